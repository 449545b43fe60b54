"""Pick the implementation of each phase by config name and device (one function per backend)."""

from __future__ import annotations

from typing import Callable

import torch

from .kernels import decode_ops as ops
from .kernels import prefill_attention as pa
from .kernels._common import HAS_TRITON, interpreting

__all__ = ["dense_prefill_function", "pick_decode_ops", "prefill_function", "triton_usable"]


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
    """The sparse prefill attention for ``backend.prefill`` (same signature for every backend).

    ``flash`` (FlashAttention-4, opt-in: ``auto`` does not pick it) raises here, naming the key and
    the install, unless ``flash_attn.cute`` imports and ``device`` is an sm90/sm100 GPU.
    """
    choice = _pick(name, device, "backend.prefill")
    if choice == "flex":
        from .kernels.flex_prefill import flex_prefill_attention

        return flex_prefill_attention
    if choice == "flash":
        from .kernels.flash_prefill import flash_prefill_attention, require_flash_attn

        require_flash_attn(device)
        return flash_prefill_attention
    return pa.prefill_attention if choice == "triton" else pa.prefill_attention_reference


def dense_prefill_function(name: str, device: torch.device) -> Callable | None:
    """The dense causal prefill of layers without a PSAW/ETF plan for ``backend.prefill``, or None
    (dense SDPA). Only ``flash`` has one (:func:`~prhs_hf.kernels.flash_prefill.flash_dense_prefill_attention`:
    ``(q, k, v, pad, q_start, scale, *, no_mask)``); it raises like :func:`prefill_function` where FA4 cannot run."""
    if name != "flash":
        return None
    from .kernels.flash_prefill import flash_dense_prefill_attention, require_flash_attn

    require_flash_attn(device)
    return flash_dense_prefill_attention
