"""Step 3 of the CIS decode pipeline: compose each head's sorted, deduplicated index set.

Contract (docs/DECODE_PIPELINE.md §3), in real indices::

    [0, min(sink, t))
      ∪ clip_[lo,hi)( {p_i : p_i >= 0} ∪ (dilate ? {p_i + j : i < dil_m, p_i >= 0, |j| <= r} : ∅) )
      ∪ [win_start, t)

with ``p = sel_idx[b, h]`` (best first, ``-1`` = none), written ascending without duplicates
into ``idx[b, h, :count]`` and ``-1`` after ``count``. ``dilate`` is a Python bool (all rows)
or a ``[B, Hq]`` bool tensor (per row, e.g. the sharing heads). ``cap`` bounds every set.

The model path composes from the anchors' dilated sets instead (§3b: :func:`compose_from_sets`,
and :func:`dilate_and_compose`, which builds the retrieving rows' sets in the same launch); the
dilated set itself (§3a: its encoding, :func:`~.dilated_set.dilated_set` and its map path) lives
in ``dilated_set.py``, whose public names this module re-exports.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launchers :func:`compose_indices` and the others, and their PyTorch references (``*_reference``).
"""

from __future__ import annotations

import torch

from ..triton_support import NORM_EPS, next_pow2, program_bh, require_triton, tl, triton
from .dilated_set import (
    SET_NONE,
    DilateArg,
    _auto_takes_map,
    _dilated_candidates,
    _last_two,
    _sorted_dilated_set,
    _store_set,
    dilate_mask,
    dilated_set,
    dilated_set_reference,
    dilated_set_size,
)
from .record_anchors import _record_row, check_record, record_anchors, record_anchors_reference, record_launch_args

__all__ = [
    "compose_indices",
    "compose_indices_reference",
    "compose_from_sets",
    "compose_from_sets_reference",
    "dilate_and_compose",
    "dilate_and_compose_reference",
    "dilate_compose_and_record",
    "dilate_compose_and_record_reference",
    # re-exported from dilated_set.py, their home
    "dilate_mask",
    "dilated_set",
    "dilated_set_reference",
    "dilated_set_size",
    "SET_NONE",
]

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
def _step_regions(T, LO, HI, WS, b, SINK):
    """Sequence ``b``'s regions of the step: ``(t, lo, hi, s_end, w0, wlen)``: the keys ``t`` it sees,
    the middle ``[lo, hi)``, the sinks ``[0, s_end)`` and the window ``[w0, w0 + wlen)``."""
    t = tl.load(T + b)
    lo = tl.load(LO + b)
    hi = tl.load(HI + b)
    s_end = tl.maximum(tl.minimum(t, SINK), 0)
    w0 = tl.maximum(tl.load(WS + b), s_end)
    wlen = tl.maximum(t - w0, 0)
    return t, lo, hi, s_end, w0, wlen


@triton.jit
def _write_composed(out, cnt_ptr, v, keep, rank, n_mid, n_below, s_end, w0, wlen, CAP, BLOCK: tl.constexpr):
    """Write a row's composed list to ``out``: the kept middle values ``v`` (ascending, ``rank``
    among them) at their closed-form slots, the sinks ``[0, s_end)``, the window ``[w0, w0 + wlen)``,
    ``-1`` after the count; the count to ``cnt_ptr``."""
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
    tl.store(cnt_ptr, count)


@triton.jit
def _compose_from_set(T, LO, HI, WS, b, SINK, x, out, cnt_ptr, CAP, BLOCK: tl.constexpr):
    """Compose a row from its middle candidates ``x`` (set entries ``(v << 1) | flag`` ascending in
    ``v``, each index once, SET_NONE anywhere): those in the middle and outside sink and window."""
    t, lo, hi, s_end, w0, wlen = _step_regions(T, LO, HI, WS, b, SINK)
    v = x >> 1
    ok = (x != 2147483647) & (v >= lo) & (v < hi) & (v >= s_end) & ((v < w0) | (v >= t))
    keep = ok.to(tl.int32)
    rank = tl.cumsum(keep, axis=0) - keep
    n_mid = tl.sum(keep, axis=0)
    n_below = tl.sum(tl.where(v < w0, keep, 0), axis=0)
    _write_composed(out, cnt_ptr, v, keep, rank, n_mid, n_below, s_end, w0, wlen, CAP, BLOCK)


@triton.jit
def _compose_kernel(
    T, LO, HI, WS, SEL, DIL, IDX, CNT,
    stride_sb, stride_sh, stride_db, stride_dh,
    K, SINK, M, R, CAP,
    H: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (batch, query head) row: its sorted, deduplicated index set."""
    pid, b, h = program_bh(H)
    t, lo, hi, s_end, w0, wlen = _step_regions(T, LO, HI, WS, b, SINK)
    dil = tl.load(DIL + b * stride_db + h * stride_dh).to(tl.int32)

    # Middle candidates: i < K the selected index i; then, where the row dilates, 2R neighbours of
    # each of the first M.
    i = tl.arange(0, NC)
    p, off, is_sel, ok = _dilated_candidates(SEL + b * stride_sb + h * stride_sh, i, K, tl.where(dil != 0, M, 0), R)
    v = p + off
    ok = ok & (v >= lo) & (v < hi) & (v >= s_end) & ((v < w0) | (v >= t))
    v = tl.sort(tl.where(ok, v, 2147483647))
    _, prev = tl.associative_scan((v, tl.full([NC], -2147483648, tl.int32)), 0, _last_two)
    keep = ((v != 2147483647) & (v != prev)).to(tl.int32)
    rank = tl.cumsum(keep, axis=0) - keep
    n_mid = tl.sum(keep, axis=0)
    n_below = tl.sum(tl.where(v < w0, keep, 0), axis=0)
    _write_composed(IDX + pid * CAP, CNT + pid, v, keep, rank, n_mid, n_below, s_end, w0, wlen, CAP, BLOCK)


def _composition(B: int, H: int, cap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(idx [B, H, cap], count [B, H])`` int32 for a composition launch to write, and whether there
    is nothing to launch (no rows, or ``cap = 0``: every count 0)."""
    idx = torch.empty((B, H, cap), dtype=torch.int32, device=device)
    cnt = torch.empty((B, H), dtype=torch.int32, device=device)
    if cap == 0:
        cnt.zero_()
    return idx, cnt, B * H == 0 or cap == 0


def compose_indices(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor,
                    sel_idx: torch.Tensor, dilate: DilateArg, sink: int, dil_m: int, dil_r: int,
                    cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton index composition: one launch, one program per (batch, query head), no sync.

    The middle candidates (``k + 2*dil_r*min(dil_m, k)`` of them) are sorted in registers.
    Args and result as :func:`compose_indices_reference`.
    """
    require_triton(sel_idx)
    B, H, K = sel_idx.shape
    dev = sel_idx.device
    cap = int(cap)
    idx, cnt, nothing = _composition(B, H, cap, dev)
    if nothing:
        return idx, cnt
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


# ----------------------------------------------------------------------------- from dilated sets (§3b)
#
# Each step composes every row from a dilated set (dilated_set.py) with a filter + prefix sum, no
# sort: a sharing row from its anchor's set, a retrieving row from the entries of its own new set
# that are not only neighbours; the gather / where glue that picked each row's selection is done
# inside the kernel.


@triton.jit
def _compose_sets_kernel(
    T, LO, HI, WS, BEST, ASET, NSETP, IDX, CNT,
    stride_bb, stride_bh, stride_ab, stride_ah, stride_as, stride_nb, stride_nh,
    NSET, SINK, CAP,
    H: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: filter its (sorted, unique) set, prefix-sum the output slots."""
    pid, b, h = program_bh(H)
    best = tl.load(BEST + b * stride_bb + h * stride_bh)
    i = tl.arange(0, NC)
    im = i < NSET
    xa = tl.load(ASET + b.to(tl.int64) * stride_ab + h * stride_ah + tl.maximum(best, 0) * stride_as + i,
                 mask=im & (best >= 0), other=2147483647)
    xn = tl.load(NSETP + b.to(tl.int64) * stride_nb + h * stride_nh + i,
                 mask=im & (best == -1), other=2147483647)
    # a retrieving row attends to its own top-k: the neighbours of its set are for its sharers
    x = tl.where(best >= 0, xa, tl.where((xn & 1) == 0, xn, 2147483647))
    _compose_from_set(T, LO, HI, WS, b, SINK, x, IDX + pid.to(tl.int64) * CAP, CNT + pid, CAP, BLOCK)


def compose_from_sets(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor,
                      best: torch.Tensor, anchor_sets: torch.Tensor, new_set: torch.Tensor, sink: int,
                      cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton composition from dilated sets: one launch, no sort, no glue.

    Args and result as :func:`compose_from_sets_reference`.
    """
    require_triton(best, anchor_sets, new_set)
    B, H, s, nset = anchor_sets.shape
    cap = int(cap)
    idx, cnt, nothing = _composition(B, H, cap, best.device)
    if nothing:
        return idx, cnt
    if anchor_sets.stride(-1) != 1:
        anchor_sets = anchor_sets.contiguous()
    if new_set.stride(-1) != 1:
        new_set = new_set.contiguous()
    nc = next_pow2(max(nset, 1), 16)
    _compose_sets_kernel[(B * H,)](
        t, lo, hi, win_start, best, anchor_sets, new_set, idx, cnt,
        best.stride(0), best.stride(1),
        anchor_sets.stride(0), anchor_sets.stride(1), anchor_sets.stride(2),
        new_set.stride(0), new_set.stride(1),
        nset, int(sink), cap,
        H=H, NC=nc, BLOCK=min(1024, next_pow2(cap, 16)),
        num_warps=4 if nc <= 1024 else 8,
    )
    return idx, cnt


@triton.jit
def _dilate_compose_kernel(
    T, LO, HI, WS, BEST, ASET, SEL, NEWSET, IDX, CNT,
    stride_bb, stride_bh, stride_ab, stride_ah, stride_as, stride_sb, stride_sh,
    K, M, R, NSET, SINK, CAP,
    Q, STEP, AQ, AIDX, ACNT,
    stride_qb, stride_qh, stride_aqb, stride_aqh, stride_aqs, stride_aib, stride_aih, stride_ais,
    stride_cb, stride_ch, eps,
    H: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr,
    RECORD: tl.constexpr = False, S_ANCH: tl.constexpr = 1, D: tl.constexpr = 1, BLOCK_D: tl.constexpr = 16,
):
    """One program per row: a retrieving row sorts its dilated set (stored) and composes from its
    selected entries; a sharing row composes from its anchor's set (``_dilated_set_kernel`` then
    ``_compose_sets_kernel``, in one launch). RECORD: then the row's anchor record
    (``record_anchors``: its unit query ``Q``, its new set, its count) into the layer's state
    ``AQ, AIDX, ACNT``, of which ``ASET`` is the set part: the row reads its anchor's set before it
    writes its slot, which is never one in use."""
    pid, b, h = program_bh(H)
    best = tl.load(BEST + b * stride_bb + h * stride_bh)
    i = tl.arange(0, NC)
    new_row = NEWSET + pid.to(tl.int64) * NSET
    if RECORD:  # the query and the count only: the slot's set is stored below, after the anchor's set is read
        slot_row = _record_row(Q, STEP, AQ, AIDX, ACNT, b, h, best, stride_qb, stride_qh, stride_aqb, stride_aqh,
                               stride_aqs, stride_aib, stride_aih, stride_ais, stride_cb, stride_ch, eps,
                               S_ANCH, D, BLOCK_D)
    if best == -1:
        x, first = _sorted_dilated_set(SEL + b * stride_sb + h * stride_sh, i, K, M, R)
        _store_set(new_row, x, first, i, NSET)
        if RECORD:
            _store_set(slot_row, x, first, i, NSET)
        x = tl.where(first & ((x & 1) == 0), x, 2147483647)
    else:
        none = tl.full([NC], 2147483647, tl.int32)
        tl.store(new_row + i, none, mask=i < NSET)
        x = tl.load(ASET + b.to(tl.int64) * stride_ab + h * stride_ah + tl.maximum(best, 0) * stride_as + i,
                    mask=(i < NSET) & (best >= 0), other=2147483647)
        if RECORD:  # after the load of the anchor's set: a row writes no slot in use, but stay in order
            tl.store(slot_row + i, none, mask=i < NSET)
    _compose_from_set(T, LO, HI, WS, b, SINK, x, IDX + pid.to(tl.int64) * CAP, CNT + pid, CAP, BLOCK)


def _check_dilate_and_compose(best, anchor_sets, new_idx, dil_m, dil_r) -> int:
    B, H, _, nset = anchor_sets.shape
    want = dilated_set_size(new_idx.shape[-1], dil_m, dil_r)
    if best.shape != (B, H) or new_idx.shape[:2] != (B, H) or nset != want:
        raise ValueError(f"dilate_and_compose: best {tuple(best.shape)} / new_idx {tuple(new_idx.shape)} / anchor_sets "
                         f"{tuple(anchor_sets.shape)}: expected [B, H] / [B, H, k] / [B, H, s, "
                         f"dilated_set_size(k, dil_m, dil_r) = {want}]")
    return nset


def dilate_and_compose(
    t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor, best: torch.Tensor,
    anchor_sets: torch.Tensor, new_idx: torch.Tensor, sink: int, cap: int, dil_m: int, dil_r: int, span: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton dilated sets of the retrieving rows and composition of every row, in one launch
    (:func:`dilated_set` then :func:`compose_from_sets`, which it equals). Sets that
    :func:`dilated_set` would build on its map path (``span`` given and at least
    :data:`~.dilated_set.MAP_FROM_ENTRIES` entries) take those two launchers instead.

    Args and result as :func:`dilate_and_compose_reference`.
    """
    require_triton(best, anchor_sets, new_idx)
    return _dilate_compose(t, lo, hi, win_start, best, anchor_sets, new_idx, sink, cap, dil_m, dil_r, span, None)


def dilate_compose_and_record(
    t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor, best: torch.Tensor,
    new_idx: torch.Tensor, anchor_q: torch.Tensor, anchor_idx: torch.Tensor, anchor_count: torch.Tensor, layer: int,
    q: torch.Tensor, step: torch.Tensor, sink: int, cap: int, dil_m: int, dil_r: int, span: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton :func:`dilate_and_compose` on ``layer``'s anchor sets and the anchor record of every
    row of ``layer`` (``record_anchors``, in place) in the same launch: one kernel per layer fewer.

    Args and result as :func:`dilate_compose_and_record_reference`.
    """
    require_triton(best, anchor_idx, new_idx, q)
    _check_record(best, new_idx, anchor_q, anchor_idx, anchor_count, layer, q, step, dil_m, dil_r)
    return _dilate_compose(t, lo, hi, win_start, best, anchor_idx[int(layer)], new_idx, sink, cap, dil_m, dil_r, span,
                           (anchor_q, anchor_idx, anchor_count, layer, q, step))


def _check_record(best, new_idx, anchor_q, anchor_idx, anchor_count, layer, q, step, dil_m, dil_r) -> None:
    B, H = best.shape
    check_record(anchor_q, anchor_idx, anchor_count, layer, q, (B, H, dilated_set_size(new_idx.shape[-1], dil_m, dil_r)),
                 best, step, name="dilate_compose_and_record")


def _dilate_compose(t, lo, hi, win_start, best, anchor_sets, new_idx, sink, cap, dil_m, dil_r, span, record):
    """The launcher of both: ``record`` is None or ``(anchor_q, anchor_idx, anchor_count, layer, q,
    step)``, the arguments of ``record_anchors`` but the new sets."""
    nset = _check_dilate_and_compose(best, anchor_sets, new_idx, dil_m, dil_r)
    B, H, K = new_idx.shape
    r = max(int(dil_r), 0)
    m = min(int(dil_m), K) if r > 0 else 0
    nc = next_pow2(max(nset, 1), 16)
    cap = int(cap)
    if B * H == 0 or cap == 0 or nset == 0 or _auto_takes_map(nset, span):
        new_set = dilated_set(new_idx, best == -1, dil_m, dil_r, span)
        out = (new_set, *compose_from_sets(t, lo, hi, win_start, best, anchor_sets, new_set, sink, cap))
        if record is not None:
            record_anchors(*record[:5], new_set, best, record[5])
        return out
    new_set = torch.empty((B, H, nset), dtype=torch.int32, device=best.device)
    idx, cnt, _ = _composition(B, H, cap, best.device)
    if anchor_sets.stride(-1) != 1:
        if record is not None:
            raise ValueError("dilate_compose_and_record: anchor_idx needs a contiguous last dim (it is written in place)")
        anchor_sets = anchor_sets.contiguous()
    if new_idx.stride(-1) != 1:
        new_idx = new_idx.contiguous()
    if record is None:  # stand-ins for the record's arguments, unused
        rec_tensors, rec_strides, rec_sizes = (best,) * 5, (0,) * 10, {}
    else:
        rec_tensors, rec_strides, rec_sizes = record_launch_args(*record)
    _dilate_compose_kernel[(B * H,)](
        t, lo, hi, win_start, best, anchor_sets, new_idx, new_set, idx, cnt,
        best.stride(0), best.stride(1),
        anchor_sets.stride(0), anchor_sets.stride(1), anchor_sets.stride(2),
        new_idx.stride(0), new_idx.stride(1),
        K, m, max(r, 1), nset, int(sink), cap,
        *rec_tensors, *rec_strides, NORM_EPS,
        H=H, NC=nc, BLOCK=min(1024, next_pow2(cap, 16)),
        RECORD=record is not None, **rec_sizes,
        num_warps=4 if nc <= 1024 else 8,
    )
    return new_set, idx, cnt


def compose_from_sets_reference(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor,
                                best: torch.Tensor, anchor_sets: torch.Tensor, new_set: torch.Tensor, sink: int,
                                cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`compose_from_sets` (vectorised, sync-free).

    The §3 composition where a row's middle candidates come from a dilated set (see
    :func:`dilated_set_reference`): ``best >= 0`` (sharing) every index of
    ``anchor_sets[b, h, best]``; ``best == -1`` (retrieving) the indices of ``new_set[b, h]``
    that are not only neighbours; ``best == -2`` (inactive) none. Then, as in
    :func:`compose_indices_reference`: ``[0, min(sink, t)) ∪ clip_[lo,hi)(middle) ∪
    [win_start, t)`` ascending, unique, ``-1`` after ``count``.

    Args:
        t, lo, hi, win_start: ``[B]`` int32.
        best: ``[B, Hq]`` int32 from ``cis_match``.
        anchor_sets: ``[B, Hq, s, n]`` int32 the anchors' dilated sets.
        new_set: ``[B, Hq, n]`` int32 the retrieving rows' dilated sets.
        sink: number of sink tokens.
        cap: capacity of the output.

    Returns:
        ``(idx [B, Hq, cap] int32, count [B, Hq] int32)``.
    """
    B, Hq, s, n = anchor_sets.shape
    pick = best.clamp_min(0).long().view(B, Hq, 1, 1).expand(B, Hq, 1, n)
    shared_set = torch.gather(anchor_sets, 2, pick).view(B, Hq, n).long()
    x = torch.where((best >= 0).unsqueeze(-1), shared_set, new_set.long())
    use = (x != SET_NONE) & (((best >= 0).unsqueeze(-1)) | ((best == -1).unsqueeze(-1) & (x % 2 == 0)))
    v = torch.div(x, 2, rounding_mode="floor")
    in_mid = (v >= lo.long().view(B, 1, 1)) & (v < hi.long().view(B, 1, 1))
    return _compose_reference(torch.where(use & in_mid, v, _NONE64), t, win_start, sink, cap)


#: "no index" of the references' int64 candidates (sorts after every index)
_NONE64 = torch.iinfo(torch.int64).max


def _compose_reference(middle: torch.Tensor, t: torch.Tensor, win_start: torch.Tensor, sink: int,
                       cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' composition from their middle candidates ``middle [B, H, n]`` int64 (clipped
    to the region, :data:`_NONE64` for none, duplicates allowed): with the sink ``[0, min(sink, t))``
    and the window ``[win_start, t)``, sorted, duplicates dropped, the first ``cap`` kept, ``-1``
    after: ``(idx [B, H, cap] int32, count [B, H] int32)``."""
    B, H = middle.shape[:2]
    dev = middle.device
    t_ = t.long().view(B, 1, 1)
    sink_r = torch.arange(int(sink), device=dev).view(1, 1, -1).expand(B, H, -1)
    win = win_start.long().clamp_min(0).view(B, 1, 1) + torch.arange(int(cap), device=dev).view(1, 1, -1)
    parts = [middle, torch.where(sink_r < t_, sink_r, _NONE64), torch.where(win < t_, win, _NONE64).expand(B, H, -1)]
    cand = torch.sort(torch.cat(parts, dim=-1), dim=-1).values
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = cand[..., 1:] == cand[..., :-1]
    cand = torch.sort(torch.where(dup, _NONE64, cand), dim=-1).values
    n = cand.shape[-1]
    if n < cap:
        cand = torch.cat([cand, cand.new_full((B, H, int(cap) - n), _NONE64)], dim=-1)
    cand = cand[..., : int(cap)]
    keep = cand != _NONE64
    return torch.where(keep, cand, -1).to(torch.int32), keep.sum(dim=-1).to(torch.int32)


def dilate_and_compose_reference(
    t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor, best: torch.Tensor,
    anchor_sets: torch.Tensor, new_idx: torch.Tensor, sink: int, cap: int, dil_m: int, dil_r: int, span: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`dilate_and_compose`: the retrieving rows' (``best == -1``)
    dilated sets of their fresh top-k ``new_idx [B, H, k]`` (:func:`dilated_set_reference`), and
    every row composed from its set (:func:`compose_from_sets_reference`). ``anchor_sets`` is
    ``[B, H, s, dilated_set_size(k, dil_m, dil_r)]``.

    Returns:
        ``(new_set [B, H, n] int32, idx [B, H, cap] int32, count [B, H] int32)``.
    """
    _check_dilate_and_compose(best, anchor_sets, new_idx, dil_m, dil_r)
    new_set = dilated_set_reference(new_idx, best == -1, dil_m, dil_r, span)
    return (new_set, *compose_from_sets_reference(t, lo, hi, win_start, best, anchor_sets, new_set, sink, cap))


def dilate_compose_and_record_reference(
    t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor, best: torch.Tensor,
    new_idx: torch.Tensor, anchor_q: torch.Tensor, anchor_idx: torch.Tensor, anchor_count: torch.Tensor, layer: int,
    q: torch.Tensor, step: torch.Tensor, sink: int, cap: int, dil_m: int, dil_r: int, span: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`dilate_compose_and_record`: :func:`dilate_and_compose_reference`
    on ``anchor_idx[layer]`` (the layer's anchor sets), then
    :func:`~prhs_hf.ops.compose.record_anchors.record_anchors_reference` of its new sets (in place).

    Args:
        t, lo, hi, win_start, best, new_idx, sink, cap, dil_m, dil_r, span: as
            :func:`dilate_and_compose_reference`.
        anchor_q, anchor_idx, anchor_count, layer, q, step: as ``record_anchors_reference``.

    Returns:
        ``(new_set, idx, count)`` as :func:`dilate_and_compose_reference`.
    """
    _check_record(best, new_idx, anchor_q, anchor_idx, anchor_count, layer, q, step, dil_m, dil_r)
    out = dilate_and_compose_reference(t, lo, hi, win_start, best, anchor_idx[int(layer)], new_idx, sink, cap,
                                       dil_m, dil_r, span)
    record_anchors_reference(anchor_q, anchor_idx, anchor_count, layer, q, out[0], best, step)
    return out


def compose_indices_reference(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor,
                              sel_idx: torch.Tensor, dilate: DilateArg, sink: int, dil_m: int, dil_r: int,
                              cap: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    lo_ = lo.long().view(B, 1, 1)
    hi_ = hi.long().view(B, 1, 1)
    sel = sel_idx.long()
    parts = [torch.where((sel >= 0) & (sel >= lo_) & (sel < hi_), sel, _NONE64)]
    m = min(int(dil_m), K)
    if m > 0 and dil_r > 0:
        r = int(dil_r)
        offs = torch.arange(-r, r, device=dev)
        offs = offs + (offs >= 0).long()  # -r..-1, 1..r (no host-to-device copy)
        p = sel[..., :m]
        nb = p.unsqueeze(-1) + offs  # [B, Hq, m, 2r]
        ok = (p >= 0).unsqueeze(-1) & dilate_mask(dilate, B, Hq, dev).view(B, Hq, 1, 1)
        ok = ok & (nb >= lo_.unsqueeze(-1)) & (nb < hi_.unsqueeze(-1))
        parts.append(torch.where(ok, nb, _NONE64).reshape(B, Hq, -1))
    return _compose_reference(torch.cat(parts, dim=-1), t, win_start, sink, cap)
