"""The interface of a comparison selector (SPEC §6): it picks each decode step's key set.

A selector replaces CIS in decode when the config's ``baseline.name`` names it; the sparse
attention over its set, the budget accounting and the telemetry are shared with CIS.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps

__all__ = ["Selector", "StepMark", "UndoesSteps", "export_call_state", "import_call_state", "undo_period",
           "undoes_steps"]


class Selector(Protocol):
    """One baseline selector for every layer of a model (it may share state across layers).

    ``CALL_STATE`` names the attributes that belong to one generation (its cache), not to the
    selector: the runtime swaps them in and out as forwards of different caches arrive
    (:func:`export_call_state`). A selector that wraps another (``base``) adds its base's.
    """

    CALL_STATE: tuple[str, ...]

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
        ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """The key set of one decode step of ``layer`` for ``q [B, Hq, D]`` (real indices, sorted, -1 padded).

        ``ops`` is the decode ops table of ``q``'s device (the runtime passes the one that
        ``backend.decode`` picked there; the sparse attention of the step runs on it too). CIS
        runs its step on it; the baselines compute in PyTorch and leave it unused."""

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search: row ``i`` becomes old row ``index[i]``."""

    def reset(self) -> None:
        """Forget everything (a new prompt follows)."""


class StepMark(NamedTuple):
    """A selector's per-generation state after one forward, as :meth:`UndoesSteps.undo_to` puts it
    back: ``state`` (the selector's own), and ``counter``, the selector's decode steps since the last
    prefill (``[]`` int64 on the device) where it has an ``undo_period``, else None."""

    state: Any
    counter: torch.Tensor | None = None


class UndoesSteps(Protocol):
    """A selector that can undo its last decode steps exactly (the periodic stop check of
    ``generation.stop_check_every`` runs steps past a generation's end and undoes them;
    ``prhs_hf.patching.PeriodicStopCheck``). A selector without these methods makes ``generate()``
    check the stop flags at every step.

    The rule: after ``undo_to(mark_step())`` of the mark taken after a forward, every later step reads
    the state that the same step reads with no forwards in between. State a later step never reads
    (CIS's anchor slots past the count, an index entry past the cache's end) may differ.
    """

    undo_period: int | None
    """None: any steps undo exactly. ``p``: not across a step that ends a block of ``p`` of the
    selector's steps followed by another of its steps (CIS: that step clears the block's anchors and
    the next one overwrites them); the stop check reads before that happens."""

    def mark_step(self) -> StepMark:
        """The state of the generation in progress, after the forward just run. Cheap, for every step
        of the loop: no device->host read, device copies of the small tensors that change only."""

    def undo_to(self, mark: StepMark) -> None:
        """Put the state of the generation in progress back to ``mark`` (of this generation, taken
        after a later forward than any prefill since)."""


def undoes_steps(selector) -> bool:
    """Whether ``selector`` (and every selector it wraps) implements :class:`UndoesSteps`."""
    return all(callable(getattr(h, "mark_step", None)) and callable(getattr(h, "undo_to", None))
               for h in _holders(selector))


def undo_period(selector) -> int | None:
    """``selector``'s :attr:`UndoesSteps.undo_period` (None where it has none)."""
    return getattr(selector, "undo_period", None)


def _holders(selector) -> list:
    """``selector`` and the selectors it wraps (``selector.base``, recursively)."""
    chain = []
    while selector is not None:
        chain.append(selector)
        selector = getattr(selector, "base", None)
    return chain


def export_call_state(selector) -> list[dict[str, Any]]:
    """The attributes of ``selector`` (and of the selectors it wraps) that belong to the generation
    in progress (their ``CALL_STATE``), as the objects themselves (no copy)."""
    return [{name: getattr(h, name) for name in getattr(h, "CALL_STATE", ())} for h in _holders(selector)]


def import_call_state(selector, state: list[dict[str, Any]]) -> None:
    """Make ``state`` (from :func:`export_call_state` of the same selector) the selector's own."""
    for holder, fields in zip(_holders(selector), state, strict=True):
        holder.__dict__.update(fields)
