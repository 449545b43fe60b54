"""What every decode selector shares: its parameters, its result, the middle region, and the
PSAW window decode that needs no selector (SPEC §4).

The selectors themselves (CIS and the baselines) are in ``prhs_hf.selectors``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import SequenceGeometry
from .ops.triton_support import layer_rows
from .schedules import psaw_window_start_tensor

__all__ = ["DecodeParams", "DecodeSelection", "StepFrame", "layer_rows", "middle_start", "step_frame", "window_decode_step"]


@dataclass(frozen=True)
class DecodeParams:
    """What a decode step of one layer needs from the config."""

    sink: int
    local: int
    topk: int
    tau: float
    dilation_topm: int
    dilation_radius: int
    capacity: int
    window_fraction: float | None  # PSAW w_l for decode; None when PSAW does not act on this layer's decode


@dataclass
class DecodeSelection:
    """What a selector picked for one decode step: index sets, their sizes, who retrieved, who
    was sparse. ``H`` is ``Hq`` (a set per query head) or ``Hkv`` (one per KV head, shared by its
    query heads: ``cis.selection: group``). ``tail``, when set, is one synthetic key/value per row
    attended beside ``idx`` with logit ``scale * q·key + log_mass`` (CertKV's tail-summary slot;
    ``log_mass = -inf``: none); ``count`` then includes the slot where it is charged."""

    idx: torch.Tensor  # [B, H, cap] real indices, -1 padded
    count: torch.Tensor  # [B, H]
    retrieved: torch.Tensor  # [B, H] bool
    active: torch.Tensor  # [B] bool: the sequence ran a sparse step
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # key, value [B, H, D]; log_mass [B, H]

    def per_query_head(self, heads: int) -> "DecodeSelection":
        """The same selection with a row per query head (telemetry counts query heads)."""
        group = heads // self.count.shape[1]
        if group == 1:
            return self
        rep = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731
        return DecodeSelection(rep(self.idx), rep(self.count), rep(self.retrieved), self.active)


def middle_start(t: torch.Tensor, p: DecodeParams) -> torch.Tensor:
    """``max(C_sink, W_l(t))`` with PSAW on for decode, else ``C_sink``."""
    if p.window_fraction is None:
        # C_sink for every sequence, computed from t (not torch.full_like): a compiled step then
        # makes it once, with the rest of the frame, for all layers; a constant fill is made again
        # for each custom op that reads it, twice per layer (scripts/probe_decode_kernels.py)
        return t.clamp(min=p.sink, max=p.sink)
    return psaw_window_start_tensor(t, p.window_fraction, p.sink)


@dataclass
class StepFrame:
    """The regions of one decode step, per sequence (``[B]`` int32 unless noted).

    Attributes:
        t: visible real tokens (the current one included).
        lo, hi: the middle region ``[lo, hi)``.
        win_start: start of the always-kept tail: ``hi`` (the local window) for an active
            sequence, ``lo`` for an inactive one, which so attends to everything visible.
        active: ``[B]`` bool, the sequence runs a sparse step (``t > sink + local + topk``).
    """

    t: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    win_start: torch.Tensor
    active: torch.Tensor

    def rows(self, heads: int) -> torch.Tensor:
        """``[B, heads]`` bool: ``active`` broadcast over the query heads."""
        return self.active[:, None].expand(-1, heads)


def step_frame(geom: SequenceGeometry, p: DecodeParams) -> StepFrame:
    """The frame of a decode step, for every selector."""
    t = geom.t_last
    lo = middle_start(t, p)
    hi = t - p.local
    active = t > p.sink + p.local + p.topk
    return StepFrame(t, lo, hi, torch.where(active, hi, lo), active)


def window_decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    geom: SequenceGeometry,
    p: DecodeParams,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PSAW decode without CIS: ``q [B, Hq, D]`` attends to the sinks and ``[W_l(t), t)``.

    Returns ``(out [B, Hq, D], processed [B])``, the number of keys each sequence attended to.
    """
    t = geom.t_last
    lo = middle_start(t, p)
    real = torch.arange(k_cache.shape[-2], device=q.device, dtype=torch.int32)[None, :] - geom.pad[:, None]
    visible = (real >= 0) & (real < t[:, None]) & ((real < p.sink) | (real >= lo[:, None]))
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :],
        k_cache,
        v_cache,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )
    return out[:, :, 0, :], visible.sum(-1)
