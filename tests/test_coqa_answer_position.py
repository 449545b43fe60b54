"""scripts/coqa_answer_position.py: where a CoQA answer sits in the prompt, and EM per bucket."""

from __future__ import annotations

import gzip
import json

from script_loader import load_script
from lm_eval_fixtures import COQA_ROWS, write_local_data
from prhs_hf.evaluation.lm_eval.prompts import coqa_prompt

cap = load_script("coqa_answer_position")


def test_answer_position_is_the_earliest_gold_in_the_story_over_the_prompt_length() -> None:
    s1, s2, s3 = COQA_ROWS
    # s1's last answer "in a barn" and its extras "a barn", "barn": "in a barn" starts first
    assert cap.answer_position(s1, 4) == s1["story"].index("in a barn") / len(coqa_prompt(s1))
    # s2's "ninety" / "ninety steps" are in the story; "90" is shorter than min_chars and not searched
    assert cap.answer_position(s2, 4) == s2["story"].index("ninety") / len(coqa_prompt(s2))
    assert cap.answer_position(s3, 4) == s3["story"].lower().index("tomatoes") / len(coqa_prompt(s3))
    assert cap.answer_position(s3, 9) is None  # every gold answer is shorter: not searched


def test_buckets() -> None:
    edges = [0.15, 0.3]
    assert cap.bucket_names(edges) == ["[0.00, 0.15)", "[0.15, 0.30)", "[0.30, 1.00]", "not found"]
    assert [cap.bucket_of(p, edges) for p in (0.0, 0.1499, 0.15, 0.29, 0.3, 1.0, None)] == [0, 0, 1, 1, 2, 2, 3]


def test_table_from_samples(tmp_path) -> None:
    data = write_local_data(tmp_path / "data")
    samples = [{"config": c, "task": "coqa", "index": i, "scores": {"em": em, "f1": em}}
               for c, ems in (("a", (1.0, 0.0, 1.0)), ("b", (0.0, 0.0, 1.0))) for i, em in enumerate(ems)]
    samples.append({"config": "a", "task": "gsm8k", "index": 0, "scores": {"flexible-extract": 1.0}})  # ignored
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps(s) + "\n" for s in samples)
    out = tmp_path / "pos.json"
    assert cap.main(["--samples", str(path), "--data-dir", str(data), "--edges", "0.5", "--min-chars", "9",
                     "--out", str(out)]) == 0
    rows = {(r["config"], r["bucket"]): r for r in json.loads(out.read_text())["rows"]}
    # min_chars 9: only s1's "in a barn" and s2's "the old lighthouse"/"ninety steps" are searched; s3 is not found
    positions = [cap.answer_position(d, 9) for d in COQA_ROWS]
    assert positions[0] is not None and positions[1] is not None and positions[2] is None
    early = [i for i, p in enumerate(positions[:2]) if p < 0.5]
    assert rows[("a", "not found")]["n"] == 1 and rows[("a", "not found")]["em"] == 1.0
    assert rows[("a", "[0.00, 0.50)")]["n"] == len(early)
    assert rows[("b", "[0.00, 0.50)")]["em"] == (0.0 if early else None)
    assert "| a |" in out.with_suffix(".md").read_text()


def test_early_answer_ablation_script(tmp_path) -> None:
    """scripts/coqa_early_answer_ablation.py on a tiny random llama: picks the early-answer examples
    (by answer_position) and writes one row per config with per-example scores."""
    from lm_eval_fixtures import save_tiny_checkpoint

    ablation = load_script("coqa_early_answer_ablation")
    data = write_local_data(tmp_path / "data")
    out = tmp_path / "abl.json"
    assert ablation.main(["--model", str(save_tiny_checkpoint(tmp_path / "tiny")), "--data-dir", str(data),
                          "--configs", "dense,cpe", "--max-position", "0.4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    expected = [i for i, d in enumerate(COQA_ROWS) if (p := cap.answer_position(d, 4)) is not None and p < 0.4]
    assert expected and report["meta"]["indices"] == expected
    assert [r["config"] for r in report["rows"]] == ["dense", "cpe"]
    assert all(r["n"] == len(expected) and [s["index"] for s in r["samples"]] == expected for r in report["rows"])
