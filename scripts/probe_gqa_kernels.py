"""Old vs new GQA decode kernels, one table (issue 12): retrieval and sparse attention.

Times with ``triton.testing.do_bench`` (CUDA) the retrieval of the CIS step (B16/16k, 32 q /
8 KV heads, d 128, budget 1/8: k = 1036, cap = 2046, 1 row in 16 retrieving as at s = 16)
along the four scoring x select paths of :func:`topk_retrieval` (``row/row`` is the old
launcher, ``group/row`` the new default, ``*/split`` the split radix select), the group-shared :func:`topk_retrieval_grouped`,
and sparse attention per head (split-K) against :func:`sparse_decode_attention_grouped`.
Also prints the bytes each moves and the implied bandwidth.

    python scripts/probe_gqa_kernels.py                    # H200: the shape above
    python scripts/probe_gqa_kernels.py --retrieve-frac 0.25 --hq 12 --hkv 2
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prhs_hf.kernels.sparse_decode_attention import (  # noqa: E402
    sparse_decode_attention,
    sparse_decode_attention_grouped,
)
from prhs_hf.kernels.topk_retrieval import topk_retrieval, topk_retrieval_grouped  # noqa: E402


def _time_ms(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # interpreter: one warm call, one timed
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        B, S, Hq, Hkv, D = 2, 256, 8, 2, 32
    else:
        B, S, Hq, Hkv, D = args.batch, args.ctx, args.hq, args.hkv, args.head_dim
    n = S // 8  # budget 1/8 (scripts/bench_decode_attention.py: budget())
    sink, local = max(8, n // 32), n // 8
    k = 3 * (n - sink - local) // 5
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
    cases = []
    for score, select in (("row", "row"), ("row", "split"), ("group", "row"), ("group", "split")):
        tag = {("row", "row"): " (old)", ("group", "row"): " (default)"}.get((score, select), "")
        cases.append((f"retrieval {score}/{select}{tag}",
                      lambda score=score, select=select: topk_retrieval(
                          q, kc, pad, lo, hi, retrieve, k, scale, _score=score, _select=select),
                      (rows if score == "row" else groups) * kbytes))
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
    return out


if __name__ == "__main__":
    main()
