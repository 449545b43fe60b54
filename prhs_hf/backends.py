"""Pick the implementation of each phase by config name and device (one function per backend)."""

from __future__ import annotations

import importlib
from typing import Callable

import torch

__all__ = ["decode_ops", "prefill_function", "triton_usable"]


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""
    import os

    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pick(name: str, device: torch.device, key: str) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if name in ("triton",) and not triton_usable(device):
        raise RuntimeError(
            f"{key}: triton was asked for, but Triton cannot run on {device} "
            "(install triton; on a CPU set TRITON_INTERPRET=1); use 'torch' or 'auto'"
        )
    return name


def decode_ops(name: str, device: torch.device):
    """The ops table (cis_match, topk_retrieval, compose_indices, sparse_decode_attention) for ``backend.decode``."""
    from .kernels import decode_ops as ops

    choice = _pick(name, device, "backend.decode")
    return ops.TRITON_OPS if choice == "triton" else ops.REFERENCE_OPS


def prefill_function(name: str, device: torch.device) -> Callable:
    """The sparse prefill attention for ``backend.prefill`` (same signature for every backend)."""
    choice = _pick(name, device, "backend.prefill")
    if choice == "flex":
        from .kernels.flex_prefill import flex_prefill_attention

        return flex_prefill_attention
    from .kernels import prefill_attention as pa

    return pa.prefill_attention if choice == "triton" else pa.prefill_attention_reference
