"""The state of Clustered Index Sharing for every layer: the anchors of the current block (SPEC §4).

One fixed-shape device tensor per kind for the whole model (``[L, B, Hq, ...]``), allocated once
per prompt shape and updated in place without host synchronisation, so that a compiled,
CUDA-graph-captured decode step sees few, fixed graph inputs. Anchors hold real indices (left
padding excluded), which stay valid while a sequence grows and follow their sequence under beam
reordering.
"""

from __future__ import annotations

import torch

from ..kernels.compose_indices import SET_NONE
from ..kernels.decode_ops import AnchorRecord, DecodeOps
from ..kernels.record_anchors import anchor_slots

__all__ = ["CISState"]


class CISState:
    """The block's anchors for every (layer, sequence, query head).

    Attributes:
        anchor_q: ``[L, B, Hq, s, D]`` fp32 unit query vectors.
        anchor_idx: ``[L, B, Hq, s, n]`` int32 each anchor's dilated middle set, sorted once when
            the anchor is taken (``kernels.compose_indices.dilated_set``: top-k plus the ±r
            neighbours of the top-m, encoded ``(j << 1) | neighbour_only``, ``SET_NONE`` padded),
            so sharing steps only filter it to the current middle region.
        anchor_count: ``[L, B, Hq]`` int32 number of valid anchors in the current block.
        step: ``[]`` int64 decode steps taken since the last prefill (one per forward, all layers).
        tail_k, tail_v, tail_log_mass: with ``cis.tail_slot`` (made by :meth:`ensure_tails`, else
            None): ``[L, B, Hq, s, D]`` fp32 each anchor's tail-summary key/value and ``[L, B, Hq, s]``
            its log-mass (``-inf``: none), written with the anchor by :meth:`record`.
    """

    def __init__(
        self, layers: int, batch: int, heads: int, head_dim: int, block_size: int, set_size: int, device: torch.device
    ):
        self.block_size = block_size
        self.anchor_q = torch.zeros(layers, batch, heads, block_size, head_dim, dtype=torch.float32, device=device)
        self.anchor_idx = torch.full((layers, batch, heads, block_size, set_size), SET_NONE, dtype=torch.int32, device=device)
        self.anchor_count = torch.zeros(layers, batch, heads, dtype=torch.int32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        for buffer in (self.anchor_q, self.anchor_idx, self.anchor_count, self.step):
            # fixed addresses: a compiled, CUDA-graph-captured decode step mutates them in place
            torch._dynamo.mark_static_address(buffer)
        self.tail_k: torch.Tensor | None = None
        self.tail_v: torch.Tensor | None = None
        self.tail_log_mass: torch.Tensor | None = None

    @torch.compiler.disable
    def ensure_tails(self, dim: int) -> None:
        """The anchors' tail-pair buffers for head size ``dim`` (kept while they fit; eager even
        inside a compiled forward, as the state itself: they must live outside any CUDA graph pool)."""
        if self.tail_k is not None and self.tail_k.shape[-1] == dim:
            return
        shape = (*self.anchor_q.shape[:-1], dim)
        with torch.inference_mode(False):  # as the state's other buffers (CISSelector._allocate)
            self._make_tails(shape)

    def _make_tails(self, shape: tuple[int, ...]) -> None:
        self.tail_k = torch.zeros(shape, dtype=torch.float32, device=self.anchor_q.device)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.tail_log_mass = torch.full(shape[:-1], float("-inf"), dtype=torch.float32, device=self.anchor_q.device)
        for buffer in (self.tail_k, self.tail_v, self.tail_log_mass):
            torch._dynamo.mark_static_address(buffer)

    def anchor_tails(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tail_k, tail_v, tail_log_mass)`` of ``layer`` (views; after :meth:`ensure_tails`)."""
        return self.tail_k[layer], self.tail_v[layer], self.tail_log_mass[layer]

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        tails = () if self.tail_k is None else (self.tail_k, self.tail_v, self.tail_log_mass)
        return (self.anchor_q, self.anchor_idx, self.anchor_count, *tails)

    def matches(self, layers: int, batch: int, heads: int, head_dim: int, device: torch.device) -> bool:
        """Whether the buffers fit decode steps of this shape."""
        n, b, h, _, d = self.anchor_q.shape
        return (n, b, h, d) == (layers, batch, heads, head_dim) and self.anchor_q.device == device

    def reset(self) -> None:
        """Start over (a new prompt) in place: no anchors, step 0; the addresses stay the same."""
        self.anchor_count.zero_()
        self.step.zero_()

    def begin_step(self) -> None:
        """Open a decode step (once per forward, before any layer). The anchors of a block of ``s``
        steps are cleared by each layer's :meth:`record` at the block's last step (the contract of
        ``record_anchors``)."""
        # add_(), not +=: ``x += y`` rebinds the attribute, which Dynamo replays after every
        # compiled step as an extra graph output and a Python setattr (host time per step)
        self.step.add_(1)

    def anchors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(anchor_q, anchor_idx, anchor_count)`` of ``layer`` (views)."""
        return self.anchor_q[layer], self.anchor_idx[layer], self.anchor_count[layer]

    def anchor_record(self, layer: int) -> AnchorRecord:
        """Where a selection records ``layer``'s anchors in its own launch (``decode_ops.cis_select``'s
        ``record``, the same contract as :meth:`record`)."""
        return AnchorRecord(self.anchor_q, self.anchor_idx, self.anchor_count, layer, self.step)

    def record(
        self, ops: DecodeOps, layer: int, q: torch.Tensor, indices: torch.Tensor, best: torch.Tensor,
        tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store ``(q / ||q||, dilated set)`` (and, with ``tail``, its tail pair ``(key [B, H, D],
        value [B, H, D], log_mass [B, H])``) as a new anchor of each row of ``layer`` that retrieved
        (``best == -1``), with ``ops.record_anchors`` (its contract: every row writes its slot
        ``anchor_count``, the first one not in use, and only the rows that retrieved count it; a
        block of ``s`` steps takes at most ``s`` anchors, so the slot is always in range, and at
        the block's last step the record clears the layer's anchors for the next block)."""
        if tail is not None:  # at the slot the record takes, before it counts
            where = anchor_slots(self.anchor_count, layer, self.block_size)
            self.tail_k.index_put_(where, tail[0])
            self.tail_v.index_put_(where, tail[1])
            self.tail_log_mass.index_put_(where, tail[2])
        ops.record_anchors(self.anchor_q, self.anchor_idx, self.anchor_count, layer, q, indices, best, self.step)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow a beam reordering: sequence ``i`` becomes old sequence ``index[i]`` in every layer."""
        index = index.to(self.anchor_q.device)
        for buffer in self._buffers():
            buffer.copy_(buffer.index_select(1, index))  # in place: addresses stay fixed
