"""scripts/run_accuracy.py on a tiny random llama and local rows: the table, telemetry per row,
not-implemented selectors, --resume and --max-seconds, and the lm-eval engine; the GPU bundle plan."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lm_eval_fixtures import COQA_ROWS, GSM8K_ROWS, save_tiny_checkpoint, write_local_data
from prhs_hf.accuracy import configs as accuracy_configs
from prhs_hf.accuracy import direct
from prhs_hf.lm_eval import metrics, prompts

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


run_accuracy = _load_script("run_accuracy")
pack_for_gpu = _load_script("pack_for_gpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_local_data(tmp_path_factory.mktemp("data"))


@pytest.fixture()
def small_budget(monkeypatch) -> str:
    """A registered config with a budget small enough for the short test prompts."""
    config = accuracy_configs.NamedConfig("cis-tiny", "cis",
                                          {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4}})
    monkeypatch.setitem(accuracy_configs.ACCURACY_CONFIGS, config.name, config)
    return config.name


def _args(checkpoint: Path, data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(checkpoint), "--data-dir", str(data_dir), "--out", str(out), "--device", "cpu",
            "--batch-size", "2", "--max-new-tokens", "6", *extra]


def test_direct_engine_table(checkpoint, data_dir, tmp_path, small_budget, monkeypatch) -> None:
    import prhs_hf.runtime

    def not_yet(resolved, num_heads):
        raise NotImplementedError(f"baseline selector {resolved.config.baseline.name!r} is not implemented yet")

    monkeypatch.setattr(prhs_hf.runtime, "make_selector", not_yet)
    out = tmp_path / "acc.json"
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--configs", f"dense,{small_budget},quest",
                                   "--save-samples")) == 0
    report = json.loads(out.read_text())
    rows = {(r["config"], r["task"]): r for r in report["rows"]}
    assert set(rows) == {(c, t) for c in ("dense", small_budget, "quest") for t in ("gsm8k", "coqa")}
    for task, n, names in (("gsm8k", len(GSM8K_ROWS), {"strict-match", "flexible-extract"}),
                           ("coqa", len(COQA_ROWS), {"em", "f1"})):
        dense, sparse = rows[("dense", task)], rows[(small_budget, task)]
        assert dense["status"] == sparse["status"] == "ok" and dense["n"] == sparse["n"] == n
        assert set(dense["metrics"]) == set(sparse["metrics"]) == names
        assert dense["rho_hat"] is None and dense["processed_kv_per_step"] == dense["dense_kv_per_step"]
        assert 0 < sparse["rho_hat"] <= 1 and sparse["processed_kv_per_step"] < sparse["dense_kv_per_step"]
        assert sparse["prhs_config"]["budget"]["topk"] == 16 and sparse["telemetry"]["sparse_steps"] > 0
        assert rows[("quest", task)]["status"] == "not implemented"
    assert report["meta"]["environment"]["versions"]["transformers"]
    table = out.with_suffix(".md").read_text()
    assert "| quest | gsm8k |" in table and "not implemented" in table and "ρ̂" in table and "--configs" in table
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * (len(GSM8K_ROWS) + len(COQA_ROWS))

    # --resume keeps the finished rows and reruns only the rest (here: quest, still not implemented)
    before = {k: r["seconds"] for k, r in rows.items() if r["status"] == "ok"}
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--configs", f"dense,{small_budget},quest",
                                   "--resume")) == 0
    first_command = report["meta"]["command"]
    resumed = json.loads(out.read_text())
    again = {(r["config"], r["task"]): r for r in resumed["rows"]}
    assert {k: again[k]["seconds"] for k in before} == before
    assert before and all(rows[k]["date"] for k in before)  # each row says when it finished, and keeps it
    assert {k: again[k]["date"] for k in before} == {k: rows[k]["date"] for k in before}
    # the table says which runs made it: the first run's command is kept, the resuming one is the meta's own
    assert [r["command"] for r in resumed["meta"]["earlier_runs"]] == [first_command]
    assert "--resume" in resumed["meta"]["command"] and f"resumed from: `{first_command}`" in out.with_suffix(".md").read_text()
    assert again[("quest", "gsm8k")]["status"] == "not implemented"


def test_gsm8k_cot_prompt_has_the_eight_exemplars_and_stops_at_q(checkpoint, monkeypatch) -> None:
    """``--tasks gsm8k_cot``: lm-eval's 8-shot ``gsm8k-cot`` prompt without chat template, generation
    stopped at ``Q:`` and cut there before scoring (else the next question's numbers are extracted)."""
    from transformers import AutoTokenizer

    task = direct.DIRECT_TASKS["gsm8k_cot"]
    assert (task.dataset, task.chat, task.max_new_tokens, task.lm_eval_task) == ("gsm8k", False, 256, "gsm8k_cot_local")
    assert task.until == ("Q:", "</s>", "<|im_end|>")
    doc = GSM8K_ROWS[0]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)  # has a chat template: it must not be applied
    text = direct.build_prompt(tokenizer, task, doc)
    blocks = text.split("\n\n")
    assert len(blocks) == 9 and blocks[-1] == f"Q: {doc['question']}\nA:"
    for block, shot in zip(blocks, prompts.GSM8K_COT_EXEMPLARS):
        assert block == f"Q: {shot['question']}\nA: {shot['target']}"
        assert block.startswith("Q: ") and block.count("\nA: ") == 1 and block.endswith(".")
    assert [metrics.extract_answer(s["target"], metrics.GSM8K_COT_STRICT)
            for s in prompts.GSM8K_COT_EXEMPLARS] == ["6", "5", "39", "8", "9", "29", "33", "8"]
    assert blocks[0].startswith("Q: There are 15 trees in the grove.") and "<|im_start|>" not in text

    # stop: as soon as a stop string appears; cut before the first one, as lm-eval's until
    finished = task.finished()
    assert not finished("Tom has 3 + 4 = 7 apples. The answer is 7.\n\n")
    assert finished("The answer is 7.\n\nQ:") and finished("The answer is 7.</s>")
    assert task.cut("3 + 4 = 7. The answer is 7.\n\nQ: A box holds 12 eggs.\nA:") == "3 + 4 = 7. The answer is 7.\n\n"

    seen = {}

    def fake_generate(model, tok, texts, max_new_tokens, done=None):
        seen.update(texts=texts, max_new_tokens=max_new_tokens, done=done)
        return ["3 + 4 = 7. The answer is 7.\n\nQ: A box holds 12 eggs. How many in 5 boxes?\nA: 60"], 30

    monkeypatch.setattr(direct, "generate", fake_generate)
    result = direct.evaluate(SimpleNamespace(device=torch.device("cpu")), tokenizer, task, [doc], batch_size=1)
    assert seen["texts"] == [text] and seen["max_new_tokens"] == 256 and seen["done"]("x\nQ:")
    (sample,) = result.samples
    assert sample["generation"] == "3 + 4 = 7. The answer is 7.\n\n"
    assert sample["scores"] == {"strict-match": 1.0, "flexible-extract": 1.0}


def test_gsm8k_cot_direct_rows(checkpoint, data_dir, tmp_path, small_budget) -> None:
    """End to end on the tiny model: the few-shot prompt is long (over 2000 byte tokens), and decodes sparsely."""
    out = tmp_path / "acc.json"
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--tasks", "gsm8k_cot", "--configs",
                                   f"dense,{small_budget}", "--limit", "2", "--save-samples")) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", small_budget}
    for row in rows.values():
        assert row["task"] == "gsm8k_cot" and row["status"] == "ok" and row["n"] == 2
        assert set(row["metrics"]) == {"strict-match", "flexible-extract"}
    assert 0 < rows[small_budget]["rho_hat"] <= 1
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["prompt_tokens"] > 2000 for s in samples)
    assert not any(stop in s["generation"] for s in samples for stop in prompts.GSM8K_COT_STOP)


def test_max_seconds_leaves_rows_for_resume(checkpoint, data_dir, tmp_path) -> None:
    out = tmp_path / "acc.json"
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--configs", "dense", "--tasks", "coqa",
                                   "--max-seconds", "0")) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == [] and report["meta"]["remaining"] == ["dense/coqa"]


def test_lm_eval_engine_row(checkpoint, data_dir, tmp_path, small_budget) -> None:
    pytest.importorskip("lm_eval")
    out = tmp_path / "acc.json"
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--engine", "lm-eval", "--configs", small_budget,
                                   "--tasks", "gsm8k", "--limit", "2")) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["n"] == 2 and set(row["metrics"]) == {"strict-match", "flexible-extract"}
    assert 0 < row["rho_hat"] <= 1


def test_unknown_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown config"):
        accuracy_configs.named_config("cis-s99")
    assert accuracy_configs.named_config("my/own.yaml").name == "own"
    for name in accuracy_configs.DEFAULT_CONFIGS:  # every registered config is valid
        assert accuracy_configs.load_named_config(accuracy_configs.named_config(name)).telemetry.enabled


def test_hshare_rows_are_the_papers_two_settings() -> None:
    assert "hshare" not in accuracy_configs.ACCURACY_CONFIGS
    for name, rho in (("hshare-1", 0.281), ("hshare-2", 0.125)):
        cfg = accuracy_configs.load_named_config(accuracy_configs.named_config(name))
        b = cfg.baseline
        assert b.name == "hshare" and (cfg.budget.sink, cfg.budget.local, cfg.budget.topk) == (8, 32, 88)
        kept = (1 - b.share_ratio) * (1 - b.head_share_ratio) * (1 - b.layer_share_ratio)
        assert kept == pytest.approx(rho, abs=5e-4)


def _fake_pack(root: Path, n: int) -> tuple[Path, list[Path], list[Path]]:
    """``n`` pieces of a model ``m`` with their manifest, data and wheel folders, laid out as in ``.xfer``."""
    folder = root / ".xfer" / "models" / "m"
    folder.mkdir(parents=True)
    pieces = []
    for i in range(n):
        piece = folder / f"m.gguf.{i:03d}"
        piece.write_bytes(bytes([i]) * 1000)
        pieces.append(piece)
    manifest = folder / "MANIFEST.json"
    manifest.write_text(json.dumps({"name": "m.gguf", "pieces": [
        {"file": p.name, "size": 1000, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in pieces]}))
    (folder / "m.gguf.sha256").write_text("0" * 64 + "  m.gguf\n")
    for sub in ("data", "whl"):
        (root / ".xfer" / sub).mkdir()
        (root / ".xfer" / sub / f"{sub}.txt").write_text(sub)
    small = [root / ".xfer" / "data", root / ".xfer" / "whl", manifest, folder / "m.gguf.sha256"]
    return manifest, pieces, small


def test_gpu_plan_carries_one_piece_per_call() -> None:
    repo = pack_for_gpu.REPO
    folder = repo / ".xfer" / "models" / "m"
    pieces = [folder / f"m.gguf.{i:03d}" for i in range(3)]
    small = [repo / ".xfer" / "data", repo / ".xfer" / "whl", folder / "MANIFEST.json", folder / "m.gguf.sha256"]
    calls = pack_for_gpu.plan_calls("m", folder / "MANIFEST.json", pieces, small, ["--limit", "5"])
    m = ".xfer/models/m/"
    assert [c.carry for c in calls] == [
        [".xfer/data", ".xfer/whl", m + "MANIFEST.json", m + "m.gguf.sha256", m + "m.gguf.000"],
        [m + "m.gguf.001"], [m + "m.gguf.002"]]
    # carried paths are gone in the next call: each call stages what it carries outside the tree
    assert "cp -r .xfer/data .xfer/whl /tmp/" in calls[0].command
    assert f"{m}MANIFEST.json {m}m.gguf.sha256 {m}m.gguf.000 /tmp/pieces/m/" in calls[0].command
    assert f"cp {m}m.gguf.001 /tmp/pieces/m/" in calls[1].command
    assert "piece 2/3 ok" in calls[1].command and "gpu_join_and_eval" not in calls[1].command
    # the last call stages the last piece, then joins, exports and evaluates, with the default configs named
    default = ",".join(accuracy_configs.DEFAULT_CONFIGS)
    assert "hshare-1" in default and "hshare-2" in default
    assert calls[-1].command.endswith(f"bash scripts/gpu_join_and_eval.sh m --configs '{default}' --limit 5")
    assert calls[-1].timeout_s == 600
    resume = pack_for_gpu.resume_call("m", ["--limit", "5"])
    assert resume.carry == [] and resume.command == f"bash scripts/gpu_join_and_eval.sh m --configs '{default}' --limit 5"
    plan = pack_for_gpu.render_plan("m", calls, resume)
    assert "R. run(" in plan and "gpu_join_and_eval.sh m --configs" in plan
    assert all(len(c.command) < pack_for_gpu.MAX_COMMAND_CHARS for c in [*calls, resume])


def test_gpu_plan_keeps_given_configs_and_fits_one_piece_in_one_call() -> None:
    folder = pack_for_gpu.REPO / ".xfer" / "models" / "m"
    calls = pack_for_gpu.plan_calls("m", folder / "MANIFEST.json", [folder / "m.gguf.000"],
                                    [folder / "MANIFEST.json"], ["--configs=dense", "--limit", "5"])
    assert len(calls) == 1 and calls[0].carry == [".xfer/models/m/MANIFEST.json", ".xfer/models/m/m.gguf.000"]
    assert "piece 1/1 ok" in calls[0].command
    assert calls[0].command.endswith("bash scripts/gpu_join_and_eval.sh m --configs=dense --limit 5")


def test_gpu_plan_stages_across_calls_that_lose_their_carry(tmp_path, monkeypatch) -> None:
    """Run the piece calls as the device does: each call's tree holds only what it carries."""
    src = tmp_path / "here"
    manifest, pieces, small = _fake_pack(src, 3)
    monkeypatch.setattr(pack_for_gpu, "REPO", src)
    monkeypatch.setattr(pack_for_gpu, "STAGE", str(tmp_path / "stage"))
    calls = pack_for_gpu.plan_calls("m", manifest, pieces, small, [])

    def run(call):
        there = tmp_path / "there"
        shutil.rmtree(there, ignore_errors=True)
        for rel in call.carry:
            dst = there / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (src / rel).is_dir() else shutil.copy)(src / rel, dst)
        command = call.command.split(" && bash scripts/gpu_join_and_eval.sh")[0]  # stop before the evaluation
        return subprocess.run(["bash", "-c", command], cwd=there, capture_output=True, text=True)

    for i, call in enumerate(calls, 1):
        r = run(call)
        assert r.returncode == 0, r.stderr
        assert f"piece {i}/3 ok" in r.stdout
    staged = tmp_path / "stage"
    assert sorted(p.name for p in (staged / "pieces" / "m").iterdir()) == sorted(
        ["MANIFEST.json", "m.gguf.sha256"] + [p.name for p in pieces])
    assert (staged / "data" / "data.txt").is_file() and (staged / "whl" / "whl.txt").is_file()
    # a machine that started afresh has nothing staged: a piece call says so and fails
    shutil.rmtree(staged)
    r = run(calls[1])
    assert r.returncode == 1 and "start again at call 1" in r.stdout
    # a corrupted piece fails its check
    shutil.rmtree(tmp_path / "there")
    assert run(calls[0]).returncode == 0
    pieces[1].write_bytes(b"x" * 1000)
    assert run(calls[1]).returncode == 1


def test_gpu_join_script_runs_inline_python_without_the_cwd_on_sys_path() -> None:
    """From the repository root, the checkout's prhs_hf/ (no kernels/) must not shadow the assembled package."""
    text = (SCRIPTS / "gpu_join_and_eval.sh").read_text()
    assert 'PY="python3 -P"' in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "python3 -c" in line or "python3 -m" in line]
    assert [line for line in code if "python3 " in line and "-P" not in line] == [
        "python3 scripts/run_accuracy.py --engine direct --model \"$CKPT\" --device cuda --batch-size 256 --save-samples \\"]
