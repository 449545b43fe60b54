"""Step 2 of the CIS decode pipeline: exact top-k of the middle region for retrieving heads.

Contract (docs/DECODE_PIPELINE.md §2): for rows with ``retrieve[b, h]``, score every real key
``j`` in ``[lo[b], hi[b])`` as ``scale * (q[b, h] . k_cache[b, kvh, pad[b] + j])`` (fp32) and
return the ``k`` best real indices in descending score order (ties: lower index first), ``-1``
padded when the region holds fewer than ``k`` keys. Rows not retrieving are all ``-1``.

Group-shared variant (:func:`topk_retrieval_grouped`): one index list per KV head, ranking
each key by the maximum over the group's query heads of the scaled score (see its reference
for why the maximum).

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` scoring kernels here
(the select kernels in :mod:`.topk_select`), the launchers :func:`topk_retrieval` /
:func:`topk_retrieval_grouped`, and the PyTorch references :func:`topk_retrieval_reference` /
:func:`topk_retrieval_grouped_reference`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Iterator, Optional

import torch

from ..triton_support import gqa_group, interpreting, next_pow2, num_sms, require_triton, tl, triton
from .topk_select import (
    HIST_ROW,
    MERGE_RANKS,
    RADIX8_STOP_POINTS,
    TILEMAX_MAX_K,
    _orderable_key,
    _tile_max_store,
    radix8_select,
    select_chunk,
    tilemax_scratch,
    tilemax_select,
)

__all__ = [
    "topk_retrieval",
    "topk_retrieval_reference",
    "topk_retrieval_grouped",
    "topk_retrieval_grouped_reference",
    "compact_rows",
    "SELECT_MODES",
    "TILEMAX_MAX_K",
    "default_select",
    "RetrievalTuning",
    "retrieval_tuning",
    "tuned",
]

# Design (the cost is reading the K rows of the middle region: bandwidth bound; no host sync,
# every grid depends on B, Hq, Hkv, S and k only):
#   1. Compaction: the retrieving rows' ids packed to the front with their count, and the same for
#      the KV groups (b, kvh) that hold at least one retrieving row. The score kernel does it: each
#      program finds the live groups from the flags in registers and program 0 writes the rows'
#      order for the select, so it costs no launch (`_compact_kernel` runs first only when there
#      are more flags than fit in registers).
#   2. Scoring (`_group_score_kernel`): a persistent grid striding over the (live group, split)
#      items, the split count derived on the device from the live count, so that one launch fits
#      a step where few groups retrieve (short reads, no idle programs) and one where all do (long
#      chunks). An item streams its chunk of the KV head's keys once and scores all G query heads of
#      the group with one tensor-core dot per tile, writing an order-preserving int32 key of each
#      fp32 score into the scratch row of every retrieving head (grouped mode: one row per group,
#      the maximum over the heads).
#   3. Selection (topk_select.py): "tilemax" up to TILEMAX_MAX_K, one program per row from a
#      threshold of the sub-tile maxima the score kernel also writes; "radix8" above, 8-bit radix
#      passes, a collect and a merge finish on persistent grids.

#: The select kernels (``RetrievalTuning.select``; the default ``"auto"`` picks one by k, :func:`default_select`).
SELECT_MODES = ("tilemax", "radix8")
#: Where ``RetrievalTuning.stop_after`` may stop (the benchmark's stage breakdown): after the
#: compaction (no launch when the score kernel compacts), after the scoring, after a stage of the
#: radix8 select (:data:`~.topk_select.RADIX8_STOP_POINTS`; not with tilemax), or at the end.
STOP_POINTS = ("compact", "score", *RADIX8_STOP_POINTS, "select")
#: Largest flag tile (groups x flags per group, padded) the group score kernel compacts in
#: registers; above it a `_compact_kernel` launch does it first.
_SCORE_COMPACT_MAX = 16384
#: The group score kernel's persistent grid (programs per SM) and its smallest split (keys): the
#: split is chosen on the device from the live group count (see `_group_score_kernel`).
_SCORE_PROGRAMS_PER_SM = 2
_SCORE_MIN_CHUNK = 256


def default_select(k: int) -> str:
    """The select kernel ``select="auto"`` (the default) runs for top-``k``."""
    return "tilemax" if int(k) <= TILEMAX_MAX_K else "radix8"


# ----------------------------------------------------------------------------- tuning hook


@dataclasses.dataclass(frozen=True)
class RetrievalTuning:
    """Switches of the top-k retrieval that benchmarks and tests set (:func:`retrieval_tuning`);
    the defaults are what the library runs.

    ``select``: one of :data:`SELECT_MODES`, or ``"auto"`` (:func:`default_select`);
    ``stop_after``: one of :data:`STOP_POINTS`; before ``"select"`` the launcher returns its
    unfinished output after that stage (the benchmark's stage breakdown); ``merge_rank``: radix8's
    merge finish, one of :data:`~.topk_select.MERGE_RANKS` (None: :data:`~.topk_select.MERGE_RANK`);
    ``select_block`` / ``select_warps``: keys per (row, chunk) item and warps of the radix8 passes
    and collect (default :func:`~.topk_select.select_chunk`, 4 warps), or keys per collect block
    and warps of the tilemax select (default: the same keys, 8 warps); ``score_cfg``: (keys per
    tile, warps, stages, keys per program or 0 for the device-side split[, programs per SM of its
    persistent grid]) of the score kernel.

    Raises:
        ValueError: ``select``, ``stop_after`` or ``merge_rank`` not one of its values.
    """

    select: str = "auto"
    stop_after: str = "select"
    merge_rank: Optional[str] = None
    select_block: Optional[int] = None
    select_warps: Optional[int] = None
    score_cfg: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        for name, allowed in (("select", SELECT_MODES + ("auto",)), ("stop_after", STOP_POINTS),
                              ("merge_rank", MERGE_RANKS + (None,))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RetrievalTuning: {name}={getattr(self, name)!r}: expected one of {allowed}")


#: The switches the retrievals run with now: the defaults, except inside :func:`retrieval_tuning`.
_tuning = RetrievalTuning()


@contextlib.contextmanager
def retrieval_tuning(**switches) -> Iterator[RetrievalTuning]:
    """Inside the ``with`` block, every top-k retrieval (:func:`topk_retrieval`,
    :func:`topk_retrieval_grouped`, the key index's first stage) runs with ``switches`` (the
    fields of :class:`RetrievalTuning`) over the switches in force; restored on exit.

    Raises:
        TypeError: a switch that is not a field of :class:`RetrievalTuning`.
        ValueError: a switch's value is not one of its values.
    """
    global _tuning
    saved = _tuning
    _tuning = dataclasses.replace(saved, **switches)
    try:
        yield _tuning
    finally:
        _tuning = saved


def tuned(launcher: Callable, **switches) -> Callable:
    """``launcher`` called under :func:`retrieval_tuning` ``(**switches)``: the switches checked
    now, for a benchmark's timed callable."""
    dataclasses.replace(_tuning, **switches)

    @functools.wraps(launcher)
    def call(*args, **kwargs):
        with retrieval_tuning(**switches):
            return launcher(*args, **kwargs)

    return call


# ----------------------------------------------------------------------------- compaction


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
    FLAG, ORDER, COUNT, GORDER, GCOUNT, R,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr,
    WITH_GROUPS: tl.constexpr,
):
    """Rows (``R`` flags) and, with WITH_GROUPS, groups of GROUP consecutive rows: one launch."""
    _compact_into(FLAG, ORDER, COUNT, R, 1, 1, BLOCK)
    if WITH_GROUPS:
        _compact_into(FLAG, GORDER, GCOUNT, R // GROUP, GROUP, GP, BLOCK_G)


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


def _compact(flags: torch.Tensor, group: int, with_groups: bool):
    """Rows and (optionally) groups of ``group`` consecutive rows with any flag set, in one
    launch: ``(order, count, group_order, group_count)`` (the last two None without groups)."""
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
    _compact_kernel[(1,)](
        flags, order, count, gorder, gcount, R,
        GROUP=group, GP=gp, BLOCK=min(next_pow2(R, 16), 1024),
        BLOCK_G=max(16, min(next_pow2(R // group, 16), 4096 // gp)), WITH_GROUPS=with_groups,
    )
    return order, count, (gorder if with_groups else None), (gcount if with_groups else None)


# ----------------------------------------------------------------------------- scoring


@triton.jit
def _group_score_kernel(
    Q, K, KB, PAD, LO, HI, FLAG, GORDER, GCOUNT, KEYS, HIST, TAKEN, TMAX, ORDER, COUNT,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_bb, stride_bh, stride_bs, stride_keys, stride_tmax,
    scale, S, CHUNK, MIN_CHUNK, MAX_SPLITS, R,
    HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, AGG_MAX: tl.constexpr, IEEE: tl.constexpr,
    ZERO_SCRATCH: tl.constexpr, ZROWS: tl.constexpr, HIST_ROW: tl.constexpr, TILE_MAX: tl.constexpr = False,
    SUB: tl.constexpr = 32, COMPACT: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, FG: tl.constexpr = 1, FGP: tl.constexpr = 1,
    NGP: tl.constexpr = 16, KFMT: tl.constexpr = 0,
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
    ``GORDER[:GCOUNT]``, from ``_compact_kernel``.

    KFMT: what K holds (:func:`_score_tile`): the keys (0), or a key index (key_index.py) with
    its second tensor KB: fp8 codes and slot scales (1), int4 codes and group scales (2), page
    maxima and minima (3)."""
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
            Q, K, KB, PAD, LO, HI, FLAG, KEYS, HIST, TAKEN, TMAX,
            stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_bb, stride_bh, stride_bs, stride_keys,
            stride_tmax, scale, S, CHUNK, MIN_CHUNK, gid, item % splits, splits,
            HKV, GROUP, D, BLOCK_M, BLOCK_N, BLOCK_D, AGG_MAX, IEEE, ZERO_SCRATCH, ZROWS, HIST_ROW, TILE_MAX, SUB, KFMT,
        )


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation (IEEE: in exact fp32, b converted to it)."""
    if IEEE:
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def _score_tile(q, q_neg, q_row, mrow, k_base, kb_base, slot, m, offs_d, dmask, stride_ks, stride_bs,
                IEEE: tl.constexpr, KFMT: tl.constexpr, D: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` fp32 scores (unscaled) of the queries ``q`` against the slots ``slot``
    (lanes ``m``) of one KV head: of its keys (KFMT 0, ``k_base``), or of its key index (``k_base``
    the index's codes / page maxima, ``kb_base`` its scales / page minima; the module docstring of
    key_index.py): fp8 ``(q . code) * slot scale`` (1); int4 ``q . (code * group scale)`` (2);
    pages the bound ``q+ . max + q- . min`` of each page (3; ``q`` holds ``q+``, ``q_neg`` ``q-``).

    int4 reads the queries from ``q_row`` (``[BLOCK_M]`` pointers to the rows of ``q``, lanes
    ``mrow``), one group of channels at a time: per group of 32 channels (key_index.INT4_GROUP),
    its 16 code bytes of every slot are loaded once and unpacked into the signed codes of its 32
    channels (exact in any float type), dotted with those channels of ``q`` (K = 32), and the
    product scaled by the group's scale of each slot."""
    mk = m[None, :] & dmask[:, None]
    rows = slot.to(tl.int64)[None, :]
    if KFMT == 1:
        code = tl.load(k_base + rows * stride_ks + offs_d[:, None], mask=mk, other=0)
        sc = tl.load(kb_base + slot.to(tl.int64) * stride_bs, mask=m, other=0.0)
        return _dot(q, code.to(tl.float8e4nv, bitcast=True), IEEE) * sc[None, :]
    elif KFMT == 2:
        offs_b = tl.arange(0, 16)  # the code bytes of one group
        offs_c = tl.arange(0, 32)  # its channels
        acc = tl.zeros([q.shape[0], slot.shape[0]], tl.float32)
        for g in tl.static_range(D // 32):
            byte = tl.load(k_base + rows * stride_ks + (g * 16 + offs_b)[:, None], mask=m[None, :], other=0)
            byte = byte.to(tl.int8, bitcast=True)  # [16, BLOCK_N]; the shifts sign-extend each nibble
            # [32, BLOCK_N] codes in channel order: channel 2i is byte i's low nibble, 2i + 1 its high one
            code = tl.reshape(tl.permute(tl.join((byte << 4) >> 4, byte >> 4), (0, 2, 1)), [32, slot.shape[0]])
            q_g = tl.load(q_row[:, None] + (g * 32 + offs_c)[None, :], mask=mrow[:, None], other=0.0)
            if IEEE:
                q_g = q_g.to(tl.float32)
            sc = tl.load(kb_base + slot.to(tl.int64) * stride_bs + g, mask=m, other=0.0)
            acc += _dot(q_g, code, IEEE) * sc[None, :]
        return acc
    elif KFMT == 3:
        mx = tl.load(k_base + rows * stride_ks + offs_d[:, None], mask=mk, other=0.0)
        mn = tl.load(kb_base + rows * stride_bs + offs_d[:, None], mask=mk, other=0.0)
        return _dot(q, mx, IEEE) + _dot(q_neg, mn, IEEE)
    else:
        return _dot(q, tl.load(k_base + rows * stride_ks + offs_d[:, None], mask=mk, other=0.0), IEEE)


@triton.jit
def _group_score_item(
    Q, K, KB, PAD, LO, HI, FLAG, KEYS, HIST, TAKEN, TMAX,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_bb, stride_bh, stride_bs, stride_keys, stride_tmax,
    scale, S, CHUNK, MIN_CHUNK, gid, sp, splits,
    HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, AGG_MAX: tl.constexpr, IEEE: tl.constexpr,
    ZERO_SCRATCH: tl.constexpr, ZROWS: tl.constexpr, HIST_ROW: tl.constexpr, TILE_MAX: tl.constexpr,
    SUB: tl.constexpr, KFMT: tl.constexpr,
):
    """Scores of split ``sp`` (of ``splits``) of live KV group ``gid``'s (``b * Hkv + kvh``)
    middle region, for all G heads at once.

    The G query heads of group (b, kvh) sit in the M rows of a [BLOCK_M, BLOCK_D] tile (rows
    >= G are zero and masked); each [BLOCK_N, BLOCK_D] tile of the KV head's keys is loaded
    once and scored by one ``tl.dot`` (fp32 accumulation; exact IEEE fp32 for fp32 inputs).
    Per-head mode (AGG_MAX off): the keys of row ``b*Hq + kvh*G + g`` are written for the
    retrieving heads ``g`` only (FLAG [B*Hq]); grouped mode (AGG_MAX): the maximum over the G
    heads goes to the group's row ``b*Hkv + kvh``. ZERO_SCRATCH (the radix8 select): the split
    program 0 of the group also zeroes the radix histograms and candidate counters of the rows
    it writes (HIST_ROW int32 each; the select accumulates into them; stream order makes this
    happen before it starts). TILE_MAX (the tilemax select): also the largest key of every SUB-key sub-tile of
    each row written, to ``TMAX[row, t]``.
    """
    b = gid // HKV
    kvh = gid % HKV
    pad = tl.load(PAD + b)
    lo = tl.maximum(tl.load(LO + b), 0)  # sub-tiles of the tile maxima count from lo
    hi = tl.minimum(tl.load(HI + b), S - pad)
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
    q_row = Q + b * stride_qb + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_row[:, None] + offs_d[None, :], mask=mrow[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if IEEE:
        q = q.to(tl.float32)
    q_neg = q
    if KFMT == 3:  # the page bound's two halves
        q_neg = tl.where(q < 0, q, tl.zeros_like(q))
        q = tl.where(q > 0, q, tl.zeros_like(q))
    k_base = K + b.to(tl.int64) * stride_kb + kvh * stride_kh  # > 2^31 elements ok
    kb_base = KB + b.to(tl.int64) * stride_bb + kvh * stride_bh
    if ZERO_SCRATCH:
        if sp == 0:
            offs_z = tl.arange(0, HIST_ROW)
            for g in tl.static_range(ZROWS):  # the scratch rows this group writes
                if AGG_MAX:
                    zr = b * HKV + kvh  # a live group: its flag is set
                else:
                    zr = b * (HKV * GROUP) + kvh * GROUP + g
                if tl.load(FLAG + zr) != 0:
                    tl.store(HIST + zr.to(tl.int64) * HIST_ROW + offs_z, tl.zeros([HIST_ROW], tl.int32))
                    tl.store(TAKEN + zr, 0)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        m = j < end
        s = _score_tile(q, q_neg, q_row, mrow, k_base, kb_base, pad + j, m, offs_d, dmask, stride_ks, stride_bs, IEEE,
                        KFMT, D)
        s = (s * scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        if AGG_MAX:
            s = tl.max(tl.where(mrow[:, None], s, float("-inf")), axis=0)
            key = _orderable_key(s)
            tl.store(KEYS + out_row * stride_keys + j, key, mask=m)
            if TILE_MAX:
                _tile_max_store(TMAX + out_row * stride_tmax, key, m, n0, lo, end, BLOCK_N, SUB)
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


# ----------------------------------------------------------------------------- launchers


def _retrieve(
    q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
    flags: torch.Tensor, k: int, scale: float, *, grouped: bool, key_format: int = 0,
    key_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """The launcher of both: per-head rows (``grouped`` off, flags [B, Hq]) or one row per KV
    group (flags [B, Hkv], scores = max over the group's heads). Returns [B, rows per sequence, k].

    ``key_format`` / ``key_b`` (key_index.py's stage 1): ``k_cache`` is a key index's first
    tensor, ``key_b`` its second, scored as the score kernel's KFMT (its slots: cache slots, or
    pages with ``pad`` 0 and the region in pages). The select and the benchmark's switches are
    those in force (:func:`retrieval_tuning`).

    Raises:
        ValueError: a radix8 stop point (``stop_after``) with the tilemax select.
    """
    require_triton(q, k_cache)
    tuning = _tuning
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = gqa_group(Hq, Hkv)
    H = Hkv if grouped else Hq  # rows per sequence
    k = int(k)
    select = default_select(k) if tuning.select == "auto" else tuning.select
    if select != "radix8" and tuning.stop_after in RADIX8_STOP_POINTS:
        stops = tuple(p for p in STOP_POINTS if p not in RADIX8_STOP_POINTS)
        raise ValueError(f"stop_after={tuning.stop_after!r} is a stage of the radix8 select; "
                         f"select={select!r} stops after one of {stops}")
    R = B * H
    if R == 0 or k == 0 or S == 0:
        return torch.full((B, H, k), -1, dtype=torch.int32, device=q.device)
    out = torch.empty((B, H, k), dtype=torch.int32, device=q.device)  # every row is written
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    flags = flags.reshape(-1).contiguous()
    radix = select == "radix8"
    hist = torch.empty((R, HIST_ROW) if radix else (1,), dtype=torch.int32, device=q.device)
    taken = torch.empty((R,) if radix else (1,), dtype=torch.int32, device=q.device)
    flags_per_group = 1 if grouped else group  # the rows are the groups in grouped mode
    ngp, fgp = next_pow2(R // flags_per_group, 16), next_pow2(flags_per_group)
    compact_in_score = ngp * fgp <= _SCORE_COMPACT_MAX  # else a compaction launch first
    if compact_in_score:
        order = torch.empty(R, dtype=torch.int32, device=q.device)
        count = torch.empty(1, dtype=torch.int32, device=q.device)
        gorder, gcount = order, count  # unused
    else:
        order, count, gorder, gcount = _compact(flags, group, with_groups=not grouped)
        if grouped:
            gorder, gcount = order, count
    if tuning.stop_after == "compact":
        return out
    keys = torch.empty((R, S), dtype=torch.int32, device=q.device)
    block = select_chunk(S) if tuning.select_block is None else next_pow2(int(tuning.select_block), 16)
    block_d = next_pow2(D, 16)
    # 128 keys per tile for 2-byte keys; fp32 keeps 32 KB tiles so that three stages fit in shared memory
    block_n = max(16, min(128, 16384 // block_d) if k_cache.element_size() <= 2 else min(64, 8192 // block_d))
    warps, stages, fixed_chunk, per_sm = 4, 3, 0, _SCORE_PROGRAMS_PER_SM
    cfg = tuning.score_cfg
    if cfg is not None:  # (block_n, warps, stages, chunk or 0[, programs per SM]): the probe's tuning
        block_n, warps, stages = cfg[0], cfg[1], cfg[2]
        fixed_chunk = triton.cdiv(cfg[3], block_n) * block_n if cfg[3] else 0
        per_sm = cfg[4] if len(cfg) > 4 else per_sm
    min_chunk = triton.cdiv(_SCORE_MIN_CHUNK, block_n) * block_n
    max_splits = triton.cdiv(S, fixed_chunk or min_chunk)
    programs = max(1, min(per_sm * num_sms(q.device), B * Hkv * max_splits))
    sub, tmax = tilemax_scratch(R, S, block_n, block, q.device) if not radix else (32, keys)  # keys: unused
    kb = k_cache if key_b is None else key_b
    _group_score_kernel[(programs,)](
        q, k_cache, kb, pad, lo, hi, flags, gorder, gcount, keys, hist, taken, tmax, order, count,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kb.stride(0), kb.stride(1), kb.stride(2), keys.stride(0), tmax.stride(0), float(scale), S, fixed_chunk,
        min_chunk, max_splits, R,
        HKV=Hkv, GROUP=group, D=D, BLOCK_M=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        AGG_MAX=grouped, IEEE=q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16),
        ZERO_SCRATCH=radix, ZROWS=1 if grouped else group, HIST_ROW=HIST_ROW, TILE_MAX=not radix, SUB=sub,
        COMPACT=compact_in_score, BLOCK_R=min(next_pow2(R, 16), 1024), FG=flags_per_group, FGP=fgp, NGP=ngp,
        KFMT=key_format, num_warps=warps, num_stages=stages,
    )
    if tuning.stop_after == "score":
        return out
    if radix:
        radix8_select(keys, hist, taken, out, pad, lo, hi, order, count, k, block, tuning.select_warps,
                      merge_rank=tuning.merge_rank,
                      stop_after=None if tuning.stop_after == "select" else tuning.stop_after)
    else:
        tilemax_select(keys, tmax, sub, out, pad, lo, hi, order, count, k, block, tuning.select_warps)
    return out


def topk_retrieval(q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   retrieve: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    """Triton top-k retrieval: work only for retrieving rows, exact order, no host sync.

    Launches: the group-aware scoring (a persistent grid over the live KV groups x sequence
    chunks, the chunks sized on the device from the live count; each group's keys are read once
    for all its retrieving heads; it also compacts the retrieving rows), then the select
    (:func:`default_select`): ``"tilemax"`` up to k = :data:`TILEMAX_MAX_K`, one program per row
    from a threshold of the score kernel's sub-tile maxima; ``"radix8"`` above, 8-bit radix
    passes and a collect on persistent grids, then a block sort and a merge finish
    (:data:`~.topk_select.MERGE_RANK`). Scratch: ``[B*Hq, S]`` int32 keys; tilemax:
    ``[B*Hq, S / 32]`` int32 sub-tile maxima and ``[B*Hq, 4096 + ~1.125 k]`` int64 candidates;
    radix8: ``[B*Hq, ~1.125 k]`` int64 candidates and ``[B*Hq, 1024]`` int32 histograms (the
    ``"count"`` finish: also ``[B*Hq, ~1.125 k]`` int32 ranks).

    Args and result as :func:`topk_retrieval_reference`. Benchmarks and tests pick the select and
    its tuning with :func:`retrieval_tuning`.
    """
    return _retrieve(q, k_cache, pad, lo, hi, retrieve, k, scale, grouped=False)


def topk_retrieval_grouped(q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor,
                           hi: torch.Tensor, retrieve: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    """Triton group-shared top-k retrieval: one index list per KV head (no host sync).

    Same launches as :func:`topk_retrieval` with one scratch row per (b, kvh): each live
    group's keys are read once, scored for its G heads by one tensor-core dot per tile, and
    the maximum over the heads is ranked. Args and result as
    :func:`topk_retrieval_grouped_reference`; the tuning as in :func:`topk_retrieval`.
    """
    return _retrieve(q, k_cache, pad, lo, hi, retrieve, k, scale, grouped=True)


# ----------------------------------------------------------------------------- references


def _topk_of_scores(
    scores: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
    retrieve: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact top-k of ``scores [B, R, S]`` (per slot) over each row's middle region: the
    ``k`` best real indices, descending score, ties lower index first, -1 padded; rows with
    ``retrieve [B, R]`` off are all -1. ``candidates [B, R, S]`` bool (the re-rank of an
    indexed retrieval): only the slots it marks count, the others as if outside the region."""
    B, R, S = scores.shape
    real = torch.arange(S, device=scores.device).unsqueeze(0) - pad.long().unsqueeze(1)  # [B, S]
    in_mid = (real >= lo.long().unsqueeze(1)) & (real < hi.long().unsqueeze(1)) & (real >= 0)
    valid = in_mid.unsqueeze(1) & retrieve.unsqueeze(-1)  # [B, R, S]
    if candidates is not None:
        valid = valid & candidates
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


def topk_retrieval_reference(q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor,
                             hi: torch.Tensor, retrieve: torch.Tensor, k: int, scale: float) -> torch.Tensor:
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


def topk_retrieval_grouped_reference(q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, lo: torch.Tensor,
                                     hi: torch.Tensor, retrieve: torch.Tensor, k: int, scale: float) -> torch.Tensor:
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

    Args and result as :func:`topk_retrieval_reference`, but ``retrieve``: ``[B, Hkv]`` bool, the
    KV groups that retrieve, and the result ``[B, Hkv, k]``.
    """
    scores = _group_scores(q, k_cache, scale).amax(dim=2)  # [B, Hkv, S]
    return _topk_of_scores(scores, pad, lo, hi, retrieve, k)
