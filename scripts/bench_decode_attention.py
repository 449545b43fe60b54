#!/usr/bin/env python
"""Decode attention operator latency, in the shape of the paper's Table IV.

LLaMA-2-7B shapes (32 query and KV heads, head size 128, bf16), batch 8 and 16, context 2k, 4k
and 16k, plus one GQA shape (32 query / 8 KV heads). The token budget is 1/8 of the context,
split like the paper's LongBench setting (sink 64 : local 256 : the rest for top-k plus its
dilation at 16k; see :func:`budget`), so that every head processes at most context/8 keys.

Columns (median of ``triton.testing.do_bench``, each operation captured in a CUDA graph and
replayed, which removes the Python launch overhead the same way for every column):

* ``dense``: PyTorch SDPA, flash backend, over the whole cache;
* ``flex``: FlexAttention (``torch.compile``) with a BlockMask of the same token pattern as the
  sparse step (mask construction excluded), 128-token KV blocks;
* ``sparse``: our fused sparse-attention kernel alone, on the step's index lists;
* ``cis8`` / ``cis16``: our whole CIS decode step with block size s = 8 / 16: match + top-k
  retrieval for exactly ceil(B*Hq/s) rows (the steady-state share rate of one retrieval per
  head per block; the other rows share an anchor) + index composition + attention;
* ``ref16``: the same step with the PyTorch reference ops (s = 16).

The CIS steps run the anchor-set fast path (``cis_decode_step(..., anchor_sets=True)``,
anchors store their dilated sets, kernels/compose_indices.py); ``cis16_topk_ms`` is the same
step with top-k anchors (every row's set sorted at every step), for comparison.

Stage breakdown of the CIS-16 step (each stage captured and replayed alone, on the step's own
inputs): ``match``; ``retrieval`` for the real number of retrieving rows, split into
``compact`` (row compaction), ``score`` (K pass) and ``select`` (top-k); ``dilated set`` (the
retrieving rows' anchor sets); ``compose``; ``attention`` (= ``sparse``); ``glue`` (the torch
ops between the kernels); ``gap`` = full step - sum of the stages (launch gaps). For the top-k
anchor path also its ``compose_indices`` and its gather/where glue. Each row states the
target (CIS-16 >= 4.5x dense for MHA, not slower than dense for GQA) and, when it is missed,
the largest stage.

Keys are Gaussian with "hot spans" (runs of 64 tokens aligned with a per-head direction that
the queries share), so that top-k sets are clustered as in real attention and a 128-token
BlockMask skips part of the cache; the fraction of KV blocks FlexAttention visits is reported.
Bandwidth of the sparse kernel = (K+V rows gathered + q + out) bytes / time, next to the
device-copy bandwidth measured in the same run.

Usage: ``python scripts/bench_decode_attention.py [--quick] [--out DIR]``. Without CUDA it runs
a tiny ``--quick`` smoke test through the Triton interpreter (flex and flash columns n/a).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

if not torch.cuda.is_available():  # CPU smoke test: kernels through the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

from prhs_hf.kernels.cis_match import cis_match  # noqa: E402
from prhs_hf.kernels.compose_indices import compose_from_sets, compose_indices, dilated_set  # noqa: E402
from prhs_hf.kernels.decode_ops import REFERENCE_OPS, TRITON_OPS, cis_decode_step  # noqa: E402
from prhs_hf.kernels.sparse_decode_attention import sparse_decode_attention  # noqa: E402
from prhs_hf.kernels.topk_retrieval import topk_retrieval  # noqa: E402

TAU = 0.8
SPAN = 64  # hot-span length (tokens)
TARGET_MHA = 4.5  # CIS-16 step at least this many times faster than dense (MHA shapes)
TARGET_GQA = 1.0  # ... and at least as fast as dense for GQA
STAGES = ("match", "retrieval", "dilated_set", "compose", "attention", "glue")


@dataclass
class Shape:
    B: int
    Hq: int
    Hkv: int
    D: int
    ctx: int


@dataclass
class Budget:
    sink: int
    local: int
    k: int
    dil_m: int
    dil_r: int
    cap: int


def budget(ctx: int) -> Budget:
    """1/8 of the context, split sink : local : top-k(+dilation) like the paper at 16k.

    N = ctx/8; sink = max(8, N/32); local = N/8; the rest R holds k selected tokens and up to
    2*r*m dilation neighbours with m = k/3, r = 1 (the paper's defaults), so k = 3R/5 and
    cap = sink + local + k + 2m <= N. At 16k: 64 / 256 / k = 1036, m = 345, cap = 2046.
    """
    n = ctx // 8
    sink = max(8, n // 32)
    local = n // 8
    k = 3 * (n - sink - local) // 5
    m, r = k // 3, 1
    return Budget(sink, local, k, m, r, sink + local + k + 2 * r * m)


def shapes(quick: bool, cuda: bool) -> list[Shape]:
    if not cuda:
        return [Shape(2, 4, 2, 32, 512)]
    if quick:
        return [Shape(8, 32, 32, 128, 2048), Shape(16, 32, 32, 128, 16384)]
    out = [Shape(b, 32, 32, 128, c) for b in (8, 16) for c in (2048, 4096, 16384)]
    return out + [Shape(16, 32, 8, 128, 16384)]


# ----------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object], cuda: bool) -> tuple[float, str]:
    """Median milliseconds of ``fn``: CUDA-graph replay under do_bench (eager on failure)."""
    if not cuda:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "cpu-interpreter"
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"), "graph"
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"    (CUDA graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)", flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), "eager"


def copy_bandwidth(cuda: bool, dev: torch.device) -> float:
    """GB/s of a large device-to-device copy (read + write bytes)."""
    n = (1 << 30) if cuda else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    if cuda:
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    else:
        ms, _ = timed(lambda: dst.copy_(src), cuda)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- inputs


def make_inputs(sh: Shape, bud: Budget, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Cache with hot spans, one decode query per head, no padding, t = ctx for every row."""
    g = torch.Generator(device=dev).manual_seed(seed)
    B, Hq, Hkv, D, S = sh.B, sh.Hq, sh.Hkv, sh.D, sh.ctx
    group = Hq // Hkv
    u = torch.randn(B, Hkv, D, generator=g, device=dev)
    u = u / u.norm(dim=-1, keepdim=True)
    lo, hi = bud.sink, S - bud.local
    n_spans = max(1, math.ceil(1.25 * bud.k / SPAN))
    starts = torch.randint(lo, max(lo + 1, hi - SPAN), (B, Hkv, n_spans), generator=g, device=dev)
    pos = torch.arange(S, device=dev)
    hot = ((pos >= starts[..., None]) & (pos < starts[..., None] + SPAN)).any(dim=2)  # [B, Hkv, S]
    k_cache = torch.randn(B, Hkv, S, D, generator=g, device=dev)
    # hot keys score ~4 standard deviations above the others for these queries
    k_cache += (4.0 / 1.5) * math.sqrt(D) * hot[..., None].float() * u[:, :, None, :]
    v_cache = torch.randn(B, Hkv, S, D, generator=g, device=dev).to(dtype)
    k_cache = k_cache.to(dtype)
    q = torch.randn(B, Hq, D, generator=g, device=dev) + 1.5 * u.repeat_interleave(group, dim=1)
    q = q.to(dtype)
    i32 = torch.int32
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        pad=torch.zeros(B, dtype=i32, device=dev),
        t=torch.full((B,), S, dtype=i32, device=dev),
        lo=torch.full((B,), lo, dtype=i32, device=dev),
        hi=torch.full((B,), hi, dtype=i32, device=dev),
        active=torch.ones(B, dtype=torch.bool, device=dev),
        scale=1.0 / math.sqrt(D),
    )


def make_anchors(x: dict, sh: Shape, bud: Budget, s: int, g: torch.Generator) -> tuple:
    """Block state mid-way: s-1 anchors per head; exactly ceil(B*Hq/s) rows match none.

    Every anchor slot a holds the true top-k of a query near the current one (cosine ~0.97);
    a sharing row's anchor vector at one random slot is that query's direction, the other
    anchor vectors (and all of a retrieving row's) are random directions (cosine ~0.1).
    """
    B, Hq, D = sh.B, sh.Hq, sh.D
    dev = x["q"].device
    n_anchor = max(1, s - 1)
    qf = x["q"].float()
    everyone = torch.ones(B, Hq, dtype=torch.bool, device=dev)
    near_q, near_idx = [], []
    for _ in range(s):
        noise = torch.randn(B, Hq, D, generator=g, device=dev)
        near = (qf + 0.25 * qf.norm(dim=-1, keepdim=True) / math.sqrt(D) * noise).to(x["q"].dtype)
        near_q.append(near.float())
        near_idx.append(
            topk_retrieval(near, x["k_cache"], x["pad"], x["lo"], x["hi"], everyone, bud.k, x["scale"])
        )
    anchor_idx = torch.stack(near_idx, dim=2)
    n_retrieve = math.ceil(B * Hq / s)
    perm = torch.randperm(B * Hq, generator=g, device=dev)
    retrieve = torch.zeros(B * Hq, dtype=torch.bool, device=dev)
    retrieve[perm[:n_retrieve]] = True
    slot = torch.randint(0, n_anchor, (B, Hq), generator=g, device=dev)
    planted = torch.zeros(B, Hq, s, dtype=torch.bool, device=dev)
    planted.scatter_(2, slot[..., None], True)
    planted &= ~retrieve.view(B, Hq, 1)
    anchor_q = torch.where(planted[..., None], torch.stack(near_q, dim=2), torch.randn(B, Hq, s, D, generator=g, device=dev))
    anchor_q = anchor_q / anchor_q.norm(dim=-1, keepdim=True)
    anchor_count = torch.full((B, Hq), n_anchor, dtype=torch.int32, device=dev)
    return anchor_q, anchor_count, anchor_idx, n_retrieve


def flex_pattern(idx: torch.Tensor, count: torch.Tensor, S: int) -> torch.Tensor:
    """[B, Hq, S] bool membership of the step's index lists (pad = 0)."""
    B, H, cap = idx.shape
    member = torch.zeros(B, H, S + 1, dtype=torch.bool, device=idx.device)
    valid = torch.arange(cap, device=idx.device) < count[..., None]
    member.scatter_(2, torch.where(valid, idx.long(), S), True)
    return member[..., :S]


# ----------------------------------------------------------------------------- one shape


def run_shape(sh: Shape, cuda: bool, dev: torch.device, dtype: torch.dtype, flex_fn) -> dict:
    bud = budget(sh.ctx)
    x = make_inputs(sh, bud, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    row: dict = dict(asdict(sh), **asdict(bud), dtype=str(dtype).replace("torch.", ""))
    q, kc, vc, scale = x["q"], x["k_cache"], x["v_cache"], x["scale"]
    common = dict(sink=bud.sink, k=bud.k, dil_m=bud.dil_m, dil_r=bud.dil_r, cap=bud.cap, scale=scale, tau=TAU)
    geo = (x["pad"], x["t"], x["lo"], x["hi"], x["hi"])

    steps = {}
    for s in (8, 16):
        aq, ac, ai, n_ret = make_anchors(x, sh, bud, s, g)
        # the anchors' dilated sets (what the integration stores with anchor_sets=True)
        sets = dilated_set(ai.view(sh.B, sh.Hq * s, -1), True, bud.dil_m, bud.dil_r).view(sh.B, sh.Hq, s, -1)

        def step(ops=TRITON_OPS, aq=aq, ac=ac, sets=sets):
            return cis_decode_step(ops, q, kc, vc, *geo, aq, ac, sets, x["active"], **common, anchor_sets=True)

        def step_topk(ops=TRITON_OPS, aq=aq, ac=ac, ai=ai):
            return cis_decode_step(ops, q, kc, vc, *geo, aq, ac, ai, x["active"], **common)

        res = step()
        res_topk = step_topk()
        if not (torch.equal(res.idx, res_topk.idx) and torch.equal(res.count, res_topk.count)):
            print(f"    WARNING: s={s}: anchor-set and top-k paths compose different index lists", flush=True)
        got_ret = int((res.best == -1).sum())
        if got_ret != n_ret:
            print(f"    note: s={s}: {got_ret} rows retrieve (planned {n_ret})", flush=True)
        steps[s] = (step, res, got_ret, step_topk, aq, ac, ai, sets)
    step16, res16 = steps[16][0], steps[16][1]
    idx, count = res16.idx, res16.count
    total_keys = int(count.sum())
    row["avg_kv_per_head"] = total_keys / (sh.B * sh.Hq)
    row["retrieving_rows_s8"] = steps[8][2]
    row["retrieving_rows_s16"] = steps[16][2]

    # dense SDPA (flash)
    q4 = q[:, :, None, :]
    gqa = sh.Hq != sh.Hkv
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # GQA: the G query heads of a KV head are G queries of one attention (same maths as
        # enable_gqa, and the flash backend takes it without GQA support)
        q_dense = q.view(sh.B, sh.Hkv, sh.Hq // sh.Hkv, sh.D) if gqa else q4

        def dense():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q_dense, kc, vc, scale=scale)

        try:
            row["dense_ms"], row["dense_timing"] = timed(dense, cuda)
        except Exception as exc:  # noqa: BLE001
            print(f"    dense flash failed: {exc}", flush=True)
            row["dense_ms"], row["dense_timing"] = None, "n/a"
    else:
        row["dense_ms"], row["dense_timing"] = None, "n/a"

    # FlexAttention with the same token pattern (mask construction excluded)
    row["flex_ms"], row["flex_timing"], row["flex_block_fraction"] = None, "n/a", None
    if flex_fn is not None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask

            member = flex_pattern(idx, count, sh.ctx)

            def mask_mod(b, h, q_idx, kv_idx):
                return member[b, h, kv_idx]

            bm = create_block_mask(mask_mod, sh.B, sh.Hq, 1, sh.ctx, device=dev, BLOCK_SIZE=128)
            n_blocks = triton.cdiv(sh.ctx, 128)
            visited = bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0)
            row["flex_block_fraction"] = float(visited) / (sh.B * sh.Hq * n_blocks)

            def flex():
                return flex_fn(q4, kc, vc, block_mask=bm, scale=scale, enable_gqa=gqa)

            out_flex = flex()[:, :, 0]
            err = (out_flex.float() - res16.out.float()).abs().max().item()
            row["flex_max_abs_diff"] = err
            row["flex_ms"], row["flex_timing"] = timed(flex, cuda)
        except Exception as exc:  # noqa: BLE001
            print(f"    flex failed: {type(exc).__name__}: {exc}", flush=True)

    # our sparse kernel alone, the whole steps, the reference step
    row["sparse_ms"], row["sparse_timing"] = timed(
        lambda: sparse_decode_attention(q, kc, vc, x["pad"], idx, count, scale), cuda
    )
    if cuda:  # split-K sweep of the sparse kernel, for tuning (auto = the heuristic above)
        row["sparse_ms_by_splits"] = {
            str(n): timed(lambda n=n: sparse_decode_attention(q, kc, vc, x["pad"], idx, count, scale, num_splits=n), cuda)[0]
            for n in (1, 2, 4, 8)
        }
    row["cis8_ms"], row["cis8_timing"] = timed(steps[8][0], cuda)
    row["cis16_ms"], row["cis16_timing"] = timed(step16, cuda)
    row["cis16_topk_ms"], _ = timed(steps[16][3], cuda)
    row["ref16_ms"], row["ref16_timing"] = timed(lambda: step16(REFERENCE_OPS), cuda)
    row.update(stage_breakdown(x, bud, steps[16], row["sparse_ms"], cuda))

    elem = kc.element_size()
    gathered = total_keys * sh.D * elem * 2 + 2 * sh.B * sh.Hq * sh.D * elem
    row["sparse_bytes"] = gathered
    row["sparse_GBps"] = gathered / (row["sparse_ms"] * 1e-3) / 1e9
    dense = row["dense_ms"]
    for col in ("flex", "sparse", "cis8", "cis16", "ref16"):
        v = row[f"{col}_ms"]
        row[f"{col}_speedup_vs_dense"] = (dense / v) if (dense and v) else None
    if row["flex_ms"]:
        row["cis16_speedup_vs_flex"] = row["flex_ms"] / row["cis16_ms"]
    want = TARGET_GQA if sh.Hq != sh.Hkv else TARGET_MHA
    row["cis16_target_speedup"] = want
    row["cis16_target_ms"] = dense / want if dense else None
    row["cis16_target_met"] = (row["cis16_ms"] <= row["cis16_target_ms"]) if dense else None
    big = max(STAGES, key=lambda st: row[f"stage16_{st}_ms"])
    row["cis16_largest_stage"] = big
    if row["cis16_target_met"] is False:
        row["cis16_limited_by"] = (
            f"{big} {row[f'stage16_{big}_ms']:.3f} ms of {row['cis16_ms']:.3f} "
            f"(target {row['cis16_target_ms']:.3f}; non-attention {row['cis16_ms'] - row['stage16_attention_ms']:.3f})"
        )
    return row


def stage_breakdown(x: dict, bud: Budget, st16: tuple, attention_ms: float, cuda: bool) -> dict:
    """Each stage of the CIS-16 step alone (graph replay) on the step's own inputs."""
    _, res, n_ret, _, aq, ac, ai, sets = st16
    q, kc, pad, lo, hi, t, scale = x["q"], x["k_cache"], x["pad"], x["lo"], x["hi"], x["t"], x["scale"]
    best = res.best
    retrieve = best == -1
    B, H, s, kk = ai.shape
    new_idx, new_set = res.new_idx, res.new_set

    def retrieval(stop="select"):
        return topk_retrieval(q, kc, pad, lo, hi, retrieve, bud.k, scale, _stop_after=stop)

    def topk_glue():  # the gather / where of the top-k anchor path (decode_ops)
        shared = best >= 0
        pick = best.clamp_min(0).long().view(B, H, 1, 1).expand(B, H, 1, kk)
        shared_idx = torch.gather(ai, 2, pick).view(B, H, kk)
        return torch.where(retrieve[..., None], new_idx, torch.where(shared[..., None], shared_idx, -1)), shared

    sel, shared = topk_glue()
    out = {"stage16_retrieving_rows": n_ret}
    fns = {
        "match": lambda: cis_match(q, aq, ac, x["active"], TAU),
        "retrieval": retrieval,
        "retrieval_compact": lambda: retrieval("compact"),
        "retrieval_score": lambda: retrieval("score"),  # compact + score
        "dilated_set": lambda: dilated_set(new_idx, retrieve, bud.dil_m, bud.dil_r),
        "compose": lambda: compose_from_sets(t, lo, hi, hi, best, sets, new_set, bud.sink, bud.cap),
        "glue": lambda: best == -1,
        "topk_compose": lambda: compose_indices(t, lo, hi, hi, sel, shared, bud.sink, bud.dil_m, bud.dil_r, bud.cap),
        "topk_glue": topk_glue,
    }
    for name, fn in fns.items():
        out[f"stage16_{name}_ms"] = timed(fn, cuda)[0]
    out["stage16_attention_ms"] = attention_ms
    out["stage16_retrieval_select_ms"] = out["stage16_retrieval_ms"] - out["stage16_retrieval_score_ms"]
    out["stage16_retrieval_score_ms"] -= out["stage16_retrieval_compact_ms"]
    out["stage16_sum_ms"] = sum(out[f"stage16_{st}_ms"] for st in STAGES)
    return out


# ----------------------------------------------------------------------------- report


def fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| B | ctx | Hq/Hkv | sink/local/k/m | avg KV/head | dense flash ms | flex ms (blocks) "
        "| sparse ms | CIS-8 step ms | CIS-16 step ms | ref step ms | CIS-16 speedup vs dense "
        "| CIS-16 speedup vs flex | sparse GB/s (% copy) |"
    )
    lines = [
        f"Decode attention latency (median ms), {meta['gpu']}, torch {meta['torch']}, "
        f"triton {meta['triton']}, {meta['date']}. Budget = ctx/8 per head. Copy bandwidth "
        f"{meta['copy_GBps']:.0f} GB/s. Retrieving rows per step: ceil(B*Hq/s).",
        "",
        head,
        "|" + "|".join(["---"] * (head.count("|") - 1)) + "|",
    ]
    for r in rows:
        blocks = "" if r["flex_block_fraction"] is None else f" ({100 * r['flex_block_fraction']:.0f}%)"
        bw_pct = 100 * r["sparse_GBps"] / meta["copy_GBps"] if meta["copy_GBps"] else None
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['Hq']}/{r['Hkv']} | {r['sink']}/{r['local']}/{r['k']}/{r['dil_m']} "
            f"| {r['avg_kv_per_head']:.0f} | {fmt(r['dense_ms'])} | {fmt(r['flex_ms'])}{blocks} "
            f"| {fmt(r['sparse_ms'])} | {fmt(r['cis8_ms'])} | {fmt(r['cis16_ms'])} | {fmt(r['ref16_ms'])} "
            f"| {fmt(r['cis16_speedup_vs_dense'], '.2f')} | {fmt(r.get('cis16_speedup_vs_flex'), '.2f')} "
            f"| {r['sparse_GBps']:.0f} ({fmt(bw_pct, '.0f')}%) |"
        )
    head2 = (
        "| B | ctx | Hq/Hkv | retrieving rows | match | retrieval (compact/score/select) | dilated set "
        "| compose | attention | glue | sum | CIS-16 step | gap | top-k-anchor step (its compose, glue) "
        "| target | largest stage |"
    )
    lines += [
        "",
        "Stage breakdown of the CIS-16 step (median ms, each stage replayed alone; gap = step - sum).",
        "",
        head2,
        "|" + "|".join(["---"] * (head2.count("|") - 1)) + "|",
    ]
    for r in rows:
        tgt = "n/a" if r.get("cis16_target_met") is None else (
            f"{'met' if r['cis16_target_met'] else 'MISSED'} (<= {r['cis16_target_ms']:.3f})"
        )
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['Hq']}/{r['Hkv']} | {r['stage16_retrieving_rows']} "
            f"| {fmt(r['stage16_match_ms'])} | {fmt(r['stage16_retrieval_ms'])} "
            f"({fmt(r['stage16_retrieval_compact_ms'])}/{fmt(r['stage16_retrieval_score_ms'])}/{fmt(r['stage16_retrieval_select_ms'])}) "
            f"| {fmt(r['stage16_dilated_set_ms'])} | {fmt(r['stage16_compose_ms'])} | {fmt(r['stage16_attention_ms'])} "
            f"| {fmt(r['stage16_glue_ms'])} | {fmt(r['stage16_sum_ms'])} | {fmt(r['cis16_ms'])} "
            f"| {fmt(r['cis16_ms'] - r['stage16_sum_ms'])} | {fmt(r['cis16_topk_ms'])} "
            f"({fmt(r['stage16_topk_compose_ms'])}, {fmt(r['stage16_topk_glue_ms'])}) | {tgt} "
            f"| {r['cis16_largest_stage']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny subset of the shapes")
    ap.add_argument("--out", default="docs/results", help="output folder (JSON + markdown)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    t_start = time.time()
    meta = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        gpu=torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        tau=TAU,
        hot_span=SPAN,
        retrieval="exactly ceil(B*Hq/s) rows retrieve per step, the rest share an anchor",
    )
    if not cuda:
        print("no CUDA: smoke test through TRITON_INTERPRET=1 (flash and flex columns n/a)", flush=True)
    meta["copy_GBps"] = copy_bandwidth(cuda, dev)
    print(f"device copy bandwidth: {meta['copy_GBps']:.0f} GB/s", flush=True)
    flex_fn = None
    if cuda:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # noqa: BLE001
            print(f"FlexAttention unavailable: {exc}", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for sh in shapes(args.quick or not cuda, cuda):
        b = budget(sh.ctx)
        print(
            f"[{time.time() - t_start:6.1f}s] B={sh.B} ctx={sh.ctx} Hq/Hkv={sh.Hq}/{sh.Hkv} D={sh.D}: "
            f"sink {b.sink}, local {b.local}, k {b.k}, dilation m {b.dil_m} r {b.dil_r}, cap {b.cap}",
            flush=True,
        )
        try:
            rows.append(run_shape(sh, cuda, dev, dtype, flex_fn))
        except torch.cuda.OutOfMemoryError as exc:  # keep the other shapes
            print(f"    out of memory: {exc}", flush=True)
            continue
        r = rows[-1]
        print(
            f"    dense {fmt(r['dense_ms'])}  flex {fmt(r['flex_ms'])}  sparse {fmt(r['sparse_ms'])}  "
            f"cis8 {fmt(r['cis8_ms'])}  cis16 {fmt(r['cis16_ms'])}  ref16 {fmt(r['ref16_ms'])} ms; "
            f"sparse {r['sparse_GBps']:.0f} GB/s",
            flush=True,
        )
        print(
            "    CIS-16 stages: " + "  ".join(f"{st} {fmt(r[f'stage16_{st}_ms'])}" for st in STAGES)
            + f"  (sum {fmt(r['stage16_sum_ms'])}; retrieval compact/score/select "
            f"{fmt(r['stage16_retrieval_compact_ms'])}/{fmt(r['stage16_retrieval_score_ms'])}/"
            f"{fmt(r['stage16_retrieval_select_ms'])}; top-k-anchor step {fmt(r['cis16_topk_ms'])})",
            flush=True,
        )
        if r.get("cis16_limited_by"):
            print(f"    target missed, limited by: {r['cis16_limited_by']}", flush=True)
        (out_dir / "bench_decode_attention.json").write_text(json.dumps(dict(meta, rows=rows), indent=2))
        if cuda:
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t_start, 1)
    md = markdown(rows, meta)
    (out_dir / "bench_decode_attention.json").write_text(json.dumps(dict(meta, rows=rows), indent=2))
    (out_dir / "bench_decode_attention.md").write_text(md)
    print()
    print(md)
    print(f"wrote {out_dir / 'bench_decode_attention.json'} and .md ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
