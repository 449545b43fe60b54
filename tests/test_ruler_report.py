"""scripts/ruler_report.py on a synthetic run: the table per task and length, the means, and needle
recall by depth recomputed from the saved generations and the prepared rows' depths."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ruler_report", REPO / "scripts" / "ruler_report.py")
ruler_report = importlib.util.module_from_spec(spec)
sys.modules["ruler_report"] = ruler_report
spec.loader.exec_module(ruler_report)


def _row(config: str, task: str, score: float, n: int, rho=None) -> dict:
    return {"config": config, "task": task, "status": "ok", "metrics": {"string_match_all": score}, "n": n,
            "seconds": 10.0, "rho_hat": rho, "processed_kv_per_step": 100.0, "dense_kv_per_step": 4000.0}


@pytest.fixture()
def run(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    docs = [{"task": "niah_single_2", "index": 0, "input": "…", "outputs": ["1234"], "depths": [0.05]},
            {"task": "niah_single_2", "index": 1, "input": "…", "outputs": ["5678"], "depths": [0.95]}]
    (data / "ruler_niah_single_2_4096.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (data / "ruler_vt_4096.jsonl").write_text(json.dumps({"task": "vt", "input": "…", "outputs": ["X"]}) + "\n")
    rows = [_row("dense", "ruler_niah_single_2_4096", 1.0, 2), _row("cpe", "ruler_niah_single_2_4096", 0.5, 2, 0.2),
            _row("dense", "ruler_vt_4096", 1.0, 1), _row("cpe", "ruler_vt_4096", 0.0, 1, 0.2),
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
    depth = {(d["config"], d["depth_from"]): (d["needles"], d["found"]) for d in got["by_depth"]}
    assert depth == {("dense", 0.0): (1, 1.0), ("dense", 0.9): (1, 1.0), ("cpe", 0.0): (1, 0.0), ("cpe", 0.9): (1, 1.0)}
    md = (out.parent / "ruler_qwen1.5b.md").read_text()
    assert "| niah_single_2 | 4096 | 2 | 1.000 | 0.500 |" in md and "gsm8k" not in md


def test_a_run_without_ruler_rows_is_an_error(tmp_path) -> None:
    results = tmp_path / "acc.json"
    results.write_text(json.dumps({"meta": {}, "rows": [_row("dense", "gsm8k_cot", 0.5, 3)]}))
    with pytest.raises(SystemExit, match="no RULER row"):
        ruler_report.main(["--results", str(results), "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")])
