"""Where each sequence's real tokens sit in the cache, read off the attention mask.

transformers 5.x gives an attention function the whole layer cache (``[B, Hkv, Lk, D]``) and the
mask built by the registered mask function (``sdpa_mask``: a bool ``[B, 1, Lq, Lk]`` tensor, or
``None`` for a plain causal batch without padding), but no ``cache_position``. With left padding
or a StaticCache, ``Lk`` is not the sequence length: the mask row of the last query says which
slots are real. Real tokens of a sequence are contiguous: real index ``j`` sits in slot
``pad + j``. Everything here is tensor arithmetic without host synchronisation, except the
contiguity check (:func:`check_layout`), which a patched ``generate()`` defers to its stop check.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["DeferredLayoutCheck", "SequenceGeometry", "check_layout", "deferred_layout_checks", "geometry_from_mask",
           "raise_if_broken"]


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
