#!/usr/bin/env python
"""Which part of CPE loses CoQA answers that lie early in the prompt: CIS, PSAW or ETF?

Takes the first ``--limit`` CoQA validation examples whose gold answer starts in the first
``--max-position`` of the prompt (:func:`coqa_answer_position.answer_position`), generates them
with each config (default: ``cis-s16``, CIS + PSAW ``cpe-no-etf``, CIS + ETF ``cpe-no-psaw`` and
``cpe``) exactly as ``run_accuracy.py --engine direct`` does, and prints EM / F1 per config.
Writes ``docs/results/coqa_early_answer_ablation.json`` (per-example scores and generations too)::

    python scripts/coqa_early_answer_ablation.py --model qwen2.5-coder-1.5b --data-dir .xfer/data --threads 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import prhs_hf
from coqa_answer_position import answer_position
from prhs_hf.hub import fetch
from prhs_hf.evaluation.accuracy import configs as accuracy_configs, direct, report
from prhs_hf.evaluation.lm_eval.data import load_rows

ROOT = Path(__file__).resolve().parent.parent


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=fetch.DEFAULT_MODEL, help="registry name, .gguf, checkpoint folder or hub id")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--data-dir", default=None, help="folder with coqa_validation.jsonl[.gz] (default: the cache)")
    ap.add_argument("--configs", default="cis-s16,cpe-no-etf,cpe-no-psaw,cpe")
    ap.add_argument("--max-position", type=float, default=0.3, help="answer starts before this fraction of the prompt")
    ap.add_argument("--min-chars", type=int, default=4, help="shorter gold answers are not searched for")
    ap.add_argument("--scan", type=int, default=256, help="look for examples among the first N")
    ap.add_argument("--limit", type=int, default=16, help="examples to generate")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "coqa_early_answer_ablation.json"))
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    docs = load_rows("coqa", args.data_dir, args.scan)
    picked = [i for i, d in enumerate(docs)
              if (p := answer_position(d, args.min_chars)) is not None and p < args.max_position][:args.limit]
    model, tokenizer = fetch.load_model(args.model, dtype=args.dtype, device=args.device)
    task = direct.DIRECT_TASKS["coqa"]
    meta = {"command": shlex.join(["scripts/coqa_early_answer_ablation.py", *(sys.argv[1:] if argv is None else argv)]),
            "model": args.model, "indices": picked, "max_position": args.max_position,
            "environment": report.environment(args.device)}
    rows = []
    for name in (c.strip() for c in args.configs.split(",") if c.strip()):
        named = accuracy_configs.named_config(name)
        cfg = accuracy_configs.load_named_config(named)
        start = time.perf_counter()
        with prhs_hf.patch(model, cfg):
            result = direct.evaluate(model, tokenizer, task, [docs[i] for i in picked], args.batch_size)
            rho = prhs_hf.telemetry(model).as_dict().get("retrieval_ratio")
        rows.append({"config": name, **result.metrics, "rho_hat": rho, "n": result.n,
                     "seconds": round(time.perf_counter() - start, 1),
                     "samples": [{"index": picked[s["index"]], "em": s["scores"]["em"], "generation": s["generation"]}
                                 for s in result.samples]})
        print(f"{name:14s} EM {result.metrics['em']:.3f}  F1 {result.metrics['f1']:.3f}  ({rows[-1]['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    print(f"| config | EM | F1 | n |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['em']:.3f} | {r['f1']:.3f} | {r['n']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
