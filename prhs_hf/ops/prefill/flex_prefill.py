"""FlexAttention backend of the sparse prefill: a ``BlockMask`` from the SPEC §3 predicate.

The block-sparse reference backend that :func:`prefill_attention.prefill_attention` has to beat.
Same contract and signature (``q, k, v, plan, scale``; see ``prefill_attention.py``); the predicate
is the shared :func:`prefill_plan.prefill_visibility`, read through a FlexAttention ``mask_mod``.

On CUDA both the mask construction and the attention are compiled (``torch.compile``), which is
what makes FlexAttention block-sparse; on the CPU they run eagerly (torch 2.13 supports that,
but the eager attention materialises the full score matrix: small shapes only). Rows that see
no key (ETF-frozen, padding) come out as zeros, which is FlexAttention's rule for fully masked
rows.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .prefill_plan import PrefillPlan, prefill_visibility

__all__ = ["prefill_mask_mod", "build_prefill_block_mask", "flex_attention_with_mask", "flex_prefill_attention"]

_compiled_flex: Callable | None = None


def prefill_mask_mod(plan: PrefillPlan) -> Callable:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for the predicate of ``plan``.

    ``q_idx`` is the query row, ``kv_idx`` the K/V slot; real indices are
    ``q_start[b] + q_idx`` and ``kv_idx - pad[b]``. ``q_idx`` is clamped before indexing
    ``win_lo``, because compiled FlexAttention may evaluate the mask past the last row.
    """
    pad, q_start, win_lo, sink, frozen_lo, frozen_hi = (
        plan.pad, plan.q_start, plan.win_lo, plan.sink, plan.frozen_lo, plan.frozen_hi
    )
    last_row = win_lo.shape[1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        i = q_start[b] + q_idx
        j = kv_idx - pad[b]
        win = win_lo[b, torch.clamp(q_idx, 0, last_row)]
        return prefill_visibility(i, j, win, sink, frozen_lo[b], frozen_hi[b])

    return mask_mod


def build_prefill_block_mask(
    plan: PrefillPlan, kv_len: int, *, block_size: int = 128, compile: bool | None = None
) -> BlockMask:
    """The ``BlockMask`` ``[B, 1, Lq, kv_len]`` (shared by all heads) of the predicate of ``plan``.

    ``compile`` (default: on CUDA) builds the mask with ``torch.compile`` so that no dense
    ``Lq x kv_len`` mask is materialised.
    """
    dev = plan.win_lo.device
    B, q_len = plan.win_lo.shape
    mask_mod = prefill_mask_mod(plan.on(dev))
    if compile is None:
        compile = dev.type == "cuda"
    return create_block_mask(mask_mod, B, None, q_len, kv_len, device=dev, BLOCK_SIZE=block_size, _compile=compile)


def flex_attention_with_mask(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float, *, compile: bool | None = None
) -> torch.Tensor:
    """FlexAttention of ``q [B, Hq, Lq, D]`` over ``k``/``v`` ``[B, Hkv, Lk, D]`` → ``[B, Lq, Hq, D]`` contiguous.

    ``compile`` (default: on CUDA) uses one process-wide ``torch.compile(flex_attention)``.
    """
    global _compiled_flex
    if compile is None:
        compile = q.is_cuda
    fn = flex_attention
    if compile:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    with warnings.catch_warnings():
        # eager on purpose (CPU): silence the "called without torch.compile()" advice
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        out = fn(q, k, v, block_mask=block_mask, scale=float(scale), enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def flex_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PrefillPlan, scale: float) -> torch.Tensor:
    """Sparse PSAW/ETF prefill attention through FlexAttention (builds the mask, then attends)."""
    plan.check(q, k, v)
    block_mask = build_prefill_block_mask(plan, k.shape[2])
    return flex_attention_with_mask(q, k, v, block_mask, scale)
