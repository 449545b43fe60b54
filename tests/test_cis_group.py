"""Group-shared CIS (``cis.selection: group``): one index set per KV head for its query heads."""

import pytest
import torch

import prhs_hf
from conftest import triton_available
from prhs_hf.decode import DecodeParams
from prhs_hf.geometry import SequenceGeometry
from prhs_hf.ops.compose.dilated_set import dilated_set_size
from prhs_hf.ops.decode_ops import REFERENCE_OPS
from prhs_hf.selectors import CISSelector
from tiny_models import padded_batch, tiny_model

GROUP = {
    "budget": {"sink": 4, "local": 8, "topk": 16},
    "cis": {"enabled": True, "block_size": 4, "selection": "group"},
    "psaw": {"enabled": False},
    "etf": {"enabled": False},
    "backend": {"prefill": "torch", "decode": "torch"},
}


def _generate(model, ids, mask, n=10, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, **kw)


def _naive_group_step(q, k_cache, v_cache, t, p, scale, score="max"):
    """sink ∪ top-k of the middle by the group's largest (or mean) score ∪ local, for every head (float64)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    g = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        tb = int(t[b])
        for kvh in range(Hkv):
            k, v = k_cache[b, kvh, :tb].double(), v_cache[b, kvh, :tb].double()
            heads = range(kvh * g, (kvh + 1) * g)
            middle = torch.arange(p.sink, tb - p.local)
            scores = torch.stack([(k[middle] @ q[b, h].double()) * scale for h in heads])
            ranked = scores.amax(0) if score == "max" else scores.mean(0)
            chosen = middle[ranked.topk(p.topk).indices]
            keys = torch.cat([torch.arange(p.sink), chosen, torch.arange(tb - p.local, tb)]).unique()
            for h in heads:
                s = (k[keys] @ q[b, h].double()) * scale
                out[b, h] = torch.softmax(s, 0) @ v[keys]
    return out


@pytest.mark.parametrize("score", ["max", "mean"])
def test_never_sharing_group_step_is_the_groups_exact_topk_attention(score):
    torch.manual_seed(3)
    B, Hq, Hkv, D, T = 2, 6, 2, 16, 80
    p = DecodeParams(sink=4, local=8, topk=16, tau=1.5, dilation_topm=5, dilation_radius=1,
                     capacity=4 + 8 + 16 + 2 * 5, window_fraction=None)
    cis = CISSelector(1, 4, dilated_set_size(p.topk, p.dilation_topm, p.dilation_radius), grouped=True,
                      group_score=score)
    q = torch.randn(B, Hq, D)
    k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    cis.observe_prefill(0, q[:, :, None], k, None, 0.25)
    assert cis.state.anchor_q.shape == (1, B, Hkv, 4, 3 * D)  # a row per KV head: the group's queries
    t = torch.full((B,), T, dtype=torch.int32)
    geom = SequenceGeometry(torch.zeros(B, dtype=torch.int32), t, t - 1)
    sel = cis.select(0, q, k, v, geom, p, 0.25)
    assert sel.idx.shape[1] == Hkv and bool(sel.retrieved.all())
    out = REFERENCE_OPS.sparse_decode_attention_grouped(q, k, v, geom.pad, sel.idx, sel.count, 0.25)
    torch.testing.assert_close(out.double(), _naive_group_step(q, k, v, t, p, 0.25, score), rtol=1e-5, atol=1e-5)
    if score == "mean":  # a ranking of its own: on random data it picks other keys than the max does
        other = _naive_group_step(q, k, v, t, p, 0.25, "max")
        assert not torch.allclose(out.double(), other, rtol=1e-5, atol=1e-5)


def test_group_selection_with_a_budget_covering_the_context_equals_dense():
    model = tiny_model("qwen2", heads=4, kv_heads=2)
    ids, mask = padded_batch([20, 14])
    dense = _generate(model, ids, mask)
    prhs_hf.patch(model, {**GROUP, "budget": {"sink": 4, "local": 8, "topk": 64}})
    assert torch.equal(_generate(model, ids, mask), dense)
    prhs_hf.unpatch(model)


def test_group_selection_on_mha_is_per_head_selection():
    model = tiny_model("llama", heads=4, kv_heads=4)
    ids, mask = padded_batch([70, 52])
    prhs_hf.patch(model, {**GROUP, "cis": {**GROUP["cis"], "selection": "head"}})
    per_head = _generate(model, ids, mask, n=16)
    prhs_hf.patch(model, GROUP)
    grouped = _generate(model, ids, mask, n=16)
    prhs_hf.unpatch(model)
    assert torch.equal(per_head, grouped)


def test_group_selection_telemetry_counts_query_heads():
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = padded_batch([70])
    prhs_hf.patch(model, {**GROUP, "cis": {**GROUP["cis"], "tau": -1.0}, "telemetry": {"enabled": True}})
    _generate(model, ids, mask, n=9)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    assert report.decode_steps == 8 and report.retrieval_ratio == pytest.approx(2 / 8)  # blocks of 4
    assert report.per_head_retrievals == [[2] * 4] * 4
    assert report.processed_kv_per_step < report.dense_kv_per_step


@pytest.mark.skipif(not triton_available(), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("selection", ["group", "group_mean"])
def test_group_selection_triton_equals_the_reference_in_a_model(selection):
    model = tiny_model("qwen3", heads=4, kv_heads=2)
    ids, mask = padded_batch([60, 44])
    runs = []
    for backend in ("torch", "triton"):
        prhs_hf.patch(model, {**GROUP, "cis": {**GROUP["cis"], "selection": selection},
                              "backend": {"prefill": "torch", "decode": backend}, "telemetry": {"enabled": True}})
        runs.append((_generate(model, ids, mask, n=12), prhs_hf.telemetry(model).retrieval_ratio))
        prhs_hf.unpatch(model)
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_group_mean_selection_is_a_config_value_and_others_are_refused():
    assert prhs_hf.load_config({"cis": {"selection": "group_mean"}}).cis.selection == "group_mean"
    with pytest.raises(prhs_hf.ConfigError, match=r"cis.selection.*head.*group.*group_mean"):
        prhs_hf.load_config({"cis": {"selection": "group_sum"}})


def test_group_mean_with_a_budget_covering_the_context_equals_dense():
    model = tiny_model("qwen2", heads=4, kv_heads=2)
    ids, mask = padded_batch([20, 14])
    dense = _generate(model, ids, mask)
    prhs_hf.patch(model, {**GROUP, "cis": {**GROUP["cis"], "selection": "group_mean"},
                          "budget": {"sink": 4, "local": 8, "topk": 64}})
    assert torch.equal(_generate(model, ids, mask), dense)
    prhs_hf.unpatch(model)
