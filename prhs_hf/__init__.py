"""prhs-hf: Pre-hoc Sparsity (PrHS) KV selection for Hugging Face Transformers.

``prhs_hf.patch(model, "configs/cpe.yaml")`` makes a LLaMA, Qwen or GLM model decode with
Clustered Index Sharing (CIS) and prune deep layers with PSAW and ETF; ``prhs_hf.unpatch(model)``
restores it. The Triton kernels live in ``prhs_hf.kernels`` (the repository folder ``kernels/``).
"""

from .config import ConfigError, PrHSConfig, load_config
from .families import SUPPORTED_FAMILIES, UnsupportedModelError
from .patching import PatchHandle, is_patched, patch, reset, telemetry, unpatch
from .stats import TelemetryReport

__all__ = [
    "ConfigError",
    "PrHSConfig",
    "load_config",
    "SUPPORTED_FAMILIES",
    "UnsupportedModelError",
    "PatchHandle",
    "patch",
    "unpatch",
    "is_patched",
    "reset",
    "telemetry",
    "TelemetryReport",
]

__version__ = "0.1.0"
