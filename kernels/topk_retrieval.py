"""Step 2 of the CIS decode pipeline: exact top-k of the middle region for retrieving heads.

Contract (docs/DECODE_PIPELINE.md §2): for rows with ``retrieve[b, h]``, score every real key
``j`` in ``[lo[b], hi[b])`` as ``scale * (q[b, h] . k_cache[b, kvh, pad[b] + j])`` (fp32) and
return the ``k`` best real indices in descending score order (ties: lower index first), ``-1``
padded when the region holds fewer than ``k`` keys. Rows not retrieving are all ``-1``.

Group-shared variant (:func:`topk_retrieval_grouped`): one index list per KV head, ranking
each key by the maximum over the group's query heads of the scaled score (see its reference
for why the maximum).

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launchers :func:`topk_retrieval` / :func:`topk_retrieval_grouped`, and the PyTorch references
:func:`topk_retrieval_reference` / :func:`topk_retrieval_grouped_reference`.
"""

from __future__ import annotations

import torch

from ._common import gqa_group, interpreting, next_pow2, num_sms, require_triton, tl, triton

__all__ = [
    "topk_retrieval",
    "topk_retrieval_reference",
    "topk_retrieval_grouped",
    "topk_retrieval_grouped_reference",
    "compact_rows",
    "SCORE_MODES",
    "SELECT_MODES",
    "STOP_POINTS",
    "TILEMAX_MAX_K",
    "default_select",
]

# Design (H200: the cost is reading the K rows of the middle region, bandwidth bound):
#   1. Compaction: the retrieving rows' ids packed to the front and their count, and the same
#      for the KV groups (b, kvh) that hold at least one retrieving row. With the group score
#      kernel (the default) that kernel does it: every program finds the live groups from the
#      flags in registers and program 0 writes the rows' order for the select (one launch per
#      layer fewer); else `_compact_kernel` (one program) runs first.
#   2. Scoring. `_group_score_kernel` (default), a persistent grid (2 programs per SM) striding
#      over the (live group, split) items; the split count comes from the device-side live count
#      (about one item per program, so a step where every group retrieves reads long chunks and
#      one where few do reads short ones; a host-side guess of the live count had sized all steps
#      for 1 row in 16, e.g. 8,448 programs of 512 keys on llama2-7b's shape). An item of a live
#      group streams its chunk of the KV head's keys ONCE and scores all G
#      query heads of the group with one tensor-core dot per tile (the G heads in the M
#      dimension, padded to 16); it writes an order-preserving int32 key of each fp32 score
#      into the scratch row of every retrieving head (grouped mode: one row per group, the
#      maximum over the heads). `_score_kernel` (``_score="row"``, the old path) does the same
#      per query row, so a group with several retrieving heads reads its keys several times.
#   3. Selection. Split radix select (``_select="split"``, opt-in: exact, but measured slower
#      than the one-program select on the H200, 0.154 vs 0.098 ms for 32 rows x 16k, because
#      its 2048-bin histograms and rank compares are not yet cheap; see decode_tuning.md): every stage runs on a
#      grid (rows, chunks of the region) so that ~16 programs per row are in flight instead of
#      one. `_radix_pass_kernel` x3: 11/11/10-bit digit histograms of the keys that still
#      match the prefix, atomically summed per row (each program re-derives the prefix from
#      the earlier histograms, 2048 bins, so no extra launch resolves them; a pass whose row
#      is already resolved is a no-op); `_radix_collect_kernel`: the candidates (keys above the
#      prefix, and the needed keys equal to it; exact ties beyond the buffer: the lowest
#      indices, ranked across chunks), packed as (key << 32 | ~index), appended with one
#      atomic per tile; `_rank_scatter_kernel`, grid (rows, blocks of 64 candidates): each
#      candidate's rank is the number of larger packed candidates (they are all distinct), and
#      the ones ranked below k are written there: descending score, ties by ascending index,
#      exactly the reference's order, whatever order the atomics appended them in.
#      `_select_kernel` (``_select="row"``, the default until 2026-12-01): one program per row does
#      all of it serially (8-bit radix passes, collect, register sort); latency bound.
#      ``_select="radix8"`` (the default above k = 256: measured on the H200, B16/16k 32/8, 37 retrieving rows,
#      54 vs 100 us for "row", same output; docs/notes/decode_tuning.md): the same split kernels with
#      8-bit digits (256-bin histograms, 4 passes, each a no-op once resolved) on persistent grids
#      (4 programs per SM striding over the live (row, chunk) items), then `_block_sort_kernel`
#      (blocks of 256 candidates sorted in place) and `_merge_rank_kernel` (rank = sum over the
#      sorted blocks of a binary-search count of larger candidates); when the candidate buffer is
#      one block (k_pad <= 256), the finish is `_row_sort_kernel` alone (one launch fewer).
#      ``"radix8_sort"``: the same passes and collect, then one register sort per row
#      (`_row_sort_kernel`) at every k.
#      ``"radix8_fused"`` (opt-in, not yet measured): radix8 with pass 0 done by the score
#      kernel on the keys in registers (each program adds its chunk's 256-bin digit-0
#      histogram of every row it writes atomically; `_compact_kernel`, the launch before,
#      zeroes that histogram of the compacted rows), so the select launches passes 1-3 only:
#      one launch and one full read of the keys fewer.
#      ``_select="tilemax"`` (the default up to k = 256, e.g. cis.yaml's 88; H200, B32/16k 12/2, 71
#      rows, k 88: 19.8 vs 52.1 us for radix8 on random data, one launch instead of six): the score
#      kernel also writes the largest key of every 32-key sub-tile; `_tilemax_select_kernel`, one
#      program per row, takes the k-th largest of those maxima as a threshold (a lower bound of the
#      k-th key: those k maxima are k distinct keys), collects the keys at or above it in index
#      order, and finishes with a register sort when they fit k rounded up to a power of two, else
#      with the one-program radix select of the candidates (of the whole row past 4096 of them).
# Everything is fixed-shape (grids depend on B, Hq, Hkv, S, k only), no host synchronisation.

#: Scoring kernels of :func:`topk_retrieval` (``_score=``): the group-aware default, the old one.
SCORE_MODES = ("group", "row")
#: Selection kernels (``_select=``): one program per row, split radix select with
#: 11-bit digits and rank compares, split radix select with 8-bit digits and a merge finish,
#: the same with a per-row register sort finish, radix8 with its first pass's histogram built
#: by the score kernel, one program per row from a threshold of sub-tile maxima. The default
#: (``"auto"``, :func:`default_select`) is ``"tilemax"`` up to k = 256 and ``"radix8"`` above
#: (fastest measured).
SELECT_MODES = ("row", "split", "radix8", "radix8_sort", "radix8_fused", "tilemax")
#: Largest k whose default select is ``"tilemax"`` (above it ``"radix8"``: the threshold from k
#: sub-tile maxima needs k of them, and its candidates grow with k * _TILE_SUB).
TILEMAX_MAX_K = 256


def default_select(k: int) -> str:
    """The select kernel ``_select="auto"`` (the default) runs for top-``k``."""
    return "tilemax" if int(k) <= TILEMAX_MAX_K else "radix8"


#: Where ``_stop_after=`` may stop (probe breakdowns): "passes"/"collect" stop inside the
#: select (every select mode), "blocksort" after the first merge step (merge finishes only).
#: With ``"radix8_fused"``, "score" includes the pass-0 histogram built by the score kernel.
#: Where the group score kernel compacts the flags itself (the default), "compact" launches
#: nothing and "score" includes the compaction.
STOP_POINTS = ("compact", "score", "passes", "collect", "blocksort", "select")

#: Digit bits and passes of the split selects: 11/11/10-bit digits (bits [21, 32), [10, 21),
#: [0, 10)) or four 8-bit ones.
_SPLIT_DIGITS = {"split": (11, 3), "radix8": (8, 4), "radix8_sort": (8, 4), "radix8_fused": (8, 4)}
#: Selects whose pass-0 histogram is built by the score kernel, and those with the merge finish.
_FUSED_SELECTS = ("radix8_fused",)
_MERGE_SELECTS = ("radix8", "radix8_fused")
_MERGE_BLOCK = 256  # candidates per block of the merge finish
_RANK_BLOCK = 64  # candidates ranked per program of _rank_scatter_kernel
_RANK_TILE = 256  # candidates compared per step
#: ``_select="tilemax"``: keys per sub-tile whose maximum the score kernel writes (the candidates
#: are at most about k * _TILE_SUB), the candidate buffer (more candidates than that: the radix
#: select of the whole row), and the radix passes that narrow theta (8 bits each). Measured on
#: the real Qwen2.5-Coder-1.5B (16k tokens of CoQA stories, k 88, 2,688 (layer, head, query)
#: rows, CPU): candidates median 339, 99th percentile 938, largest 2,209 with three passes (two:
#: 349 / 1,419 / 9,303); 16-key sub-tiles: 246 / 568 / 980.
_TILE_SUB = 32
_TILE_CAP = 4096
_THETA_PASSES = 3
#: Warps of the tilemax select (H200, B32/16k 12/2, 71 rows, k 88: 19.8 us with 8, 22.5 with 4).
_TILEMAX_WARPS = 8


@triton.jit
def _any_flag(FLAG, items, inb, GROUP: tl.constexpr, GP: tl.constexpr):
    """1 where any of item ``i``'s GROUP flags ``FLAG[i*GROUP : (i+1)*GROUP]`` is set, else 0
    (0 where ``inb`` is false)."""
    offs_g = tl.arange(0, GP)
    fl = tl.load(FLAG + items[:, None] * GROUP + offs_g[None, :],
                 mask=inb[:, None] & (offs_g[None, :] < GROUP), other=0).to(tl.int32)
    return tl.where(tl.max(tl.where(fl != 0, 1, 0), axis=1) != 0, 1, 0)


@triton.jit
def _compact_into(FLAG, ORDER, COUNT, R, GROUP: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
    """Item ``i < R`` is flagged when any of ``FLAG[i*GROUP : (i+1)*GROUP]`` is set: write the
    flagged ids to ORDER[:count] (ascending), the others to ORDER[count:] (descending)."""
    offs = tl.arange(0, BLOCK)
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for r0 in range(0, R, BLOCK):
        rows = r0 + offs
        inb = rows < R
        f = _any_flag(FLAG, rows, inb, GROUP, GP)
        pos = total + tl.cumsum(f, axis=0) - f
        tl.store(ORDER + pos, rows, mask=f != 0)
        # unflagged item number u (0-based, ascending) goes to R - 1 - u
        u = (r0 - total) + (offs - (pos - total))
        tl.store(ORDER + (R - 1 - u), rows, mask=inb & (f == 0))
        total += tl.sum(f, axis=0)
    tl.store(COUNT, total)
    return total


@triton.jit
def _live_groups(FLAG, NG, GROUP: tl.constexpr, GP: tl.constexpr, NGP: tl.constexpr):
    """The compaction of ``_compact_into(FLAG, ..., NG, GROUP, ...)`` in registers, for a kernel
    that needs it without a launch before: ``(offs, live, pos, count)``, group ``offs[i]`` is live
    (any of its GROUP flags set) and then the ``pos[i]``-th live one; ``count`` live groups."""
    offs = tl.arange(0, NGP)
    live = _any_flag(FLAG, offs, offs < NG, GROUP, GP)
    pos = tl.cumsum(live, axis=0) - live
    return offs, live, pos, tl.sum(live, axis=0)


@triton.jit
def _nth_live(offs, live, pos, c):
    """The id of live group number ``c`` (of :func:`_live_groups`)."""
    return tl.sum(tl.where((live != 0) & (pos == c), offs, 0), axis=0)


@triton.jit
def _compact_kernel(
    FLAG, ORDER, COUNT, GORDER, GCOUNT, HIST, R,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr,
    WITH_GROUPS: tl.constexpr, ZERO_HIST: tl.constexpr = False, HIST_ROW: tl.constexpr = 1,
    HIST_BINS: tl.constexpr = 1, ZB: tl.constexpr = 32,
):
    """Rows (``R`` flags) and, with WITH_GROUPS, groups of GROUP consecutive rows: one launch.

    ZERO_HIST (``_select="radix8_fused"``): also zero ``HIST[row, :HIST_BINS]`` (the pass-0
    histogram, row stride HIST_ROW) of every flagged row, ZB rows per store, so that the score
    kernel launched after it can add into it atomically (a zeroing inside the score launch could
    not be ordered before the other programs' atomics)."""
    count = _compact_into(FLAG, ORDER, COUNT, R, 1, 1, BLOCK)
    if WITH_GROUPS:
        _compact_into(FLAG, GORDER, GCOUNT, R // GROUP, GROUP, GP, BLOCK_G)
    if ZERO_HIST:
        tl.debug_barrier()  # ORDER's stores visible to every thread of this program
        offs_r = tl.arange(0, ZB)
        bins = tl.arange(0, HIST_BINS)
        for c0 in range(0, count, ZB):
            cr = c0 + offs_r
            rows = tl.load(ORDER + cr, mask=cr < count, other=0)
            tl.store(HIST + rows.to(tl.int64)[:, None] * HIST_ROW + bins[None, :],
                     tl.zeros([ZB, HIST_BINS], tl.int32), mask=(cr < count)[:, None])


@triton.jit
def _orderable_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 is mapped to +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 2147483647)


@triton.jit
def _digit0(key):
    """Pass-0 digit of an orderable key: the top 8 bits of ``key + 2^31`` (int32 arithmetic)."""
    return (key >> 24) + 128


@triton.jit
def _score_region(PAD, LO, HI, b, S):
    """``(pad, lo, hi)``: sequence ``b``'s left pad and its middle region ``[lo, hi)`` (in
    positions after the pad), clamped to the cache: the range both score kernels split."""
    pad = tl.load(PAD + b)
    lo = tl.maximum(tl.load(LO + b), 0)
    hi = tl.minimum(tl.load(HI + b), S - pad)
    return pad, lo, hi


@triton.jit
def _score_kernel(
    Q, K, PAD, LO, HI, ORDER, COUNT, KEYS, HIST, TMAX,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_keys, stride_tmax,
    scale, S, CHUNK,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FUSE_HIST: tl.constexpr = False, HIST_ROW: tl.constexpr = 1,
    TILE_MAX: tl.constexpr = False, SUB: tl.constexpr = 32,
):
    """Old path (``_score="row"``): scores of one chunk of one retrieving row's middle region,
    as order-preserving keys, into that row's scratch row. FUSE_HIST: the 256-bin histogram
    of the keys' pass-0 digit, built in registers, is added atomically to ``HIST[row, :256]``
    (zeroed by the launcher before this launch). TILE_MAX: the sub-tile maxima as the group
    score kernel writes them."""
    c = tl.program_id(0)
    sp = tl.program_id(1)
    live = c < tl.load(COUNT)
    row = tl.load(ORDER + c, mask=live, other=0)
    b = row // H
    h = row % H
    pad, lo, hi = _score_region(PAD, LO, HI, b, S)
    start = lo + sp * CHUNK
    end = tl.where(live, tl.minimum(hi, start + CHUNK), start)  # a dead program scores nothing
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP) * stride_kh  # > 2^31 elements ok
    key_base = KEYS + row.to(tl.int64) * stride_keys
    hist = tl.zeros([256], dtype=tl.int32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        m = j < end
        kt = tl.load(
            k_base + (pad + j).to(tl.int64)[:, None] * stride_ks + offs_d[None, :],
            mask=m[:, None] & dmask[None, :], other=0.0,
        ).to(tl.float32)
        s = (tl.sum(kt * q[None, :], axis=1) * scale).to(tl.float32)  # fp32 even if a compiler passes scale as fp64
        key = _orderable_key(s)
        tl.store(key_base + j, key, mask=m)
        if TILE_MAX:
            _tile_max_store(TMAX + row.to(tl.int64) * stride_tmax, key, m, n0, lo, end, BLOCK_N, SUB)
        if FUSE_HIST:
            hist += tl.histogram(_digit0(key), 256, mask=m)
    if FUSE_HIST:
        tl.atomic_add(HIST + row.to(tl.int64) * HIST_ROW + tl.arange(0, 256), hist, mask=hist != 0)


@triton.jit
def _group_score_kernel(
    Q, K, PAD, LO, HI, FLAG, GORDER, GCOUNT, KEYS, HIST, TAKEN, TMAX, ORDER, COUNT,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_keys, stride_tmax,
    scale, S, CHUNK, MIN_CHUNK, MAX_SPLITS, R,
    HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, AGG_MAX: tl.constexpr, IEEE: tl.constexpr,
    ZERO_SCRATCH: tl.constexpr, ZROWS: tl.constexpr, HIST_PASSES: tl.constexpr,
    HIST_BINS: tl.constexpr, FUSE_HIST: tl.constexpr = False, GP: tl.constexpr = 2,
    TILE_MAX: tl.constexpr = False, SUB: tl.constexpr = 32,
    COMPACT: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, FG: tl.constexpr = 1, FGP: tl.constexpr = 1,
    NGP: tl.constexpr = 16,
):
    """Persistent grid of the group scoring: the programs stride over the (live group, split)
    items, ``splits`` per live group, items ``i = c * splits + sp``.

    CHUNK > 0: ``splits = MAX_SPLITS`` (= cdiv(S, CHUNK)) of CHUNK keys (the probe's fixed
    tuning). CHUNK == 0 (the default): the split follows the device-side live count, so one
    launch fits both a step where a few groups retrieve and one where all do (no host sync):
    ``splits = clamp(programs // live groups, 1, MAX_SPLITS)``, and each group's region is cut
    into ``splits`` chunks of at least MIN_CHUNK keys (multiples of BLOCK_N): about one item
    per program, each reading the same number of keys.

    COMPACT: no compaction launch before this one. Each program finds the live groups from FLAG
    itself (``_live_groups``: the flags of FG consecutive rows per group, one row per group in
    grouped mode), and program 0 also writes the rows' compaction (``ORDER``, ``COUNT`` of the
    ``R`` flags, what the select launched after this one reads). Else the live groups are
    ``GORDER[:GCOUNT]``, from ``_compact_kernel``."""
    nprog = tl.num_programs(0)
    if COMPACT:
        if tl.program_id(0) == 0:
            _compact_into(FLAG, ORDER, COUNT, R, 1, 1, BLOCK_R)
        g_offs, g_live, g_pos, gcount = _live_groups(FLAG, R // FG, FG, FGP, NGP)
    else:
        gcount = tl.load(GCOUNT)
    if CHUNK > 0:
        splits = MAX_SPLITS
    else:
        splits = tl.minimum(tl.maximum(nprog // tl.maximum(gcount, 1), 1), MAX_SPLITS)
    for item in range(tl.program_id(0), gcount * splits, nprog):
        c = item // splits
        if COMPACT:
            gid = _nth_live(g_offs, g_live, g_pos, c)
        else:
            gid = tl.load(GORDER + c)
        _group_score_item(
            Q, K, PAD, LO, HI, FLAG, KEYS, HIST, TAKEN, TMAX,
            stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_keys, stride_tmax,
            scale, S, CHUNK, MIN_CHUNK, gid, item % splits, splits,
            HKV, GROUP, D, BLOCK_M, BLOCK_N, BLOCK_D, AGG_MAX, IEEE, ZERO_SCRATCH, ZROWS,
            HIST_PASSES, HIST_BINS, FUSE_HIST, GP, TILE_MAX, SUB,
        )


@triton.jit
def _group_score_item(
    Q, K, PAD, LO, HI, FLAG, KEYS, HIST, TAKEN, TMAX,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_keys, stride_tmax,
    scale, S, CHUNK, MIN_CHUNK, gid, sp, splits,
    HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, AGG_MAX: tl.constexpr, IEEE: tl.constexpr,
    ZERO_SCRATCH: tl.constexpr, ZROWS: tl.constexpr, HIST_PASSES: tl.constexpr,
    HIST_BINS: tl.constexpr, FUSE_HIST: tl.constexpr, GP: tl.constexpr,
    TILE_MAX: tl.constexpr, SUB: tl.constexpr,
):
    """Scores of split ``sp`` (of ``splits``) of live KV group ``gid``'s (``b * Hkv + kvh``)
    middle region, for all G heads at once.

    The G query heads of group (b, kvh) sit in the M rows of a [BLOCK_M, BLOCK_D] tile (rows
    >= G are zero and masked); each [BLOCK_N, BLOCK_D] tile of the KV head's keys is loaded
    once and scored by one ``tl.dot`` (fp32 accumulation; exact IEEE fp32 for fp32 inputs).
    Per-head mode (AGG_MAX off): the keys of row ``b*Hq + kvh*G + g`` are written for the
    retrieving heads ``g`` only (FLAG [B*Hq]); grouped mode (AGG_MAX): the maximum over the G
    heads goes to the group's row ``b*Hkv + kvh``. ZERO_SCRATCH: the split program 0 of the
    group also zeroes the radix histograms and candidate counters of the rows it writes (the
    split select accumulates into them; stream order makes this happen before it starts).
    FUSE_HIST (``_select="radix8_fused"``, 8-bit digits): the first radix pass is done here,
    on the keys in registers: each program adds its chunk's 256-bin histogram of the pass-0
    digit of every row it writes to ``HIST[row, 0, :]`` atomically (zeroed by the compaction
    launch, which runs before this one); ZERO_SCRATCH then zeroes passes 1.. only. GP: rows of
    the per-head accumulator (next_pow2(GROUP), at least 2). TILE_MAX (``_select="tilemax"``):
    also the largest key of every SUB-key sub-tile of each row written, to ``TMAX[row, t]``.
    """
    b = gid // HKV
    kvh = gid % HKV
    pad, lo, hi = _score_region(PAD, LO, HI, b, S)  # sub-tiles of the tile maxima count from lo
    if CHUNK > 0:
        chunk = CHUNK
    else:  # the region in `splits` chunks, each a multiple of BLOCK_N (so of SUB) and >= MIN_CHUNK
        chunk = tl.maximum(tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = lo + sp * chunk  # every item is live: the grid strides over live groups only
    end = tl.minimum(hi, start + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    mrow = offs_m < GROUP
    head = kvh * GROUP + offs_m  # query head of each M row
    if AGG_MAX:
        wrow = mrow  # every head of the group takes part in the maximum
        out_row = (b * HKV + kvh).to(tl.int64)
    else:
        wrow = mrow & (tl.load(FLAG + b * (HKV * GROUP) + head, mask=mrow, other=0) != 0)
        out_row = (b * (HKV * GROUP) + head).to(tl.int64)
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=mrow[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if IEEE:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kvh * stride_kh  # > 2^31 elements ok
    if ZERO_SCRATCH:
        if sp == 0:
            offs_z = tl.arange(0, HIST_BINS)
            for g in tl.static_range(ZROWS):  # the scratch rows this group writes
                if AGG_MAX:
                    zr = b * HKV + kvh  # a live group: its flag is set
                else:
                    zr = b * (HKV * GROUP) + kvh * GROUP + g
                if tl.load(FLAG + zr) != 0:
                    for p in tl.static_range(1 if FUSE_HIST else 0, HIST_PASSES):
                        tl.store(HIST + zr.to(tl.int64) * (HIST_PASSES * HIST_BINS) + p * HIST_BINS + offs_z,
                                 tl.zeros([HIST_BINS], tl.int32))
                    tl.store(TAKEN + zr, 0)
    bins = tl.arange(0, 256)
    offs_gp = tl.arange(0, GP)
    if AGG_MAX:
        hist = tl.zeros([256], dtype=tl.int32)
    else:
        hist = tl.zeros([GP, 256], dtype=tl.int32)  # row g: head g of the group
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        m = j < end
        kt = tl.load(
            k_base + (pad + j).to(tl.int64)[None, :] * stride_ks + offs_d[:, None],
            mask=m[None, :] & dmask[:, None], other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = (s * scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        if AGG_MAX:
            s = tl.max(tl.where(mrow[:, None], s, float("-inf")), axis=0)
            key = _orderable_key(s)
            tl.store(KEYS + out_row * stride_keys + j, key, mask=m)
            if TILE_MAX:
                _tile_max_store(TMAX + out_row * stride_tmax, key, m, n0, lo, end, BLOCK_N, SUB)
            if FUSE_HIST:
                hist += tl.histogram(_digit0(key), 256, mask=m)
        else:
            key = _orderable_key(s)
            tl.store(KEYS + out_row[:, None] * stride_keys + j[None, :], key,
                     mask=wrow[:, None] & m[None, :])
            if TILE_MAX:  # [BLOCK_M, sub-tiles]: the largest key of each sub-tile of each head
                km = tl.where(m[None, :], key, -2147483648)
                tmax = tl.max(tl.reshape(km, [BLOCK_M, BLOCK_N // SUB, SUB]), axis=2)
                t = tl.arange(0, BLOCK_N // SUB)
                tl.store(TMAX + out_row[:, None] * stride_tmax + ((n0 - lo) // SUB + t)[None, :], tmax,
                         mask=wrow[:, None] & (n0 + t * SUB < end)[None, :])
            if FUSE_HIST:
                for g in tl.static_range(GROUP):  # only the retrieving heads' rows
                    sel_g = offs_m == g
                    if tl.sum((sel_g & wrow).to(tl.int32), axis=0) != 0:
                        key_g = tl.sum(tl.where(sel_g[:, None], key, 0), axis=0)  # [BLOCK_N]
                        h_g = tl.histogram(_digit0(key_g), 256, mask=m)
                        hist += tl.where(offs_gp[:, None] == g, h_g[None, :], 0)
    if FUSE_HIST:
        if AGG_MAX:
            tl.atomic_add(HIST + out_row * (HIST_PASSES * HIST_BINS) + bins, hist, mask=hist != 0)
        else:
            head_gp = kvh * GROUP + offs_gp
            w_gp = (offs_gp < GROUP) & (tl.load(FLAG + b * (HKV * GROUP) + head_gp,
                                                mask=offs_gp < GROUP, other=0) != 0)
            row_gp = (b * (HKV * GROUP) + head_gp).to(tl.int64)
            tl.atomic_add(HIST + row_gp[:, None] * (HIST_PASSES * HIST_BINS) + bins[None, :], hist,
                          mask=w_gp[:, None] & (hist != 0))


@triton.jit
def _select_kernel(
    KEYS, CAND, OUT, PAD, LO, HI, ORDER, COUNT,
    stride_keys, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, STOP: tl.constexpr = 0,
):
    """One-program select (``_select="row"``): exact top-K of one retrieving row's keys in one program:
    radix refinement, collect, sort.

    Keys are viewed as u = key + 2^31 in [0, 2^32) (int64). After ``depth`` radix passes of 8
    bits, the keys whose top ``8*depth`` bits exceed ``prefix`` are all in the top-K, and of the
    ``n_eq`` keys whose top bits equal ``prefix``, ``krem`` more are needed. Passes run only
    while the candidates (above + equal) overflow the K_PAD buffer; at full depth the equal keys
    are exact ties, of which the ``krem`` lowest indices are taken. The candidates are then
    collected in index order and sorted by (key desc, index asc) in registers.

    STOP (probe breakdown only; 0 = the whole select): 1 stops after the radix passes (one
    int32 of their result is stored to OUT[row, 0] so they are not optimised away), 2 after
    the collect (no sort, OUT not written).
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
        _row_radix_select(KEYS + row.to(tl.int64) * stride_keys, CAND + c * K_PAD, OUT + row * K,
                          lo, hi, K, K_PAD, BLOCK, STOP)


@triton.jit
def _row_radix_select(key_base, cand_base, out_row, lo, hi, K, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      STOP: tl.constexpr = 0, PACKED: tl.constexpr = False):
    """The one-program select of one row (keys ``key_base[lo:hi]``, candidate buffer of K_PAD at
    ``cand_base``): radix refinement, collect, sort; ``out_row[:K]`` written (STOP as in
    :func:`_select_kernel`). PACKED: ``key_base[lo:hi]`` are packed candidates (key << 32 |
    ~index) in index order instead of int32 keys at their index (the tilemax select's second
    stage); they are selected by key, exact ties by position (= by index), and collected as
    they are; ``cand_base`` must not overlap them."""
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
    if STOP == 1:
        tl.store(out_row, (prefix + krem + n_eq).to(tl.int32))
    else:
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
        if STOP == 0:
            tl.debug_barrier()
            _sort_store(cand_base, taken, kk, out_row, K, K_PAD)


@triton.jit
def _tile_max_store(TMAX_ROW, key, m, n0, lo, end, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """``_select="tilemax"``: the largest key of each SUB-key sub-tile of a [BLOCK_N] score tile
    (sub-tile t of a row covers real keys ``[lo + t*SUB, lo + (t+1)*SUB)``; ``n0 - lo`` is a
    multiple of SUB) to ``TMAX_ROW[t]``. Masked lanes do not count."""
    km = tl.where(m, key, -2147483648)
    tmax = tl.max(tl.reshape(km, [BLOCK_N // SUB, SUB]), axis=1)
    t = tl.arange(0, BLOCK_N // SUB)
    tl.store(TMAX_ROW + (n0 - lo) // SUB + t, tmax, mask=n0 + t * SUB < end)


@triton.jit
def _tilemax_select_kernel(
    KEYS, TMAX, HOT, CAND, OUT, PAD, LO, HI, ORDER, COUNT,
    stride_keys, stride_tmax, stride_cand, S, K,
    H: tl.constexpr, SUB: tl.constexpr, K_PAD: tl.constexpr, CAP: tl.constexpr,
    RADIX_PAD: tl.constexpr, BLOCK: tl.constexpr, TBLOCK: tl.constexpr, THETA_PASSES: tl.constexpr,
    CBLOCK: tl.constexpr, STOP: tl.constexpr = 0,
):
    """``_select="tilemax"``: exact top-K of one retrieving row in one program, from a threshold.

    The score kernel also wrote the largest key of every SUB-key sub-tile of the row (TMAX).
    1. theta: a lower bound of the kk-th largest key. The kk-th largest sub-tile maximum is one
       (those kk maxima are kk distinct keys >= it); THETA_PASSES 8-bit radix passes over the
       ``cdiv(n, SUB)`` maxima narrow it to the low end of its digit bucket (still a lower bound).
       With fewer sub-tiles than kk, theta is the smallest key (every key is a candidate).
    2. Collect, in index order, every key >= theta (all of the top-kk, exact ties included):
       packed as (key << 32 | ~index) at CAND[c, :CAP]. Only the hot sub-tiles (maximum >= theta;
       their ids compacted in order to ``HOT[row]``) are read, BLOCK // SUB of them at a time.
    3. Up to K_PAD candidates: sort them in registers (descending key, ties by ascending index,
       the reference's order). Up to CAP: the one-program radix select over the candidates
       (:func:`_row_radix_select` on the packed buffer, CBLOCK at a time; its K_PAD-sized result
       at ``CAND[c, CAP:]``). More than CAP (at most about kk * SUB, e.g. long runs of exact
       ties): the same radix select over the whole row, exact but slower.
    STOP (probe breakdown): 1 stops after theta, 2 after the collect.
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
                match = mt & ((u >> (32 - 8 * p)) == prefix)
                digit = tl.where(match, (u >> (24 - 8 * p)) & 255, 0).to(tl.int32)
                hist += tl.histogram(digit, 256)
                hist -= tl.where(bins == 0, TBLOCK - tl.sum(match.to(tl.int32), axis=0), 0)
            gt = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # matching, larger digit
            ge = gt + hist
            d = tl.max(tl.where((gt < krem) & (ge >= krem), bins, -1), axis=0)
            krem = krem - tl.sum(tl.where(bins == d, gt, 0), axis=0)
            prefix = prefix * 256 + d.to(tl.int64)
        theta = (prefix << (32 - 8 * THETA_PASSES)) - 2147483648  # a key value (int64)
        theta = tl.where(nt >= kk, theta, -2147483648)
        if STOP == 1:
            tl.store(out_row, theta.to(tl.int32))
        else:
            # 2. collect every key >= theta, in index order: first the hot sub-tiles (maximum >=
            # theta; the others hold no candidate), compacted in order, then their keys, BLOCK // SUB
            # sub-tiles at a time
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
            if STOP == 0:
                # 3. finish
                tl.debug_barrier()
                if taken <= K_PAD:
                    _sort_store(cand_base, taken, kk, out_row, K, K_PAD)
                elif taken <= CAP:  # the radix select of the candidates (in index order), then a K_PAD sort
                    _row_radix_select(cand_base, cand_base + CAP, out_row, 0, taken, K, RADIX_PAD,
                                      CBLOCK, PACKED=True)
                else:
                    _row_radix_select(key_base, cand_base, out_row, lo, hi, K, RADIX_PAD, BLOCK)


# ----------------------------------------------------------------------------- split selects


@triton.jit
def _radix_state(HIST_ROW, NPASS: tl.constexpr, kk, n, K_PAD: tl.constexpr, W: tl.constexpr,
                 BINS: tl.constexpr):
    """Prefix after the first NPASS passes of a row, from its summed histograms (W-bit
    digits from the top, the last one narrower when W does not divide 32; BINS = 2^W).

    Returns ``(prefix, krem, n_eq, depth)``: after ``depth`` passes the keys whose top bits
    exceed ``prefix`` are all in the top-kk, and ``krem`` of the ``n_eq`` keys equal to it are
    needed. A pass is applied only while the candidates (above + equal) overflow K_PAD (the
    same test the pass kernel used to decide whether to fill that histogram).
    """
    bins = tl.arange(0, BINS)
    krem = kk
    n_eq = n
    prefix = (kk * 0).to(tl.int64)
    depth = kk * 0
    for p in tl.static_range(NPASS):
        if kk - krem + n_eq > K_PAD:
            hist = tl.load(HIST_ROW + p * BINS + bins)
            gt = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # matching, larger digit
            ge = gt + hist
            d = tl.max(tl.where((gt < krem) & (ge >= krem), bins, -1), axis=0)
            krem = krem - tl.sum(tl.where(bins == d, gt, 0), axis=0)
            n_eq = tl.sum(tl.where(bins == d, hist, 0), axis=0)
            prefix = (prefix << min(W, 32 - W * p)) + d.to(tl.int64)  # digit p's width
            depth = depth * 0 + (p + 1)
    return prefix, krem, n_eq, depth


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
def _radix_pass_chunk(KEYS, HIST, PAD, LO, HI, ORDER, COUNT, c, ch, stride_keys, S, K, CHUNK,
                      H: tl.constexpr, P: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      W: tl.constexpr, BINS: tl.constexpr, NP: tl.constexpr):
    """Pass P for chunk ``ch`` of compact row ``c``: the histogram of digit P of the chunk's
    keys that match the prefix of passes < P, added atomically to HIST[row, P]."""
    live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
    hist_row = HIST + row.to(tl.int64) * (NP * BINS)
    start = lo + ch * CHUNK
    end = tl.minimum(hi, start + CHUNK)
    if start < end:
        prefix, krem, n_eq, depth = _radix_state(hist_row, P, kk, hi - lo, K_PAD, W, BINS)
        if kk - krem + n_eq > K_PAD:
            hi_b: tl.constexpr = 32 - W * P  # pass P resolves bits [lo_b, hi_b)
            lo_b: tl.constexpr = max(hi_b - W, 0)
            key_base = KEYS + row.to(tl.int64) * stride_keys
            offs = tl.arange(0, BLOCK)
            bins = tl.arange(0, BINS)
            hist = tl.zeros([BINS], dtype=tl.int32)
            for n0 in range(start, end, BLOCK):
                j = n0 + offs
                m = j < end
                u = tl.load(key_base + j, mask=m, other=0).to(tl.int64) + 2147483648
                match = m & ((u >> hi_b) == prefix)
                digit = tl.where(match, (u >> lo_b) & ((1 << (hi_b - lo_b)) - 1), 0).to(tl.int32)
                hist += tl.histogram(digit, BINS)
                # the non-matching lanes went to bin 0: take them out again
                miss = BLOCK - tl.sum(match.to(tl.int32), axis=0)
                hist -= tl.where(bins == 0, miss, 0)
            tl.atomic_add(hist_row + P * BINS + bins, hist, mask=hist != 0)


@triton.jit
def _radix_pass_kernel(
    KEYS, HIST, PAD, LO, HI, ORDER, COUNT, stride_keys, S, K, CHUNK, NCH,
    H: tl.constexpr, P: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
    W: tl.constexpr, BINS: tl.constexpr, NP: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """Pass P of a split select. Grid (rows, chunks), or PERSISTENT: a fixed grid of programs
    striding over the live (row, chunk) items (count x NCH, read on the device), so that the
    ~94 % of rows that do not retrieve cost no programs."""
    if PERSISTENT:
        for w in range(tl.program_id(0), tl.load(COUNT) * NCH, tl.num_programs(0)):
            _radix_pass_chunk(KEYS, HIST, PAD, LO, HI, ORDER, COUNT, w // NCH, w % NCH,
                              stride_keys, S, K, CHUNK, H, P, K_PAD, BLOCK, W, BINS, NP)
    else:
        _radix_pass_chunk(KEYS, HIST, PAD, LO, HI, ORDER, COUNT, tl.program_id(0), tl.program_id(1),
                          stride_keys, S, K, CHUNK, H, P, K_PAD, BLOCK, W, BINS, NP)


@triton.jit
def _radix_collect_chunk(
    KEYS, HIST, TAKEN, CAND, PAD, LO, HI, ORDER, COUNT, c, ch, stride_keys, S, K, CHUNK,
    H: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
    BINS: tl.constexpr, NP: tl.constexpr,
):
    """Candidates of chunk ``ch`` of compact row ``c`` (keys above the final prefix, and the
    needed keys equal to it), packed as (key << 32 | ~index), appended to CAND[c] at an
    atomic offset."""
    live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
    start = lo + ch * CHUNK
    end = tl.minimum(hi, start + CHUNK)
    if start < end:
        hist_row = HIST + row.to(tl.int64) * (NP * BINS)
        prefix, krem, n_eq, depth = _radix_state(hist_row, NP, kk, hi - lo, K_PAD, W, BINS)
        shift = tl.maximum(32 - W * depth, 0).to(tl.int64)
        key_base = KEYS + row.to(tl.int64) * stride_keys
        offs = tl.arange(0, BLOCK)
        # Exact ties at full depth that overflow: take the krem lowest indices, so count the
        # equal keys before this chunk (only then; it is a rescan of the earlier chunks).
        eq_seen = kk * 0
        if depth == NP:
            if krem < n_eq:
                for n0 in range(lo, start, BLOCK):
                    j = n0 + offs
                    key = tl.load(key_base + j, mask=j < start, other=0).to(tl.int64)
                    eq_seen += tl.sum(((j < start) & (key + 2147483648 == prefix)).to(tl.int32), axis=0)
        take_eq = tl.where(depth == NP, krem, n_eq)
        cand_base = CAND + c.to(tl.int64) * K_PAD
        for n0 in range(start, end, BLOCK):
            j = n0 + offs
            m = j < end
            key = tl.load(key_base + j, mask=m, other=0).to(tl.int64)
            top = (key + 2147483648) >> shift
            eq = (m & (top == prefix)).to(tl.int32)
            eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
            sel = ((m & (top > prefix)) | ((eq != 0) & (eq_rank < take_eq))).to(tl.int32)
            n_sel = tl.sum(sel, axis=0)
            base = tl.atomic_add(TAKEN + row, n_sel)
            pos = base + tl.cumsum(sel, axis=0) - sel
            packed = (key << 32) | (2147483647 - j).to(tl.int64)
            tl.store(cand_base + pos, packed, mask=(sel != 0) & (pos < K_PAD))
            eq_seen += tl.sum(eq, axis=0)


@triton.jit
def _radix_collect_kernel(
    KEYS, HIST, TAKEN, CAND, PAD, LO, HI, ORDER, COUNT, stride_keys, S, K, CHUNK, NCH,
    H: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
    BINS: tl.constexpr, NP: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """Collect of a split select; grid as :func:`_radix_pass_kernel`."""
    if PERSISTENT:
        for w in range(tl.program_id(0), tl.load(COUNT) * NCH, tl.num_programs(0)):
            _radix_collect_chunk(KEYS, HIST, TAKEN, CAND, PAD, LO, HI, ORDER, COUNT, w // NCH, w % NCH,
                                 stride_keys, S, K, CHUNK, H, K_PAD, BLOCK, W, BINS, NP)
    else:
        _radix_collect_chunk(KEYS, HIST, TAKEN, CAND, PAD, LO, HI, ORDER, COUNT,
                             tl.program_id(0), tl.program_id(1),
                             stride_keys, S, K, CHUNK, H, K_PAD, BLOCK, W, BINS, NP)


@triton.jit
def _live_taken(TAKEN, row, live, K_PAD: tl.constexpr):
    """Candidates collected for a row (0 for a row that does not retrieve: its TAKEN entry is
    never zeroed)."""
    return tl.where(live, tl.minimum(tl.load(TAKEN + row), K_PAD), 0)


@triton.jit
def _rank_scatter_kernel(
    CAND, TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Block ``blk`` of one row's candidates: rank = number of larger candidates (all packed
    values differ), written to OUT[row, rank] when rank < kk; output slots [kk, K) of the
    block get -1 (a row that does not retrieve: its whole block is -1)."""
    c = tl.program_id(0)
    blk = tl.program_id(1)
    live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
    offs_c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    out_row = OUT + row.to(tl.int64) * K
    tl.store(out_row + offs_c, tl.full([BLOCK_C], -1, tl.int32), mask=(offs_c >= kk) & (offs_c < K))
    if live:
        taken = tl.minimum(tl.load(TAKEN + row), K_PAD)
        if blk * BLOCK_C < taken:
            cand_base = CAND + c.to(tl.int64) * K_PAD
            x = tl.load(cand_base + offs_c, mask=offs_c < taken, other=-9223372036854775808)
            rank = tl.zeros([BLOCK_C], dtype=tl.int32)
            offs_t = tl.arange(0, BLOCK_T)
            for t0 in range(0, taken, BLOCK_T):
                y = tl.load(cand_base + t0 + offs_t, mask=t0 + offs_t < taken, other=-9223372036854775808)
                rank += tl.sum((y[None, :] > x[:, None]).to(tl.int32), axis=1)
            idx = (2147483647 - (x & 4294967295)).to(tl.int32)
            tl.store(out_row + rank, idx, mask=(offs_c < taken) & (rank < kk))


@triton.jit
def _sort_store(cand_base, taken, kk, out_row, K, K_PAD: tl.constexpr):
    """The ``taken`` packed candidates at ``cand_base`` sorted in registers (descending: score
    desc, index asc), their indices written to ``out_row[:kk]``, -1 to ``out_row[kk:K]``."""
    offs_k = tl.arange(0, K_PAD)
    x = tl.load(cand_base + offs_k, mask=offs_k < taken, other=-9223372036854775808)
    x = tl.sort(x, descending=True)
    idx = (2147483647 - (x & 4294967295)).to(tl.int32)
    idx = tl.where(offs_k < kk, idx, -1)
    tl.store(out_row + offs_k, idx, mask=offs_k < K)


@triton.jit
def _row_sort_kernel(
    CAND, TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr,
):
    """Finish of ``_select="radix8_sort"``: one program per row sorts its candidates (as the
    row select does after its collect); a row that does not retrieve gets -1."""
    c = tl.program_id(0)
    live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
    taken = _live_taken(TAKEN, row, live, K_PAD)
    _sort_store(CAND + c.to(tl.int64) * K_PAD, taken, kk, OUT + row.to(tl.int64) * K, K, K_PAD)


@triton.jit
def _block_sort_kernel(
    CAND, TAKEN, PAD, LO, HI, ORDER, COUNT, S, K, NBLK,
    H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr,
):
    """Merge finish, step 1: each block of MB candidates of a live row sorted in place
    (descending; INT64_MIN after the last candidate). Persistent grid over count x NBLK."""
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


@triton.jit
def _merge_rank_kernel(
    CAND, TAKEN, OUT, PAD, LO, HI, ORDER, COUNT, S, K,
    H: tl.constexpr, K_PAD: tl.constexpr, MB: tl.constexpr, LOG_MB: tl.constexpr,
):
    """Merge finish, step 2, grid (rows, blocks of MB output slots / candidates): the rank of
    each candidate of sorted block ``blk`` is the number of larger candidates in every sorted
    block (a branchless binary search per block: LOG_MB + 1 gathers; all packed values differ,
    so within its own block that is its position), written to OUT[row, rank] when rank < kk.
    Output slots [kk, K) of the block get -1 (a row that does not retrieve: all of them)."""
    c = tl.program_id(0)
    blk = tl.program_id(1)
    live, row, lo, hi, kk = _row_geometry(ORDER, COUNT, PAD, LO, HI, c, S, K, H)
    offs_c = blk * MB + tl.arange(0, MB)
    out_row = OUT + row.to(tl.int64) * K
    tl.store(out_row + offs_c, tl.full([MB], -1, tl.int32), mask=(offs_c >= kk) & (offs_c < K))
    taken = _live_taken(TAKEN, row, live, K_PAD)
    if blk * MB < taken:
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
        idx = (2147483647 - (x & 4294967295)).to(tl.int32)
        tl.store(out_row + rank, idx, mask=(offs_c < taken) & (rank < kk))


# ----------------------------------------------------------------------------- launchers


def compact_rows(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with ``flags`` set, packed to the front, on the device (no host sync).

    Args:
        flags: ``[R]`` bool.

    Returns:
        ``(order [R] int32, count [1] int32)``: ``order[:count]`` are the flagged row ids in
        ascending order, ``order[count:]`` the other rows in descending order.
    """
    order, count, _, _ = _compact(flags, 1, with_groups=False)
    return order, count


def _compact(flags: torch.Tensor, group: int, with_groups: bool, zero_hist: torch.Tensor | None = None):
    """Rows and (optionally) groups of ``group`` consecutive rows with any flag set, in one
    launch: ``(order, count, group_order, group_count)`` (the last two None without groups).
    ``zero_hist`` ``[R, >= 256]`` int32: its first 256 entries of every flagged row are zeroed
    in the same launch (the fused pass-0 histogram)."""
    flags = flags.reshape(-1).contiguous()
    R = flags.numel()
    order = torch.empty(R, dtype=torch.int32, device=flags.device)
    count = torch.empty(1, dtype=torch.int32, device=flags.device)
    if with_groups:
        gorder = torch.empty(R // group, dtype=torch.int32, device=flags.device)
        gcount = torch.empty(1, dtype=torch.int32, device=flags.device)
    else:
        gorder, gcount = order, count  # unused
    gp = next_pow2(group)
    zero = zero_hist is not None
    _compact_kernel[(1,)](
        flags, order, count, gorder, gcount, zero_hist if zero else order, R,
        GROUP=group, GP=gp, BLOCK=min(next_pow2(R, 16), 1024),
        BLOCK_G=max(16, min(next_pow2(R // group, 16), 4096 // gp)), WITH_GROUPS=with_groups,
        ZERO_HIST=zero, HIST_ROW=zero_hist.stride(0) if zero else 1, HIST_BINS=256 if zero else 1,
    )
    return order, count, (gorder if with_groups else None), (gcount if with_groups else None)


#: Largest flag tile (groups x flags per group, padded) the group score kernel compacts in
#: registers; above it a `_compact_kernel` launch does it first.
_SCORE_COMPACT_MAX = 16384
#: The group score kernel's persistent grid (programs per SM) and its smallest split (keys): the
#: split is chosen on the device from the live group count (see `_group_score_kernel`).
_SCORE_PROGRAMS_PER_SM = 2
_SCORE_MIN_CHUNK = 256


def _score_chunk(S: int, live: int, device: torch.device) -> int:
    """Keys per program of the row score kernel: about 4 programs per SM when about ``live``
    items score."""
    target_splits = triton.cdiv(4 * num_sms(device), max(1, live))
    return max(256, min(4096, next_pow2(triton.cdiv(S, target_splits))))


def _candidate_capacity(k: int) -> int:
    """Candidate buffer of the select kernel: room above k so that 1-2 radix passes suffice."""
    roomy = next_pow2(k + k // 8 + 16)
    return roomy if roomy <= 4096 else next_pow2(k)


def _select_chunk(S: int) -> int:
    """Keys per (row, chunk) item of the split select (one tile of up to 2048). 2048 measured
    faster than 1024 on the H200 (scripts/probe_gqa_kernels.py, 2026-12-02): 55.5 vs 63.3 us for
    71 rows x 16k at k = 88 (12/2, B32), 46.9 vs 54.5 for 37 rows at k = 1036 (32/8, B16)."""
    return min(2048, next_pow2(S, 16))


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent select grid: 4 per SM (they stride over the live items)."""
    return 4 * num_sms(device)


def _tile_max_scratch(tile_max: bool, R: int, S: int, block_n: int, sel_block: int, device: torch.device):
    """``(SUB, TMAX)`` of the score launch: keys per sub-tile (it divides the score tile and the
    tilemax collect block) and the ``[R, cdiv(S, SUB)]`` int32 sub-tile maxima (a 1x1 stand-in
    when the select is not tilemax)."""
    sub = min(_TILE_SUB, block_n, sel_block)
    shape = (R, triton.cdiv(S, sub)) if tile_max else (1, 1)
    return sub, torch.empty(shape, dtype=torch.int32, device=device)


def _check_mode(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {allowed}")


def _retrieve(
    q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
    flags: torch.Tensor, k: int, scale: float, *, grouped: bool, score: str, select: str,
    stop_after: str, select_block: int | None = None, select_warps: int | None = None,
    score_cfg: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Shared launcher: per-head rows (``grouped`` off, flags [B, Hq]) or one row per KV group
    (flags [B, Hkv], scores = max over the group's heads). Returns [B, rows per sequence, k]."""
    require_triton(q, k_cache)
    _check_mode("_score", score, SCORE_MODES)
    _check_mode("_select", select, SELECT_MODES + ("auto",))
    _check_mode("_stop_after", stop_after, STOP_POINTS)
    if stop_after == "blocksort" and select not in _MERGE_SELECTS:
        raise ValueError(f"_stop_after='blocksort' needs _select in {_MERGE_SELECTS}, got _select={select!r}")
    if grouped and score != "group":
        raise ValueError("_score='row' has no group-shared variant: use _score='group'")
    if score_cfg is not None and score != "group":
        raise ValueError("_score_cfg tunes the group score kernel: it needs _score='group'")
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = gqa_group(Hq, Hkv)
    H = Hkv if grouped else Hq  # rows per sequence
    k = int(k)
    if select == "auto":
        select = default_select(k)
    R = B * H
    if R == 0 or k == 0 or S == 0:
        return torch.full((B, H, k), -1, dtype=torch.int32, device=q.device)
    out = torch.empty((B, H, k), dtype=torch.int32, device=q.device)  # every row is written
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    flags = flags.reshape(-1).contiguous()
    by_group = score == "group"
    split = select not in ("row", "tilemax")
    tile_max = select == "tilemax"
    fused = select in _FUSED_SELECTS  # pass 0 done by the score kernel
    w, np_ = _SPLIT_DIGITS[select] if split else (8, 4)
    bins = 1 << w
    hist = torch.empty((R, np_ * bins) if split else (1,), dtype=torch.int32, device=q.device)
    flags_per_group = 1 if grouped else group  # the rows are the groups in grouped mode
    ngp, fgp = next_pow2(R // flags_per_group, 16), next_pow2(flags_per_group)
    # the group score kernel compacts (no launch for it), unless its histogram must be zeroed first
    compact_in_score = by_group and not fused and ngp * fgp <= _SCORE_COMPACT_MAX
    if compact_in_score:
        order = torch.empty(R, dtype=torch.int32, device=q.device)
        count = torch.empty(1, dtype=torch.int32, device=q.device)
        gorder, gcount = order, count  # unused
    else:
        order, count, gorder, gcount = _compact(flags, group, with_groups=by_group and not grouped,
                                                zero_hist=hist if fused and by_group else None)
        if grouped:
            gorder, gcount = order, count
    if stop_after == "compact":
        return out
    keys = torch.empty((R, S), dtype=torch.int32, device=q.device)
    sel_block = (_select_chunk(S) if select_block is None else next_pow2(int(select_block), 16))
    taken = torch.empty((R,) if split else (1,), dtype=torch.int32, device=q.device)
    block_d = next_pow2(D, 16)
    if by_group:
        block_m = max(16, next_pow2(group))
        # 128 keys per tile for 2-byte keys (H200, 12/2 B32/16k, 71 rows: 54.2 vs 62.0 us for 64;
        # 32/8 B16: 41.8 vs 42.5); fp32 keeps 32 KB tiles so that three stages fit in shared memory
        block_n = max(16, min(128, 16384 // block_d) if k_cache.element_size() <= 2 else min(64, 8192 // block_d))
        score_warps, score_stages, fixed_chunk, per_sm = 4, 3, 0, _SCORE_PROGRAMS_PER_SM
        if score_cfg is not None:  # (block_n, warps, stages, chunk or 0[, programs per SM]): the probe's tuning
            block_n, score_warps, score_stages = score_cfg[0], score_cfg[1], score_cfg[2]
            fixed_chunk = triton.cdiv(score_cfg[3], block_n) * block_n if score_cfg[3] else 0
            per_sm = score_cfg[4] if len(score_cfg) > 4 else per_sm
        min_chunk = triton.cdiv(_SCORE_MIN_CHUNK, block_n) * block_n
        max_splits = triton.cdiv(S, fixed_chunk or min_chunk)
        programs = max(1, min(per_sm * num_sms(q.device), B * Hkv * max_splits))
        sub, tmax = _tile_max_scratch(tile_max, R, S, block_n, sel_block, q.device)
        _group_score_kernel[(programs,)](
            q, k_cache, pad, lo, hi, flags, gorder, gcount, keys, hist, taken, tmax, order, count,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            keys.stride(0), tmax.stride(0), float(scale), S, fixed_chunk, min_chunk, max_splits, R,
            HKV=Hkv, GROUP=group, D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            AGG_MAX=grouped,
            IEEE=q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16),
            ZERO_SCRATCH=split, ZROWS=1 if grouped else group, HIST_PASSES=np_, HIST_BINS=bins,
            FUSE_HIST=fused, GP=max(2, next_pow2(group)), TILE_MAX=tile_max, SUB=sub,
            COMPACT=compact_in_score, BLOCK_R=min(next_pow2(R, 16), 1024), FG=flags_per_group, FGP=fgp, NGP=ngp,
            num_warps=score_warps, num_stages=score_stages,
        )
    else:
        if split:
            hist.zero_()  # all passes (the fused one too), before the score launch
            taken.zero_()
        block_n = max(16, min(128, 8192 // block_d))
        # expected live rows: about 1 in 16 (CIS at s = 16)
        chunk = max(_score_chunk(S, max(1, min(R, (B * Hq) // 16)), q.device), block_n)
        sub, tmax = _tile_max_scratch(tile_max, R, S, block_n, sel_block, q.device)
        _score_kernel[(R, triton.cdiv(S, chunk))](
            q, k_cache, pad, lo, hi, order, count, keys, hist, tmax,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            keys.stride(0), tmax.stride(0), float(scale), S, chunk,
            H=Hq, GROUP=group, D=D, BLOCK_N=block_n, BLOCK_D=block_d,
            FUSE_HIST=fused, HIST_ROW=np_ * bins, TILE_MAX=tile_max, SUB=sub, num_warps=4,
        )
    if stop_after == "score":
        return out
    k_pad = _candidate_capacity(k)
    if tile_max:
        small = next_pow2(k, 16)  # the first sort tier: at least k slots, so every output slot is written
        cap = max(small, k_pad, _TILE_CAP)
        cand = torch.empty((R, cap + k_pad), dtype=torch.int64, device=q.device)
        _tilemax_select_kernel[(R,)](
            keys, tmax, torch.empty_like(tmax), cand, out, pad, lo, hi, order, count,
            keys.stride(0), tmax.stride(0), cand.stride(0), S, k,
            H=H, SUB=sub, K_PAD=small, CAP=cap, RADIX_PAD=k_pad, BLOCK=sel_block,
            TBLOCK=min(1024, next_pow2(triton.cdiv(S, sub), 16)), THETA_PASSES=_THETA_PASSES,
            CBLOCK=min(1024, cap),
            STOP={"passes": 1, "collect": 2}.get(stop_after, 0),
            num_warps=_TILEMAX_WARPS if select_warps is None else select_warps,
        )
        return out
    cand = torch.empty((R, k_pad), dtype=torch.int64, device=q.device)
    if not split:
        _select_kernel[(R,)](
            keys, cand, out, pad, lo, hi, order, count,
            keys.stride(0), S, k,
            H=H, K_PAD=k_pad, BLOCK=min(1024, next_pow2(S, 16)),
            STOP={"passes": 1, "collect": 2}.get(stop_after, 0),
            num_warps=8 if k_pad >= 1024 else 4,
        )
        return out
    select_warps = 4 if select_warps is None else select_warps
    nch = triton.cdiv(S, sel_block)
    persistent = select != "split"  # the measured split path keeps its (rows, chunks) grid
    grid = (min(R * nch, _persistent_programs(q.device)),) if persistent else (R, nch)
    for p in range(1 if fused else 0, np_):  # fused: pass 0's histogram came with the scores
        _radix_pass_kernel[grid](
            keys, hist, pad, lo, hi, order, count, keys.stride(0), S, k, sel_block, nch,
            H=H, P=p, K_PAD=k_pad, BLOCK=sel_block, W=w, BINS=bins, NP=np_, PERSISTENT=persistent,
            num_warps=select_warps,
        )
    if stop_after == "passes":
        return out
    _radix_collect_kernel[grid](
        keys, hist, taken, cand, pad, lo, hi, order, count, keys.stride(0), S, k, sel_block, nch,
        H=H, K_PAD=k_pad, BLOCK=sel_block, W=w, BINS=bins, NP=np_, PERSISTENT=persistent,
        num_warps=select_warps,
    )
    if stop_after == "collect":
        return out
    if select == "split":
        block_c = min(_RANK_BLOCK, k_pad)
        _rank_scatter_kernel[(R, triton.cdiv(max(k_pad, k), block_c))](
            cand, taken, out, pad, lo, hi, order, count, S, k,
            H=H, K_PAD=k_pad, BLOCK_C=block_c, BLOCK_T=_RANK_TILE, num_warps=4,
        )
    elif select == "radix8_sort" or k_pad <= _MERGE_BLOCK:
        # radix8 / radix8_fused with one merge block (k_pad <= 256, e.g. cis.yaml's k = 88): the
        # per-row register sort is the whole finish, one launch instead of block sort + merge rank
        # (H200, B32/16k 12/2, 71 rows, k = 88: finish 3.6 vs 5.7 us; probe_gqa_select_real.md)
        if stop_after == "blocksort":
            return out
        _row_sort_kernel[(R,)](
            cand, taken, out, pad, lo, hi, order, count, S, k,
            H=H, K_PAD=k_pad, num_warps=8 if k_pad >= 1024 else 4,
        )
    else:  # radix8, radix8_fused with several blocks: merge finish
        mb = min(_MERGE_BLOCK, k_pad)
        nblk = k_pad // mb  # k_pad >= k, both powers of two
        _block_sort_kernel[(min(R * nblk, _persistent_programs(q.device)),)](
            cand, taken, pad, lo, hi, order, count, S, k, nblk,
            H=H, K_PAD=k_pad, MB=mb, num_warps=4,
        )
        if stop_after == "blocksort":
            return out
        _merge_rank_kernel[(R, nblk)](
            cand, taken, out, pad, lo, hi, order, count, S, k,
            H=H, K_PAD=k_pad, MB=mb, LOG_MB=mb.bit_length() - 1, num_warps=4,
        )
    return out


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
    _score: str = "group",
    _select: str = "auto",
    _select_block: int | None = None,
    _select_warps: int | None = None,
    _score_cfg: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton top-k retrieval: work only for retrieving rows, exact order, no host sync.

    Launches: group-aware scoring (a persistent grid over the live KV groups x sequence chunks,
    the chunks sized on the device from the live count; each group's keys are read once for all
    its retrieving heads; it also compacts the retrieving rows, in a launch of its own only with
    ``_score="row"``, ``"radix8_fused"`` or more than 16k flags), then the select (default ``"auto"``: ``"tilemax"``
    up to k = 256, one program per row from a threshold of the score kernel's sub-tile maxima,
    19.8 us for 71 rows x 16k at k 88 on the H200 (radix8 52.1); ``"radix8"`` above: 8-bit passes
    and the collect on persistent grids, then a block sort + merge rank, 54 us for 37 rows x 16k
    on the H200; ``"row"``: one program per row, 100 us there; ``"split"``: 11-bit passes and a
    rank-scatter, 149 us; ``"radix8_sort"``: radix8's passes, then one register sort per row,
    169 us; ``"radix8_fused"``: radix8 with pass 0's histogram built by the score kernel, not yet
    measured; all exact, see docs/notes/decode_tuning.md).
    Scratch: ``[B*Hq, S]`` int32 keys, ``[B*Hq, ~1.125 k]`` int64 candidates (split select:
    also ``[B*Hq, 6144]`` int32 histograms; tilemax: ``[B*Hq, S / 32]`` int32 sub-tile maxima and
    ``[B*Hq, 4096 + ~1.125 k]`` int64 candidates).

    Args and result as :func:`topk_retrieval_reference`. Private switches (benchmarks and
    tests): ``_score`` in :data:`SCORE_MODES` (``"row"``: the old per-row scoring),
    ``_select`` in :data:`SELECT_MODES` (``"split"``: the split radix select);
    ``_stop_after`` in :data:`STOP_POINTS` returns the unfinished output after that stage;
    ``_select_block`` / ``_select_warps``: keys per (row, chunk) item and warps of the split
    select's passes and collect (default: :func:`_select_chunk`, 4 warps), or keys per collect
    block and warps of the tilemax select (default: the same keys, 8 warps); ``_score_cfg``:
    (keys per tile, warps, stages, keys per program or 0 for the device-side split[, programs
    per SM of its persistent grid]) of the group score kernel (the probe's tuning).
    """
    return _retrieve(q, k_cache, pad, lo, hi, retrieve, k, scale, grouped=False,
                     score=_score, select=_select, stop_after=_stop_after,
                     select_block=_select_block, select_warps=_select_warps, score_cfg=_score_cfg)


def topk_retrieval_grouped(
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
    _select: str = "auto",
    _select_block: int | None = None,
    _select_warps: int | None = None,
    _score_cfg: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton group-shared top-k retrieval: one index list per KV head (no host sync).

    Same launches as :func:`topk_retrieval` with one scratch row per (b, kvh): each live
    group's keys are read once, scored for its G heads by one tensor-core dot per tile, and
    the maximum over the heads is ranked. Args and result as
    :func:`topk_retrieval_grouped_reference`; the private switches as in :func:`topk_retrieval`.
    """
    return _retrieve(q, k_cache, pad, lo, hi, retrieve, k, scale, grouped=True,
                     score="group", select=_select, stop_after=_stop_after,
                     select_block=_select_block, select_warps=_select_warps, score_cfg=_score_cfg)


# ----------------------------------------------------------------------------- references


def _topk_of_scores(
    scores: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
    retrieve: torch.Tensor, k: int,
) -> torch.Tensor:
    """Exact top-k of ``scores [B, R, S]`` (per slot) over each row's middle region: the
    ``k`` best real indices, descending score, ties lower index first, -1 padded; rows with
    ``retrieve [B, R]`` off are all -1."""
    B, R, S = scores.shape
    real = torch.arange(S, device=scores.device).unsqueeze(0) - pad.long().unsqueeze(1)  # [B, S]
    in_mid = (real >= lo.long().unsqueeze(1)) & (real < hi.long().unsqueeze(1)) & (real >= 0)
    valid = in_mid.unsqueeze(1) & retrieve.unsqueeze(-1)  # [B, R, S]
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    kk = min(int(k), S)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
    n_valid = valid.sum(dim=-1, keepdim=True)  # [B, R, 1]
    rank = torch.arange(kk, device=scores.device)
    idx = torch.where(rank < n_valid, order - pad.long().view(B, 1, 1), -1)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((B, R, int(k) - kk), -1)], dim=-1)
    return idx.to(torch.int32)


def _group_scores(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q . k`` of every query head and slot, ``[B, Hkv, G, S]`` fp32."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = gqa_group(Hq, Hkv)
    qf = q.float().reshape(B, Hkv, G, D)
    # fp32 matmul (TF32 is off by default for matmuls in PyTorch), then the scale: the same
    # order of operations as the kernel.
    return torch.matmul(qf, k_cache.float().transpose(-1, -2)) * scale


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
    B, Hq, _ = q.shape
    scores = _group_scores(q, k_cache, scale).reshape(B, Hq, -1)
    return _topk_of_scores(scores, pad, lo, hi, retrieve, k)


def topk_retrieval_grouped_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pad: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    retrieve: torch.Tensor,
    k: int,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :func:`topk_retrieval_grouped`: one index list per KV head.

    Each real key ``j`` of the middle region is ranked by the group's aggregated score
    ``max over the G query heads h of KV head kvh of scale * q[b, h] . k_cache[b, kvh, pad+j]``
    (fp32), then exactly as :func:`topk_retrieval_reference` (the ``k`` best, descending,
    ties lower index first, ``-1`` padded; groups not retrieving are all ``-1``).

    Why the maximum: a key that one head needs badly stays near the top however the other
    heads score it (a sum of raw scores lets one head with a large query norm, or a few
    negative heads, decide for the whole group; Quest-style upper bounds aggregate by max for
    the same reason); it needs no softmax normaliser, so it is exact in the one pass that reads
    each key once (a sum of per-head softmax probabilities needs each head's log-sum-exp over
    the whole region first: a second pass or a second read of K); and it is the same cost as
    per-head scoring (one ``G x tile`` dot, a max over G in registers, one int32 per key
    written instead of G), so the retrieval stays bandwidth bound on reading K.

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k_cache: ``[B, Hkv, S, D]`` key cache (same dtype as ``q``).
        pad: ``[B]`` int32 first real slot.
        lo, hi: ``[B]`` int32 middle region ``[lo, hi)`` in real indices (may be empty).
        retrieve: ``[B, Hkv]`` bool, KV groups that retrieve.
        k: number of indices to return.
        scale: score scale (the attention softmax scale).

    Returns:
        ``[B, Hkv, k]`` int32 real indices, best first, ``-1`` padded.
    """
    scores = _group_scores(q, k_cache, scale).amax(dim=2)  # [B, Hkv, S]
    return _topk_of_scores(scores, pad, lo, hi, retrieve, k)
