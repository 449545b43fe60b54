"""One explicit context per forward (:class:`prhs_hf.geometry.ForwardContext`): the first layer's
pre-hook makes it once per eager forward, the layers receive it, and the runtime holds no mode flag
that anything outside its class sets."""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch

import prhs_hf
from prhs_hf.geometry import ForwardContext
from prhs_hf.layer import PrHSLayer
from prhs_hf.runtime import PrHSRuntime
from tiny_models import padded_batch, tiny_model

SMALL = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4},
         "backend": {"decode": "torch", "prefill": "torch"}}


def test_the_runtime_is_written_only_by_its_own_methods(monkeypatch):
    """Patching, generating, copying, nesting and unpatching: every attribute of a ``PrHSRuntime`` is
    written from its own methods (what the patch installs goes through ``attach``); the per-forward
    flags are gone, held by the forward's context."""
    outside = []
    setattr_ = object.__setattr__

    def recording(self, name, value):
        caller = sys._getframe(1).f_code
        if not caller.co_qualname.startswith("PrHSRuntime."):
            outside.append((name, caller.co_qualname))
        setattr_(self, name, value)

    monkeypatch.setattr(PrHSRuntime, "__setattr__", recording)
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([30, 22])
    with prhs_hf.patch(model, "cpe", SMALL) as handle:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        twin = copy.deepcopy(model)
        with prhs_hf.patch(model, "cis", SMALL):
            with torch.no_grad():
                model(ids, attention_mask=mask)
    assert prhs_hf.is_patched(twin) and not prhs_hf.is_patched(model)
    assert outside == [], outside
    runtime = handle.runtime
    for flag in ("sparse_decode", "sparse_prefill", "dense_step", "geometry", "step_config", "kv_buffers",
                 "_decoding", "_last_query_slot", "hooks", "wrapped", "own_generate", "own_prefill",
                 "original_attn_implementation"):
        assert not hasattr(runtime, flag), flag


@pytest.mark.parametrize("decode", ["sparse", "dense"])
def test_every_layer_of_a_forward_receives_the_one_context_it_made(monkeypatch, decode):
    """Each eager forward makes one frozen context at its first layer; every layer's attention gets that
    object as its argument (a decode step the policy sends to dense skips the layers: ``dense_step``)."""
    seen = []
    attend = PrHSLayer.attend

    def spy(self, context, *args):
        seen.append((self.index, context))
        return attend(self, context, *args)

    monkeypatch.setattr(PrHSLayer, "attend", spy)
    model = tiny_model("llama", layers=3)
    ids, mask = padded_batch([30, 22])
    overrides = {**SMALL, "policy": {"decode": decode, "prefill": "sparse"}, "generation": {"stop_check_every": 1}}
    with prhs_hf.patch(model, "cis", overrides) as handle:
        contexts = []
        hook = model.model.register_forward_hook(lambda *_: contexts.append(handle.runtime.context))
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        hook.remove()
    assert len(contexts) == 3 and len({id(c) for c in contexts}) == 3  # one per forward, a new one each
    prefill, *steps = contexts
    assert not prefill.decoding and all(c.decoding for c in steps)
    assert all(c.sparse_decode is (decode == "sparse") and c.dense_step is (decode == "dense") for c in steps)
    assert [c.last_query_slot for c in contexts] == [29, 30, 31]  # the prompt's last slot, then each new key's
    per_forward = [seen[i:i + 3] for i in range(0, len(seen), 3)]
    assert len(per_forward) == (3 if decode == "sparse" else 1)  # dense steps: the fair dense attention at once
    for forward, context in zip(per_forward, contexts):
        assert [index for index, _ in forward] == [0, 1, 2]
        assert all(got is context for _, got in forward)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prefill.sparse_decode = False
    assert isinstance(prefill, ForwardContext)
