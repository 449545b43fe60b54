"""Step 4 of the CIS decode pipeline: exact softmax attention over each head's index list.

Contract (docs/DECODE_PIPELINE.md §4): attention of ``q[b, h]`` over the keys at cache slots
``pad[b] + idx[b, h, i]`` for ``i < count[b, h]`` (fp32 scores and accumulator, online
softmax, output in ``q``'s dtype). ``count = 0`` gives zeros. No full-length score vector.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launcher :func:`sparse_decode_attention`, and the PyTorch reference
:func:`sparse_decode_attention_reference`.
"""

from __future__ import annotations

import torch

from ._common import gqa_group

__all__ = ["sparse_decode_attention_reference"]


def sparse_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pad: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :func:`sparse_decode_attention` (vectorised, sync-free).

    Gathers the ``cap`` indexed K/V rows of every head (fixed shape) and masks the slots at or
    after ``count`` (it materialises ``[B, Hq, cap, D]``; the kernel does not).

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k_cache, v_cache: ``[B, Hkv, S, D]`` caches (same dtype as ``q``).
        pad: ``[B]`` int32 first real slot.
        idx: ``[B, Hq, cap]`` int32 real indices (valid before ``count``).
        count: ``[B, Hq]`` int32 number of valid indices.
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = gqa_group(Hq, Hkv)
    cap = idx.shape[-1]
    dev = q.device
    slots = (pad.long().view(B, 1, 1) + idx.long().clamp_min(0)).clamp(0, S - 1)
    b_ix = torch.arange(B, device=dev).view(B, 1, 1)
    h_ix = (torch.arange(Hq, device=dev) // G).view(1, Hq, 1)
    kg = k_cache[b_ix, h_ix, slots].float()  # [B, Hq, cap, D]
    vg = v_cache[b_ix, h_ix, slots].float()
    scores = (kg * q.float().unsqueeze(2)).sum(dim=-1) * scale  # [B, Hq, cap]
    valid = torch.arange(cap, device=dev) < count.long().unsqueeze(-1)
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p.unsqueeze(-1) * vg).sum(dim=-2) / denom.clamp_min(1e-30)
    out = torch.where(denom > 0, out, torch.zeros_like(out))
    return out.to(q.dtype)
