"""The union of the per-head index sets of each KV group, with a head bitmask per entry.

Contract: from per-head sets ``idx[b, h, :count[b, h]]`` (real indices; the entries at or after
``count`` are ignored), for every KV head ``kvh`` with query heads ``kvh*G + g``, ``g < G``:

* ``union_idx[b, kvh, :union_count[b, kvh]]`` the distinct indices of the G sets, ascending,
  ``-1`` after ``union_count``;
* ``head_mask[b, kvh, i]`` (int32) bit ``g`` set when ``union_idx[b, kvh, i]`` is in head
  ``kvh*G + g``'s set (``0`` after ``union_count``).

Shapes are fixed (``[B, Hkv, G*cap]``, ``[B, Hkv]``) and the builder is torch ops only, with no
host synchronisation (graph-capturable). It feeds
:func:`~.sparse_decode_attention.sparse_decode_attention_union`, which loads each group's union
once and keeps every head to its own set. The builder :func:`group_union` and its set-based
reference :func:`group_union_reference` live here.
"""

from __future__ import annotations

import torch

__all__ = ["group_union", "group_union_reference", "MAX_GROUP"]

#: The largest query-head group a head bitmask holds (bits of an int32).
MAX_GROUP = 32


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


def group_union(idx: torch.Tensor, count: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Union of each KV group's per-head index sets, with the head bitmask of every entry.

    Sorts the G rows of a group together, keyed ``index * G + g`` (so equal indices are adjacent
    and a repeated (index, head) pair is counted once), marks the first entry of every index run,
    ORs the heads' bits into the run by a scatter-add of ``1 << g`` over distinct pairs, and
    compacts the runs to the front (their slot is the running count of runs). Rows need not be
    sorted nor free of repeats. No host synchronisation.

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
    valid = torch.arange(cap, device=dev) < count.long().unsqueeze(-1)  # [B, Hq, cap]
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
    """Set-based reference of :func:`group_union` (Python loops; same arguments and results)."""
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
                    heads_of.setdefault(int(x), set()).add(g)
            for i, x in enumerate(sorted(heads_of)):
                union_idx[b, kvh, i] = x
                head_mask[b, kvh, i] = sum(1 << g for g in heads_of[x])
            union_count[b, kvh] = len(heads_of)
    return union_idx, _as_int32_bits(head_mask), union_count
