"""The dense/sparse policy against every measured cell: ``docs/results/policy_<gpu>.md``, one per GPU.

``python scripts/policy_table.py`` reads the result JSONs of ``docs/results`` (the speed maps
``speed_map*.json`` and the end-to-end runs ``bench_e2e_decode*.json``; nothing typed by hand) and
writes, per GPU of :data:`prhs_hf.policy.GPU_COST_MODELS`, the shipped constants with what each is
fitted to, then one row per measured cell where a PrHS config's decode steps ran sparse: the cost
model's dense and sparse µs per layer, its decision, the measured ratio (the fastest dense of the same
run and cell over the sparse row's ms/step) and whether the decision is right. Re-run it after adding
a result JSON; ``--check`` exits 1 where a shipped constant set gets a clear cell wrong.

A cell counts where its steps ran sparse: a config forced sparse (``NAME/sparse``), a row whose
``decode_steps`` says so, every PrHS row of a run before the policy existed (commit 4b39565), and a
``policy: auto`` row of a run that did not record ``decode_steps``, whose decision is replayed with
the cost model of the run's own tree (``git show COMMIT:prhs_hf/policy.py``). The dense rows of a cell
(``sdpa``, ``sdpa_gqa``, ``dense``, ``dense-gqa``, a config forced dense, a PrHS row whose steps ran
dense) give its fastest dense. A decision is judged only where the ratio is clear, outside
:data:`CLEAR_BAND`; inside it either decision is right.

The effective read rates (``bandwidth_gbs``) and the select cost (``topk_latency_ns``) come from the
operator benchmarks ``bench_decode_attention*.json`` / ``bench_union_lb.json``
(:func:`effective_rates`, :func:`select_costs`), printed in each table's header.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import statistics
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
#: measured ratios inside this band are a tie: either decision is right
CLEAR_BAND = (0.95, 1.05)
#: the first commit with ``policy: auto``; every PrHS row of an earlier run decoded sparse
POLICY_COMMIT = "4b39565"
#: backend.eager_step: auto (CUDA graphs of the eager CIS step) became the default; before, eager steps were plain
GRAPHS_DEFAULT_COMMIT = "9ae3b80"
#: the runtime passes the budget's k to the cost model (before, DecodeShape.topk stayed 0)
TOPK_PRICED_COMMIT = "8812774"

#: attention geometry of the models in the result files: query heads, KV heads, head size, layers
#: (``llama3-8b-shape``: prhs_hf.evaluation.speed_map.SHAPES; ``llama2-7b``, ``llama3-8b``,
#: ``qwen2.5-1.5b``: scripts/bench_e2e_decode.py's SHAPES; Qwen2.5-Coder-1.5B's config.json)
GEOMETRY = {
    "llama3-8b-shape": (32, 8, 128, 32),
    "llama3-8b-shape-4L": (32, 8, 128, 4),
    "llama3-8b": (32, 8, 128, 32),
    "llama2-7b": (32, 32, 128, 32),
    "qwen2.5-1.5b": (12, 2, 128, 28),
    "qwen2.5-coder-1.5b": (12, 2, 128, 28),
    "ckpt-qwen2.5-coder-1.5b": (12, 2, 128, 28),
}
DENSE_E2E = ("dense", "dense-gqa")  # bench_e2e_decode's dense configs

_PEAK = {"H100": "3.35 TB/s", "H200": "4.8 TB/s"}
_COMMON = {
    "eager_overhead_us": "host time per layer of an eager sparse step without CUDA graphs (`backend.eager_step: "
                         "plain` / `buffered`): below ~340 (llama2-7b B8/16k eager `cpe-s16-share` ran sparse 1.06x "
                         "on the H200) and above ~40 (the eager cells that lost, issue 37: Qwen B1/16k 0.36x, B8/30k "
                         "0.61x; llama3-8b shape B1/128k 0.32x). The default `eager_step: auto` replays CUDA graphs "
                         "and is priced as a compiled step. The host time itself is larger (~150 more launches per layer, "
                         "0.8-1.3 ms per layer in issue 37's B1 rows) but overlaps the GPU's work where that is long, "
                         "so the additive term is the bound the cells allow, not the host time",
    "per_key_ns": "0: a fit with a per-key term gives about zero (below) once the gathered sets' bytes are priced",
    "retrieval_rate": "`kv_group_rho_hat` 0.485 / 0.478 on real text at τ 0.8 (issue 12)",
    "margin": "sparse only where it saves at least 10 % of the layer's dense attention time",
    "min_sparse_prefill": "not measured: a PSAW/ETF prefill below it, or over a cache, runs dense",
    "union_fraction": "Qwen2.5-Coder-1.5B's `cis_longbench` sets at 16k, G = 6: 0.325 "
                      "([probe_group_set_mass_qwen1.5b_16k.md](probe_group_set_mass_qwen1.5b_16k.md))",
}
#: where each constant comes from, per GPU (the table's third column)
SOURCES = {key: {**_COMMON,
                 "bandwidth_gbs": f"median effective read rate of the fastest dense decode attention, operator rows "
                                  f"below ({_PEAK[key]} peak)",
                 "compiled_overhead_us": "the fit's fixed term below (rounded): the CIS step's kernels beyond their reads, "
                                         "per layer. A compiled step replays one CUDA graph: no host term per "
                                         "layer (the dense step's host gap, 1.2-2.5 ms per step in "
                                         "[decode_bound_fused_record.md](decode_bound_fused_record.md), is the "
                                         "same for both paths)",
                 "topk_latency_ns": "the fit's top-k term below (rounded): per entry of a retrieval's top-k, once per layer "
                                    "(the select and the dilated set's sort work through a row's k entries in turn)"}
           for key in _PEAK}
SOURCES["H100"]["eager_overhead_us"] = "the H200's: no H100 cell ran eager steps without CUDA graphs sparse"
NOTES = {
    "H200": "The one clear disagreement cannot be removed by any constant set of this model: for the llama3-8b shape's "
            "B1/128k `cis` cell to go dense, the fixed step cost must exceed ~85 µs per layer, and then the "
            "B32/16k `cis` cells of Qwen's shape (1.07x-1.58x, six rows) go dense too. Random weights retrieve on most steps "
            "(above the 0.5 rate of real text), and the same cell measured 1.08x in another run (b0e7c6a).\n\n"
            "Cells cited before this table have no result file here (they stay asserted in tests/test_policy.py::"
            "test_the_measured_h200_decisions): issue 37's Qwen2.5-Coder-1.5B rows (static B1/30k `cis` 0.83x, "
            "B32/30k `cis_longbench` 0.57x, eager B1/16k `cis` 0.36x, B8/30k 0.61x), issue 12's B32/16k 1.12x and "
            "B32/32.5k 1.58x (here as bench_e2e_decode_real_fused_record.json), and the llama3-8b shape runs of "
            "b0e7c6a (static B1/128k `cis` 1.08x, `cis_longbench` 0.58x; eager `cis` 0.32x).",
}


@dataclass
class Cell:
    """One measured row whose decode steps ran sparse, with the fastest dense of its cell."""

    gpu: str  # the JSON's gpu string
    source: str  # file name
    commit: str
    model: str
    weights: str
    mode: str
    batch: int
    context: int
    config: str
    ms_sparse: float
    ms_dense: float
    fastest_dense: str
    how: str  # why its steps count as sparse: forced, decode_steps, before the policy, replayed
    shape: Any = None  # prhs_hf.policy.DecodeShape
    compiled: bool = True

    @property
    def ratio(self) -> float:
        return self.ms_dense / self.ms_sparse

    @property
    def clear(self) -> bool:
        return not CLEAR_BAND[0] <= self.ratio <= CLEAR_BAND[1]


def _hex(commit: str) -> str:
    match = re.match(r"[0-9a-f]{7,40}", commit or "")
    if not match:
        raise ValueError(f"no commit hash in {commit!r}")
    return match.group(0)


@functools.lru_cache(maxsize=None)
def _descends(commit: str, ancestor: str) -> bool:
    """Whether ``commit`` contains ``ancestor`` (git; the script runs in the repository)."""
    run = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, _hex(commit)], cwd=ROOT,
                         capture_output=True, text=True)
    if run.returncode not in (0, 1):
        raise RuntimeError(f"git merge-base {ancestor} {commit}: {run.stderr.strip()} (run in a clone with history)")
    return run.returncode == 0


@functools.lru_cache(maxsize=None)
def _old_policy(commit: str) -> types.ModuleType:
    """prhs_hf/policy.py as of ``commit``, imported as a module of the package (its relative imports work)."""
    text = subprocess.run(["git", "show", f"{_hex(commit)}:prhs_hf/policy.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    module = types.ModuleType(f"prhs_hf._policy_{_hex(commit)}")
    module.__package__ = "prhs_hf"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(text, f"{commit}:prhs_hf/policy.py", "exec"), module.__dict__)
    return module


def _config(name: str, e2e_configs: Optional[dict]) -> Any:
    """The PrHSConfig of a row's config name (a bench_e2e_decode name: its recorded base + overrides)."""
    from prhs_hf.evaluation.accuracy.configs import load_any_config
    from prhs_hf.evaluation.speed_map import prhs_config

    if e2e_configs is not None:
        spec = e2e_configs[name]
        return load_any_config(str(ROOT / spec["base"]), spec["overrides"])
    return load_any_config(*prhs_config(name))


@functools.lru_cache(maxsize=None)
def _runtime_shape(config_key: str, geometry: tuple, batch: int, context: int) -> tuple[Any, bool]:
    """``(DecodeShape, graphed)`` of a config on a model of ``geometry``: what the runtime prices
    (:meth:`prhs_hf.runtime.PrHSRuntime.decode_shape` after :meth:`use_budget`), taken from a patched
    one-layer-wide stand-in of the model's attention (tiny hidden size, the real heads)."""
    import torch
    import transformers

    import prhs_hf

    heads, kv_heads, head_dim, layers = geometry
    config = _CONFIGS[config_key]
    llama = transformers.LlamaConfig(hidden_size=heads * 8, intermediate_size=16, num_hidden_layers=layers,
                                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                     vocab_size=16, max_position_embeddings=1 << 22)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama, attn_implementation="sdpa")
    handle = prhs_hf.patch(model, config)
    try:
        runtime = handle.runtime
        runtime.use_budget(context)
        return runtime.decode_shape(batch, context, torch.bfloat16), runtime.graphed
    finally:
        prhs_hf.unpatch(model)


_CONFIGS: dict[str, Any] = {}


def _shape_of(name: str, e2e_configs: Optional[dict], model: str, batch: int, context: int) -> tuple[Any, bool]:
    if model not in GEOMETRY:
        raise ValueError(f"model {model!r}: its attention geometry is not in scripts/policy_table.py's GEOMETRY "
                         f"(add its query heads, KV heads, head size and layers)")
    config = _config(name, e2e_configs)
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    _CONFIGS[key] = config
    return _runtime_shape(key, GEOMETRY[model], batch, context)


def _replayed_sparse(commit: str, shape: Any, compiled: bool) -> bool:
    """What ``policy: auto`` decided at ``commit`` for ``shape`` (its DecodeShape's fields only; the
    budget's k only where that tree's runtime passed it)."""
    old = _old_policy(commit)
    fields = {f.name for f in dataclasses.fields(old.DecodeShape)}
    values = {k: v for k, v in dataclasses.asdict(shape).items() if k in fields}
    if "topk" in values and not _descends(commit, TOPK_PRICED_COMMIT):
        values["topk"] = 0
    return old.H200.sparse_decode_wins(old.DecodeShape(**values), compiled)


def _speed_map_cells(path: Path, data: dict) -> list[Cell]:
    from prhs_hf.evaluation.speed_map import is_dense_baseline, prhs_config

    commit = data["git_commit"]
    before_policy = not _descends(commit, POLICY_COMMIT)
    graphs_default = _descends(commit, GRAPHS_DEFAULT_COMMIT)
    groups: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        if row.get("status") == "ok" and row.get("ms_per_step"):
            key = (row.get("bench_call"), row["model"], row["prompts"], row["mode"], row["batch"], row["length"],
                   row.get("stop_check_every"))
            groups.setdefault(key, []).append(row)
    cells = []
    for rows in groups.values():
        dense, sparse = [], []
        for row in rows:
            if is_dense_baseline(row["config"]):
                dense.append(row)
                continue
            name = row["config"]
            shape, graphed = _shape_of(name, None, row["model"], row["batch"], row["length"])
            step = name.partition("+")[2] or ("auto" if graphs_default else "plain")
            compiled = row["mode"] == "static" or (graphed and step in ("auto", "graphs"))
            forced = prhs_config(name)[1].get("policy", {}).get("decode")
            if forced == "sparse":
                how = "forced"
            elif row.get("decode_steps"):
                how = "decode_steps" if row["decode_steps"] == "sparse" else ""
            elif before_policy:
                how = "before the policy"
            else:
                how = "replayed" if _replayed_sparse(commit, shape, compiled) else ""
            if not how:
                dense.append(row)  # the policy ran its steps dense: a dense baseline in its loop
                continue
            sparse.append((row, shape, compiled, how))
        if not dense:
            continue  # no dense of the cell ran (e.g. out of memory): no ratio
        best = min(dense, key=lambda r: r["ms_per_step"])
        for row, shape, compiled, how in sparse:
            cells.append(Cell(data["gpu"], path.name, commit, row["model"], row.get("weights", "?"), row["mode"],
                              row["batch"], row["length"], row["config"], row["ms_per_step"], best["ms_per_step"],
                              best["config"], how, shape, compiled))
    return cells


def _e2e_cells(path: Path, data: dict) -> list[Cell]:
    """bench_e2e_decode rows: all before the policy, every PrHS config decoding sparse."""
    commit = data["git_commit"]
    if _descends(commit, POLICY_COMMIT):
        raise ValueError(f"{path.name}: a bench_e2e_decode run after the policy: its rows do not say whether "
                         f"their steps ran sparse")
    groups: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        if row.get("ms_per_step"):
            key = (row["shape"], row["prompts"], row["mode"], row["batch"], row["prompt"])
            groups.setdefault(key, []).append(row)
    cells = []
    for rows in groups.values():
        dense = [r for r in rows if r["config"] in DENSE_E2E]
        if not dense:
            continue
        best = min(dense, key=lambda r: r["ms_per_step"])
        for row in rows:
            if row["config"] in DENSE_E2E:
                continue
            shape, graphed = _shape_of(row["config"], data["configs"], row["shape"], row["batch"], row["prompt"])
            compiled = row["mode"] == "static"  # eager steps were plain before backend.eager_step
            cells.append(Cell(data["gpu"], path.name, commit, row["shape"], row.get("weights", "?"), row["mode"],
                              row["batch"], row["prompt"], row["config"], row["ms_per_step"], best["ms_per_step"],
                              best["config"], "before the policy", shape, compiled))
    return cells


def measured_cells(results: Path = RESULTS) -> list[Cell]:
    """Every measured cell of ``results`` where a PrHS config decoded sparse, with its fastest dense."""
    cells = []
    for path in sorted(results.glob("speed_map*.json")):
        cells += _speed_map_cells(path, json.loads(path.read_text()))
    for path in sorted(results.glob("bench_e2e_decode*.json")):
        cells += _e2e_cells(path, json.loads(path.read_text()))
    return cells


def _operator_rows(results: Path) -> list[tuple[str, dict]]:
    out = []
    for path in sorted([*results.glob("bench_decode_attention*.json"), *results.glob("bench_union_lb.json")]):
        data = json.loads(path.read_text())
        out += [(data["gpu"], dict(row, source=path.name)) for row in data["rows"]]
    return out


def effective_rates(results: Path = RESULTS) -> dict[str, list[tuple[str, float]]]:
    """Per GPU string: ``(operator shape, GB/s)`` of the fastest dense attention of each operator row
    (every key and value read once: ``B · Hkv · L · D · 2 · 2`` bytes over its time)."""
    rates: dict[str, list[tuple[str, float]]] = {}
    for gpu, r in _operator_rows(results):
        if r.get("fastest_dense_ms"):
            nbytes = r["B"] * r["Hkv"] * r["ctx"] * r["D"] * 2 * 2
            label = f"B{r['B']}/{r['ctx'] // 1024}k {r['Hq']}/{r['Hkv']} ({r['source']})"
            rates.setdefault(gpu, []).append((label, nbytes / (r["fastest_dense_ms"] * 1e-3) / 1e9))
    return rates


def step_fit(key: str, per_key: bool = False, results: Path = RESULTS) -> Optional[tuple[float, ...]]:
    """A least-squares fit, over the operator rows of GPU ``key``, of the CIS step's time beyond its
    modelled reads at the shipped ``bandwidth_gbs`` (the gathered sets, and the retrieving rows' share of
    their KV groups' keys scored): ``fixed + topk_latency_ns · k`` (with ``per_key``, ``+ per_key_ns ·
    B · rows · n`` too). Each row gives two points, its per-head step (``cis16_ms``, rows = query heads)
    and its group step (``cis16_group_ms``, rows = KV heads; ``cis.selection: group``). Returns
    ``(fixed µs, topk_latency_ns, points)``, with ``per_key`` ``(fixed µs, topk_latency_ns, per_key_ns,
    points)``; None under three points."""
    import numpy as np

    from prhs_hf import policy

    per_us = policy.GPU_COST_MODELS[key].bandwidth_gbs * 1e3
    design, rest = [], []
    for gpu, r in _operator_rows(results):
        if policy.gpu_key(gpu) != key:
            continue
        token = r["D"] * 2
        share = r["retrieving_rows_s16"] / (r["B"] * r["Hq"])
        for rows, ms in ((r["Hq"], r.get("cis16_ms")), (r["Hkv"], r.get("cis16_group_ms"))):
            if ms:
                reads = r["B"] * rows * min(r["cap"], r["ctx"]) * 2 * token + share * r["B"] * r["Hkv"] * r["ctx"] * token
                design.append([1.0, r["k"] * 1e-3] + ([r["B"] * rows * r["cap"] * 1e-3] if per_key else []))
                rest.append(ms * 1e3 - reads / per_us)
    if len(rest) < 3:
        return None
    return (*(float(x) for x in np.linalg.lstsq(np.array(design), np.array(rest), rcond=None)[0]), len(rest))


def select_costs(results: Path = RESULTS) -> dict[str, list[tuple[str, int, float]]]:
    """Per GPU string: ``(operator shape, k, µs)`` of the select and the dilated set's sort (the stages
    whose time grows with the top-k k, ``stage16_retrieval_select_ms + stage16_dilated_set_ms``)."""
    out: dict[str, list[tuple[str, int, float]]] = {}
    for gpu, r in _operator_rows(results):
        if r.get("stage16_retrieval_select_ms") is not None and r.get("stage16_dilated_set_ms") is not None:
            label = f"B{r['B']}/{r['ctx'] // 1024}k {r['Hq']}/{r['Hkv']} ({r['source']})"
            us = (r["stage16_retrieval_select_ms"] + r["stage16_dilated_set_ms"]) * 1e3
            out.setdefault(gpu, []).append((label, r["k"], us))
    return out


def judged(cells: list[Cell], model: Any) -> list[tuple[Cell, float, float, bool, Optional[bool]]]:
    """``(cell, dense µs, sparse µs, says sparse, right)`` per cell; ``right`` None inside the band."""
    out = []
    for cell in cells:
        dense_us, sparse_us = model.decode_times_us(cell.shape, cell.compiled)
        says = model.sparse_decode_wins(cell.shape, cell.compiled)
        out.append((cell, dense_us, sparse_us, says, (says == (cell.ratio > 1)) if cell.clear else None))
    return out


def markdown(key: str, cells: list[Cell], results: Path = RESULTS) -> str:
    from prhs_hf import policy

    model = policy.GPU_COST_MODELS[key]
    notes = SOURCES[key]
    lines = [f"# The dense/sparse policy's {key} constants (prhs_hf/policy.py)", "",
             "Generated by `python scripts/policy_table.py` from the result JSONs of this folder; do not edit by hand.",
             "", f"`cost_model_for` picks these constants on a GPU whose name contains \"{key}\" "
             f"(`policy.GPU_COST_MODELS`). `policy: auto` runs a decode step sparse only where "
             "`CostModel.sparse_decode_wins` says so.", "",
             "| constant | value | from |", "|---|---|---|"]
    for field in dataclasses.fields(model):
        lines.append(f"| `{field.name}` | {getattr(model, field.name):g} | {notes.get(field.name, '')} |")
    gpus = [g for g in {**effective_rates(results), **select_costs(results)} if policy.gpu_key(g) == key]
    lines += ["", "Measured inputs (operator benchmarks, this GPU):", ""]
    for gpu in gpus:
        for label, gbs in effective_rates(results).get(gpu, []):
            lines.append(f"- fastest dense attention {label}: {gbs:,.0f} GB/s")
        for label, k, us in select_costs(results).get(gpu, []):
            lines.append(f"- select + dilated set {label}, k {k:,}: {us:.0f} µs")
    fit, with_key = step_fit(key, results=results), step_fit(key, per_key=True, results=results)
    if fit:
        lines.append(f"- least-squares fit of the CIS step (per-head and group) beyond its reads at "
                     f"{model.bandwidth_gbs:g} GB/s, {fit[2]} points: fixed {fit[0]:.0f} µs, topk_latency_ns "
                     f"{fit[1]:.1f}; with a per-key term: fixed {with_key[0]:.0f} µs, topk_latency_ns "
                     f"{with_key[1]:.1f}, per_key_ns {with_key[2]:.3f}")
    if not gpus:
        lines.append("- none in this folder")
    rows = judged([c for c in cells if policy.gpu_key(c.gpu) == key], model)
    wrong = [r for r in rows if r[4] is False]
    lines += ["", f"What the model says against every measured cell on the {key} where a PrHS config's decode steps "
              "ran sparse (measured: the fastest dense of the same run and cell over the sparse row's ms/step, a "
              "PrHS row whose steps the policy ran dense counting as a dense row; "
              f"a ratio inside {CLEAR_BAND[0]}–{CLEAR_BAND[1]}× is a tie, either decision right). "
              "`steps`: forced (`NAME/sparse`), decode_steps (the policy ran them sparse), before the policy "
              "(every PrHS row decoded sparse), replayed (the run's own tree's policy said sparse).", "",
              "| model | weights | mode | B | L | config | dense µs/layer | sparse µs/layer | model says | measured "
              "| fastest dense | right | steps | source |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, dense_us, sparse_us, says, right in rows:
        mode = cell.mode if cell.mode == "static" or not cell.compiled else "eager (graphs)"
        verdict = "tie" if right is None else ("yes" if right else "**no**")
        lines.append(f"| {cell.model} | {cell.weights} | {mode} | {cell.batch} | {cell.context} | {cell.config} "
                     f"| {dense_us:.0f} | {sparse_us:.0f} | {'sparse' if says else 'dense'} | {cell.ratio:.2f}x "
                     f"| {cell.fastest_dense} | {verdict} | {cell.how} | {cell.source} ({_hex(cell.commit)[:7]}) |")
    clear = sum(r[4] is not None for r in rows)
    lines += ["", f"{len(rows)} cells, {clear} clear; the model's decision is wrong in {len(wrong)}."]
    lines += [f"- wrong: {c.model} {c.mode} B{c.batch} L{c.context} {c.config}: says "
              f"{'sparse' if s else 'dense'}, measured {c.ratio:.2f}x ({c.source})" for c, _, _, s, _ in wrong]
    if NOTES.get(key):
        lines += ["", NOTES[key]]
    lines += ["", "## Re-measuring", "Add a run's JSON to docs/results and run `python scripts/policy_table.py` again. "
              "On another GPU: `prhs-hf bench --model YOUR_CHECKPOINT --prompts TEXT.jsonl --configs "
              "sdpa,sdpa_gqa,cis/sparse,cis/dense --modes eager,static` (`NAME/sparse`, `NAME/dense` force the "
              "policy) and `python scripts/bench_decode_attention.py` for the read rate and the select cost; write "
              "the constants that reproduce its decisions to a JSON object of `CostModel` fields "
              "(`{\"bandwidth_gbs\": 2000, \"compiled_overhead_us\": 80}`) and name it in the config: "
              "`policy: {decode: auto, prefill: auto, cost_model: my_gpu.json}` (fields left out keep the H200's)."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSONs (default: docs/results)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for policy_<gpu>.md (default: docs/results)")
    parser.add_argument("--check", action="store_true", help="exit 1 where a shipped constant set gets a clear cell wrong")
    args = parser.parse_args(argv)
    from prhs_hf import policy

    cells = measured_cells(args.results)
    bad = 0
    for key in policy.GPU_COST_MODELS:
        text = markdown(key, cells, args.results)
        path = args.out / f"policy_{key.lower()}.md"
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
        bad += sum(r[4] is False for r in judged([c for c in cells if policy.gpu_key(c.gpu) == key],
                                                  policy.GPU_COST_MODELS[key]))
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
