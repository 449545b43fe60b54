"""CIS with a key index (``cis.index``): the index the state keeps, and generate() through it.

With a margin that covers the whole middle region the two-stage retrieval equals the exact one
bit for bit (prhs_hf/ops/key_index/key_index.py's contract), so every such run must give the tokens of
``index: none``; the index the state holds must always equal one written afresh from the cache
(the prompt's write, each step's update, growth, beams, chunked prefill and skipped steps all keep
it current). A small margin makes the index decide, which the deepcopy test relies on.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache
from transformers.generation.configuration_utils import CompileConfig

import prhs_hf
from conftest import triton_available
from prhs_hf.ops.decode_ops import REFERENCE_OPS
from prhs_hf.ops.key_index.key_index import (
    INDEX_KINDS,
    allocate_key_index,
    index_bytes_per_slot,
    write_key_index_reference,
)
from prhs_hf.selectors import CISSelector
from prhs_hf.selectors.cis_state import INDEX_GROWTH
from tiny_models import padded_batch, tiny_model

#: CIS alone at a budget far below the prompts (4 + 8 + 16 of 52-70 tokens), blocks of 4, τ 0 (rows both retrieve
#: and share); the reference backends
BASE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.0},
        "backend": {"prefill": "torch", "decode": "torch"}}
COVERING = 4096  # a rerank margin beyond every middle region here: the index then only proposes, never decides


def _config(index: str = "none", margin: int = COVERING, selection: str = "head", **extra) -> dict:
    cis = {**BASE["cis"], "index": index, "rerank_margin": margin, "selection": selection}
    return {**BASE, "cis": cis, **extra}


def _model():
    return tiny_model("qwen3", layers=2, heads=4, kv_heads=2, head_dim=32)  # int4 needs D % 32 == 0


def _generate(model, config, ids, mask, new: int = 10, **kw):
    prhs_hf.patch(model, config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                             return_dict_in_generate=True, **kw)
    return out


def _selector(model, cache) -> CISSelector:
    """The selector holding the state of ``cache``'s generation (a finished generate() gave it back to
    its cache)."""
    return model._prhs_runtime.hold(cache)


def _assert_index_current(model, cache) -> None:
    """The index of every layer equals one written afresh from the cache's keys (every slot)."""
    selector = _selector(model, cache)
    for layer, cache_layer in enumerate(cache.layers):
        keys = cache_layer.keys
        device, local = selector._slot[layer]
        state = selector.states[device]
        held = state.key_index(local, keys.shape[2])
        B, H, S, D = keys.shape
        fresh = allocate_key_index(held.kind, B, H, S, D, keys.dtype, keys.device, held.page)
        write_key_index_reference(fresh._replace(center=held.center), keys, 0, S)  # the prompt's centre
        assert torch.equal(held.a, fresh.a), f"layer {layer}: index codes differ from the cache's"
        assert torch.equal(held.b, fresh.b), f"layer {layer}: index scales/bounds differ from the cache's"


def _forbidding_ops():
    def refuse(*args, **kwargs):
        raise AssertionError("a key index op ran with cis.index: none")

    return dataclasses.replace(REFERENCE_OPS, write_key_index=refuse, update_key_index=refuse,
                               topk_retrieval_indexed=refuse)


def test_index_none_runs_no_index_op_and_keeps_no_index():
    model = _model()
    ids, mask = padded_batch([70, 52])
    plain = _generate(model, BASE, ids, mask).sequences
    prhs_hf.patch(model, _config("none", margin=3))
    model._prhs_runtime._ops[torch.device("cpu")] = _forbidding_ops()  # the table the runtime hands the layers
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                             return_dict_in_generate=True)
    state = _selector(model, out.past_key_values).state
    assert state.key_index_a is None and state.index_nbytes() == 0
    assert torch.equal(out.sequences, plain)


def test_the_prompts_index_is_written_on_the_runtimes_ops_table():
    """The prompt's write runs on the table the runtime hands the layers' decode steps (``ops_for``), the
    one home of the choice: every layer's prompt slots through it."""
    model = _model()
    ids, mask = padded_batch([70, 52])
    prhs_hf.patch(model, _config("fp8", margin=8))
    writes = []

    def write(index, k_cache, start, end):
        writes.append((start, end))
        REFERENCE_OPS.write_key_index(index, k_cache, start, end)

    model._prhs_runtime._ops[torch.device("cpu")] = dataclasses.replace(REFERENCE_OPS, write_key_index=write)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    assert writes == [(0, 70)] * 2  # the prompt's slots, once per layer; no step needed a catch-up write
    _assert_index_current(model, out.past_key_values)


@pytest.mark.parametrize("selection", ["head", "group", "group_mean"])
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_a_covering_margin_gives_the_tokens_of_no_index(kind, selection):
    model = _model()
    ids, mask = padded_batch([70, 52])  # left padded
    exact = _generate(model, _config("none", selection=selection), ids, mask).sequences
    out = _generate(model, _config(kind, selection=selection), ids, mask)
    assert torch.equal(out.sequences, exact)
    _assert_index_current(model, out.past_key_values)


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_a_dynamic_cache_grows_the_index_and_keeps_it_current(kind):
    model = _model()
    ids, mask = padded_batch([40, 33])
    out = _generate(model, _config(kind, margin=8), ids, mask, new=30)  # 40 + 29 cache slots: grows twice
    state = _selector(model, out.past_key_values).state
    assert state.index_slots == math.ceil(math.ceil(40 * INDEX_GROWTH) * INDEX_GROWTH) >= 40 + 29
    _assert_index_current(model, out.past_key_values)


def test_a_static_cache_never_grows_the_index():
    model = _model()
    ids, mask = padded_batch([70, 52])
    exact = _generate(model, _config("none"), ids, mask, cache_implementation="static", disable_compile=True)
    out = _generate(model, _config("fp8"), ids, mask, cache_implementation="static", disable_compile=True)
    assert torch.equal(out.sequences, exact.sequences)
    slots = out.past_key_values.layers[0].keys.shape[2]
    assert _selector(model, out.past_key_values).state.index_slots == slots
    _assert_index_current(model, out.past_key_values)


@pytest.mark.parametrize("kind", ["fp8", "pages"])
def test_beams_reorder_the_index_with_the_cache(kind):
    model = _model()
    ids, mask = padded_batch([70, 52])
    exact = _generate(model, _config("none"), ids, mask, num_beams=3).sequences
    out = _generate(model, _config(kind), ids, mask, num_beams=3)
    assert torch.equal(out.sequences, exact)
    _assert_index_current(model, out.past_key_values)


def test_chunked_prefill_writes_every_chunk():
    model = _model()
    ids, mask = padded_batch([70])
    exact = _generate(model, _config("none"), ids, mask).sequences
    out = _generate(model, _config("int4"), ids, mask, prefill_chunk_size=24)
    assert torch.equal(out.sequences, exact)
    _assert_index_current(model, out.past_key_values)


@pytest.mark.parametrize("cache_implementation,eager_step,index", [
    ("dynamic", "plain", "pages"), ("static", "plain", "pages"), ("dynamic", "buffered", "fp8")])
def test_steps_the_policy_runs_dense_are_caught_up(monkeypatch, cache_implementation, eager_step, index):
    """A forward the policy runs dense never reaches the selector: the next sparse step writes its slots
    up to the new key's, which a buffered cache's capacity does not tell (the runtime's host count; fp8,
    one entry a slot: a slot left out shows, where a page's update would rewrite its neighbours)."""
    model = _model()
    ids, mask = padded_batch([70, 52])
    runs = []
    for kind in ("none", index):
        prhs_hf.patch(model, _config(kind), {"backend": {**BASE["backend"], "eager_step": eager_step}})
        runtime = model._prhs_runtime
        decide, forwards = runtime._decide, []

        def every_third_sparse(*args, decide=decide, forwards=forwards):
            sparse_prefill, _ = decide(*args)
            forwards.append(None)
            return sparse_prefill, len(forwards) % 3 == 1  # the prompt, then every third step

        monkeypatch.setattr(runtime, "_decide", every_third_sparse)
        with torch.no_grad():
            runs.append(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10,  # last: sparse
                                       return_dict_in_generate=True, cache_implementation=cache_implementation,
                                       disable_compile=True))
    assert torch.equal(runs[1].sequences, runs[0].sequences)
    _assert_index_current(model, runs[1].past_key_values)


def test_early_select_cis_with_a_covering_index_gives_its_tokens_without():
    """ES-CIS (no side stream) selects layer ℓ+1 at layer ℓ+1 itself, after its key is written: the
    index is updated first there too."""
    model = _model()
    ids, mask = padded_batch([70, 52])
    runs = [_generate(model, _config(kind, early_select={"tap": "mid"}), ids, mask).sequences for kind in ("none", "fp8")]
    assert torch.equal(runs[1], runs[0])


def test_a_deepcopied_cache_continues_identically():
    """Mid-generation copies of a cache carry their index: continuations from the copy and from the
    original, with unrelated calls in between, are the same (margin 0: the index decides)."""
    model = _model()
    prhs_hf.patch(model, _config("fp8", margin=0))
    ids, _ = padded_batch([64], seed=3)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        first = model.generate(ids, do_sample=False, max_new_tokens=6, past_key_values=cache,
                               return_dict_in_generate=True)
    copied = copy.deepcopy(cache)
    seq = first.sequences
    with torch.no_grad():
        one = model.generate(seq, do_sample=False, max_new_tokens=8, past_key_values=cache)
        other, other_mask = padded_batch([50, 41], seed=4)
        model.generate(other, attention_mask=other_mask, do_sample=False, max_new_tokens=5)  # unrelated
        two = model.generate(seq, do_sample=False, max_new_tokens=8, past_key_values=copied)
    assert torch.equal(one, two)


def test_a_small_margin_lets_the_index_decide():
    """Margin 0 on the pages index (whole pages of candidates, scored by their bounds) selects other
    tokens than the exact retrieval somewhere: the covering-margin tests compare a path that is used."""
    model = _model()
    ids, mask = padded_batch([70, 52])
    picked = []
    for kind in ("none", "pages"):
        prhs_hf.patch(model, _config(kind, margin=0, telemetry={"enabled": True, "oracle": True}))
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
        picked.append(prhs_hf.telemetry(model).oracle.dropped_mass)
    assert picked[1] != picked[0]


def test_index_memory_is_index_bytes_per_slot_of_every_layer_sequence_and_kv_head():
    model = _model()
    ids, mask = padded_batch([70, 52])
    for kind in INDEX_KINDS:
        selector = _selector(model, _generate(model, _config(kind), ids, mask, new=2).past_key_values)
        state = selector.state
        L, B, H = state.key_index_a.shape[:3]
        page = 16 if kind == "pages" else 1
        slots = math.ceil(state.index_slots / page) * page  # pages: whole pages
        per_slot = index_bytes_per_slot(kind, 32, torch.float32, page)
        center = 0 if kind == "pages" else L * B * H * 32 * 4  # fp32 [L, B, Hkv, D]: one key's worth per head
        assert state.index_nbytes() == L * B * H * slots * per_slot + center == selector.index_nbytes()


@pytest.mark.parametrize("selection,centered", [("head", True), ("group_mean", True), ("group", False)])
def test_the_index_is_centred_on_the_prompts_mean_key_but_for_grouped_max_rows(selection, centered):
    """fp8 / int4 codes hold each key less its (sequence, KV head)'s prompt mean, over the real slots
    of a left-padded batch (a chunked prefill: of its first chunk, kept through the later chunks), kept
    through the decode steps; rows ranked by their group's maximum (``cis.selection: group``) take no
    centre."""
    model = _model()
    ids, mask = padded_batch([70, 52])
    pad = (mask == 0).sum(1)
    for chunk in (None, 32):
        extra = {} if chunk is None else {"prefill_chunk_size": chunk}
        out = _generate(model, _config("fp8", selection=selection), ids, mask, new=4, **extra)
        selector = _selector(model, out.past_key_values)
        for layer, cache_layer in enumerate(out.past_key_values.layers):
            device, local = selector._slot[layer]
            held = selector.states[device].key_index(local, cache_layer.keys.shape[2])
            if not centered:
                assert held.center is None
                continue
            keys = cache_layer.keys[:, :, :chunk or ids.shape[1]].float()
            for b in range(2):
                torch.testing.assert_close(held.center[b], keys[b, :, int(pad[b]):].mean(1))
        _assert_index_current(model, out.past_key_values)


def test_int4_on_a_head_size_it_cannot_group_names_the_key():
    model = tiny_model("llama", layers=2)  # head size 16
    prhs_hf.patch(model, _config("int4"))
    with pytest.raises(prhs_hf.ConfigError, match=r"^cis\.index: int4 needs a head size that is a multiple of 32"):
        with torch.no_grad():
            model.generate(padded_batch([40])[0], do_sample=False, max_new_tokens=2)


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_static_decode_with_an_index_is_one_graph_with_eager_tokens(backend):
    """Under torch.compile (fullgraph, StaticCache) the index update and the indexed retrieval stay in
    the one decode graph: no recompilation, no graph break (a host sync would be one)."""
    if backend == "triton" and not triton_available():
        pytest.skip("needs Triton on CUDA or TRITON_INTERPRET=1")
    model = _model()
    ids, mask = padded_batch([70, 52])
    config = _config("fp8", margin=8, backend={"prefill": "torch", "decode": backend})
    prhs_hf.patch(model, config)
    torch._dynamo.reset()
    counters.clear()
    runs = []
    for compiled in (True, False, True):
        prhs_hf.reset(model)
        with torch.no_grad():
            runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                       cache_implementation="static", compile_config=_compile_config(),
                                       disable_compile=not compiled))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[2], runs[1])


@pytest.mark.skipif(not triton_available(), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("selection", ["head", "group"])
def test_triton_index_ops_give_the_reference_tokens(selection):
    model = _model()
    ids, mask = padded_batch([60, 44])
    runs = []
    for backend in ("torch", "triton"):
        config = _config("fp8", margin=8, selection=selection, backend={"prefill": "torch", "decode": backend})
        runs.append(_generate(model, config, ids, mask, new=8).sequences)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("selection", ["head", "group"])
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_gpu_covering_margin_gives_the_tokens_of_no_index(kind, selection):
    """On CUDA in bf16 with the Triton ops, eager and compiled (StaticCache, CUDA graphs): a covering
    margin gives the exact retrieval's tokens."""
    model = _model().to("cuda", torch.bfloat16)
    ids, mask = padded_batch([300, 220], device="cuda")
    backend = {"prefill": "auto", "decode": "triton"}
    eager, compiled = {}, {}
    for index in ("none", kind):
        config = _config(index, selection=selection, backend=backend)
        eager[index] = _generate(model, config, ids, mask, new=16).sequences
        compiled[index] = _generate(model, config, ids, mask, new=16, cache_implementation="static").sequences
    assert torch.equal(eager[kind], eager["none"])
    assert torch.equal(compiled[kind], compiled["none"])  # compiled vs compiled: the same dense numerics


def test_an_int4_index_on_cuda_gives_no_speed_warning():
    """int4's score tile was about 50x slower than fp8 on an H100 and a CUDA key warned of it; since the
    tile scores one 32-channel group per dot (5c722ba) it is within 2x of fp8 there, so it warns no more."""
    from types import SimpleNamespace

    model = _model()
    with prhs_hf.patch(model, _config("int4")):
        for device in ("cuda", "cpu"):
            key = SimpleNamespace(shape=(1, 2, 64, 32), device=torch.device(device), dtype=torch.bfloat16)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert model._prhs_runtime.selector._index_spec(key).kind == "int4"