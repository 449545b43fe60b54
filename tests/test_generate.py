"""PrHS under model.generate(): budgets, left padding, GQA/MHA, caches, beams, sampling."""

import pytest
import torch

import prhs_hf
from prhs_hf.selectors.cis_state import CISState
from prhs_hf.ops.triton_support import HAS_TRITON, interpreting
from tiny_models import FAMILIES, decode_by_backend, padded_batch, tiny_model

SMALL_CPE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4}, "psaw": {"enabled": True},
             "etf": {"enabled": True}, "backend": {"prefill": "torch", "decode": "torch"}}  # a section left out is off


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def test_budget_covering_the_context_equals_dense():
    model = tiny_model("llama")
    ids, mask = padded_batch([90, 70])
    dense = _generate(model, ids, mask, max_new_tokens=12)
    prhs_hf.patch(model, {"budget": {"sink": 8, "local": 32, "topk": 200}, "cis": {"enabled": True},
                          "psaw": {"enabled": False}, "etf": {"enabled": False}, "telemetry": {"enabled": True}})
    sparse = _generate(model, ids, mask, max_new_tokens=12)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    assert torch.equal(sparse, dense)
    assert report.sparse_sequence_steps == 0 and report.processed_kv_per_step == report.dense_kv_per_step


@pytest.mark.parametrize("config", ["cis", "cpe"])
def test_left_padded_batch_equals_each_sequence_alone(config):
    cfg = SMALL_CPE if config == "cpe" else {**SMALL_CPE, "psaw": {"enabled": False}, "etf": {"enabled": False}}
    model = tiny_model("llama")
    lengths = [70, 45, 58]
    ids, mask = padded_batch(lengths)
    prhs_hf.patch(model, cfg)
    batch = _generate(model, ids, mask, max_new_tokens=10)
    for i, n in enumerate(lengths):
        alone = _generate(model, ids[i : i + 1, -n:], mask[i : i + 1, -n:], max_new_tokens=10)
        assert torch.equal(batch[i, -10:], alone[0, -10:]), f"sequence {i}"
    prhs_hf.unpatch(model)


def test_pads_are_never_selected_and_sinks_are_the_first_real_tokens():
    model = tiny_model("llama")
    ids, mask = padded_batch([60, 40])
    seen, looked_up = [], set()
    prhs_hf.patch(model, {**SMALL_CPE, "psaw": {"enabled": False}, "etf": {"enabled": False}})
    runtime = model._prhs_runtime
    ops = runtime.ops_for(torch.device("cpu"))

    class Spy:
        def __getattr__(self, name):
            looked_up.add(name)
            return getattr(ops, name)

        def sparse_decode_attention(self, q, k, v, pad, idx, count, scale):
            seen.append((pad.clone(), idx.clone(), count.clone(), k.shape[-2]))
            return ops.sparse_decode_attention(q, k, v, pad, idx, count, scale)

    runtime._ops[torch.device("cpu")] = Spy()
    _generate(model, ids, mask, max_new_tokens=5)
    prhs_hf.unpatch(model)
    assert seen
    # the selection ran on the same table as the attention: the runtime's for the device, passed to the selector
    assert {"cis_match", "topk_retrieval"} <= looked_up
    for pad, idx, count, slots in seen:
        assert pad.tolist() == [0, 20]
        for b in range(2):
            t = slots - int(pad[b])
            for h in range(idx.shape[1]):
                chosen = idx[b, h, : count[b, h]]
                assert chosen.min() >= 0 and chosen.max() < t  # real indices: pads excluded
                assert chosen[:4].tolist() == [0, 1, 2, 3]  # the sinks are the first real tokens
                assert (idx[b, h, count[b, h] :] == -1).all()


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_gqa_and_mha_dynamic_and_static_cache_agree(heads, kv_heads):
    model = tiny_model("qwen3", heads=heads, kv_heads=kv_heads)
    ids, mask = padded_batch([64, 50])
    prhs_hf.patch(model, SMALL_CPE)
    dynamic = _generate(model, ids, mask, max_new_tokens=8)
    static = _generate(model, ids, mask, max_new_tokens=8, cache_implementation="static")
    prhs_hf.unpatch(model)
    assert torch.equal(dynamic, static)


def test_beam_search_reorders_the_cis_state(monkeypatch):
    model = tiny_model("llama")
    ids, mask = padded_batch([60, 52])
    prhs_hf.patch(model, SMALL_CPE)
    calls = []
    original = CISState.reorder

    def spy(self, index):
        before = (self.anchor_q.clone(), self.anchor_idx.clone(), self.anchor_count.clone())
        original(self, index)
        calls.append((index.clone(), self.anchor_q.shape[:2]))
        assert torch.equal(self.anchor_q, before[0][:, index])
        assert torch.equal(self.anchor_idx, before[1][:, index])
        assert torch.equal(self.anchor_count, before[2][:, index])

    monkeypatch.setattr(CISState, "reorder", spy)
    out = _generate(model, ids, mask, max_new_tokens=6, num_beams=3)
    prhs_hf.unpatch(model)
    assert out.shape == (2, 66)
    assert calls and all(c.shape == (6,) and shape == (4, 6) for c, shape in calls)  # layers, batch x beams


def test_sampling_runs():
    model = tiny_model("glm4")
    ids, mask = padded_batch([60, 48])
    prhs_hf.patch(model, SMALL_CPE)
    torch.manual_seed(3)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9)
    prhs_hf.unpatch(model)
    assert out.shape == (2, 68) and int(out.max()) < 128


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (on a GPU: tests/test_model_gpu.py)")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_decode_equals_the_reference_token_for_token_in_every_family(family):
    """fp32: the Triton decode step (interpreted) writes the PyTorch reference's tokens, with the
    same retrievals, in every supported family (GQA 4/2; qwen3/glm head_dim 16, partial rotary, MoE)."""
    runs = decode_by_backend(family)
    (ref, ref_rho, ref_steps), (tri, tri_rho, tri_steps) = runs["torch"], runs["triton"]
    assert torch.equal(ref, tri)
    assert (ref_rho, ref_steps) == (tri_rho, tri_steps)
    assert ref_steps > 0 and 0 < ref_rho < 1  # sparse steps ran, and both retrievals and sharing happened


# ------------------------------------------------------------------ generation.stop_check_every: the loop

#: CIS well below the prompts (4 + 8 + 16 keys, blocks of 4, tau 0: rows retrieve and share), reference backends
SPARSE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.0},
          "backend": {"prefill": "torch", "decode": "torch"}}
EVERY = 8


def _loop(config: dict, every: int) -> dict:
    return {**config, "generation": {"stop_check_every": every}}


def _counted(model, **kw):
    """``model.generate(**kw)`` (no grad) and the number of forwards it ran."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            out = model.generate(**kw)
    finally:
        handle.remove()
    return out, len(calls)


def _eos_mid(model, kw: dict, seed: int) -> list[int]:
    """EOS ids that end row r of ``kw``'s generation at its step 1 + 2 r at the latest (read off a run
    without EOS): some rows stop early, and all (at most 4 rows) before step 8, the first stop check."""
    torch.manual_seed(seed)
    with torch.no_grad():
        ref = model.generate(**kw)
    start = kw["input_ids"].shape[1]
    assert ref.shape[0] <= 4
    return sorted({int(ref[r, start + 2 * r]) for r in range(ref.shape[0])})


def _assert_same_output(got, expected, what: str) -> None:
    """Same sequences, scores, logits and cache (every layer's keys and values, bit for bit)."""
    assert torch.equal(got.sequences, expected.sequences), f"{what}: tokens differ\n{got.sequences}\n{expected.sequences}"
    for field in ("scores", "logits"):
        a, b = getattr(got, field) or (), getattr(expected, field) or ()
        assert len(a) == len(b), f"{what}: {len(a)} {field} against {len(b)}"
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{what}: {field} differ"
    ca, cb = got.past_key_values, expected.past_key_values
    assert type(ca) is type(cb) and len(ca.layers) == len(cb.layers)
    for la, lb in zip(ca.layers, cb.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values), f"{what}: cache differs"
    assert int(ca.get_seq_length()) == int(cb.get_seq_length())


MODES = {
    "greedy": {},
    "sampling": {"do_sample": True, "top_k": 20, "temperature": 0.9},
    "num_return_sequences": {"do_sample": True, "num_return_sequences": 2},
    "beams": {"num_beams": 3, "num_return_sequences": 2},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("config", ["sparse", "dense"])
def test_stop_check_every_n_returns_what_every_step_returns(mode, config):
    """EOS ends some rows early and all before ``max_new_tokens``: generate() with the flag read every
    8 steps returns the sequences, scores, logits and cache of the check at every step (and, for the
    dense config, of the unpatched model), the same RNG state after sampling, and its greedy and
    sampling loops did run steps past the end (so the undo was exercised)."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([44, 35])
    base = SPARSE if config == "sparse" else {}
    seed = 5  # before every run: the RNG state after it is then the draws' of that run
    kw = {**dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0), **MODES[mode]}
    prhs_hf.patch(model, _loop(base, 1))
    kw["eos_token_id"] = _eos_mid(model, kw, seed)
    kw.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    runs = {}
    for every in (1, EVERY, None):  # None: the unpatched model
        if every is None:
            if config != "dense":
                continue
            prhs_hf.unpatch(model)
        else:
            prhs_hf.patch(model, _loop(base, every))
        torch.manual_seed(seed)
        out, forwards = _counted(model, **kw)
        runs[every] = (out, forwards, torch.rand(4))
    prhs_hf.unpatch(model)
    (every_step, plain_forwards, plain_rng), (periodic, forwards, rng) = runs[1], runs[EVERY]
    assert every_step.sequences.shape[1] < ids.shape[1] + 30, "EOS did not end the generation early"
    _assert_same_output(periodic, every_step, f"{mode}, stop_check_every {EVERY}")
    assert torch.equal(rng, plain_rng), "the RNG state after generate() differs"
    if mode != "beams":
        assert plain_forwards < forwards < plain_forwards + EVERY
    if None in runs:
        _assert_same_output(periodic, runs[None][0], f"{mode}: patched dense against the unpatched model")


@pytest.mark.parametrize("new_tokens", [1, 5, 13, 16])
def test_the_host_known_end_is_never_overshot(new_tokens):
    """Without EOS the loop ends where max_new_tokens says (not a multiple of N too): exactly that
    many forwards, the tokens of the check at every step."""
    model = tiny_model("qwen3", layers=2)
    ids, mask = padded_batch([40, 33])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    outs = []
    for every in (1, EVERY):
        prhs_hf.patch(model, _loop(SPARSE, every))
        out, forwards = _counted(model, **kw)
        assert forwards == new_tokens
        outs.append(out)
    prhs_hf.unpatch(model)
    assert torch.equal(*outs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_second_turn_on_the_returned_cache_equals_the_check_at_every_step(cache):
    """Turn 1 stops early on EOS (the loop ran steps past it and undid them); turn 2 (two more tokens,
    one new) continues from turn 1's cache and gives what it gives after the check at every step. The
    ``StaticCache`` has room for 6 new tokens, fewer than turn 1's max_new_tokens and its first stop
    check: its extra steps must not write past the end ("the static cache is full")."""
    from transformers import StaticCache

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    prhs_hf.patch(model, _loop(SPARSE, 1))
    eos = _eos_mid(model, {**kw, "input_ids": ids, "return_dict_in_generate": False, "output_scores": False}, 0)
    runs = []
    for every in (1, EVERY):
        prhs_hf.patch(model, _loop(SPARSE, every))
        # room for 6 new tokens: EOS ends turn 1 by step 3; steps up to the first check (8) would not fit
        first_cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 6) if cache == "static" else None
        with torch.no_grad():
            first = model.generate(ids, eos_token_id=eos, past_key_values=first_cache, **kw)
            assert first.sequences.shape[1] <= ids.shape[1] + 3
            more = torch.randint(1, 128, (2, 2), generator=torch.Generator().manual_seed(3))
            ids2 = torch.cat([first.sequences, more], 1)
            mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
            second = model.generate(ids2, **{**kw, "attention_mask": mask2, "max_new_tokens": 1},
                                    past_key_values=first.past_key_values)
        runs.append((first, second))
    prhs_hf.unpatch(model)
    for a, b in zip(runs[0], runs[1]):
        _assert_same_output(b, a, f"{cache} cache")


def test_a_streamer_gets_every_token_at_its_step():
    """A streamer needs each token on the host: the loop checks every step and streams as plain generate()."""
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value.clone())

        def end(self):
            pass

    model = tiny_model("llama", layers=2)
    ids = padded_batch([30])[0]
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    prhs_hf.patch(model, _loop(SPARSE, 1))
    eos = _eos_mid(model, {**kw, "input_ids": ids}, 0)
    got = []
    for every in (1, EVERY):
        prhs_hf.patch(model, _loop(SPARSE, every))
        streamer = Collect()
        out, forwards = _counted(model, input_ids=ids, streamer=streamer, eos_token_id=eos, **kw)
        got.append((out, forwards, streamer.tokens))
    prhs_hf.unpatch(model)
    (a, fa, sa), (b, fb, sb) = got
    assert torch.equal(a, b) and fa == fb and len(sa) == len(sb)
    assert all(torch.equal(x, y) for x, y in zip(sa, sb))


def test_unpatch_restores_generate_and_transformers_stop_check():
    from transformers.generation import utils as generation_utils

    model = tiny_model("llama")
    original = generation_utils.DeferredStopCheck
    own = lambda *a, **k: "own"  # noqa: E731 - a generate() set on the instance before patching
    model.generate = own
    prhs_hf.patch(model, "cis")
    assert model.generate is not own and model.generate() == "own"  # wrapped, and still called
    prhs_hf.unpatch(model)
    assert model.generate is own
    del model.generate
    prhs_hf.patch(model, "cis")
    ids = padded_batch([20])[0]
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generation_utils.DeferredStopCheck is original  # only swapped while a patched generate() runs
    prhs_hf.unpatch(model)
    assert "generate" not in model.__dict__


def test_stop_check_every_is_validated():
    with pytest.raises(prhs_hf.ConfigError, match=r"generation\.stop_check_every: 0 is out of range; allowed \[1, 1024\]"):
        prhs_hf.load_config("cis", {"generation": {"stop_check_every": 0}})
    with pytest.raises(prhs_hf.ConfigError, match=r"generation\.stop_check_every: expected an int"):
        prhs_hf.load_config("cis", {"generation": {"stop_check_every": "8"}})
    assert prhs_hf.load_config("cis").generation.stop_check_every == EVERY
