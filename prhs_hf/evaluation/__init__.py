"""Measurements of a patched model that users run themselves: :mod:`prhs_hf.evaluation.speed_map`
(``prhs-hf bench``, decode speed over a batch × length grid against the fastest dense baseline).

Importing this package loads neither torch nor transformers; the modules import them when they run.
"""
