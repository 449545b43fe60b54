"""A context-relative top-k (``budget.topk_fraction``, floor ``budget.topk``, cap ``budget.topk_max``):
validated, one k per generation from its prefill's cache slots, the same in eager, compiled,
chunked-prefill and key-index steps, and priced by ``policy: auto``."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

import prhs_hf
from prhs_hf.config import ConfigError, load_config
from prhs_hf.policy import CostModel
from tiny_models import padded_batch, tiny_model

#: retrieve at every step (tau above 1), no dilation: an active row's set is exactly sink + k + local
RELATIVE = {"budget": {"sink": 4, "local": 8, "topk": 8, "topk_fraction": 0.25, "topk_max": 40},
            "cis": {"block_size": 4, "tau": 1.5, "dilation_radius": 0},
            "backend": {"prefill": "torch", "decode": "torch"}}


def _with(base: dict, **sections) -> dict:
    return {**base, **{name: {**base.get(name, {}), **values} for name, values in sections.items()}}


@pytest.mark.parametrize("budget, cis, baseline, text", [
    ({"topk_fraction": 0.0}, {}, None, r"budget.topk_fraction: 0.0 is out of range; allowed \(0.0, 1.0\]"),
    ({"topk_fraction": 1.5}, {}, None, r"budget.topk_fraction: 1.5 is out of range; allowed \(0.0, 1.0\]"),
    ({"topk_fraction": "1/8"}, {}, None, r"budget.topk_fraction: expected a float or null"),
    ({"topk_fraction": 0.1, "topk_max": 0}, {}, None, r"budget.topk_max: 0 is out of range; allowed \[1, 1048576\]"),
    ({"topk_fraction": 0.1, "topk": 64, "topk_max": 32}, {}, None,
     r"budget.topk_max: 32 is out of range; allowed \[budget.topk=64, 1048576\] or null"),
    ({"topk_max": 64}, {}, None, r"budget.topk_max: 64 caps a context-relative top-k and this config has none"),
    ({"topk_fraction": 0.1}, {"enabled": False}, None, r"budget.topk_fraction: applies to CIS .* no selector"),
    ({"topk_fraction": 0.1}, {}, "quest", r"budget.topk_fraction: applies to CIS .* baseline.name: quest"),
])
def test_bad_relative_budgets_name_the_key_and_the_allowed_range(budget, cis, baseline, text):
    data = {"budget": budget, "cis": cis}
    if baseline:
        data["baseline"] = {"name": baseline}
    with pytest.raises(ConfigError, match=text):
        load_config(data)


@pytest.mark.parametrize("budget, cis, text", [
    ({"topk": 8100}, {"index": "fp8"}, r"budget.topk: 8100 with cis.index: fp8 and cis.rerank_margin: 128 gives 8228 "
                                       r"candidates to re-rank per row; allowed up to 8192"),
    ({"topk": 1024, "topk_fraction": 0.125, "topk_max": 8192}, {"index": "int4"}, r"budget.topk_max: 8192 with"),
    ({"topk": 1024, "topk_fraction": 0.125}, {"index": "fp8"}, r"budget.topk_max: null leaves .* set budget.topk_max "
                                                               r"<= 8064"),
    ({"topk": 8050}, {"index": "pages", "rerank_margin": 160}, r"budget.topk: 8050 .* gives 8210 candidates \(pages of 16: 8240 tokens\)"),
])
def test_a_key_index_needs_room_to_re_rank_the_largest_k(budget, cis, text):
    with pytest.raises(ConfigError, match=text):
        load_config({"budget": budget, "cis": cis})
    if cis["index"] != "pages":  # k + the default margin 128 = 8,192 fits
        fitting = {**budget, "topk_max": 8064} if "topk_fraction" in budget else {**budget, "topk": 8064}
        load_config({"budget": fitting, "cis": {"index": cis["index"]}})


def test_the_configs_re_rank_bound_is_the_kernels():
    from prhs_hf.config import MAX_RERANK_TOKENS
    from prhs_hf.ops.key_index.key_index import RERANK_MAX

    assert MAX_RERANK_TOKENS == RERANK_MAX


def test_topk_for_rounds_the_fraction_of_the_context_into_floor_and_cap():
    b = load_config({"budget": {"topk": 1024, "topk_fraction": 0.125, "topk_max": 8192}, "cis": {}}).budget
    assert [b.topk_for(n) for n in (0, 8192, 16384, 30000, 30004, 128000)] == [1024, 1024, 2048, 3750, 3751, 8192]
    assert load_config({"budget": {"topk": 7, "topk_fraction": 0.5}, "cis": {}}).budget.topk_for(10**6) == 500000
    assert load_config({"budget": {"topk": 88}, "cis": {}}).budget.topk_for(10**6) == 88  # off: the fixed k
    assert load_config("cis_longbench").budget.topk_fraction is None  # the shipped configs keep a fixed k


def test_the_index_set_bound_takes_the_cap():
    with pytest.raises(ConfigError, match=r"index set .* allowed up to 1048576"):
        load_config({"budget": {"topk": 8, "topk_fraction": 0.5, "topk_max": 2**20}, "cis": {}})
    resolved = load_config({"budget": {"topk": 90, "topk_fraction": 0.5}, "cis": {}}).resolve(4)
    at = resolved.at_topk(300)
    assert (at.config.budget.topk, at.dilation_topm, at.index_capacity) == (300, 100, 8 + 32 + 300 + 2 * 100)
    assert at.config.budget.topk_fraction is None and resolved.dilation_topm == 30


class _KRecorder:
    """Wraps a patched model's selector: the top-k and the set sizes of every decode step."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select(self, layer, q, k_cache, v_cache, geom, params, *args):
        sel = self.inner.select(layer, q, k_cache, v_cache, geom, params, *args)
        self.steps.append((params.topk, sel.count[sel.active].unique().tolist()))
        return sel


def _steps_k(model, lengths, config, new=4):
    ids, mask = padded_batch(lengths)
    prhs_hf.patch(model, config)
    runtime = model._prhs_runtime
    runtime.selector = recorder = _KRecorder(runtime.selector)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    prhs_hf.unpatch(model)
    return recorder.steps


@pytest.mark.parametrize("selection", ["head", "group"])
def test_a_step_retrieves_the_fraction_of_its_generations_prompt(selection):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    config = _with(RELATIVE, cis={"selection": selection})
    for lengths, k in (([100, 80], 25), ([200], 40), ([20], 8)):  # 0.25 x the longest prompt; the cap; the floor
        steps = _steps_k(model, lengths, config)
        assert {topk for topk, _ in steps} == {k}
        assert {n for _, counts in steps for n in counts} == {4 + k + 8}  # every step runs sparse


def test_a_covering_fraction_is_dense():
    """topk_fraction 1.0 keeps every prompt token: while a generation stays within sink + local new
    tokens every step attends to every token, and the output is dense's (to float rounding: the sparse
    step's own attention over the whole set); a fixed k of 8 is not."""
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2)
    ids, mask = padded_batch([60, 44])
    run = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,  # noqa: E731
                                 output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        with prhs_hf.patch(model, _with(RELATIVE, policy={"decode": "dense"})):  # the fair dense path
            dense = run()
        covering = _with(RELATIVE, budget={"topk": 1, "topk_fraction": 1.0, "topk_max": None})
        for config, equal in ((covering, True), (_with(RELATIVE, budget={"topk_fraction": None, "topk_max": None}), False)):
            with prhs_hf.patch(model, config):
                out = run()
            close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(out.logits, dense.logits))
            assert close == equal and (torch.equal(out.sequences, dense.sequences) or not equal)


def test_a_generation_keeps_its_k_when_another_cache_runs_in_between():
    """k follows the cache: a continuation of the short prompt's generation after the long prompt's
    prefill steps with the short prompt's k, as the uninterrupted generation does."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    short, short_mask = padded_batch([120], seed=1)
    long, long_mask = padded_batch([160], seed=2)
    kw = dict(do_sample=False, return_dict_in_generate=True)
    with prhs_hf.patch(model, RELATIVE), torch.no_grad():
        whole = model.generate(short, attention_mask=short_mask, max_new_tokens=8, **kw).sequences
        first = model.generate(short, attention_mask=short_mask, max_new_tokens=4, **kw)
        model.generate(long, attention_mask=long_mask, max_new_tokens=2, **kw)
        assert model._prhs_runtime.layers[0].decode_params.topk == 40
        more = torch.ones_like(first.sequences)
        rest = model.generate(first.sequences, attention_mask=more, max_new_tokens=4,
                              past_key_values=first.past_key_values, **kw).sequences
        assert model._prhs_runtime.layers[0].decode_params.topk == 30
    assert torch.equal(rest, whole)


def test_chunked_prefill_takes_the_whole_prompts_k():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    config = _with(RELATIVE, budget={"topk_max": 400})
    ids, mask = padded_batch([700, 650], seed=3)
    outs = []
    for chunk in (None, 256):
        prhs_hf.patch(model, config)
        with torch.no_grad():
            kw = {} if chunk is None else {"prefill_chunk_size": chunk}
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kw))
            assert model._prhs_runtime.layers[1].decode_params.topk == 175
        prhs_hf.unpatch(model)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("selection", ["head", "group_mean"])
def test_a_key_index_retrieves_the_generations_k(selection):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    config = _with(RELATIVE, cis={"selection": selection, "index": "fp8", "rerank_margin": 8})
    steps = _steps_k(model, [140, 100], config)
    assert {topk for topk, _ in steps} == {35}
    assert {n for _, counts in steps for n in counts} == {4 + 35 + 8}


def test_the_policy_prices_the_generations_k(monkeypatch):
    shapes = []
    monkeypatch.setattr(prhs_hf.runtime, "cost_model_for", lambda device, path=None: CostModel(
        bandwidth_gbs=1.0, eager_overhead_us=0.0, compiled_overhead_us=0.0, per_key_ns=0.0, retrieval_rate=0.0,
        margin=1.0, min_sparse_prefill=1))
    real = CostModel.sparse_decode_wins
    monkeypatch.setattr(CostModel, "sparse_decode_wins",
                        lambda self, shape, compiled: (shapes.append(shape), real(self, shape, compiled))[1])
    model = tiny_model("llama", layers=2)
    for lengths, k in (([100], 25), ([140], 35)):
        shapes.clear()
        _steps_k(model, lengths, _with(RELATIVE, policy={"decode": "auto"}))
        assert shapes and {(s.topk, s.index_set) for s in shapes} == {(k, 4 + 8 + k)}


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def test_compiled_static_steps_run_each_generations_k_with_the_eager_tokens():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    config = _with(RELATIVE, cis={"tau": 0.5, "dilation_radius": 1})
    torch._dynamo.reset()
    with prhs_hf.patch(model, config), torch.no_grad():
        for lengths, k in (([100, 70], 25), ([140], 35)):
            ids, mask = padded_batch(lengths)
            runs = [model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                   cache_implementation="static", compile_config=_compile_config(),
                                   disable_compile=not compiled) for compiled in (False, True)]
            assert model._prhs_runtime.layers[0].decode_params.topk == k
            assert torch.equal(runs[0], runs[1])
