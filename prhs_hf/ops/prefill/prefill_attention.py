"""Sparse prefill attention with PSAW windows and ETF frozen rows (SPEC §3).

``prefill_attention(q, k, v, plan, scale) -> out``

* ``q [B, Hq, Lq, D]``, ``k``/``v`` ``[B, Hkv, Lk, D]`` (HF layout; last dim contiguous, other
  strides free); fp16, bf16 or fp32; ``D <= 256``.
* ``plan``: a :class:`~prefill_plan.PrefillPlan` (left padding, query start, PSAW window starts,
  sink, ETF frozen rows); which key each row sees is defined there (``prefill_plan.py``).
* Returns ``[B, Lq, Hq, D]`` contiguous in q's dtype (what HF attention functions return).
  Inactive rows, and rows that see no key at all, are exactly zero.

The Triton kernel follows FlashAttention-2 (Triton tutorial ``06-fused-attention``): one
program per (query tile, query head); the query tile stays in registers while the KV loop
visits only the two visible intervals of the tile, the sink prefix ``[0, sink)`` and the
active tail ``[min_r win_lo, max_r i]`` (both over the tile's *active* rows); KV tiles in the
excluded middle are never loaded. The tail is split into three runs: the PSAW boundary tiles
and the causal-diagonal tiles apply the exact element predicate, the interior tiles between
them run unmasked. A tile without active rows loads nothing and writes zeros. Online softmax
and the accumulator are fp32 (base-2 exponentials with the scale folded in).

Scheduling: the grid is ``(n_tiles * G, B * Hkv)`` with ``G = Hq // Hkv``; the ``G`` query heads
of one KV head and all tiles of that KV head are consecutive programs (heaviest tiles first),
so that K/V tiles are reused from L2 across the GQA group and across query tiles.

:func:`prefill_attention_reference` is the pure-PyTorch path (CPU reference), chunked over
query rows, on the predicate :func:`prefill_plan.prefill_visibility` (which the FlexAttention
backend, ``flex_prefill.py``, reads too).
"""

from __future__ import annotations

import torch

from ..triton_support import interpreting, next_pow2, require_triton, tl, triton
from .prefill_plan import PrefillPlan, prefill_visibility

__all__ = [
    "prefill_attention",
    "prefill_attention_reference",
    "INTERPRET_BLOCKS",
]

#: Block sizes (BLOCK_M, BLOCK_N) used under ``TRITON_INTERPRET=1`` (no autotuning there).
INTERPRET_BLOCKS = (32, 32)

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- reference


def _reference_chunk_rows(B: int, Hq: int, Lk: int, budget: int = 1 << 21) -> int:
    """Query rows per chunk so that one chunk's fp32 scores hold about ``budget`` elements."""
    return max(1, budget // max(1, B * Hq * Lk))


def prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PrefillPlan, scale: float
) -> torch.Tensor:
    """Pure-PyTorch prefill attention (module docstring contract), computed in fp32.

    Chunked over query rows: no ``Lq x Lk`` tensor exists, only ``chunk x Lk`` scores per head.
    GQA by broadcasting the query group over its KV head (K/V are not repeated). Rows that see
    no key return zeros. Exact in fp32 up to summation order.
    """
    B, Hq, Lq, D, Hkv, Lk = plan.check(q, k, v)
    G = Hq // Hkv
    dev = q.device
    plan = plan.on(dev)
    pad, q_start, win_lo = plan.pad, plan.q_start, plan.win_lo
    flo, fhi = plan.frozen_lo[:, None, None], plan.frozen_hi[:, None, None]
    kt = k.float().transpose(-1, -2)  # [B, Hkv, D, Lk]
    vf = v.float()
    out = torch.empty(B, Lq, Hq, D, dtype=q.dtype, device=dev)
    key_real = torch.arange(Lk, device=dev)[None, :] - pad[:, None]  # [B, Lk]
    step = _reference_chunk_rows(B, Hq, Lk)
    for r0 in range(0, Lq, step):
        r1 = min(Lq, r0 + step)
        C = r1 - r0
        rows = torch.arange(r0, r1, device=dev)
        i = q_start[:, None] + rows[None, :]  # [B, C]
        vis = prefill_visibility(i[:, :, None], key_real[:, None, :], win_lo[:, r0:r1, None], plan.sink, flo, fhi)
        qc = q[:, :, r0:r1].float().reshape(B, Hkv, G * C, D)
        s = torch.matmul(qc, kt).view(B, Hkv, G, C, Lk) * scale
        s = s.masked_fill(~vis[:, None, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: p = 0
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p.view(B, Hkv, G * C, Lk), vf).view(B, Hkv, G, C, D)
        o = o / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, r0:r1] = o.reshape(B, Hq, C, D).transpose(1, 2).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def _load_kv_tile(ptrs, col_ok, d_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One K or V tile; slots past ``col_ok`` (``MASKED`` tiles only) and columns past ``D`` read as 0."""
    if MASKED:
        if EVEN_D:
            x = tl.load(ptrs, mask=col_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=col_ok[:, None] & d_ok, other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok, other=0.0)
    return x


@triton.jit
def _attend_kv_run(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    row_i,
    win_row,
    offs_n,
    offs_d,
    start,
    stop,
    kv_hi,
    sink,
    qk_scale,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Online-softmax update over the KV tiles starting at ``start, start + BLOCK_N, ... < stop``.

    ``MASKED`` tiles apply the exact element predicate (and bound the loads by ``kv_hi``);
    unmasked tiles are fully visible to every active row of the query tile. ``DOT_F32``: both
    dots in fp32 (``q`` is already fp32 then).
    """
    d_ok = offs_d[None, :] < D
    for j0 in range(start, stop, BLOCK_N):
        cols = j0 + offs_n
        col_ok = cols < kv_hi  # read by MASKED tiles only
        k = _load_kv_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :], col_ok, d_ok, MASKED, EVEN_D)
        if DOT_F32:
            qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if MASKED:
            c = cols[None, :]
            vis = (c <= row_i[:, None]) & ((c < sink) | (c >= win_row[:, None])) & col_ok[None, :]
            qk = tl.where(vis, (qk * qk_scale).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        else:
            qk = (qk * qk_scale).to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = m_new
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_kv_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :], col_ok, d_ok, MASKED, EVEN_D)
        if DOT_F32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Pad,
    QStart,
    WinLo,
    FrozenLo,
    FrozenHi,
    Stats,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_om,
    stride_oh,
    stride_wb,
    stride_wm,
    Hkv,
    Lq,
    Lk,
    sink,
    qk_scale,
    LQ_BUCKET,  # autotune key only
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    WITH_STATS: tl.constexpr,
):
    """One (query tile, query head) of the sparse prefill; see the module docstring."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    n_tiles = tl.cdiv(Lq, BLOCK_M)
    tile = n_tiles - 1 - pid0 // GROUP  # heaviest (last) tiles first
    h = (pid1 % Hkv) * GROUP + pid0 % GROUP
    b = pid1 // Hkv
    kvh = pid1 % Hkv
    b64 = b.to(tl.int64)

    pad = tl.load(Pad + b)
    qs = tl.load(QStart + b)
    f_lo = tl.load(FrozenLo + b)
    f_hi = tl.load(FrozenHi + b)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D

    row_i = qs + offs_m  # real index of each row
    row_ok = offs_m < Lq
    active = row_ok & (row_i >= 0) & ((row_i < f_lo) | (row_i >= f_hi))
    win_row = tl.load(WinLo + b64 * stride_wb + offs_m * stride_wm, mask=row_ok, other=0)

    # Visible KV range of the tile's active rows (empty when none is active). Reductions over the
    # rows, so that nothing depends on win_lo being monotone. (1 << 29 stands for "none".)
    a_lo = tl.min(tl.where(active, row_i, 1 << 29), 0)
    a_hi = tl.max(tl.where(active, row_i, -1), 0)
    w_lo = tl.min(tl.where(active, win_row, 1 << 29), 0)
    w_hi = tl.max(tl.where(active, win_row, -(1 << 29)), 0)
    kv_hi = tl.minimum(a_hi + 1, Lk - pad)  # exclusive end of the tail and of every load
    s_end = tl.maximum(tl.minimum(sink, kv_hi), 0)  # sink prefix [0, s_end)
    sink_stop = tl.cdiv(s_end, BLOCK_N) * BLOCK_N
    t_start = tl.maximum(tl.maximum(w_lo, s_end), sink_stop)  # tail [t_start, kv_hi)
    n_tail = tl.cdiv(tl.maximum(kv_hi - t_start, 0), BLOCK_N)
    # Tail tiles k1 <= k < k2 are interior: past every row's window start, before the diagonal.
    k1 = tl.minimum(tl.cdiv(tl.maximum(w_hi - t_start, 0), BLOCK_N), n_tail)
    k2 = tl.maximum(tl.minimum(tl.maximum(a_lo + 1 - t_start, 0) // BLOCK_N, n_tail), k1)
    mid_lo = t_start + k1 * BLOCK_N
    mid_hi = t_start + k2 * BLOCK_N
    tail_end = t_start + n_tail * BLOCK_N

    q_ptrs = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    if EVEN_D:
        q = tl.load(q_ptrs, mask=active[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=active[:, None] & d_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh + pad.to(tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh + pad.to(tl.int64) * stride_vn

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # sink prefix
    acc, l_i, m_i = _attend_kv_run(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, row_i, win_row, offs_n, offs_d,
        0, sink_stop, kv_hi, sink, qk_scale, True, EVEN_D, D, BLOCK_N, DOT_F32,
    )
    # tail: PSAW boundary tiles, interior tiles, causal-diagonal tiles
    acc, l_i, m_i = _attend_kv_run(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, row_i, win_row, offs_n, offs_d,
        t_start, mid_lo, kv_hi, sink, qk_scale, True, EVEN_D, D, BLOCK_N, DOT_F32,
    )
    acc, l_i, m_i = _attend_kv_run(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, row_i, win_row, offs_n, offs_d,
        mid_lo, mid_hi, kv_hi, sink, qk_scale, False, EVEN_D, D, BLOCK_N, DOT_F32,
    )
    acc, l_i, m_i = _attend_kv_run(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, row_i, win_row, offs_n, offs_d,
        mid_hi, tail_end, kv_hi, sink, qk_scale, True, EVEN_D, D, BLOCK_N, DOT_F32,
    )

    keep = active & (l_i > 0.0)
    out = acc / tl.where(keep, l_i, 1.0)[:, None]
    out = tl.where(keep[:, None], out, 0.0)
    o_ptrs = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    if EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok)
    if WITH_STATS:
        # KV tiles this program visited, and how many of them ran without the element predicate
        n_visited = sink_stop // BLOCK_N + n_tail
        stat_ptr = Stats + ((b * Hkv + kvh) * GROUP + pid0 % GROUP).to(tl.int64) * (2 * n_tiles) + 2 * tile
        tl.store(stat_ptr, n_visited)
        tl.store(stat_ptr + 1, k2 - k1)


# ----------------------------------------------------------------------------- launcher

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner on GPUs (Hopper-oriented);
# _prune_configs keeps those that fit the head size in shared memory and registers.
_GPU_CONFIGS = (
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 32, 4, 2),
    (64, 64, 8, 2),
)
#: One config for fp32 inputs (exact fp32 dots; correctness path, not tuned).
_FP32_CONFIG = (64, 32, 4, 2)
_SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on H100/H200
_ACC_ELEMS_PER_THREAD = 64  # BLOCK_M * BLOCK_D / threads above this spills registers on sm_90


def _prune_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Keep configs whose staged tiles fit in shared memory and whose accumulator fits in registers.

    Shared memory: ``elt * BLOCK_D * (BLOCK_M + 2 * BLOCK_N * num_stages)`` (Q once, K and V per
    stage, as Triton allocates them for sm_90). Registers: at most
    ``_ACC_ELEMS_PER_THREAD`` fp32 accumulator elements per thread.
    """
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 128))
    elt = 4 if kwargs.get("DOT_F32", named_args.get("DOT_F32", False)) else 2
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        smem = elt * bd * (bm + 2 * bn * max(1, c.num_stages))
        regs = bm * bd // (32 * c.num_warps)
        if smem <= _SMEM_LIMIT and regs <= _ACC_ELEMS_PER_THREAD:
            kept.append(c)
    return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], -c.num_warps))]


_tuned_kernel = None


def _autotuned():  # -> triton Autotuner
    """The autotuned kernel (built on first use, so that importing this module stays cheap)."""
    global _tuned_kernel
    if _tuned_kernel is None:
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in _GPU_CONFIGS
        ]
        _tuned_kernel = triton.autotune(
            configs=configs,
            key=["LQ_BUCKET", "GROUP", "D", "DOT_F32"],
            prune_configs_by={"early_config_prune": _prune_configs},
        )(_prefill_fwd_kernel)
    return _tuned_kernel


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    tile_stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse PSAW/ETF prefill attention (Triton); contract in the module docstring.

    Block sizes are autotuned on GPUs; ``block_m``/``block_n`` (with ``num_warps``,
    ``num_stages``) force one config, and under ``TRITON_INTERPRET=1`` :data:`INTERPRET_BLOCKS`
    is used. ``tile_stats`` (int32 ``[B, Hq, n_tiles, 2]``, needs forced block sizes) receives,
    per program, the number of KV tiles visited and how many of them ran unmasked.
    Sync-free: no host read of device data.
    """
    B, Hq, Lq, D, Hkv, Lk = plan.check(q, k, v)
    require_triton(q)
    dev = q.device
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    plan = plan.on(dev)
    out = torch.empty(B, Lq, Hq, D, dtype=q.dtype, device=dev)
    if Lq == 0 or B == 0 or Hq == 0:
        return out
    G = Hq // Hkv
    block_d = next_pow2(D, 16)
    # fp32 inputs: exact (ieee) fp32 dots. The Triton interpreter multiplies the raw bits of bf16
    # dot operands (a Triton bug), so there bf16 tiles are upcast before each dot.
    dot_f32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
    forced = block_m is not None or block_n is not None or tile_stats is not None or interpreting()
    if forced:
        bm = block_m or INTERPRET_BLOCKS[0]
        bn = block_n or INTERPRET_BLOCKS[1]
    elif q.dtype == torch.float32:
        forced = True
        bm, bn, num_warps, num_stages = _FP32_CONFIG
    with_stats = tile_stats is not None
    if with_stats:
        n_tiles = triton.cdiv(Lq, bm)
        if tuple(tile_stats.shape) != (B, Hq, n_tiles, 2) or tile_stats.dtype != torch.int32:
            raise ValueError(f"tile_stats must be int32 [{B}, {Hq}, {n_tiles}, 2]")
    stats = tile_stats if with_stats else plan.pad
    win_lo = plan.win_lo
    args = (
        q, k, v, out, plan.pad, plan.q_start, win_lo, plan.frozen_lo, plan.frozen_hi, stats,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        win_lo.stride(0), win_lo.stride(1),
        Hkv, Lq, Lk, plan.sink, float(scale) * _LOG2E, next_pow2(Lq),
    )
    meta = dict(GROUP=G, D=D, BLOCK_D=block_d, EVEN_D=block_d == D, DOT_F32=dot_f32, WITH_STATS=with_stats)
    if forced:
        grid = (triton.cdiv(Lq, bm) * G, B * Hkv)
        _prefill_fwd_kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=num_warps, num_stages=num_stages)
    else:
        grid = lambda m: (triton.cdiv(Lq, m["BLOCK_M"]) * G, B * Hkv)  # noqa: E731
        _autotuned()[grid](*args, **meta)
    return out
