"""prhs-hf: Pre-hoc Sparsity (PrHS) KV selection for Hugging Face Transformers.

``prhs_hf.patch(model, "cpe")`` makes a LLaMA, Qwen or GLM model decode with Clustered Index
Sharing (CIS) and prune deep layers with PSAW and ETF; ``prhs_hf.unpatch(model)`` restores it.
The Triton kernels live in ``prhs_hf.ops`` (one folder per op).

The public names below are imported on first use, so that ``import prhs_hf`` (and the
``prhs-hf`` command line, which imports :mod:`prhs_hf.hub.fetch` through it) does not load torch or
transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs; at run time see __getattr__
    from .config import ConfigError, PrHSConfig, load_config
    from .families import SUPPORTED_FAMILIES, UnsupportedModelError
    from .patching import PatchHandle, is_patched, patch, reset, telemetry, unpatch
    from .telemetry_counters import TelemetryReport

_LAZY: dict[str, str] = {
    "ConfigError": "config",
    "PrHSConfig": "config",
    "load_config": "config",
    "SUPPORTED_FAMILIES": "families",
    "UnsupportedModelError": "families",
    "PatchHandle": "patching",
    "patch": "patching",
    "unpatch": "patching",
    "is_patched": "patching",
    "reset": "patching",
    "telemetry": "patching",
    "TelemetryReport": "telemetry_counters",
}

__all__ = list(_LAZY)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import the submodule that defines the public name ``name`` on first access."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prhs_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
