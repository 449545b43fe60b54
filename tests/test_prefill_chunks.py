"""A patched generate() prefills a long prompt in chunks where the whole prompt's activations would not fit
in the free GPU memory beside its cache (issue 37 item 4: long batched prompts fit).

There is no GPU here: the tests give ``prhs_hf.patching.free_device_bytes`` a number, as CUDA would."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import prhs_hf
from prhs_hf import patching
from tiny_models import padded_batch, tiny_model

SPARSE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.5},
          "backend": {"decode": "torch"}}
PROMPT = 1500  # more than one MIN_PREFILL_CHUNK, less than two


def _prefill_lengths(model, ids, mask, free_bytes, monkeypatch, **generate_kwargs):
    """The query lengths of the forwards of one patched greedy generate(), and its output."""
    monkeypatch.setattr(patching, "free_device_bytes", lambda device: free_bytes)
    lengths = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append((kwargs.get("input_ids") if kwargs.get("input_ids") is not None
                                                     else args[0]).shape[-1]), with_kwargs=True)
    try:
        with prhs_hf.patch(model, SPARSE), torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    finally:
        hook.remove()
    return lengths, out


def _fits_one_chunk(model, ids, mask) -> int:
    """Free bytes that hold the cache and one 1024-token chunk's activations, not the whole prompt's."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    slots = ids.shape[1] + 3
    cache = ids.shape[0] * slots * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    per_token = ids.shape[0] * patching.prefill_bytes_per_token(model.config, 4, ids.shape[1], True)
    return int(cache + 1.2 * patching.MIN_PREFILL_CHUNK * per_token / patching.PREFILL_MEMORY_SHARE)


def test_a_prompt_that_does_not_fit_is_prefilled_in_chunks_with_the_same_tokens(monkeypatch):
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([PROMPT, PROMPT - 37], seed=1)
    free = _fits_one_chunk(model, ids, mask)
    chunked, out = _prefill_lengths(model, ids, mask, free, monkeypatch)
    assert chunked == [1024, PROMPT - 1024, 1, 1]
    whole, ref = _prefill_lengths(model, ids, mask, 10 ** 15, monkeypatch)
    assert whole == [PROMPT, 1, 1]
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_callers_chunk_size_and_a_cpu_are_left_alone(monkeypatch):
    model = tiny_model("llama", layers=1)
    ids, mask = padded_batch([PROMPT], seed=2)
    lengths, _ = _prefill_lengths(model, ids, mask, 1, monkeypatch, prefill_chunk_size=512)
    assert lengths == [512, 512, PROMPT - 1024, 1, 1]
    lengths, _ = _prefill_lengths(model, ids, mask, None, monkeypatch)  # off CUDA: nothing measured
    assert lengths == [PROMPT, 1, 1]
    assert patching.free_device_bytes(torch.device("cpu")) is None


@pytest.mark.parametrize("case", ["cached", "embeds", "short"])
def test_no_chunks_where_transformers_chunked_prefill_does_not_apply(case):
    """A prompt after cached tokens (transformers' chunked prefill would re-read the cached ones),
    inputs_embeds, or a prompt of one chunk or less: the prefill stays whole."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(1, 100, (1, PROMPT if case != "short" else patching.MIN_PREFILL_CHUNK))
    cache = DynamicCache(config=model.config)
    kwargs = {"past_key_values": cache, "attention_mask": torch.ones_like(ids)}
    if case == "cached":
        with torch.no_grad():
            model(ids[:, :10], past_key_values=cache)
    if case == "embeds":
        kwargs["inputs_embeds"] = torch.zeros(1, ids.shape[1], model.config.hidden_size)
    config = model.generation_config
    original = patching.free_device_bytes
    try:
        patching.free_device_bytes = lambda device: 1
        assert patching.prefill_chunk_that_fits(model, ids, config, kwargs) is None
    finally:
        patching.free_device_bytes = original
