"""Step 3 of the CIS decode pipeline: compose each head's sorted, deduplicated index set.

Contract (docs/DECODE_PIPELINE.md §3), in real indices::

    [0, min(sink, t))
      ∪ clip_[lo,hi)( {p_i : p_i >= 0} ∪ (dilate ? {p_i + j : i < dil_m, p_i >= 0, |j| <= r} : ∅) )
      ∪ [win_start, t)

with ``p = sel_idx[b, h]`` (best first, ``-1`` = none), written ascending without duplicates
into ``idx[b, h, :count]`` and ``-1`` after ``count``. ``dilate`` is a Python bool (all rows)
or a ``[B, Hq]`` bool tensor (per row, e.g. the sharing heads). ``cap`` bounds every set.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernel, the
launcher :func:`compose_indices`, and the PyTorch reference :func:`compose_indices_reference`.
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["compose_indices_reference", "dilate_mask"]

DilateArg = Union[bool, torch.Tensor]


def dilate_mask(dilate: DilateArg, B: int, Hq: int, device: torch.device) -> torch.Tensor:
    """``dilate`` as a ``[B, Hq]`` bool tensor on ``device`` (a Python bool is broadcast)."""
    if isinstance(dilate, torch.Tensor):
        return dilate.to(device=device, dtype=torch.bool).expand(B, Hq)
    return torch.full((B, Hq), bool(dilate), dtype=torch.bool, device=device)


def compose_indices_reference(
    t: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    win_start: torch.Tensor,
    sel_idx: torch.Tensor,
    dilate: DilateArg,
    sink: int,
    dil_m: int,
    dil_r: int,
    cap: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`compose_indices` (vectorised, sync-free).

    Builds every candidate of every row in one fixed-shape tensor (sink range, selected,
    dilation neighbours, a ``cap``-long window range), masks the invalid ones with a sentinel,
    sorts, turns duplicates into the sentinel, sorts again and keeps the first ``cap``.

    Args:
        t, lo, hi, win_start: ``[B]`` int32 (see the module docstring).
        sel_idx: ``[B, Hq, k]`` int32 selected middle indices, best first, ``-1`` = none.
        dilate: bool or ``[B, Hq]`` bool, whether the ``±dil_r`` neighbours of the first
            ``dil_m`` selected indices are added.
        sink: number of sink tokens.
        dil_m, dil_r: dilation top-m and radius.
        cap: capacity of the output.

    Returns:
        ``(idx [B, Hq, cap] int32, count [B, Hq] int32)``.
    """
    B, Hq, K = sel_idx.shape
    dev = sel_idx.device
    big = torch.iinfo(torch.int64).max
    t_ = t.long().view(B, 1, 1)
    lo_ = lo.long().view(B, 1, 1)
    hi_ = hi.long().view(B, 1, 1)
    ws = win_start.long().clamp_min(0).view(B, 1, 1)

    def in_mid(x: torch.Tensor) -> torch.Tensor:
        return (x >= lo_) & (x < hi_)

    sel = sel_idx.long()
    parts = [torch.where((sel >= 0) & in_mid(sel), sel, big)]
    sink_r = torch.arange(int(sink), device=dev).view(1, 1, -1).expand(B, Hq, -1)
    parts.append(torch.where(sink_r < t_, sink_r, big))
    m = min(int(dil_m), K)
    if m > 0 and dil_r > 0:
        offs = torch.tensor(
            [j for j in range(-int(dil_r), int(dil_r) + 1) if j != 0], device=dev
        )
        p = sel[..., :m]
        nb = p.unsqueeze(-1) + offs  # [B, Hq, m, 2r]
        ok = (p >= 0).unsqueeze(-1) & dilate_mask(dilate, B, Hq, dev).view(B, Hq, 1, 1)
        ok = ok & (nb >= lo_.unsqueeze(-1)) & (nb < hi_.unsqueeze(-1))
        parts.append(torch.where(ok, nb, big).reshape(B, Hq, -1))
    win = ws + torch.arange(int(cap), device=dev).view(1, 1, -1)
    parts.append(torch.where(win < t_, win, big).expand(B, Hq, -1))
    cand = torch.sort(torch.cat(parts, dim=-1), dim=-1).values
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = cand[..., 1:] == cand[..., :-1]
    cand = torch.sort(torch.where(dup, big, cand), dim=-1).values
    n = cand.shape[-1]
    if n < cap:
        cand = torch.cat([cand, cand.new_full((B, Hq, int(cap) - n), big)], dim=-1)
    cand = cand[..., : int(cap)]
    keep = cand != big
    idx = torch.where(keep, cand, -1).to(torch.int32)
    return idx, keep.sum(dim=-1).to(torch.int32)
