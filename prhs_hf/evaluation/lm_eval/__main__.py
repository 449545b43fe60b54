"""``python -m prhs_hf.evaluation.lm_eval``: lm-eval's command line with the ``prhs`` model and the local tasks."""

from prhs_hf.evaluation.lm_eval.shim import main

raise SystemExit(main())
