"""Pick the implementation of each phase by config name and device (one function per backend)."""

from __future__ import annotations

from typing import Callable

import torch

from .kernels import decode_ops as ops
from .kernels import prefill_attention as pa
from .kernels._common import HAS_TRITON, interpreting

__all__ = ["pick_decode_ops", "prefill_function", "triton_usable"]


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on the CPU under ``TRITON_INTERPRET=1``."""
    return HAS_TRITON and (device.type == "cuda" or interpreting())


def _pick(name: str, device: torch.device, key: str) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if name in ("triton",) and not triton_usable(device):
        raise RuntimeError(
            f"{key}: triton was asked for, but Triton cannot run on {device} "
            "(install triton; on a CPU set TRITON_INTERPRET=1); use 'torch' or 'auto'"
        )
    return name


def pick_decode_ops(name: str, device: torch.device) -> ops.DecodeOps:
    """The ops table (cis_match, topk_retrieval, compose_indices, sparse_decode_attention) for ``backend.decode``."""
    choice = _pick(name, device, "backend.decode")
    return ops.TRITON_OPS if choice == "triton" else ops.REFERENCE_OPS


def prefill_function(name: str, device: torch.device) -> Callable:
    """The sparse prefill attention for ``backend.prefill`` (same signature for every backend)."""
    choice = _pick(name, device, "backend.prefill")
    if choice == "flex":
        from .kernels.flex_prefill import flex_prefill_attention

        return flex_prefill_attention
    return pa.prefill_attention if choice == "triton" else pa.prefill_attention_reference
