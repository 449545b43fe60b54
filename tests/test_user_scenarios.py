"""Real ``generate()`` usage of a patched model, on a tiny random model of every supported family,
against the unpatched model: multi-turn cache reuse, prefix caches and deepcopy, ``copy.deepcopy``
of a patched model, threads, assisted generation, streaming, sampling with several sequences, beam
search, ``inputs_embeds``, save/load, dtype moves, eager attention and training with dropout; a
returned cache's own edits (``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``,
``crop``), ``output_attentions``, ``inference_mode``, ``set_attn_implementation`` and ``torch.save``.

What each scenario must give (README, "Supported"):

- ``"dense"`` (nothing on) keeps transformers' own path: bit for bit the unpatched model's tokens
  and logits;
- ``"cis"`` with its shipped budget, 8 sink + 32 local + 88 top-k = 128 keys, attends to every
  token of a sequence of at most 128 tokens, so on the short prompts here (at most ~50 tokens with
  everything generated) it writes the unpatched model's tokens (its logits come from another
  attention kernel: equal up to rounding, not bit for bit);
- a sparse config (4 + 8 + 16 keys, τ 0: CIS retrieves *and* shares) on prompts of 40-96 tokens
  either runs exactly as the same call does elsewhere (sequentially, on a fresh patch, from a fresh
  cache), or raises an error that names what is supported.

Everything decodes with the PyTorch reference (``backend.decode: torch``): no Triton needed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.generation.streamers import BaseStreamer

import prhs_hf
from prhs_hf.compat import CACHE_ARGUMENT_NAME
from prhs_hf.families import decoder_layers
from prhs_hf.patching import RUNTIME_ATTRIBUTE
from tiny_models import FAMILIES, padded_batch, tiny_model

NEW = 4  # new tokens per generate() call
#: the PyTorch reference backends, and the sparse path wherever the config has one (``policy: auto``, the
#: shipped configs' default, is sparse on a CPU but goes dense on CUDA for contexts this short)
TORCH_BACKENDS = {"backend": {"prefill": "torch", "decode": "torch"}, "policy": {"decode": "sparse", "prefill": "sparse"}}
#: CIS alone far below the prompts (4 + 8 + 16 = 28 keys), blocks of 4, τ 0: rows retrieve and share
SPARSE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.0},
          "telemetry": {"enabled": True}, **TORCH_BACKENDS}
#: "cis" as shipped: 8 + 32 + 88 = 128 keys, more than any sequence of the covering tests holds
COVERING_LIMIT = 8 + 32 + 88
#: the message a full StaticCache must raise with
STATIC_FULL = r"(?i)static ?cache\b.*\bfull"

families = pytest.mark.parametrize("family", list(FAMILIES))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread per test process: under ``-n 2`` on two cores, two workers with two OpenMP
    threads each ran this file 10x slower (5 min against 30 s). scripts/test.sh sets OMP_NUM_THREADS=1
    for the same reason; this keeps a bare ``pytest -n 2`` as fast. The threads test still runs two
    generate() calls at once (torch releases the GIL inside its ops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- helpers


def _patch(model, config: str):
    """``dense`` / ``covering`` (shipped "cis", budget over every sequence here) / ``sparse``."""
    if config == "dense":
        return prhs_hf.patch(model, "dense", overrides=TORCH_BACKENDS)
    if config == "covering":
        budget = prhs_hf.load_config("cis").budget
        assert budget.sink + budget.local + budget.topk == COVERING_LIMIT
        return prhs_hf.patch(model, "cis", overrides=TORCH_BACKENDS)
    if config == "sparse":
        return prhs_hf.patch(model, "cis", overrides=SPARSE)
    raise AssertionError(config)


def _gen(model, ids=None, mask=None, new: int = NEW, **kw):
    """Greedy (unless ``do_sample`` is given) ``generate()`` with its per-step logits."""
    kw.setdefault("do_sample", False)
    if "past_key_values" in kw:  # under the name the installed transformers takes (5.24 on warns at the old one)
        kw[CACHE_ARGUMENT_NAME] = kw.pop("past_key_values")
    if ids is not None:
        kw["input_ids"] = ids
    with torch.no_grad():
        return model.generate(attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True,
                              output_logits=True, **kw)


def _same(got, expected, logits: bool = True, what: str = "") -> None:
    """Same tokens; with ``logits`` also the same per-step logits, bit for bit."""
    assert got.sequences.shape == expected.sequences.shape, what
    assert torch.equal(got.sequences, expected.sequences), f"{what}: tokens differ\n{got.sequences}\n{expected.sequences}"
    if logits:
        assert len(got.logits) == len(expected.logits), what
        for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
            assert torch.equal(a, b), f"{what}: logits of step {step} differ (max |diff| {(a - b).abs().max():.3g})"


def _check(got, expected, config: str, what: str = "") -> None:
    """``dense``: bit for bit; ``covering``: the same tokens."""
    assert config in ("dense", "covering"), config
    _same(got, expected, logits=config == "dense", what=what)


def _more(ids, mask, n: int = 5, seed: int = 9):
    """``ids``/``mask`` with ``n`` new random (real) tokens appended to every sequence."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(1, 128, (ids.shape[0], n), generator=g)
    return torch.cat([ids, extra], 1), torch.cat([mask, torch.ones_like(extra)], 1)


def _ones(ids):
    return torch.ones_like(ids)


def _assert_sparse_and_sharing(model) -> None:
    """The telemetry of ``model`` (patched with :data:`SPARSE`) saw sparse steps that both retrieved and shared."""
    report = prhs_hf.telemetry(model)
    assert report.sparse_sequence_steps > 0, "no sparse decode step ran: the scenario does not test the sparse path"
    assert 0 < report.retrieval_ratio < 1, f"retrieval ratio {report.retrieval_ratio}: CIS did not both retrieve and share"


def _in_threads(calls, timeout: float = 120.0):
    """Run every callable of ``calls`` in its own thread, released together by a Barrier; their results
    (an exception in any of them is raised here)."""
    barrier = threading.Barrier(len(calls), timeout=timeout)
    results = [None] * len(calls)
    errors = []

    def run(i):
        try:
            barrier.wait()
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a generate() thread hung"
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------- multi-turn past_key_values


def _two_turns(model, ids, mask, cache: str):
    """Turn 1 generates; turn 2 continues turn 1's output plus 5 new tokens with the returned cache.
    ``cache``: ``dynamic`` (generate()'s default), ``static`` (``cache_implementation="static"``) or
    ``explicit`` (a ``StaticCache`` passed in)."""
    kw = {"dynamic": {}, "static": {"cache_implementation": "static", "max_cache_len": 96},
          "explicit": {"past_key_values": StaticCache(config=model.config, max_cache_len=96)}}[cache]
    first = _gen(model, ids, mask, **kw)
    expected_cache = DynamicCache if cache == "dynamic" else StaticCache
    assert isinstance(first.past_key_values, expected_cache)
    ids2, mask2 = _more(first.sequences, torch.cat([mask, _ones(first.sequences[:, ids.shape[1]:])], 1))
    second = _gen(model, ids2, mask2, past_key_values=first.past_key_values)
    assert second.sequences.shape == (ids.shape[0], ids.shape[1] + 2 * NEW + 5)
    assert torch.equal(second.sequences[:, : ids2.shape[1]], ids2)
    return first, second


@families
@pytest.mark.parametrize("cache", ["dynamic", "static", "explicit"])
@pytest.mark.parametrize("config", ["dense", "covering"])
def test_multi_turn_with_the_returned_cache_equals_unpatched(family, config, cache):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([20, 14], seed=1)  # left-padded batch; 20 + 4 + 5 + 4 = 33 <= 128 tokens
    ref = _two_turns(model, ids, mask, cache)
    _patch(model, config)
    got = _two_turns(model, ids, mask, cache)
    _check(got[0], ref[0], config, "turn 1")
    _check(got[1], ref[1], config, "turn 2")


@families
def test_multi_turn_sparse_dynamic_and_static_caches_agree(family):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    dynamic = _two_turns(model, ids, mask, "dynamic")
    _assert_sparse_and_sharing(model)
    for cache in ("static", "explicit"):
        static = _two_turns(model, ids, mask, cache)
        _same(static[0], dynamic[0], logits=False, what=f"{cache}: turn 1")
        _same(static[1], dynamic[1], logits=False, what=f"{cache}: turn 2")
    # and turn 2 from a fresh copy of the turn-1 cache gives turn 2 again
    first = _gen(model, ids, mask)
    ids2, mask2 = _more(first.sequences, torch.cat([mask, _ones(first.sequences[:, ids.shape[1]:])], 1))
    again = _gen(model, ids2, mask2, past_key_values=copy.deepcopy(first.past_key_values))
    _same(again, dynamic[1], what="turn 2 again")


@families
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_continuing_a_generation_from_its_cache_equals_one_long_generation(family, cache):
    """Turn 2 is turn 1's output alone (its last token is not in the cache yet): its first forward is a
    decode step that continues turn 1's CIS blocks, so turn 1 + turn 2 must be the 2 x 4 tokens of one
    8-token generate(), bit for bit, also when unrelated generate() calls ran in between."""
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    kw = {"cache_implementation": "static", "max_cache_len": 96} if cache == "static" else {}
    whole = _gen(model, ids, mask, new=2 * NEW, **kw)
    first = _gen(model, ids, mask, **kw)
    _gen(model, *padded_batch([61, 29, 50], seed=23), new=3)  # unrelated calls: batch 3, then batch 1
    _gen(model, *padded_batch([57], seed=24), new=3, **kw)
    mask2 = torch.cat([mask, _ones(first.sequences[:, ids.shape[1]:])], 1)
    second = _gen(model, first.sequences, mask2, past_key_values=first.past_key_values)
    assert torch.equal(second.sequences, whole.sequences)
    for step, (a, b) in enumerate(zip(first.logits + second.logits, whole.logits)):
        assert torch.equal(a, b), f"step {step}: logits differ from the single generation"
    _assert_sparse_and_sharing(model)


@families
@pytest.mark.parametrize("config", ["dense", "sparse"])
def test_static_cache_full_in_second_turn_is_a_clear_error(family, config):
    """Turn 1 fills 43 of 44 slots; turn 2 adds 5 + 4 tokens. Unpatched, transformers fails with an
    IndexError deep in ``index_copy_``; patched, the error must say that the static cache is full."""
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([40], seed=2)
    _patch(model, config)
    for how in ("explicit", "cache_implementation"):
        if how == "explicit":
            first = _gen(model, ids, mask, past_key_values=StaticCache(config=model.config, max_cache_len=44))
        else:
            first = _gen(model, ids, mask, cache_implementation="static", max_cache_len=44)
        assert isinstance(first.past_key_values, StaticCache)
        ids2, mask2 = _more(first.sequences, _ones(first.sequences))
        with pytest.raises(ValueError, match=STATIC_FULL):
            _gen(model, ids2, mask2, past_key_values=first.past_key_values)
    # the model still works after the error
    out = _gen(model, ids, mask)
    assert out.sequences.shape == (1, 40 + NEW)


# ------------------------------------------------------------------------------ prefix cache + deepcopy


@families
@pytest.mark.parametrize("suffix", [1, 8])
def test_prefix_cache_deepcopies_continue_identically_after_unrelated_calls(family, suffix):
    """A 1-token suffix makes the continuation's first forward a decode step on the prefix cache (its
    CIS state must be the prefix's, not the last call's); 8 tokens make it a prefill over the cache."""
    model = tiny_model(family, layers=2)
    _patch(model, "sparse")
    ids, _ = padded_batch([96], seed=3)
    prefix = ids[:, : 96 - suffix]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prefix, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 96 - suffix
    first = _gen(model, ids, _ones(ids), new=8, past_key_values=copy.deepcopy(cache), output_scores=True)
    _assert_sparse_and_sharing(model)
    # unrelated calls in between: batch 1, then a left-padded batch of 2
    _gen(model, *padded_batch([70], seed=4), new=6)
    _gen(model, *padded_batch([81, 57], seed=5), new=6)
    second = _gen(model, ids, _ones(ids), new=8, past_key_values=copy.deepcopy(cache), output_scores=True)
    _same(second, first, what="second continuation")
    for step, (a, b) in enumerate(zip(second.scores, first.scores)):
        assert torch.equal(a, b), f"scores of step {step} differ"
    assert cache.get_seq_length() == 96 - suffix  # the prefix cache itself was never written


@families
def test_decoding_on_a_cache_the_patch_never_prefilled_is_refused(family):
    """A prefix cache filled by the unpatched model holds no CIS state: continuing it with one token
    (a decode step) must say so, not decode with another call's anchors; a multi-token suffix is a
    prefill over the cache and works (it equals the same continuation of a patched prefix)."""
    model = tiny_model(family, layers=2)
    ids, _ = padded_batch([96], seed=3)
    with torch.no_grad():
        unpatched_cache = DynamicCache(config=model.config)
        model(ids[:, :95], past_key_values=unpatched_cache, use_cache=True)
        prefix8 = DynamicCache(config=model.config)
        model(ids[:, :88], past_key_values=prefix8, use_cache=True)
    _patch(model, "sparse")
    _gen(model, *padded_batch([70, 50], seed=4))  # a call whose anchors must not be reused
    with pytest.raises(ValueError, match="prefill"):
        _gen(model, ids, _ones(ids), past_key_values=unpatched_cache)
    with torch.no_grad():
        patched8 = DynamicCache(config=model.config)
        model(ids[:, :88], past_key_values=patched8, use_cache=True)
    _same(_gen(model, ids, _ones(ids), new=8, past_key_values=prefix8),
          _gen(model, ids, _ones(ids), new=8, past_key_values=patched8), what="8-token suffix")


# ---------------------------------------------------------------------------- copy.deepcopy(model)


@families
@pytest.mark.parametrize("used", [False, True], ids=["fresh", "after_generate"])
def test_deepcopy_of_a_patched_model_is_an_independent_patched_model(family, used):
    base = tiny_model(family, layers=2)
    ids, mask = padded_batch([44, 36], seed=6)
    other_ids, other_mask = padded_batch([52, 30], seed=7)
    model = copy.deepcopy(base)
    _patch(model, "sparse")
    if used:
        _gen(model, ids, mask)
        with torch.no_grad():
            model(other_ids, attention_mask=other_mask)
    clone = copy.deepcopy(model)
    fresh = copy.deepcopy(base)
    _patch(fresh, "sparse")
    expected = _gen(fresh, ids, mask)

    assert prhs_hf.is_patched(clone) and clone.config._attn_implementation == "prhs"
    assert getattr(clone, RUNTIME_ATTRIBUTE) is not getattr(model, RUNTIME_ATTRIBUTE)
    before = prhs_hf.telemetry(model).as_dict()
    _same(_gen(clone, ids, mask), expected, what="the copy")
    _gen(clone, other_ids, other_mask)
    assert prhs_hf.telemetry(model).as_dict() == before, "the copy's runs changed the original's telemetry"
    _same(_gen(model, ids, mask), expected, what="the original after the copy ran")
    _same(_gen(clone, ids, mask), expected, what="the copy after the original ran")

    prhs_hf.unpatch(clone)  # unpatching the copy leaves the original patched
    assert prhs_hf.is_patched(model) and not prhs_hf.is_patched(clone)
    _same(_gen(model, ids, mask), expected, what="the original after unpatching the copy")
    _same(_gen(clone, ids, mask), _gen(base, ids, mask), what="the unpatched copy")


# ------------------------------------------------------------------------------------------- threads


@families
@pytest.mark.parametrize("config", ["sparse", "covering"])
def test_two_threads_generate_as_sequential_calls(family, config):
    model = tiny_model(family, layers=2)
    if config == "sparse":
        a, b = padded_batch([64], seed=8), padded_batch([58, 41], seed=9)
    else:
        a, b = padded_batch([20], seed=8), padded_batch([18, 11], seed=9)
    calls = [lambda: _gen(model, *a, new=6), lambda: _gen(model, *b, new=6)]
    unpatched = [call() for call in calls]
    _patch(model, config)
    sequential = [call() for call in calls]
    if config == "covering":
        for got, ref in zip(sequential, unpatched):
            _same(got, ref, logits=False, what="sequential, against unpatched")
    else:
        _assert_sparse_and_sharing(model)
    for rep in range(3):
        concurrent = _in_threads(calls)
        for i, (got, ref) in enumerate(zip(concurrent, sequential)):
            _same(got, ref, what=f"repetition {rep}, thread {i}")


# ------------------------------------------------------------------------------ assisted generation


@families
def test_assisted_generation(family):
    """Greedy assisted decoding writes the main model's greedy tokens. The prompts are batch 1:
    transformers 5.17 refuses more ("assisted generate is only supported for batch_size = 1"), patched
    or not. The main model attends densely in assisted decoding (its verification forwards check
    several tokens at once: test_assisted_decoding_under_a_sparse_config_is_dense_and_says_so); a
    patched assistant drafts with its own config."""
    model = tiny_model(family, layers=2)
    assistant = tiny_model(family, layers=1, seed=1)
    ids, mask = padded_batch([20], seed=10)
    unpatched = _gen(model, ids, mask, new=8)
    _patch(model, "covering")
    plain = _gen(model, ids, mask, new=8)
    _same(plain, unpatched, logits=False, what="plain greedy")
    assisted = _gen(model, ids, mask, new=8, assistant_model=assistant)
    _same(assisted, plain, logits=False, what="assistant unpatched")
    _patch(assistant, "covering")
    assisted = _gen(model, ids, mask, new=8, assistant_model=assistant)
    _same(assisted, plain, logits=False, what="assistant patched")

    # sparse: runs, on a prompt over the budget, with the assistant patched or not
    ids, mask = padded_batch([64], seed=11)
    _patch(model, "sparse")
    for patched_assistant in (True, False):
        if patched_assistant:
            _patch(assistant, "sparse")
        else:
            prhs_hf.unpatch(assistant)
        with pytest.warns(UserWarning, match="assisted decoding"):
            out = _gen(model, ids, mask, new=8, assistant_model=assistant)
        assert out.sequences.shape == (1, 72)
        assert torch.equal(out.sequences[:, :64], ids) and int(out.sequences.max()) < 128


# --------------------------------------------------------------------------------- streaming (thread)


class TokenCollector(BaseStreamer):
    """A streamer without a tokenizer: keeps every tensor ``generate()`` puts (the prompt first)."""

    def __init__(self):
        self.values: list[torch.Tensor] = []
        self.ended = False

    def put(self, value):
        self.values.append(value.detach().clone())

    def end(self):
        self.ended = True


def _stream(model, ids, mask, new: int = 6):
    """``generate()`` with a :class:`TokenCollector` in a thread: ``(returned sequences, streamed new tokens)``."""
    streamer, box = TokenCollector(), {}

    def target():
        try:
            with torch.no_grad():
                box["out"] = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, streamer=streamer)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the streaming generate() hung"
    if "error" in box:
        raise box["error"]
    assert streamer.ended
    assert torch.equal(streamer.values[0].reshape(-1), ids[0])
    streamed = torch.cat([v.reshape(-1) for v in streamer.values[1:]])
    return box["out"], streamed


@families
def test_streaming_in_a_thread(family):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([20], seed=12)
    unpatched, unpatched_streamed = _stream(model, ids, mask)
    assert torch.equal(unpatched_streamed, unpatched[0, 20:])
    _patch(model, "covering")
    out, streamed = _stream(model, ids, mask)
    assert torch.equal(streamed, out[0, 20:])
    assert torch.equal(out, unpatched)

    ids, mask = padded_batch([64], seed=13)
    _patch(model, "sparse")
    out, streamed = _stream(model, ids, mask)
    assert torch.equal(streamed, out[0, 64:])
    assert torch.equal(out, _gen(model, ids, mask, new=6).sequences)
    _assert_sparse_and_sharing(model)


# --------------------------------------------------------------------- sampling, num_return_sequences


@families
@pytest.mark.parametrize("config", ["dense", "covering", "sparse"])
def test_sampling_with_num_return_sequences(family, config):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([48, 36] if config == "sparse" else [20, 14], seed=14)

    def sample():
        torch.manual_seed(1234)
        return _gen(model, ids, mask, new=6, do_sample=True, num_return_sequences=3, top_k=20, temperature=0.9)

    unpatched = sample()
    _patch(model, config)
    got = sample()
    assert got.sequences.shape == (6, ids.shape[1] + 6)
    if config == "sparse":
        _assert_sparse_and_sharing(model)
        _same(sample(), got, what="the same seed again")
        assert torch.equal(got.sequences[:, : ids.shape[1]], ids.repeat_interleave(3, 0))
    else:
        _check(got, unpatched, config)


# ----------------------------------------------------------------------------------------- beam search


@families
@pytest.mark.parametrize("config", ["dense", "covering", "sparse"])
def test_beam_search_with_two_returned_sequences(family, config):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([48, 36] if config == "sparse" else [20, 14], seed=15)

    def beams():
        return _gen(model, ids, mask, new=5, num_beams=3, num_return_sequences=2, output_scores=True)

    unpatched = beams()
    _patch(model, config)
    got = beams()
    assert got.sequences.shape == (4, ids.shape[1] + 5)
    assert got.sequences_scores.shape == (4,)
    if config == "sparse":
        _assert_sparse_and_sharing(model)
        assert torch.equal(got.sequences[:, : ids.shape[1]], ids.repeat_interleave(2, 0))
        assert int(got.sequences.max()) < 128
        _same(beams(), got, what="the same beam search again")
    else:
        _check(got, unpatched, config)
        if config == "dense":
            assert torch.equal(got.sequences_scores, unpatched.sequences_scores)


# ------------------------------------------------------------------------------------- inputs_embeds


@families
@pytest.mark.parametrize("config", ["dense", "covering", "sparse"])
def test_inputs_embeds_instead_of_input_ids(family, config):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([48, 36] if config == "sparse" else [20, 14], seed=16)
    embeds = model.get_input_embeddings()(ids).detach()
    unpatched = _gen(model, mask=mask, inputs_embeds=embeds)
    _patch(model, config)
    got = _gen(model, mask=mask, inputs_embeds=embeds)
    assert got.sequences.shape == (2, NEW)  # a decoder-only model given embeddings returns the new tokens
    if config == "sparse":
        _assert_sparse_and_sharing(model)
        from_ids = _gen(model, ids, mask)
        assert torch.equal(got.sequences, from_ids.sequences[:, ids.shape[1]:])
        for step, (a, b) in enumerate(zip(got.logits, from_ids.logits)):
            assert torch.equal(a, b), f"logits of step {step}: embeddings and ids differ"
    else:
        _check(got, unpatched, config)


# ------------------------------------------------------------------------- save_pretrained / reload


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


CPE_TORCH = ("cpe", TORCH_BACKENDS)  # PSAW + ETF: ETF wraps q_proj/o_proj/mlp, which must not reach the weights


@families
def test_save_pretrained_of_a_patched_model_loads_and_repatches(family, tmp_path):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([20, 14], seed=17)
    ref = _logits(model, ids, mask)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prhs_hf.patch(model, *CPE_TORCH)
    sparse = _gen(model, ids, mask)
    model.save_pretrained(tmp_path)
    assert prhs_hf.is_patched(model) and model.config._attn_implementation == "prhs"  # saving leaves the patch on

    for name in ("config.json", "generation_config.json"):
        if (tmp_path / name).exists():
            text = (tmp_path / name).read_text()
            assert "prhs" not in text, f"{name} carries the PrHS attention implementation:\n{text}"
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("attn_implementation") in (None, "sdpa") and saved.get("_attn_implementation") in (None, "sdpa")

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not prhs_hf.is_patched(loaded) and loaded.config._attn_implementation == "sdpa"
    assert set(loaded.state_dict()) == set(state)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(_logits(loaded, ids, mask), ref)
    _patch(loaded, "dense")
    assert torch.equal(_logits(loaded, ids, mask), ref)
    # from_pretrained leaves the weights in the safetensors file's memory map, where a tensor may start
    # 40 bytes past a 64-byte boundary; CPU kernels then round some sums differently (qwen2_moe's step 3
    # under cpe: 1.5e-8), patched or not. Owned copies make the bit-for-bit comparison about PrHS alone.
    for p in loaded.parameters():
        p.data = p.data.clone()
    prhs_hf.patch(loaded, *CPE_TORCH)
    _same(_gen(loaded, ids, mask), sparse, what="the reloaded model under cpe")


@pytest.mark.slow
def test_saved_patched_models_load_in_a_fresh_unpatched_process(tmp_path):
    """A fresh process that never imports prhs_hf (so "prhs" is not registered) loads every family
    saved while patched, with the unpatched logits; re-patching it there works."""
    ids, mask = padded_batch([20, 14], seed=18)
    refs = {}
    for family in FAMILIES:
        model = tiny_model(family, layers=2)
        refs[family] = _logits(model, ids, mask)
        prhs_hf.patch(model, *CPE_TORCH)
        model.save_pretrained(tmp_path / family)
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = textwrap.dedent(
        """
        import sys, torch, transformers
        torch.set_num_threads(1)  # as the parent (the _one_torch_thread fixture): the same rounding
        root, families = sys.argv[1], sys.argv[2:]
        inputs = torch.load(f"{root}/inputs.pt")
        out = {}
        for family in families:
            model = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/{family}").eval()
            with torch.no_grad():
                out[family] = (model.config._attn_implementation, model(inputs["ids"], attention_mask=inputs["mask"]).logits)
        assert "prhs_hf" not in sys.modules
        import prhs_hf
        for family in families:
            model = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/{family}").eval()
            prhs_hf.patch(model, "dense")
            with torch.no_grad():
                out[family] += (model(inputs["ids"], attention_mask=inputs["mask"]).logits,)
        torch.save(out, f"{root}/out.pt")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and "subprocess_site" not in p)}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), *FAMILIES], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    for family, ref in refs.items():
        implementation, fresh, repatched = out[family]
        assert implementation == "sdpa", family
        assert torch.equal(fresh, ref), family
        assert torch.equal(repatched, ref), family


# ------------------------------------------------------------------------------------------ dtype moves


@families
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dtype_move_after_patch(family, dtype):
    base = tiny_model(family, layers=2)
    short, short_mask = padded_batch([20, 14], seed=19)
    ids, mask = padded_batch([44, 36], seed=20)

    # dense: patched in fp32 (and run), then moved: bit for bit the unpatched model at that dtype
    unpatched = copy.deepcopy(base).to(dtype)
    model = copy.deepcopy(base)
    _patch(model, "dense")
    _gen(model, short, short_mask)
    model.to(dtype)
    _same(_gen(model, short, short_mask), _gen(unpatched, short, short_mask), what="dense")

    # covering: the unpatched tokens at that dtype (logits within the dtype's rounding)
    model = copy.deepcopy(base)
    _patch(model, "covering")
    _gen(model, short, short_mask)
    model.to(dtype)
    got, ref = _gen(model, short, short_mask), _gen(unpatched, short, short_mask)
    _same(got, ref, logits=False, what="covering")
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)

    # sparse: patch then move (after a run in fp32) == move then patch, bit for bit
    moved_after = copy.deepcopy(base)
    _patch(moved_after, "sparse")
    _gen(moved_after, ids, mask)
    moved_after.to(dtype)
    moved_before = copy.deepcopy(base).to(dtype)
    _patch(moved_before, "sparse")
    _same(_gen(moved_after, ids, mask), _gen(moved_before, ids, mask), what="sparse")


# ------------------------------------------------------------------------------------ eager attention


@families
def test_eager_model_patched_dense_is_bit_equal_with_attentions(family):
    model = tiny_model(family, layers=2)
    model.set_attn_implementation("eager")
    base = copy.deepcopy(model)
    ids, mask = padded_batch([20, 14], seed=21)
    with torch.no_grad():
        ref = base(ids, attention_mask=mask, output_attentions=True)
    _patch(model, "dense")
    with torch.no_grad():
        got = model(ids, attention_mask=mask, output_attentions=True)
    assert torch.equal(got.logits, ref.logits), "logits differ from the unpatched eager model"
    assert got.attentions is not None and len(got.attentions) == 2
    for layer, (a, b) in enumerate(zip(got.attentions, ref.attentions)):
        assert a is not None, f"layer {layer}: no attention weights"
        assert torch.equal(a, b), f"layer {layer}: attention weights differ"
    _same(_gen(model, ids, mask), _gen(base, ids, mask), what="generate")
    prhs_hf.unpatch(model)
    assert model.config._attn_implementation == "eager"


# ------------------------------------------------------------------------------ training with dropout


def _train_loss(model, ids, seed: int = 5):
    torch.manual_seed(seed)
    return model(ids, labels=ids, use_cache=False).loss


def _set_dropout(model, p: float) -> None:
    for layer in decoder_layers(model):
        layer.self_attn.attention_dropout = p


@families
def test_training_with_attention_dropout_is_not_silently_dropout_free(family):
    """cpe with PSAW and ETF from layer 0 (every layer plans its prefill), ``train()``, attention
    dropout 0.3: the loss must use the dropout (so differ from the loss with dropout 0 at the same
    seed), or the patched model must refuse with an error that names dropout/training."""
    model = tiny_model(family, layers=2, attention_dropout=0.3)
    assert all(layer.self_attn.attention_dropout == 0.3 for layer in decoder_layers(model))
    prhs_hf.patch(model, "cpe", overrides={"psaw": {"start_layer": 0}, "etf": {"start_layer": 0}, **TORCH_BACKENDS})
    model.train()
    ids, _ = padded_batch([180], seed=22)
    try:
        with_dropout = _train_loss(model, ids)
    except (ValueError, RuntimeError) as exc:
        assert re.search(r"(?i)dropout|train", str(exc)), f"unclear error: {exc}"
        return
    assert torch.isfinite(with_dropout)
    _set_dropout(model, 0.0)
    without = _train_loss(model, ids)
    assert not torch.equal(with_dropout, without), "attention dropout 0.3 was silently ignored by the patched layers"


@families
@pytest.mark.parametrize("config", ["dense", "cis"])
def test_training_with_attention_dropout_under_a_dense_prefill_config(family, config):
    """Configs whose prefill attends densely ("dense"; "cis": CIS acts on decode steps only) train like
    the unpatched model: the same loss under dropout 0.3 at the same seed (bit for bit with "dense",
    which keeps transformers' path), and not the dropout-free loss; the gradients flow."""
    model = tiny_model(family, layers=2, attention_dropout=0.3).train()
    ids, _ = padded_batch([60], seed=25)
    ref = _train_loss(model, ids)
    prhs_hf.patch(model, config, overrides=TORCH_BACKENDS)
    loss = _train_loss(model, ids)
    if config == "dense":
        assert torch.equal(loss, ref)
    else:
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())
    _set_dropout(model, 0.0)
    assert not torch.equal(_train_loss(model, ids), loss), "attention dropout 0.3 was silently ignored"


# ------------------------------------------------------------------------------------- chunked prefill


@families
def test_chunked_prefill_gives_the_unchunked_tokens(family):
    """generate(prefill_chunk_size=...) (transformers' chunked prefill, for long batched prompts): the
    chunks after the first are prefills over a cache; with left padding the first chunk of a short
    sequence is mostly pads. "dense" equals the unpatched chunked run bit for bit; a sparse CIS config
    gives its unchunked tokens (its prefill is dense either way)."""
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([90, 70], seed=21)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    unpatched = model.generate(ids, prefill_chunk_size=32, **kw)
    with prhs_hf.patch(model, "dense"):
        assert torch.equal(model.generate(ids, prefill_chunk_size=32, **kw), unpatched)
    with prhs_hf.patch(model, "cis", overrides={"budget": {"sink": 4, "local": 8, "topk": 16},
                                                 "backend": {"decode": "torch"}, "policy": {"decode": "sparse"},
                                                 "telemetry": {"enabled": True}}) as handle:
        whole = model.generate(ids, **kw)
        chunked = model.generate(ids, prefill_chunk_size=32, **kw)
    assert torch.equal(whole, chunked)
    assert handle.telemetry().sparse_sequence_steps > 0


# ------------------------------------------------------------- transformers' edits of a returned cache


def _continue(model, first, ids, mask, rows=None, new: int = 6, **kw):
    """Continue ``first`` (a generate() output) from its cache with its sequences (their last token is
    not in the cache yet: the continuation's first forward is a decode step), rows ``rows`` of them."""
    seq = first.sequences
    mask2 = torch.cat([mask, _ones(seq[:, ids.shape[1]:])], 1)
    if rows is not None:
        seq, mask2 = seq[rows], mask2[rows]
    return _gen(model, seq, mask2, new=new, **kw)


@families
def test_reordered_cache_continues_each_row_with_its_own_state(family):
    """``cache.reorder_cache(perm)`` moves every row's CIS state with its keys: the continuation of the
    permuted rows is the permuted continuation. Turn 1 stops mid-block (2 of 4 steps), so the anchors
    of the block in progress are read by the next steps."""
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    first = _gen(model, ids, mask, new=3)
    expected = _continue(model, first, ids, mask, past_key_values=copy.deepcopy(first.past_key_values))
    perm = torch.tensor([1, 0])
    cache = copy.deepcopy(first.past_key_values)
    cache.reorder_cache(perm)
    got = _continue(model, first, ids, mask, rows=perm, past_key_values=cache)
    assert torch.equal(got.sequences, expected.sequences[perm])
    for a, b in zip(got.logits, expected.logits):  # (MoE experts sum the rows in another order: not bit for bit)
        torch.testing.assert_close(a, b[perm], rtol=1e-5, atol=1e-6)
    _assert_sparse_and_sharing(model)


@families
@pytest.mark.parametrize("edit", ["select", "repeat"])
def test_batch_select_and_repeat_of_the_cache_carry_the_state(family, edit):
    """``batch_select_indices`` / ``batch_repeat_interleave`` of a returned cache (what transformers does
    to expand or prune a batch) change the batch of the CIS state with the cache's: the continuation of
    the kept (or repeated) rows writes their tokens of the whole batch's continuation."""
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    first = _gen(model, ids, mask, new=3)
    expected = _continue(model, first, ids, mask, past_key_values=copy.deepcopy(first.past_key_values))
    cache = copy.deepcopy(first.past_key_values)
    if edit == "select":
        rows = torch.tensor([1])
        cache.batch_select_indices(indices=rows)  # (by keyword, as the methods' signatures allow)
    else:
        rows = torch.tensor([0, 0, 1, 1])
        cache.batch_repeat_interleave(repeats=2)
    got = _continue(model, first, ids, mask, rows=rows, past_key_values=cache)
    assert torch.equal(got.sequences, expected.sequences[rows])
    _assert_sparse_and_sharing(model)


@families
def test_cropped_cache_continues_as_the_shorter_generation(family):
    """``cache.crop(-n)`` (a rewind) puts the CIS state back with the cache where that is exact: turn 1
    runs 4 decode steps, the crop removes the last 2 (steps 3 and 4 of a block of 4), and the
    continuation is the one of a generation that stopped there, bit for bit, with no warning."""
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    whole = _gen(model, ids, mask, new=9)
    first = _gen(model, ids, mask, new=5)  # the prompt's token, then 4 decode steps
    cache = first.past_key_values
    cache.crop(-2)
    shorter = first.sequences[:, : ids.shape[1] + 3]  # 3 new tokens; the last one is not in the cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gen(model, shorter, torch.cat([mask, _ones(shorter[:, ids.shape[1]:])], 1), new=6, past_key_values=cache)
    assert torch.equal(got.sequences, whole.sequences)
    for step, (a, b) in enumerate(zip(got.logits, whole.logits[3:])):
        assert torch.equal(a, b), f"logits of step {step} differ from the uncropped generation"
    _assert_sparse_and_sharing(model)


def test_crop_past_a_block_end_starts_the_state_over_with_a_warning():
    """A crop back past the end of a block that a later step overwrote cannot put the anchors back: the
    next step says so and starts CIS over (as after a prefill). A crop into the prompt starts over
    silently, as a prefill of what is left does."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    first = _gen(model, ids, mask, new=8)  # 7 decode steps: a block ended at step 4, step 5 overwrote it
    cache = first.past_key_values
    cache.crop(-5)
    shorter = first.sequences[:, : ids.shape[1] + 3]
    mask2 = torch.cat([mask, _ones(shorter[:, ids.shape[1]:])], 1)
    with pytest.warns(UserWarning, match=r"crop.*starts over"):
        out = _gen(model, shorter, mask2, past_key_values=cache)
    assert torch.equal(out.sequences[:, : shorter.shape[1]], shorter)

    def into_the_prompt(decode_steps: int):
        """Continue from 40 of the prompt's 44 tokens, cropped off a cache that ran ``decode_steps``."""
        cache = _gen(model, ids, mask, new=decode_steps + 1).past_key_values
        cache.crop(-(cache.get_seq_length() - 40))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return _gen(model, ids[:, :41], mask[:, :41], past_key_values=cache)

    _same(into_the_prompt(7), into_the_prompt(0), what="crop into the prompt")


def test_a_batch_changed_behind_the_states_back_is_refused():
    """A cache whose batch was changed other than through its own methods (its layers' tensors
    replaced) holds no state for the new rows: the decode step says so instead of failing inside CIS."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "covering")
    first = _gen(model, ids, mask, new=3)
    cache = first.past_key_values
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:1], layer.values[:1]
    with pytest.raises(ValueError, match=r"(?i)batch.*reorder_cache, batch_select_indices"):
        _continue(model, first, ids, mask, rows=torch.tensor([0]), past_key_values=cache)


# --------------------------------------------------------------- assisted decoding, attention weights


@pytest.mark.parametrize("how", ["assistant_model", "prompt_lookup"])
def test_assisted_decoding_under_a_sparse_config_is_dense_and_says_so(how):
    """Assisted and prompt-lookup decoding verify several tokens in one forward, which the sparse decode
    step does not run: the patched model says so and attends densely throughout, so the tokens are the
    unpatched model's greedy tokens (not a mix of dense verification forwards and sparse single steps)."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([64], seed=11)
    kw = {"assistant_model": tiny_model("llama", layers=1, seed=1)} if how == "assistant_model" else {
        "prompt_lookup_num_tokens": 3}
    unpatched = _gen(model, ids, mask, new=20)
    _patch(model, "sparse")
    with pytest.warns(UserWarning, match=r"assisted decoding.*densely"):
        got = _gen(model, ids, mask, new=20, **kw)
    _same(got, unpatched, logits=False, what=how)
    assert prhs_hf.telemetry(model).sparse_sequence_steps == 0
    assert _gen(model, ids, mask, new=6).sequences.shape == (1, 70)  # and the next plain call is sparse again
    assert prhs_hf.telemetry(model).sparse_sequence_steps > 0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_output_attentions_under_a_sparse_config_is_refused(attn):
    """PrHS attention computes no weights: asking for them is an error that says what gives them, not
    empty tuples. A config that keeps the model's own attention ("dense") still returns them."""
    model = tiny_model("llama", layers=2)
    model.set_attn_implementation(attn)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    with pytest.raises(ValueError, match=r"output_attentions.*'dense'"), torch.no_grad():
        model(ids, attention_mask=mask, output_attentions=True)
    with pytest.raises(ValueError, match=r"output_attentions"):
        _gen(model, ids, mask, output_attentions=True)
    assert _gen(model, ids, mask).sequences.shape == (2, 48)  # the model still works


# ------------------------------------------------------------------- PyTorch and transformers operations


def test_second_turn_under_no_grad_after_a_first_under_inference_mode():
    """lm-eval style: turn 1 under ``torch.inference_mode()``, turn 2 on its cache under ``no_grad``. The
    cache's buffers made in inference mode must not make turn 2's in-place writes fail."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    first = _gen(model, ids, mask, new=3)
    expected = _continue(model, first, ids, mask, past_key_values=copy.deepcopy(first.past_key_values))
    with torch.inference_mode():
        first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                               output_logits=True)
    _same(_continue(model, first, ids, mask, past_key_values=first.past_key_values), expected, what="turn 2")


def test_set_attn_implementation_after_patch_is_refused_and_unpatch_keeps_it():
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"set to 'eager' after prhs_hf.patch"):
        _gen(model, ids, mask)
    prhs_hf.unpatch(model)
    assert model.config._attn_implementation == "eager"  # the user's choice stays
    _patch(model, "sparse")  # and patching again works
    assert _gen(model, ids, mask).sequences.shape == (2, 48)
    prhs_hf.unpatch(model)
    assert model.config._attn_implementation == "eager"


def test_torch_save_of_a_patched_model_loads_patched(tmp_path):
    """``torch.save(model)`` pickles the model: a patched one loads patched with the same config (as
    ``copy.deepcopy`` gives), and the saved model stays patched."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    _patch(model, "sparse")
    expected = _gen(model, ids, mask)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert prhs_hf.is_patched(loaded) and loaded.config._attn_implementation == "prhs"
    assert getattr(loaded, RUNTIME_ATTRIBUTE).resolved.config == getattr(model, RUNTIME_ATTRIBUTE).resolved.config
    _same(_gen(loaded, ids, mask), expected, what="the loaded model")
    assert prhs_hf.is_patched(model)
    _same(_gen(model, ids, mask), expected, what="the saved model")
    prhs_hf.unpatch(loaded)
    assert loaded.config._attn_implementation == "sdpa"


def test_a_prefix_cache_for_several_return_sequences_is_expanded_first():
    """generate(num_return_sequences=2) on a batch-1 prefix cache: transformers repeats input_ids, not
    the cache (unpatched, a size mismatch deep in the cache's update). Patched, the error says what to do;
    expanded with its own ``batch_repeat_interleave`` the cache carries its CIS state along, and both
    returned sequences are the one continuation of the prefix (sampling from the top 1: greedy)."""
    model = tiny_model("llama", layers=2)
    ids, _ = padded_batch([96], seed=3)
    _patch(model, "sparse")
    with torch.no_grad():
        prefix = DynamicCache(config=model.config)
        model(ids[:, :95], past_key_values=prefix, use_cache=True)
    single = _gen(model, ids, _ones(ids), new=8, past_key_values=copy.deepcopy(prefix))
    two = dict(new=8, num_return_sequences=2, do_sample=True, top_k=1)
    with pytest.raises(ValueError, match=r"holds 1 sequences.*batch_repeat_interleave"):
        _gen(model, ids, _ones(ids), past_key_values=copy.deepcopy(prefix), **two)
    expanded = copy.deepcopy(prefix)
    expanded.batch_repeat_interleave(2)
    got = _gen(model, ids, _ones(ids), past_key_values=expanded, **two)
    assert torch.equal(got.sequences, single.sequences.repeat(2, 1))
    _assert_sparse_and_sharing(model)


@pytest.mark.parametrize("cis", [{"index": "fp8"}, {"tail_slot": True}, {"selection": "group"}],
                         ids=["key_index", "tail_slot", "group"])
def test_batch_edits_carry_every_part_of_the_cis_state(cis):
    """The key index, the tail pairs and grouped anchors have a batch axis too: a repeat then a select of
    the returned cache continue each row as the whole batch's continuation does."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 33], seed=1)
    prhs_hf.patch(model, "cis", overrides={**SPARSE, "cis": {**SPARSE["cis"], **cis}})
    first = _gen(model, ids, mask, new=3)
    expected = _continue(model, first, ids, mask, past_key_values=copy.deepcopy(first.past_key_values))
    cache = copy.deepcopy(first.past_key_values)
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([3, 0]))
    got = _continue(model, first, ids, mask, rows=torch.tensor([1, 0]), past_key_values=cache)
    assert torch.equal(got.sequences, expected.sequences[[1, 0]])
    _assert_sparse_and_sharing(model)
