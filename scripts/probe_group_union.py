#!/usr/bin/env python
"""Probe: how much the per-head index sets of one KV group overlap, on a real model and text.

With per-head sets (``cis.selection: head``, every shipped config) the sparse attention reads, for
each query head, the keys and values of its own set: a KV group of G query heads reads the sum of
its heads' set sizes. An attention that loaded the union of the group's sets once and kept each
head to its own set would give the same output while reading the union. This probe measures what
that would save: per decode step, layer and KV group of the sparse rows, ``sum`` (keys the per-head
attention reads), ``union`` (distinct keys of the group) and ``union / sum`` (the share of the
per-head reads a union-loading attention would make; 1/G when every head of the group picked the
same keys, 1 when no two share a key). It runs ``generate()`` on the model patched with each
config (``policy`` forced sparse, CPU PyTorch path), teacher-free greedy, on prompts packed from
``--text`` (default: this Python's standard-library source, text no evaluation uses).

    python scripts/probe_group_union.py --model qwen2.5-coder-0.5b --length 4096 --new-tokens 24 \\
        --out docs/results/probe_group_union
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional

import torch

import prhs_hf
from prhs_hf.calibration.texts import calibration_texts, pack_prompts
from prhs_hf.evaluation.accuracy.configs import load_any_config
from prhs_hf.hub.fetch import load_model

REPO = Path(__file__).resolve().parents[1]


class UnionRecorder:
    """Wraps a patched model's selector; for each decode selection of per-head sets, records per (layer,
    sequence, KV group) the summed set sizes of the group's heads and the size of their union."""

    def __init__(self, inner: Any, kv_heads: int):
        self.inner, self.kv_heads, self.rows = inner, kv_heads, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def select(self, layer: int, *args: Any) -> Any:
        sel = self.inner.select(layer, *args)
        idx, count, active = sel.idx, sel.count, sel.active
        B, H, _ = idx.shape
        if H == self.kv_heads:  # group-shared sets: one per KV head already
            return sel
        group = H // self.kv_heads
        for b in range(B):
            if not bool(active[b]):
                continue
            for g in range(self.kv_heads):
                heads = range(g * group, (g + 1) * group)
                sets = [idx[b, h][idx[b, h] >= 0] for h in heads]
                total = int(sum(int(count[b, h]) for h in heads))
                union = int(torch.unique(torch.cat(sets)).numel())
                self.rows.append((layer, total, union))
        return sel


def measure(model: Any, prompts: torch.Tensor, config: str, new_tokens: int) -> dict[str, Any]:
    cfg = load_any_config(config, {"policy": {"decode": "sparse", "prefill": "sparse"},
                                   "backend": {"decode": "torch", "prefill": "torch"}})
    text_cfg = model.config.get_text_config()
    kv_heads, heads = text_cfg.num_key_value_heads, text_cfg.num_attention_heads
    t0 = time.time()
    with prhs_hf.patch(model, cfg) as handle, torch.no_grad():
        recorder = UnionRecorder(handle.runtime.selector, kv_heads)
        handle.runtime.selector = recorder
        try:
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        finally:
            handle.runtime.selector = recorder.inner
    rows = recorder.rows
    if not rows:
        return dict(config=config, status="no per-head sparse step")
    ratios = [u / s for _, s, u in rows if s > 0]
    by_layer: dict[int, list[float]] = {}
    for layer, s, u in rows:
        by_layer.setdefault(layer, []).append(u / s if s else 1.0)
    return dict(config=config, status="ok", group=heads // kv_heads, samples=len(rows),
                mean_sum=statistics.fmean(s for _, s, _ in rows), mean_union=statistics.fmean(u for _, _, u in rows),
                union_over_sum=sum(u for _, _, u in rows) / sum(s for _, s, _ in rows),
                union_over_sum_p10=_quantile(ratios, 0.1), union_over_sum_p90=_quantile(ratios, 0.9),
                union_over_sum_by_layer={str(k): round(statistics.fmean(v), 4) for k, v in sorted(by_layer.items())},
                seconds=round(time.time() - t0, 1))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Overlap of the per-head index sets of a KV group ({result['date'][:10]})", "",
             f"    {result['command']}", "",
             f"Model {result['model']} ({result['dtype']}, CPU), {result['prompts']} prompt(s) of {result['length']} "
             f"tokens from {result['text']}, {result['new_tokens']} greedy decode steps, policy forced sparse. "
             "Per (decode step, layer, sequence, KV group): `sum` = keys the per-head attention reads for the "
             "group's heads, `union` = distinct keys among them; `union / sum` = the share of those reads an "
             "attention loading each group's union once would make (1/G: all heads picked the same keys).", "",
             "| config | G | samples | mean sum | mean union | union / sum (p10–p90) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| `{r['config']}` | – | – | – | – | {r['status']} |")
            continue
        lines.append(f"| `{r['config']}` | {r['group']} | {r['samples']} | {r['mean_sum']:.0f} | {r['mean_union']:.0f} | "
                     f"**{r['union_over_sum']:.3f}** ({r['union_over_sum_p10']:.3f}–{r['union_over_sum_p90']:.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, .gguf, checkpoint folder or hub id")
    ap.add_argument("--configs", default="cis,cis_longbench", help="comma-separated config names (per-head sets)")
    ap.add_argument("--text", default=sysconfig.get_paths()["stdlib"],
                    help="file or folder the prompts are packed from (default: the Python standard library's source)")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--length", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "probe_group_union"), help="output stem (.json, .md)")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.length < 2 or args.new_tokens < 1:
        ap.error("--prompts and --new-tokens must be >= 1 and --length >= 2")
    model, tokenizer = load_model(args.model)
    texts, text_name = calibration_texts(args.text, None)
    prompts = pack_prompts(texts, tokenizer, args.length, args.prompts)
    result: dict[str, Any] = dict(
        command="python scripts/probe_group_union.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), model=args.model,
        dtype=str(next(model.parameters()).dtype), text=text_name if args.text != ap.get_default("text")
        else "the Python standard library's source", prompts=args.prompts, length=args.length,
        new_tokens=args.new_tokens, torch=torch.__version__, machine=platform.machine(), rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for config in args.configs.split(","):
        result["rows"].append(measure(model, prompts, config, args.new_tokens))
        (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result["rows"][-1].items() if k != "union_over_sum_by_layer"}), flush=True)
    md = markdown(result)
    (out.parent / f"{out.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
