"""The interface of a comparison selector (SPEC §6): it picks each decode step's key set.

A selector replaces CIS in decode when the config's ``baseline.name`` names it; the sparse
attention over its set, the budget accounting and the telemetry are shared with CIS.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry

__all__ = ["Selector"]


class Selector(Protocol):
    """One baseline selector for every layer of a model (it may share state across layers)."""

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """See a layer's prefill: ``query [B, Hq, Lq, D]``, the cache ``key [B, Hkv, Lk, D]``."""

    def select(
        self,
        layer: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        geom: SequenceGeometry,
        params: DecodeParams,
        scale: float,
    ) -> DecodeSelection:
        """The key set of one decode step of ``layer`` for ``q [B, Hq, D]`` (real indices, sorted, -1 padded)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search: row ``i`` becomes old row ``index[i]``."""

    def reset(self) -> None:
        """Forget everything (a new prompt follows)."""
