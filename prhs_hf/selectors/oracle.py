"""The budget-matched top-k oracle: exact per-query top-k of the middle at every step (SPEC §6).

Every active (sequence, head) row scores every key of the middle region with its own query (the
attention scale, GQA: the key head the query head reads) and keeps the ``topk`` best, as a CIS
retrieval does (:func:`prhs_hf.kernels.topk_retrieval.topk_retrieval_reference`). The set is
``sink ∪ top-k(middle) ∪ local``: CIS with ``block_size: 1``. Every active row retrieves at every
step, so its retrieval ratio ρ̂ is 1.
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from .set_steps import StatelessSelector, compose, retrieve_topk, step_frame

__all__ = ["OracleSelector"]


class OracleSelector(StatelessSelector):
    """Exact top-k of the middle per query (stateless)."""

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float,
    ) -> DecodeSelection:
        """``sink ∪ top-k(q · K[middle]) ∪ local`` for every active row; everything for the others."""
        frame = step_frame(geom, params)
        rows = frame.rows(q.shape[1])
        middle = retrieve_topk(q, k_cache, geom, frame, rows, params.topk, scale)
        return compose(frame, middle, params, retrieved=rows)
