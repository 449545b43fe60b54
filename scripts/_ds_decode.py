"""Double Sparsity's decode step (the paper's "DS" baseline) from the CIS kernels: no new kernel.

The operator benchmark's (scripts/bench_decode_attention.py) and its test's (tests/test_ds_step.py):
the library's Double Sparsity baseline is ``prhs_hf.selectors.double_sparsity``.

Double Sparsity (Yang et al., 2024, arXiv:2408.07092) scores every row at every step (nothing is
shared between steps or heads) with the ``r`` *label channels* of each head, from a *label cache*
``[B, Hc, S, r]`` kept beside the KV cache (the label channels of every cached key), and attends
to the exact top-k of those approximate scores. One step, in real indices::

    q_label[b, h] = q[b, h, channels[h]]                                     (a gather)
    sel[b, h]     = top-k over j in [lo, hi) of scale * q_label[b, h] . label[b, c(h), pad + j]
    idx[b, h]     = [0, min(sink, t)) ∪ sel[b, h] ∪ [win_start, t)          (sorted, unique)
    out[b, h]     = softmax attention of q[b, h] over K/V[b, kvh(h), pad + idx[b, h]]

:func:`ds_decode_step` chains the existing launchers of a :class:`~prhs_hf.ops.decode_ops.DecodeOps`:
``topk_retrieval`` on ``q_label`` and the label cache with every active row flagged (label
scoring + exact select), ``compose_indices`` without dilation, ``sparse_decode_attention``: the
same attention kernel and index layout as a CIS step. :func:`ds_decode_step_reference` is the
same step in plain PyTorch (dense label scores, ``torch.topk``, a masked softmax over the cache),
written independently of the launchers' references so that a test can compare the two.

Label heads ``Hc``: ``Hkv`` (DS's own layout, one set of channels per KV head, shared by the
group's query heads; what the operator benchmark times) or ``Hq`` (one per query head, as
``prhs_hf.selectors.double_sparsity`` keeps it). ``q_channels [Hq, r]`` holds each query head's
channels (under ``Hc = Hkv`` the group's rows are equal); build the label cache with
``prhs_hf.selectors.double_sparsity.label_keys``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prhs_hf.ops.decode_ops import TRITON_OPS, DecodeOps
from prhs_hf.ops.triton_support import gqa_group

__all__ = ["DSStepResult", "ds_query_labels", "ds_decode_step", "ds_decode_step_reference"]


class DSStepResult(NamedTuple):
    """Outputs of :func:`ds_decode_step`."""

    sel: torch.Tensor  # [B, Hq, k] int32 top-k of the label scores, best first, -1 padded
    idx: torch.Tensor  # [B, Hq, cap] int32 composed index lists (sink ∪ top-k ∪ local, ascending)
    count: torch.Tensor  # [B, Hq] int32
    out: torch.Tensor  # [B, Hq, D] attention output


def ds_query_labels(q: torch.Tensor, q_channels: torch.Tensor) -> torch.Tensor:
    """``[B, Hq, r]``: each query head's label channels of ``q [B, Hq, D]`` (``q_channels [Hq, r]`` int64)."""
    B, Hq, _ = q.shape
    if q_channels.dim() != 2 or q_channels.shape[0] != Hq:
        raise ValueError(f"q_channels: expected [Hq={Hq}, r], got shape {tuple(q_channels.shape)}")
    return q.gather(-1, q_channels.expand(B, Hq, q_channels.shape[1]))


def ds_decode_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, label_cache: torch.Tensor,
                   q_channels: torch.Tensor, pad: torch.Tensor, t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   win_start: torch.Tensor, active: torch.Tensor, *, sink: int, k: int, cap: int, scale: float,
                   ops: DecodeOps = TRITON_OPS) -> DSStepResult:
    """One Double Sparsity decode step through ``ops`` (default the Triton launchers; no host sync).

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k_cache, v_cache: ``[B, Hkv, S, D]``.
        label_cache: ``[B, Hc, S, r]`` label channels of every cached key (``Hc`` = Hkv or Hq), same
            slots as ``k_cache``.
        q_channels: ``[Hq, r]`` int64, query head ``h``'s channels (those of label head ``h // (Hq/Hc)``).
        pad, t, lo, hi, win_start: ``[B]`` int32, as in ``compose_indices`` (middle region
            ``[lo, hi)``, window ``[win_start, t)``).
        active: ``[B]`` bool, rows that select (an inactive row keeps only its sink and window).
        sink: sink tokens; k: top-k tokens of the middle region; cap: capacity of an index list
            (at least ``sink + k + local``).
        scale: the attention softmax scale (also scales the label scores: the ranking is the same).
        ops: :data:`~.decode_ops.TRITON_OPS` or :data:`~.decode_ops.REFERENCE_OPS`.
    """
    B, Hq, _ = q.shape
    gqa_group(Hq, label_cache.shape[1])  # Hc must divide Hq
    q_label = ds_query_labels(q, q_channels)
    rows = active.view(B, 1).expand(B, Hq)
    sel = ops.topk_retrieval(q_label, label_cache, pad, lo, hi, rows, k, scale)
    idx, count = ops.compose_indices(t, lo, hi, win_start, sel, False, sink, 0, 0, cap)
    out = ops.sparse_decode_attention(q, k_cache, v_cache, pad, idx, count, scale)
    return DSStepResult(sel, idx, count, out)


def ds_decode_step_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, label_cache: torch.Tensor,
                             q_channels: torch.Tensor, pad: torch.Tensor, t: torch.Tensor, lo: torch.Tensor,
                             hi: torch.Tensor, win_start: torch.Tensor, active: torch.Tensor, *, sink: int, k: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The DS step in plain PyTorch, dense over the cache: ``(member [B, Hq, S] bool, out [B, Hq, D] fp32)``.

    ``member[b, h, p]``: cache slot ``p`` is attended (sink ∪ top-k label scores of the middle
    region ∪ window, for an active row; sink ∪ window otherwise). Arguments as :func:`ds_decode_step`.
    """
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    Hc = label_cache.shape[1]
    qf = q.float()
    approx = scale * torch.einsum(
        "bhr,bhsr->bhs", ds_query_labels(qf, q_channels), label_cache.float().repeat_interleave(Hq // Hc, dim=1)
    )
    real = (torch.arange(S, device=q.device)[None] - pad.long()[:, None])[:, None]  # [B, 1, S]
    b_ = lambda x: x.long().view(B, 1, 1)  # noqa: E731
    middle = (real >= b_(lo)) & (real < b_(hi)) & (real >= 0) & active.view(B, 1, 1)
    approx = torch.where(middle, approx, float("-inf"))
    top = torch.topk(approx, min(int(k), S), dim=-1)
    member = torch.zeros(B, Hq, S, dtype=torch.bool, device=q.device)
    member.scatter_(-1, top.indices, top.values > float("-inf"))
    member |= (real >= 0) & (real < torch.clamp(b_(t), max=int(sink)))
    member |= (real >= b_(win_start)) & (real < b_(t))
    kf = k_cache.float().repeat_interleave(Hq // Hkv, dim=1)
    vf = v_cache.float().repeat_interleave(Hq // Hkv, dim=1)
    logits = torch.where(member, scale * torch.einsum("bhd,bhsd->bhs", qf, kf), float("-inf"))
    out = torch.einsum("bhs,bhsd->bhd", torch.softmax(logits, dim=-1), vf)
    return member, out
