"""Step 2 of the CIS decode pipeline: exact top-k of the middle region for retrieving heads.

Contract (docs/DECODE_PIPELINE.md §2): for rows with ``retrieve[b, h]``, score every real key
``j`` in ``[lo[b], hi[b])`` as ``scale * (q[b, h] . k_cache[b, kvh, pad[b] + j])`` (fp32) and
return the ``k`` best real indices in descending score order (ties: lower index first), ``-1``
padded when the region holds fewer than ``k`` keys. Rows not retrieving are all ``-1``.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernels, the
launcher :func:`topk_retrieval`, and the PyTorch reference :func:`topk_retrieval_reference`.
"""

from __future__ import annotations

import torch

from ._common import gqa_group

__all__ = ["topk_retrieval_reference"]


def topk_retrieval_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pad: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    retrieve: torch.Tensor,
    k: int,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :func:`topk_retrieval` (vectorised, sync-free).

    Scores every cache slot of every row (fixed shape), masks the slots outside each row's
    middle region and takes a stable descending sort, so equal scores keep index order.

    Args:
        q: ``[B, Hq, D]`` decode queries.
        k_cache: ``[B, Hkv, S, D]`` key cache (same dtype as ``q``).
        pad: ``[B]`` int32 first real slot.
        lo, hi: ``[B]`` int32 middle region ``[lo, hi)`` in real indices (may be empty).
        retrieve: ``[B, Hq]`` bool, rows that retrieve.
        k: number of indices to return.
        scale: score scale (the attention softmax scale).

    Returns:
        ``[B, Hq, k]`` int32 real indices, best first, ``-1`` padded.
    """
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = gqa_group(Hq, Hkv)
    qf = q.float().reshape(B, Hkv, G, D)
    # fp32 matmul (TF32 is off by default for matmuls in PyTorch), then the scale: the same
    # order of operations as the kernel.
    scores = torch.matmul(qf, k_cache.float().transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    scores = scores.reshape(B, Hq, S)
    real = torch.arange(S, device=q.device).unsqueeze(0) - pad.long().unsqueeze(1)  # [B, S]
    in_mid = (real >= lo.long().unsqueeze(1)) & (real < hi.long().unsqueeze(1)) & (real >= 0)
    valid = in_mid.unsqueeze(1) & retrieve.unsqueeze(-1)  # [B, Hq, S]
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    kk = min(int(k), S)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
    n_valid = valid.sum(dim=-1, keepdim=True)  # [B, Hq, 1]
    rank = torch.arange(kk, device=q.device)
    idx = torch.where(rank < n_valid, order - pad.long().view(B, 1, 1), -1)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((B, Hq, int(k) - kk), -1)], dim=-1)
    return idx.to(torch.int32)
