"""scripts/ruler_report.py on a synthetic run: the table per task and length, the means, and needle
recall by depth recomputed from the saved generations and the prepared rows' depths."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
ruler_report = load_script("ruler_report")


def _row(config: str, task: str, score: float, n: int, rho=None, prefill=None) -> dict:
    row = {"config": config, "task": task, "status": "ok", "metrics": {"string_match_all": score}, "n": n,
           "seconds": 10.0, "rho_hat": rho, "processed_kv_per_step": 100.0, "dense_kv_per_step": 4000.0}
    if prefill is not None:  # rows of reports without prefill times lack the key
        row["prefill_seconds"] = prefill
    return row


@pytest.fixture()
def run(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    docs = [{"task": "niah_single_2", "index": 0, "input": "…", "outputs": ["1234"], "depths": [0.05]},
            {"task": "niah_single_2", "index": 1, "input": "…", "outputs": ["5678"], "depths": [0.95]}]
    (data / "ruler_niah_single_2_4096.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (data / "ruler_vt_4096.jsonl").write_text(json.dumps({"task": "vt", "input": "…", "outputs": ["X"]}) + "\n")
    rows = [_row("dense", "ruler_niah_single_2_4096", 1.0, 2, prefill=2.0),
            _row("cpe", "ruler_niah_single_2_4096", 0.5, 2, 0.2, prefill=1.5),
            _row("dense", "ruler_vt_4096", 1.0, 1), _row("cpe", "ruler_vt_4096", 0.0, 1, 0.2, prefill=0.5),
            _row("dense", "gsm8k_cot", 0.5, 3)]
    results = tmp_path / "acc.json"
    results.write_text(json.dumps({"meta": {"command": "run_accuracy.py …", "model": "m"}, "rows": rows}))
    samples = [{"config": "dense", "task": "ruler_niah_single_2_4096", "index": 0, "generation": " The number is 1234."},
               {"config": "dense", "task": "ruler_niah_single_2_4096", "index": 1, "generation": "5678"},
               {"config": "cpe", "task": "ruler_niah_single_2_4096", "index": 0, "generation": "I do not know"},
               {"config": "cpe", "task": "ruler_niah_single_2_4096", "index": 1, "generation": "5678\n"},
               {"config": "cpe", "task": "ruler_vt_4096", "index": 0, "generation": "Y"}]
    with gzip.open(tmp_path / "acc.samples.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in samples)
    return results, data


def test_report_tables_and_depth_recall(run, tmp_path) -> None:
    results, data = run
    out = tmp_path / "out" / "ruler_qwen1.5b"  # a dot in the name: not a suffix to replace
    assert ruler_report.main(["--results", str(results), "--data-dir", str(data), "--out", str(out)]) == 0
    got = json.loads((out.parent / "ruler_qwen1.5b.json").read_text())
    assert {(r["config"], r["task"], r["length"]) for r in got["rows"]} == {
        ("dense", "niah_single_2", 4096), ("cpe", "niah_single_2", 4096), ("dense", "vt", 4096), ("cpe", "vt", 4096)}
    means = {(m["config"], m["length"]): m["mean_score"] for m in got["by_length"]}
    assert means == {("dense", 4096): 1.0, ("cpe", 4096): 0.25}
    assert {m["config"]: m["delta_vs_dense"] for m in got["by_length"]} == {"dense": 0.0, "cpe": -0.75}
    depth = {(d["config"], d["depth_from"]): (d["needles"], d["found"]) for d in got["by_depth"]}
    assert depth == {("dense", 0.0): (1, 1.0), ("dense", 0.9): (1, 1.0), ("cpe", 0.0): (1, 0.0), ("cpe", 0.9): (1, 1.0)}
    md = (out.parent / "ruler_qwen1.5b.md").read_text()
    assert "| niah_single_2 | 4096 | 2 | 1.000 | 0.500 |" in md and "gsm8k" not in md


def test_prefill_saved_vs_dense(run, tmp_path) -> None:
    """dense 2.0 s, cpe 1.5 s on the same task and length: 25 % saved; a row without the time shows —
    and leaves the saving unknown."""
    results, data = run
    out = tmp_path / "r"
    assert ruler_report.main(["--results", str(results), "--data-dir", str(data), "--out", str(out)]) == 0
    got = json.loads(out.with_name("r.json").read_text())
    rows = {(r["config"], r["task"]): (r["prefill_seconds"], r["prefill_saved"]) for r in got["rows"]}
    assert rows[("cpe", "niah_single_2")] == (1.5, pytest.approx(0.25))
    assert rows[("dense", "niah_single_2")] == (2.0, 0.0)
    assert rows[("dense", "vt")] == (None, None) and rows[("cpe", "vt")] == (0.5, None)
    means = {m["config"]: (m["prefill_seconds"], m["prefill_saved"]) for m in got["by_length"]}
    assert means == {"dense": (None, None), "cpe": (2.0, None)}  # dense's vt time unknown: no sum, no saving
    md = out.with_name("r.md").read_text()
    assert "Prefill time, s (saved vs dense)" in md
    assert "| niah_single_2 | 4096 | 2.00 (0.0 %) | 1.50 (25.0 %) |" in md
    assert "| vt | 4096 | — | 0.50 |" in md


def test_prefill_saving_needs_the_same_examples_and_a_dense_row() -> None:
    rows = [_row("dense", "ruler_vt_4096", 1.0, 4, prefill=2.0), _row("cpe", "ruler_vt_4096", 1.0, 2, prefill=0.5),
            _row("dense", "ruler_vt_8192", 1.0, 2, prefill=4.0), _row("cpe", "ruler_vt_8192", 1.0, 2, prefill=1.0)]
    summary = ruler_report.summarize(rows, [])
    saved = {(r["config"], r["length"]): r["prefill_saved"] for r in summary["rows"]}
    assert saved[("cpe", 4096)] is None  # 2 examples against dense's 4: not comparable
    assert saved[("cpe", 8192)] == pytest.approx(0.75)
    by_length = {(m["config"], m["length"]): m["prefill_saved"] for m in summary["by_length"]}
    assert by_length[("cpe", 4096)] is None and by_length[("cpe", 8192)] == pytest.approx(0.75)
    assert all(r["prefill_saved"] is None for r in ruler_report.summarize(rows, [], dense_config="full")["rows"])
    assert ruler_report.prefill_saved(1.0, 0.0) is None and ruler_report.prefill_saved(None, 2.0) is None


def test_no_prefill_saving_for_a_config_that_runs_the_dense_prefill() -> None:
    """cis-lb (PSAW and ETF off) ran the dense prefill: its shorter time (here the dense row's warm-up)
    is not a saving; a PSAW config that prunes prefill keeps its saving, one pruning only decode does not."""
    off = {"psaw": {"enabled": False, "phases": ["prefill", "decode"]}, "etf": {"enabled": False}}
    psaw = {"psaw": {"enabled": True, "phases": ["prefill", "decode"]}, "etf": {"enabled": False}}
    decode_only = {"psaw": {"enabled": True, "phases": ["decode"]}, "etf": {"enabled": False}}
    rows = [{**_row("dense", "ruler_vt_4096", 1.0, 2, prefill=2.0), "prhs_config": off},
            {**_row("cis-lb", "ruler_vt_4096", 1.0, 2, prefill=0.5), "prhs_config": off},
            {**_row("cpe", "ruler_vt_4096", 1.0, 2, prefill=1.0), "prhs_config": psaw},
            {**_row("psaw-decode", "ruler_vt_4096", 1.0, 2, prefill=1.0), "prhs_config": decode_only}]
    summary = ruler_report.summarize(rows, [])
    saved = {r["config"]: r["prefill_saved"] for r in summary["rows"]}
    assert saved == {"dense": 0.0, "cis-lb": None, "cpe": pytest.approx(0.5), "psaw-decode": None}
    assert {m["config"]: m["prefill_saved"] for m in summary["by_length"]} == saved
    md = ruler_report.render_markdown(summary, {})
    assert "| vt | 4096 | 2.00 (0.0 %) | 0.50 | 1.00 (50.0 %) | 1.00 |" in md


def test_a_run_without_ruler_rows_is_an_error(tmp_path) -> None:
    results = tmp_path / "acc.json"
    results.write_text(json.dumps({"meta": {}, "rows": [_row("dense", "gsm8k_cot", 0.5, 3)]}))
    with pytest.raises(SystemExit, match="no RULER row"):
        ruler_report.main(["--results", str(results), "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")])


def test_several_reports_side_by_side_and_a_repeated_cell_is_an_error(run, tmp_path) -> None:
    """A config run later (its own report and samples) joins the table of an earlier run; each run's
    command is listed; the same config and task in two reports is refused."""
    results, data = run
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"meta": {"command": "run_accuracy.py --configs cis-lb", "model": "m"},
                                 "rows": [_row("cis-lb", "ruler_niah_single_2_4096", 1.0, 2, 0.1)]}))
    with gzip.open(tmp_path / "later.samples.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps({"config": "cis-lb", "task": "ruler_niah_single_2_4096", "index": i,
                                  "generation": g}) + "\n" for i, g in enumerate(("1234", "0000")))
    out = tmp_path / "both"
    assert ruler_report.main(["--results", str(results), str(later), "--data-dir", str(data), "--out", str(out)]) == 0
    md = (out.parent / "both.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| task | length | n |"))
    columns = [c.strip() for c in header.strip("|").split("|")][3:]
    assert sorted(columns) == ["cis-lb", "cpe", "dense"]
    scores = {"dense": "1.000", "cpe": "0.500", "cis-lb": "1.000"}
    assert "| niah_single_2 | 4096 | 2 | " + " | ".join(scores[c] for c in columns) + " |" in md
    assert "`run_accuracy.py …`" in md and "`run_accuracy.py --configs cis-lb`" in md
    report = json.loads((out.parent / "both.json").read_text())
    hits = [d for d in report["by_depth"] if d["config"] == "cis-lb"]
    assert hits and sum(d["needles"] for d in hits) == 2 and sum(d["found"] * d["needles"] for d in hits) == 1
    with pytest.raises(SystemExit, match="dense / ruler_niah_single_2_4096 is also in"):
        ruler_report.main(["--results", str(results), str(results), "--data-dir", str(data), "--out", str(out)])


def test_a_config_on_fewer_tasks_is_compared_with_dense_on_the_same_cells() -> None:
    """Means over different task sets are not comparable: a config run on one of dense's two tasks
    gets dense's score on that task beside its own, and none where dense ran other examples."""
    rows = [_row("dense", "ruler_vt_4096", 1.0, 15), _row("dense", "ruler_fwe_4096", 0.4, 15),
            _row("quest-lb", "ruler_fwe_4096", 0.5, 15), _row("h2o-lb", "ruler_vt_4096", 0.9, 25)]
    means = {m["config"]: m for m in ruler_report.summarize(rows, [])["by_length"]}
    assert means["dense"]["mean_score"] == pytest.approx(0.7) and means["quest-lb"]["mean_score"] == 0.5
    assert means["quest-lb"]["dense_same_tasks"] == pytest.approx(0.4)
    assert means["quest-lb"]["delta_vs_dense"] == pytest.approx(0.1)  # not 0.5 - 0.7
    assert means["h2o-lb"]["dense_same_tasks"] is None and means["h2o-lb"]["delta_vs_dense"] is None
