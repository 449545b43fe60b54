"""Step 1 of the CIS decode pipeline: match each query head against its block's anchors.

Contract (docs/DECODE_PIPELINE.md §1): for an active row ``(b, h)``,
``sim_a = cos(q[b, h], anchor_q[b, h, a])`` for ``a < anchor_count[b, h]`` (fp32; a zero vector
has cosine 0); ``best = argmax_a sim_a`` (lowest ``a`` on ties) if ``max sim >= tau`` else
``-1`` (the head retrieves); no anchors gives ``-1``; an inactive sequence gives ``-2``.

Both operands are normalised here (``x / max(|x|, NORM_EPS)``), so the anchors need not be
exactly unit vectors.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernel, its
launcher :func:`cis_match`, and the PyTorch reference :func:`cis_match_reference`.
"""

from __future__ import annotations

import torch

from ._common import NORM_EPS

__all__ = ["cis_match_reference"]


def cis_match_reference(
    q: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_count: torch.Tensor,
    active: torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """PyTorch reference of :func:`cis_match` (vectorised, sync-free).

    Args:
        q: ``[B, Hq, D]`` decode queries (fp16/bf16/fp32).
        anchor_q: ``[B, Hq, s, D]`` fp32 anchor query vectors.
        anchor_count: ``[B, Hq]`` int32, number of valid anchors (the first slots).
        active: ``[B]`` bool, sequences running a sparse step.
        tau: cosine threshold for sharing.

    Returns:
        ``[B, Hq]`` int32: best anchor, ``-1`` (retrieve) or ``-2`` (inactive sequence).
    """
    s = anchor_q.shape[2]
    qf = q.float()
    qn = qf / qf.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    af = anchor_q.float()
    an = af / af.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    # Elementwise product + sum: exact fp32 (a matmul could silently use TF32).
    sim = (an * qn.unsqueeze(2)).sum(dim=-1)  # [B, Hq, s]
    slot = torch.arange(s, device=q.device)
    valid = slot < anchor_count.unsqueeze(-1).long()
    sim = torch.where(valid, sim, torch.full_like(sim, float("-inf")))
    best_sim = sim.amax(dim=-1)
    # torch.argmax returns the first maximal index: the lowest anchor on ties.
    best = torch.argmax(sim, dim=-1).to(torch.int32)
    share = (anchor_count > 0) & (best_sim >= tau)
    best = torch.where(share, best, torch.full_like(best, -1))
    return torch.where(active.unsqueeze(-1), best, torch.full_like(best, -2))
