"""``python -m prhs_hf``: the same command line as ``prhs-hf``."""

from prhs_hf.cli import main

raise SystemExit(main())
