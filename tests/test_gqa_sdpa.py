"""The fair dense attention ``sdpa_gqa`` (prhs_hf.attention.gqa_sdpa_attention_forward)."""

from __future__ import annotations

import pytest
import torch

import prhs_hf.attention as attention


def _inputs(batch=2, heads=4, kv_heads=2, q_len=24, kv_len=40, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=g)
    # a chunk of a chunked prefill over a cache, the second sequence left-padded by 5
    pos = torch.arange(kv_len - q_len, kv_len)
    mask = torch.arange(kv_len)[None, :] <= pos[:, None]
    mask = mask[None, None].repeat(batch, 1, 1, 1)
    mask[1, :, :, :5] = False
    return q, k, v, mask


def _reference(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


def test_a_mask_over_the_slice_limit_is_taken_in_query_slices(monkeypatch):
    """Each SDPA call gets at most MASK_SLICE_BYTES of mask (widened to the query's dtype), and the
    output equals one call's and the naive attention's."""
    q, k, v, mask = _inputs()
    module = torch.nn.Module()
    whole, _ = attention.gqa_sdpa_attention_forward(module, q, k, v, mask)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query, key, value, attn_mask=None, **kw):
        calls.append(tuple(attn_mask.shape))
        return sdpa(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    row_bytes = 2 * 1 * 40 * 4  # B x mask heads x kv_len x float32
    monkeypatch.setattr(attention, "MASK_SLICE_BYTES", 5 * row_bytes)
    sliced, _ = attention.gqa_sdpa_attention_forward(module, q, k, v, mask)
    assert calls == [(2, 1, 5, 40)] * 4 + [(2, 1, 4, 40)]
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(sliced, _reference(q, k, v, mask).transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_rows", [1, 24])
def test_a_small_or_broadcast_mask_is_one_call(monkeypatch, mask_rows):
    q, k, v, mask = _inputs()
    mask = mask[:, :, -mask_rows:] if mask_rows == 1 else mask
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    monkeypatch.setattr(attention, "MASK_SLICE_BYTES", 1 if mask_rows == 1 else 1 << 28)
    attention.gqa_sdpa_attention_forward(torch.nn.Module(), q, k, v, mask)
    assert calls == [1]
