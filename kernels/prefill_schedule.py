"""Depth schedules of PSAW and ETF (SPEC §2) in pure Python, plus pair and row counts.

Dependency-free (only :mod:`math`), so that benchmarks and analytic bounds can use the exact
same formulas as the model integration without importing torch. Floors are taken on Python
floats, i.e. in IEEE float64.

Layers are 0-based, ``N`` is the number of layers, ``l_s`` the first pruned (or frozen) layer:

* ``u_l = clip((l - l_s) / (N - l_s), 0, 1)`` for ``l >= l_s``; the layer is untouched below.
* PSAW window fraction ``w_l = phi ** (alpha * u_l)`` (1.0 on untouched layers) and window
  start ``W_l(t) = max(C_sink, floor((1 - w_l) * t))`` for a query that sees ``t`` tokens.
* ETF frozen count ``E_l(L) = floor((1 - psi ** (gamma * u_l)) * L)`` (0 on untouched layers);
  prompt rows ``C_sink <= i < E_l(L)`` are frozen.
"""

from __future__ import annotations

import math

__all__ = [
    "default_start_layer",
    "layer_depth",
    "psaw_window_fraction",
    "psaw_window_start",
    "etf_frozen_count",
    "visible_pairs",
    "causal_pairs",
]


def default_start_layer(n_layers: int) -> int:
    """The paper's default first pruned/frozen layer, ``floor(N / 2)``."""
    return n_layers // 2


def layer_depth(layer: int, n_layers: int, start_layer: int) -> float | None:
    """``u_l = clip((l - l_s) / (N - l_s), 0, 1)``, or ``None`` for an untouched layer (``l < l_s``).

    ``layer`` may be ``N`` (a hypothetical layer at depth exactly 1) for bounds and benchmarks.
    """
    if layer < start_layer:
        return None
    span = n_layers - start_layer
    if span <= 0:
        return 1.0
    return min(max((layer - start_layer) / span, 0.0), 1.0)


def psaw_window_fraction(layer: int, n_layers: int, start_layer: int, phi: float, alpha: float) -> float:
    """PSAW window fraction ``w_l = phi ** (alpha * u_l)``; 1.0 (everything visible) below ``l_s``."""
    u = layer_depth(layer, n_layers, start_layer)
    return 1.0 if u is None else float(phi) ** (float(alpha) * u)


def psaw_window_start(t: int, w: float, sink: int) -> int:
    """PSAW window start ``W(t) = max(sink, floor((1 - w) * t))`` (float64 floor) for a query seeing ``t`` tokens."""
    return max(int(sink), math.floor((1.0 - float(w)) * int(t)))


def etf_frozen_count(L: int, layer: int, n_layers: int, start_layer: int, psi: float, gamma: float) -> int:
    """ETF frozen count ``E_l(L) = floor((1 - psi ** (gamma * u_l)) * L)``; 0 below ``l_s``."""
    u = layer_depth(layer, n_layers, start_layer)
    if u is None:
        return 0
    return math.floor((1.0 - float(psi) ** (float(gamma) * u)) * int(L))


def causal_pairs(L: int) -> int:
    """Query-key pairs of dense causal attention over ``L`` tokens: ``L (L + 1) / 2``."""
    return L * (L + 1) // 2


def visible_pairs(L: int, w: float, sink: int, frozen_lo: int = 0, frozen_hi: int = 0) -> int:
    """Query-key pairs visible in a prefill of ``L`` tokens (SPEC §3 predicate).

    Row ``i`` (seeing ``t = i + 1`` tokens) sees ``min(sink, t)`` sinks plus the window
    ``[W(t), t)``; rows ``frozen_lo <= i < frozen_hi`` see nothing (ETF). ``w = 1`` and an empty
    frozen interval give :func:`causal_pairs`.
    """
    total = 0
    for i in range(L):
        if frozen_lo <= i < frozen_hi:
            continue
        t = i + 1
        lo = max(psaw_window_start(t, w, sink), sink)
        total += min(sink, t) + max(0, t - lo)
    return total
