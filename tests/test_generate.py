"""PrHS under model.generate(): budgets, left padding, GQA/MHA, caches, beams, sampling."""

import pytest
import torch

import prhs_hf
from prhs_hf.selectors.cis_state import CISState
from prhs_hf.kernels.triton_support import HAS_TRITON, interpreting
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
    runtime = model._prhs_runtime
    calls = []
    original = CISState.reorder

    def spy(self, index):
        before = (self.anchor_q.clone(), self.anchor_idx.clone(), self.anchor_count.clone())
        original(self, index)
        calls.append(index.clone())
        assert torch.equal(self.anchor_q, before[0][:, index])
        assert torch.equal(self.anchor_idx, before[1][:, index])
        assert torch.equal(self.anchor_count, before[2][:, index])

    monkeypatch.setattr(CISState, "reorder", spy)
    out = _generate(model, ids, mask, max_new_tokens=6, num_beams=3)
    prhs_hf.unpatch(model)
    assert out.shape == (2, 66)
    assert calls and all(c.shape == (6,) for c in calls)
    assert runtime.selector.state.anchor_q.shape[:2] == (4, 6)  # layers, batch x beams


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
