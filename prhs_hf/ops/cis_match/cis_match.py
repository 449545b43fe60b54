"""Step 1 of the CIS decode pipeline: match each query head against its block's anchors.

Contract (docs/DECODE_PIPELINE.md §1): for an active row ``(b, h)``,
``sim_a = cos(q[b, h], anchor_q[b, h, a])`` for ``a < anchor_count[b, h]`` (fp32; a zero vector
has cosine 0); ``best = argmax_a sim_a`` (lowest ``a`` on ties) if ``max sim >= tau`` else
``-1`` (the head retrieves); no anchors gives ``-1``; an inactive sequence gives ``-2``. Beside
``best`` the step returns ``retrieve = best == -1`` as a bool tensor of its own: the retrieval
takes it as is, where a compiled step would otherwise launch a kernel to compare.

Both operands are normalised here (``x / max(|x|, NORM_EPS)``), so the anchors need not be
exactly unit vectors.

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernel, its
launcher :func:`cis_match`, and the PyTorch reference :func:`cis_match_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..triton_support import NORM_EPS, next_pow2, program_bh, require_triton, tl, triton, unit_vectors

__all__ = ["CISMatch", "cis_match", "cis_match_reference"]


class CISMatch(NamedTuple):
    """What :func:`cis_match` returns."""

    best: torch.Tensor  # [B, H] int32 matched anchor, -1 retrieve, -2 inactive sequence
    retrieve: torch.Tensor  # [B, H] bool: best == -1


@triton.jit
def _cis_match_kernel(
    Q, A, CNT, ACT, OUT, RETR,
    stride_qb, stride_qh,
    stride_ab, stride_ah, stride_as,
    stride_cb, stride_ch,
    tau, eps,
    H: tl.constexpr, S_ANCH: tl.constexpr, D: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (batch, query head) row: cosine against the valid anchors, argmax."""
    pid, b, h = program_bh(H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_a = tl.arange(0, BLOCK_A)
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    qn = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=0)), eps)
    a_ptrs = A + b * stride_ab + h * stride_ah + offs_a[:, None] * stride_as + offs_d[None, :]
    a = tl.load(a_ptrs, mask=(offs_a[:, None] < S_ANCH) & dmask[None, :], other=0.0).to(tl.float32)
    an = a / tl.maximum(tl.sqrt(tl.sum(a * a, axis=1)), eps)[:, None]
    sim = tl.sum(an * qn[None, :], axis=1)
    cnt = tl.load(CNT + b * stride_cb + h * stride_ch)
    valid = offs_a < cnt
    sim = tl.where(valid, sim, float("-inf"))
    best_sim = tl.max(sim, axis=0)
    # lowest anchor among the maxima
    best = tl.min(tl.where(valid & (sim == best_sim), offs_a, BLOCK_A), axis=0)
    best = tl.where((cnt > 0) & (best_sim >= tau), best, -1)
    act = tl.load(ACT + b).to(tl.int32)
    best = tl.where(act != 0, best, -2)
    tl.store(OUT + pid, best.to(tl.int32))
    tl.store(RETR + pid, (best == -1).to(tl.int8))


def cis_match(q: torch.Tensor, anchor_q: torch.Tensor, anchor_count: torch.Tensor, active: torch.Tensor,
              tau: float) -> CISMatch:
    """Triton CIS matching: one launch, one program per (batch, query head) row, no sync.

    Args and result as :func:`cis_match_reference`.
    """
    require_triton(q, anchor_q)
    B, H, D = q.shape
    s = anchor_q.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if anchor_q.stride(-1) != 1:
        anchor_q = anchor_q.contiguous()
    out = torch.empty((B, H), dtype=torch.int32, device=q.device)
    retrieve = torch.empty((B, H), dtype=torch.bool, device=q.device)
    if B * H == 0:
        return CISMatch(out, retrieve)
    _cis_match_kernel[(B * H,)](
        q, anchor_q, anchor_count, active, out, retrieve.view(torch.int8),
        q.stride(0), q.stride(1),
        anchor_q.stride(0), anchor_q.stride(1), anchor_q.stride(2),
        anchor_count.stride(0), anchor_count.stride(1),
        float(tau), NORM_EPS,
        H=H, S_ANCH=s, D=D,
        BLOCK_A=next_pow2(s, 2), BLOCK_D=next_pow2(D, 16),
        num_warps=4 if D * s >= 2048 else 2,
    )
    return CISMatch(out, retrieve)


def cis_match_reference(q: torch.Tensor, anchor_q: torch.Tensor, anchor_count: torch.Tensor, active: torch.Tensor,
                        tau: float) -> CISMatch:
    """PyTorch reference of :func:`cis_match` (vectorised, sync-free).

    Args:
        q: ``[B, Hq, D]`` decode queries (fp16/bf16/fp32).
        anchor_q: ``[B, Hq, s, D]`` fp32 anchor query vectors.
        anchor_count: ``[B, Hq]`` int32, number of valid anchors (the first slots).
        active: ``[B]`` bool, sequences running a sparse step.
        tau: cosine threshold for sharing.

    Returns:
        ``(best, retrieve)``: ``[B, Hq]`` int32 best anchor, ``-1`` (retrieve) or ``-2`` (inactive
        sequence), and ``[B, Hq]`` bool ``best == -1``.
    """
    s = anchor_q.shape[2]
    qn = unit_vectors(q)
    an = unit_vectors(anchor_q)
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
    best = torch.where(active.unsqueeze(-1), best, torch.full_like(best, -2))
    return CISMatch(best, best == -1)
