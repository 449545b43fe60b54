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

from ._common import next_pow2, require_triton, tl, triton

__all__ = ["compose_indices", "compose_indices_reference", "dilate_mask"]

# Kernel design: the sink range [0, s_end) and the window [w0, t) (w0 = max(win_start, s_end))
# are contiguous and disjoint, so only the middle candidates (the selected indices and their
# dilation neighbours, at most k + 2*r*m of them) are sorted, in registers (tl.sort), with
# everything outside [lo, hi) or inside the sink/window ranges masked away. Duplicates are
# dropped by comparing each sorted value with its predecessor (an associative scan), and each
# value's output slot is computed in closed form:
#   sink j        -> j
#   middle v      -> s_end + rank(v) + (v >= w0 ? |window| : 0)
#   window w0 + i -> s_end + #(middle values < w0) + i
# so the sorted, unique result is written with plain stores, -1 after count.


@triton.jit
def _last_two(last_a, prev_a, last_b, prev_b):
    """Scan combine: (last, previous) element of a concatenation (prev -2^31 = none yet)."""
    return last_b, tl.where(prev_b == -2147483648, last_a, prev_b)


@triton.jit
def _compose_kernel(
    T, LO, HI, WS, SEL, DIL, IDX, CNT,
    stride_sb, stride_sh, stride_db, stride_dh,
    K, SINK, M, R, CAP,
    H: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (batch, query head) row: its sorted, deduplicated index set."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    t = tl.load(T + b)
    lo = tl.load(LO + b)
    hi = tl.load(HI + b)
    s_end = tl.maximum(tl.minimum(t, SINK), 0)
    w0 = tl.maximum(tl.load(WS + b), s_end)
    wlen = tl.maximum(t - w0, 0)
    dil = tl.load(DIL + b * stride_db + h * stride_dh).to(tl.int32)

    # Middle candidates: i < K the selected index i; then 2R neighbours of each of the first M.
    i = tl.arange(0, NC)
    is_sel = i < K
    nb = i - K
    src = tl.where(is_sel, i, nb // (2 * R))
    o = nb % (2 * R)
    off = tl.where(is_sel, 0, tl.where(o < R, o - R, o - R + 1))
    in_set = is_sel | ((nb < 2 * R * M) & (dil != 0))
    p = tl.load(SEL + b * stride_sb + h * stride_sh + src, mask=in_set, other=-1)
    v = p + off
    ok = in_set & (p >= 0) & (v >= lo) & (v < hi) & (v >= s_end) & ((v < w0) | (v >= t))
    v = tl.sort(tl.where(ok, v, 2147483647))
    _, prev = tl.associative_scan((v, tl.full([NC], -2147483648, tl.int32)), 0, _last_two)
    keep = ((v != 2147483647) & (v != prev)).to(tl.int32)
    rank = tl.cumsum(keep, axis=0) - keep
    n_mid = tl.sum(keep, axis=0)
    n_below = tl.sum(tl.where(v < w0, keep, 0), axis=0)
    out = IDX + pid * CAP
    pos = s_end + rank + tl.where(v >= w0, wlen, 0)
    tl.store(out + pos, v, mask=(keep != 0) & (pos < CAP))

    offs = tl.arange(0, BLOCK)
    for j0 in range(0, s_end, BLOCK):
        j = j0 + offs
        tl.store(out + j, j, mask=(j < s_end) & (j < CAP))
    base = s_end + n_below
    for j0 in range(0, wlen, BLOCK):
        j = j0 + offs
        tl.store(out + base + j, w0 + j, mask=(j < wlen) & (base + j < CAP))
    count = tl.minimum(s_end + n_mid + wlen, CAP)
    for j0 in range(count, CAP, BLOCK):
        j = j0 + offs
        tl.store(out + j, tl.full([BLOCK], -1, tl.int32), mask=j < CAP)
    tl.store(CNT + pid, count)


def compose_indices(
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
    """Triton index composition: one launch, one program per (batch, query head), no sync.

    The middle candidates (``k + 2*dil_r*min(dil_m, k)`` of them) are sorted in registers.
    Args and result as :func:`compose_indices_reference`.
    """
    require_triton(sel_idx)
    B, H, K = sel_idx.shape
    dev = sel_idx.device
    cap = int(cap)
    idx = torch.empty((B, H, cap), dtype=torch.int32, device=dev)
    cnt = torch.empty((B, H), dtype=torch.int32, device=dev)
    if B * H == 0:
        return idx, cnt
    if cap == 0:
        return idx, cnt.zero_()
    if sel_idx.stride(-1) != 1:
        sel_idx = sel_idx.contiguous()
    r = int(dil_r)
    m = min(int(dil_m), K) if r > 0 else 0
    dil = dilate_mask(dilate, B, H, dev)
    nc = next_pow2(K + 2 * r * m, 16)
    _compose_kernel[(B * H,)](
        t, lo, hi, win_start, sel_idx, dil, idx, cnt,
        sel_idx.stride(0), sel_idx.stride(1), dil.stride(0), dil.stride(1),
        K, int(sink), m, max(r, 1), cap,
        H=H, NC=nc,
        BLOCK=min(1024, next_pow2(cap, 16)),
        num_warps=4 if nc <= 1024 else (8 if nc <= 4096 else 16),
    )
    return idx, cnt

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
        r = int(dil_r)
        offs = torch.arange(-r, r, device=dev)
        offs = offs + (offs >= 0).long()  # -r..-1, 1..r (no host-to-device copy)
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
