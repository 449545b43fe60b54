"""Depth schedules of PSAW and ETF (SPEC §2), for scalars and for tensors.

All floors are taken in float64 so that the Python and the tensor versions agree exactly.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "default_start_layer",
    "depth_fraction",
    "psaw_window_fraction",
    "psaw_window_start",
    "psaw_window_start_tensor",
    "etf_frozen_count",
    "etf_frozen_count_tensor",
    "causal_pairs",
    "visible_pairs",
]


def default_start_layer(num_layers: int) -> int:
    """The paper's default first pruned/frozen layer, ``floor(N / 2)``."""
    return num_layers // 2


def depth_fraction(layer: int, num_layers: int, start_layer: int) -> float | None:
    """``u_l = clip((l - l_s) / (N - l_s), 0, 1)``; ``None`` where the layer is untouched (``l < l_s``)."""
    if layer < start_layer:
        return None
    span = num_layers - start_layer
    if span <= 0:
        return 1.0
    return min(max((layer - start_layer) / span, 0.0), 1.0)


def psaw_window_fraction(layer: int, num_layers: int, start_layer: int, phi: float, alpha: float) -> float:
    """``w_l = phi^(alpha * u_l)``; 1.0 (everything visible) for an untouched layer."""
    u = depth_fraction(layer, num_layers, start_layer)
    return 1.0 if u is None else phi ** (alpha * u)


def psaw_window_start(t: int, w: float, sink: int) -> int:
    """``W_l(t) = max(C_sink, floor((1 - w_l) * t))``: the first window position a query seeing ``t`` tokens sees."""
    return max(sink, math.floor((1.0 - w) * t))


def psaw_window_start_tensor(t: torch.Tensor, w: float, sink: int) -> torch.Tensor:
    """:func:`psaw_window_start` elementwise over an integer tensor ``t``; returns int32."""
    start = torch.floor((1.0 - w) * t.to(torch.float64)).to(torch.int32)
    return torch.clamp(start, min=sink)


def _etf_coefficient(layer: int, num_layers: int, start_layer: int, psi: float, gamma: float) -> float | None:
    u = depth_fraction(layer, num_layers, start_layer)
    return None if u is None else 1.0 - psi ** (gamma * u)


def etf_frozen_count(L: int, layer: int, num_layers: int, start_layer: int, psi: float, gamma: float) -> int:
    """``E_l(L) = floor((1 - psi^(gamma * u_l)) * L)``; 0 for an untouched layer."""
    c = _etf_coefficient(layer, num_layers, start_layer, psi, gamma)
    return 0 if c is None else math.floor(c * L)


def etf_frozen_count_tensor(
    L: torch.Tensor, layer: int, num_layers: int, start_layer: int, psi: float, gamma: float
) -> torch.Tensor:
    """:func:`etf_frozen_count` elementwise over an integer tensor of prompt lengths; returns int32."""
    c = _etf_coefficient(layer, num_layers, start_layer, psi, gamma)
    if c is None:
        return torch.zeros_like(L, dtype=torch.int32)
    return torch.floor(c * L.to(torch.float64)).to(torch.int32)


def causal_pairs(L: int) -> int:
    """Query-key pairs of dense causal attention over ``L`` tokens: ``L (L + 1) / 2``."""
    return L * (L + 1) // 2


def visible_pairs(L: int, w: float, sink: int, frozen_lo: int = 0, frozen_hi: int = 0) -> int:
    """Query-key pairs visible in a prefill of ``L`` tokens (SPEC §3 predicate).

    Row ``i`` (seeing ``t = i + 1`` tokens) sees ``min(sink, t)`` sinks plus the window
    ``[W(t), t)``; rows ``frozen_lo <= i < frozen_hi`` see nothing (ETF).
    """
    total = 0
    for i in range(L):
        if frozen_lo <= i < frozen_hi:
            continue
        t = i + 1
        total += min(sink, t) + max(0, t - psaw_window_start(t, w, sink))
    return total
