"""Pick the implementation of each phase by config name and device (one function per backend)."""

from __future__ import annotations

from typing import Callable

import torch

from .kernels import decode_ops as ops
from .kernels import prefill_attention as pa
from .kernels._common import HAS_TRITON, interpreting

__all__ = ["dense_prefill_function", "flash_usable", "pick_decode_ops", "prefill_function", "triton_usable"]


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
    from .kernels.flash_prefill import require_flash_attn

    try:
        require_flash_attn(device)
    except RuntimeError:
        return False
    return True


def _fa4_takes(q: torch.Tensor) -> bool:
    """Whether FA4's forward takes ``q``'s dtype and head size (fp16/bf16, head size 8..256 in steps of 8)."""
    from .kernels.flash_prefill import check_flash_inputs

    try:
        check_flash_inputs(q)
    except ValueError:
        return False
    return True


def _prefill_choice(name: str, device: torch.device) -> str:
    """``backend.prefill`` resolved for ``device``. ``auto`` is the fastest measured route that can run
    there (docs/results/probe_flash_attn4.md, H200, 4k-32k, dense and PSAW/ETF patterns: FA4 fastest,
    then our Triton kernel, then FlexAttention, then SDPA): ``flash`` on an sm90/sm100 GPU with FA4
    installed, else ``triton`` on CUDA, else ``torch``."""
    if name == "auto" and flash_usable(device):
        return "flash"
    return _pick(name, device, "backend.prefill")


def _by_input(flash_fn: Callable, triton_fn: Callable) -> Callable:
    """``auto``'s route: ``flash_fn`` for the inputs FA4 takes, else ``triton_fn`` (an fp32 model, an
    odd head size), both exact to the same contract; same signature as the two."""

    def attention(q, *args, **kwargs):
        return (flash_fn if _fa4_takes(q) else triton_fn)(q, *args, **kwargs)

    return attention


def prefill_function(name: str, device: torch.device) -> Callable:
    """The sparse prefill attention for ``backend.prefill`` (same signature for every backend).

    ``flash`` (FlashAttention-4) raises here, naming the key and the install, unless
    ``flash_attn.cute`` imports and ``device`` is an sm90/sm100 GPU; ``auto`` takes FA4 where it
    can run and takes the input (:func:`_prefill_choice`), else the Triton kernel on CUDA.
    """
    choice = _prefill_choice(name, device)
    if choice == "flex":
        from .kernels.flex_prefill import flex_prefill_attention

        return flex_prefill_attention
    if choice == "flash":
        from .kernels.flash_prefill import flash_prefill_attention, require_flash_attn

        require_flash_attn(device)
        return flash_prefill_attention if name == "flash" else _by_input(flash_prefill_attention, pa.prefill_attention)
    return pa.prefill_attention if choice == "triton" else pa.prefill_attention_reference


def dense_prefill_function(name: str, device: torch.device) -> Callable | None:
    """The dense causal prefill of layers without a PSAW/ETF plan (the layers below a sparse config's
    start layer, or every layer of a CIS-only config) for ``backend.prefill``, or None (the model's
    own attention, SDPA). Signature ``(q, k, v, pad, q_start, scale, *, no_mask)``.

    ``flash``: FA4 (:func:`~prhs_hf.kernels.flash_prefill.flash_dense_prefill_attention`; it raises
    like :func:`prefill_function` where FA4 cannot run); ``triton``: our tile kernel with the dense
    pattern (:func:`~prhs_hf.kernels.prefill_attention.dense_prefill_attention`); ``auto``: the
    fastest of the two that runs (:func:`_prefill_choice`); ``torch`` and ``flex``: None. A config
    that changes nothing (``configs/dense.yaml``) never gets here: it keeps the unpatched path.
    """
    choice = _prefill_choice(name, device)
    if choice == "triton":
        return pa.dense_prefill_attention
    if choice != "flash":
        return None
    from .kernels.flash_prefill import flash_dense_prefill_attention, require_flash_attn

    require_flash_attn(device)
    if name == "flash":
        return flash_dense_prefill_attention
    return _by_input(flash_dense_prefill_attention, pa.dense_prefill_attention)
