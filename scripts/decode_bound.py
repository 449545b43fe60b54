#!/usr/bin/env python
"""How fast a sparse decode step could be at best, from a profiled end-to-end run's own parts.

Input: reports of ``scripts/bench_e2e_decode.py --profile-steps N`` (their per-step breakdown). For
every case (shape, B, prompt, mode) with a profiled dense row (the case's fastest dense config) and a
profiled sparse row, the floor of the sparse step keeps what no exact sparse step can avoid and
drops everything else (select, match, dilated sets, composition, the inductor glue around them, and
any host time of its own):

- the dense row's host gap (its timed step minus its kernels): ``generate()``'s per-step wait,
  mask building and graph launch, which a sparse step pays too;
- the dense row's linear layers and ``aten`` copies (the same GEMMs and cache writes);
- the keys an exact retrieval must read: the K half of the dense attention time times the share of
  (sequence, KV head) pairs with at least one retrieving query head (``kv_group_rho_hat`` of the
  row's telemetry; else ``--kv-group-share``; else ρ̂, the smallest that share can be);
- the sparse attention's keys and values: the dense attention time times processed / dense KV.

Both memory terms run at the dense attention's own bandwidth. ``bound`` is the dense step over that
floor; ``bound without host gap`` takes the host gap out of both (a loop that never waits on the
host). Where the row lists the score kernel (``--profile-steps`` with the pipeline's kernels), the
share of K it streams at the dense bandwidth is shown beside the floor's share.

Output: a table, and ``<out>.json`` / ``<out>.md`` (default docs/results/decode_bound).

Example::

    python scripts/decode_bound.py --results docs/results/bench_e2e_decode_real_profile.json \\
        docs/results/bench_e2e_decode_real_32k.json docs/results/bench_e2e_decode_profile.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
#: the score kernels that stream K for a retrieval (group-aware and per-row)
SCORE_KERNELS = ("_group_score_kernel", "_score_kernel")


def _case(row: dict) -> tuple:
    return row["shape"], row["batch"], row["prompt"], row["mode"]


def bound_row(dense: dict, sparse: dict, source: str, kv_group_share: float | None = None) -> dict[str, Any]:
    """The floor of ``sparse``'s step from ``dense``'s measured parts (see the module docstring)."""
    d = dense["breakdown_ms_per_step"]
    attention, kernels = d["dense attention"], d["all kernels"]
    host_gap = max(dense["ms_per_step"] - kernels, 0.0)
    rho = sparse.get("rho_hat")
    if rho is None:
        raise ValueError(f"{source}: {sparse['config']} has no ρ̂ (run bench_e2e_decode.py with telemetry)")
    share, origin = sparse.get("kv_group_rho_hat"), "telemetry"
    if share is None and kv_group_share is not None:
        share, origin = kv_group_share, "--kv-group-share"
    if share is None:
        share, origin = rho, "ρ̂ (lower bound)"
    k_reads = share * attention / 2
    kv_reads = sparse["processed_kv"] / sparse["dense_kv"] * attention
    shared = d.get("linear (proj, MLP, head)", 0.0) + d.get("aten (copy, index, reduce)", 0.0)
    floor = host_gap + shared + k_reads + kv_reads
    pipeline = sparse.get("pipeline_kernels_per_step") or {}
    score = next((pipeline[k] for k in SCORE_KERNELS if k in pipeline), None)
    return {
        "source": source, "shape": sparse["shape"], "batch": sparse["batch"], "prompt": sparse["prompt"],
        "config": sparse["config"], "dense_config": dense["config"], "dense_ms": dense["ms_per_step"],
        "sparse_ms": sparse["ms_per_step"], "measured": dense["ms_per_step"] / sparse["ms_per_step"],
        "host_gap_ms": host_gap, "rho_hat": rho, "kv_group_share": share, "kv_group_share_from": origin,
        "score_k_share": None if score is None else score["ms"] / (attention / 2),
        "floor_ms": floor, "bound": dense["ms_per_step"] / floor,
        "bound_without_host_gap": kernels / (floor - host_gap),
    }


def bounds(reports: Sequence[tuple[str, dict]], kv_group_share: float | None = None) -> list[dict[str, Any]]:
    """One row per profiled sparse row of each report whose case has a profiled fastest dense row."""
    out = []
    for source, report in reports:
        rows = [r for r in report["rows"] if r.get("breakdown_ms_per_step")]
        for sparse in rows:
            if sparse["config"] in report.get("dense_configs", ()) or sparse.get("fastest_dense") == sparse["config"]:
                continue
            dense = next((r for r in rows if _case(r) == _case(sparse) and r["config"] == sparse.get("fastest_dense")),
                         None)
            if dense is not None:
                out.append(bound_row(dense, sparse, source, kv_group_share))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1 else f"{value:.2f}"
    return "–" if value is None else str(value)


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    head = ["report", "case", "sparse vs dense", "measured", "host gap ms", "ρ̂", "KV-group share (from)",
            "score kernel's K share", "floor ms", "bound", "bound without host gap"]
    lines = [f"Best possible sparse decode step from each run's own parts ({datetime.now(timezone.utc):%Y-%m-%d}):", "",
             f"    {command}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["source"], f"{r['shape']} B{r['batch']}/{r['prompt']}", f"{r['config']} vs {r['dense_config']}",
                 f"{r['measured']:.2f}× ({r['sparse_ms']:.2f} vs {r['dense_ms']:.2f} ms)", _fmt(r["host_gap_ms"]),
                 f"{r['rho_hat']:.3f}", f"{r['kv_group_share']:.3f} ({r['kv_group_share_from']})",
                 _fmt(r["score_k_share"]), _fmt(r["floor_ms"]), f"{r['bound']:.2f}×",
                 f"{r['bound_without_host_gap']:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", nargs="+", required=True, type=Path, help="bench_e2e_decode.py JSON reports")
    ap.add_argument("--kv-group-share", type=float, default=None,
                    help="share of (sequence, KV head) pairs with a retrieving head, for rows whose telemetry "
                         "lacks it (default: ρ̂, the smallest it can be)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "decode_bound")
    args = ap.parse_args(argv)
    if args.kv_group_share is not None and not 0 < args.kv_group_share <= 1:
        ap.error(f"--kv-group-share must be in (0, 1], got {args.kv_group_share}")
    reports = []
    for path in args.results:
        try:
            reports.append((path.name, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            ap.error(f"--results: {path}: {exc}")
    try:
        rows = bounds(reports, args.kv_group_share)
    except ValueError as exc:
        ap.error(f"--results: {exc}")
    if not rows:
        ap.error("--results: no case has both a profiled dense row and a profiled sparse row (--profile-steps)")
    command = "python scripts/decode_bound.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, command)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    meta = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": {name: {"date": rep.get("date"), "git_commit": rep.get("git_commit"), "gpu": rep.get("gpu")}
                       for name, rep in reports}}
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
