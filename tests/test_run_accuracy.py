"""scripts/run_accuracy.py on a tiny random llama and local rows: the table, telemetry per row,
not-implemented selectors, --resume and --max-seconds, and the lm-eval engine; the GPU bundle plan."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from script_loader import load_script
from lm_eval_fixtures import COQA_ROWS, GSM8K_ROWS, checkpoint, data_dir  # noqa: F401 (fixtures)
import prhs_hf
from prhs_hf.evaluation.accuracy import configs as accuracy_configs
from prhs_hf.evaluation.accuracy import direct
from prhs_hf.evaluation.lm_eval import metrics, prompts

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


run_accuracy = load_script("run_accuracy")
pack_for_gpu = load_script("pack_for_gpu", REPO / "tools")  # its own folder (gpu_transfer.py) first, as when it runs


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

    real = prhs_hf.runtime.make_selector

    def not_yet(resolved, *args, **kwargs):  # a baseline that is "not implemented yet"; CIS as it is
        if resolved.config.baseline.name is None:
            return real(resolved, *args, **kwargs)
        raise NotImplementedError(f"baseline selector {resolved.config.baseline.name!r} is not implemented yet")

    monkeypatch.setattr(prhs_hf.runtime, "make_selector", not_yet)
    monkeypatch.setenv("PRHS_GIT_COMMIT", "abc1234")
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
        assert sparse["prhs_config"]["budget"]["topk"] == 16 and sparse["telemetry"]["sparse_sequence_steps"] > 0
        assert rows[("quest", task)]["status"] == "not implemented"
        for row in (dense, sparse):  # the prefill is part of the row's time; the failed row has none
            assert 0 < row["prefill_seconds"] < row["seconds"] and row["prompt_tokens"] > 0
        assert dense["prompt_tokens"] == sparse["prompt_tokens"]
        assert rows[("quest", task)]["prefill_seconds"] is None
    assert report["meta"]["environment"]["versions"]["transformers"]
    assert report["meta"]["commit"] == "abc1234"  # which code made the rows (PRHS_GIT_COMMIT, else git)
    table = out.with_suffix(".md").read_text()
    assert "; commit abc1234" in table
    assert "| quest | gsm8k |" in table and "not implemented" in table and "ρ̂" in table and "--configs" in table
    assert "| prefill (s) | status |" in table
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
    assert [r["commit"] for r in resumed["meta"]["earlier_runs"]] == ["abc1234"]
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
        return direct.Generation(["3 + 4 = 7. The answer is 7.\n\nQ: A box holds 12 eggs. How many in 5 boxes?\nA: 60"],
                                 30, 0.25, 800)

    monkeypatch.setattr(direct, "generate", fake_generate)
    result = direct.evaluate(SimpleNamespace(device=torch.device("cpu")), tokenizer, task, [doc], batch_size=1)
    assert seen["texts"] == [text] and seen["max_new_tokens"] == 256 and seen["done"]("x\nQ:")
    assert (result.prefill_seconds, result.prompt_tokens) == (0.25, 800)
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


def test_a_row_of_a_task_not_run_yet_is_estimated_from_the_others() -> None:
    """--max-seconds must not count 0 s for a task not run yet: a long RULER row started with too little
    time left is killed with the call before its results are saved."""
    est = run_accuracy.estimate_seconds
    assert est("ruler_vt_32768", {}) == 0.0  # nothing measured: the first row always runs
    assert est("ruler_vt_16384", {"ruler_vt_16384": 20.0, "ruler_cwe_16384": 30.0}) == 20.0  # its own rows
    longest = {"ruler_niah_single_1_16384": 23.0, "ruler_cwe_8192": 10.0}  # scaled: 46 and 40 s
    assert est("ruler_niah_single_3_32768", longest) == pytest.approx(run_accuracy.UNSEEN_MARGIN * 46.0)
    assert est("coqa", {"gsm8k_cot": 40.0, "ruler_vt_4096": 10.0}) == pytest.approx(run_accuracy.UNSEEN_MARGIN * 40.0)
    assert est("ruler_vt_8192", {"gsm8k_cot": 40.0}) == pytest.approx(run_accuracy.UNSEEN_MARGIN * 40.0)


def test_lm_eval_engine_row(checkpoint, data_dir, tmp_path, small_budget) -> None:
    pytest.importorskip("lm_eval")
    out = tmp_path / "acc.json"
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--engine", "lm-eval", "--configs", small_budget,
                                   "--tasks", "gsm8k", "--limit", "2")) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["n"] == 2 and set(row["metrics"]) == {"strict-match", "flexible-extract"}
    assert 0 < row["rho_hat"] <= 1
    assert row["prefill_seconds"] is None  # lm-eval's generate is not timed per prefill


def test_unknown_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown config"):
        accuracy_configs.named_config("cis-s99")
    assert accuracy_configs.named_config("my/own.yaml").name == "own"
    assert accuracy_configs.named_config("cis_longbench") == accuracy_configs.NamedConfig("cis_longbench", "cis_longbench")


def test_the_names_of_the_result_tables_load_wherever_a_config_is_named() -> None:
    """The rows of the accuracy and RULER tables are named by these configs: each loads by its name."""
    cis_s8 = accuracy_configs.load_any_config("cis-s8")
    assert cis_s8.cis.block_size == 8 and not cis_s8.telemetry.enabled  # telemetry as the config says
    assert accuracy_configs.load_any_config("cis-lb", {"budget": {"topk": 100}}).budget.topk == 100
    assert accuracy_configs.load_any_config("cis_longbench").budget.topk == 4096  # a shipped config
    for name in accuracy_configs.ACCURACY_CONFIGS:
        accuracy_configs.load_any_config(name)
    with pytest.raises(ValueError, match="named configs of the result tables: dense, cis-s8.*bench_e2e_decode"):
        accuracy_configs.load_any_config("cpe-s16-share")
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


def test_long_context_baselines_are_the_baselines_at_cis_lb_budget() -> None:
    """The RULER table's baseline and seed-selector rows: each as configured for the 128-key rows, at
    cis-lb's 64/256/4096 budget; not in the default set (short prompts fit that budget whole)."""
    ac = accuracy_configs
    lb = ac.load_named_config(ac.named_config("cis-lb")).budget
    assert {"es-cis", "es-quest", "cis-tail", "cis-group", "cis-union"} <= set(ac.LONG_CONTEXT_BASELINES)
    for name in ac.LONG_CONTEXT_BASELINES:
        short, long = (ac.load_named_config(ac.named_config(n)) for n in (name, f"{name}-lb"))
        assert long.budget == lb != short.budget
        assert (long.baseline, long.cis, long.early_select, long.backend) == (
            short.baseline, short.cis, short.early_select, short.backend)
        union = long.backend.sparse_attention == "group_union"  # a speed variant: per-head attention's output
        indexed = long.cis.index != "none"  # a speed variant too, off by default
        assert (long.baseline.name is not None or long.cis.tail_slot or long.early_select.enabled
                or long.cis.selection == "group" or union or indexed)
        # the accuracy table's default rows: not a speed variant, whose accuracy is its per_head twin's
        assert f"{name}-lb" not in ac.DEFAULT_CONFIGS and (name in ac.DEFAULT_CONFIGS) != (union or indexed)
    ds = ac.load_named_config(ac.named_config("ds-cal-lb"))
    shipped = prhs_hf.load_config("ds_qwen2.5-coder-1.5b")
    assert ds.budget == lb and ds.baseline == shipped.baseline and ds.baseline.label_channels.endswith(".pt")


def test_key_index_configs_are_cis_s16_with_only_the_index_changed() -> None:
    """``cis-fp8`` / ``cis-fp8-m512`` / ``cis-int4`` / ``cis-pages`` (issue 38's candidates, for ``prhs-hf
    bench`` and the accuracy runs): ``cis-s16`` with ``cis.index`` set and the shipped margin (``-m512``:
    512); nothing else differs."""
    from prhs_hf.evaluation.speed_map import prhs_config

    ac = accuracy_configs
    base = ac.load_any_config("cis-s16")
    assert base.cis.index == "none"
    for name, index, margin in (("cis-fp8", "fp8", 128), ("cis-fp8-m512", "fp8", 512), ("cis-int4", "int4", 128),
                                ("cis-pages", "pages", 128)):
        cfg = ac.load_any_config(name)
        assert cfg.cis.index == index and cfg.cis.rerank_margin == margin and base.cis.rerank_margin == 128
        assert dataclasses.replace(cfg.cis, index="none", rerank_margin=128) == base.cis
        assert dataclasses.replace(cfg, cis=base.cis) == base and name not in ac.DEFAULT_CONFIGS
        assert ac.load_any_config(f"{name}-lb").cis.index == index
        assert ac.load_any_config(*prhs_config(f"{name}/sparse")).policy.decode == "sparse"


def test_cis_union_lb_is_cis_longbench_reading_group_unions() -> None:
    """``cis-union-lb``: the shipped default with backend.sparse_attention: group_union, for the speed map
    (``prhs-hf bench --configs cis-union-lb/sparse``); nothing else differs from cis_longbench."""
    from prhs_hf.evaluation.speed_map import prhs_config

    ac = accuracy_configs
    union = ac.load_any_config("cis-union-lb")
    shipped = prhs_hf.load_config("cis_longbench")
    assert union.backend.sparse_attention == "group_union" and shipped.backend.sparse_attention == "per_head"
    assert dataclasses.replace(union, backend=shipped.backend) == shipped
    forced = ac.load_any_config(*prhs_config("cis-union-lb/sparse+graphs"))
    assert (forced.policy.decode, forced.backend.eager_step, forced.backend.sparse_attention) == (
        "sparse", "graphs", "group_union")


# The device-call plan of tools/pack_for_gpu.py: the rest of its tests are in tests/test_gpu_transfer.py.


def test_gpu_plan_keeps_given_configs_and_fits_one_piece_in_one_call() -> None:
    folder = pack_for_gpu.REPO / ".xfer" / "models" / "m"
    calls = pack_for_gpu.plan_calls("m", folder / "MANIFEST.json", [folder / "m.gguf.000"],
                                    [folder / "MANIFEST.json"], ["--configs=dense", "--limit", "5"])
    assert len(calls) == 1 and calls[0].carry == [".xfer/models/m/MANIFEST.json", ".xfer/models/m/m.gguf.000"]
    assert "piece 1/1 ok" in calls[0].command
    assert calls[0].command.endswith("gpu_join_and_eval.sh m --configs=dense --limit 5")


def test_batches_bound_the_padded_prompt_tokens() -> None:
    """Long prompts get smaller batches: 32k-token RULER prompts at the GSM8K batch size do not fit a GPU."""
    lengths = [100, 4000, 32000, 16000, 16000, 120, 32000]
    assert direct.batches(lengths, batch_size=4) == [[2, 6, 3, 4], [1, 5, 0]]
    got = direct.batches(lengths, batch_size=4, batch_tokens=40000)
    assert got == [[2], [6], [3, 4], [1, 5, 0]]
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))
    assert direct.batches([50000, 10], batch_size=8, batch_tokens=40000) == [[0], [1]]  # too long: alone
    for bad in ({"batch_size": 0}, {"batch_size": 2, "batch_tokens": 0}):
        with pytest.raises(ValueError, match="batch_"):
            direct.batches(lengths, **bad)


def test_batch_tokens_reaches_the_direct_engine(checkpoint, data_dir, tmp_path, monkeypatch) -> None:
    sizes: list[int] = []
    real = direct.generate

    def counting(model, tokenizer, texts, *args, **kwargs):
        sizes.append(len(texts))
        return real(model, tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(direct, "generate", counting)
    out = tmp_path / "acc.json"
    assert run_accuracy.main(_args(checkpoint, data_dir, out, "--configs", "dense", "--tasks", "coqa", "--limit", "3",
                                   "--batch-tokens", "1")) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["batch_tokens"] == 1 and report["rows"][0]["n"] == 3
    assert sizes == [1, 1, 1]  # --batch-size 2 alone would give [2, 1]


def test_first_logits_clock_reads_the_clock_once_and_changes_nothing(checkpoint) -> None:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    clock = direct.first_logits_clock(model)
    assert clock.first is None
    ids, scores = torch.zeros(2, 3, dtype=torch.long), torch.randn(2, model.config.vocab_size)
    before = time.perf_counter()
    kept = scores.clone()
    assert clock(ids, scores) is scores and torch.equal(scores, kept)
    first = clock.first
    assert first is not None and before <= first <= time.perf_counter()
    assert clock(ids, scores) is scores and clock.first == first  # later tokens do not move it

    # in generate: the same greedy tokens with and without it
    ids = torch.tensor([[5, 9, 17, 33, 2, 8]])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    clocked = direct.first_logits_clock(model)
    timed = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                           logits_processor=LogitsProcessorList([clocked]))
    assert torch.equal(plain, timed) and clocked.first is not None


def test_direct_prefill_time_is_part_of_the_row_time(checkpoint, monkeypatch) -> None:
    """On the tiny model: each batch's prefill is timed, summed over batches, within the row's seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    sizes: list[int] = []
    real = direct.generate

    def spying(model, tokenizer, texts, *args, **kwargs):
        gen = real(model, tokenizer, texts, *args, **kwargs)
        sizes.append(len(texts))
        assert gen.prefill_seconds > 0 and gen.prompt_tokens > 0
        return gen

    task = direct.DIRECT_TASKS["coqa"]
    docs = COQA_ROWS[:3]
    monkeypatch.setattr(direct, "generate", spying)
    result = direct.evaluate(model, tokenizer, task, docs, batch_size=2, max_new_tokens=8)
    assert sizes == [2, 1]
    assert 0 < result.prefill_seconds < result.seconds
    # real prompt tokens (the left padding of the first batch not counted)
    assert result.prompt_tokens == sum(s["prompt_tokens"] for s in result.samples)


def test_row_prefill_round_trips_and_old_rows_load(tmp_path) -> None:
    from prhs_hf.evaluation.accuracy import report

    timed = report.Row.from_telemetry("cpe", "coqa", {"em": 0.5}, 2, 3.0, 12, {"retrieval_ratio": 0.2}, {},
                                      prefill_seconds=1.25, prompt_tokens=640)
    untimed = report.Row.from_telemetry("dense", "coqa", {"em": 0.5}, 2, 3.0, 12, {}, {})
    out = tmp_path / "acc.json"
    report.write_report(out, {"command": "x"}, [timed, untimed])
    assert report.load_rows(out) == [timed, untimed]
    assert (timed.prefill_seconds, timed.prompt_tokens, untimed.prefill_seconds) == (1.25, 640, None)
    table = out.with_suffix(".md").read_text()
    assert "| 3.0 | 1.25 | ok |" in table and "| 3.0 | — | ok |" in table

    # a report without these fields still loads (for --resume), prefill unknown
    payload = json.loads(out.read_text())
    for r in payload["rows"]:
        del r["prefill_seconds"], r["prompt_tokens"]
    out.write_text(json.dumps(payload))
    old = report.load_rows(out)
    assert [r.config for r in old] == ["cpe", "dense"] and all(r.prefill_seconds is None for r in old)
    assert "| 3.0 | — | ok |" in report.render_markdown({}, old)


def test_prefill_time_ends_at_the_first_logits(checkpoint) -> None:
    """The prefill forward is timed, the decode forwards are not: each forward sleeps (prefill 0.1 s,
    decode step 0.05 s), so the prefill is at least 0.1 s and leaves out every decode step's 0.05 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    forwards: list[int] = []

    def slow(module, args, kwargs):
        width = kwargs["input_ids"].shape[1]
        forwards.append(width)
        time.sleep(0.1 if len(forwards) == 1 else 0.05)

    handle = model.register_forward_pre_hook(slow, with_kwargs=True)
    try:
        began = time.perf_counter()
        gen = direct.generate(model, tokenizer, ["Once upon a time", "Hi"], max_new_tokens=5)  # "Hi": left-padded
        total = time.perf_counter() - began
    finally:
        handle.remove()
    decode_steps = len(forwards) - 1
    assert forwards[0] > 1 and decode_steps >= 2 and set(forwards[1:]) == {1}
    assert gen.prefill_seconds >= 0.1 and total - gen.prefill_seconds >= 0.05 * decode_steps
    texts = ("Once upon a time", "Hi")
    assert gen.prompt_tokens == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def test_rows_run_their_decode_steps_sparse_unless_told_otherwise(checkpoint, data_dir, tmp_path, monkeypatch) -> None:
    """Issue 54 measures each candidate's accuracy with its decode steps forced sparse: a shipped config
    says ``policy: auto``, which on a GPU runs dense wherever the cost model says sparse loses, so a row
    of it would measure dense's accuracy. ``--policy`` (default sparse) forces every forward; ``config``
    keeps each config's own section."""
    config = accuracy_configs.NamedConfig("cis-tiny-auto", "cis", {
        "budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4},
        "policy": {"decode": "auto", "prefill": "auto"}})
    monkeypatch.setitem(accuracy_configs.ACCURACY_CONFIGS, config.name, config)
    policies = {}
    for flag in ([], ["--policy", "config"], ["--policy", "dense"]):
        out = tmp_path / f"acc{len(policies)}.json"
        assert run_accuracy.main(_args(checkpoint, data_dir, out, "--configs", config.name, "--tasks", "coqa",
                                       "--limit", "1", *flag)) == 0
        report = json.loads(out.read_text())
        (row,) = report["rows"]
        policies[report["meta"]["policy"]] = row["prhs_config"]["policy"]
    assert policies["sparse"]["decode"] == policies["sparse"]["prefill"] == "sparse"
    assert policies["config"]["decode"] == "auto" and policies["dense"]["decode"] == "dense"
    assert accuracy_configs.with_policy(config, "config") is config
    with pytest.raises(ValueError, match="allowed sparse, auto, dense, config"):
        accuracy_configs.with_policy(config, "fast")
