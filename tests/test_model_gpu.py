"""Whole patched models on the GPU: Triton paths equal the PyTorch reference path; compiled decode."""

import pytest
import torch

import prhs_hf
from tiny_models import FAMILIES, decode_by_backend, padded_batch, tiny_model

pytestmark = pytest.mark.gpu

CPE = {"budget": {"sink": 8, "local": 32, "topk": 88}, "cis": {"block_size": 8}, "psaw": {"enabled": True},
       "etf": {"enabled": True}}  # a section left out is off


def _model(dtype, head_dim=64, layers=6, heads=8, kv_heads=4):
    model = tiny_model("llama", dtype=dtype, layers=layers, heads=heads, kv_heads=kv_heads,
                       hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim, head_dim=head_dim)
    return model.cuda()


def _generate(model, ids, mask, backend, config, **kw):
    prhs_hf.patch(model, config, overrides={"backend": backend, "telemetry": {"enabled": True}})
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32, **kw)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    return out, report


@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_decode_equals_reference_token_for_token_fp32(head_dim):
    model = _model(torch.float32, head_dim=head_dim)
    ids, mask = padded_batch([700, 530, 610], device="cuda")
    cfg = {**CPE, "psaw": {"enabled": False}, "etf": {"enabled": False}}
    ref, r_ref = _generate(model, ids, mask, {"decode": "torch", "prefill": "torch"}, cfg)
    tri, r_tri = _generate(model, ids, mask, {"decode": "triton", "prefill": "torch"}, cfg)
    assert torch.equal(ref, tri)
    assert r_ref.retrieval_ratio == r_tri.retrieval_ratio and r_ref.sparse_sequence_steps == r_tri.sparse_sequence_steps > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_decode_equals_reference_token_for_token_fp32_in_every_family(family):
    """tests/test_generate.py::test_triton_decode_equals_the_reference_token_for_token_in_every_family
    with the kernels compiled for the GPU."""
    runs = decode_by_backend(family, device="cuda")
    (ref, ref_rho, ref_steps), (tri, tri_rho, tri_steps) = runs["torch"], runs["triton"]
    assert torch.equal(ref, tri)
    assert (ref_rho, ref_steps) == (tri_rho, tri_steps) and ref_steps > 0 and 0 < ref_rho < 1


def _teacher_forced_logits(model, ids, mask, tokens, backend):
    """Prefill, then decode ``tokens`` one by one (the same tokens for every backend); all logits."""
    prhs_hf.patch(model, CPE, overrides={"backend": backend})
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = [model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1].float()]
        for i in range(tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out.append(model(tokens[:, i : i + 1], attention_mask=mask, past_key_values=cache).logits[:, -1].float())
    prhs_hf.unpatch(model)
    return torch.stack(out, 1)


def test_triton_decode_and_prefill_within_bf16_noise_of_the_reference():
    # bf16 greedy runs of a random model diverge after the first near-tie, so compare
    # teacher-forced logits (prefill with the PSAW/ETF kernel, then 24 CIS decode steps) with
    # the fp32 reference path: the Triton path may not be further from it than the bf16
    # PyTorch reference path is (plus a little).
    model = _model(torch.float32, head_dim=128)
    ids, mask = padded_batch([1500, 1100], device="cuda")
    tokens = torch.randint(1, 128, (2, 24), device="cuda")
    truth = _teacher_forced_logits(model, ids, mask, tokens, {"decode": "torch", "prefill": "torch"})
    model.to(torch.bfloat16)
    ref = _teacher_forced_logits(model, ids, mask, tokens, {"decode": "torch", "prefill": "torch"})
    tri = _teacher_forced_logits(model, ids, mask, tokens, {"decode": "triton", "prefill": "triton"})
    err_ref = ((ref - truth).norm(dim=-1) / truth.norm(dim=-1)).mean().item()
    err_tri = ((tri - truth).norm(dim=-1) / truth.norm(dim=-1)).mean().item()
    assert err_tri <= 1.5 * err_ref + 0.01, f"triton {err_tri:.4f} vs bf16 reference {err_ref:.4f}"


def _generate_with_logits(model, ids, mask, config, **kw):
    prhs_hf.patch(model, config, overrides={"telemetry": {"enabled": True}})
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32, cache_implementation="static",
                             return_dict_in_generate=True, output_logits=True, **kw)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float(), report


def _assert_same_until_a_near_tie(compiled, logits_c, eager, logits_e):
    """Compiled and eager runs agree token for token, and their logits within float rounding at every
    step up to and including the first where the tokens part (a near-tie)."""
    scale = logits_e.abs().max()
    steps = compiled.shape[1]
    for b in range(compiled.shape[0]):
        parted = (compiled[b] != eager[b]).nonzero()
        last = int(parted[0]) if len(parted) else steps - 1
        err = (logits_c[b, : last + 1] - logits_e[b, : last + 1]).abs().max()
        assert err <= 1e-3 * scale, f"sequence {b}: logits differ by {err:.3g} (scale {scale:.3g}) before step {last}"


def test_static_cache_compiled_decode_matches_eager():
    """generate() with a StaticCache, compiled as transformers does (inductor, CUDA graphs) with
    fullgraph=True: one graph, no break, CUDA graphs not skipped, and the same computation as eager PrHS.

    Inductor fuses and orders reductions differently, so logits differ by float rounding and a
    random model's greedy tokens may part at a near-tie; the logits must agree at every step up
    to and including the first step where the tokens part (where the two choices are then within
    that rounding of each other), and the runs must agree token for token before it.
    """
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model = _model(torch.float32, head_dim=128)
    ids, mask = padded_batch([900, 700], device="cuda")
    cfg = {**CPE, "backend": {"decode": "triton", "prefill": "triton"}}
    torch._dynamo.reset()
    counters.clear()
    compiled, logits_c, r_compiled = _generate_with_logits(
        model, ids, mask, cfg, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")
    )
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # and the graph is replayed as a CUDA graph: a skip would launch every kernel from Python
    assert not counters["inductor"]["cudagraph_skips"], "inductor skipped CUDA graphs (TORCH_LOGS=cudagraphs says why)"
    eager, logits_e, r_eager = _generate_with_logits(model, ids, mask, cfg, disable_compile=True)
    _assert_same_until_a_near_tie(compiled, logits_c, eager, logits_e)
    # telemetry accumulates on the device inside the compiled step too
    assert r_compiled.decode_steps == r_eager.decode_steps == 31
    assert r_compiled.sparse_sequence_steps > 0


def _policy_run(model, ids, mask, policy, static=False):
    kw = dict(cache_implementation="static") if static else {}
    with prhs_hf.patch(model, "cis", overrides={"policy": {"decode": policy}, "telemetry": {"enabled": True}}) as h:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, output_logits=True,
                                 return_dict_in_generate=True, **kw)
    return out, h.telemetry()


@pytest.mark.parametrize("static", [False, True])
def test_the_shipped_policy_goes_dense_on_a_short_context_and_equals_the_fair_dense(static):
    """On CUDA the H200 cost model sends the shipped "cis" at 700 tokens to the fair dense path, eager and
    compiled alike: the same logits as policy dense, bit for bit, and no sparse step; forced sparse differs."""
    model = _model(torch.bfloat16)
    ids, mask = padded_batch([700, 530], device="cuda")
    auto, auto_stats = _policy_run(model, ids, mask, "auto", static)
    dense, _ = _policy_run(model, ids, mask, "dense", static)
    sparse, sparse_stats = _policy_run(model, ids, mask, "sparse", static)
    assert torch.equal(auto.sequences, dense.sequences)
    assert all(torch.equal(a, b) for a, b in zip(auto.logits, dense.logits))
    assert auto_stats.sparse_sequence_steps == 0 and sparse_stats.sparse_sequence_steps > 0
    assert any(not torch.equal(a, b) for a, b in zip(sparse.logits, dense.logits))


def test_a_chunked_prefill_of_a_cuda_graphed_static_generate_runs():
    """``generate(prefill_chunk_size=...)`` with a static cache and transformers' CUDA-graphed compile
    (reduce-overhead): the prompt chunks run eagerly on a patched model, so what the prefill sets up
    (geometry buffers, CIS state) lives outside the graphs' pool. On the H100 `prhs-hf bench --modes
    static --prefill-chunk 16384` failed here with "accessing tensor output of CUDAGraphs that has been
    overwritten"; now the compiled steps agree with the eager ones after the same chunked prefill."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model = _model(torch.float32, head_dim=128)
    ids, mask = padded_batch([900, 700], device="cuda")
    cfg = {**CPE, "psaw": {"enabled": False}, "etf": {"enabled": False},
           "backend": {"decode": "triton", "prefill": "triton"}, "policy": {"decode": "sparse", "prefill": "sparse"}}
    torch._dynamo.reset()
    counters.clear()
    compiled, logits_c, r_compiled = _generate_with_logits(
        model, ids, mask, cfg, prefill_chunk_size=256, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the decode step; the chunks ran eagerly
    eager, logits_e, _ = _generate_with_logits(model, ids, mask, cfg, prefill_chunk_size=256, disable_compile=True)
    _assert_same_until_a_near_tie(compiled, logits_c, eager, logits_e)
    assert r_compiled.sparse_sequence_steps > 0
