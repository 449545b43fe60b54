"""Bad input gets a clear error or works exactly: padding, 1-token prompts, nested patches."""

import pytest
import torch
from transformers import StaticCache

import prhs_hf
from tiny_models import padded_batch, tiny_model

# CIS alone, reference backends, a budget that decides nothing for short prompts
CIS = {
    "budget": {"sink": 4, "local": 8, "topk": 16},
    "cis": {"enabled": True, "block_size": 4},
    "psaw": {"enabled": False},
    "etf": {"enabled": False},
    "backend": {"prefill": "torch", "decode": "torch"},
}
WIDE = {**CIS, "budget": {"sink": 8, "local": 32, "topk": 400}}


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def _right_padded(lengths, seed=0):
    ids, mask = padded_batch(lengths, seed=seed)
    for i, n in enumerate(lengths):  # move each row's real tokens to the front
        ids[i] = torch.roll(ids[i], n - ids.shape[1])
        mask[i] = torch.roll(mask[i], n - ids.shape[1])
    return ids, mask


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_right_padding_is_refused_with_the_left_padding_advice(cache):
    model = tiny_model("llama")
    ids, mask = _right_padded([60, 45])
    prhs_hf.patch(model, WIDE)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        _generate(model, ids, mask, max_new_tokens=4, **kw)
    prhs_hf.unpatch(model)


def test_a_decode_step_after_a_gap_is_refused():
    """A hand-written decode loop whose new token lands after padding (not one contiguous run)."""
    model = tiny_model("llama")
    ids, mask = _right_padded([30, 30])  # no padding at all: both rows full
    prhs_hf.patch(model, WIDE)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        step_mask[1, 10:30] = 0  # a hole inside the second sequence
        with pytest.raises(ValueError, match="contiguous"):
            model(ids[:, -1:], attention_mask=step_mask, past_key_values=cache, use_cache=True)
    prhs_hf.unpatch(model)


def test_left_padding_is_still_accepted():
    model = tiny_model("llama")
    ids, mask = padded_batch([60, 45])
    dense = _generate(model, ids, mask, max_new_tokens=6)
    prhs_hf.patch(model, WIDE)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=6), dense)
    prhs_hf.unpatch(model)


def test_one_token_prompts_do_not_leak_cis_state_between_calls():
    model = tiny_model("llama")
    long_ids, long_mask = padded_batch([120])
    one = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long)
    # tau -1: every query shares, so the block boundaries (and stale anchors) decide the tokens
    prhs_hf.patch(model, {**CIS, "cis": {"enabled": True, "block_size": 4, "tau": -1.0}})
    first = _generate(model, *one, max_new_tokens=100)
    _generate(model, long_ids, long_mask, max_new_tokens=39)  # leaves anchors of another sequence
    third = _generate(model, *one, max_new_tokens=100)
    prhs_hf.unpatch(model)
    assert torch.equal(first, third)


def test_one_token_prompt_static_cache_equals_dynamic_cache():
    model = tiny_model("llama")
    one = torch.tensor([[7]]), torch.ones(1, 1, dtype=torch.long)
    prhs_hf.patch(model, {**CIS, "telemetry": {"enabled": True}})
    dynamic = _generate(model, *one, max_new_tokens=40)
    steps_dynamic = prhs_hf.telemetry(model).decode_steps
    prhs_hf.reset(model)
    static = _generate(model, *one, max_new_tokens=40, cache_implementation="static")
    steps_static = prhs_hf.telemetry(model).decode_steps
    prhs_hf.unpatch(model)
    assert torch.equal(dynamic, static)
    assert steps_dynamic == steps_static == 39  # the prompt is a prefill, not a decode step


def test_leaving_a_nested_patch_restores_the_outer_one():
    model = tiny_model("llama")
    with prhs_hf.patch(model, CIS) as outer:
        with prhs_hf.patch(model, "dense") as inner:
            assert model._prhs_runtime is inner.runtime
        assert prhs_hf.is_patched(model)
        assert model._prhs_runtime is outer.runtime
        assert len(model.model.layers[0]._forward_pre_hooks) == 1
        assert model.model.layers[0].self_attn._prhs_layer is outer.runtime.layers[0]
    assert not prhs_hf.is_patched(model)
    assert not model.model.layers[0]._forward_pre_hooks
    assert model.config._attn_implementation == "sdpa"


def test_telemetry_stays_readable_on_the_handle_after_the_block():
    model = tiny_model("llama")
    ids, mask = padded_batch([90])
    with prhs_hf.patch(model, {**CIS, "telemetry": {"enabled": True}}) as handle:
        _generate(model, ids, mask, max_new_tokens=5)
    report = handle.telemetry()
    assert report.decode_steps == 4
    with pytest.raises(ValueError, match="not patched"):
        prhs_hf.telemetry(model)


def test_a_budget_beyond_the_models_positions_is_refused_at_patch():
    model = tiny_model("llama", max_position_embeddings=512)
    with pytest.raises(prhs_hf.ConfigError, match=r"budget.topk.*512"):
        prhs_hf.patch(model, {**CIS, "budget": {"sink": 4, "local": 8, "topk": 1000}})
    assert not prhs_hf.is_patched(model)


def test_a_patch_that_raises_leaves_the_patch_in_force():
    model = tiny_model("llama", max_position_embeddings=512)
    with prhs_hf.patch(model, CIS) as handle:
        with pytest.raises(prhs_hf.ConfigError, match="budget.topk"):
            prhs_hf.patch(model, {**CIS, "budget": {"sink": 4, "local": 8, "topk": 1000}})
        assert model._prhs_runtime is handle.runtime
    assert not prhs_hf.is_patched(model)
