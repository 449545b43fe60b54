"""Quest (Tang et al., ICML 2024): query-aware page selection from min/max key bounds (SPEC §6).

The real positions are cut into pages of ``baseline.page_size`` (P) tokens, ``[iP, (i+1)P)``.
For each page and KV head Quest keeps the elementwise minimum and maximum of the page's keys; a
query's upper bound on any key score in the page is ``scale * Σ_d max(q_d m_d, q_d M_d)``. Here
the bounds are taken over the page's tokens that lie in the middle region (the sinks and the local
window are always kept, so they do not compete), recomputed at every step from the cache (Quest
maintains them incrementally; the values are the same).

Budget: the middle selection holds ``topk`` tokens, like every selector: pages are taken in
descending bound order (ties: lower page first) and the last page taken is cut at the budget
(its lowest positions are kept). Technically, every middle token is scored with its page's bound
and the ``topk`` best tokens are kept with ties broken by position
(:func:`.set_steps.topk_of_scores`), which is exactly that page order.

Retrieval ratio: Quest scores every page at every step, so every active row counts as
retrieving (ρ̂ = 1).
"""

from __future__ import annotations

import torch

from ..geometry import SequenceGeometry
from ..ops.triton_support import gqa_group
from .set_steps import StepFrame, TopKSelector, to_real, topk_of_scores

__all__ = ["QuestSelector", "page_bounds"]


def page_bounds(
    q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, frame: StepFrame, page_size: int, scale: float
) -> torch.Tensor:
    """``[B, Hq, R]`` Quest upper bound of each real position's page (``-inf`` outside the middle).

    ``R`` is the cache length rounded up to whole pages; a page's min/max run over its positions
    inside ``[lo, hi)``.
    """
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    g = gqa_group(Hq, Hkv)
    n_pages = -(-S // page_size)
    R = n_pages * page_size
    keys = to_real(k_cache.float().transpose(-1, -2), pad)  # [B, Hkv, D, S] by real position
    keys = torch.nn.functional.pad(keys, (0, R - S)).transpose(-1, -2)  # [B, Hkv, R, D]
    pos = torch.arange(R, device=q.device)
    in_mid = (pos >= frame.lo.long()[:, None]) & (pos < frame.hi.long()[:, None])  # [B, R]
    m = in_mid[:, None, :, None]
    kmin = keys.masked_fill(~m, float("inf")).view(B, Hkv, n_pages, page_size, D).amin(dim=3)
    kmax = keys.masked_fill(~m, float("-inf")).view(B, Hkv, n_pages, page_size, D).amax(dim=3)
    qf = q.float().view(B, Hkv, g, 1, D)
    bound = torch.maximum(qf * kmin[:, :, None], qf * kmax[:, :, None]).sum(-1) * scale  # [B, Hkv, g, n_pages]
    bound = bound.reshape(B, Hq, n_pages).repeat_interleave(page_size, dim=-1)  # [B, Hq, R]
    return bound.masked_fill(~in_mid[:, None, :], float("-inf"))


class QuestSelector(TopKSelector):
    """Top pages by min/max upper bound, filling ``topk`` middle tokens (stateless: the page bounds
    are read from the cache at every step)."""

    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    def middle(
        self, q: torch.Tensor, k_cache: torch.Tensor, geom: SequenceGeometry, frame: StepFrame, rows: torch.Tensor,
        k: int, scale: float,
    ) -> torch.Tensor:
        """The best pages' tokens, ``k`` of them (the set is ``sink ∪ these ∪ local``)."""
        score = page_bounds(q, k_cache, geom.pad, frame, self.page_size, scale)
        return topk_of_scores(score, frame, rows, k)
