"""Comparison selectors (SPEC §6), one per module, chosen by the config's ``baseline.name``."""

from __future__ import annotations

from ..config import ResolvedConfig
from .base import Selector

__all__ = ["Selector", "make_selector"]


def make_selector(resolved: ResolvedConfig, num_heads: int) -> Selector:
    """The selector that ``baseline.name`` names."""
    name = resolved.config.baseline.name
    raise NotImplementedError(f"baseline selector {name!r} is not implemented yet")
