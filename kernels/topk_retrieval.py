"""Step 2 of the CIS decode pipeline: exact top-k of the middle region for retrieving heads.

Contract (docs/DECODE_PIPELINE.md §2): for rows with ``retrieve[b, h]``, score every real key
``j`` in ``[lo[b], hi[b])`` as ``scale * (q[b, h] . k_cache[b, kvh, pad[b] + j])`` (fp32) and
return the ``k`` best real indices in descending score order (ties: lower index first), ``-1``
padded when the region holds fewer than ``k`` keys. Rows not retrieving are all ``-1``.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launcher :func:`topk_retrieval`, and the PyTorch reference :func:`topk_retrieval_reference`.
"""

from __future__ import annotations

import torch

from ._common import gqa_group, next_pow2, num_sms, require_triton, tl, triton

__all__ = ["topk_retrieval", "topk_retrieval_reference", "compact_rows"]

# Design (H200: the cost is reading the K rows of the middle region, bandwidth bound):
#   1. `_compact_rows_kernel`: the retrieving rows' ids, packed to the front, and their count,
#      on the device (one program, a cumsum-scatter).
#   2. `_score_kernel`, grid (rows, splits of the sequence): a program whose compact row id is
#      at or past the count exits at once; the others stream their chunk of K once and write an
#      order-preserving int32 key of each fp32 score into a scratch row (4 bytes per 2*D read).
#   3. `_select_kernel`, one program per compact row (a row that does not retrieve writes its
#      -1 row, so the output needs no separate fill): radix refinement of the k-th largest key
#      (8-bit histogram passes over the scratch row, which sits in L2, only while the candidates
#      overflow a buffer of ~1.125 k: typically 1-2 passes), a collect pass, then a register
#      sort of the candidates packed as (key << 32 | ~index): descending score, ties by
#      ascending index, exactly the reference's order. Works for any k (k <= 4096 tested).
# Everything is fixed-shape (grids depend on B, Hq, S, k only), with no host synchronisation.


@triton.jit
def _compact_rows_kernel(FLAG, ORDER, COUNT, R, BLOCK: tl.constexpr):
    """Write the ids of the rows with FLAG set to ORDER[:count] (ascending), the other rows to
    ORDER[count:] (descending), and count to COUNT."""
    offs = tl.arange(0, BLOCK)
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for r0 in range(0, R, BLOCK):
        rows = r0 + offs
        inb = rows < R
        f = tl.load(FLAG + rows, mask=inb, other=0).to(tl.int32)
        f = tl.where(f != 0, 1, 0)
        pos = total + tl.cumsum(f, axis=0) - f
        tl.store(ORDER + pos, rows, mask=f != 0)
        # unflagged row number u (0-based, ascending) goes to R - 1 - u
        u = (r0 - total) + (offs - (pos - total))
        tl.store(ORDER + (R - 1 - u), rows, mask=inb & (f == 0))
        total += tl.sum(f, axis=0)
    tl.store(COUNT, total)


@triton.jit
def _orderable_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 is mapped to +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 2147483647)


@triton.jit
def _score_kernel(
    Q, K, PAD, LO, HI, ORDER, COUNT, KEYS,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_keys,
    scale, S, CHUNK,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Scores of one chunk of one retrieving row's middle region, as order-preserving keys."""
    c = tl.program_id(0)
    sp = tl.program_id(1)
    live = c < tl.load(COUNT)
    row = tl.load(ORDER + c, mask=live, other=0)
    b = row // H
    h = row % H
    pad = tl.load(PAD + b)
    lo = tl.maximum(tl.load(LO + b), 0)
    hi = tl.minimum(tl.load(HI + b), S - pad)
    start = lo + sp * CHUNK
    end = tl.minimum(hi, start + CHUNK)
    end = tl.where(live, end, start)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP) * stride_kh  # > 2^31 elements ok
    key_base = KEYS + c.to(tl.int64) * stride_keys
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        m = j < end
        kt = tl.load(
            k_base + (pad + j).to(tl.int64)[:, None] * stride_ks + offs_d[None, :],
            mask=m[:, None] & dmask[None, :], other=0.0,
        ).to(tl.float32)
        s = (tl.sum(kt * q[None, :], axis=1) * scale).to(tl.float32)  # fp32 even if a compiler passes scale as fp64
        tl.store(key_base + j, _orderable_key(s), mask=m)


@triton.jit
def _select_kernel(
    KEYS, CAND, OUT, PAD, LO, HI, ORDER, COUNT,
    stride_keys, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Exact top-K of one retrieving row's keys: radix refinement, collect, sort.

    Keys are viewed as u = key + 2^31 in [0, 2^32) (int64). After ``depth`` radix passes of 8
    bits, the keys whose top ``8*depth`` bits exceed ``prefix`` are all in the top-K, and of the
    ``n_eq`` keys whose top bits equal ``prefix``, ``krem`` more are needed. Passes run only
    while the candidates (above + equal) overflow the K_PAD buffer; at full depth the equal keys
    are exact ties, of which the ``krem`` lowest indices are taken. The candidates are then
    collected in index order and sorted by (key desc, index asc) in registers.
    """
    c = tl.program_id(0)
    live = c < tl.load(COUNT)
    row = tl.load(ORDER + c)
    if not live:  # a row that does not retrieve: all -1 (no separate fill of the output)
        offs_f = tl.arange(0, K_PAD)
        tl.store(OUT + row * K + offs_f, tl.full([K_PAD], -1, tl.int32), mask=offs_f < K)
    else:
        b = row // H
        pad = tl.load(PAD + b)
        lo = tl.maximum(tl.load(LO + b), 0)
        hi = tl.maximum(tl.minimum(tl.load(HI + b), S - pad), lo)
        n = hi - lo
        kk = tl.minimum(n, K)
        key_base = KEYS + c.to(tl.int64) * stride_keys
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        krem = kk
        n_eq = n
        prefix = (kk * 0).to(tl.int64)
        depth = kk * 0
        for p in tl.static_range(4):  # pass p resolves bits [24 - 8p, 32 - 8p)
            if kk - krem + n_eq > K_PAD:
                hist = tl.zeros([256], dtype=tl.int32)
                for n0 in range(lo, hi, BLOCK):
                    j = n0 + offs
                    m = j < hi
                    u = tl.load(key_base + j, mask=m, other=0).to(tl.int64) + 2147483648
                    match = m & ((u >> (32 - 8 * p)) == prefix)
                    digit = tl.where(match, (u >> (24 - 8 * p)) & 255, 0).to(tl.int32)
                    hist += tl.histogram(digit, 256)
                    # the non-matching lanes went to bin 0: take them out again
                    miss = BLOCK - tl.sum(match.to(tl.int32), axis=0)
                    hist -= tl.where(bins == 0, miss, 0)
                gt = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # matching, larger digit
                ge = gt + hist
                d = tl.max(tl.where((gt < krem) & (ge >= krem), bins, -1), axis=0)
                krem = krem - tl.sum(tl.where(bins == d, gt, 0), axis=0)
                n_eq = tl.sum(tl.where(bins == d, hist, 0), axis=0)
                prefix = prefix * 256 + d.to(tl.int64)
                depth = depth * 0 + (p + 1)
        shift = (32 - 8 * depth).to(tl.int64)
        take_eq = tl.where(depth == 4, krem, n_eq)
        # Collect, in index order: keys above the prefix, and take_eq of the keys equal to it.
        taken = kk * 0
        eq_seen = kk * 0
        cand_base = CAND + c * K_PAD
        for n0 in range(lo, hi, BLOCK):
            j = n0 + offs
            m = j < hi
            key = tl.load(key_base + j, mask=m, other=0).to(tl.int64)
            top = (key + 2147483648) >> shift
            eq = (m & (top == prefix)).to(tl.int32)
            eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
            sel = ((m & (top > prefix)) | ((eq != 0) & (eq_rank < take_eq))).to(tl.int32)
            pos = taken + tl.cumsum(sel, axis=0) - sel
            packed = (key << 32) | (2147483647 - j).to(tl.int64)
            tl.store(cand_base + pos, packed, mask=(sel != 0) & (pos < K_PAD))
            taken += tl.sum(sel, axis=0)
            eq_seen += tl.sum(eq, axis=0)
        tl.debug_barrier()
        offs_k = tl.arange(0, K_PAD)
        x = tl.load(cand_base + offs_k, mask=offs_k < taken, other=-9223372036854775808)
        x = tl.sort(x, descending=True)
        idx = (2147483647 - (x & 4294967295)).to(tl.int32)
        idx = tl.where(offs_k < kk, idx, -1)
        tl.store(OUT + row * K + offs_k, idx, mask=offs_k < K)


def compact_rows(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with ``flags`` set, packed to the front, on the device (no host sync).

    Args:
        flags: ``[R]`` bool.

    Returns:
        ``(order [R] int32, count [1] int32)``: ``order[:count]`` are the flagged row ids in
        ascending order, ``order[count:]`` the other rows in descending order.
    """
    flags = flags.reshape(-1).contiguous()
    R = flags.numel()
    order = torch.empty(R, dtype=torch.int32, device=flags.device)
    count = torch.empty(1, dtype=torch.int32, device=flags.device)
    _compact_rows_kernel[(1,)](flags, order, count, R, BLOCK=min(next_pow2(R, 16), 1024))
    return order, count


def _score_chunk(S: int, R: int, device: torch.device) -> int:
    """Keys per score program: enough programs for the GPU when about R/16 rows retrieve."""
    target_splits = triton.cdiv(4 * num_sms(device), max(1, R // 16))
    return max(256, min(4096, next_pow2(triton.cdiv(S, target_splits))))


def _candidate_capacity(k: int) -> int:
    """Candidate buffer of the select kernel: room above k so that 1-2 radix passes suffice."""
    roomy = next_pow2(k + k // 8 + 16)
    return roomy if roomy <= 4096 else next_pow2(k)


def topk_retrieval(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pad: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    retrieve: torch.Tensor,
    k: int,
    scale: float,
    *,
    _stop_after: str = "select",
) -> torch.Tensor:
    """Triton top-k retrieval: work only for retrieving rows, exact order, no host sync.

    Launches: row compaction (1 program), scoring (grid rows x sequence chunks; programs past
    the device-side count exit at once), selection (one program per row, same early exit).
    Scratch: ``[B*Hq, S]`` int32 keys and ``[B*Hq, ~1.125 k]`` int64 candidates.

    Args and result as :func:`topk_retrieval_reference`. ``_stop_after`` (``"compact"``,
    ``"score"``; benchmark stage timing only) returns the unfinished output after that launch.
    """
    require_triton(q, k_cache)
    B, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = gqa_group(H, Hkv)
    k = int(k)
    R = B * H
    if R == 0 or k == 0 or S == 0:
        return torch.full((B, H, k), -1, dtype=torch.int32, device=q.device)
    out = torch.empty((B, H, k), dtype=torch.int32, device=q.device)  # every row is written
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    order, count = compact_rows(retrieve)
    if _stop_after == "compact":
        return out
    keys = torch.empty((R, S), dtype=torch.int32, device=q.device)
    block_d = next_pow2(D, 16)
    block_n = max(16, min(128, 8192 // block_d))
    chunk = max(_score_chunk(S, R, q.device), block_n)
    _score_kernel[(R, triton.cdiv(S, chunk))](
        q, k_cache, pad, lo, hi, order, count, keys,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        keys.stride(0), float(scale), S, chunk,
        H=H, GROUP=group, D=D, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4,
    )
    if _stop_after == "score":
        return out
    k_pad = _candidate_capacity(k)
    cand = torch.empty((R, k_pad), dtype=torch.int64, device=q.device)
    _select_kernel[(R,)](
        keys, cand, out, pad, lo, hi, order, count,
        keys.stride(0), S, k,
        H=H, K_PAD=k_pad, BLOCK=min(1024, next_pow2(S, 16)),
        num_warps=8 if k_pad >= 1024 else 4,
    )
    return out


def topk_retrieval_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pad: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    retrieve: torch.Tensor,
    k: int,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :func:`topk_retrieval` (vectorised, sync-free).

    Scores every cache slot of every row (fixed shape), masks the slots outside each row's
    middle region and takes a stable descending sort, so equal scores keep index order.

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k_cache: ``[B, Hkv, S, D]`` key cache (same dtype as ``q``).
        pad: ``[B]`` int32 first real slot.
        lo, hi: ``[B]`` int32 middle region ``[lo, hi)`` in real indices (may be empty).
        retrieve: ``[B, Hq]`` bool, rows that retrieve.
        k: number of indices to return.
        scale: score scale (the attention softmax scale).

    Returns:
        ``[B, Hq, k]`` int32 real indices, best first, ``-1`` padded.
    """
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = gqa_group(Hq, Hkv)
    qf = q.float().reshape(B, Hkv, G, D)
    # fp32 matmul (TF32 is off by default for matmuls in PyTorch), then the scale: the same
    # order of operations as the kernel.
    scores = torch.matmul(qf, k_cache.float().transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    scores = scores.reshape(B, Hq, S)
    real = torch.arange(S, device=q.device).unsqueeze(0) - pad.long().unsqueeze(1)  # [B, S]
    in_mid = (real >= lo.long().unsqueeze(1)) & (real < hi.long().unsqueeze(1)) & (real >= 0)
    valid = in_mid.unsqueeze(1) & retrieve.unsqueeze(-1)  # [B, Hq, S]
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    kk = min(int(k), S)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
    n_valid = valid.sum(dim=-1, keepdim=True)  # [B, Hq, 1]
    rank = torch.arange(kk, device=q.device)
    idx = torch.where(rank < n_valid, order - pad.long().view(B, 1, 1), -1)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((B, Hq, int(k) - kk), -1)], dim=-1)
    return idx.to(torch.int32)
