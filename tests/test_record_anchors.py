"""``record_anchors`` (docs/DECODE_PIPELINE.md §5): the reference against a per-row loop, the Triton
kernel against the reference (``TRITON_INTERPRET=1`` on the CPU, or CUDA), and the compiled op
writing the state in place."""

from __future__ import annotations

import pytest
import torch

from conftest import triton_available
from prhs_hf.ops.compose.dilated_set import SET_NONE
from prhs_hf.ops.compose.record_anchors import record_anchors, record_anchors_reference

needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _state(L=3, B=2, H=4, s=4, D=16, n=12, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    aq = torch.randn(L, B, H, s, D, generator=g).to(device)
    ai = torch.randint(0, 500, (L, B, H, s, n), generator=g, dtype=torch.int32).to(device)
    # every count from 0 to s: s (a full block) must write the last slot
    ac = torch.randint(0, s + 1, (L, B, H), generator=g, dtype=torch.int32).to(device)
    return aq, ai, ac


def _inputs(B=2, H=4, D=16, n=12, seed=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    q[0, 0] = 0  # a zero query stores a zero vector
    new_set = torch.randint(0, 1000, (B, H, n), generator=g, dtype=torch.int32)
    new_set[..., -3:] = SET_NONE
    best = torch.randint(-2, 3, (B, H), generator=g, dtype=torch.int32)  # -2 inactive, -1 retrieve, >= 0 share
    return q.to(device), new_set.to(device), best.to(device)


STEP = torch.tensor(5)  # not a block's last step (s = 4)
LAST = torch.tensor(8)  # the last step of the second block


def _naive(aq, ai, ac, layer, q, new_set, best, step):
    aq, ai, ac = aq.clone(), ai.clone(), ac.clone()
    s = aq.shape[3]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            slot = min(int(ac[layer, b, h]), s - 1)
            v = q[b, h].double()
            aq[layer, b, h, slot] = (v / max(float(v.norm()), 1e-12)).float()
            ai[layer, b, h, slot] = new_set[b, h]
            ac[layer, b, h] = 0 if int(step) % s == 0 else int(ac[layer, b, h]) + (int(best[b, h]) == -1)
    return aq, ai, ac


@pytest.mark.parametrize("step", [STEP, LAST])
def test_reference_against_naive(step):
    aq, ai, ac = _state()
    q, new_set, best = _inputs()
    want = _naive(aq, ai, ac, 1, q, new_set, best, step)
    record_anchors_reference(aq, ai, ac, 1, q, new_set, best, step)
    torch.testing.assert_close(aq, want[0])
    assert torch.equal(ai, want[1]) and torch.equal(ac, want[2])
    before = _state()[2]
    assert torch.equal(ac[[0, 2]], before[[0, 2]])  # other layers untouched
    if step is STEP:  # only the retrieving rows count
        assert (ac[1] - before[1]).sum() == (best == -1).sum()
    else:  # the block's last step clears the layer's anchors for the next block
        assert (ac[1] == 0).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer,D,n,step", [(0, 16, 12, STEP), (2, 80, 40, LAST), (1, 128, 1100, STEP)])
def test_kernel_equals_reference(dtype, layer, D, n, step):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    aq, ai, ac = _state(D=D, n=n, device=device)
    q, new_set, best = _inputs(D=D, n=n, dtype=dtype, device=device)
    step = step.to(device)
    want = [x.clone() for x in (aq, ai, ac)]
    record_anchors_reference(*want, layer, q, new_set, best, step)
    record_anchors(aq, ai, ac, layer, q, new_set, best, step)
    torch.testing.assert_close(aq, want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(ai, want[1]) and torch.equal(ac, want[2])


@needs_triton
def test_kernel_strided_query():
    """A query that is a view with a non-contiguous head stride (as transformers' transpose gives)."""
    aq, ai, ac = _state()
    q, new_set, best = _inputs()
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    want = [x.clone() for x in (aq, ai, ac)]
    record_anchors_reference(*want, 0, q, new_set, best, STEP)
    record_anchors(aq, ai, ac, 0, q_strided, new_set, best, STEP)
    torch.testing.assert_close(aq, want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(ai, want[1]) and torch.equal(ac, want[2])


@pytest.mark.parametrize("fn", [record_anchors_reference, pytest.param(record_anchors, marks=needs_triton)])
def test_shape_errors_name_the_tensors(fn):
    aq, ai, ac = _state()
    q, new_set, best = _inputs()
    with pytest.raises(ValueError, match="layer 3 not in"):
        fn(aq, ai, ac, 3, q, new_set, best, STEP)
    with pytest.raises(ValueError, match="new_set"):
        fn(aq, ai, ac, 0, q, new_set[..., :5], best, STEP)
    with pytest.raises(ValueError, match="anchor_count"):
        fn(aq, ai, ac[:, :1], 0, q, new_set, best, STEP)
    with pytest.raises(ValueError, match="step"):
        fn(aq, ai, ac, 0, q, new_set, best, STEP.int())


@needs_triton
def test_compiled_op_writes_the_state_in_place():
    """Under torch.compile the op mutates the whole buffers (no copy): the eager tensors see it."""
    from prhs_hf.ops.decode_ops import TRITON_OPS

    aq, ai, ac = _state()
    q, new_set, best = _inputs()
    want = [x.clone() for x in (aq, ai, ac)]
    record_anchors_reference(*want, 2, q, new_set, best, STEP)
    ptrs = [x.data_ptr() for x in (aq, ai, ac)]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(aq, ai, ac, q, new_set, best, step):
        TRITON_OPS.record_anchors(aq, ai, ac, 2, q, new_set, best, step)

    step(aq, ai, ac, q, new_set, best, STEP)
    assert [x.data_ptr() for x in (aq, ai, ac)] == ptrs
    torch.testing.assert_close(aq, want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(ai, want[1]) and torch.equal(ac, want[2])
