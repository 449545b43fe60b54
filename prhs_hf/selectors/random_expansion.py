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

Draws come from a ``torch.Generator`` seeded with ``baseline.seed`` (re-seeded by ``reset``);
the paper averages 42 seeds.
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams
from ..kernels.compose_indices import compose_indices_reference
from .base import StepMark
from .set_steps import StepFrame
from .direct_reuse import DirectReuseSelector

__all__ = ["RandomExpansionSelector"]


class RandomExpansionSelector(DirectReuseSelector):
    """DirectReuse whose reused sets get CIS's dilation count of uniformly random middle indices."""

    CALL_STATE = (*DirectReuseSelector.CALL_STATE, "_generators")  # each generation's stream starts at seed

    def __init__(self, block_size: int, seed: int = 0):
        super().__init__(block_size)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def reset(self) -> None:
        """Forget the state and restart the random stream from ``seed``."""
        super().reset()
        self._generators.clear()

    def mark_step(self) -> StepMark:
        """DirectReuse's mark and each random stream's position (a generator's state is host data)."""
        return StepMark((super().mark_step(), {device: g.get_state() for device, g in self._generators.items()}))

    def undo_to(self, mark: StepMark) -> None:
        """Put the state and the random streams back to ``mark``."""
        layers, streams = mark.state
        super().undo_to(layers)
        for device, position in streams.items():
            self._generators[device].set_state(position)

    def expansion(
        self, frame: StepFrame, middle: torch.Tensor, reuse: torch.Tensor, params: DecodeParams, slots: int
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
        draw = torch.rand(B, H, slots, generator=self._generator(middle.device), device=middle.device)
        draw = torch.where(eligible, draw, -1.0)
        width = min(2 * r * m, slots)
        value, index = draw.topk(width, dim=-1)
        keep = (value >= 0) & (torch.arange(width, device=middle.device) < n_extra[..., None])
        return torch.where(keep, index, -1).to(torch.int32)
