"""The union of the per-head index sets of each KV group, with a head bitmask per entry.

Contract: from per-head sets ``idx[b, h, :count[b, h]]`` (real indices; the entries at or after
``count`` are ignored, and so are negative ones: ``-1`` is none), for every KV head ``kvh`` with query heads ``kvh*G + g``, ``g < G``:

* ``union_idx[b, kvh, :union_count[b, kvh]]`` the distinct indices of the G sets, ascending,
  ``-1`` after ``union_count``;
* ``head_mask[b, kvh, i]`` (int32) bit ``g`` set when ``union_idx[b, kvh, i]`` is in head
  ``kvh*G + g``'s set (``0`` after ``union_count``).

Shapes are fixed (``[B, Hkv, W]``, ``[B, Hkv]``) and no builder synchronises with the host
(graph-capturable). The width ``W`` is ``G*cap``, or with the index bound ``span`` (the cache's slot
count, which :func:`group_union` takes) :func:`union_width` ``min(G*cap, span)``: a group has at most that
many distinct indices, and a narrower list is less padding to write and fewer attention splits. The union feeds :func:`~.sparse_decode_attention.sparse_decode_attention_union`,
which loads each group's union once and keeps every head to its own set.

Three builders, the same result: :func:`group_union`, the Triton one that the attention uses (each
group's heads mark their indices in a zeroed int32 map of the cache's slots, OR-ing their bits, and
the marked slots are collected in order: no sort; prhs_hf/ops/map_collect.py); :func:`group_union_torch`,
torch ops (a sort of each group's ``G*cap`` entries and about fifteen elementwise launches); and the
set-based reference :func:`group_union_reference`.
"""

from __future__ import annotations

import torch

from ..map_collect import MAP_CHUNK, _chunk_count, _chunks_before, _marked_slots, _pad_from, chunk_grid
from ..triton_support import next_pow2, program_bh, require_triton, tl, triton

__all__ = ["group_union", "group_union_torch", "group_union_reference", "union_width", "MAX_GROUP"]

#: The largest query-head group a head bitmask holds (bits of an int32).
MAX_GROUP = 32


def union_width(group: int, cap: int, span: int | None = None) -> int:
    """Entries of a union list: ``group * cap`` (every head's whole list distinct), at most ``span`` (the
    distinct indices below the index bound) when it is given."""
    width = int(group) * int(cap)
    return width if span is None else min(width, int(span))


def _check(idx: torch.Tensor, count: torch.Tensor, kv_heads: int) -> int:
    """Validate the per-head sets; the group size G."""
    if idx.dim() != 3 or count.shape != idx.shape[:2]:
        raise ValueError(f"group_union: idx {tuple(idx.shape)} / count {tuple(count.shape)}: "
                         "expected idx [B, Hq, cap] and count [B, Hq]")
    Hq = idx.shape[1]
    if kv_heads < 1 or Hq % kv_heads:
        raise ValueError(f"group_union: kv_heads={kv_heads} must be >= 1 and divide Hq={Hq}")
    group = Hq // kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"group_union: group size G = Hq / kv_heads = {group}; allowed 1 .. {MAX_GROUP} "
                         "(bits of the int32 head bitmask)")
    return group


def _as_int32_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 bitmasks in [0, 2^32) as int32 with the same bits (bit 31 is the sign bit)."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def group_union_torch(idx: torch.Tensor, count: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Union of each KV group's per-head index sets, with the head bitmask of every entry, in torch ops.

    Sorts the G rows of a group together, keyed ``index * G + g`` (so equal indices are adjacent
    and a repeated (index, head) pair is counted once), marks the first entry of every index run,
    ORs the heads' bits into the run by a scatter-add of ``1 << g`` over distinct pairs, and
    compacts the runs to the front (their slot is the running count of runs). Rows need not be
    sorted nor free of repeats; negative entries are skipped. No host synchronisation.

    Args:
        idx: ``[B, Hq, cap]`` integer per-head sets (real indices before ``count``).
        count: ``[B, Hq]`` integer number of valid entries (clamped to ``[0, cap]``).
        kv_heads: ``Hkv``; query head ``h`` belongs to group ``h // (Hq // Hkv)``.

    Returns:
        ``(union_idx, head_mask, union_count)``: int32 ``[B, Hkv, G*cap]``, int32
        ``[B, Hkv, G*cap]`` and int32 ``[B, Hkv]`` as in the module contract.

    Raises:
        ValueError: bad shapes, ``kv_heads`` not dividing ``Hq``, or ``G > 32``.
    """
    group = _check(idx, count, kv_heads)
    B, Hq, cap = idx.shape
    width = group * cap
    dev = idx.device
    valid = (torch.arange(cap, device=dev) < count.long().unsqueeze(-1)) & (idx >= 0)  # [B, Hq, cap]
    head_of_entry = (torch.arange(Hq, device=dev) % group).view(1, Hq, 1)
    none = torch.iinfo(torch.int64).max
    key = torch.where(valid, idx.long() * group + head_of_entry, none).view(B, kv_heads, width)
    key = torch.sort(key, dim=-1).values
    present = key != none
    index = torch.where(present, key.div(group, rounding_mode="floor"), -1)
    head = key.remainder(group)  # the entry's g (meaningless where absent; masked below)
    prev_key = torch.nn.functional.pad(key, (1, 0), value=none)[..., :-1]
    prev_index = torch.nn.functional.pad(index, (1, 0), value=-1)[..., :-1]
    new_pair = present & (key != prev_key)
    new_index = present & ((index != prev_index) | (prev_key == none))
    run = torch.cumsum(new_index, dim=-1) - 1  # the union slot of each present entry
    slot = run.clamp_min(0)
    bits = torch.where(new_pair, torch.ones_like(key) << head, 0)
    head_bits = torch.zeros_like(key).scatter_add_(-1, slot, bits)
    union_idx = torch.full_like(key, -1).scatter_reduce_(-1, slot, torch.where(present, index, -1), "amax")
    union_count = new_index.sum(dim=-1)
    return union_idx.to(torch.int32), _as_int32_bits(head_bits), union_count.to(torch.int32)


def group_union_reference(idx: torch.Tensor, count: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Set-based reference of :func:`group_union_torch` and :func:`group_union` (Python loops; the
    arguments of the first, the results of both)."""
    group = _check(idx, count, kv_heads)
    B, Hq, cap = idx.shape
    union_idx = torch.full((B, kv_heads, group * cap), -1, dtype=torch.int32)
    head_mask = torch.zeros((B, kv_heads, group * cap), dtype=torch.int64)
    union_count = torch.zeros((B, kv_heads), dtype=torch.int32)
    for b in range(B):
        for kvh in range(kv_heads):
            heads_of: dict[int, set[int]] = {}
            for g in range(group):
                h = kvh * group + g
                n = min(max(int(count[b, h]), 0), cap)
                for x in idx[b, h, :n].tolist():
                    if x >= 0:
                        heads_of.setdefault(int(x), set()).add(g)
            for i, x in enumerate(sorted(heads_of)):
                union_idx[b, kvh, i] = x
                head_mask[b, kvh, i] = sum(1 << g for g in heads_of[x])
            union_count[b, kvh] = len(heads_of)
    return union_idx, _as_int32_bits(head_mask), union_count


# The Triton builder. Launches: a memset of the map, then
#   mark   grid (B*Hq, blocks of a head's list): atomic_or of the head's bit 1 << g into its group's
#          map row at each index of its list (a repeated index ORs the same bit again);
#   count  grid (B*Hkv, chunks of MAP_CHUNK map slots): the chunk's marked slots;
#   write  grid (B*Hkv, chunks): the chunk's marked slots (union_idx) and their marks (head_mask) from
#          the counts of the row's chunks before it, its share of the -1 / 0 padding, and (chunk 0)
#          the row's union_count.
# The map holds the cache's S slots per group: S * 4 bytes per (sequence, KV head) to zero and read
# twice, against the union_width(G, cap, S) * 4 bytes of each output row.


@triton.jit
def _union_mark_kernel(
    IDX, CNT, MAP,
    stride_ib, stride_ih, stride_cb, stride_ch,
    cap, S,
    H: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (query head, block of BLOCK entries of its list): OR the head's bit into its
    KV group's map row at its indices before its count (clamped to [0, cap]) that lie in [0, S)."""
    pid, b, h = program_bh(H)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.minimum(tl.maximum(tl.load(CNT + b * stride_cb + h * stride_ch).to(tl.int32), 0), cap)
    x = tl.load(IDX + b * stride_ib + h * stride_ih + i, mask=i < n, other=-1)
    row = MAP + (b * (H // GROUP) + h // GROUP).to(tl.int64) * S
    bit = tl.full([BLOCK], 1, tl.int32) << (h % GROUP)
    tl.atomic_or(row + x, bit, mask=(x >= 0) & (x < S), sem="relaxed")


@triton.jit
def _union_count_kernel(MAP, COUNTS, S, N_CHUNKS, CHUNK: tl.constexpr):
    """One program per (group row, chunk of CHUNK map slots): the chunk's marked slots into ``COUNTS[row, chunk]``."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    tl.store(COUNTS + pid.to(tl.int64) * N_CHUNKS + c, _chunk_count(MAP + pid.to(tl.int64) * S, c, S, CHUNK))


@triton.jit
def _union_write_kernel(
    MAP, COUNTS, UNION_IDX, HEAD_MASK, UNION_COUNT,
    S, NSET, N_CHUNKS, SHARE,
    CHUNK: tl.constexpr, NCH: tl.constexpr,
):
    """One program per (group row, chunk): the chunk's marked slots and their head bits in order from
    the counts of the row's chunks before it, then -1 / 0 at the slots of its share
    ``[c * SHARE, (c + 1) * SHARE)`` of the row from the union's size on; chunk 0 stores that size."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    before, total = _chunks_before(COUNTS, pid, c, N_CHUNKS, NCH)
    j = c * CHUNK + tl.arange(0, CHUNK)
    bits, slot, store, _ = _marked_slots(MAP + pid.to(tl.int64) * S, j, before, S, NSET)
    out = pid.to(tl.int64) * NSET
    tl.store(UNION_IDX + out + slot, j, mask=store)
    tl.store(HEAD_MASK + out + slot, bits, mask=store)
    lo = c * SHARE
    hi = tl.minimum(lo + SHARE, NSET)
    _pad_from(UNION_IDX + out, lo, hi, total, -1, CHUNK)
    _pad_from(HEAD_MASK + out, lo, hi, total, 0, CHUNK)
    if c == 0:
        tl.store(UNION_COUNT + pid, tl.minimum(total, NSET))


def group_union(idx: torch.Tensor, count: torch.Tensor, kv_heads: int,
                span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Union of each KV group's per-head index sets, with the head bitmask of every entry (Triton).

    Each query head ORs its bit ``1 << g`` into its group's row of a zeroed int32 map of ``span``
    slots at every index of its list, and each map row's marked slots are collected in ascending
    order with their bits (a program per (row, chunk of :data:`~.map_collect.MAP_CHUNK` slots) counts
    the chunk's marks, another writes them after the counts of the chunks before it): a memset and
    three launches, no sort, no host synchronisation. Rows need not be sorted nor free of repeats;
    ``-1`` entries before the count are skipped.

    Args:
        idx: ``[B, Hq, cap]`` integer per-head sets (real indices before ``count``).
        count: ``[B, Hq]`` integer number of valid entries (clamped to ``[0, cap]``).
        kv_heads: ``Hkv``; query head ``h`` belongs to group ``h // (Hq // Hkv)``.
        span: the index bound, the cache's slot count ``S``: every real index is ``< span`` (an entry at
            or past it is left out of the union).

    Returns:
        ``(union_idx, head_mask, union_count)`` as :func:`group_union_torch` (the module contract), each
        list :func:`union_width` ``(G, cap, span)`` wide: :func:`group_union_torch`'s first columns.

    Raises:
        ValueError: bad shapes, ``kv_heads`` not dividing ``Hq``, ``G > 32`` or ``span < 1``.
    """
    group = _check(idx, count, kv_heads)
    if span < 1:
        raise ValueError(f"group_union: span={span}; allowed >= 1 (the cache's slot count, above every index)")
    require_triton(idx, count)
    B, Hq, cap = idx.shape
    nset = union_width(group, cap, span)
    dev = idx.device
    union_idx = torch.empty((B, kv_heads, nset), dtype=torch.int32, device=dev)
    head_mask = torch.empty_like(union_idx)
    union_count = torch.zeros((B, kv_heads), dtype=torch.int32, device=dev)
    if B == 0 or nset == 0:
        return union_idx, head_mask, union_count
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    rows = B * kv_heads
    marks = torch.zeros((rows, int(span)), dtype=torch.int32, device=dev)
    block = min(next_pow2(cap, 16), 1024)
    _union_mark_kernel[(B * Hq, triton.cdiv(cap, block))](
        idx, count, marks,
        idx.stride(0), idx.stride(1), count.stride(0), count.stride(1),
        cap, int(span),
        H=Hq, GROUP=group, BLOCK=block, num_warps=4,
    )
    grid = chunk_grid(int(span), nset, int(MAP_CHUNK))
    counts = torch.empty((rows, grid.n_chunks), dtype=torch.int32, device=dev)
    _union_count_kernel[(rows, grid.n_chunks)](
        marks, counts, int(span), grid.n_chunks,
        CHUNK=grid.chunk, num_warps=4,
    )
    _union_write_kernel[(rows, grid.n_chunks)](
        marks, counts, union_idx, head_mask, union_count,
        int(span), nset, grid.n_chunks, grid.share,
        CHUNK=grid.chunk, NCH=grid.n_chunks_pow2, num_warps=4,
    )
    return union_idx, head_mask, union_count
