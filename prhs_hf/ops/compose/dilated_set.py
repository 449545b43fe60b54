"""Step 3a of the CIS decode pipeline: each anchor's dilated set, built once when it is retrieved.

A sharing row re-uses its anchor's indices for every step of a block, so the anchor's middle set,
sorted, deduplicated and dilated, is built once, when the anchor is retrieved (one set per
*retrieving* row), and stored instead of its top-k list; each step then composes every row from
a set without a sort (step 3b: ``compose_from_sets`` and ``dilate_and_compose`` of
``compose_indices.py``, whose fused kernel builds the set with this module's register sort;
the anchor-set fast path of docs/notes/decode_tuning.md).

Contract (docs/DECODE_PIPELINE.md §3a): for each row of ``sel_idx [B, Hq, k]`` (best first,
``-1`` = none) flagged in ``rows``, with ``p = sel_idx[b, h]``, the middle indices::

    {p_i : p_i >= 0} ∪ {p_i + j : i < m, p_i >= 0, 0 < |j| <= r}

(unclipped: the region is applied at use), encoded (int32) ``(v << 1) | nb`` for each index
``v``, ``nb = 1`` when ``v`` is only a dilation neighbour (not a selected index itself);
ascending, one entry per ``v``, :data:`SET_NONE` after the last; a row not flagged is all
:data:`SET_NONE`. A retrieving row's own step uses the entries with ``nb = 0`` (its fresh top-k,
undilated); a sharing row uses all.

Two Triton methods build it, the same output: a register sort per row, or, for large sets whose
index span is known, a mark-and-collect pass over an int8 map of the row's index range with
either collect of :data:`MAP_COLLECTS` (their helpers, shared with ``group_union.py``, are
``map_collect.py``'s).

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launcher :func:`dilated_set`, and the PyTorch reference :func:`dilated_set_reference`.
"""

from __future__ import annotations

from typing import Union

import torch

from ..map_collect import MAP_CHUNK, _chunk_count, _chunks_before, _marked_slots, _pad_from, chunk_grid
from ..triton_support import next_pow2, program_bh, require_triton, tl, triton

__all__ = [
    "dilated_set",
    "dilated_set_reference",
    "dilated_set_size",
    "dilate_mask",
    "DilateArg",
    "SET_NONE",
    "MAP_FROM_ENTRIES",
    "MAP_COLLECTS",
    "MAP_COLLECT",
]

#: Padding of a dilated set (larger than every entry).
SET_NONE = 2147483647

#: the rows a dilation applies to (``dilate`` of ``compose_indices``, ``rows`` of
#: :func:`dilated_set`): one bool for every row, or a ``[B, Hq]`` bool tensor.
DilateArg = Union[bool, torch.Tensor]


def dilated_set_size(k: int, dil_m: int, dil_r: int) -> int:
    """Entries of a dilated set: ``k + 2 * r * min(m, k)`` (``r = 0``: ``k``)."""
    r = max(int(dil_r), 0)
    return int(k) + (2 * r * min(int(dil_m), int(k)) if r > 0 else 0)


def dilate_mask(dilate: DilateArg, B: int, Hq: int, device: torch.device) -> torch.Tensor:
    """``dilate`` as a ``[B, Hq]`` bool tensor on ``device`` (a Python bool is broadcast)."""
    if isinstance(dilate, torch.Tensor):
        return dilate.to(device=device, dtype=torch.bool).expand(B, Hq)
    return torch.full((B, Hq), bool(dilate), dtype=torch.bool, device=device)


# The jit helpers down to _store_set are compose_indices.py's too: its _compose_kernel takes a row's
# candidates and their scan combine from here, its fused _dilate_compose_kernel the sorted set.


@triton.jit
def _last_two(last_a, prev_a, last_b, prev_b):
    """Scan combine: (last, previous) element of a concatenation (prev -2^31 = none yet)."""
    return last_b, tl.where(prev_b == -2147483648, last_a, prev_b)


@triton.jit
def _dilated_candidates(SEL, i, K, M, R):
    """Entry ``i`` of a row's dilated-set candidates: selected ``i < K`` (``SEL[i]``), then the
    top-``M``'s neighbours at offsets ``-R..-1, 1..R``; ``(p, offset, is_selected, valid)``."""
    is_sel = i < K
    nb = i - K
    src = tl.where(is_sel, i, nb // (2 * R))
    o = nb % (2 * R)
    off = tl.where(is_sel, 0, tl.where(o < R, o - R, o - R + 1))
    in_set = is_sel | (nb < 2 * R * M)
    p = tl.load(SEL + src, mask=in_set, other=-1)
    return p, off, is_sel, in_set & (p >= 0)


@triton.jit
def _sorted_dilated_set(SEL_ROW, i, K, M, R):
    """A row's dilated set in registers: ``(x, first)``, ``x`` its candidates ``(v << 1) |
    only_neighbour`` sorted ascending (SET_NONE where none), ``first`` the first entry of each
    index (the selected one where an index is both)."""
    p, off, is_sel, ok = _dilated_candidates(SEL_ROW, i, K, M, R)
    x = tl.sort(tl.where(ok, ((p + off) << 1) | tl.where(is_sel, 0, 1), 2147483647))
    _, prev = tl.associative_scan((x, tl.full(x.shape, -2147483648, tl.int32)), 0, _last_two)
    return x, (x != 2147483647) & ((x >> 1) != (prev >> 1))


@triton.jit
def _store_set(out, x, first, i, NSET):
    """Store the entries ``first`` of ``x`` compacted to ``out[:n]``, SET_NONE after."""
    keep = first.to(tl.int32)
    pos = tl.cumsum(keep, axis=0) - keep
    n = tl.sum(keep, axis=0)
    tl.store(out + pos, x, mask=first & (pos < NSET))
    tl.store(out + i, tl.full(x.shape, 2147483647, tl.int32), mask=(i >= n) & (i < NSET))


@triton.jit
def _program_row(FLAG, stride_fb, stride_fh, H: tl.constexpr):
    """This program's row and whether it is flagged: ``(pid, b, h, flag)``."""
    pid, b, h = program_bh(H)
    flag = tl.load(FLAG + b * stride_fb + h * stride_fh).to(tl.int32)
    return pid, b, h, flag


@triton.jit
def _dilated_set_kernel(SEL, FLAG, OUT, stride_sb, stride_sh, stride_fb, stride_fh, K, M, R, NSET,
                        H: tl.constexpr, NC: tl.constexpr):
    """One program per row; rows without FLAG only write the padding (no sort)."""
    pid, b, h, flag = _program_row(FLAG, stride_fb, stride_fh, H)
    i = tl.arange(0, NC)
    out = OUT + pid.to(tl.int64) * NSET
    if flag != 0:
        x, first = _sorted_dilated_set(SEL + b * stride_sb + h * stride_sh, i, K, M, R)
        _store_set(out, x, first, i, NSET)
    else:
        tl.store(out + i, tl.full([NC], 2147483647, tl.int32), mask=i < NSET)


@triton.jit
def _dilated_mark_kernel(SEL, FLAG, MAP, stride_sb, stride_sh, stride_fb, stride_fh, K, M, R, L,
                         H: tl.constexpr, NC: tl.constexpr):
    """One program per row: mark its indices in its row of a zeroed int8 map over ``[-R, L - R)``,
    1 for a neighbour, then 2 for a selected index (selected wins where both fall)."""
    pid, b, h, flag = _program_row(FLAG, stride_fb, stride_fh, H)
    if flag != 0:
        p, off, is_sel, ok = _dilated_candidates(SEL + b * stride_sb + h * stride_sh, tl.arange(0, NC), K, M, R)
        row = MAP + pid.to(tl.int64) * L + R
        tl.store(row + p + off, tl.full([NC], 1, tl.int8), mask=ok & ~is_sel)
        tl.debug_barrier()
        tl.store(row + p, tl.full([NC], 2, tl.int8), mask=ok & is_sel)


@triton.jit
def _store_marked(row, out, j, n, R, L, NSET):
    """Store the marked positions ``j`` of map row ``row`` as ``((j - R) << 1) | only_neighbour``,
    in order, at ``out[n:]`` (not at or past ``NSET``); return how many are marked."""
    mark, slot, store, marked = _marked_slots(row, j, n, L, NSET)
    tl.store(out + slot, ((j - R) << 1) | (mark == 1).to(tl.int32), mask=store)
    return marked


@triton.jit
def _pad_set(out, lo, hi, n, BLOCK: tl.constexpr):
    """SET_NONE at the slots ``[lo, hi)`` of ``out`` from the set's size ``n`` on."""
    _pad_from(out, lo, hi, n, 2147483647, BLOCK)


@triton.jit
def _dilated_collect_kernel(
    MAP, FLAG, OUT,
    stride_fb, stride_fh,
    R, L, NSET,
    H: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: the marked positions of its map row in ascending order, as
    ``(v << 1) | only_neighbour``, then SET_NONE padding (rows without FLAG: padding only)."""
    pid, b, h, flag = _program_row(FLAG, stride_fb, stride_fh, H)
    out = OUT + pid.to(tl.int64) * NSET
    n = 0
    if flag != 0:
        row = MAP + pid.to(tl.int64) * L
        for start in range(0, L, BLOCK):
            n += _store_marked(row, out, start + tl.arange(0, BLOCK), n, R, L, NSET)
    _pad_set(out, 0, NSET, n, BLOCK)


@triton.jit
def _dilated_count_kernel(
    MAP, FLAG, COUNTS,
    stride_fb, stride_fh,
    L, N_CHUNKS,
    H: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per (row, chunk of CHUNK map positions): the chunk's marked positions, into
    ``COUNTS[row, chunk]`` (rows without FLAG: 0)."""
    pid, b, h, flag = _program_row(FLAG, stride_fb, stride_fh, H)
    c = tl.program_id(1)
    n = 0
    if flag != 0:
        n = _chunk_count(MAP + pid.to(tl.int64) * L, c, L, CHUNK)
    tl.store(COUNTS + pid.to(tl.int64) * N_CHUNKS + c, n)


@triton.jit
def _dilated_write_kernel(
    MAP, FLAG, COUNTS, OUT,
    stride_fb, stride_fh,
    R, L, NSET, N_CHUNKS, SHARE,
    H: tl.constexpr, CHUNK: tl.constexpr, NCH: tl.constexpr,
):
    """One program per (row, chunk): the chunk's marked positions as ``(v << 1) | only_neighbour``
    from the sum of the counts of the chunks before it, and SET_NONE at the slots of its share
    ``[c * SHARE, (c + 1) * SHARE)`` of the row from the row's total on (rows without FLAG:
    padding only)."""
    pid, b, h, flag = _program_row(FLAG, stride_fb, stride_fh, H)
    c = tl.program_id(1)
    out = OUT + pid.to(tl.int64) * NSET
    total = 0
    if flag != 0:
        before, total = _chunks_before(COUNTS, pid, c, N_CHUNKS, NCH)
        _store_marked(MAP + pid.to(tl.int64) * L, out, c * CHUNK + tl.arange(0, CHUNK), before, R, L, NSET)
    lo = c * SHARE
    _pad_set(out, lo, tl.minimum(lo + SHARE, NSET), total, CHUNK)


#: the sort path's register sort grows as log^2 of the set: from this many entries (next power
#: of two) a row with a known index span is marked in a map and collected in order instead
MAP_FROM_ENTRIES = 1024

#: the map path's collects: ``"serial"`` (``_method="map"``: one program per row scans its map row)
#: and ``"parallel"`` (``_method="map_parallel"``: a program per (row, chunk of :data:`MAP_CHUNK`
#: positions) counts its chunk's marks, then writes them after the counts of the chunks before it)
MAP_COLLECTS = {"serial": "map", "parallel": "map_parallel"}

#: the collect of :func:`dilated_set`'s ``"auto"`` map path (so of
#: :func:`~.compose_indices.dilate_and_compose`'s), a key of :data:`MAP_COLLECTS`: ``"parallel"``, the
#: faster at every shape timed (H100, cis_longbench's sets: docs/results/bench_union_lb.md)
MAP_COLLECT = "parallel"

# MAP_CHUNK, the parallel collect's map positions per program, is prhs_hf/ops/map_collect.py's (the
# collect's helpers live there, shared with group_union.py's union builder).


def _auto_takes_map(nset: int, span: int) -> bool:
    """Whether ``"auto"`` builds sets of ``nset`` entries on the map path: ``span`` given and the
    sort's register block (``nset`` rounded up to a power of two) at least :data:`MAP_FROM_ENTRIES`."""
    return span > 0 and next_pow2(nset, 16) >= MAP_FROM_ENTRIES


def _collect_map(marks: torch.Tensor, flag: torch.Tensor, out: torch.Tensor, R: int, parallel: bool) -> None:
    """Collect each flagged row of ``marks [B*H, L]`` (int8, marked over ``[-R, L - R)``) into
    ``out [B, H, nset]`` (contiguous), with the parallel collect or the serial one (see
    :data:`MAP_COLLECTS`); the rows without ``flag [B, H]`` are all SET_NONE."""
    B, H, nset = out.shape
    L = marks.shape[1]
    if not parallel:
        _dilated_collect_kernel[(B * H,)](
            marks, flag, out,
            flag.stride(0), flag.stride(1),
            R, L, nset,
            H=H, BLOCK=2048, num_warps=8,
        )
        return
    grid = chunk_grid(L, nset, int(MAP_CHUNK))
    counts = torch.empty((B * H, grid.n_chunks), dtype=torch.int32, device=marks.device)
    _dilated_count_kernel[(B * H, grid.n_chunks)](
        marks, flag, counts,
        flag.stride(0), flag.stride(1),
        L, grid.n_chunks,
        H=H, CHUNK=grid.chunk, num_warps=4,
    )
    _dilated_write_kernel[(B * H, grid.n_chunks)](
        marks, flag, counts, out,
        flag.stride(0), flag.stride(1),
        R, L, nset, grid.n_chunks, grid.share,
        H=H, CHUNK=grid.chunk, NCH=grid.n_chunks_pow2, num_warps=4,
    )


def dilated_set(sel_idx: torch.Tensor, rows: DilateArg, dil_m: int, dil_r: int, span: int = 0,
                _method: str = "auto") -> torch.Tensor:
    """Triton dilated sets of the selected rows.

    Args and result as :func:`dilated_set_reference`; ``span`` (optional, e.g. the cache's slot
    count) bounds the indices: every ``sel_idx`` entry is ``< span``. Three methods, the same
    output: ``"sort"`` (one launch, a register sort per selected row) and the map (needs ``span``:
    each selected row marks its indices in an int8 map of ``span + 2r`` positions, then they are
    collected in order, no sort) with either collect of :data:`MAP_COLLECTS`: ``"map"`` (one
    program per row scans its map row: a memset and two launches) or ``"map_parallel"`` (a
    program per (row, chunk of :data:`MAP_CHUNK` positions) counts its chunk's marks, then another
    writes them after the counts of the row's chunks before it, and its share of the padding: a
    memset and three launches). ``"auto"``: the map with the collect :data:`MAP_COLLECT` for sets
    of at least :data:`MAP_FROM_ENTRIES` (next power of two) when ``span`` is given, else the sort.

    Raises:
        ValueError: ``_method`` not one of the above, a map method without ``span``, or (``"auto"``)
            a :data:`MAP_COLLECT` that is not a key of :data:`MAP_COLLECTS`.
    """
    require_triton(sel_idx)
    methods = ("auto", "sort", *MAP_COLLECTS.values())
    if _method not in methods:
        raise ValueError(f"dilated_set: _method={_method!r}; expected one of {', '.join(map(repr, methods))}")
    B, H, K = sel_idx.shape
    dev = sel_idx.device
    r = max(int(dil_r), 0)
    m = min(int(dil_m), K) if r > 0 else 0
    nset = dilated_set_size(K, m, r)
    out = torch.empty((B, H, nset), dtype=torch.int32, device=dev)
    if B * H == 0 or nset == 0:
        return out
    if sel_idx.stride(-1) != 1:
        sel_idx = sel_idx.contiguous()
    flag = dilate_mask(rows, B, H, dev)
    nc = next_pow2(nset, 16)
    method = _method
    if method == "auto":
        if MAP_COLLECT not in MAP_COLLECTS:
            raise ValueError(f"dilated_set: MAP_COLLECT={MAP_COLLECT!r}; expected one of "
                             f"{', '.join(map(repr, MAP_COLLECTS))}")
        method = MAP_COLLECTS[MAP_COLLECT] if _auto_takes_map(nset, span) else "sort"
    if method != "sort":
        if span <= 0:
            raise ValueError(f"dilated_set: _method={method!r} needs span > 0 (the index bound), got span={span}")
        R = max(r, 1)
        L = int(span) + 2 * R
        marks = torch.zeros((B * H, L), dtype=torch.int8, device=dev)
        _dilated_mark_kernel[(B * H,)](
            sel_idx, flag, marks,
            sel_idx.stride(0), sel_idx.stride(1), flag.stride(0), flag.stride(1),
            K, m, R, L,
            H=H, NC=nc, num_warps=4 if nc <= 1024 else 8,
        )
        _collect_map(marks, flag, out, R, parallel=method == MAP_COLLECTS["parallel"])
        return out
    _dilated_set_kernel[(B * H,)](
        sel_idx, flag, out,
        sel_idx.stride(0), sel_idx.stride(1), flag.stride(0), flag.stride(1),
        K, m, max(r, 1), nset,
        H=H, NC=nc,
        num_warps=4 if nc <= 1024 else (8 if nc <= 4096 else 16),
    )
    return out


def dilated_set_reference(sel_idx: torch.Tensor, rows: DilateArg, dil_m: int, dil_r: int, span: int = 0) -> torch.Tensor:
    """PyTorch reference of :func:`dilated_set` (vectorised, sync-free; ``span`` is not needed here).

    Args:
        sel_idx: ``[B, Hq, k]`` int32 selected middle indices, best first, ``-1`` = none.
        rows: bool or ``[B, Hq]`` bool, the rows whose set is built (the others: all padding).
        dil_m, dil_r: dilation top-m and radius.

    Returns:
        ``[B, Hq, k + 2*r*min(m, k)]`` int32: ``(v << 1) | only_neighbour`` ascending, one
        entry per index ``v``, :data:`SET_NONE` padded (see the module docstring).
    """
    B, Hq, K = sel_idx.shape
    dev = sel_idx.device
    r = max(int(dil_r), 0)
    m = min(int(dil_m), K) if r > 0 else 0
    none = torch.iinfo(torch.int64).max
    sel = sel_idx.long()
    parts = [torch.where(sel >= 0, sel * 2, none)]
    if m > 0:
        offs = torch.arange(-r, r, device=dev)
        offs = offs + (offs >= 0).long()  # -r..-1, 1..r
        p = sel[..., :m]
        nb = p.unsqueeze(-1) + offs  # [B, Hq, m, 2r]
        parts.append(torch.where((p >= 0).unsqueeze(-1), nb * 2 + 1, none).reshape(B, Hq, -1))
    cand = torch.sort(torch.cat(parts, dim=-1), dim=-1).values
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = torch.div(cand[..., 1:], 2, rounding_mode="floor") == torch.div(
        cand[..., :-1], 2, rounding_mode="floor"
    )
    cand = torch.sort(torch.where(dup, none, cand), dim=-1).values
    keep = (cand != none) & dilate_mask(rows, B, Hq, dev).unsqueeze(-1)
    return torch.where(keep, cand, SET_NONE).to(torch.int32)
