"""StreamingLLM (Xiao et al., 2024): attention sinks plus a recent window, budget-matched (SPEC §6).

StreamingLLM keeps the first tokens and a sliding window of the most recent ones. To spend the
same budget as CIS (``sink + local + topk``), the ``topk`` middle tokens it keeps are the most
recent ones of the middle region, so an active row attends to
``[0, sink) ∪ [max(lo, t - local - topk), t)``: the sinks and a ``local + topk`` window (clipped
below by the PSAW window start ``lo`` when PSAW acts on decode).

Retrieval ratio: StreamingLLM never scores keys to pick them, so no row ever counts as
retrieving and its ρ̂ is 0 (defined here; the tests check it).
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from .set_steps import StatelessSelector, compose, step_frame

__all__ = ["StreamingSelector"]


class StreamingSelector(StatelessSelector):
    """Sinks + the most recent ``local + topk`` tokens (stateless)."""

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """Sinks and the recent window; the middle selection is the window's older part (``ops`` unused)."""
        frame = step_frame(geom, params)
        window = torch.where(frame.active, torch.maximum(frame.lo, frame.hi - params.topk), frame.win_start)
        none = torch.full((q.shape[0], q.shape[1], 1), -1, dtype=torch.int32, device=q.device)
        return compose(frame, none, params, win_start=window)
