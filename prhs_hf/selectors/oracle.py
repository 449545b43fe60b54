"""The budget-matched top-k oracle: exact per-query top-k of the middle at every step (SPEC §6).

Every active (sequence, head) row scores every key of the middle region with its own query (the
attention scale, GQA: the key head the query head reads) and keeps the ``topk`` best, as a CIS
retrieval does (:func:`prhs_hf.ops.topk.topk_retrieval.topk_retrieval_reference`). The set is
``sink ∪ top-k(middle) ∪ local``: CIS with ``block_size: 1``. Every active row retrieves at every
step, so its retrieval ratio ρ̂ is 1.
"""

from __future__ import annotations

import torch

from ..geometry import SequenceGeometry
from .set_steps import StepFrame, TopKSelector, retrieve_topk

__all__ = ["OracleSelector"]


class OracleSelector(TopKSelector):
    """Exact top-k of the middle per query (stateless)."""

    def middle(
        self, q: torch.Tensor, k_cache: torch.Tensor, geom: SequenceGeometry, frame: StepFrame, rows: torch.Tensor,
        k: int, scale: float,
    ) -> torch.Tensor:
        """``top-k(q · K[middle])`` of every active row."""
        return retrieve_topk(q, k_cache, geom, frame, rows, k, scale)
