"""GQA decode kernels, one table: top-k retrieval and sparse attention, per head and group-shared.

Times with ``triton.testing.do_bench`` (CUDA) the retrieval of the CIS step (B16/16k, 32 q /
8 KV heads, d 128, budget 1/8: k = 1036, cap = 2046, 1 row in 16 retrieving as at s = 16)
with the default select and each select of :data:`SELECT_MODES` forced, the group-shared
:func:`topk_retrieval_grouped`, and sparse attention per head (split-K) against
:func:`sparse_decode_attention_grouped`. Also prints the bytes each moves and the implied bandwidth.

    python scripts/probe_gqa_kernels.py                    # H200: the shape above
    python scripts/probe_gqa_kernels.py --retrieve-frac 0.25 --hq 12 --hkv 2
    python scripts/probe_gqa_kernels.py --select-only      # the select table only

Select table (printed after the main one; CUDA: ``do_bench_cudagraph``, so launch overhead is
not counted): for B16/16k 32/8, B16/16k 32/32 and the Qwen 12/2 shape at B32/16k, each select
of :data:`SELECT_MODES` (and each ``--select-variants`` tuning) after group scoring, in us:
``score`` (compaction + scoring, the retrieval stopped after it), ``sel`` (the whole select =
retrieval - score), ``total`` (the whole retrieval), ``exact`` (output equal to the default
select's). The selects' inner stages (radix passes, collect, finish) were timed with stop points
that are gone from the library; their numbers are in docs/notes/decode_tuning.md.
Score table (``--score-only``): the group score stage alone (compaction + scoring, CUDA graph
replay) at each ``--score-shapes`` entry ``B,S,HQ,HKV,FRAC`` (FRAC of the query rows retrieve; 1.0
is a block's first step, where every row does), for the default (the split sized on the device
from the live count) and each ``--select-variants`` score tuning; with the MB of K it reads, the
implied GB/s, and whether the retrieval's output equals the default's.
    python scripts/probe_gqa_kernels.py --score-only --topk 88 \
        --score-shapes 8,16384,32,32,1.0,8,16384,32,32,0.0625 --select-variants 128x4x3x512,128x4x3x4096
    TRITON_INTERPRET=1 python scripts/probe_gqa_kernels.py --quick   # CPU smoke run (a test)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

try:  # an installed prhs_hf, else this checkout's
    import prhs_hf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prhs_hf.ops.sparse_attention.sparse_decode_attention import (  # noqa: E402
    sparse_decode_attention,
    sparse_decode_attention_grouped,
)
from prhs_hf.ops.topk.topk_retrieval import (  # noqa: E402
    SELECT_MODES,
    topk_retrieval,
    topk_retrieval_grouped,
    tuned,
)


#: row name of the retrieval table that tests compare: the model path's default
DEFAULT_RETRIEVAL = "retrieval (default select)"


def _time_ms(fn: Callable[[], object], cuda: bool, graph: bool = False) -> float:
    if cuda:
        import triton.testing

        if graph:  # replayed CUDA graph: GPU time without the Python launch overhead
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # interpreter: one warm call, one timed
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _budget_k(S: int) -> int:
    """k of the CIS budget 1/8 (scripts/bench_decode_attention.py: budget())."""
    n = S // 8
    sink, local = max(8, n // 32), n // 8
    return 3 * (n - sink - local) // 5


def _retrieval_case(B: int, S: int, Hq: int, Hkv: int, D: int, frac: float, dev: torch.device, seed: int):
    """Random bf16 ``(q, k_cache, pad, lo, hi, retrieve, scale)`` at the budget-1/8 region (sink and
    local cut off), ``frac`` of the rows retrieving (row (0, 0) always)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g, device=dev).to(torch.bfloat16)
    kc = torch.randn(B, Hkv, S, D, generator=g, device=dev).to(torch.bfloat16)
    pad = torch.zeros(B, dtype=torch.int32, device=dev)
    n = S // 8
    lo = torch.full((B,), max(8, n // 32), dtype=torch.int32, device=dev)
    hi = torch.full((B,), S - n // 8, dtype=torch.int32, device=dev)
    retrieve = torch.rand(B, Hq, generator=g, device=dev) < frac
    retrieve[0, 0] = True
    return q, kc, pad, lo, hi, retrieve, 1 / math.sqrt(D)


def select_table(shapes: list[tuple[int, int, int, int, int]], frac: float, cuda: bool,
                 topk: Optional[int] = None, variants: tuple[tuple, ...] = ()) -> list[dict]:
    """Score and select time of every select, after group scoring (see the module docstring).
    ``topk`` replaces the budget-1/8 k (``cis.yaml``'s 88, say); each ``(block, warps)`` of
    ``variants`` adds a ``radix8`` row with that many keys per select item and warps
    (``select_block``; ``(mode, block, warps)`` for another select), each ``(tile, warps, stages,
    keys per program)`` one with that group score kernel (``score_cfg``; the switches are
    ``topk_retrieval.RetrievalTuning``'s)."""
    dev = torch.device("cuda" if cuda else "cpu")
    print(f"\nselect stages, us (group scoring, {'CUDA graph replay' if cuda else 'CPU interpreter: not timings'}), "
          f"retrieving fraction {frac:.4f}")
    print(f"| {'shape':24s} | {'select':12s} | {'sel':>7s} | {'score':>7s} | {'total':>7s} | exact |")
    print(f"|{'-' * 26}|{'-' * 14}|{'-' * 9}|{'-' * 9}|{'-' * 9}|-------|")
    rows = []
    for B, S, Hq, Hkv, D in shapes:
        k = _budget_k(S) if topk is None else topk
        q, kc, pad, lo, hi, retrieve, scale = _retrieval_case(B, S, Hq, Hkv, D, frac, dev, seed=1)
        tag = f"B{B} {S // 1024}k {Hq}/{Hkv} r{int(retrieve.sum())} k{k}"
        base = topk_retrieval(q, kc, pad, lo, hi, retrieve, k, scale)
        modes = [(select, select, {}) for select in SELECT_MODES]
        modes += [(f"{v[0]} b{v[1]}w{v[2]}", v[0], {"select_block": v[1], "select_warps": v[2]})
                  if isinstance(v[0], str) else
                  (f"radix8 b{v[0]}w{v[1]}", "radix8", {"select_block": v[0], "select_warps": v[1]})
                  if len(v) == 2 else
                  (f"radix8 score {_score_label(v)}", "radix8", {"score_cfg": v}) for v in variants]
        for label, select, extra in modes:
            t = {stop: _time_ms(lambda stop=stop, select=select, extra=extra: tuned(
                topk_retrieval, select=select, stop_after=stop, **extra)(q, kc, pad, lo, hi, retrieve, k, scale),
                cuda, graph=True) for stop in ("score", "select")}
            exact = torch.equal(tuned(topk_retrieval, select=select, **extra)(q, kc, pad, lo, hi, retrieve, k, scale),
                                base)
            us = {"sel": (t["select"] - t["score"]) * 1e3, "score": t["score"] * 1e3, "total": t["select"] * 1e3}
            print(f"| {tag:24s} | {label:12s} | {us['sel']:7.1f} | {us['score']:7.1f} | {us['total']:7.1f} | "
                  f"{str(exact):5s} |")
            rows.append({"name": f"select {tag} {label}", "ms": t["select"], "stages_us": us, "exact": exact})
    return rows


def _score_label(v: tuple[int, ...]) -> str:
    return f"n{v[0]}w{v[1]}s{v[2]}c{v[3]}" + (f"p{v[4]}" if len(v) > 4 else "")


def score_table(shapes: list[tuple[int, int, int, int, int, float]], cuda: bool, topk: Optional[int] = None,
                variants: tuple[tuple[int, ...], ...] = ()) -> list[dict]:
    """Group score stage time (us) at each ``(B, S, Hq, Hkv, D, frac)``: the default and each
    ``(tile, warps, stages, keys per program or 0[, programs per SM])`` of ``variants``."""
    dev = torch.device("cuda" if cuda else "cpu")
    print(f"\ngroup score stage, us ({'CUDA graph replay' if cuda else 'CPU interpreter: not timings'})")
    print(f"| {'shape':26s} | {'score':22s} | {'us':>8s} | {'MB of K':>8s} | {'GB/s':>6s} | exact |")
    print(f"|{'-' * 28}|{'-' * 24}|{'-' * 10}|{'-' * 10}|{'-' * 8}|-------|")
    rows = []
    for B, S, Hq, Hkv, D, frac in shapes:
        k = _budget_k(S) if topk is None else topk
        q, kc, pad, lo, hi, retrieve, scale = _retrieval_case(B, S, Hq, Hkv, D, frac, dev, seed=2)
        groups = int(retrieve.view(B, Hkv, -1).any(-1).sum())
        mb = groups * int(hi[0] - lo[0]) * D * q.element_size() / 1e6
        tag = f"B{B} {S // 1024}k {Hq}/{Hkv} r{int(retrieve.sum())} g{groups}"
        base = topk_retrieval(q, kc, pad, lo, hi, retrieve, k, scale)
        for label, extra in [("default (device split)", {})] + [(_score_label(v), {"score_cfg": v}) for v in variants]:
            ms = _time_ms(lambda extra=extra: tuned(topk_retrieval, stop_after="score", **extra)(
                q, kc, pad, lo, hi, retrieve, k, scale), cuda, graph=True)
            exact = torch.equal(tuned(topk_retrieval, **extra)(q, kc, pad, lo, hi, retrieve, k, scale), base)
            print(f"| {tag:26s} | {label:22s} | {ms * 1e3:8.1f} | {mb:8.1f} | {mb / ms:6.0f} | {str(exact):5s} |")
            rows.append({"name": f"score {tag} {label}", "ms": ms, "mb": mb, "exact": exact})
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape (CPU interpreter smoke run)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--retrieve-frac", type=float, default=1 / 16,
                    help="fraction of query rows that retrieve (CIS-16: about 1/16)")
    ap.add_argument("--select-only", action="store_true", help="only the select stage table")
    ap.add_argument("--no-select", action="store_true", help="skip the select stage table")
    ap.add_argument("--score-only", action="store_true", help="only the group score stage table")
    ap.add_argument("--score-shapes", default=None, metavar="B,S,HQ,HKV,FRAC[,...]",
                    help="the score table's shapes, five numbers each (default: llama2-7b's 32/32 B8 and the "
                         "Qwen 12/2 B32 at 16k, every row and 1 in 16 retrieving)")
    ap.add_argument("--topk", type=int, default=None,
                    help="k of the select table (default: the budget 1/8; cis.yaml's is 88)")
    ap.add_argument("--select-shape", default=None, metavar="B,S,HQ,HKV",
                    help="the select table's only shape (default: its three)")
    ap.add_argument("--select-variants", default="", metavar="BLOCKxWARPS,...",
                    help="extra radix8 rows with these keys per select item and warps, e.g. 2048x4,4096x8 "
                         "(MODE:BLOCKxWARPS for another select mode, e.g. tilemax:2048x8); "
                         "four numbers NxWxSxC: the group score kernel's keys per tile, warps, stages and keys "
                         "per program (0: the device-side split); a fifth: the score grid's programs per SM")
    args = ap.parse_args(argv)
    variants = tuple((v.split(":")[0], *(int(x) for x in v.split(":")[1].split("x"))) if ":" in v else
                     tuple(int(x) for x in v.split("x")) for v in args.select_variants.split(",") if v)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        select_shapes = [(1, 1100, 2, 1, 16)]  # one select chunk of 2048 (two of 1024: --select-variants 1024x4)
    else:
        select_shapes = [(16, 16384, 32, 8, 128), (16, 16384, 32, 32, 128), (32, 16384, 12, 2, 128)]
    if args.select_shape:
        B, S, Hq, Hkv = (int(x) for x in args.select_shape.split(","))
        select_shapes = [(B, S, Hq, Hkv, args.head_dim if not args.quick else 16)]
    if args.score_only:
        if args.score_shapes:
            vals = [float(x) for x in args.score_shapes.split(",")]
            if len(vals) % 5:
                ap.error("--score-shapes: five numbers per shape (B,S,HQ,HKV,FRAC)")
            score_shapes = [(int(v[0]), int(v[1]), int(v[2]), int(v[3]), args.head_dim if not args.quick else 16, v[4])
                            for v in (vals[i:i + 5] for i in range(0, len(vals), 5))]
        elif args.quick:
            score_shapes = [(2, 1100, 4, 2, 16, 1.0), (2, 1100, 4, 2, 16, 0.25)]
        else:
            score_shapes = [(B, 16384, hq, hkv, args.head_dim, f) for B, hq, hkv in ((8, 32, 32), (32, 12, 2))
                            for f in (1.0, 1 / 16)]
        return score_table(score_shapes, cuda, args.topk, variants)
    if args.select_only:
        return select_table(select_shapes, args.retrieve_frac, cuda, args.topk, variants)
    if args.quick:
        B, S, Hq, Hkv, D = 2, 256, 8, 2, 32
    else:
        B, S, Hq, Hkv, D = args.batch, args.ctx, args.hq, args.hkv, args.head_dim
    n = S // 8  # budget 1/8 (scripts/bench_decode_attention.py: budget())
    sink, local = max(8, n // 32), n // 8
    k = _budget_k(S)
    cap = sink + local + k + 2 * (k // 3)
    G = Hq // Hkv
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, D, generator=g, device=dev).to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g, device=dev).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g, device=dev).to(dtype)
    pad = torch.zeros(B, dtype=torch.int32, device=dev)
    t = torch.full((B,), S, dtype=torch.int32, device=dev)
    lo = torch.full_like(t, sink)
    hi = t - local
    retrieve = torch.rand(B, Hq, generator=g, device=dev) < args.retrieve_frac
    retrieve[0, 0] = True
    retrieve_g = retrieve.view(B, Hkv, G).any(-1)
    scale = 1 / math.sqrt(D)
    idx = torch.sort(torch.randint(0, S, (B, Hq, cap), generator=g, device=dev), dim=-1).values.to(torch.int32)
    count = torch.full((B, Hq), cap, dtype=torch.int32, device=dev)
    idx_g, count_g = idx[:, ::G].contiguous(), count[:, ::G].contiguous()

    esz = q.element_size()
    mid = int((hi - lo)[0])
    rows = int(retrieve.sum())
    groups = int(retrieve_g.sum())
    kbytes = mid * D * esz
    cases = [(DEFAULT_RETRIEVAL, lambda: topk_retrieval(q, kc, pad, lo, hi, retrieve, k, scale), groups * kbytes)]
    cases += [(f"retrieval {select}",
               lambda select=select: tuned(topk_retrieval, select=select)(q, kc, pad, lo, hi, retrieve, k, scale),
               groups * kbytes) for select in SELECT_MODES]
    cases.append(("retrieval grouped", lambda: topk_retrieval_grouped(q, kc, pad, lo, hi, retrieve_g, k, scale),
                  groups * kbytes))
    cases.append(("attention per-head", lambda: sparse_decode_attention(q, kc, vc, pad, idx, count, scale),
                  B * Hq * cap * 2 * D * esz))
    cases.append(("attention grouped",
                  lambda: sparse_decode_attention_grouped(q, kc, vc, pad, idx_g, count_g, scale),
                  B * Hkv * cap * 2 * D * esz))
    print(f"B{B} S{S} Hq{Hq}/Hkv{Hkv} D{D} bf16, k={k} cap={cap}, retrieving rows {rows}, "
          f"groups with a retrieving row {groups} of {B * Hkv} ({'CUDA' if cuda else 'CPU interpreter'})")
    print(f"| {'kernel':32s} | {'ms':>8s} | {'MB read':>8s} | {'GB/s':>7s} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
    out = []
    for name, fn, nbytes in cases:
        ms = _time_ms(fn, cuda)
        out.append({"name": name, "ms": ms, "bytes": nbytes})
        print(f"| {name:32s} | {ms:8.4f} | {nbytes / 1e6:8.2f} | {nbytes / ms / 1e6:7.0f} |")
    if not args.no_select:
        out += select_table(select_shapes, args.retrieve_frac, cuda, args.topk, variants)
    return out


if __name__ == "__main__":
    main()
