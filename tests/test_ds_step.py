"""The Double Sparsity decode step of the operator benchmark (scripts/_ds_decode.py) on the CPU.

The Triton step (label scoring + exact top-k through ``topk_retrieval``, ``compose_indices``
without dilation, ``sparse_decode_attention``) against a plain PyTorch DS step: dense label
scores, ``torch.topk``, a masked softmax over sink ∪ top-k ∪ local.
"""

from __future__ import annotations

import math

import pytest
import torch

from prhs_hf.ops.decode_ops import HAS_TRITON, REFERENCE_OPS
from prhs_hf.selectors.double_sparsity import label_keys
from script_loader import load_script

ds = load_script("_ds_decode")
ds_decode_step, ds_decode_step_reference, ds_query_labels = (ds.ds_decode_step, ds.ds_decode_step_reference,
                                                              ds.ds_query_labels)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (TRITON_INTERPRET=1 on the CPU)")

B, HQ, HKV, D, S, R = 2, 4, 2, 32, 96, 8
SINK, LOCAL, K = 4, 8, 12


def _inputs(label_heads: int, active_rows=(True, True), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=g)
    k_cache, v_cache = (torch.randn(B, HKV, S, D, generator=g) for _ in range(2))
    i32 = dict(dtype=torch.int32)
    pad = torch.tensor([0, 6], **i32)  # row 1 left-padded, and 9 slots short of the cache
    t = torch.tensor([S, S - 6 - 9], **i32)
    lo = torch.full((B,), SINK, **i32)
    hi = t - LOCAL
    channels = torch.stack([torch.randperm(D, generator=g)[:R] for _ in range(label_heads)]).sort(-1).values
    label = label_keys(k_cache, channels[None].expand(B, label_heads, R))  # [B, Hc, S, R]
    q_channels = channels.repeat_interleave(HQ // label_heads, dim=0)  # [Hq, R]
    active = torch.tensor(active_rows)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, label_cache=label, q_channels=q_channels,
                pad=pad, t=t, lo=lo, hi=hi, win_start=hi, active=active)


def _member(idx: torch.Tensor, count: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """[B, Hq, S] cache slots of the composed real-index lists."""
    member = torch.zeros(B, HQ, S + 1, dtype=torch.bool)
    valid = torch.arange(idx.shape[-1]) < count[..., None]
    slot = torch.where(valid, idx.long() + pad.long().view(B, 1, 1), S)
    member.scatter_(2, slot, True)
    return member[..., :S]


@pytest.mark.parametrize("label_heads", [HKV, HQ], ids=["per_kv_head", "per_query_head"])
@pytest.mark.parametrize("active_rows", [(True, True), (True, False)], ids=["all_active", "row1_inactive"])
def test_ds_step_equals_pytorch_reference(label_heads, active_rows):
    x = _inputs(label_heads, active_rows)
    cap = SINK + K + LOCAL
    res = ds_decode_step(**x, sink=SINK, k=K, cap=cap, scale=1 / math.sqrt(D))
    want_member, want_out = ds_decode_step_reference(**x, sink=SINK, k=K, scale=1 / math.sqrt(D))
    assert torch.equal(_member(res.idx, res.count, x["pad"]), want_member)
    # ascending, unique lists: the layout the CIS step's attention takes
    for b in range(B):
        for h in range(HQ):
            row = res.idx[b, h, : res.count[b, h]]
            assert torch.all(row[1:] > row[:-1])
    n_top = want_member.sum(-1) - (SINK + LOCAL)
    assert torch.all(n_top[0] == K)  # the top-k really is in the set
    assert torch.all(n_top[1] == (K if active_rows[1] else 0))
    torch.testing.assert_close(res.out.float(), want_out, rtol=1e-5, atol=1e-5)
    # the same step through the launchers' PyTorch references
    ref_ops = ds_decode_step(**x, sink=SINK, k=K, cap=cap, scale=1 / math.sqrt(D), ops=REFERENCE_OPS)
    assert torch.equal(ref_ops.idx, res.idx) and torch.equal(ref_ops.count, res.count)


def test_ds_top_k_is_of_the_label_scores_not_the_exact_ones():
    """With r < D the selected set follows the label channels: the query restricted to them."""
    x = _inputs(HKV)
    res = ds_decode_step(**x, sink=SINK, k=K, cap=SINK + K + LOCAL, scale=1.0)
    ql = ds_query_labels(x["q"], x["q_channels"])
    scores = torch.einsum("hr,hsr->hs", ql[0], x["label_cache"][0].repeat_interleave(HQ // HKV, 0))
    mid = scores[:, SINK: S - LOCAL]
    want = mid.topk(K, dim=-1).indices + SINK
    assert torch.equal(res.sel[0].long().sort(-1).values, want.sort(-1).values)


def test_ds_query_labels_names_the_shape():
    with pytest.raises(ValueError, match="q_channels"):
        ds_query_labels(torch.zeros(1, HQ, D), torch.zeros(HQ + 1, R, dtype=torch.long))
