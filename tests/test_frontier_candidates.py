"""Issue 54's frontier candidates (``FRONTIER_CONFIGS``): named as their module docstring says, found by every
entry point that takes a config name, and each running sparse end to end on a tiny GQA model, eager and static."""

from __future__ import annotations

import re

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

import prhs_hf
from prhs_hf.config import load_config
from prhs_hf.evaluation.accuracy.configs import ACCURACY_CONFIGS, FRONTIER_CONFIGS, load_any_config, named_config
from tiny_models import padded_batch, tiny_model

NAME = re.compile(r"cis-(group|head)-(8k|2k|1k|f8|f16)(-fp8)?|cis-group-fp8-lb")
BUDGETS = {"8k": {"topk": 8192}, "2k": {"topk": 2048}, "1k": {"topk": 1024},
           "f8": {"topk": 1024, "topk_fraction": 1 / 8, "topk_max": 8192},
           "f16": {"topk": 1024, "topk_fraction": 1 / 16, "topk_max": 8192}}


def test_each_candidate_is_cis_longbench_with_the_sets_budget_and_index_its_name_says():
    assert len(FRONTIER_CONFIGS) >= 8
    for name in FRONTIER_CONFIGS:
        match = NAME.fullmatch(name)
        assert match, name
        selection, budget, fp8 = match.groups() if match.group(1) else ("group", None, "-fp8")
        budget = dict(BUDGETS.get(budget, {}))
        if fp8 and "topk_max" in budget:  # the index's re-rank takes k + margin (128) <= 8,192 candidates
            budget["topk_max"] = 8192 - 128
        want = load_config("cis_longbench", {"budget": budget,
                                             "cis": {"selection": selection, "index": "fp8" if fp8 else "none"}})
        assert load_any_config(name) == want, name
        assert named_config(name) is ACCURACY_CONFIGS[name]  # run_accuracy.py --configs, prhs-hf bench --configs
    assert load_any_config("cis-group-f16").budget.topk_for(32768) == 2048
    assert load_any_config("cis-group-f8").budget.topk_for(131072) == 8192
    assert "cis-group-8k-fp8" not in FRONTIER_CONFIGS  # k 8,192 + margin 128: more than the re-rank takes


def _generate(model, ids, mask, static: bool, compiled: bool = False):
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    kw = dict(cache_implementation="static", compile_config=config, disable_compile=not compiled) if static else {}
    prhs_hf.reset(model)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kw)
    return out, prhs_hf.telemetry(model)


#: the PyTorch ops (a CPU), every step sparse, telemetry on: the steps that ran sparse are counted
CPU_SPARSE = {"backend": {"decode": "torch", "prefill": "torch"}, "policy": {"decode": "sparse", "prefill": "sparse"},
              "telemetry": {"enabled": True}}


@pytest.mark.parametrize("name", sorted(FRONTIER_CONFIGS))
def test_a_candidate_runs_sparse_with_the_same_tokens_eager_and_static(name):
    """A prompt past the candidate's budget (sink 64 + window 256 + k: 1,344 at k 1,024, 2,368 at 2,048, 4,416 at
    4,096), GQA (4 query heads, 2 KV heads), left padding: every step sparse, eager = static cache."""
    k = load_any_config(name).budget.topk
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2)
    ids, mask = padded_batch([64 + 256 + k + 40, 64 + 256 + k + 8])
    prhs_hf.patch(model, load_any_config(name, CPU_SPARSE))
    eager, stats = _generate(model, ids, mask, static=False)
    static, static_stats = _generate(model, ids, mask, static=True)
    prhs_hf.unpatch(model)
    assert stats.sparse_sequence_steps == 2 * 5 == static_stats.sparse_sequence_steps
    assert torch.equal(eager, static)


@pytest.mark.parametrize("name", ["cis-group-f16-fp8", "cis-head-1k"])
def test_a_candidate_compiles_to_the_static_eager_tokens(name):
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2)
    ids, mask = padded_batch([1400, 1370])
    prhs_hf.patch(model, load_any_config(name, CPU_SPARSE))
    torch._dynamo.reset()
    static, _ = _generate(model, ids, mask, static=True)
    compiled, stats = _generate(model, ids, mask, static=True, compiled=True)
    prhs_hf.unpatch(model)
    assert stats.sparse_sequence_steps > 0 and torch.equal(static, compiled)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "glm", "glm4", "qwen2_moe", "qwen3_moe", "glm4_moe"])
def test_group_sets_with_a_relative_budget_and_a_key_index_run_on_every_family(family):
    model = tiny_model(family, layers=2, heads=4, kv_heads=2)
    ids, mask = padded_batch([1400, 1370])
    prhs_hf.patch(model, load_any_config("cis-group-f16-fp8", CPU_SPARSE))
    eager, stats = _generate(model, ids, mask, static=False)
    static, _ = _generate(model, ids, mask, static=True)
    prhs_hf.unpatch(model)
    assert stats.sparse_sequence_steps == 2 * 5 and torch.equal(eager, static)
