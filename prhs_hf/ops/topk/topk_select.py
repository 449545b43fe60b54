"""The select half of top-k retrieval: exact top-k of the scored keys of each retrieving row.

:func:`~.topk_retrieval.topk_retrieval`'s score kernel writes, for every retrieving row, an
order-preserving int32 *key* of each fp32 score of its middle region (``KEYS[row, lo:hi]``, see
:func:`_orderable_key`) and the compacted row ids (``ORDER[:COUNT]`` the retrieving rows,
``ORDER[COUNT:]`` the others). The two selects here turn those into the ``k`` best real indices
of each row, descending score, ties by ascending index, ``-1`` padded (the contract of
docs/DECODE_PIPELINE.md §2); a row that does not retrieve gets all ``-1``. No host sync, fixed
shapes. Their reference is :func:`~.topk_retrieval.topk_retrieval_reference` (the tests compare
the whole retrieval with it).

* :func:`tilemax_select` (``k <= TILEMAX_MAX_K``): one program per row. The score kernel also
  wrote the largest key of every ``_TILE_SUB``-key sub-tile (:func:`_tile_max_store`); the k-th
  largest of those maxima is a lower bound ``theta`` of the row's k-th key (those k maxima are k
  distinct keys), so the program collects the keys ``>= theta`` (a superset of the top k, exact
  ties included) and selects among them: one launch, a few hundred candidates instead of the row.
* :func:`radix8_select` (larger k): 8-bit radix passes over the keys that still match the prefix
  (256-bin histograms summed atomically per row), a candidate collect, then a block sort and a
  merge finish, on persistent grids striding over the live (row, chunk) items where they can, so
  the rows that do not retrieve cost no programs. Its stages, in launch order (each a stop point,
  :data:`RADIX8_STOP_POINTS`, so a benchmark can time them apart): ``"passes"`` (four pass
  launches), ``"collect"``, ``"block_sort"`` (each block of MB = ``_MERGE_BLOCK`` candidates sorted
  in registers), then the merge finish, which gives every candidate its rank (the number of larger
  candidates of its row) and writes its index to that output slot. Two finishes, picked by
  :data:`MERGE_RANK`, the same output bit for bit:

  - ``"search"`` (one launch, grid rows x blocks): each program takes one sorted block and, for
    each other sorted block in turn, finds its candidates' ranks there by a branchless binary
    search, ``log2(MB) + 1`` gathers that each depend on the one before; blocks x that many
    dependent loads per program.
  - ``"count"`` (two launches): a persistent grid over the live (row, block, other block) items
    counts, for each candidate of the block, the larger entries of the other sorted block with no
    chain beyond two loads: the other block's ``FAN`` sub-block minima in one load (a broadcast
    compare says how many of its sub-blocks lie wholly above each candidate), then one gather of
    the single sub-block the candidate falls into (a broadcast compare again); the counts are
    added into an int32 rank per candidate (zeroed by the block sort) with ``atomic_add``. A
    scatter launch (grid rows x blocks) then writes each candidate's index at its rank.

Candidates are packed as ``key << 32 | ~index`` (int64): all distinct, and their descending order
is the output order (so a candidate's rank is its output slot, and the ranks are a permutation).
"""

from __future__ import annotations

import torch

from ..triton_support import next_pow2, num_sms, tl, triton

__all__ = ["HIST_ROW", "MERGE_RANK", "MERGE_RANKS", "RADIX8_STOP_POINTS", "TILEMAX_MAX_K", "candidate_capacity",
           "radix8_select", "select_chunk", "tilemax_scratch", "tilemax_select"]

#: Largest k whose default select is tilemax (the threshold needs k sub-tile maxima, and its
#: candidates grow with k * _TILE_SUB).
TILEMAX_MAX_K = 256
#: tilemax: keys per sub-tile whose maximum the score kernel writes (the candidates are at most
#: about k * _TILE_SUB), the candidate buffer (more candidates than that: the radix select of the
#: whole row), the radix passes that narrow theta (8 bits each), and the select's warps. The sizes
#: come from the candidate counts on a real model's keys (docs/notes/decode_tuning.md).
_TILE_SUB = 32
_TILE_CAP = 4096
_THETA_PASSES = 3
_TILEMAX_WARPS = 8
#: radix8: candidates per block of the merge finish.
_MERGE_BLOCK = 256
#: radix8's merge finishes (module docstring): a binary search per (block, other block), or the
#: counts of each (block, other block) pair added atomically, then a scatter.
MERGE_RANKS = ("search", "count")
#: The merge finish :func:`radix8_select` runs where its ``merge_rank`` is not given (read at each call).
MERGE_RANK = "search"
#: Where :func:`radix8_select` may stop early (``stop_after``): after its pass launches, its collect,
#: or its block sort; the merge finish is the rest.
RADIX8_STOP_POINTS = ("passes", "collect", "block_sort")
#: int32 per row of the radix8 histograms: 4 passes of 256 bins (the score kernel zeroes them).
HIST_ROW = 1024


def candidate_capacity(k: int) -> int:
    """Candidate buffer of a select: room above k so that one or two radix passes suffice."""
    roomy = next_pow2(k + k // 8 + 16)
    return roomy if roomy <= 4096 else next_pow2(k)


def select_chunk(S: int) -> int:
    """Keys per (row, chunk) item of the radix8 passes and collect, and per tilemax collect block
    (one tile of up to 2048)."""
    return min(2048, next_pow2(S, 16))


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent select grid: 4 per SM (they stride over the live items)."""
    return 4 * num_sms(device)


# ----------------------------------------------------------------------------- the key format


@triton.jit
def _orderable_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 is mapped to +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 2147483647)


@triton.jit
def _tile_max_store(TMAX_ROW, key, m, n0, lo, end, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """The largest key of each SUB-key sub-tile of a [BLOCK_N] score tile (sub-tile t of a row
    covers real keys ``[lo + t*SUB, lo + (t+1)*SUB)``; ``n0 - lo`` is a multiple of SUB) to
    ``TMAX_ROW[t]``. Masked lanes do not count."""
    km = tl.where(m, key, -2147483648)
    tmax = tl.max(tl.reshape(km, [BLOCK_N // SUB, SUB]), axis=1)
    t = tl.arange(0, BLOCK_N // SUB)
    tl.store(TMAX_ROW + (n0 - lo) // SUB + t, tmax, mask=n0 + t * SUB < end)


@triton.jit
def _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H: tl.constexpr):
    """``(live, row, lo, hi, kk)`` of compact row ``c`` (empty range when it is not live)."""
    live = c < tl.load(COUNT)
    row = tl.load(ORDER + c)
    b = row // H
    pad = tl.load(PAD + b)
    lo = tl.maximum(tl.load(LO + b), 0)
    hi = tl.maximum(tl.minimum(tl.load(HI + b), S - pad), lo)
    hi = tl.where(live, hi, lo)
    kk = tl.minimum(hi - lo, K)
    return live, row, lo, hi, kk


@triton.jit
def _packed_index(x):
    """The real index of packed candidates ``x`` (``key << 32 | ~index``), int32."""
    return (2147483647 - (x & 4294967295)).to(tl.int32)


@triton.jit
def _sort_store(cand_base, taken, kk, out_row, K, K_PAD: tl.constexpr):
    """The ``taken`` packed candidates at ``cand_base`` sorted in registers (descending: score
    desc, index asc), their indices written to ``out_row[:kk]``, -1 to ``out_row[kk:K]``."""
    offs_k = tl.arange(0, K_PAD)
    x = tl.load(cand_base + offs_k, mask=offs_k < taken, other=-9223372036854775808)
    x = tl.sort(x, descending=True)
    idx = tl.where(offs_k < kk, _packed_index(x), -1)
    tl.store(out_row + offs_k, idx, mask=offs_k < K)


@triton.jit
def _digit_step(hist, krem, bins):
    """One radix step from a pass's 256-bin histogram of the keys matching the prefix: the digit
    ``d`` of the krem-th largest, the keys still needed among those equal to it, and how many are."""
    gt = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # matching, larger digit
    ge = gt + hist
    d = tl.max(tl.where((gt < krem) & (ge >= krem), bins, -1), axis=0)
    return d, krem - tl.sum(tl.where(bins == d, gt, 0), axis=0), tl.sum(tl.where(bins == d, hist, 0), axis=0)


@triton.jit
def _matching_digits(u, m, prefix, p, bins, BLOCK: tl.constexpr):
    """256-bin histogram of digit ``p`` (bits ``[24 - 8p, 32 - 8p)``) of the values ``u`` (in
    ``[0, 2^32)``, lanes ``m``) whose higher bits equal ``prefix``."""
    match = m & ((u >> (32 - 8 * p)) == prefix)
    digit = tl.where(match, (u >> (24 - 8 * p)) & 255, 0).to(tl.int32)
    hist = tl.histogram(digit, 256)
    # the non-matching lanes went to bin 0: take them out again
    return hist - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), axis=0), 0)


# ----------------------------------------------------------------------------- tilemax


@triton.jit
def _row_radix_select(key_base, cand_base, out_row, lo, hi, K, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      PACKED: tl.constexpr = False):
    """Exact top-K of one row in one program (keys ``key_base[lo:hi]``, a candidate buffer of
    K_PAD at ``cand_base``), ``out_row[:K]`` written: the tilemax select's finish past its sort tier.

    Keys are viewed as u = key + 2^31 in [0, 2^32). After ``depth`` radix passes of 8 bits, the
    keys whose top ``8*depth`` bits exceed ``prefix`` are all in the top-K, and of the ``n_eq``
    keys whose top bits equal ``prefix``, ``krem`` more are needed. Passes run only while the
    candidates (above + equal) overflow the K_PAD buffer; at full depth the equal keys are exact
    ties, of which the ``krem`` lowest indices are taken. The candidates are then collected in
    index order and sorted in registers. PACKED: ``key_base[lo:hi]`` are packed candidates in
    index order instead of int32 keys at their index; they are selected by key, exact ties by
    position (= by index), and collected as they are; ``cand_base`` must not overlap them."""
    n = hi - lo
    kk = tl.minimum(n, K)
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
                if PACKED:
                    u = (tl.load(key_base + j, mask=m, other=0) >> 32) + 2147483648
                else:
                    u = tl.load(key_base + j, mask=m, other=0).to(tl.int64) + 2147483648
                hist += _matching_digits(u, m, prefix, p, bins, BLOCK)
            d, krem, n_eq = _digit_step(hist, krem, bins)
            prefix = prefix * 256 + d.to(tl.int64)
            depth = depth * 0 + (p + 1)
    shift = (32 - 8 * depth).to(tl.int64)
    take_eq = tl.where(depth == 4, krem, n_eq)
    # Collect, in index order: keys above the prefix, and take_eq of the keys equal to it.
    taken = kk * 0
    eq_seen = kk * 0
    for n0 in range(lo, hi, BLOCK):
        j = n0 + offs
        m = j < hi
        if PACKED:
            packed = tl.load(key_base + j, mask=m, other=0)
            key = packed >> 32
        else:
            key = tl.load(key_base + j, mask=m, other=0).to(tl.int64)
            packed = (key << 32) | (2147483647 - j).to(tl.int64)
        top = (key + 2147483648) >> shift
        eq = (m & (top == prefix)).to(tl.int32)
        eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
        sel = ((m & (top > prefix)) | ((eq != 0) & (eq_rank < take_eq))).to(tl.int32)
        pos = taken + tl.cumsum(sel, axis=0) - sel
        tl.store(cand_base + pos, packed, mask=(sel != 0) & (pos < K_PAD))
        taken += tl.sum(sel, axis=0)
        eq_seen += tl.sum(eq, axis=0)
    tl.debug_barrier()
    _sort_store(cand_base, taken, kk, out_row, K, K_PAD)


@triton.jit
def _tilemax_select_kernel(
    KEYS, TMAX, HOT, CAND, OUT, PAD, LO, HI, ORDER, COUNT,
    stride_keys, stride_tmax, stride_cand, S, K,
    H: tl.constexpr, SUB: tl.constexpr, K_PAD: tl.constexpr, CAP: tl.constexpr,
    RADIX_PAD: tl.constexpr, BLOCK: tl.constexpr, TBLOCK: tl.constexpr, THETA_PASSES: tl.constexpr,
    CBLOCK: tl.constexpr,
):
    """Exact top-K of one retrieving row in one program, from a threshold of sub-tile maxima.

    1. theta: a lower bound of the kk-th largest key. The kk-th largest sub-tile maximum is one
       (those kk maxima are kk distinct keys >= it); THETA_PASSES 8-bit radix passes over the
       ``cdiv(n, SUB)`` maxima narrow it to the low end of its digit bucket (still a lower bound).
       With fewer sub-tiles than kk, theta is the smallest key (every key is a candidate).
    2. Collect, in index order, every key >= theta (all of the top-kk, exact ties included):
       packed at CAND[c, :CAP]. Only the hot sub-tiles (maximum >= theta; their ids compacted in
       order to ``HOT[row]``) are read, BLOCK // SUB of them at a time.
    3. Up to K_PAD candidates: sort them in registers. Up to CAP: the one-program radix select over
       the candidates (:func:`_row_radix_select` on the packed buffer, CBLOCK at a time; its
       RADIX_PAD-sized buffer at ``CAND[c, CAP:]``). More than CAP (at most about kk * SUB, e.g.
       long runs of exact ties): the same radix select over the whole row, exact but slower.
    """
    c = tl.program_id(0)
    live = c < tl.load(COUNT)
    row = tl.load(ORDER + c)
    out_row = OUT + row.to(tl.int64) * K
    if not live:  # a row that does not retrieve: all -1 (no separate fill of the output)
        offs_f = tl.arange(0, K_PAD)
        tl.store(out_row + offs_f, tl.full([K_PAD], -1, tl.int32), mask=offs_f < K)
    else:
        b = row // H
        pad = tl.load(PAD + b)
        lo = tl.maximum(tl.load(LO + b), 0)
        hi = tl.maximum(tl.minimum(tl.load(HI + b), S - pad), lo)
        n = hi - lo
        kk = tl.minimum(n, K)
        nt = (n + SUB - 1) // SUB
        key_base = KEYS + row.to(tl.int64) * stride_keys
        tmax_base = TMAX + row.to(tl.int64) * stride_tmax
        cand_base = CAND + c.to(tl.int64) * stride_cand  # CAP collected candidates, then RADIX_PAD
        # 1. theta, as u = key + 2^31 in [0, 2^32): radix passes over the sub-tile maxima
        offs_t = tl.arange(0, TBLOCK)
        bins = tl.arange(0, 256)
        krem = kk
        prefix = (kk * 0).to(tl.int64)
        for p in tl.static_range(THETA_PASSES):  # pass p resolves bits [24 - 8p, 32 - 8p)
            hist = tl.zeros([256], dtype=tl.int32)
            for t0 in range(0, nt, TBLOCK):
                t = t0 + offs_t
                mt = t < nt
                u = tl.load(tmax_base + t, mask=mt, other=0).to(tl.int64) + 2147483648
                hist += _matching_digits(u, mt, prefix, p, bins, TBLOCK)
            d, krem, _ = _digit_step(hist, krem, bins)
            prefix = prefix * 256 + d.to(tl.int64)
        theta = (prefix << (32 - 8 * THETA_PASSES)) - 2147483648  # a key value (int64)
        theta = tl.where(nt >= kk, theta, -2147483648)
        # 2. collect every key >= theta, in index order: first the hot sub-tiles (maximum >= theta;
        # the others hold no candidate), compacted in order, then their keys, BLOCK // SUB sub-tiles
        # at a time
        hot_base = HOT + row.to(tl.int64) * stride_tmax
        n_hot = kk * 0
        for t0 in range(0, nt, TBLOCK):
            t = t0 + offs_t
            mt = t < nt
            hot = (mt & (tl.load(tmax_base + t, mask=mt, other=0).to(tl.int64) >= theta)).to(tl.int32)
            tl.store(hot_base + n_hot + tl.cumsum(hot, axis=0) - hot, t, mask=hot != 0)
            n_hot += tl.sum(hot, axis=0)
        tl.debug_barrier()  # the hot ids visible to every thread of this program
        offs_h = tl.arange(0, BLOCK // SUB)
        offs_in = tl.arange(0, SUB)
        taken = kk * 0
        for h0 in range(0, n_hot, BLOCK // SUB):
            hs = h0 + offs_h
            tid = tl.load(hot_base + hs, mask=hs < n_hot, other=0)
            j = tl.reshape(lo + tid[:, None] * SUB + offs_in[None, :], [BLOCK])  # ascending
            m = tl.reshape((hs < n_hot)[:, None] & (offs_in[None, :] >= 0), [BLOCK]) & (j < hi)
            key = tl.load(key_base + j, mask=m, other=0).to(tl.int64)
            sel = (m & (key >= theta)).to(tl.int32)
            pos = taken + tl.cumsum(sel, axis=0) - sel
            packed = (key << 32) | (2147483647 - j).to(tl.int64)
            tl.store(cand_base + pos, packed, mask=(sel != 0) & (pos < CAP))
            taken += tl.sum(sel, axis=0)
        # 3. finish
        tl.debug_barrier()
        if taken <= K_PAD:
            _sort_store(cand_base, taken, kk, out_row, K, K_PAD)
        elif taken <= CAP:  # the radix select of the candidates (in index order), then a RADIX_PAD sort
            _row_radix_select(cand_base, cand_base + CAP, out_row, 0, taken, K, RADIX_PAD, CBLOCK, PACKED=True)
        else:
            _row_radix_select(key_base, cand_base, out_row, lo, hi, K, RADIX_PAD, BLOCK)


def tilemax_scratch(R: int, S: int, block_n: int, block: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """``(SUB, TMAX)`` for the score launch: keys per sub-tile (it divides the score tile
    ``block_n`` and the collect block) and the ``[R, cdiv(S, SUB)]`` int32 sub-tile maxima."""
    sub = min(_TILE_SUB, block_n, block)
    return sub, torch.empty((R, triton.cdiv(S, sub)), dtype=torch.int32, device=device)


def tilemax_select(keys: torch.Tensor, tmax: torch.Tensor, sub: int, out: torch.Tensor, pad: torch.Tensor,
                   lo: torch.Tensor, hi: torch.Tensor, order: torch.Tensor, count: torch.Tensor, k: int,
                   block: int, warps: int | None = None) -> None:
    """Launch the tilemax select into ``out [B, H, k]`` (every row written): ``keys [R, S]`` and the
    sub-tile maxima ``tmax`` (of :func:`tilemax_scratch`) as the score kernel wrote them, ``order``
    / ``count`` the compacted rows, ``block`` keys per collect step (a multiple of ``sub``)."""
    R, S = keys.shape
    small = next_pow2(k, 16)  # the first sort tier: at least k slots, so every output slot is written
    k_pad = candidate_capacity(k)
    cap = max(small, k_pad, _TILE_CAP)
    cand = torch.empty((R, cap + k_pad), dtype=torch.int64, device=keys.device)
    _tilemax_select_kernel[(R,)](
        keys, tmax, torch.empty_like(tmax), cand, out, pad, lo, hi, order, count,
        keys.stride(0), tmax.stride(0), cand.stride(0), S, k,
        H=out.shape[1], SUB=sub, K_PAD=small, CAP=cap, RADIX_PAD=k_pad, BLOCK=block,
        TBLOCK=min(1024, next_pow2(triton.cdiv(S, sub), 16)), THETA_PASSES=_THETA_PASSES,
        CBLOCK=min(1024, cap),
        num_warps=_TILEMAX_WARPS if warps is None else warps,
    )


# ----------------------------------------------------------------------------- radix8


@triton.jit
def _radix_state(HIST_ROW, NPASS: tl.constexpr, kk, n, K_PAD: tl.constexpr):
    """Prefix after the first NPASS 8-bit passes of a row, from its summed histograms.

    Returns ``(prefix, krem, n_eq, depth)``: after ``depth`` passes the keys whose top bits
    exceed ``prefix`` are all in the top-kk, and ``krem`` of the ``n_eq`` keys equal to it are
    needed. A pass is applied only while the candidates (above + equal) overflow K_PAD (the
    same test the pass kernel used to decide whether to fill that histogram).
    """
    bins = tl.arange(0, 256)
    krem = kk
    n_eq = n
    prefix = (kk * 0).to(tl.int64)
    depth = kk * 0
    for p in tl.static_range(NPASS):
        if kk - krem + n_eq > K_PAD:
            d, krem, n_eq = _digit_step(tl.load(HIST_ROW + p * 256 + bins), krem, bins)
            prefix = (prefix << 8) + d.to(tl.int64)
            depth = depth * 0 + (p + 1)
    return prefix, krem, n_eq, depth


@triton.jit
def _radix_pass_kernel(
    KEYS, HIST, PAD, LO, HI, ORDER, COUNT, stride_keys, S, K, CHUNK, NCH,
    H: tl.constexpr, P: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Pass P: a persistent grid striding over the live (row, chunk) items (count x NCH, read on
    the device); each adds the histogram of digit P of its chunk's keys that match the prefix of
    passes < P to HIST[row, P] atomically (a no-op once the row is resolved)."""
    for w in range(tl.program_id(0), tl.load(COUNT) * NCH, tl.num_programs(0)):
        live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, w // NCH, S, K, H)
        hist_row = HIST + row.to(tl.int64) * 1024
        start = lo + (w % NCH) * CHUNK
        end = tl.minimum(hi, start + CHUNK)
        if start < end:
            prefix, krem, n_eq, depth = _radix_state(hist_row, P, kk, hi - lo, K_PAD)
            if kk - krem + n_eq > K_PAD:
                key_base = KEYS + row.to(tl.int64) * stride_keys
                offs = tl.arange(0, BLOCK)
                bins = tl.arange(0, 256)
                hist = tl.zeros([256], dtype=tl.int32)
                for n0 in range(start, end, BLOCK):
                    j = n0 + offs
                    m = j < end
                    u = tl.load(key_base + j, mask=m, other=0).to(tl.int64) + 2147483648
                    hist += _matching_digits(u, m, prefix, P, bins, BLOCK)
                tl.atomic_add(hist_row + P * 256 + bins, hist, mask=hist != 0)


@triton.jit
def _radix_collect_kernel(
    KEYS, HIST, TAKEN, CAND, PAD, LO, HI, ORDER, COUNT, stride_keys, S, K, CHUNK, NCH,
    H: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Candidates of each live (row, chunk) item (keys above the final prefix, and the needed keys
    equal to it), packed, appended to CAND[c] at an atomic offset; grid as the passes'."""
    for w in range(tl.program_id(0), tl.load(COUNT) * NCH, tl.num_programs(0)):
        c = w // NCH
        live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
        start = lo + (w % NCH) * CHUNK
        end = tl.minimum(hi, start + CHUNK)
        if start < end:
            prefix, krem, n_eq, depth = _radix_state(HIST + row.to(tl.int64) * 1024, 4, kk, hi - lo, K_PAD)
            shift = tl.maximum(32 - 8 * depth, 0).to(tl.int64)
            key_base = KEYS + row.to(tl.int64) * stride_keys
            offs = tl.arange(0, BLOCK)
            # Exact ties at full depth that overflow: take the krem lowest indices, so count the
            # equal keys before this chunk (only then; it is a rescan of the earlier chunks).
            eq_seen = kk * 0
            if depth == 4:
                if krem < n_eq:
                    for n0 in range(lo, start, BLOCK):
                        j = n0 + offs
                        key = tl.load(key_base + j, mask=j < start, other=0).to(tl.int64)
                        eq_seen += tl.sum(((j < start) & (key + 2147483648 == prefix)).to(tl.int32), axis=0)
            take_eq = tl.where(depth == 4, krem, n_eq)
            cand_base = CAND + c.to(tl.int64) * K_PAD
            for n0 in range(start, end, BLOCK):
                j = n0 + offs
                m = j < end
                key = tl.load(key_base + j, mask=m, other=0).to(tl.int64)
                top = (key + 2147483648) >> shift
                eq = (m & (top == prefix)).to(tl.int32)
                eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
                sel = ((m & (top > prefix)) | ((eq != 0) & (eq_rank < take_eq))).to(tl.int32)
                base = tl.atomic_add(TAKEN + row, tl.sum(sel, axis=0))
                pos = base + tl.cumsum(sel, axis=0) - sel
                packed = (key << 32) | (2147483647 - j).to(tl.int64)
                tl.store(cand_base + pos, packed, mask=(sel != 0) & (pos < K_PAD))
                eq_seen += tl.sum(eq, axis=0)


@triton.jit
def _live_taken(TAKEN, row, live, K_PAD: tl.constexpr):
    """Candidates collected for a row (0 for a row that does not retrieve: its TAKEN entry is
    never zeroed)."""
    return tl.where(live, tl.minimum(tl.load(TAKEN + row), K_PAD), 0)


@triton.jit
def _block_sort_kernel(
    CAND, TAKEN, RANK, PAD, LO, HI, ORDER, COUNT, S, K, NBLK,
    H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr, ZERO_RANK: tl.constexpr,
):
    """Merge finish, step 1: each block of MB candidates of a live row sorted in place
    (descending; INT64_MIN after the last candidate). Persistent grid over count x NBLK.
    ZERO_RANK (the "count" finish): the block's int32 ranks ``RANK[c, block]`` zeroed too."""
    for w in range(tl.program_id(0), tl.load(COUNT) * NBLK, tl.num_programs(0)):
        c = w // NBLK
        blk = w % NBLK
        live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
        taken = _live_taken(TAKEN, row, live, K_PAD)
        if blk * MB < taken:
            offs = blk * MB + tl.arange(0, MB)
            cand = CAND + c.to(tl.int64) * K_PAD + offs
            x = tl.load(cand, mask=offs < taken, other=-9223372036854775808)
            tl.store(cand, tl.sort(x, descending=True))
            if ZERO_RANK:
                tl.store(RANK + c.to(tl.int64) * K_PAD + offs, tl.zeros([MB], dtype=tl.int32))


@triton.jit
def _merge_out_block(TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K,
                     H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr):
    """Program (c, blk) of a merge finish's output launch (grid rows x blocks): -1 written to the
    output slots ``[kk, K)`` among the block's MB (a row that does not retrieve: all of them).
    Returns ``(c, taken, kk, offs_c, out_row)``: the block's candidate / slot offsets ``offs_c``."""
    c = tl.program_id(0)
    blk = tl.program_id(1)
    live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
    offs_c = blk * MB + tl.arange(0, MB)
    out_row = OUT + row.to(tl.int64) * K
    tl.store(out_row + offs_c, tl.full([MB], -1, tl.int32), mask=(offs_c >= kk) & (offs_c < K))
    return c, _live_taken(TAKEN, row, live, K_PAD), kk, offs_c, out_row


@triton.jit
def _store_ranked(out_row, x, rank, offs_c, taken, kk):
    """Each real candidate ``x`` (lanes ``offs_c < taken``) of rank below kk: its index to
    ``out_row[rank]``."""
    tl.store(out_row + rank, _packed_index(x), mask=(offs_c < taken) & (rank < kk))


@triton.jit
def _merge_rank_kernel(
    CAND, TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr, LOG_MB: tl.constexpr,
):
    """Merge finish "search", step 2, grid (rows, blocks of MB output slots / candidates): the
    rank of each candidate of sorted block ``blk`` is the number of larger candidates in every
    sorted block (a branchless binary search per block: LOG_MB + 1 gathers; all packed values
    differ, so within its own block that is its position), written to OUT[row, rank] when
    rank < kk. Output slots [kk, K) of the block get -1 (a row that does not retrieve: all of them)."""
    c, taken, kk, offs_c, out_row = _merge_out_block(TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K, H, K_PAD, MB)
    if tl.program_id(1) * MB < taken:
        cand_base = CAND + c.to(tl.int64) * K_PAD
        x = tl.load(cand_base + offs_c, mask=offs_c < taken, other=-9223372036854775808)
        rank = tl.zeros([MB], dtype=tl.int32)
        for b0 in range(0, taken, MB):
            cnt = tl.zeros([MB], dtype=tl.int32)  # sorted block b0: entries > x are a prefix
            for s in tl.static_range(LOG_MB + 1):
                half = MB >> s  # MB, MB/2, ..., 1 (a constexpr)
                probe = cnt + (half - 1)
                y = tl.load(cand_base + b0 + probe, mask=probe < MB, other=-9223372036854775808)
                cnt = tl.where(y > x, cnt + half, cnt)
            rank += cnt
        _store_ranked(out_row, x, rank, offs_c, taken, kk)


@triton.jit
def _merge_count_kernel(
    CAND, TAKEN, RANK, PAD, LO, HI, ORDER, COUNT, S, K, NBLK,
    H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr, FAN: tl.constexpr,
):
    """Merge finish "count", step 2: a persistent grid over the live (row, block, other block)
    items, count x NBLK x NBLK. Item (c, blk, other) adds to ``RANK[c, j]``, for each candidate
    ``x_j`` of sorted block ``blk``, the number of entries of sorted block ``other`` larger than
    it (a prefix of that block: within its own block, its position). The other block is FAN
    sub-blocks of SUB = MB / FAN entries: the sub-blocks whose last (smallest) entry is larger
    than ``x_j`` lie wholly above it (one [FAN] load, a [MB, FAN] compare), and of the next one
    a prefix (one [MB, SUB] gather of that sub-block, a [MB, SUB] compare)."""
    SUB: tl.constexpr = MB // FAN
    offs = tl.arange(0, MB)
    offs_t = tl.arange(0, FAN)
    offs_s = tl.arange(0, SUB)
    for w in range(tl.program_id(0), tl.load(COUNT) * NBLK * NBLK, tl.num_programs(0)):
        c = w // (NBLK * NBLK)
        blk = (w // NBLK) % NBLK
        other = w % NBLK
        live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
        taken = _live_taken(TAKEN, row, live, K_PAD)
        if (blk * MB < taken) & (other * MB < taken):
            cand_base = CAND + c.to(tl.int64) * K_PAD
            offs_c = blk * MB + offs
            x = tl.load(cand_base + offs_c, mask=offs_c < taken, other=-9223372036854775808)
            other_base = cand_base + other * MB
            smallest = tl.load(other_base + offs_t * SUB + (SUB - 1))  # of each sub-block
            above = tl.sum((smallest[None, :] > x[:, None]).to(tl.int32), axis=1)  # sub-blocks wholly above
            probe = above[:, None] * SUB + offs_s[None, :]  # the sub-block x falls into (none when above == FAN)
            y = tl.load(other_base + probe, mask=probe < MB, other=-9223372036854775808)
            cnt = above * SUB + tl.sum((y > x[:, None]).to(tl.int32), axis=1)
            tl.atomic_add(RANK + c.to(tl.int64) * K_PAD + offs_c, cnt, mask=(offs_c < taken) & (cnt != 0))


@triton.jit
def _rank_scatter_kernel(
    CAND, TAKEN, RANK, OUT, PAD, LO, HI, ORDER, COUNT, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr,
):
    """Merge finish "count", step 3, grid (rows, blocks of MB output slots / candidates): each
    candidate of sorted block ``blk`` written to OUT[row, rank] when its summed rank < kk; output
    slots [kk, K) of the block get -1 (a row that does not retrieve: all of them)."""
    c, taken, kk, offs_c, out_row = _merge_out_block(TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K, H, K_PAD, MB)
    if tl.program_id(1) * MB < taken:
        x = tl.load(CAND + c.to(tl.int64) * K_PAD + offs_c, mask=offs_c < taken, other=-9223372036854775808)
        rank = tl.load(RANK + c.to(tl.int64) * K_PAD + offs_c, mask=offs_c < taken, other=0)
        _store_ranked(out_row, x, rank, offs_c, taken, kk)


def _count_fan(mb: int) -> int:
    """Sub-blocks per sorted block of ``mb`` (a power of two) in the "count" finish:
    ``2^ceil(log2(mb) / 2)``, so that both of its compares are about ``mb * sqrt(mb)``
    (mb = 256: 16 sub-blocks of 16)."""
    return 1 << (mb.bit_length() // 2)


def radix8_select(keys: torch.Tensor, hist: torch.Tensor, taken: torch.Tensor, out: torch.Tensor,
                  pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, order: torch.Tensor,
                  count: torch.Tensor, k: int, block: int, warps: int | None = None,
                  merge_rank: str | None = None, stop_after: str | None = None) -> None:
    """Launch the radix8 select into ``out [B, H, k]`` (every row written): ``keys [R, S]`` as the
    score kernel wrote them, ``hist [R, HIST_ROW]`` and ``taken [R]`` int32 zeroed by it for the
    retrieving rows, ``order`` / ``count`` the compacted rows, ``block`` keys per (row, chunk) item.

    ``merge_rank``: the merge finish, one of :data:`MERGE_RANKS` (None: :data:`MERGE_RANK`), the
    same output. ``stop_after``: None runs the whole select; one of :data:`RADIX8_STOP_POINTS`
    returns after that stage's launches with ``out`` not written (a benchmark times each stage).

    Raises:
        ValueError: ``merge_rank`` (or :data:`MERGE_RANK`) not in :data:`MERGE_RANKS`, or
            ``stop_after`` neither None nor in :data:`RADIX8_STOP_POINTS`.
    """
    finish = MERGE_RANK if merge_rank is None else merge_rank
    if finish not in MERGE_RANKS:
        name = "MERGE_RANK" if merge_rank is None else "merge_rank"
        raise ValueError(f"radix8_select: {name}={finish!r}; expected one of {MERGE_RANKS}")
    if stop_after is not None and stop_after not in RADIX8_STOP_POINTS:
        raise ValueError(f"radix8_select: stop_after={stop_after!r}; expected None or one of {RADIX8_STOP_POINTS}")
    R, S = keys.shape
    H = out.shape[1]
    k_pad = candidate_capacity(k)
    cand = torch.empty((R, k_pad), dtype=torch.int64, device=keys.device)
    warps = 4 if warps is None else warps
    nch = triton.cdiv(S, block)
    grid = (min(R * nch, _persistent_programs(keys.device)),)
    for p in range(4):
        _radix_pass_kernel[grid](
            keys, hist, pad, lo, hi, order, count, keys.stride(0), S, k, block, nch,
            H=H, P=p, K_PAD=k_pad, BLOCK=block, num_warps=warps,
        )
    if stop_after == "passes":
        return
    _radix_collect_kernel[grid](
        keys, hist, taken, cand, pad, lo, hi, order, count, keys.stride(0), S, k, block, nch,
        H=H, K_PAD=k_pad, BLOCK=block, num_warps=warps,
    )
    if stop_after == "collect":
        return
    mb = min(_MERGE_BLOCK, k_pad)
    nblk = k_pad // mb  # k_pad >= k, both powers of two
    counted = finish == "count"
    rank = torch.empty((R, k_pad) if counted else (1,), dtype=torch.int32, device=keys.device)
    _block_sort_kernel[(min(R * nblk, _persistent_programs(keys.device)),)](
        cand, taken, rank, pad, lo, hi, order, count, S, k, nblk,
        H=H, K_PAD=k_pad, MB=mb, ZERO_RANK=counted, num_warps=4,
    )
    if stop_after == "block_sort":
        return
    if counted:
        _merge_count_kernel[(min(R * nblk * nblk, _persistent_programs(keys.device)),)](
            cand, taken, rank, pad, lo, hi, order, count, S, k, nblk,
            H=H, K_PAD=k_pad, MB=mb, FAN=_count_fan(mb), num_warps=4,
        )
        _rank_scatter_kernel[(R, nblk)](
            cand, taken, rank, out, pad, lo, hi, order, count, S, k,
            H=H, K_PAD=k_pad, MB=mb, num_warps=4,
        )
    else:
        _merge_rank_kernel[(R, nblk)](
            cand, taken, out, pad, lo, hi, order, count, S, k,
            H=H, K_PAD=k_pad, MB=mb, LOG_MB=mb.bit_length() - 1, num_warps=4,
        )
