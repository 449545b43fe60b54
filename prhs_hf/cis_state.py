"""Per-layer state of Clustered Index Sharing: the anchors of the current block (SPEC §4).

Fixed-shape device buffers updated without host synchronisation, so a decode step that uses
them can be captured in a CUDA graph. Anchors hold real indices (left padding excluded), which
stay valid while a sequence grows and follow their sequence under beam reordering.
"""

from __future__ import annotations

import torch

from .kernels.compose_indices import SET_NONE

__all__ = ["CISLayerState"]


class CISLayerState:
    """The block's anchors for every (sequence, query head) of one layer.

    Attributes:
        anchor_q: ``[B, Hq, s, D]`` fp32 unit query vectors.
        anchor_idx: ``[B, Hq, s, n]`` int32 each anchor's dilated middle set, sorted once when the
            anchor is taken (``kernels.compose_indices.dilated_set``: top-k plus the ±r
            neighbours of the top-m, encoded ``(j << 1) | neighbour_only``, ``SET_NONE`` padded),
            so sharing steps only filter it to the current middle region.
        anchor_count: ``[B, Hq]`` int32 number of valid anchors in the current block.
        step: ``[]`` int64 decode steps taken since the last prefill.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, block_size: int, set_size: int, device: torch.device):
        self.block_size = block_size
        self.anchor_q = torch.zeros(batch, heads, block_size, head_dim, dtype=torch.float32, device=device)
        self.anchor_idx = torch.full((batch, heads, block_size, set_size), SET_NONE, dtype=torch.int32, device=device)
        self.anchor_count = torch.zeros(batch, heads, dtype=torch.int32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        for buffer in (self.anchor_q, self.anchor_idx, self.anchor_count, self.step):
            # fixed addresses: a compiled, CUDA-graph-captured decode step mutates them in place
            torch._dynamo.mark_static_address(buffer)

    def matches(self, batch: int, heads: int, head_dim: int, device: torch.device) -> bool:
        """Whether the buffers fit a decode step of this shape."""
        b, h, _, d = self.anchor_q.shape
        return (b, h, d) == (batch, heads, head_dim) and self.anchor_q.device == device

    def reset(self) -> None:
        """Start over (a new prompt) in place: no anchors, step 0; the addresses stay the same."""
        self.anchor_count.zero_()
        self.step.zero_()

    def begin_step(self) -> None:
        """Clear the anchors at the first step of every block of ``s`` decode steps."""
        block_start = torch.remainder(self.step, self.block_size) == 0
        self.anchor_count.masked_fill_(block_start, 0)

    def record(self, q: torch.Tensor, indices: torch.Tensor, retrieved: torch.Tensor) -> None:
        """Store ``(q / ||q||, dilated set)`` as a new anchor of each row that retrieved; advance the step."""
        b, h, s, d = self.anchor_q.shape
        k = self.anchor_idx.shape[-1]
        slot = self.anchor_count.clamp(max=s - 1).long()
        qn = torch.nn.functional.normalize(q.float(), dim=-1)
        keep = retrieved[:, :, None]
        q_slot = slot[:, :, None, None].expand(b, h, 1, d)
        old_q = self.anchor_q.gather(2, q_slot).squeeze(2)
        self.anchor_q.scatter_(2, q_slot, torch.where(keep, qn, old_q).unsqueeze(2))
        i_slot = slot[:, :, None, None].expand(b, h, 1, k)
        old_i = self.anchor_idx.gather(2, i_slot).squeeze(2)
        self.anchor_idx.scatter_(2, i_slot, torch.where(keep, indices, old_i).unsqueeze(2))
        # add_(), not +=: ``x += y`` rebinds the attribute, which Dynamo replays after every
        # compiled step as an extra graph output and a Python setattr (host time per layer)
        self.anchor_count.add_(retrieved.to(torch.int32))
        self.step.add_(1)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow a beam reordering: row ``i`` becomes old row ``index[i]``."""
        index = index.to(self.anchor_q.device)
        for buffer in (self.anchor_q, self.anchor_idx, self.anchor_count):
            buffer.copy_(buffer.index_select(0, index))  # in place: addresses stay fixed
