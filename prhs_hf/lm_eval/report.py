"""Moved to :mod:`prhs_hf.accuracy.report` (the direct accuracy runner is not part of the lm-eval
integration). This name stays an alias of that module until the last importers follow
(``from prhs_hf.accuracy import report``); do not add code here."""

import sys

from prhs_hf.accuracy import report as _moved

sys.modules[__name__] = _moved
