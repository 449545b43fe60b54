#!/usr/bin/env python
"""Does a side CUDA stream hide ES-CIS's selection? (issue 15, EarlySelectKV, item 2)

EarlySelectKV builds layer l+1's proxy query at layer l's "mid" tap (after l's attention), so
layer l+1's whole selection -- proxy projection (RMSNorm + W_q), CIS match, retrieval, dilated
set, composition -- depends on nothing that layer l computes after the tap. This probe times,
per decoder layer and as CUDA graphs (the replay of a compiled step has no Python in it):

- ``select``: the proxy projection and ``cis_select`` of layer l+1 (the kernels the model runs,
  on the operator bench's inputs: ``bench_decode_attention.make_inputs``/``make_anchors``, s = 16);
- ``rest``: what layer l runs after the tap and layer l+1 before its attention: l's MLP
  (post-attention RMSNorm, gate/up, SiLU, down) and l+1's input RMSNorm and q/k/v projection;
- ``sequential``: select, then rest, then l+1's sparse attention with the selected indices
  (what ES-CIS does today: everything on one stream);
- ``overlapped``: select on a side stream forked before rest and joined (an event) before the
  attention; rest on the main stream.

``hidden`` = (sequential - overlapped) / select: the share of the selection's latency the side
stream hides (1: all of it; 0: none). ``overlapped`` can be no shorter than
``max(select, rest) + attention``; ``bound`` is that floor.

    python scripts/probe_es_side_stream.py                 # H200: llama3-8b B16/16k and Qwen2.5-1.5B B32/16k
    TRITON_INTERPRET=1 python scripts/probe_es_side_stream.py --quick   # CPU smoke run (a test): no streams

``same_output``: the overlapped step's attention output equals the sequential one's (CUDA; a
missing join would show here). The proxy query is the operator bench's query plus the projection's
output scaled down, so that the anchors match as they do there: the kernels and their shapes are
the model's, the numbers in them are the bench's. Without CUDA there are no streams: the CPU run
times the sequential path only (``overlapped``, ``hidden`` and ``same_output`` are None). Writes
``<out>/probe_es_side_stream.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import _bench_common as common
import bench_decode_attention as bda
from prhs_hf.ops.compose.dilated_set import dilated_set
from prhs_hf.ops.decode_ops import TRITON_OPS, cis_select

ROOT = Path(__file__).resolve().parents[1]
S = 16  # CIS block size


@dataclass
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    op: bda.Shape


SHAPES = [
    ModelShape("llama3-8b", 4096, 14336, bda.Shape(16, 32, 8, 128, 16384)),
    ModelShape("qwen2.5-1.5b", 1536, 8960, bda.Shape(32, 12, 2, 128, 16384, "cis.yaml")),
]
QUICK_SHAPES = [ModelShape("tiny", 64, 128, bda.Shape(2, 4, 2, 16, 512))]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def build(ms: ModelShape, dev: torch.device, dtype: torch.dtype) -> tuple[dict[str, Callable], dict]:
    """The three pieces of work (select, rest, attention) on one layer's tensors, and what they share."""
    sh, bud = ms.op, bda.shape_budget(ms.op)
    x = bda.make_inputs(sh, bud, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(2)
    aq, ac, ai, _ = bda.make_anchors(x, sh, bud, S, g)
    sets = dilated_set(ai.view(sh.B, sh.Hq * S, -1), True, bud.dil_m, bud.dil_r).view(sh.B, sh.Hq, S, -1)
    w = lambda *shape: (torch.randn(*shape, generator=g, device=dev) / shape[-1] ** 0.5).to(dtype)  # noqa: E731
    h, inter, qd, kvd = ms.hidden, ms.intermediate, sh.Hq * sh.D, sh.Hkv * sh.D
    weights = dict(w_q=w(qd, h), w_qkv=w(qd + 2 * kvd, h), w_gate_up=w(2 * inter, h), w_down=w(h, inter),
                   norm=torch.ones(h, device=dev, dtype=dtype))
    tap = torch.randn(sh.B, h, generator=g, device=dev).to(dtype)  # layer l's mid tap (its residual)
    kw = dict(sink=bud.sink, k=bud.k, dil_m=bud.dil_m, dil_r=bud.dil_r, cap=bud.cap, scale=x["scale"], tau=bda.TAU)
    geo = (x["pad"], x["t"], x["lo"], x["hi"], x["hi"])
    q_real = x["q"]  # l+1's real query (the attention's); the proxy only selects

    def select():
        proxy = F.linear(rms_norm(tap, weights["norm"]), weights["w_q"]).view(sh.B, sh.Hq, sh.D)
        # the proxy's scale: the operator bench's query, so that the anchors match as they do there
        proxy = (q_real.float() + 0.01 * proxy.float()).to(dtype)
        return cis_select(TRITON_OPS, proxy, x["k_cache"], *geo, aq, ac, sets, x["active"], **kw)

    def rest():
        y = rms_norm(tap, weights["norm"])
        gate, up = F.linear(y, weights["w_gate_up"]).chunk(2, dim=-1)
        out = tap + F.linear(F.silu(gate) * up, weights["w_down"])
        return F.linear(rms_norm(out, weights["norm"]), weights["w_qkv"])

    def attend(sel):
        return TRITON_OPS.sparse_decode_attention(q_real, x["k_cache"], x["v_cache"], x["pad"], sel.idx, sel.count, x["scale"])

    return dict(select=select, rest=rest, attend=attend), dict(asdict(sh), **asdict(bud), model=ms.name,
                                                               hidden=h, intermediate=inter, s=S)


def sequential(fns: dict) -> Callable[[], object]:
    def run():
        sel = fns["select"]()
        r = fns["rest"]()
        return fns["attend"](sel), r
    return run


def overlapped(fns: dict, side: "torch.cuda.Stream") -> Callable[[], object]:
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)  # the tap is ready
        with torch.cuda.stream(side):
            sel = fns["select"]()
        r = fns["rest"]()
        main.wait_stream(side)  # layer l+1's attention needs its indices
        return fns["attend"](sel), r
    return run


def probe(ms: ModelShape, dev: torch.device, dtype: torch.dtype) -> dict:
    fns, row = build(ms, dev, dtype)
    cuda = dev.type == "cuda"
    time_it = lambda fn: common.median_ms(fn, dev, cuda_graph=cuda)  # noqa: E731
    sel = fns["select"]()
    row["select_ms"] = time_it(fns["select"]).ms
    row["rest_ms"] = time_it(fns["rest"]).ms
    row["attention_ms"] = time_it(lambda: fns["attend"](sel)).ms
    seq = time_it(sequential(fns))
    row["sequential_ms"], row["timing"] = seq.ms, seq.method
    row["bound_ms"] = max(row["select_ms"], row["rest_ms"]) + row["attention_ms"]
    if cuda:
        want = sequential(fns)()[0]
        side = torch.cuda.Stream()
        got = overlapped(fns, side)()[0]
        torch.cuda.synchronize()
        row["same_output"] = bool(torch.equal(got, want))
        ov = time_it(overlapped(fns, side))
        row["overlapped_ms"] = ov.ms
        row["overlap_timing"] = ov.method  # "graph" unless the multi-stream capture failed
        row["hidden"] = (row["sequential_ms"] - ov.ms) / row["select_ms"]
    else:  # no streams: nothing to overlap or to compare
        row["same_output"] = row["overlapped_ms"] = row["overlap_timing"] = row["hidden"] = None
    return row


COLUMNS = ("model", "B", "ctx", "Hq", "Hkv", "k", "select_ms", "rest_ms", "attention_ms", "sequential_ms",
           "overlapped_ms", "bound_ms", "hidden", "same_output", "timing", "overlap_timing")


def markdown(rows: list[dict], meta: dict) -> str:
    def cell(v):
        return "n/a" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    lines = [f"# ES-CIS selection on a side CUDA stream (issue 15)\n",
             f"{meta['gpu']}, torch {meta['versions']['torch']}, triton {meta['versions']['triton']}, "
             f"{meta['date']}, commit {meta['git_commit']}. Median ms per decoder layer (CUDA: replays of CUDA graphs).\n",
             f"    {meta['command']}\n",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape (CPU smoke run under TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"), help="output folder")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    plan = QUICK_SHAPES if args.quick or not cuda else SHAPES
    meta = common.run_metadata(dev, argv, s=S, tap="mid", selector="cis (ES-CIS), exact W_q proxy")
    t0 = time.time()
    rows = []
    for ms in common.progress(plan, "ES side stream"):
        row = probe(ms, dev, torch.bfloat16)
        rows.append(row)
        print("  " + ", ".join(f"{c}={row.get(c)}" for c in COLUMNS), flush=True)
    meta["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_es_side_stream.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / "probe_es_side_stream.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0 if all(r["same_output"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
