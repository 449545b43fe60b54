"""Where each sequence's real tokens sit in the cache, read off the attention mask.

transformers 5.x gives an attention function the whole layer cache (``[B, Hkv, Lk, D]``) and the
mask built by the registered mask function (``sdpa_mask``: a bool ``[B, 1, Lq, Lk]`` tensor, or
``None`` for a plain causal batch without padding), but no ``cache_position``. With left padding
or a StaticCache, ``Lk`` is not the sequence length: the mask row of the last query says which
slots are real. Real tokens of a sequence are contiguous: real index ``j`` sits in slot
``pad + j``. Everything here is tensor arithmetic without host synchronisation, except the
contiguity check (:func:`check_layout`), which a patched ``generate()`` defers to its stop check.

The forward's geometry travels to the layers in its :class:`ForwardContext`, the one object that holds
what a forward decided and set up. The first decoder layer's pre-hook
(:meth:`prhs_hf.runtime.PrHSRuntime.begin_forward`) makes one per eager forward, after the policy's
decision (``PrHSRuntime._decide``, its one place), and every reader of the forward's mode takes it from
there: the registered attention function (:func:`prhs_hf.attention.prhs_attention_forward`) and the
layers it hands the call to (:class:`prhs_hf.layer.PrHSLayer`, which receive it as an argument), the
prefill plans, EarlySelectKV's taps and the selector's host callbacks. Nothing changes it after it is
made. A forward under ``torch.compile`` makes none (it would be an attribute write that Dynamo replays
after every compiled step): it runs on the last eager forward's context, as a decode step of that
shape (:meth:`ForwardContext.is_decoding`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .config import ResolvedConfig

__all__ = ["DeferredLayoutCheck", "ForwardContext", "SequenceGeometry", "check_layout", "deferred_layout_checks",
           "geometry_from_mask", "raise_if_broken"]


@dataclass
class SequenceGeometry:
    """Per-sequence positions of one forward call.

    Attributes:
        pad: ``[B]`` int32, the first real cache slot of each sequence.
        t_last: ``[B]`` int32, how many real tokens the last query row sees (its own included).
        q_start: ``[B]`` int32, the real index of query row 0 (negative for left-padding rows).
    """

    pad: torch.Tensor
    t_last: torch.Tensor
    q_start: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pad, t_last, q_start)``."""
        return self.pad, self.t_last, self.q_start

    def query_real_index(self, q_len: int) -> torch.Tensor:
        """``[B, Lq]`` int32 real index of each of the ``q_len`` query rows."""
        rows = torch.arange(q_len, device=self.pad.device, dtype=torch.int32)
        return self.q_start[:, None] + rows[None, :]


@dataclass(frozen=True)
class ForwardContext:
    """One forward's decision, geometry and step state (see the module docstring).

    Attributes:
        decoding: the forward is a decode step (one query row over a cache that holds tokens); a
            prompt, also a 1-token one, or a multi-token forward over a cache is a prefill.
        sparse_prefill: the policy's decision for this forward's prefill (``policy.prefill``).
        sparse_decode: the policy's decision for this decode step, or at a prefill for the decode
            steps after it (compiled ones keep it; eager ones decide again).
        dense_step: a decode step that the policy sends to dense with nothing else to do (no
            telemetry, no PSAW window, no taps): every layer calls the fair dense attention at once,
            with no geometry made for it.
        geometry: the forward's :class:`SequenceGeometry` in the runtime's fixed buffers (updated in
            place by later forwards of the same batch shape; a dense step makes none and keeps the
            last one), or None before any.
        step_config: the resolved config at the top-k of the generation this forward belongs to
            (``budget.topk_fraction``: one k per generation, set at its prefill).
        last_query_slot: the cache slot of the forward's last query row, a host int (no device read):
            cached tokens plus query rows minus one; None where only the device knows.
        kv_buffers: the forward's cache layers (``backend.eager_step``: the sparse step reads the whole
            buffers of its :class:`~prhs_hf.runtime.BufferedLayer`), None once its ``generate()``
            returned, for a cache that is not a ``DynamicCache``, or with ``eager_step: plain``.
    """

    decoding: bool
    sparse_prefill: bool
    sparse_decode: bool
    dense_step: bool
    geometry: SequenceGeometry | None
    step_config: "ResolvedConfig"
    last_query_slot: int | None
    kv_buffers: list[Any] | None = None

    def is_decoding(self, q_len: int) -> bool:
        """Whether the forward running now, of ``q_len`` query rows, is a decode step: this context's
        :attr:`decoding` for the eager forward that made it, ``q_len == 1`` under ``torch.compile``."""
        return q_len == 1 if torch.compiler.is_compiling() else self.decoding

    def geometry_on(self, device: torch.device) -> SequenceGeometry | None:
        """The forward's geometry on ``device``: the buffers themselves on the first layer's device, a
        copy for a layer that a ``device_map`` puts on another one."""
        geom = self.geometry
        if geom is None or geom.pad.device == device:
            return geom
        return SequenceGeometry(*(x.to(device, non_blocking=True) for x in geom.tensors()))


def _valid_keys(mask: torch.Tensor) -> torch.Tensor:
    """``[B, Lk]`` bool: the keys the last query row may attend to."""
    row = mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        return row
    return row == 0  # additive float mask: 0 where visible, a large negative value elsewhere


def geometry_from_mask(
    mask: torch.Tensor | None,
    batch_size: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> SequenceGeometry:
    """Per-sequence pad offset, visible length and query start from the attention mask.

    ``mask`` is ``None`` (no padding, the queries are the last ``q_len`` of ``kv_len`` keys) or a
    4D ``[B, 1, Lq, Lk]`` bool/additive mask. No host synchronisation: see :func:`check_layout`
    for the check that the layout is one PrHS handles.
    """
    if mask is None:
        zeros = torch.zeros(batch_size, dtype=torch.int32, device=device)
        t_last = torch.full((batch_size,), kv_len, dtype=torch.int32, device=device)
        return SequenceGeometry(zeros, t_last, t_last - q_len)
    if mask.dim() != 4:
        raise ValueError(f"PrHS expects a 4D attention mask [B, 1, Lq, Lk] or None, got shape {tuple(mask.shape)}")
    valid = _valid_keys(mask)
    if valid.shape[0] == 1 and batch_size > 1:
        valid = valid.expand(batch_size, -1)
    t_last = valid.sum(-1, dtype=torch.int32)
    pad = valid.to(torch.int8).argmax(-1).to(torch.int32)
    return SequenceGeometry(pad, t_last, t_last - q_len)


class DeferredLayoutCheck:
    """The layout checks of one ``generate()``'s decode steps, kept on the device until the loop
    reads the device anyway (see :func:`deferred_layout_checks`).

    ``active`` turns deferral on (the loop's stop check does so once its prefill has run, so a
    prefill is always checked at once); :meth:`pending` hands the broken rows collected so far to
    the reader, which passes what it read to :func:`raise_if_broken`.
    """

    def __init__(self):
        self.active = False
        self._broken: torch.Tensor | None = None  # [B] bool: the rows some deferred step found broken

    def add(self, broken: torch.Tensor) -> None:
        """Keep the rows ``broken`` (``[B]`` bool) of one step; no host read."""
        if self._broken is not None and self._broken.shape != broken.shape:
            raise_if_broken(self._broken.tolist())  # another batch: settle the earlier one first
            self._broken = None
        self._broken = broken if self._broken is None else self._broken | broken

    def pending(self) -> torch.Tensor | None:
        """The rows collected since the last call (``[B]`` bool, or ``None``), forgotten here."""
        broken, self._broken = self._broken, None
        return broken


_DEFERRED: ContextVar[DeferredLayoutCheck | None] = ContextVar("prhs_deferred_layout", default=None)


@contextmanager
def deferred_layout_checks() -> Iterator[DeferredLayoutCheck]:
    """For the block (one ``generate()`` in this thread): once the returned collector is
    ``active``, :func:`check_layout` keeps a decode step's result on the device for the loop to read
    at its next stop check instead of reading it at once."""
    collector = DeferredLayoutCheck()
    token = _DEFERRED.set(collector)
    try:
        yield collector
    finally:
        _DEFERRED.reset(token)


def check_layout(mask: torch.Tensor | None, geom: SequenceGeometry, last_query_slot: int | None) -> None:
    """Raise ``ValueError`` unless every sequence is one contiguous run of cache slots ending at
    the last query (left padding, as ``generate()`` does). Eager only.

    ``last_query_slot`` is the cache slot of the forward's last query row (``cached tokens +
    Lq - 1``), or ``None`` where it is not known. Right padding fails here: its last query row
    is a pad, whose mask row ends before it; so does a decode token that lands after a gap.

    When it is raised: at once (a host read) for a prefill and for every forward outside a
    patched ``generate()``'s sync-free loop; a decode step inside that loop
    (:func:`deferred_layout_checks`) leaves its result on the device, and the error is raised at the
    loop's next stop check (at most ``generation.stop_check_every`` steps later) or at the end of
    ``generate()``, naming the same rows.
    """
    if mask is None:
        return
    valid = _valid_keys(mask)
    if valid.shape[0] == 1 and geom.pad.shape[0] > 1:
        valid = valid.expand(geom.pad.shape[0], -1)
    last = valid.shape[-1] - 1 - valid.flip(-1).to(torch.int8).argmax(-1).to(torch.int32)
    real = geom.t_last > 0
    broken = real & (last - geom.pad + 1 != geom.t_last)
    if last_query_slot is not None:
        broken |= real & (last != last_query_slot)
    collector = _DEFERRED.get()
    if collector is not None and collector.active and mask.shape[-2] == 1 and last_query_slot:
        collector.add(broken)  # a decode step inside the sync-free loop: read at its next stop check
        return
    if bool(broken.any()):
        raise_if_broken(broken.tolist())


def raise_if_broken(broken: list[bool]) -> None:
    """Raise the layout ``ValueError`` naming the rows that are ``True`` in ``broken`` (read on the host)."""
    rows = [i for i, b in enumerate(broken) if b]
    if rows:
        raise ValueError(
            "PrHS needs each sequence's real tokens to be one contiguous run of cache slots that ends "
            f"at the newest token (left padding, as generate() does); sequence(s) {rows} of this batch "
            "have padding inside or after their tokens (right padding or a custom mask). "
            "Use tokenizer.padding_side = 'left'."
        )
