"""Sparse prefill attention on a CUDA GPU at 4k-32k tokens (run: ``pytest -m gpu tests/test_kernels_prefill_gpu.py``).

The autotuned Triton kernel in bf16 against the chunked fp32 reference computed on the GPU
from the same bf16 inputs, at the paper's schedules (sink 8, phi 0.7, psi 0.5, deepest layer),
for D = 128 and 64, MHA, GQA and MQA, with and without left padding; dense mode against
PyTorch SDPA; FlexAttention against the kernel; fp16 and fp32 inputs.
"""

from __future__ import annotations

import pytest
import torch

from prhs_hf import schedules as sched
from prhs_hf.ops.prefill.prefill_attention import prefill_attention, prefill_attention_reference
from test_kernels_prefill import Case, dead_rows, on_device

pytestmark = pytest.mark.gpu

SINK = 8
N_LAYERS, START = 32, 16
DEEPEST = N_LAYERS  # u = 1


def _case(name: str, L: int, D: int, Hq: int, Hkv: int, mode: str, pads: tuple[int, ...] = (0,)) -> Case:
    """A prefill of ``L`` slots at the deepest layer with PSAW, ETF or both (paper defaults)."""
    w = sched.psaw_window_fraction(DEEPEST, N_LAYERS, START, 0.7, 1.0) if mode in ("psaw", "both") else 1.0
    frozen = ()
    if mode in ("etf", "both"):
        frozen = tuple(
            (SINK, max(SINK, sched.etf_frozen_count(L - p, DEEPEST, N_LAYERS, START, 0.5, 1.0))) for p in pads
        )
    return Case(name, B=len(pads), Hq=Hq, Hkv=Hkv, Lq=L, D=D, pads=pads, sink=SINK, w=w, frozen=frozen)


SHAPES = [
    # (L, D, Hq, Hkv, pads)
    (4096, 128, 32, 32, (0,)),  # LLaMA-2-7B heads
    (4096, 64, 8, 2, (0, 300)),  # GQA, left-padded batch
    (16384, 128, 8, 2, (0,)),
    (16384, 64, 8, 8, (0,)),
    (32768, 128, 8, 2, (0,)),
    (32768, 64, 4, 1, (0,)),  # MQA
]


@pytest.mark.parametrize("mode", ["psaw", "etf", "both"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"L{s[0]}-d{s[1]}-h{s[2]}x{s[3]}-b{len(s[4])}" for s in SHAPES])
def test_gpu_bf16_matches_fp32_reference(shape, mode):
    L, D, Hq, Hkv, pads = shape
    case = _case(mode, L, D, Hq, Hkv, mode, pads)
    args = on_device(case.tensors(), "cuda", torch.bfloat16)
    out = prefill_attention(*args)
    q, k, v, *rest = args
    ref = prefill_attention_reference(q.float(), k.float(), v.float(), *rest)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    if mode != "psaw":  # frozen rows are exactly zero
        assert bool((out[dead_rows(rest[0])] == 0).all())


def test_gpu_dense_mode_equals_sdpa():
    case = Case("dense", Hq=32, Hkv=8, Lq=8192, D=128, sink=SINK)
    q, k, v, *rest = on_device(case.tensors(), "cuda", torch.bfloat16)
    out = prefill_attention(q, k, v, *rest)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.float(), ref.transpose(1, 2).float(), atol=1e-2, rtol=1e-2)


def test_gpu_forced_configs_agree():
    case = _case("both", 4096, 128, 8, 2, "both")
    args = on_device(case.tensors(), "cuda", torch.bfloat16)
    tuned = prefill_attention(*args)
    for bm, bn, warps, stages in ((64, 32, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2)):
        forced = prefill_attention(*args, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        torch.testing.assert_close(forced.float(), tuned.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gpu_other_dtypes(dtype):
    case = _case("both", 4096, 128, 8, 2, "both", (0, 77))
    args = on_device(case.tensors(), "cuda", dtype)
    q, k, v, *rest = args
    ref = prefill_attention_reference(q.float(), k.float(), v.float(), *rest)
    out = prefill_attention(*args)
    tol = 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_gpu_flex_matches_kernel():
    from prhs_hf.ops.prefill.flex_prefill import flex_prefill_attention

    case = _case("both", 4096, 128, 8, 2, "both", (0, 128))
    args = on_device(case.tensors(), "cuda", torch.bfloat16)
    torch.testing.assert_close(flex_prefill_attention(*args).float(), prefill_attention(*args).float(), atol=1e-2, rtol=1e-2)
