#!/usr/bin/env python
"""CoQA accuracy by where the answer sits in the prompt: does a config lose early context?

PSAW hides ``[C_sink, W_ℓ(t))`` from the deep layers, ``W_ℓ(t) = ⌊(1 − w_ℓ)·t⌋``, up to the first
``1 − φ`` = 30 % of the context at the last layer (SPEC §2). CoQA asks about a story that comes
first in the prompt, so a config that drops early context should fail where the answer lies early.
For every example of the saved generations (``run_accuracy.py --save-samples``) this finds the first
occurrence of a gold answer (of at least ``--min-chars`` characters, case-insensitive) in the story,
takes its character offset over the length of the whole prompt, buckets the examples by that
fraction, and prints each config's mean EM and F1 per bucket (examples whose answer is not found
verbatim form the ``not found`` bucket). Writes ``docs/results/coqa_answer_position.{json,md}``::

    python scripts/coqa_answer_position.py --samples docs/results/accuracy.samples.jsonl.gz --data-dir .xfer/data
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from prhs_hf.hub.jsonl import read_jsonl_records
from prhs_hf.evaluation.lm_eval.data import load_rows
from prhs_hf.evaluation.lm_eval.prompts import coqa_golds, coqa_prompt

ROOT = Path(__file__).resolve().parent.parent
NOT_FOUND = "not found"


def answer_position(doc: dict[str, Any], min_chars: int) -> float | None:
    """Offset of the earliest gold answer found in the story, as a fraction of the prompt's length."""
    story, prompt_len = doc["story"].lower(), len(coqa_prompt(doc))
    offsets = [story.find(g.lower()) for g in coqa_golds(doc) if len(g.strip()) >= min_chars]
    offsets = [o for o in offsets if o >= 0]
    return min(offsets) / prompt_len if offsets else None


def bucket_names(edges: Sequence[float]) -> list[str]:
    """``[0, e1)``, ``[e1, e2)``, ... ``[en, 1]``, then ``not found``."""
    bounds = [0.0, *edges, 1.0]
    names = [f"[{a:.2f}, {b:.2f})" for a, b in zip(bounds[:-2], bounds[1:-1])]
    return [*names, f"[{bounds[-2]:.2f}, 1.00]", NOT_FOUND]


def bucket_of(position: float | None, edges: Sequence[float]) -> int:
    """Index into :func:`bucket_names` of a position (``None``: the last, ``not found``)."""
    if position is None:
        return len(edges) + 1
    return sum(position >= e for e in edges)


def table(samples: list[dict[str, Any]], docs: list[dict[str, Any]], edges: Sequence[float],
          min_chars: int) -> list[dict[str, Any]]:
    """One row per (config, bucket): examples, mean EM and F1."""
    names = bucket_names(edges)
    acc: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for s in samples:
        if s["task"] != "coqa":
            continue
        b = bucket_of(answer_position(docs[s["index"]], min_chars), edges)
        acc[(s["config"], b)].append(s["scores"])
    configs = list(dict.fromkeys(s["config"] for s in samples if s["task"] == "coqa"))
    rows = []
    for c in configs:
        for b, name in enumerate(names):
            scores = acc.get((c, b), [])
            rows.append({"config": c, "bucket": name, "n": len(scores),
                         "em": sum(x["em"] for x in scores) / len(scores) if scores else None,
                         "f1": sum(x["f1"] for x in scores) / len(scores) if scores else None})
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    buckets = list(dict.fromkeys(r["bucket"] for r in rows))
    by = {(r["config"], r["bucket"]): r for r in rows}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    n = {b: by[(configs[0], b)]["n"] for b in buckets}
    lines = ["# CoQA EM by answer position", "", f"Command: `{meta['command']}`  ",
             f"Samples: {meta['samples']}; date {meta['date']}. Position: first occurrence of a gold answer "
             f"(≥ {meta['min_chars']} characters) in the story, over the prompt's length in characters.", "",
             "| config | " + " | ".join(f"{b} (n={n[b]})" for b in buckets) + " |",
             "|---|" + "---|" * len(buckets)]
    for c in configs:
        cells = ["—" if by[(c, b)]["em"] is None else f"{by[(c, b)]['em']:.3f}" for b in buckets]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", required=True, help="run_accuracy.py's .samples.jsonl[.gz]")
    ap.add_argument("--data-dir", default=None, help="folder with coqa_validation.jsonl[.gz] (default: the cache)")
    ap.add_argument("--edges", default="0.15,0.3", help="bucket edges, fractions of the prompt")
    ap.add_argument("--min-chars", type=int, default=4, help="shorter gold answers are not searched for")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "coqa_answer_position.json"))
    args = ap.parse_args(argv)
    edges = sorted(float(e) for e in args.edges.split(",") if e.strip())
    samples = read_jsonl_records(args.samples)
    coqa = [s for s in samples if s["task"] == "coqa"]
    if not coqa:
        ap.error(f"{args.samples} holds no coqa samples")
    docs = load_rows("coqa", args.data_dir, max(s["index"] for s in coqa) + 1)
    rows = table(samples, docs, edges, args.min_chars)
    meta = {"command": shlex.join(["scripts/coqa_answer_position.py", *(sys.argv[1:] if argv is None else argv)]),
            "samples": args.samples, "edges": edges, "min_chars": args.min_chars,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    text = render(rows, meta)
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
