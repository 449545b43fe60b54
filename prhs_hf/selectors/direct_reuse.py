"""DirectReuse (paper §VI-A, Table VI): CIS without the similarity gate and without dilation.

Decode steps are grouped into blocks of ``cis.block_size`` (s) steps counted from the first
decode step, as CIS's blocks are. At a block's first step every active (sequence, head) row
retrieves the exact top-k of the middle (the CIS retrieval); for the rest of the block it reuses
those indices unchanged, whatever its query, clipped to the current middle region. A row that
becomes active inside a block (its sequence grew past the budget) retrieves at once. The set is
``sink ∪ clip(anchor top-k) ∪ local``, so ρ̂ = (blocks) / (sparse steps) ≈ 1/s.

This equals CIS with ``tau: -1`` (every query shares the block's single anchor) and
``dilation_topm: 0``. The paper's control raises ``budget.topk`` by about 1/6 to match CIS's
processed KV; that is a config choice (``scripts/selection_quality.py`` reports both).
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from .set_steps import LayerStates, StepFrame, compose, retrieve_topk, step_frame

__all__ = ["DirectReuseSelector"]


class DirectReuseSelector(LayerStates):
    """Reuse each block's first retrieval for the whole block of ``block_size`` decode steps."""

    def __init__(self, block_size: int):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """Retrieve at the block's first step (or when a row has no anchor yet), else reuse; blocks
        count from the first decode step after a prefill (``ops`` unused)."""
        B, H, _ = q.shape
        k = params.topk
        st = self.layer_state(layer, B, lambda: {
            "anchor": torch.full((B, H, k), -1, dtype=torch.int32, device=q.device),
            "has": torch.zeros(B, H, dtype=torch.bool, device=q.device),
        })
        if st["anchor"].shape[-1] != k:
            raise ValueError(f"layer {layer}: budget.topk changed from {st['anchor'].shape[-1]} to {k} mid-generation")
        step = self.advance(layer)
        has = st["has"] & (step % self.block_size != 0)  # a new block has no anchors yet
        frame = step_frame(geom, params)
        retrieve = frame.rows(H) & ~has
        fresh = retrieve_topk(q, k_cache, geom, frame, retrieve, k, scale)
        reuse = has & frame.rows(H)
        # replaced, not written in place (LayerStates.mark_step keeps the tensors themselves)
        st["anchor"] = torch.where(retrieve[..., None], fresh, st["anchor"])
        st["has"] = has | retrieve
        middle = torch.where(retrieve[..., None], fresh, torch.where(reuse[..., None], st["anchor"], -1))
        extra = self.expansion(frame, middle, reuse, params, k_cache.shape[-2], layer=layer, step=step)
        if extra is not None:
            middle = torch.cat([middle, extra], dim=-1)
        return compose(frame, middle, params, retrieved=retrieve)

    def expansion(
        self, frame: StepFrame, middle: torch.Tensor, reuse: torch.Tensor, params: DecodeParams, slots: int, *,
        layer: int, step: int,
    ) -> torch.Tensor | None:
        """Middle indices added to the reused rows' sets at decode step ``step`` of ``layer`` (none:
        DirectReuse adds nothing)."""
        return None
