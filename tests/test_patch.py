"""Patching: dense equivalence for every family, unpatch, patch twice, clear errors."""

from pathlib import Path

import pytest
import torch
import transformers

import prhs_hf
from prhs_hf.families import SUPPORTED_FAMILIES, UnsupportedModelError
from tiny_models import FAMILIES, padded_batch, tiny_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _batch(seed=0, length=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on the second sequence
    ids[1, :7] = 0
    return ids, mask


def test_every_supported_family_has_a_tiny_model():
    assert set(FAMILIES) == set(SUPPORTED_FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_config_gives_the_unpatched_logits(family):
    model = tiny_model(family)
    ids, mask = _batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        prhs_hf.patch(model, CONFIGS / "dense.yaml")
        assert model.config._attn_implementation == "sdpa"  # a config that changes nothing keeps the model's own
        patched = model(ids, attention_mask=mask).logits
        prhs_hf.unpatch(model)
        assert model.config._attn_implementation == "sdpa"
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(patched, ref)
    assert torch.equal(after, ref)


#: a batch length that is a whole number of flex attention's 128-token blocks: on a CPU, transformers'
#: flex_attention (torch's compiled flex kernel) returns wrong rows at random, now and then NaN, on a
#: length that is not (40 tokens: 2 to 9 calls of 12, the first or later ones, on torch 2.13 with
#: transformers 5.17 and 5.23; 128: none), so only whole blocks give a reference to compare against
FLEX_BLOCK_LENGTH = 128


@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_dense_config_keeps_the_models_own_attention(implementation):
    """A model loaded with eager or flex attention and patched with "dense" keeps that implementation:
    the same logits bit for bit, and (eager) the attention weights output_attentions asks for. The
    unpatched reference agrees with eager attention on the real tokens (it is a right answer)."""
    model = tiny_model("llama")
    ids, mask = _batch(length=FLEX_BLOCK_LENGTH if implementation == "flex_attention" else 40)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(implementation)
        ref = model(ids, attention_mask=mask, output_attentions=implementation == "eager")
        with prhs_hf.patch(model, "dense"):
            assert model.config._attn_implementation == implementation
            out = model(ids, attention_mask=mask, output_attentions=implementation == "eager")
    real = mask.bool()
    assert (ref.logits - eager)[real].abs().max() < 1e-5, "the unpatched reference is not eager attention's answer"
    assert torch.equal(out.logits, ref.logits)
    if implementation == "eager":
        assert len(out.attentions) == len(ref.attentions) == 4
        assert all(torch.equal(a, b) for a, b in zip(out.attentions, ref.attentions))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpe_runs_and_unpatch_restores(family):
    model = tiny_model(family)
    ids, mask = _batch(length=180)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        with prhs_hf.patch(model, CONFIGS / "cpe.yaml", overrides={"backend": {"prefill": "torch", "decode": "torch"}}):
            sparse = model(ids, attention_mask=mask).logits
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert not prhs_hf.is_patched(model)
        after = model(ids, attention_mask=mask).logits
    assert not torch.equal(sparse, ref)  # PSAW/ETF changed deep layers
    assert torch.isfinite(sparse).all() and out.shape == (2, 184)
    assert torch.equal(after, ref)
    for layer in model.model.layers:
        assert "forward" not in layer.mlp.__dict__ and "_prhs_layer" not in layer.self_attn.__dict__
        assert not layer._forward_pre_hooks
        for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp):  # ETF's row skipping
            assert not module._forward_pre_hooks and not module._forward_hooks


@pytest.mark.parametrize("config", ["cis.yaml", "cpe.yaml"])
def test_pre_hooks_only_where_they_do_work(config):
    """The first decoder layer's pre-hook opens each forward; the others have one only where PSAW
    prefill or ETF plan work (a hook that does nothing still costs: under torch.compile its
    closure's objects are guarded on every decode step). unpatch removes them all."""
    model = tiny_model("llama", layers=6)
    prhs_hf.patch(model, CONFIGS / config)
    runtime = model._prhs_runtime
    hooked = [i for i, layer in enumerate(model.model.layers) if layer._forward_pre_hooks]
    planning = [l.index for l in runtime.layers if l.psaw_prefill or l.etf]
    assert hooked == sorted({0, *planning})
    assert (config == "cis.yaml") == (hooked == [0])
    prhs_hf.unpatch(model)
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)


def test_patching_twice_is_harmless():
    model = tiny_model("llama")
    ids, mask = _batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        prhs_hf.patch(model, CONFIGS / "cpe.yaml")
        prhs_hf.patch(model, CONFIGS / "dense.yaml")
        assert len(model.model.layers[0]._forward_pre_hooks) == 1
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)
        prhs_hf.unpatch(model)
        prhs_hf.unpatch(model)  # a second unpatch is a no-op
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)


def test_config_object_and_dict_are_accepted():
    model = tiny_model("llama")
    cfg = prhs_hf.load_config(CONFIGS / "cis.yaml")
    handle = prhs_hf.patch(model, cfg)
    assert handle.config == cfg
    prhs_hf.patch(model, cfg.to_dict())
    prhs_hf.unpatch(model)


def test_unsupported_family_lists_the_supported_ones():
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = transformers.MistralForCausalLM(config)
    with pytest.raises(UnsupportedModelError, match="supported: llama, qwen2, qwen3, glm, glm4"):
        prhs_hf.patch(model, CONFIGS / "cis.yaml")


def test_sliding_window_layers_are_refused():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        prhs_hf.patch(model, CONFIGS / "cis.yaml")


def test_unsupported_dtype_is_refused():
    model = tiny_model("llama").to(torch.float64)
    with pytest.raises(UnsupportedModelError, match="float16, bfloat16, float32"):
        prhs_hf.patch(model, CONFIGS / "cis.yaml")


def test_unsupported_cache_is_refused():
    model = tiny_model("llama")
    ids, mask = _batch()
    # a generic Cache (e.g. what a quantized or custom cache derives from) is not one PrHS knows
    cache = transformers.cache_utils.Cache(layer_class_to_replicate=transformers.cache_utils.DynamicLayer)
    prhs_hf.patch(model, CONFIGS / "cis.yaml")
    with pytest.raises(TypeError, match="DynamicCache, StaticCache"):
        model(ids, attention_mask=mask, past_key_values=cache)
    prhs_hf.unpatch(model)


def test_triton_backend_without_triton_device_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the triton backend is valid here")
    model = tiny_model("llama")
    ids, mask = _batch(length=200)
    prhs_hf.patch(model, CONFIGS / "cis.yaml", overrides={"backend": {"decode": "triton"}})
    with pytest.raises(RuntimeError, match="backend.decode: triton"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    prhs_hf.unpatch(model)


def test_telemetry_off_by_default_and_clear_error():
    model = tiny_model("llama")
    prhs_hf.patch(model, CONFIGS / "cis.yaml")
    assert model._prhs_runtime.telemetry is None
    with pytest.raises(ValueError, match="telemetry is off"):
        prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        prhs_hf.telemetry(model)


def test_dense_attention_of_a_sparse_config_never_copies_grouped_kv(monkeypatch):
    """Prefill layers below l_s and short sequences of a sparse config read K/V in place (enable_gqa):
    transformers' own path would repeat_kv-copy them for every query head under the mask."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    def no_copy(*args, **kwargs):
        raise AssertionError("repeat_kv called")

    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = _batch(length=60)
    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copy)
    with torch.no_grad(), prhs_hf.patch(model, "cpe", overrides={"budget": {"sink": 4, "local": 8, "topk": 16},
                                                                 "backend": {"prefill": "torch", "decode": "torch"}}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 63)


def test_a_pickled_cache_leaves_its_prhs_state_behind():
    """A cache carries its generation's CIS state for deepcopy, but the state holds the patch's runtime:
    pickling the cache drops the state, and decoding on the unpickled copy raises the clear error."""
    import pickle

    from transformers import DynamicCache

    model = tiny_model("llama", layers=2)
    ids, _ = padded_batch([40])
    with prhs_hf.patch(model, "cis", overrides={"budget": {"sink": 4, "local": 8, "topk": 16}, "backend": {"decode": "torch"}}):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        copied = pickle.loads(pickle.dumps(cache))
        assert copied._prhs_call_state is None
        with pytest.raises(ValueError, match="a decode step on a cache whose prompt this patch did not prefill"):
            model.generate(torch.cat([ids, ids[:, :1]], 1), past_key_values=copied, max_new_tokens=2)


@pytest.mark.parametrize("tail_slot", [False, True])
def test_state_made_under_inference_mode_resets_outside_it(tail_slot):
    """Each generation makes its own CIS state; made under torch.inference_mode (lm-eval's generate), it
    must still be normal tensors that reset() zeroes outside it (it raised 'Inplace update to inference
    tensor outside InferenceMode')."""
    model = tiny_model("llama", layers=2)
    ids, _ = padded_batch([40])
    overrides = {"budget": {"sink": 4, "local": 8, "topk": 16}, "backend": {"decode": "torch"},
                 "cis": {"tau": 0.0, "tail_slot": tail_slot}, "telemetry": {"enabled": True}}
    with prhs_hf.patch(model, "cis", overrides=overrides):
        with torch.inference_mode():
            first = model.generate(ids, max_new_tokens=4, do_sample=False)
        prhs_hf.reset(model)
        with torch.no_grad():
            again = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(first, again)
