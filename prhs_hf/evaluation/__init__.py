"""Measurements of a patched model that users run themselves: :mod:`prhs_hf.evaluation.speed_map`
(``prhs-hf bench``, decode speed over a batch × length grid against the fastest dense baseline) and
:mod:`prhs_hf.evaluation.compare` (dense against PrHS on one prompt: ``prhs-hf generate`` and the
README's first quick start).

Importing this package loads neither torch nor transformers; the modules import them when they run.
"""
