"""One decode step of one layer: CIS selection + sparse attention, or the PSAW window alone (SPEC §4).

The four steps (match, retrieval, composition, sparse attention) come from an ops table,
``prhs_hf.kernels.decode_ops.REFERENCE_OPS`` (PyTorch) or ``TRITON_OPS``, chained by
``decode_ops.cis_decode_step``; this module adds the per-sequence regions and the CIS state,
with no host synchronisation, so the Triton path can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cis_state import CISLayerState
from .geometry import SequenceGeometry
from .kernels.decode_ops import cis_decode_step as chain_cis_step
from .schedules import psaw_window_start_tensor

__all__ = ["DecodeParams", "DecodeSelection", "cis_decode_step", "window_decode_step"]


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
    """What a CIS step selected, for telemetry: index sets, their sizes, who retrieved, who was sparse."""

    idx: torch.Tensor  # [B, Hq, cap] real indices, -1 padded
    count: torch.Tensor  # [B, Hq]
    retrieved: torch.Tensor  # [B, Hq] bool
    active: torch.Tensor  # [B] bool: the sequence ran a sparse step


def _middle_start(t: torch.Tensor, p: DecodeParams) -> torch.Tensor:
    """``max(C_sink, W_l(t))`` with PSAW on for decode, else ``C_sink``."""
    if p.window_fraction is None:
        return torch.full_like(t, p.sink)
    return psaw_window_start_tensor(t, p.window_fraction, p.sink)


def cis_decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    geom: SequenceGeometry,
    state: CISLayerState,
    p: DecodeParams,
    scale: float,
    ops,
) -> tuple[torch.Tensor, DecodeSelection]:
    """A CIS decode step: ``q [B, Hq, D]`` over the cache, returns ``(out [B, Hq, D], selection)``.

    Sequences with ``t <= sink + local + k`` attend to every token (those PSAW leaves visible);
    the others share an anchor's dilated indices or retrieve a fresh top-k (SPEC §4 steps 1-5).
    """
    t = geom.t_last
    lo = _middle_start(t, p)
    hi = t - p.local
    active = t > p.sink + p.local + p.topk
    win_start = torch.where(active, hi, lo)

    state.begin_step()
    step = chain_cis_step(
        ops, q, k_cache, v_cache, geom.pad, t, lo, hi, win_start,
        state.anchor_q, state.anchor_count, state.anchor_idx, active,
        tau=p.tau, sink=p.sink, k=p.topk, dil_m=p.dilation_topm, dil_r=p.dilation_radius, cap=p.capacity, scale=scale,
        anchor_sets=True,
    )
    retrieved = step.best == -1
    state.record(q, step.new_set, retrieved)
    return step.out, DecodeSelection(step.idx, step.count, retrieved, active)


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
    lo = _middle_start(t, p)
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
