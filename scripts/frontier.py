#!/usr/bin/env python
"""The accuracy-speed frontier of the candidate defaults (issue 37 item 5), from measured results only.

Each candidate is a config (budget × selection) with, where measured:

- **speed**: the whole CIS-16 decode step against the fastest dense column of the same run, from
  ``scripts/bench_decode_attention.py --shapes ...`` (``--operator``; the llama3-8b attention shape,
  32/8 heads, half the rows retrieving), per-head sets (``cis16``) or one set per KV head
  (``cis16_group``), at every shape of that file; and the end-to-end ``prhs-hf bench`` cells of the
  same config (``--speed-maps``: decode ms/step of ``generate()`` against the fastest dense);
- **what ``policy: auto`` does there**: the cost model's decision for that shape (``prhs_hf.policy``,
  compiled step), so a config whose sets lose runs dense and costs what dense costs;
- **accuracy**: the RULER mean over the (task, length) cells the config shares with ``dense`` in
  ``--ruler`` (``scripts/ruler_report.py``'s JSON), as points against dense, with its worst cell;
- **dropped attention mass** (a CPU proxy where RULER has not run): from ``--masses``
  (``scripts/probe_group_union.py --mass-k`` JSONs), the mean mass outside the sets of the
  candidate's budget (its config's sink, window and top-k) and selection, on a real model and text.

Output (``--out`` stem): ``.json`` (rows and the sources), ``.md`` (the table) and, with matplotlib,
``.png`` (speed vs RULER points per candidate; candidates without a RULER run are drawn on a strip
below). Nothing is estimated: a number that was not measured is left empty.

    python scripts/frontier.py   # the committed results -> docs/results/frontier.{json,md,png}
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


@dataclass(frozen=True)
class Candidate:
    """A candidate default: its name in the speed map / accuracy tables, its budget's config file and
    selection (``head``: a set per query head; ``group``: one per KV head), and its RULER rows' name."""

    name: str
    budget: str  # the configs/ file whose budget it uses ("" for dense)
    selection: str
    ruler_name: str
    speed_map_names: tuple[str, ...]  # its rows in the speed maps, forced sparse or as the policy ran them
    topk: Optional[int] = None  # its top-k where it is not the budget file's (the file's sink and window kept)


CANDIDATES = (
    Candidate("dense", "", "", "dense", ("sdpa_gqa",)),
    Candidate("cis_longbench", "cis_longbench.yaml", "head", "cis-lb",
              ("cis_longbench/sparse", "cis_longbench", "cis_longbench+graphs")),
    Candidate("cis-group-lb", "cis_longbench.yaml", "group", "cis-group-lb", ("cis-group-lb", "cis-group-lb/sparse")),
    Candidate("cis-group-8k", "cis_longbench.yaml", "group", "cis-group-8k", ("cis-group-8k", "cis-group-8k/sparse"),
              topk=8192),
    Candidate("cis", "cis.yaml", "head", "cis-s16", ("cis", "cis/sparse", "cis+graphs")),
    Candidate("cis-group", "cis.yaml", "group", "cis-group", ("cis-group", "cis-group/sparse")),
)
DEFAULT_SPEED_MAPS = ("speed_map_static_h100_b1_128k.json", "speed_map_eager_h100.json",
                      "speed_map_eager_h100_b4_64k.json", "speed_map_h100_af76502.json")
DEFAULT_RULER = ("ruler_qwen1.5b.json", "ruler_qwen1.5b_frontier_table.json")
DEFAULT_MASSES = ("probe_group_mass_qwen1.5b.json", "probe_group_mass_qwen1.5b_16k.json",
                  "probe_group_mass_qwen1.5b_cis.json", "probe_group_set_mass_qwen1.5b_16k.json")


def dropped_masses(probes: list[tuple[str, dict]], cand: Candidate) -> list[dict]:
    """The candidate's dropped attention mass in each probe: ``sets="exact top-k"`` where the probe ran its
    budget's config at its top-k (``--mass-k``: exact per-step sets of its selection), ``"as run"`` where it
    ran the candidate itself (``--set-mass``: the sets its decode steps attended to, CIS sharing and
    dilation included); one entry per probe file (its model and prompt length)."""
    if not cand.budget:
        return []
    from prhs_hf.config import load_config

    config = Path(cand.budget).stem
    k = str(cand.topk or load_config(REPO / "configs" / cand.budget).budget.topk)
    who = "group" if cand.selection == "group" else "head"
    exact = [dict(file=name, model=data["model"], length=data["length"], k=int(k), sets="exact top-k",
                  mean=row["dropped_mass"][k][who]["mean"], p90=row["dropped_mass"][k][who]["p90"],
                  samples=row["dropped_mass"][k][who]["samples"])
             for name, data in probes for row in data["rows"]
             if row.get("config") == config and k in (row.get("dropped_mass") or {})]
    as_run = [dict(file=name, model=data["model"], length=data["length"], k=int(k), sets="as run",
                   **row["set_dropped_mass"])
              for name, data in probes for row in data["rows"]
              if row.get("config") == cand.name and row.get("set_dropped_mass")]
    return exact + as_run


def ruler_accuracy(ruler: dict, name: str) -> Optional[dict]:
    """``name``'s mean RULER score over the cells it shares with dense, as points against dense's mean
    over the same cells, its worst cell, the cell count and the smallest n; None where it has no rows."""
    cells = {(r["config"], r["task"], r["length"]): r for r in ruler["rows"] if r.get("score") is not None}
    own = {(t, n): r for (c, t, n), r in cells.items() if c == name}
    shared = [key for key in own if ("dense",) + key in cells]
    if not shared:
        return None
    deltas = [100 * (own[key]["score"] - cells[("dense",) + key]["score"]) for key in shared]
    return dict(cells=len(shared), min_n=min(min(own[k]["n"], cells[("dense",) + k]["n"]) for k in shared),
                delta_points=sum(deltas) / len(deltas), worst_cell_points=min(deltas),
                score=sum(own[k]["score"] for k in shared) / len(shared))


def merge_ruler(reports: list[dict]) -> dict:
    """The rows of several ``ruler_report.py`` JSONs as one report; a (config, task, length) cell in
    several keeps the first report's row."""
    cells: dict[tuple, dict] = {}
    for report in reports:
        for r in report["rows"]:
            cells.setdefault((r["config"], r["task"], r["length"]), r)
    return {"rows": list(cells.values())}


def operator_speeds(operator: dict, cand: Candidate) -> list[dict]:
    """The candidate's whole-step speedups in the operator file: one per shape with its budget."""
    if not cand.budget:
        return [dict(shape=_shape(r), speedup=1.0, ms=r["fastest_dense_ms"]) for r in operator["rows"]]
    column = "cis16_group" if cand.selection == "group" else "cis16"
    return [dict(shape=_shape(r), speedup=r[f"{column}_speedup_vs_fastest_dense"], ms=r[f"{column}_ms"],
                 dense_ms=r["fastest_dense_ms"], dense=r["fastest_dense"])
            for r in operator["rows"] if _measures(r, cand)]


def _measures(row: dict, cand: Candidate) -> bool:
    """Whether an operator row ran ``cand``'s budget (its file, and its top-k where the candidate sets one)."""
    return row["budget"] == cand.budget and (cand.topk is None or row["k"] == cand.topk)


def _shape(row: dict) -> str:
    return f"B{row['B']}/{row['ctx'] // 1024}k {row['Hq']}/{row['Hkv']}"


def policy_decision(row: dict, cand: Candidate, gpu: Optional[str] = None) -> Optional[str]:
    """What ``policy: auto`` (the shipped cost model of ``gpu``, the operator run's GPU by name; compiled
    step) runs at an operator row's shape."""
    if not cand.budget:
        return None
    from prhs_hf.policy import DEFAULT_GPU, GPU_COST_MODELS, DecodeShape, gpu_key

    model = GPU_COST_MODELS[gpu_key(gpu or "") or DEFAULT_GPU]

    rows = row["Hkv"] if cand.selection == "group" else row["Hq"]
    shape = DecodeShape(batch=row["B"], context=row["ctx"], kv_heads=row["Hkv"], rows=rows, head_dim=row["D"],
                        itemsize=2, index_set=row["cap"], topk=row["k"])
    return "sparse" if model.sparse_decode_wins(shape, compiled=True) else "dense"


def end_to_end(speed_maps: list[tuple[str, dict]], cand: Candidate) -> list[dict]:
    return [dict(file=name, mode=r["mode"], cell=f"B{r['batch']}/{r['length'] // 1024}k", config=r["config"],
                 speedup=r.get("speedup_vs_fastest_dense"), fastest_dense=r.get("fastest_dense"),
                 decode_steps=r.get("decode_steps"))
            for name, data in speed_maps for r in data["rows"]
            if r["config"] in cand.speed_map_names and r.get("status") == "ok" and r["config"] != "sdpa_gqa"
            and r.get("speedup_vs_fastest_dense") is not None]  # a cell whose dense did not run has no ratio


def build(ruler: dict, operator: dict, speed_maps: list[tuple[str, dict]],
          probes: tuple[tuple[str, dict], ...] = ()) -> list[dict]:
    out = []
    for cand in CANDIDATES:
        ops = operator_speeds(operator, cand)
        by_shape = {_shape(r): r for r in operator["rows"] if _measures(r, cand)}
        for op in ops:
            op["policy_auto"] = policy_decision(by_shape[op["shape"]], cand, operator.get("gpu")) if cand.budget else None
        out.append(dict(asdict(cand), operator=ops, end_to_end=end_to_end(speed_maps, cand),
                        ruler=ruler_accuracy(ruler, cand.ruler_name), dropped_mass=dropped_masses(list(probes), cand)))
    return out


def pareto(rows: list[dict], shape: str) -> list[str]:
    """The candidates no other measured one beats on both the speed at ``shape`` and RULER points."""
    pts = {}
    for r in rows:
        op = next((o for o in r["operator"] if o["shape"] == shape), None)
        if op is not None and r["ruler"] is not None:
            pts[r["name"]] = (op["speedup"], r["ruler"]["delta_points"])
    return [n for n, (s, a) in pts.items()
            if not any(s2 >= s and a2 >= a and (s2, a2) != (s, a) for m, (s2, a2) in pts.items() if m != n)]


def markdown(rows: list[dict], meta: dict) -> str:
    shapes = list(dict.fromkeys(o["shape"] for r in rows for o in r["operator"]))
    lines = [f"# Candidate defaults: accuracy and speed, measured ({meta['date'][:10]})", "",
             f"    {meta['command']}", "",
             "Speed: the whole CIS-16 decode step against the fastest dense of the same run "
             f"([{meta['operator']}]({meta['operator']}): {meta['operator_gpu']}, llama3-8b attention shape, half the "
             "rows retrieving); in brackets what `policy: auto` runs there (its cost model). RULER: points against "
             "dense over the cells both ran ("
             + ", ".join(f"[{name}]({name})" for name in meta["ruler"].split(", "))
             + ", Qwen2.5-Coder-1.5B-Instruct; a candidate's RULER rows ran every decode step sparse). "
             "Dropped mass (a CPU proxy, not an accuracy): the mean attention mass per (step, layer, query head) "
             "outside the candidate's sets, on a prompt of Python source: its exact per-step sets (sink, window, "
             "top-k, its selection; no sharing, no dilation; `scripts/probe_group_union.py --mass-k`) and the sets "
             "its decode steps attended to (`--set-mass`, as run) "
             f"({', '.join(meta.get('masses', [])) or 'none'}).", "",
             "| candidate | budget | sets | " + " | ".join(f"step {s}" for s in shapes)
             + " | end to end (`prhs-hf bench`) | RULER vs dense (mean / worst cell, cells, n) | dropped mass (CPU proxy) |",
             "|---|---|---|" + "---|" * len(shapes) + "---|---|---|"]
    for r in rows:
        ops = {o["shape"]: o for o in r["operator"]}
        speed = [f"{ops[s]['speedup']:.2f}×" + (f" ({ops[s]['policy_auto']})" if ops[s].get("policy_auto") else "")
                 if s in ops else "–" for s in shapes]
        e2e = "; ".join(f"{e['mode']} {e['cell']} `{e['config']}` {e['speedup']:.2f}×"
                        + (" (dense steps)" if e.get("decode_steps") == "dense" else "")
                        for e in r["end_to_end"]) or "–"
        acc = r["ruler"]
        acc_s = (f"{acc['delta_points']:+.1f} / {acc['worst_cell_points']:+.1f} points ({acc['cells']} cells, n ≥ {acc['min_n']})"
                 if acc else "not run")
        mass = "; ".join(f"{m['mean']:.4f} ({m['sets']}, {m['model']}, {m['length'] // 1024}k, k {m['k']})"
                         for m in r.get("dropped_mass", [])) or ("0" if not r["budget"] else "–")
        lines.append(f"| `{r['name']}` | {r['budget'] or 'all keys'} | {r['selection'] or '–'} | " + " | ".join(speed)
                     + f" | {e2e} | {acc_s} | {mass} |")
    lines += ["", f"On the frontier at {shapes[0]} (no measured candidate faster and at least as accurate): "
              + ", ".join(f"`{n}`" for n in pareto(rows, shapes[0])) + "."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, shape: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    strip = min([r["ruler"]["delta_points"] for r in rows if r["ruler"]] + [0]) - 3
    for r in rows:
        op = next((o for o in r["operator"] if o["shape"] == shape), None)
        if op is None:
            continue
        measured = r["ruler"] is not None
        y = r["ruler"]["delta_points"] if measured else strip
        ax.scatter([op["speedup"]], [y], s=60, marker="o" if measured else "x",
                   color="C0" if r["selection"] == "head" else ("C1" if r["selection"] else "k"))
        ax.annotate(r["name"] + ("" if measured else " (RULER not run)"), (op["speedup"], y),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.axhline(-1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"CIS step vs fastest dense, {shape} (operator)")
    ax.set_ylabel("RULER vs dense, points (Qwen2.5-Coder-1.5B)")
    ax.set_title("Candidate defaults: blue per-head sets, orange one set per KV head", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ruler", default=",".join(str(RESULTS / f) for f in DEFAULT_RULER),
                    help="scripts/ruler_report.py JSONs, comma-separated (a cell in several: the first file's)")
    ap.add_argument("--operator", default=str(RESULTS / "bench_decode_attention_lb.json"))
    ap.add_argument("--speed-maps", default=",".join(str(RESULTS / f) for f in DEFAULT_SPEED_MAPS))
    ap.add_argument("--masses", default=",".join(str(RESULTS / f) for f in DEFAULT_MASSES),
                    help="scripts/probe_group_union.py --mass-k JSONs (the dropped-mass column; '' for none)")
    ap.add_argument("--out", default=str(RESULTS / "frontier"), help="output stem (.json, .md, .png)")
    args = ap.parse_args(argv)
    mass_paths = [Path(p) for p in args.masses.split(",") if p]
    ruler_paths = [Path(p) for p in args.ruler.split(",") if p]
    speed_paths = [Path(p) for p in args.speed_maps.split(",") if p]
    missing = [str(p) for p in [*ruler_paths, Path(args.operator), *speed_paths, *mass_paths] if not p.is_file()]
    if missing:
        ap.error(f"missing result files: {', '.join(missing)}")
    ruler = merge_ruler([json.loads(p.read_text()) for p in ruler_paths])
    operator = json.loads(Path(args.operator).read_text())
    speed_maps = [(p.name, json.loads(p.read_text())) for p in speed_paths]
    probes = tuple((p.name, json.loads(p.read_text())) for p in mass_paths)
    rows = build(ruler, operator, speed_maps, probes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(command="python scripts/frontier.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                ruler=", ".join(p.name for p in ruler_paths), operator=Path(args.operator).name,
                operator_gpu=operator.get("gpu"), operator_commit=operator.get("git_commit"),
                speed_maps=[n for n, _ in speed_maps], masses=[n for n, _ in probes])
    (out.parent / f"{out.name}.json").write_text(json.dumps(dict(meta, rows=rows), indent=2) + "\n")
    md = markdown(rows, meta)
    (out.parent / f"{out.name}.md").write_text(md)
    drawn = plot(rows, out.parent / f"{out.name}.png", rows[0]["operator"][0]["shape"] if rows[0]["operator"] else "")
    print(md)
    print(f"wrote {out}.json, .md" + (", .png" if drawn else " (no matplotlib: no .png)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
