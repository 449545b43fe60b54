"""RandomExpansion (paper §VI-A, Table VI): DirectReuse plus as many random middle indices as CIS dilates.

On a step where a row reuses its block's anchor indices ``p_1..p_k`` (see
:mod:`.direct_reuse`), CIS would add the ``±r`` neighbours of ``p_1..p_m`` (clipped to the
middle, without duplicates). RandomExpansion counts exactly how many indices that dilation would
add to the row's set, ``n = |dilated set| - |undilated set|`` (both from
:func:`compose_indices_reference`, so sinks, the local window and the middle bounds are handled
as CIS does), and instead adds ``n`` indices drawn uniformly without replacement from the middle
positions not already selected ("the eligible non-sink and non-local region"). Retrieval steps
add nothing (CIS does not dilate a fresh retrieval). The set therefore has exactly the size of
the CIS set that shares the same anchor, and at most ``params.capacity`` entries.

The draws are a counter-based hash of (``baseline.seed``, layer, decode step, the sequence's length,
head, real position), not a generator's stream over the batch: a sequence draws the same indices
alone and in any batch, at any padding, and a step that is undone draws the same again. The paper
averages 42 seeds.
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams
from ..ops.compose.compose_indices import compose_indices_reference
from .set_steps import StepFrame
from .direct_reuse import DirectReuseSelector

__all__ = ["RandomExpansionSelector"]


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of ``x`` (int64 values in ``[0, 2**32)``; no overflow:
    the multiplier is below ``2**27``)."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


class RandomExpansionSelector(DirectReuseSelector):
    """DirectReuse whose reused sets get CIS's dilation count of uniformly random middle indices."""

    def __init__(self, block_size: int, seed: int = 0):
        super().__init__(block_size)
        self.seed = seed

    def draws(self, frame: StepFrame, layer: int, step: int, heads: int, slots: int) -> torch.Tensor:
        """``[B, Hq, slots]`` int64: a distinct pseudo-random value per real position of each (sequence,
        head), a function of ``seed``, ``layer``, ``step``, the sequence's length ``t``, the head and the
        position only (the position in the low 21 bits keeps the values distinct, so ``topk`` has no ties)."""
        device = frame.t.device
        key = _mix32(torch.tensor([self.seed & _MASK32, layer, step], dtype=torch.int64, device=device))
        key = _mix32(key[0] ^ _mix32(key[1] ^ _mix32(key[2] ^ frame.t.long())))  # [B]
        head = torch.arange(heads, device=device, dtype=torch.int64)
        pos = torch.arange(slots, device=device, dtype=torch.int64)
        row = _mix32(key[:, None] ^ _mix32(head + 0x9E3779B))  # [B, Hq]
        return (_mix32(row[..., None] ^ pos) << 21) | pos  # positions < 2**20 (MAX_TOKENS)

    def expansion(
        self, frame: StepFrame, middle: torch.Tensor, reuse: torch.Tensor, params: DecodeParams, slots: int, *,
        layer: int, step: int,
    ) -> torch.Tensor | None:
        """``[B, Hq, 2rm]`` random middle indices (``-1`` padded): as many per row as CIS's dilation adds."""
        m, r = min(params.dilation_topm, middle.shape[-1]), params.dilation_radius
        if m == 0 or r == 0:
            return None
        B, H, _ = middle.shape
        args = (frame.t, frame.lo, frame.hi, frame.win_start, middle)
        _, plain = compose_indices_reference(*args, False, params.sink, 0, 0, params.capacity)
        _, dilated = compose_indices_reference(*args, reuse, params.sink, m, r, params.capacity)
        n_extra = (dilated - plain).long()  # [B, Hq], 0 where the row does not reuse
        pos = torch.arange(slots, device=middle.device)
        eligible = (pos >= frame.lo.long()[:, None]) & (pos < frame.hi.long()[:, None])  # [B, S]
        taken = torch.zeros(B, H, slots + 1, dtype=torch.bool, device=middle.device)
        taken.scatter_(-1, torch.where(middle >= 0, middle.long(), slots), True)
        eligible = eligible[:, None, :] & ~taken[..., :slots]
        draw = torch.where(eligible, self.draws(frame, layer, step, H, slots), -1)
        width = min(2 * r * m, slots)
        value, index = draw.topk(width, dim=-1)
        keep = (value >= 0) & (torch.arange(width, device=middle.device) < n_extra[..., None])
        return torch.where(keep, index, -1).to(torch.int32)
