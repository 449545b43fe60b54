"""Pick the implementation of each phase by config name and device (one function per backend)."""

from __future__ import annotations

from typing import Callable

import torch

from .ops import decode_ops as ops
from .ops.prefill import prefill_attention as pa
from .ops.triton_support import HAS_TRITON, interpreting

__all__ = ["dense_prefill_function", "flash_usable", "pick_decode_ops", "prefill_choice", "prefill_function", "triton_usable"]


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


def flash_usable(device: torch.device) -> bool:
    """Whether the FlashAttention-4 route can run on ``device``: a CUDA sm90/sm100 GPU on which
    ``flash_attn.cute`` imports (``backend.prefill: auto`` then prefers it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    from .ops.prefill.flash_prefill import require_flash_attn

    try:
        require_flash_attn(device)
    except RuntimeError:
        return False
    return True


def _fa4_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FA4's forward takes attention in ``dtype`` with head size ``head_dim`` (fp16/bf16, 8..256 in steps of 8)."""
    from .ops.prefill.flash_prefill import check_flash_inputs

    try:
        check_flash_inputs(torch.empty(0, head_dim, dtype=dtype, device="meta"))
    except ValueError:
        return False
    return True


def prefill_choice(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``backend.prefill`` resolved for attention in ``dtype`` with head size ``head_dim`` on ``device``.

    ``auto`` is the fastest route that runs there and takes the input (docs/notes/prefill_tuning.md):
    ``flash`` on an sm90/sm100 GPU with FA4 installed for fp16/bf16, else ``triton`` on CUDA, else
    ``torch``."""
    if name == "auto" and flash_usable(device) and _fa4_takes(dtype, head_dim):
        return "flash"
    return _pick(name, device, "backend.prefill")


def prefill_function(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable:
    """The sparse (PSAW/ETF) prefill attention for ``backend.prefill`` and attention in ``dtype`` with
    head size ``head_dim`` on ``device`` (:func:`prefill_choice`). Every backend has the signature
    ``(q, k, v, plan, scale)`` with a :class:`~prhs_hf.ops.prefill.prefill_plan.PrefillPlan`.

    ``flash`` (FlashAttention-4) raises here, naming the key and the install, unless
    ``flash_attn.cute`` imports and ``device`` is an sm90/sm100 GPU (the input checks follow at the call).
    """
    choice = prefill_choice(name, device, dtype, head_dim)
    if choice == "flex":
        from .ops.prefill.flex_prefill import flex_prefill_attention

        return flex_prefill_attention
    if choice == "flash":
        from .ops.prefill.flash_prefill import flash_prefill_attention, require_flash_attn

        require_flash_attn(device)
        return flash_prefill_attention
    return pa.prefill_attention if choice == "triton" else pa.prefill_attention_reference


def dense_prefill_function(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable | None:
    """The dense causal prefill of layers without a PSAW/ETF plan (the layers below a sparse config's
    start layer, or every layer of a CIS-only config), or None: the model's own attention (SDPA).
    Signature ``(q, k, v, pad, q_start, scale, *, no_mask)``.

    Only FA4 is faster than SDPA on the dense causal pattern; our Triton tile kernel is slower than
    SDPA there (docs/notes/prefill_tuning.md). So ``flash``, and ``auto`` where it resolves to FA4
    (:func:`prefill_choice`), give :func:`~prhs_hf.ops.prefill.flash_prefill.flash_dense_prefill_attention`
    (``flash`` raises like :func:`prefill_function` where FA4 cannot run); every other choice None.
    A config that changes nothing (``configs/dense.yaml``) never gets here: it keeps the unpatched path.
    """
    if prefill_choice(name, device, dtype, head_dim) != "flash":
        return None
    from .ops.prefill.flash_prefill import flash_dense_prefill_attention, require_flash_attn

    require_flash_attn(device)
    return flash_dense_prefill_attention
