"""The lm-eval integration: scoring (against hand-computed values and lm-eval's own filters and
metric), the ``prhs`` model through the Python API and the ``python -m prhs_hf.evaluation.lm_eval`` shim, end to
end on a tiny random llama and a handful of local GSM8K / CoQA rows (no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lm_eval_fixtures import COQA_ROWS, GSM8K_ROWS, SMALL_BUDGET, checkpoint, data_dir  # noqa: F401 (fixtures)
from prhs_hf.evaluation.accuracy import direct
from prhs_hf.evaluation.lm_eval import LOCAL_TASKS, TASKS_DIR, metrics, prompts
from prhs_hf.evaluation.lm_eval import shim
from prhs_hf.evaluation.lm_eval.shim import lm_eval_argv

# Offline, and a data folder that does not exist as the fallback: data must come from data_dir.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PRHS_HF_DATA_DIR": "/nonexistent/prhs-hf-data",
           "OMP_NUM_THREADS": "1"}  # for the subprocess: a tiny model gains nothing from threads
MAX_NEW = 10


# ----------------------------------------------------------------------------------- CoQA metric


def test_squad_normalisation() -> None:
    assert metrics.normalize_answer("The Cat, sat  on A mat!") == "cat sat on mat"
    assert metrics.normalize_answer("  An apple.  ") == "apple"
    assert metrics.normalize_answer("theatre") == "theatre"  # articles only as whole words


@pytest.mark.parametrize(("gold", "pred", "em", "f1"), [
    ("An Apple", "apple", 1, 1.0),
    ("the cat sat on the mat", "a cat on a mat", 0, 2 * 1.0 * 0.75 / 1.75),  # P 3/3, R 3/4
    ("in a barn", "the barn", 0, 2 * 1.0 * 0.5 / 1.5),                       # P 1/1, R 1/2
    ("barn barn hay", "barn", 0, 2 * 1.0 * (1 / 3) / (4 / 3)),               # P 1/1, R 1/3
    ("dog", "cat", 0, 0.0),
    ("", "", 1, 1.0),
    ("", "cat", 0, 0.0),
    ("...", "the", 1, 1.0),  # both normalise to nothing
])
def test_squad_exact_and_f1(gold, pred, em, f1) -> None:
    assert metrics.squad_exact(gold, pred) == em
    assert metrics.squad_f1(gold, pred) == pytest.approx(f1)


def test_coqa_scores_leave_one_out() -> None:
    # one gold: plain scores
    assert metrics.coqa_scores(["no"], "No.") == {"em": 1.0, "f1": 1.0}
    # two golds: each scored against the other alone, then averaged
    scores = metrics.coqa_scores(["in a barn", "barn near a farm"], "the barn")
    assert scores["em"] == 0.0
    assert scores["f1"] == pytest.approx((2 / 4 + 2 / 3) / 2)  # vs "barn near farm": P 1, R 1/3; vs "in barn": 2/3
    # three golds, the prediction equal to one of them: two of the three subsets contain it
    scores = metrics.coqa_scores(["white", "white kitten", "black"], "White")
    assert scores["em"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx((2 / 3 + 1 + 1) / 3)  # subset {white kitten, black}: F1 2/3


def test_coqa_prompt_golds_and_prediction() -> None:
    doc = COQA_ROWS[0]
    assert prompts.coqa_prompt(doc) == (f"{doc['story']}\n\nQ: What color was Cotton?\n\nA: white\n\n"
                                        "Q: Where did she live?\n\nA:")
    assert prompts.coqa_golds(doc) == ["in a barn", "a barn", "barn"]  # duplicates dropped, case-insensitively
    assert prompts.coqa_golds(COQA_ROWS[2]) == ["tomatoes", "tomato plants"]
    assert prompts.coqa_prediction("  in the barn\nQ: next") == "in the barn"
    assert prompts.coqa_prediction("\n\nQ: next\nA: x") == ""
    assert prompts.coqa_prediction("\n barn \n more") == "barn "  # lm-eval strips before splitting only
    assert not prompts.coqa_answer_done("\n  barn")
    assert prompts.coqa_answer_done("\n  barn\n") and prompts.coqa_answer_done("\nQ:")


# ----------------------------------------------------------------------------------- GSM8K metric


def test_gsm8k_extraction_and_exact_match() -> None:
    gold = GSM8K_ROWS[2]["answer"]  # ends "#### 1,000"
    assert prompts.gsm8k_gold(GSM8K_ROWS[2]) == "1,000"
    assert metrics.gsm8k_scores("She has 1000 left.\n#### 1,000", gold) == {"strict-match": 1.0, "flexible-extract": 1.0}
    assert metrics.gsm8k_scores("She has $1,000.", gold) == {"strict-match": 0.0, "flexible-extract": 1.0}
    assert metrics.gsm8k_scores("So 1000 then 999", gold) == {"strict-match": 0.0, "flexible-extract": 0.0}
    cot = metrics.GSM8K_COT_FILTERS
    assert metrics.gsm8k_scores("1 + 2 = 3. The answer is 1,000.", gold, cot) == {"strict-match": 1.0,
                                                                                  "flexible-extract": 1.0}
    assert metrics.extract_answer("nothing", metrics.GSM8K_STRICT) == metrics.FALLBACK
    assert metrics.extract_answer("5 and -7", metrics.GSM8K_FLEXIBLE) == "-7"


GENERATIONS = [
    "The answer is 18.", "#### 1,234", "so she pays $18.00.", "no number here", "-5 and then 7",
    "#### -3\nThe answer is 4.", "The answer is 1,000. Done", "12.5 then 13", "$5", "answer: 42.", "",
    "It costs $7.\n#### 7", "The answer is 60", "Total 120 miles. The answer is 120.",
    # Qwen2.5-Coder-Instruct's closings on the chat prompt: LaTeX boxes, never "The answer is N." (strict 0)
    "The answer is \\(\\boxed{3}\\).", "is:\n\\[ \\boxed{-38000} \\]", "is \\(\\boxed{18}\\).",
]
REFERENCES = [r["answer"] for r in GSM8K_ROWS] + ["#### 18", "#### 1,234", "#### 42", "18", "-3"]


@pytest.mark.parametrize("upstream", ["gsm8k.yaml", "gsm8k-cot.yaml"])
def test_gsm8k_scoring_matches_lm_eval(upstream) -> None:
    """Our patterns are lm-eval's, and extraction + exact match agree with lm-eval's regex filter and
    exact_match metric on every generation × reference."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    spec = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / upstream).read_text())
    ours = metrics.GSM8K_FILTERS if upstream == "gsm8k.yaml" else metrics.GSM8K_COT_FILTERS
    (metric,) = spec["metric_list"]
    assert tuple(metric["regexes_to_ignore"]) == metrics.GSM8K_IGNORE
    assert (metric["ignore_case"], metric["ignore_punctuation"]) == (True, False)
    for entry in spec["filter_list"]:
        regex_step = entry["filter"][0]
        pattern = ours[entry["name"]]
        assert (regex_step["regex_pattern"], regex_step.get("group_select", 0)) == (pattern.regex, pattern.group_select)
        upstream_filter = RegexFilter(regex_step["regex_pattern"], regex_step.get("group_select", 0))
        extracted = [x[0] for x in upstream_filter.apply([[g] for g in GENERATIONS], [{}] * len(GENERATIONS))]
        assert extracted == [metrics.extract_answer(g, pattern) for g in GENERATIONS]
        for answer in extracted:
            for ref in REFERENCES:
                theirs = exact_match_hf_evaluate([answer], [ref], regexes_to_ignore=metric["regexes_to_ignore"],
                                                 ignore_case=True, ignore_punctuation=False)["exact_match"]
                assert metrics.exact_match(answer, ref) == theirs, (answer, ref)


def test_gsm8k_cot_exemplars_and_stops_are_lm_evals() -> None:
    """The one copy of the ``gsm8k-cot`` exemplars (prompts.py, also read by gsm8k_cot_local.yaml) and
    its stop strings and question format are lm-eval's."""
    lm_eval = pytest.importorskip("lm_eval")
    from prhs_hf.evaluation.lm_eval import task_hooks

    spec = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml").read_text())
    assert spec["fewshot_config"]["samples"] == list(prompts.GSM8K_COT_EXEMPLARS) == task_hooks.gsm8k_cot_fewshot()
    assert (spec["num_fewshot"], spec["fewshot_config"]["sampler"]) == (8, "first_n")
    assert tuple(spec["generation_kwargs"]["until"]) == prompts.GSM8K_COT_STOP
    assert spec["doc_to_text"] == prompts.gsm8k_cot_question({"question": "{{question}}"})
    assert "fewshot_delimiter" not in spec and "target_delimiter" not in spec  # defaults "\n\n" and " "
    ours = yaml.load((TASKS_DIR / "gsm8k_cot_local.yaml").read_text().replace("!function", ""), yaml.SafeLoader)
    assert tuple(ours["generation_kwargs"]["until"]) == prompts.GSM8K_COT_STOP


def test_gsm8k_cot_context_matches_lm_eval(local_tasks) -> None:
    """lm-eval builds the same 8-shot context and stop strings for ``gsm8k_cot_local`` as the direct
    engine for ``gsm8k_cot``."""
    task = local_tasks.load("gsm8k_cot_local")["tasks"]["gsm8k_cot_local"]
    task.build_all_requests(limit=len(GSM8K_ROWS))
    ours = direct.DIRECT_TASKS["gsm8k_cot"]
    assert len(task.instances) == len(GSM8K_ROWS)
    for inst in task.instances:
        context, gen_kwargs = inst.args
        assert context == ours.prompt(GSM8K_ROWS[inst.doc_id])
        assert tuple(gen_kwargs["until"]) == ours.until


# ----------------------------------------------------------------------------------- plumbing


def test_task_files_and_shim_arguments() -> None:
    assert sorted(p.stem for p in TASKS_DIR.glob("*.yaml")) == sorted(LOCAL_TASKS)
    include = ["--include_path", str(TASKS_DIR)]
    assert lm_eval_argv(["--tasks", "gsm8k_local"]) == ["--tasks", "gsm8k_local", *include, "--model", "prhs"]
    assert lm_eval_argv(["run", "--model", "hf", "--include_path", "x"]) == ["run", "--model", "hf", "--include_path", "x"]
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks", *include]
    assert lm_eval_argv(["--help"]) == ["--help"]


def test_project_cli_forwarding(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(shim, "main", lambda argv: seen.append(argv) or 7)
    assert shim.forward(["generate", "--model", "x"]) is None and seen == []
    assert shim.forward(["lm-eval", "--tasks", "gsm8k_local"]) == 7 and seen == [["--tasks", "gsm8k_local"]]


def test_prhs_overrides_from_dicts_strings_and_dotted_keys() -> None:
    pytest.importorskip("lm_eval")
    from prhs_hf.evaluation.lm_eval.plugin import parse_overrides

    assert parse_overrides(None) == {}
    assert parse_overrides({"budget": {"topk": 72}}, {"prhs.budget.sink": 4, "prhs.cis.block_size": 8}) == {
        "budget": {"topk": 72, "sink": 4}, "cis": {"block_size": 8}}
    assert parse_overrides('{"cis": {"tau": 0.5}}') == {"cis": {"tau": 0.5}}
    with pytest.raises(ValueError):
        parse_overrides(None, {"prhs.topk": 3})
    with pytest.raises(ValueError):
        parse_overrides("[1, 2]")


# ----------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def local_tasks(data_dir):
    """lm-eval's task manager over the local tasks only, reading ``data_dir``."""
    pytest.importorskip("lm_eval")
    import prhs_hf.evaluation.lm_eval as ple

    return ple.task_manager(include_defaults=False, metadata={"data_dir": str(data_dir)})


@pytest.fixture()
def offline(monkeypatch) -> None:
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def _check_telemetry(prhs: dict, tasks: list[str]) -> None:
    assert prhs["config"]["telemetry"]["enabled"] is True
    assert prhs["config"]["budget"] == {"sink": 4, "local": 8, "topk": 16, "topk_fraction": None, "topk_max": None}
    for task in tasks:
        report = prhs["telemetry"][task]["generate_until"]
        assert report["decode_steps"] > 0 and report["sparse_sequence_steps"] > 0
        assert 0.0 < report["retrieval_ratio"] <= 1.0
        assert 0 < report["processed_kv_per_step"] < report["dense_kv_per_step"]


def test_python_api_local_tasks(checkpoint, local_tasks, offline) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    import prhs_hf.evaluation.lm_eval as ple

    ple.register()
    results = lm_eval.simple_evaluate(
        model="prhs", tasks=["gsm8k_local", "gsm8k_cot_local", "coqa_local"], limit=10, batch_size=4,
        task_manager=local_tasks,
        model_args={"pretrained": str(checkpoint), "prhs_config": "cis", "prhs_overrides": SMALL_BUDGET,
                    "device": "cpu", "dtype": "float32"},
        gen_kwargs={"max_gen_toks": MAX_NEW}, bootstrap_iters=0)
    gsm8k, coqa = results["results"]["gsm8k_local"], results["results"]["coqa_local"]
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(gsm8k)
    assert {"em,none", "f1,none"} <= set(coqa)
    # all of the local rows and no more: the data came from data_dir
    assert results["n-samples"]["gsm8k_local"]["effective"] == len(GSM8K_ROWS)
    assert results["n-samples"]["coqa_local"]["effective"] == len(COQA_ROWS)
    _check_telemetry(results["config"]["prhs"], ["gsm8k_local", "gsm8k_cot_local", "coqa_local"])
    assert results["config"]["prhs"]["config_source"].endswith("configs/cis.yaml")
    assert results["n-shot"]["gsm8k_cot_local"] == 8 and results["n-shot"]["gsm8k_local"] == 0


def test_cli_shim_writes_results_with_telemetry(checkpoint, data_dir, tmp_path) -> None:
    pytest.importorskip("lm_eval")
    out = tmp_path / "out"
    args = ["--model_args", f"pretrained={checkpoint},prhs_config=cis,prhs.budget.sink=4,"  # sparse forced: on a
                            "prhs.budget.local=8,prhs.budget.topk=16,prhs.policy.decode=sparse,"  # CPU auto is dense
                            "dtype=float32",
            "--device", "cpu", "--tasks", "gsm8k_local,coqa_local", "--limit", "10", "--batch_size", "4",
            "--gen_kwargs", f"max_gen_toks={MAX_NEW}", "--metadata", json.dumps({"data_dir": str(data_dir)}),
            "--output_path", str(out)]
    proc = subprocess.run([sys.executable, "-m", "prhs_hf.evaluation.lm_eval", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())
    assert "exact_match,flexible-extract" in results["results"]["gsm8k_local"]
    assert "f1,none" in results["results"]["coqa_local"]
    assert results["n-samples"]["gsm8k_local"]["effective"] == len(GSM8K_ROWS)
    _check_telemetry(results["config"]["prhs"], ["gsm8k_local", "coqa_local"])
    assert "gsm8k_local" in proc.stdout  # lm-eval's table
    table_end = proc.stdout.index("gsm8k_local (generate_until), prhs_config ")  # then each task's summary
    assert "PrHS telemetry: " in proc.stdout[table_end:] and "coqa_local (generate_until)" in proc.stdout[table_end:]


def test_the_shim_prints_each_tasks_telemetry_summary_without_output_path(monkeypatch, capsys) -> None:
    """What a run reported to lm-eval (``PrHSLM.reported``) is summarised after lm-eval's output."""
    pytest.importorskip("lm_eval")
    import lm_eval.__main__
    from prhs_hf.telemetry_counters import TelemetryReport

    model = shim.register()
    report = TelemetryReport(decode_steps=4, decode_sequence_steps=8, sparse_sequence_steps=6, retrieval_ratio=0.5,
                             processed_kv_per_step=20.0, dense_kv_per_step=40.0)
    info = {"config_source": "/configs/cis.yaml", "telemetry": {"gsm8k_local": {"generate_until": report.as_dict()}}}
    seen = []

    def fake_cli_evaluate() -> None:
        seen.append(list(sys.argv))
        print("|gsm8k_local| table |")
        model.reported.append(info)

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fake_cli_evaluate)
    monkeypatch.setattr(model, "reported", [{"telemetry": {"earlier_run": {}}}])  # not this run's: not printed
    assert shim.main(["--tasks", "gsm8k_local"]) == 0
    out = capsys.readouterr().out
    assert "--output_path" not in seen[0]
    assert out.index("|gsm8k_local| table |") < out.index("gsm8k_local (generate_until), prhs_config /configs/cis.yaml:")
    assert "PrHS telemetry: 4 decode steps, 6 of 8 sequence-steps sparse (75.0 %)" in out, out
    assert "keys read per head and step: 20.0 of dense's 40.0 (50.0 %)" in out and "earlier_run" not in out, out


def test_prhs_config_takes_a_named_config_of_the_result_tables(checkpoint) -> None:
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM

    lm = object.__new__(shim.register())  # no HFLM loading: configure() only needs the model
    lm._model = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = lm.configure("cis-s8", {"budget": {"topk": 16}})
    assert (config.cis.block_size, config.budget.topk, config.telemetry.enabled) == (8, 16, True)
    assert lm.prhs_config_source == "cis-s8"
    assert lm.configure("cis").cis.block_size == 16 and lm.prhs_config_source.endswith("configs/cis.yaml")
    with pytest.raises(ValueError, match="named configs of the result tables: .*cis-s16"):
        lm.configure("cpe-s16-share")


def test_model_instance_matches_the_direct_engine(checkpoint, local_tasks, offline) -> None:
    """A ``PrHSLM`` around a loaded model gives the same generations and scores as
    ``prhs_hf.evaluation.accuracy.direct`` on the chat GSM8K, 8-shot GSM8K and CoQA tasks (same prompts, same
    scoring). ``max_length`` above the 8-shot prompt's ~2,600 byte tokens: lm-eval must not cut it."""
    lm_eval = pytest.importorskip("lm_eval")
    import prhs_hf
    import prhs_hf.evaluation.lm_eval as ple
    from prhs_hf.hub.fetch import load_model

    model, tokenizer = load_model(checkpoint, dtype="float32")
    lm = ple.register()(pretrained=model, tokenizer=tokenizer, batch_size=1, prhs_config="cis",
                        prhs_overrides=SMALL_BUDGET, max_length=4096)
    for task in direct.DIRECT_TASKS.values():
        res = lm_eval.simple_evaluate(model=lm, tasks=[task.lm_eval_task], limit=2, apply_chat_template=task.chat,
                                      task_manager=local_tasks,
                                      gen_kwargs={"max_gen_toks": MAX_NEW}, log_samples=True, bootstrap_iters=0)
        logged = {s["doc_id"]: s for s in res["samples"][task.lm_eval_task]}  # one entry per doc and filter
        theirs = [logged[i]["resps"][0][0] for i in sorted(logged)]
        docs = (GSM8K_ROWS if task.dataset == "gsm8k" else COQA_ROWS)[:2]
        prhs_hf.reset(model)
        ours = direct.evaluate(model, tokenizer, task, docs, batch_size=1, max_new_tokens=MAX_NEW)
        if task.name.startswith("gsm8k"):
            assert [s["generation"] for s in ours.samples] == theirs
        else:  # the direct engine stops once the first line is complete
            assert [prompts.coqa_prediction(s["generation"]) for s in ours.samples] == [
                prompts.coqa_prediction(t) for t in theirs]
        lm_metrics = res["results"][task.lm_eval_task]
        for name, value in ours.metrics.items():
            key = f"exact_match,{name}" if task.name.startswith("gsm8k") else f"{name},none"
            assert lm_metrics[key] == pytest.approx(value)


# ------------------------------------------------------------- pretrained= and device


class _Captured(Exception):
    """Raised by the stand-in for HFLM.__init__ once it has recorded its arguments."""


@pytest.fixture()
def hflm_arguments(monkeypatch) -> dict:
    """What ``PrHSLM`` hands to ``HFLM.__init__`` (which is replaced: nothing is loaded)."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    seen: dict = {}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id then goes to HFLM unchecked (offline: its cache)

    def fake_init(self, **kwargs):
        seen.update(kwargs)
        raise _Captured

    monkeypatch.setattr(HFLM, "__init__", fake_init)
    return seen


def _construct(**kwargs) -> None:
    import prhs_hf.evaluation.lm_eval as ple

    with pytest.raises(_Captured):
        ple.register()(**kwargs)


def test_pretrained_takes_a_registered_model_name(hflm_arguments, monkeypatch, tmp_path) -> None:
    from prhs_hf.hub import fetch

    gguf = tmp_path / "models" / "smollm2-135m" / "SmolLM2.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"")
    monkeypatch.setattr(fetch, "fetch_model", lambda name, cache_dir=None, **kw: gguf)
    _construct(pretrained="smollm2-135m")
    assert (hflm_arguments["pretrained"], hflm_arguments["gguf_file"]) == (str(gguf.parent), gguf.name)


def test_pretrained_takes_a_gguf_path_and_a_gguf_folder(hflm_arguments, tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    _construct(pretrained=str(gguf))
    assert (hflm_arguments["pretrained"], hflm_arguments["gguf_file"]) == (str(tmp_path), "m.gguf")
    hflm_arguments.clear()
    _construct(pretrained=str(tmp_path))  # a folder holding one GGUF and no config.json
    assert (hflm_arguments["pretrained"], hflm_arguments["gguf_file"]) == (str(tmp_path), "m.gguf")


def test_pretrained_passes_checkpoints_hub_ids_and_an_explicit_gguf_file_through(hflm_arguments, checkpoint) -> None:
    _construct(pretrained=str(checkpoint))
    assert hflm_arguments["pretrained"] == str(checkpoint) and hflm_arguments.get("gguf_file") is None
    hflm_arguments.clear()
    _construct(pretrained="org/some-model")
    assert hflm_arguments["pretrained"] == "org/some-model" and hflm_arguments.get("gguf_file") is None
    hflm_arguments.clear()
    _construct(pretrained="/models/dir", gguf_file="x.gguf")  # the HFLM form stays as it was
    assert (hflm_arguments["pretrained"], hflm_arguments["gguf_file"]) == ("/models/dir", "x.gguf")


def test_a_missing_gguf_path_names_it(hflm_arguments, tmp_path) -> None:
    import prhs_hf.evaluation.lm_eval as ple

    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        ple.register()(pretrained=str(tmp_path / "no-such.gguf"))


def test_the_device_defaults_to_what_is_there(hflm_arguments) -> None:
    import torch

    _construct(pretrained="org/some-model")
    assert hflm_arguments["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    hflm_arguments.clear()
    _construct(pretrained="org/some-model", device="cpu")
    assert hflm_arguments["device"] == "cpu"


def test_simple_evaluate_without_a_device_runs_where_there_is_no_gpu(checkpoint, local_tasks, offline) -> None:
    """``simple_evaluate`` with ``device`` left out (lm-eval then asks HFLM for ``cuda``) runs."""
    lm_eval = pytest.importorskip("lm_eval")
    import prhs_hf.evaluation.lm_eval as ple

    ple.register()
    results = lm_eval.simple_evaluate(
        model="prhs", tasks=["gsm8k_local"], limit=1, batch_size=1, task_manager=local_tasks,
        model_args=f"pretrained={checkpoint},prhs_config=cis,dtype=float32",
        gen_kwargs={"max_gen_toks": 2}, bootstrap_iters=0)
    assert results["n-samples"]["gsm8k_local"]["effective"] == 1


@pytest.mark.slow
def test_simple_evaluate_with_the_registered_default_model(local_tasks, offline) -> None:
    """``pretrained=smollm2-135m`` as ``prhs-hf generate --model`` takes it (fetched offline from PyPI)."""
    lm_eval = pytest.importorskip("lm_eval")
    import prhs_hf.evaluation.lm_eval as ple

    ple.register()
    results = lm_eval.simple_evaluate(
        model="prhs", tasks=["gsm8k_local"], limit=1, batch_size=1, task_manager=local_tasks,
        model_args="pretrained=smollm2-135m,prhs_config=cis", gen_kwargs={"max_gen_toks": 2}, bootstrap_iters=0)
    assert results["n-samples"]["gsm8k_local"]["effective"] == 1
    assert results["config"]["prhs"]["config"]["cis"]["enabled"] is True


def test_the_default_config_is_the_demo_s() -> None:
    pytest.importorskip("lm_eval")
    from prhs_hf import cli
    from prhs_hf.evaluation.lm_eval import plugin

    assert plugin.DEFAULT_CONFIG == cli.DEFAULT_CONFIG


# ------------------------------------------------------------- batches score as each request alone

#: PSAW and ETF from layer 1 of 4 (so both act in a short prefill) at a budget below the prompts
PSAW_ETF = {**SMALL_BUDGET, "psaw": {"start_layer": 1}, "etf": {"start_layer": 1},
            "backend": {"prefill": "torch", "decode": "torch"}}


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A 4-layer tiny checkpoint, loaded, with sharper attention (q/k weights x4) so that what PSAW
    hides and ETF freezes changes the scores."""
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval_fixtures import save_tiny_checkpoint
    from prhs_hf.hub.fetch import load_model

    model, tokenizer = load_model(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-4"), layers=4),
                                  dtype="float32")
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(4.0)
    return model, tokenizer


def _lm(sharp_model, batch_size: int, config: str):
    import prhs_hf.evaluation.lm_eval as ple

    model, tokenizer = sharp_model
    return ple.register()(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, prhs_config=config,
                          prhs_overrides=PSAW_ETF if config == "cpe" else None)


def _instances(request_type: str, arguments: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type, {}, args, i, ("task", i, 1)) for i, args in enumerate(arguments)]


# contexts of 45 to 180 byte tokens: a batch of them is right-padded to the longest
CONTEXTS = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 4, 2, 3)]


@pytest.mark.parametrize("config", ["cpe", "dense"])
def test_a_loglikelihood_request_scores_the_same_alone_and_in_a_batch(sharp_model, config) -> None:
    """lm-eval right-pads a loglikelihood batch and passes no mask: with PSAW/ETF the pads shifted
    the windows and the frozen rows (the scores of the shorter requests moved by ~0.1)."""
    requests = _instances("loglikelihood", [(c, " and runs away") for c in CONTEXTS])
    alone = [_lm(sharp_model, 1, config).loglikelihood([r], disable_tqdm=True)[0] for r in requests]
    batch = _lm(sharp_model, 4, config).loglikelihood(requests, disable_tqdm=True)
    assert [s for s, _ in batch] == pytest.approx([s for s, _ in alone], rel=1e-6, abs=1e-5)
    assert [g for _, g in batch] == [g for _, g in alone]


@pytest.mark.parametrize("config", ["cpe", "dense"])
def test_a_rolling_loglikelihood_is_the_same_alone_and_in_a_batch(sharp_model, config) -> None:
    requests = _instances("loglikelihood_rolling", [(c,) for c in CONTEXTS])
    alone = [_lm(sharp_model, 1, config).loglikelihood_rolling([r], disable_tqdm=True)[0] for r in requests]
    batch = _lm(sharp_model, 4, config).loglikelihood_rolling(requests, disable_tqdm=True)
    assert batch == pytest.approx(alone, rel=1e-6, abs=1e-5)


def test_generate_until_gives_the_same_text_alone_and_in_a_batch(sharp_model) -> None:
    """generate_until batches left-padded with a mask (lm-eval's own), which PrHS takes exactly."""
    requests = _instances("generate_until", [(c, {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False})
                                             for c in CONTEXTS])
    alone = [_lm(sharp_model, 1, "cpe").generate_until([r], disable_tqdm=True)[0] for r in requests]
    assert _lm(sharp_model, 4, "cpe").generate_until(requests, disable_tqdm=True) == alone


def test_the_recorded_lengths_must_fit_the_batch(sharp_model) -> None:
    """An lm-eval whose batching the plugin does not know is refused, not scored with a wrong mask."""
    import torch

    lm = _lm(sharp_model, 2, "cpe")
    lm._row_lengths = [3, 5, 2]
    with pytest.raises(RuntimeError, match="row lengths"):
        lm._model_call(torch.ones(2, 5, dtype=torch.long))


# ------------------------------------------------------------- device= and batch_size= in --model_args


@pytest.fixture()
def local_task_index(monkeypatch) -> None:
    """lm-eval's command line indexes the local tasks only (its own take most of a minute here)."""
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))


def test_device_and_batch_size_in_model_args_reach_the_model(hflm_arguments, local_task_index) -> None:
    """lm-eval's command line always passes --device and --batch_size (its defaults cuda:0 and 1), so
    device= in --model_args, which `prhs-hf lm-eval --help` documents, crashed with "multiple values
    for keyword argument 'device'"."""
    with pytest.raises(_Captured):
        shim.main(["--tasks", "gsm8k_local", "--model_args", "pretrained=org/some-model,device=cpu,batch_size=2"])
    assert (hflm_arguments["device"], str(hflm_arguments["batch_size"])) == ("cpu", "2")


def test_device_given_twice_must_agree(hflm_arguments, local_task_index) -> None:
    with pytest.raises(ValueError, match="device=cpu in the model arguments and --device cuda:1 disagree"):
        shim.main(["--tasks", "gsm8k_local", "--device", "cuda:1", "--model_args", "pretrained=org/x,device=cpu"])
    with pytest.raises(_Captured):  # the same value twice is fine
        shim.main(["--tasks", "gsm8k_local", "--device", "cpu", "-b", "3", "--model_args",
                   "pretrained=org/x,device=cpu,batch_size=3"])
    assert (hflm_arguments["device"], str(hflm_arguments["batch_size"])) == ("cpu", "3")
    import prhs_hf.evaluation.lm_eval as ple

    assert ple.register().defaulted_options == frozenset()  # the run's defaults are not left behind
    with pytest.raises(ValueError, match="batch_size=8 in the model arguments and --batch_size 4 disagree"):
        ple.register().create_from_arg_obj({"pretrained": "org/x", "batch_size": 8}, {"batch_size": 4})


def test_lm_eval_outside_a_git_repository_prints_no_git_error(monkeypatch, tmp_path, capfd) -> None:
    """lm-eval records the commit it ran in with `git describe`, whose "fatal: not a git repository"
    went to the terminal of every run outside a repository."""
    pytest.importorskip("lm_eval")
    import lm_eval.__main__
    import lm_eval.evaluator

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(lm_eval.evaluator.get_git_commit_hash()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    assert shim.main(["--tasks", "gsm8k_local"]) == 0
    assert seen == [None]
    assert "fatal" not in capfd.readouterr().err


def test_a_bad_config_or_cuda_device_is_refused_before_the_model_loads(hflm_arguments) -> None:
    """A misspelled prhs_config was found only after HFLM had loaded the model; a CUDA device that is
    not there only when the first batch went to it."""
    import prhs_hf.evaluation.lm_eval as ple
    from prhs_hf.config import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'cis_longbench'"):
        ple.register()(pretrained="org/some-model", prhs_config="cis_longbnech")
    with pytest.raises(ConfigError, match="psaw.phi: the config leaves psaw off"):
        ple.register()(pretrained="org/some-model", prhs_config="cis", **{"prhs.psaw.phi": 0.5})
    with pytest.raises(ValueError, match="device 'cuda:99'"):
        ple.register()(pretrained="org/some-model", device="cuda:99")
    with pytest.raises(ValueError, match="unknown model 'smollm2-13m': did you mean 'smollm2-135m'"):
        ple.register()(pretrained="smollm2-13m")
    assert hflm_arguments == {}  # HFLM never started


def test_lm_evals_default_device_gives_way_to_what_is_there(hflm_arguments, local_task_index) -> None:
    """Without --device lm-eval passes cuda:0: the plugin's default (cuda if there, else cpu) applies."""
    import torch

    with pytest.raises(_Captured):
        shim.main(["--tasks", "gsm8k_local", "--model_args", "pretrained=org/some-model"])
    assert hflm_arguments["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
