"""The accuracy table without lm-eval: the direct runner and what only it and
``scripts/run_accuracy.py`` use.

- :mod:`.direct`: GSM8K and CoQA prompts in left-padded batches, greedy generation and scoring
  (for machines without lm-eval or ``datasets``, such as the GPU machine);
- :mod:`.configs`: the named PrHS configurations of the table (``dense``, ``cis-s16``, ``cpe``,
  ``hshare-2``, …);
- :mod:`.report`: the table's rows and its JSON + Markdown files.

The prompts and the scoring are the lm-eval tasks' own (:mod:`prhs_hf.evaluation.lm_eval.prompts`,
:mod:`prhs_hf.evaluation.lm_eval.metrics`, :mod:`prhs_hf.evaluation.lm_eval.data`: pure Python, no lm-eval), so both
engines of ``scripts/run_accuracy.py`` score alike. Nothing here imports lm-eval.
"""
