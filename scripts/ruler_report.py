#!/usr/bin/env python
"""The long-context table and plots from a RULER accuracy run (issue 13, docs/LONG_CONTEXT.md).

Input: the report of ``scripts/run_accuracy.py --tasks ruler_<task>_<length>,…`` (its JSON and, with
``--save-samples``, its ``.samples.jsonl[.gz]``) and the folder the rows were prepared in
(``prhs-hf ruler prepare``: the needles' depths). Output, beside ``--out``:

- ``<out>.json``: rows per (config, task, length) with the score, n, ρ̂, KV per decode step, the
  row's time, its prefill time (``prefill_seconds``, None in reports written before it was measured)
  and the prefill time saved vs dense (``prefill_saved`` = 1 − prefill / prefill of the ``--dense``
  config at the same task and length; None unless both were measured on the same examples); per
  (config, length) the mean over tasks (prefill summed, saved vs dense likewise) and dense's mean
  over the same cells with the difference (``dense_same_tasks``, ``delta_vs_dense``); per (config, depth
  bin) the share of needles found (needle tasks, from the saved generations); plus the command, GPU
  and versions of the run;
- ``<out>.md``: the same as tables (tasks × lengths, one column per config; the prefill times with
  the share saved in brackets);
- ``<out>_length.png`` and ``<out>_depth.png`` (with matplotlib, the ``plots`` extra): accuracy vs
  length (each config's mean minus dense's over the same cells, since configs may have run on fewer
  tasks) and needle recall vs depth, one line per config.

Example::

    python scripts/ruler_report.py --results docs/results/ruler_qwen1.5b_raw.json \\
        --data-dir data/ruler-qwen1.5b --out docs/results/ruler_qwen1.5b
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from prhs_hf.evaluation import ruler as lc
from prhs_hf.hub.jsonl import read_jsonl_records

DEPTH_BINS = 10
DENSE_CONFIG = "dense"  # the config the prefill saving is measured against (--dense)
_NAME = re.compile(r"^ruler_(?P<task>.+)_(?P<length>\d+)$")


def split_task(name: str) -> tuple[str, int] | None:
    """``ruler_<task>_<length>`` as ``(task, length)``; None for any other task name."""
    m = _NAME.match(name)
    if not m or m["task"] not in lc.RULER_TASKS:
        return None
    return m["task"], int(m["length"])


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The saved generations (``.samples.jsonl`` or its ``.gz``); none when neither exists."""
    for p in (path, Path(f"{path}.gz")):
        if p.is_file():
            return read_jsonl_records(p)
    return []


def needle_hits(samples: Iterable[Mapping[str, Any]], data_dir: str | Path) -> list[dict[str, Any]]:
    """One record per expected answer of the needle tasks: config, task, length, depth, found."""
    docs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    out = []
    for s in samples:
        parsed = split_task(str(s.get("task", "")))
        if parsed is None:
            continue
        key = parsed
        if key not in docs:
            docs[key] = lc.load_prepared(key[0], [key[1]], data_dir)
        doc = docs[key][int(s["index"])]
        depths = doc.get("depths")
        if not depths:
            continue  # vt, cwe, fwe: no needle
        pred = lc.postprocess_pred(str(s["generation"])).lower()
        for answer, depth in zip(doc["outputs"], depths):
            out.append({"config": s["config"], "task": key[0], "length": key[1], "depth": float(depth),
                        "found": str(answer).lower() in pred})
    return out


def prefill_saved(prefill: float | None, dense: float | None) -> float | None:
    """``1 - prefill / dense``: the share of the dense prefill time saved; None if either is unknown or
    ``dense`` is not positive."""
    if prefill is None or dense is None or dense <= 0:
        return None
    return 1.0 - prefill / dense


def prunes_prefill(prhs_config: Mapping[str, Any] | None) -> bool | None:
    """Whether a row's config prunes prefill work (PSAW with its ``prefill`` phase, or ETF); None when the
    row does not carry its config. A config that does not runs dense's prefill (CIS acts at decode)."""
    if not isinstance(prhs_config, Mapping):
        return None
    psaw, etf = prhs_config.get("psaw") or {}, prhs_config.get("etf") or {}
    return bool(psaw.get("enabled") and "prefill" in (psaw.get("phases") or ())) or bool(etf.get("enabled"))


def _with_saving(entries: list[dict[str, Any]], key: Sequence[str], same: Sequence[str], dense_config: str) -> None:
    """Set ``prefill_saved`` of each entry against the ``dense_config`` entry of the same ``key`` fields
    (None where there is none, or it differs in one of the ``same`` fields: other examples, or the entry's
    config prunes no prefill work: its prefill is dense's, and a difference in time is noise or warm-up)."""
    dense = {tuple(e[k] for k in key): e for e in entries if e["config"] == dense_config}
    for e in entries:
        d = dense.get(tuple(e[k] for k in key))
        comparable = (d is not None and all(d[k] == e[k] for k in same)
                      and (e["config"] == dense_config or e.get("prunes_prefill") is not False))
        e["prefill_saved"] = prefill_saved(e["prefill_seconds"], d["prefill_seconds"]) if comparable else None


def _with_dense_score(means: list[dict[str, Any]], cells_of: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]],
                      dense_config: str) -> None:
    """Set ``dense_same_tasks`` of each (config, length) mean to ``dense_config``'s mean over the same
    tasks at that length with the same n per task, and ``delta_vs_dense`` to the difference (both None
    where dense lacks one of those cells): configs run on fewer tasks than dense have means over other
    task sets, which only this difference compares. ``cells_of``: the rows of each (config, length)."""
    for m in means:
        cells = cells_of[(m["config"], m["length"])]
        dense = {t["task"]: t for t in cells_of.get((dense_config, m["length"]), ())}
        ref = [dense.get(t["task"]) for t in cells]
        if cells and all(d is not None and d["n"] == t["n"] for d, t in zip(ref, cells)):
            m["dense_same_tasks"] = sum(d["score"] for d in ref) / len(ref)
            m["delta_vs_dense"] = m["mean_score"] - m["dense_same_tasks"]
        else:
            m["dense_same_tasks"] = m["delta_vs_dense"] = None


def summarize(rows: Sequence[Mapping[str, Any]], hits: Sequence[Mapping[str, Any]],
              dense_config: str = DENSE_CONFIG) -> dict[str, Any]:
    """Per-row table, per-(config, length) means over tasks, per-(config, depth bin) needle recall; the
    prefill time of each row and (config, length), and its saving vs ``dense_config`` (:func:`prefill_saved`)."""
    table = []
    for r in rows:
        parsed = split_task(str(r["task"]))
        if parsed is None or r.get("status", "ok") != "ok":
            continue
        (metric, value), = [(k, v) for k, v in r["metrics"].items()][:1]
        table.append({"config": r["config"], "task": parsed[0], "length": parsed[1], "metric": metric,
                      "score": float(value), "n": int(r["n"]), "rho_hat": r.get("rho_hat"),
                      "processed_kv_per_step": r.get("processed_kv_per_step"),
                      "dense_kv_per_step": r.get("dense_kv_per_step"), "seconds": r.get("seconds"),
                      "prefill_seconds": r.get("prefill_seconds"),
                      "prunes_prefill": prunes_prefill(r.get("prhs_config"))})
    _with_saving(table, ("task", "length"), ("n",), dense_config)
    by_length: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for t in table:
        by_length[(t["config"], t["length"])].append(t)
    means = [{"config": c, "length": n, "tasks": len(ts), "mean_score": sum(t["score"] for t in ts) / len(ts),
              "examples": sum(t["n"] for t in ts), "seconds": sum(t["seconds"] or 0.0 for t in ts),
              "prefill_seconds": (None if any(t["prefill_seconds"] is None for t in ts)
                                  else sum(t["prefill_seconds"] for t in ts)),
              "task_names": sorted(t["task"] for t in ts),
              "prunes_prefill": (None if any(t["prunes_prefill"] is None for t in ts)
                                 else any(t["prunes_prefill"] for t in ts))}
             for (c, n), ts in sorted(by_length.items(), key=lambda kv: (kv[0][0], kv[0][1]))]
    _with_saving(means, ("length",), ("task_names", "examples"), dense_config)
    _with_dense_score(means, by_length, dense_config)
    bins: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for h in hits:
        b = min(DEPTH_BINS - 1, int(h["depth"] * DEPTH_BINS))
        bins[(h["config"], b)].append(bool(h["found"]))
    depth = [{"config": c, "depth_from": b / DEPTH_BINS, "depth_to": (b + 1) / DEPTH_BINS, "needles": len(v),
              "found": sum(v) / len(v)} for (c, b), v in sorted(bins.items())]
    return {"rows": table, "by_length": means, "by_depth": depth}


def prefill_cell(entry: Mapping[str, Any] | None) -> str:
    """``seconds (saved %)`` of an entry's prefill; ``—`` where unknown, no bracket without a saving."""
    if entry is None or entry.get("prefill_seconds") is None:
        return "—"
    saved = entry.get("prefill_saved")
    return f"{entry['prefill_seconds']:.2f}" + ("" if saved is None else f" ({100 * saved:.1f} %)")


def _configs(table: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: list[str] = []
    for t in table:
        if t["config"] not in seen:
            seen.append(t["config"])
    return seen


def merge_reports(reports: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Several run_accuracy.py reports as one: their rows side by side, the first one's meta, and the
    commands of the others under ``meta["more_runs"]``. A (config, task) in two reports is an error."""
    seen: dict[tuple[str, str], str] = {}
    rows = []
    for report, name in zip(reports, names):
        for row in report["rows"]:
            key = (row["config"], row["task"])
            if key in seen:
                raise SystemExit(f"{name}: {key[0]} / {key[1]} is also in {seen[key]}; give each config and task once")
            seen[key] = name
            rows.append(row)
    meta = dict(reports[0].get("meta", {}))
    if len(reports) > 1:
        meta["more_runs"] = [r.get("meta", {}) for r in reports[1:]]
    return {"meta": meta, "rows": rows}


def _run_lines(meta: Mapping[str, Any]) -> list[str]:
    env = meta.get("environment", {})
    return [f"- run: `{meta.get('command', '?')}`",
            f"- model: {meta.get('model', '?')}; GPU: {env.get('gpu') or 'none'}; torch {env.get('torch', '?')}, "
            f"transformers {env.get('versions', {}).get('transformers', '?')}; date {env.get('date', '?')}"]


def render_markdown(summary: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    """Tasks × lengths with a column per config; then the means per length and the recall per depth."""
    table = summary["rows"]
    configs = _configs(table)
    cell = {(t["config"], t["task"], t["length"]): t for t in table}
    lines = ["# RULER (offline subset, docs/LONG_CONTEXT.md)", "",
             *[line for m in (meta, *meta.get("more_runs", ())) for line in _run_lines(m)],
             f"- report: `{meta.get('report_command', '?')}`", "",
             "Score: lm-eval's string_match_all (share of the expected strings found), n examples per cell. "
             "ρ̂: share of sparse (step, layer, head) that ran a top-k retrieval; KV: keys attended per layer, "
             "head and decode step. Prefill: seconds from each batch's generate call to its first logits, "
             "summed; in brackets the share of the dense prefill time saved (same task, length and examples), "
             "not given for a config that prunes no prefill work (PSAW and ETF off: it runs dense's prefill, so "
             "a difference is timing noise or the warm-up in a run's first row).",
             "",
             "| task | length | n | " + " | ".join(configs) + " |",
             "|---|---|---|" + "---|" * len(configs)]
    keys = sorted({(t["task"], t["length"]) for t in table}, key=lambda k: (list(lc.RULER_TASKS).index(k[0]), k[1]))
    for task, length in keys:
        ns = {cell[(c, task, length)]["n"] for c in configs if (c, task, length) in cell}
        vals = [f"{cell[(c, task, length)]['score']:.3f}" if (c, task, length) in cell else "—" for c in configs]
        lines.append(f"| {task} | {length} | {'/'.join(map(str, sorted(ns)))} | " + " | ".join(vals) + " |")
    if any(t["prefill_seconds"] is not None for t in table):
        lines += ["", "Prefill time, s (saved vs dense):", "",
                  "| task | length | " + " | ".join(configs) + " |", "|---|---|" + "---|" * len(configs)]
        for task, length in keys:
            lines.append(f"| {task} | {length} | "
                         + " | ".join(prefill_cell(cell.get((c, task, length))) for c in configs) + " |")
    lines += ["", "Mean over the tasks run at each length (tasks, examples); dense's mean over the same cells "
              "(same tasks and n) and the difference, the column that compares configs run on different tasks:", "",
              "| config | length | tasks | examples | mean score | dense, same cells | Δ vs dense | seconds | "
              "prefill s (saved) | ρ̂ | KV/step (dense) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in summary["by_length"]:
        ts = [t for t in table if t["config"] == m["config"] and t["length"] == m["length"]]
        rho = [t["rho_hat"] for t in ts if t["rho_hat"] is not None]
        kv = [t["processed_kv_per_step"] for t in ts if t["processed_kv_per_step"] is not None]
        dense = [t["dense_kv_per_step"] for t in ts if t["dense_kv_per_step"] is not None]
        same = "—" if m.get("dense_same_tasks") is None else f"{m['dense_same_tasks']:.3f}"
        delta = "—" if m.get("delta_vs_dense") is None else f"{m['delta_vs_dense']:+.3f}"
        lines.append(f"| {m['config']} | {m['length']} | {m['tasks']} | {m['examples']} | {m['mean_score']:.3f} | "
                     f"{same} | {delta} | {m['seconds']:.0f} | {prefill_cell(m)} | {f'{100 * sum(rho) / len(rho):.1f} %' if rho else '—'} | "
                     f"{f'{sum(kv) / len(kv):.0f} ({sum(dense) / len(dense):.0f})' if kv and dense else '—'} |")
    if summary["by_depth"]:
        lines += ["", "Needles found by depth in the haystack (needle tasks, all lengths):", "",
                  "| config | depth | needles | found |", "|---|---|---|---|"]
        for d in summary["by_depth"]:
            lines.append(f"| {d['config']} | {d['depth_from']:.1f}–{d['depth_to']:.1f} | {d['needles']} | {d['found']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(summary: Mapping[str, Any], out: Path, dense_config: str = DENSE_CONFIG) -> list[Path]:
    """Accuracy vs length and vs depth (PNG); nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ruler_report: matplotlib is not installed (the 'plots' extra): no plots", file=sys.stderr)
        return []
    written = []
    # accuracy vs length as the difference to dense over the same cells (configs run on fewer tasks
    # than dense have means over other task sets); needle recall by depth as it is
    by_length = [m for m in summary["by_length"] if m.get("delta_vs_dense") is not None and m["config"] != dense_config]
    for name, series, x, y, xlabel in (
            ("length", by_length, "length", "delta_vs_dense", "prompt length (tokens)"),
            ("depth", summary["by_depth"], "depth_from", "found", "needle depth in the haystack (bin start)")):
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for config in _configs(series):
            pts = [(s[x], s[y]) for s in series if s["config"] == config]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
        if name == "length":
            ax.set_xscale("log", base=2)
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_ylabel("mean score − dense (same cells)")
        else:
            ax.set_ylabel("share of needles found")
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out.with_name(f"{out.name}_{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True, type=Path, nargs="+",
                    help="run_accuracy.py's JSON report, or several (their rows side by side; a config and task "
                         "in two of them is an error)")
    ap.add_argument("--samples", type=Path, default=None,
                    help="the saved generations of a single --results (default: <results>.samples.jsonl[.gz] "
                         "of each)")
    ap.add_argument("--data-dir", required=True, help="the folder the RULER rows were prepared in")
    ap.add_argument("--out", required=True, type=Path, help="output path without suffix")
    ap.add_argument("--dense", default=DENSE_CONFIG,
                    help=f"the config the prefill time saved is measured against (default {DENSE_CONFIG})")
    args = ap.parse_args(argv)
    if args.samples is not None and len(args.results) > 1:
        ap.error("--samples goes with a single --results (each of several reports brings its own samples file)")
    report = merge_reports([json.loads(p.read_text()) for p in args.results], [str(p) for p in args.results])
    samples = [s for p in args.results
               for s in read_samples(args.samples or p.with_name(f"{p.stem}.samples.jsonl"))]
    summary = summarize(report["rows"], needle_hits(samples, args.data_dir), args.dense)
    if not summary["rows"]:
        raise SystemExit(f"{', '.join(map(str, args.results))}: no RULER row (ruler_<task>_<length>) with status ok")
    meta = {**report.get("meta", {}), "report_command": shlex.join(["scripts/ruler_report.py", *(sys.argv[1:] if argv is None else argv)])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_name(f"{args.out.name}.json").write_text(json.dumps({"meta": meta, **summary}, indent=1) + "\n")
    md = render_markdown(summary, meta)
    args.out.with_name(f"{args.out.name}.md").write_text(md)
    print(md)
    for p in plot(summary, args.out, args.dense):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
