"""``backend.prefill: flash`` (FlashAttention-4) on an sm90/sm100 GPU (run: ``pytest -m gpu tests/test_flash_prefill_gpu.py``).

The block-sparse route against the fp32 reference and our Triton kernel (PSAW, ETF, left padding,
a chunked prefill, ragged lengths, GQA, D 64 and 128, bf16 and fp16); the dense route (FA4 causal
without a mask, the block-sparse dense pattern with padding) against SDPA / the reference; a tiny
bf16 model end to end against ``backend.prefill: triton``, with the FA4 calls counted. Skips with
the reason when there is no CUDA device, flash-attn-4 is not installed, or the GPU is not
sm90/sm100; an installed FA4 that fails to import fails the tests.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import prhs_hf
from prhs_hf import schedules as sched
from prhs_hf.backends import dense_prefill_function, prefill_function
from prhs_hf.ops.prefill import flash_prefill as fp
from prhs_hf.ops.prefill import prefill_attention as pa
from prhs_hf.ops.prefill.prefill_plan import PrefillPlan
from test_kernels_prefill import Case, dead_rows, on_device
from tiny_models import padded_batch, tiny_model

pytestmark = pytest.mark.gpu

SINK = 8


@pytest.fixture(autouse=True)
def _fa4():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn-4 is not installed (" + fp.INSTALL_HINT + ")")
    cap = torch.cuda.get_device_capability()
    if cap[0] not in fp.SUPPORTED_MAJORS:
        pytest.skip(f"compute capability {cap[0]}.{cap[1]}: FA4's forward here is sm90/sm100 only")
    fp.require_flash_attn(torch.device("cuda"))  # installed: an import failure is a failure


def _deepest(L: int, pads: tuple[int, ...]) -> tuple[float, tuple[tuple[int, int], ...]]:
    """The paper's deepest-layer window fraction and ETF frozen rows (32 layers, start 16)."""
    w = sched.psaw_window_fraction(32, 32, 16, 0.7, 1.0)
    return w, tuple((SINK, max(SINK, sched.etf_frozen_count(L - p, 32, 32, 16, 0.5, 1.0))) for p in pads)


def _cases() -> list[Case]:
    out = []
    for name, L, D, Hq, Hkv, pads in (
        ("L4096-d128-mha", 4096, 128, 32, 32, (0,)),
        ("L4096-d128-gqa4-padded", 4096, 128, 32, 8, (0, 300)),
        ("L3001-d64-gqa4-padded-ragged", 3001, 64, 8, 2, (0, 517, 1200)),
        ("L8192-d128-gqa4", 8192, 128, 32, 8, (0,)),
    ):
        w, frozen = _deepest(L, pads)
        out.append(Case(name, B=len(pads), Hq=Hq, Hkv=Hkv, Lq=L, D=D, pads=pads, sink=SINK, w=w, frozen=frozen))
    out.append(Case("chunked-prefill-padded", B=2, Hq=8, Hkv=2, Lq=700, prefix=1500, D=128, pads=(0, 211), sink=SINK, w=0.4))
    out.append(Case("psaw-only-mqa", Hq=8, Hkv=1, Lq=2000, D=128, sink=SINK, w=0.3))
    return out


CASES = _cases()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sparse_route_matches_the_reference_and_the_triton_kernel(case, dtype):
    args = on_device(case.tensors(), "cuda", dtype)
    q, k, v, plan, scale = args
    out = fp.flash_prefill_attention(*args)
    assert out.dtype == dtype and out.shape == (case.B, case.Lq, case.Hq, case.D) and out.is_contiguous()
    ref = pa.prefill_attention_reference(q.float(), k.float(), v.float(), plan, scale)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), pa.prefill_attention(*args).float(), atol=2e-2, rtol=2e-2)
    assert bool((out[dead_rows(plan)] == 0).all())  # frozen and padding rows: exactly zero


def test_dense_route_without_a_mask_is_fa4_causal_and_equals_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(fp, "flash_block_sparse_attention", lambda *a: calls.append(a) or pytest.fail("block-sparse path taken"))
    q, k, v, plan, _ = on_device(Case("dense", Hq=32, Hkv=8, Lq=8192, D=128, sink=0).tensors(), "cuda", torch.bfloat16)
    out = fp.flash_dense_prefill_attention(q, k, v, plan.pad, plan.q_start, 128**-0.5, no_mask=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.float(), ref.transpose(1, 2).float(), atol=1e-2, rtol=1e-2)
    assert not calls


@pytest.mark.parametrize("case", [Case("padded", B=3, Hq=8, Hkv=4, Lq=2500, D=128, pads=(0, 90, 1300), sink=0),
                                  Case("over-a-cache", B=1, Hq=8, Hkv=2, Lq=900, prefix=1100, D=64, sink=0)],
                         ids=lambda c: c.name)
def test_dense_route_with_padding_or_a_cache_is_exact(case):
    q, k, v, plan, scale = on_device(case.tensors(), "cuda", torch.bfloat16)
    out = fp.flash_dense_prefill_attention(q, k, v, plan.pad, plan.q_start, scale, no_mask=case.pads == (0,))
    dense = PrefillPlan.dense_causal(plan.pad, plan.q_start, case.Lq)
    ref = pa.prefill_attention_reference(q.float(), k.float(), v.float(), dense, scale)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert bool((out[dead_rows(dense)] == 0).all())


def test_fp32_is_refused_on_the_gpu():
    args = on_device(CASES[-1].tensors(), "cuda", torch.float32)
    with pytest.raises(ValueError, match="backend.prefill: flash"):
        fp.flash_prefill_attention(*args)


def test_auto_takes_fa4_for_bf16_and_triton_or_sdpa_for_fp32():
    """Where FA4 runs, ``backend.prefill: auto`` (the fastest measured route) is FA4 for bf16
    attention, the Triton kernel (PSAW/ETF layers) and SDPA (dense layers) for fp32 (FA4 has no fp32
    forward)."""
    gpu = torch.device("cuda")
    assert prefill_function("auto", gpu, torch.bfloat16, 128) is fp.flash_prefill_attention
    assert dense_prefill_function("auto", gpu, torch.bfloat16, 128) is fp.flash_dense_prefill_attention
    assert prefill_function("auto", gpu, torch.float32, 128) is pa.prefill_attention
    assert dense_prefill_function("auto", gpu, torch.float32, 128) is None


# ----------------------------------------------------------------------------- a model end to end

CPE = {"budget": {"sink": 8, "local": 32, "topk": 88}, "cis": {"block_size": 8}, "psaw": {"enabled": True},
       "etf": {"enabled": True}}  # PSAW/ETF from layer N/2: layers 0-2 dense, 3-5 sparse


def _model(dtype):
    heads, head_dim = 8, 128
    model = tiny_model("llama", dtype=torch.float32, layers=6, heads=heads, kv_heads=4, hidden_size=heads * head_dim,
                       intermediate_size=4 * heads * head_dim, head_dim=head_dim)
    return model.cuda().to(dtype)


def _prefill_logits(model, ids, mask, prefill: str) -> torch.Tensor:
    """Prefill logits; an all-ones ``mask`` is not passed (no mask at all: FA4's causal path)."""
    prhs_hf.patch(model, CPE, overrides={"backend": {"prefill": prefill, "decode": "triton"}})
    try:
        with torch.no_grad():
            return model(ids, attention_mask=None if bool(mask.all()) else mask).logits.float()
    finally:
        prhs_hf.unpatch(model)


def _spy(monkeypatch) -> dict[str, int]:
    """Count the route's FA4 calls (the dense causal one and the block-sparse one)."""
    counts = {"causal": 0, "block_sparse": 0}
    causal, sparse = fp.flash_causal_attention, fp.flash_block_sparse_attention

    def counted_causal(*a, **kw):
        counts["causal"] += 1
        return causal(*a, **kw)

    def counted_sparse(*a, **kw):
        counts["block_sparse"] += 1
        return sparse(*a, **kw)

    monkeypatch.setattr(fp, "flash_causal_attention", counted_causal)
    monkeypatch.setattr(fp, "flash_block_sparse_attention", counted_sparse)
    return counts


@pytest.mark.parametrize("lengths", [[1800, 1800], [1800, 1100, 1500]], ids=["unpadded", "left-padded"])
def test_tiny_model_flash_prefill_equals_triton_within_bf16(lengths, monkeypatch):
    ids, mask = padded_batch(lengths, device="cuda")
    truth = _prefill_logits(_model(torch.float32), ids, mask, "torch")
    model = _model(torch.bfloat16)
    tri = _prefill_logits(model, ids, mask, "triton")
    counts = _spy(monkeypatch)
    fla = _prefill_logits(model, ids, mask, "flash")
    padded = len(set(lengths)) > 1
    # 3 sparse layers always go block-sparse; the 3 dense layers: FA4 causal unpadded, the dense pattern padded
    assert counts == ({"causal": 0, "block_sparse": 6} if padded else {"causal": 3, "block_sparse": 3}), counts
    real = mask.bool()
    err = lambda x: ((x - truth).norm(dim=-1) / truth.norm(dim=-1))[real].mean().item()  # noqa: E731
    assert err(fla) <= 1.5 * err(tri) + 0.01, f"flash {err(fla):.4f} vs triton {err(tri):.4f}"
    # next tokens equal wherever triton's top-2 margin is above bf16 noise
    top2 = tri[:, -1].topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 0.05 * tri[:, -1].abs().amax(dim=-1)
    assert torch.equal(fla[:, -1].argmax(-1)[sure], tri[:, -1].argmax(-1)[sure])
