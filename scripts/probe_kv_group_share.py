#!/usr/bin/env python
"""How many KV groups hold a retrieving query head: the share of K an exact CIS retrieval reads (issue 12).

With G query heads per KV head, a decode step's retrieval must read the keys of every (sequence, KV
head) pair in which at least one of the G heads retrieves. Per-head ρ̂ alone leaves that share
anywhere between ρ̂ (the heads of a group retrieve together) and 1 − (1 − ρ̂)^G (independently).
This runs ``generate()`` on real text with a config and its telemetry on, and reports ρ̂, the measured
share (``kv_group_retrieval_ratio``) and the independent-heads figure beside it; the share feeds
``scripts/decode_bound.py --kv-group-share``.

Output: a table, and ``<out>.json`` / ``<out>.md`` (default docs/results/probe_kv_group_share).

Example (CPU, fp32, ~5 min)::

    python scripts/probe_kv_group_share.py --model qwen2.5-coder-1.5b --length 4096 --batch 2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import _bench_common as common
import prhs_hf
from bench_e2e_decode import TextPrompts
from prhs_hf.hub import fetch
from prhs_hf.hub.data_sets import fetch_dataset

ROOT = Path(__file__).resolve().parents[1]


def measure(model, ids: torch.Tensor, config: str, new_tokens: int) -> dict:
    """ρ̂, the KV-group share and the independent-heads share of one greedy ``generate()`` of ``ids``."""
    prhs_hf.patch(model, config, overrides={"telemetry": {"enabled": True}})
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
        report = prhs_hf.telemetry(model)
    finally:
        prhs_hf.unpatch(model)
    group = model.config.num_attention_heads // (model.config.num_key_value_heads or model.config.num_attention_heads)
    rho = report.retrieval_ratio
    return {"config": config, "heads_per_kv_head": group, "rho_hat": rho,
            "kv_group_share": report.kv_group_retrieval_ratio,
            "independent_heads_share": None if rho is None else 1 - (1 - rho) ** group,
            "decode_steps": report.decode_steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="registry name, .gguf or checkpoint folder")
    ap.add_argument("--prompts", default=None, type=Path,
                    help="JSONL of texts (default: the registered CoQA validation set, its stories)")
    ap.add_argument("--config", default="cis", help="PrHS config (default: cis)")
    ap.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps (default 64)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "probe_kv_group_share")
    args = ap.parse_args(argv)
    for name in ("length", "batch", "new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    start = time.perf_counter()
    model, tokenizer = fetch.load_model(args.model, device=args.device)
    prompts = args.prompts or fetch_dataset("coqa")
    ids = TextPrompts(Path(prompts), tokenizer).batch(args.batch, args.length).to(args.device)
    row = {"model": args.model, "prompts": Path(prompts).name, "length": args.length, "batch": args.batch,
           "new_tokens": args.new_tokens, **measure(model, ids, args.config, args.new_tokens),
           "seconds": time.perf_counter() - start}
    meta = common.run_metadata(torch.device(args.device), argv)
    lines = [f"KV groups with a retrieving head, {meta['gpu']}, {meta['date']}:", "",
             f"    {meta['command']}", "",
             "| model | prompts | B × tokens | config | G | ρ̂ | KV-group share | independent heads 1 − (1 − ρ̂)^G |",
             "|---|---|---|---|---|---|---|---|",
             f"| {row['model']} | {row['prompts']} | {row['batch']} × {row['length']} (+{row['new_tokens']}) | "
             f"{row['config']} | {row['heads_per_kv_head']} | {row['rho_hat']:.3f} | {row['kv_group_share']:.3f} | "
             f"{row['independent_heads_share']:.3f} |"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": [row]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
