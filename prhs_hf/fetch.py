"""Deprecated alias of :mod:`prhs_hf.hub.fetch`, kept for ``from prhs_hf.fetch import load_model``.

Import ``prhs_hf.hub.fetch`` instead; this alias goes in a later release.
"""

import warnings

from .hub.fetch import *  # noqa: F403
from .hub.fetch import __all__  # noqa: F401

warnings.warn("prhs_hf.fetch moved to prhs_hf.hub.fetch", DeprecationWarning, stacklevel=2)
