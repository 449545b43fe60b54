"""The eager decode step's host cost and ``backend.eager_step`` (prhs_hf/runtime.py, prhs_hf/layer.py).

- :class:`~prhs_hf.runtime.BufferedLayer` keeps ``DynamicLayer``'s contract (valid views, length,
  crop, beam reorder, batch repeat/select, deepcopy, pickle) and grows geometrically;
- a sparse step on the whole buffers (``buffered``/``graphs``; on the CPU no capture) gives the
  tokens and logits of the plain ``DynamicCache`` bit for bit through ``model.generate`` with the
  buffers' unwritten slots full of NaN (so no path reads past a sequence's valid length): per-head
  and group selection, padding, beams, sampling, a continuation from the cache;
- a decode step the policy sends to dense costs the ops of the unpatched ``sdpa_gqa`` per layer;
- on CUDA (``gpu``): a replayed CUDA graph equals the uncaptured step bit for bit, and a step
  launches fewer kernels.
"""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import prhs_hf
from prhs_hf import attention
from prhs_hf.patching import _rollback_supported
from prhs_hf.runtime import BufferedLayer, buffer_cache
from prhs_hf.selectors.cis import CISSelector
from conftest import triton_available
from tiny_models import FAMILIES, padded_batch, tiny_model

#: CIS far below the prompts (4 + 8 + 16 keys), blocks of 4, τ 0.5: rows retrieve and share
SPARSE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.5},
          "backend": {"prefill": "torch", "decode": "torch"}, "policy": {"decode": "sparse", "prefill": "sparse"}}


@pytest.fixture(autouse=True)
def _nan_slots(monkeypatch):
    """Unwritten buffer slots hold NaN: any read past a valid length shows in the logits."""
    monkeypatch.setattr(BufferedLayer, "fill", float("nan"))
    torch.set_num_threads(1)


def _kv(batch=2, heads=2, n=5, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, dim, generator=g), torch.randn(batch, heads, n, dim, generator=g)


def _twins():
    plain, buffered = DynamicLayer(), BufferedLayer(growth=1.5)
    return plain, buffered


def _same(plain: DynamicLayer, buffered: BufferedLayer) -> None:
    assert buffered.get_seq_length() == plain.get_seq_length()
    assert torch.equal(buffered.keys, plain.keys) and torch.equal(buffered.values, plain.values)


def test_buffered_layer_update_returns_the_valid_views_and_grows_geometrically():
    plain, buffered = _twins()
    assert buffered.keys is None and buffered.get_seq_length() == 0
    k, v = _kv(n=300)
    pk, pv = plain.update(k, v)
    bk, bv = buffered.update(k, v)
    assert torch.equal(bk, pk) and torch.equal(bv, pv)
    allocations = {buffered.whole_buffers[0].data_ptr()}
    for i in range(700):
        k, v = _kv(n=1, seed=i + 1)
        pk, pv = plain.update(k, v)
        bk, bv = buffered.update(k, v)
        assert torch.equal(bk, pk) and torch.equal(bv, pv)
        allocations.add(buffered.whole_buffers[0].data_ptr())
    _same(plain, buffered)
    capacity = buffered.whole_buffers[0].shape[2]
    assert 1000 <= capacity <= 1.5 * 1000 + 128
    assert len(allocations) <= 4  # 300 -> 512 -> 768 -> 1152: geometric, not one per token
    assert plain.get_mask_sizes(1) == buffered.get_mask_sizes(1)


def test_buffered_layer_keeps_dynamic_layer_semantics():
    plain, buffered = _twins()
    k, v = _kv(batch=3, n=20)
    plain.update(k, v)
    buffered.update(k, v)
    address = buffered.whole_buffers[0].data_ptr()
    beams = torch.tensor([2, 0, 0])
    plain.reorder_cache(beams)
    buffered.reorder_cache(beams)
    _same(plain, buffered)
    assert buffered.whole_buffers[0].data_ptr() == address  # a reorder copies into the same buffer
    plain.crop(-4)
    buffered.crop(-4)
    _same(plain, buffered)
    assert buffered.whole_buffers[0].data_ptr() == address
    for layer in (plain, buffered):
        layer.update(*_kv(batch=3, n=2, seed=7))
    _same(plain, buffered)
    twin = copy.deepcopy(buffered)
    _same(plain, twin)
    assert twin.whole_buffers[0].data_ptr() != address
    _same(plain, pickle.loads(pickle.dumps(buffered)))
    for layer in (plain, buffered):
        layer.batch_repeat_interleave(2)
    _same(plain, buffered)
    for layer in (plain, buffered):
        layer.batch_select_indices(torch.tensor([1, 4]))
    _same(plain, buffered)
    for layer in (plain, buffered):
        layer.update(*_kv(batch=2, n=1, seed=9))
    _same(plain, buffered)


def test_buffer_cache_converts_dynamic_layers_and_the_ones_made_later():
    model = tiny_model("llama", layers=2)
    with_config = DynamicCache(config=model.config)
    layers = buffer_cache(with_config, 1.25)
    assert layers is with_config.layers and all(type(x) is BufferedLayer for x in layers)
    lazy = DynamicCache()
    buffer_cache(lazy, 1.25)
    ids, mask = padded_batch([9, 12])
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=lazy)
    assert len(lazy.layers) == 2 and all(type(x) is BufferedLayer for x in lazy.layers)
    assert buffer_cache(transformers.StaticCache(config=model.config, max_cache_len=32), 1.25) is None


def _generate(model, config, step, ids, mask, **kwargs):
    """``generate`` under ``config`` with ``backend.eager_step: step``: tokens and logits."""
    overrides = {"backend": {**config.get("backend", {}), "eager_step": step}}
    with prhs_hf.patch(model, config, overrides):
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True, **kwargs)
    return out


def _assert_same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("selection", ["head", "group"])
@pytest.mark.parametrize("step", ["buffered", "graphs"])
def test_sparse_step_on_whole_buffers_equals_the_plain_cache(selection, step, monkeypatch):
    model = tiny_model("llama", layers=2)
    config = {**SPARSE, "cis": {**SPARSE["cis"], "selection": selection}}
    ids, mask = padded_batch([40, 55, 31], seed=1)  # left padding
    plain = _generate(model, config, "plain", ids, mask, do_sample=False)
    slack = []  # slots past the valid length that each step's selection was given
    select = CISSelector.select

    def spy(self, layer, q, k_cache, v_cache, geom, *args):
        slack.append(k_cache.shape[2] - int(geom.pad[0] + geom.t_last[0]))
        return select(self, layer, q, k_cache, v_cache, geom, *args)

    monkeypatch.setattr(CISSelector, "select", spy)
    _assert_same(plain, _generate(model, config, step, ids, mask, do_sample=False))
    assert not torch.isnan(torch.stack(plain.logits)).any()
    if step == "graphs":  # the step that graphs capture reads the whole buffers, NaN past the valid slots
        assert slack and min(slack) > 0
    else:  # buffered K/V, uncaptured: the valid views, as every selector is given
        assert slack and set(slack) == {0}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_decodes_on_whole_buffers_as_on_the_plain_cache(family):
    model = tiny_model(family, layers=2)
    ids, mask = padded_batch([36, 30], seed=4)
    _assert_same(_generate(model, SPARSE, "plain", ids, mask, do_sample=False),
                 _generate(model, SPARSE, "buffered", ids, mask, do_sample=False))


def test_whole_buffers_beams_sampling_and_continuation_equal_the_plain_cache():
    model = tiny_model("qwen2", layers=2)
    ids, mask = padded_batch([44, 37], seed=2)
    for kwargs in (dict(num_beams=3, do_sample=False), dict(do_sample=True, top_k=20, num_return_sequences=2)):
        _assert_same(_generate(model, SPARSE, "plain", ids, mask, **kwargs),
                     _generate(model, SPARSE, "buffered", ids, mask, **kwargs))
    results = []
    for step in ("plain", "buffered"):
        with prhs_hf.patch(model, SPARSE, {"backend": {**SPARSE["backend"], "eager_step": step}}):
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5,
                                       min_new_tokens=5, do_sample=False, pad_token_id=0)
                more = torch.cat([first, torch.tensor([[5, 6, 7]] * 2)], dim=1)
                second = model.generate(more, attention_mask=torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], 1),
                                        past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                        pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            assert (type(cache.layers[0]) is BufferedLayer) == (step == "buffered")
            results.append(second)
    _assert_same(*results)


@pytest.mark.skipif(not triton_available(), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
def test_triton_kernels_on_whole_buffers_equal_the_plain_cache():
    model = tiny_model("llama", layers=1)
    config = {**SPARSE, "backend": {"prefill": "torch", "decode": "triton"}}
    ids, mask = padded_batch([40, 29], seed=3)
    _assert_same(_generate(model, config, "plain", ids, mask, do_sample=False),
                 _generate(model, config, "buffered", ids, mask, do_sample=False))


def _ops_per_step(model, layers_ids_mask) -> int:
    """Top-level PyTorch ops of one eager decode forward."""
    ids, mask = layers_ids_mask
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        step = ids[:, -1:]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(step, attention_mask=mask, past_key_values=cache)
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


def test_a_dense_decode_step_costs_the_ops_of_sdpa_gqa():
    """The policy's dense step adds no op per layer and none per forward to the unpatched sdpa_gqa."""
    inputs = padded_batch([20, 16])
    for layers in (2, 4):
        model = tiny_model("llama", layers=layers)
        attention.register()
        model.set_attn_implementation("sdpa_gqa")
        dense = _ops_per_step(model, inputs)
        model.set_attn_implementation("sdpa")
        forced_dense = {"policy": {"decode": "dense", "prefill": "dense"}}
        with prhs_hf.patch(model, "cis", {**forced_dense, "backend": {"eager_step": "plain"}}):
            assert _ops_per_step(model, inputs) == dense
            assert model._prhs_runtime.context.dense_step
        with prhs_hf.patch(model, "cis", forced_dense):  # the default step: buffered K/V on the CPU
            # the cache write in place (slices and copies of K and V, and the valid views) instead of one
            # cat each: four more host ops per layer, none per forward; the copy of the whole cache is gone
            assert _ops_per_step(model, inputs) == dense + 4 * layers


def test_a_dense_decode_step_gives_sdpa_gqa_tokens_and_logits():
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([30, 22])
    attention.register()
    model.set_attn_implementation("sdpa_gqa")
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    with prhs_hf.patch(model, "cis", {"policy": {"decode": "dense", "prefill": "dense"}}):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
    _assert_same(ref, out)


def test_the_bench_selects_the_eager_step_by_a_plus_suffix():
    from prhs_hf.evaluation.speed_map import prhs_config

    assert prhs_config("cis/sparse+graphs") == (
        "cis", {"backend": {"eager_step": "graphs"}, "policy": {"decode": "sparse", "prefill": "sparse"}})
    assert prhs_config("cis_longbench+buffered") == ("cis_longbench", {"backend": {"eager_step": "buffered"}})
    assert prhs_config("cis+plain") == ("cis", {"backend": {"eager_step": "plain"}})  # the default is auto
    with pytest.raises(ValueError, match="eager_step"):
        prhs_config("cis+fast")


def test_graphs_capture_plain_cis_without_telemetry_only():
    model = tiny_model("llama", layers=2)
    graphs = {"backend": {"eager_step": "graphs"}}
    for overrides, graphed in ((graphs, True), ({**graphs, "telemetry": {"enabled": True}}, False),
                               ({**graphs, "cis": {"tail_slot": True}}, False),
                               ({"backend": {"eager_step": "buffered"}}, False),
                               ({"backend": {"eager_step": "plain"}}, False)):
        with prhs_hf.patch(model, "cis", overrides) as handle:
            assert handle.runtime.graphed is graphed, overrides


def test_the_default_eager_step_is_graphs_where_the_step_can_be_captured_else_buffered():
    """``backend.eager_step: auto`` (the default): graphs for plain CIS, buffered K/V where the step cannot
    be captured (a key index, which an explicit ``graphs`` refuses; telemetry; the baselines)."""
    from prhs_hf.config import ConfigError

    model = tiny_model("llama", layers=2)
    for overrides, graphed in (({}, True), ({"cis": {"index": "fp8"}}, False),
                               ({"telemetry": {"enabled": True}}, False)):
        with prhs_hf.patch(model, "cis", overrides) as handle:
            assert handle.config.backend.eager_step == "auto"
            assert handle.runtime.graphed is graphed, overrides
            assert handle.runtime.kv_growth == handle.config.backend.kv_growth  # buffered either way
    with prhs_hf.patch(model, "configs/cis.yaml", {"baseline": {"name": "quest"}, "cis": {"enabled": False}}) as handle:
        assert not handle.runtime.graphed and handle.runtime.kv_growth is not None
    with pytest.raises(ConfigError, match="eager_step: graphs"):
        prhs_hf.patch(model, "cis", {"cis": {"index": "fp8"}, "backend": {"eager_step": "graphs"}})
    assert not prhs_hf.is_patched(model)

def test_a_stop_found_late_rolls_a_buffered_cache_back_as_a_plain_one():
    """generate()'s periodic stop check crops the steps after an EOS it reads late: on BufferedLayers too."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([40, 33], seed=5)
    probe = _generate(model, SPARSE, "plain", ids, mask, do_sample=False).sequences[:, ids.shape[1]:]
    eos = int(probe[0, 2])  # the first sequence ends at its third new token, between two stop checks
    lengths, outs = [], []
    for step in ("plain", "buffered"):
        with prhs_hf.patch(model, SPARSE, {"backend": {**SPARSE["backend"], "eager_step": step}}):
            cache = DynamicCache(config=model.config)
            if step == "buffered":
                buffer_cache(cache, 1.25)
                assert _rollback_supported(cache)  # the loop may check every few steps and crop after
            with torch.no_grad():
                outs.append(model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                           eos_token_id=eos, pad_token_id=0, do_sample=False))
            lengths.append(cache.get_seq_length())
            assert (type(cache.layers[0]) is BufferedLayer) == (step == "buffered")
    assert torch.equal(outs[0], outs[1]) and lengths[0] == lengths[1]

@pytest.mark.parametrize("stop_check_every", [1, 8])
def test_a_finished_generate_keeps_no_reference_to_its_cache(stop_check_every):
    """The patch holds a forward's cache layers (``runtime.context.kv_buffers``) for that forward only: once
    ``generate()`` returns, a cache the user drops is freed (it holds the whole K/V), not kept until
    the model's next forward."""
    import gc
    import weakref

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([40, 33], seed=5)
    overrides = {"backend": {**SPARSE["backend"], "eager_step": "buffered"},
                 "generation": {"stop_check_every": stop_check_every}}
    with prhs_hf.patch(model, SPARSE, overrides):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, do_sample=False,
                                 return_dict_in_generate=True)
        assert type(out.past_key_values.layers[0]) is BufferedLayer
        cache = weakref.ref(out.past_key_values)
        keys = weakref.ref(out.past_key_values.layers[0].whole_buffers[0])
        del out
        gc.collect()
        assert cache() is None and keys() is None
        with torch.no_grad():  # the next generation fills a cache of its own as before
            again = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, do_sample=False)
    assert again.shape == (2, ids.shape[1] + 4)


def _state_tensors(runtime, cache) -> list:
    """Weak references to the anchor and key-index tensors of CIS's state, wherever it is held: the
    selector (the generation bound now) and ``cache``'s own record of its generation."""
    import weakref

    from prhs_hf.selectors.base import export_call_state

    holders = export_call_state(runtime.selector) + runtime.call_state_of(cache).fields
    states = {id(st): st for fields in holders for st in fields.get("states", {}).values()}  # shared dicts: once
    return [weakref.ref(t) for st in states.values()
            for t in (st.anchor_q, st.anchor_idx, st.key_index_a, st.key_index_b) if t is not None]


@pytest.mark.parametrize("eager_step", ["plain", "buffered"])
def test_a_dropped_cache_frees_cis_anchors_and_key_index_once_generate_returns(eager_step):
    """CIS's state of a generation (its anchors; the key index, a quarter of the KV cache in fp8) goes
    back to the generation's cache when ``generate()`` returns, so a cache the caller drops frees it,
    instead of the selector keeping it until the model's next forward. A continuation from a cache
    that is kept gets its state back: its tokens equal one generate() of both turns' length."""
    import gc

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)
    ids, mask = padded_batch([40, 33], seed=5)
    config = {**SPARSE, "cis": {**SPARSE["cis"], "index": "fp8", "rerank_margin": 4},
              "backend": {**SPARSE["backend"], "eager_step": eager_step}}
    kw = dict(attention_mask=mask, pad_token_id=0, do_sample=False, return_dict_in_generate=True)
    with prhs_hf.patch(model, config) as handle, torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, **kw)
        held = _state_tensors(handle.runtime, out.past_key_values)
        assert len(held) == 4 and all(ref() is not None for ref in held)  # anchors and index were made
        del out
        gc.collect()
        assert all(ref() is None for ref in held), "the selector kept a finished generation's state"
        whole = model.generate(ids, max_new_tokens=9, **kw).sequences
        first = model.generate(ids, max_new_tokens=6, **kw)
        mask_now = torch.cat([mask, mask.new_ones(2, 6)], 1)
        second = model.generate(first.sequences, max_new_tokens=3, past_key_values=first.past_key_values,
                                **{**kw, "attention_mask": mask_now})
    assert torch.equal(second.sequences, whole)


def test_a_generate_that_ends_while_another_runs_leaves_the_state_bound():
    """Threads: the state goes back to its cache only when no patched generate() is running, since a
    compiled decode step of another thread's generation reads the selector's state without binding."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([40, 33], seed=5)
    with prhs_hf.patch(model, SPARSE) as handle, torch.no_grad():
        runtime = handle.runtime
        runtime.generate_starts()  # another generate() in flight
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, do_sample=False,
                                 return_dict_in_generate=True)
            assert runtime.bound is runtime.call_state_of(out.past_key_values) is not None
        finally:
            runtime.generate_ends()
        assert runtime.bound is None


# ---------------------------------------------------------------------------------------------- GPU


def _cuda_model(layers: int = 2):
    head_dim, heads = 64, 8
    model = tiny_model("llama", layers=layers, heads=heads, kv_heads=4, hidden_size=heads * head_dim,
                       intermediate_size=2 * heads * head_dim, head_dim=head_dim, dtype=torch.bfloat16).cuda()
    ids, mask = padded_batch([300, 260], device="cuda")
    return model, ids, mask


GPU_SPARSE = {"budget": {"sink": 4, "local": 16, "topk": 32}, "cis": {"block_size": 4, "tau": 0.5},
              "backend": {"prefill": "auto", "decode": "triton"}, "policy": {"decode": "sparse", "prefill": "sparse"}}


@contextlib.contextmanager
def graphs_after_each_forward(model, runtime):
    """Yields a list that gets, after each forward of ``model``, whether every layer holds a captured
    graph; on leaving, checks that none does any more (a finished ``generate()`` drops its graphs)."""
    seen = []
    hook = model.register_forward_hook(
        lambda *_: seen.append(all(layer.graphs.graph is not None for layer in runtime.layers)))
    try:
        yield seen
    finally:
        hook.remove()
    assert not any(layer.graphs.graph is not None for layer in runtime.layers), "generate() kept its graphs"


@pytest.mark.gpu
@pytest.mark.parametrize("selection", ["head", "group"])
def test_graph_replay_equals_the_uncaptured_step_bit_for_bit(selection):
    """Unwritten slots hold NaN (the fixture): the kernels never read past a valid length either."""
    model, ids, mask = _cuda_model()
    config = {**GPU_SPARSE, "cis": {**GPU_SPARSE["cis"], "selection": selection}}
    buffered = _generate(model, config, "buffered", ids, mask, do_sample=False)
    graphs = _generate(model, config, "graphs", ids, mask, do_sample=False)
    _assert_same(buffered, graphs)
    assert not torch.isnan(torch.stack(graphs.logits)).any()
    with prhs_hf.patch(model, config, {"backend": {**config["backend"], "eager_step": "graphs"}}) as handle:
        with torch.no_grad(), graphs_after_each_forward(model, handle.runtime) as captured:
            model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, do_sample=False)
        assert captured[-1]  # captured and replayed


@pytest.mark.gpu
def test_the_default_eager_step_captures_graphs_on_cuda_and_equals_the_plain_cache():
    """``eager_step: auto`` (the default) on CUDA: plain CIS steps captured and replayed, the tokens and
    logits of the plain cache; a key index runs buffered, uncaptured, with the tokens of its plain run."""
    model, ids, mask = _cuda_model()
    _assert_same(_generate(model, GPU_SPARSE, "plain", ids, mask, do_sample=False),
                 _generate(model, GPU_SPARSE, "auto", ids, mask, do_sample=False))
    with prhs_hf.patch(model, GPU_SPARSE) as handle:
        with torch.no_grad(), graphs_after_each_forward(model, handle.runtime) as captured:
            model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, do_sample=False)
        assert captured[-1]
    indexed = {**GPU_SPARSE, "cis": {**GPU_SPARSE["cis"], "index": "fp8"}}
    _assert_same(_generate(model, indexed, "plain", ids, mask, do_sample=False),
                 _generate(model, indexed, "auto", ids, mask, do_sample=False))


@pytest.mark.gpu
@pytest.mark.parametrize("selection", ["head", "group"])
def test_triton_step_on_whole_buffers_equals_the_plain_cache_on_cuda(selection):
    model, ids, mask = _cuda_model()
    config = {**GPU_SPARSE, "cis": {**GPU_SPARSE["cis"], "selection": selection}}
    _assert_same(_generate(model, config, "plain", ids, mask, do_sample=False),
                 _generate(model, config, "buffered", ids, mask, do_sample=False))


def _launches_per_step(model, ids, mask) -> int:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        token = ids[:, -1:]
        for _ in range(3):  # the eager step at a new key, the capture, a replay
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            model(token, attention_mask=mask, past_key_values=cache)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            model(token, attention_mask=mask, past_key_values=cache)
            torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
    return sum(1 for e in prof.events() if e.name in names)


@pytest.mark.gpu
def test_graphs_launch_fewer_kernels_per_step():
    model, ids, mask = _cuda_model(layers=4)
    counts = {}
    for step in ("buffered", "graphs"):
        with prhs_hf.patch(model, GPU_SPARSE, {"backend": {**GPU_SPARSE["backend"], "eager_step": step}}):
            counts[step] = _launches_per_step(model, ids, mask)
    assert counts["graphs"] < counts["buffered"] - 4 * 3, counts  # several launches per layer become one



class _PoolModel:
    """The caching allocator's rule for shared graph pools, as its internal assert states it: a
    capture may join an existing pool only while a graph still holds it (use count above 0)."""

    def __init__(self):
        self.use = {}

    def graph_class(self):
        model = self

        class Graph:
            def capture_begin(self, pool):
                if pool in model.use:
                    assert model.use[pool] > 0, "it->second->use_count > 0 INTERNAL ASSERT FAILED"
                    model.use[pool] += 1
                else:
                    model.use[pool] = 1
                self.pool = pool

            def capture_end(self):
                pass

            def replay(self):
                pass

            def __del__(self):
                if hasattr(self, "pool"):
                    model.use[self.pool] -= 1

        return Graph


def test_step_graphs_keep_a_shared_pool_alive_across_new_keys(monkeypatch):
    """Every layer's graph is replaced at once when the buffers grow (a new key): the replaced graphs
    are retired, not dropped, so that the next captures into the same pool find it held."""
    import contextlib

    from prhs_hf.layer import StepGraph

    pools = _PoolModel()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", pools.graph_class())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: type("S", (), {"wait_stream": lambda *a: None})())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"wait_stream": lambda *a: None})())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    layers, retired, q = [StepGraph() for _ in range(3)], [], torch.zeros(1, 2, 4)
    for key in ("capacity 1", "capacity 2"):
        for _ in range(3):  # eager at the new key, then captured, then replayed
            for graphs in layers:
                graphs.run(key, lambda x: x + 1, q, "pool", retired)
    assert pools.use["pool"] == 6 and len(retired) == 3


@pytest.mark.parametrize("chunk", [None, 16])
def test_generate_makes_the_buffers_for_its_max_length_once(chunk, monkeypatch):
    """A patched generate() whose max_length is within the growth's slack of the prompt (a long prompt,
    a short answer) gives each BufferedLayer its max_length before the prompt is written: one buffer per
    layer for the whole call (no growth copy, no growth overshoot), the memory of a static cache of that
    length; a later turn past it grows the buffers again, and a max_length far past the prompt is not
    reserved up front (the buffers grow with the tokens)."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([40, 29], seed=5)
    made = []
    allocate = BufferedLayer._allocate

    def spy(self, like, tokens):
        buffer = allocate(self, like, tokens)
        made.append(buffer.shape[-2])
        return buffer

    monkeypatch.setattr(BufferedLayer, "_allocate", spy)
    with prhs_hf.patch(model, SPARSE, {"backend": {**SPARSE["backend"], "eager_step": "buffered"}}):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, min_new_tokens=6,
                                   do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
        assert made == [40 + 6] * 4  # keys and values of two layers, at the call's max_length
        assert all(layer.whole_buffers[0].shape[-2] == 46 for layer in cache.layers)
        made.clear()
        more = torch.cat([first, torch.tensor([[5, 6, 7]] * 2)], dim=1)
        with torch.no_grad():
            model.generate(more, attention_mask=torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], 1),
                           past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        assert made == [49 + 4] * 4  # the second turn's max_length: one new buffer per layer again
        made.clear()
        with torch.no_grad():  # an answer longer than the growth's slack: no reservation, the buffers grow
            model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                           pad_token_id=0, prefill_chunk_size=chunk)
        growth_rule = BufferedLayer(model._prhs_runtime.kv_growth)._capacity(40)  # the prompt's, not max_length 80
        assert made == [growth_rule] * 4 and growth_rule != 80


def test_step_graph_capture_releases_the_allocators_cached_blocks_first(monkeypatch):
    """A capture allocates from its graph pool and, while it is under way, the caching allocator cannot
    release the blocks it caches for ordinary allocations (the prefill's activations) to make room: on
    the H100 the eager B4/64k cis cell ran out of memory in a capture (a 34 MiB retrieval scratch) with
    49 GiB allocated of 79 GiB in use. So every capture is preceded by ``torch.cuda.empty_cache()``, as
    ``torch.cuda.graph`` does; eager runs and replays are not."""
    import contextlib

    from prhs_hf.layer import StepGraph

    calls = []

    class Graph:
        def capture_begin(self, pool):
            calls.append("capture")

        def capture_end(self):
            pass

        def replay(self):
            calls.append("replay")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: type("S", (), {"wait_stream": lambda *a: None})())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"wait_stream": lambda *a: None})())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    graphs, q = StepGraph(), torch.zeros(1, 2, 4)
    for key in ("capacity 1", "capacity 2"):
        for _ in range(3):  # eager at the new key, then captured, then replayed
            graphs.run(key, lambda x: x + 1, q, "pool", [])
    assert calls == ["empty_cache", "capture", "replay", "replay"] * 2
