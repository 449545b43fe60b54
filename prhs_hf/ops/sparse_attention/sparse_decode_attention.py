"""Step 4 of the CIS decode pipeline: exact softmax attention over each head's index list.

Contract (docs/DECODE_PIPELINE.md §4): attention of ``q[b, h]`` over the keys at cache slots
``pad[b] + idx[b, h, i]`` for ``i < count[b, h]`` (fp32 scores and accumulator, online
softmax, output in ``q``'s dtype). ``count = 0`` gives zeros. No full-length score vector.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launcher :func:`sparse_decode_attention`, and the PyTorch reference
:func:`sparse_decode_attention_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..triton_support import gqa_group, interpreting, next_pow2, num_sms, program_bh, require_triton, tl, triton
from .group_union import group_union

__all__ = [
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
    "sparse_decode_attention_grouped",
    "sparse_decode_attention_grouped_reference",
    "sparse_decode_attention_union",
    "sparse_decode_attention_union_reference",
    "attention_schedule",
]

# Kernel design: grid (B*Hq rows, splits of the index list) in one launch (flash-decoding).
# A program walks its slice of the row's index list in tiles of BLOCK_N entries: it gathers the
# BLOCK_N K and V rows (slot pad + idx, the KV head of the query head) with software-pipelined
# loads, computes q.K^T as a tensor-core dot (the query replicated over 16 rows; fp32
# accumulation), runs the online softmax in base 2 in fp32, and accumulates p.V (p in the
# input dtype, as FlashAttention does); nothing longer than a tile is ever held. With one split the program writes
# the output; otherwise it writes (max, sum, unnormalised acc) and `_combine_kernel` merges the
# splits. Query heads of one KV group share no index list in general (each head has its own
# set), so rows are independent programs; rows of a group reading common keys (sink, window)
# meet in L2.
#
# Group-shared selection (one index list per KV head, :func:`sparse_decode_attention_grouped`):
# the same kernel with PACK on, grid (B*Hkv groups, splits): the G query heads of the group are
# the M rows of the tiles (pack_gqa), so every selected K/V row is loaded once for all G heads
# and the two dots do G rows of useful work instead of 1 of 16.
#
# Per-head sets read once per group (:func:`sparse_decode_attention_union`): the group's union of
# its heads' sets (prhs_hf/ops/sparse_attention/group_union.py) is the PACK list, and a head bitmask per entry
# (HEAD_MASK) sets a head's score to -inf on the keys outside its own set. Each K/V row of the
# union is loaded once for the group instead of once per head holding it; the output is the
# per-head attention's.

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_attn_kernel(
    Q, K, V, PAD, IDX, CNT, HMASK, OUT, M_PART, L_PART, O_PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ih, stride_cb, stride_ch, stride_mb, stride_mh, stride_ob, stride_oh,
    qk_scale, cap, CHUNK,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    PACK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_MASK: tl.constexpr,
):
    """Attention of one query row (PACK off) or of the G query heads of one KV group sharing
    one index list (PACK on) over one slice of that list (online softmax, base 2).

    PACK off: program ``b*H + h``, index list ``idx[b, h]``; the query is replicated over the
    BLOCK_M = 16 rows of a tensor-core tile (only row 0 is stored). PACK on: program
    ``b*(H // GROUP) + kvh``, index list ``idx[b, kvh]``, M row ``g < GROUP`` is query head
    ``kvh*GROUP + g`` (rows past GROUP are zero and not stored). HEAD_MASK (PACK only): entry
    ``i`` of the list carries the int32 ``HMASK[b, kvh, i]``, and head ``g`` scores ``-inf`` where
    its bit ``g`` is clear, so every head attends exactly its own subset of the list (the running
    max is taken as 0 while a head has seen no key, keeping the online softmax NaN-free; a head
    with no key gives zeros). In all modes:
    q.K^T and p.V run as `tl.dot` (fp32 accumulation; exact IEEE fp32 for fp32 inputs), which
    keeps the K/V tiles out of registers and lets the compiler pipeline the gathers (cp.async,
    3 stages). ``IEEE``: fp32 operands, exact fp32 dots (fp32 inputs; also bf16 under the
    Triton 3.8 interpreter, whose bf16 ``tl.dot`` is wrong).
    """
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if PACK:
        b = pid // (H // GROUP)
        kvh = pid % (H // GROUP)
        lrow = kvh  # the index list's row
        head = kvh * GROUP + offs_m  # the query head of each M row
        mrow = offs_m < GROUP  # rows that exist and are stored
    else:
        b = pid // H
        h = pid % H
        kvh = h // GROUP
        lrow = h
        head = h + 0 * offs_m  # one query, replicated
        mrow = offs_m == 0
    cnt = tl.minimum(tl.load(CNT + b * stride_cb + lrow * stride_ch), cap)
    start = sp * CHUNK
    end = tl.minimum(cnt, start + CHUNK)
    pad = tl.load(PAD + b)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=mrow[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    b64 = b.to(tl.int64)  # caches can exceed 2^31 elements
    k_base = K + b64 * stride_kb + kvh * stride_kh
    v_base = V + b64 * stride_vb + kvh * stride_vh
    i_base = IDX + b * stride_ib + lrow * stride_ih
    hm_base = HMASK + b * stride_mb + lrow * stride_mh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        slot = (pad + tl.load(i_base + n, mask=nm, other=0)).to(tl.int64)
        kt = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None],
                     mask=nm[None, :] & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        vt = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :],
                     mask=nm[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        if HEAD_MASK:
            bits = tl.load(hm_base + n, mask=nm, other=0)
            keep = nm[None, :] & (((bits[None, :] >> offs_m[:, None]) & 1) != 0)
        else:
            keep = nm[None, :]
        s = tl.where(keep, (s * qk_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if HEAD_MASK:  # a head with no key so far: m_new = -inf; exp2 against 0 gives 0, not NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NSPLIT == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # count 0: acc = 0
        o_ptrs = OUT + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=mrow[:, None] & dmask[None, :])
    else:
        part = (b * H + head) * NSPLIT + sp  # partials are per query row: [B*H, NSPLIT]
        tl.store(M_PART + part, m_i, mask=mrow)
        tl.store(L_PART + part, l_i, mask=mrow)
        tl.store(O_PART + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mrow[:, None])


@triton.jit
def _combine_kernel(
    OUT, M_PART, L_PART, O_PART, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the splits of one row: rescale by exp2(m_split - m) and normalise."""
    pid, b, h = program_bh(H)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NSPLIT
    m = tl.load(M_PART + pid * NSPLIT + offs_s, mask=smask, other=float("-inf"))
    l = tl.load(L_PART + pid * NSPLIT + offs_s, mask=smask, other=0.0)
    o = tl.load(
        O_PART + (pid * NSPLIT + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=smask[:, None], other=0.0,
    )
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    l_tot = tl.sum(l * w, axis=0)
    acc = tl.sum(o * w[:, None], axis=0)
    res = acc / tl.where(l_tot > 0, l_tot, 1.0)  # nothing attended: acc = 0
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, res.to(OUT.dtype.element_ty), mask=offs_d < D)


def attention_schedule(
    rows: int,
    cap: int,
    head_dim: int,
    device: torch.device,
    num_splits: Optional[int] = None,
    elem_bytes: int = 2,
) -> tuple[int, int, int]:
    """``(block_n, chunk, num_splits)`` of :func:`sparse_decode_attention` for a shape.

    Tiles of ~16 KiB of K (64 keys at D = 128 in 16-bit; no spills on sm_90 at 3 stages).
    The index list is split only until there are about 2 programs per SM, and never into chunks
    of fewer than 8 tiles: one split needs no combine launch, which outweighs the occupancy a
    split gains at the operator benchmark's shapes (docs/notes/decode_tuning.md).
    """
    block_n = max(16, min(64, 16384 // (next_pow2(head_dim, 16) * elem_bytes)))
    if num_splits is None:
        num_splits = min(triton.cdiv(2 * num_sms(device), max(rows, 1)), triton.cdiv(cap, 8 * block_n))
    num_splits = max(1, int(num_splits))
    chunk = triton.cdiv(triton.cdiv(max(cap, 1), num_splits), block_n) * block_n
    return block_n, chunk, triton.cdiv(max(cap, 1), chunk)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pad: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    scale: float,
    *,
    pack: bool,
    num_splits: Optional[int],
    head_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Shared launcher: one program per query row (``pack`` off, idx [B, Hq, cap]) or per KV
    group with the G heads packed in M (``pack`` on, idx [B, Hkv, cap]; ``head_mask``, int32 like
    ``idx``, restricts head ``g`` of the group to the entries with bit ``g`` set)."""
    require_triton(q, k_cache, v_cache)
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    group = gqa_group(H, Hkv)
    lists = Hkv if pack else H  # index lists per sequence
    if idx.dim() != 3 or idx.shape[:2] != (B, lists) or count.shape != (B, lists):
        want = "[B, Hkv, cap] / [B, Hkv]" if pack else "[B, Hq, cap] / [B, Hq]"
        raise ValueError(f"idx {tuple(idx.shape)} / count {tuple(count.shape)}: expected {want} with B={B}, "
                         f"{'Hkv' if pack else 'Hq'}={lists}")
    if head_mask is not None and (not pack or head_mask.shape != idx.shape or head_mask.dtype != torch.int32):
        raise ValueError(f"head_mask {tuple(head_mask.shape)} {head_mask.dtype}: expected int32 of idx's shape "
                         f"{tuple(idx.shape)}, with one index list per KV head")
    cap = idx.shape[-1]
    out = torch.empty_like(q)
    if B * H == 0:
        return out
    if cap == 0:
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    if head_mask is not None and head_mask.stride(-1) != 1:
        head_mask = head_mask.contiguous()
    hmask = idx if head_mask is None else head_mask  # unused without a head mask
    rows = B * H
    programs = B * lists
    block_d = next_pow2(D, 16)
    block_m = max(16, next_pow2(group)) if pack else 16
    block_n, chunk, nsplit = attention_schedule(programs, cap, D, q.device, num_splits, q.element_size())
    if nsplit > 1:
        m_part = torch.empty((rows, nsplit), dtype=torch.float32, device=q.device)
        l_part = torch.empty((rows, nsplit), dtype=torch.float32, device=q.device)
        o_part = torch.empty((rows, nsplit, block_d), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = o_part = out  # unused
    _sparse_attn_kernel[(programs, nsplit)](
        q, k_cache, v_cache, pad, idx, count, hmask, out, m_part, l_part, o_part,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        idx.stride(0), idx.stride(1), count.stride(0), count.stride(1), hmask.stride(0), hmask.stride(1),
        out.stride(0), out.stride(1),
        float(scale) * _LOG2E, cap, chunk,
        H=H, GROUP=group, D=D, NSPLIT=nsplit, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16),
        PACK=pack, BLOCK_M=block_m, HEAD_MASK=head_mask is not None,
        num_warps=4, num_stages=3,
    )
    if nsplit > 1:
        _combine_kernel[(rows,)](
            out, m_part, l_part, o_part, out.stride(0), out.stride(1),
            H=H, D=D, NSPLIT=nsplit, SPLIT_PAD=next_pow2(nsplit, 2), BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, idx: torch.Tensor,
                            count: torch.Tensor, scale: float, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """Triton fused gather + online-softmax attention over each row's index list, no sync.

    One launch for all (batch, head) rows, split-K over the index list (flash-decoding) plus
    a small combine launch when the list is split for occupancy (``num_splits`` overrides the
    heuristic of :func:`attention_schedule`). Args and result as
    :func:`sparse_decode_attention_reference`.
    """
    return _attend(q, k_cache, v_cache, pad, idx, count, scale, pack=False, num_splits=num_splits)


def sparse_decode_attention_grouped(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, idx: torch.Tensor,
                                    count: torch.Tensor, scale: float, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """Triton attention for group-shared selection: one index list per KV head.

    One program per (batch, KV head, split) loads each selected K/V row once and serves all
    G = Hq / Hkv query heads of the group (heads in the M dimension of the two tensor-core
    dots); splits and combine as :func:`sparse_decode_attention`. Args and result as
    :func:`sparse_decode_attention_grouped_reference`.
    """
    return _attend(q, k_cache, v_cache, pad, idx, count, scale, pack=True, num_splits=num_splits)


def sparse_decode_attention_union(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, idx: torch.Tensor,
                                  count: torch.Tensor, scale: float, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """Triton attention over per-head index sets that reads each KV group's union of them once.

    :func:`~.group_union.group_union` (the Triton map builder, over the cache's ``S`` slots) turns
    the per-head sets into one list per KV head (the distinct indices of the G heads' sets,
    ``[B, Hkv, min(G*cap, S)]``) with a head bitmask per entry; the grouped kernel (one program per (batch,
    KV head, split), the G heads in the M rows of the dots) loads each listed K/V row once and masks
    every head to its own set. Same output as :func:`sparse_decode_attention` for lists without
    repeats or ``-1`` before their counts (a repeated index is attended once here, a ``-1`` not at
    all), with the K/V rows read per group being the union's size rather than the sum of the heads'
    counts. No host synchronisation. ``num_splits`` as in :func:`sparse_decode_attention`, applied
    to the union lists (length ``min(G*cap, S)``). Args and result as
    :func:`sparse_decode_attention_reference`; needs ``G = Hq / Hkv <= 32``.
    """
    if idx.dim() != 3 or idx.shape[:2] != q.shape[:2] or count.shape != q.shape[:2]:
        raise ValueError(f"idx {tuple(idx.shape)} / count {tuple(count.shape)}: expected [B, Hq, cap] / [B, Hq] "
                         f"with B={q.shape[0]}, Hq={q.shape[1]}")
    union_idx, head_mask, union_count = group_union(idx, count, k_cache.shape[1], k_cache.shape[2])
    return _attend(q, k_cache, v_cache, pad, union_idx, union_count, scale, pack=True, num_splits=num_splits,
                   head_mask=head_mask)


def sparse_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor,
                                      idx: torch.Tensor, count: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch reference of :func:`sparse_decode_attention` (vectorised, sync-free).

    Gathers the ``cap`` indexed K/V rows of every head (fixed shape) and masks the slots at or
    after ``count`` (it materialises ``[B, Hq, cap, D]``; the kernel does not).

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k_cache, v_cache: ``[B, Hkv, S, D]`` caches (same dtype as ``q``).
        pad: ``[B]`` int32 first real slot.
        idx: ``[B, Hq, cap]`` int32 real indices (valid before ``count``).
        count: ``[B, Hq]`` int32 number of valid indices.
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = gqa_group(Hq, Hkv)
    cap = idx.shape[-1]
    dev = q.device
    slots = (pad.long().view(B, 1, 1) + idx.long().clamp_min(0)).clamp(0, S - 1)
    b_ix = torch.arange(B, device=dev).view(B, 1, 1)
    h_ix = (torch.arange(Hq, device=dev) // G).view(1, Hq, 1)
    kg = k_cache[b_ix, h_ix, slots].float()  # [B, Hq, cap, D]
    vg = v_cache[b_ix, h_ix, slots].float()
    scores = (kg * q.float().unsqueeze(2)).sum(dim=-1) * scale  # [B, Hq, cap]
    valid = torch.arange(cap, device=dev) < count.long().unsqueeze(-1)
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p.unsqueeze(-1) * vg).sum(dim=-2) / denom.clamp_min(1e-30)
    out = torch.where(denom > 0, out, torch.zeros_like(out))
    return out.to(q.dtype)


def sparse_decode_attention_grouped_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor,
                                              idx: torch.Tensor, count: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch reference of :func:`sparse_decode_attention_grouped`.

    Query head ``h`` attends exactly (softmax, fp32) over the keys at slots
    ``pad[b] + idx[b, h // G, i]``, ``i < count[b, h // G]``: the per-head reference with each
    KV head's list given to all G heads of its group. Args and result as
    :func:`sparse_decode_attention_reference`, but one index list per KV head: ``idx [B, Hkv, cap]``
    and ``count [B, Hkv]``.
    """
    G = gqa_group(q.shape[1], k_cache.shape[1])
    return sparse_decode_attention_reference(
        q, k_cache, v_cache, pad, idx.repeat_interleave(G, dim=1), count.repeat_interleave(G, dim=1), scale
    )


def sparse_decode_attention_union_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor,
                                            idx: torch.Tensor, count: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch reference of :func:`sparse_decode_attention_union`: the per-head attention
    (:func:`sparse_decode_attention_reference`), since reading the union leaves every head's set unchanged."""
    return sparse_decode_attention_reference(q, k_cache, v_cache, pad, idx, count, scale)
