"""The choice of PSAW and ETF schedules from a :class:`~prhs_hf.calibration.measurement.Measurement`.

A candidate pair (PSAW ``(ℓ_s, φ)``, ETF ``(ℓ_s, ψ)``, either possibly off) passes when every
layer keeps its dropped mass within the bounds (:func:`excess`); :func:`choose` takes the passing
pair with the fewest prefill FLOPs (:class:`~prhs_hf.calibration.flops.FlopModel`). When no
candidate of a mechanism passes, :func:`nearest_miss` names the one closest to the bounds.
:func:`beta_emp` compares a chosen schedule's kept set with the budget-matched oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import FlopModel, VisiblePairs
from .measurement import ZERO, MassStat, Measurement
from .options import check_target

__all__ = [
    "Schedule",
    "OFF",
    "Choice",
    "layer_windows",
    "layer_frozen",
    "layer_stats",
    "evaluate",
    "choose",
    "excess",
    "NearestMiss",
    "nearest_miss",
    "beta_emp",
]


@dataclass(frozen=True)
class Schedule:
    """One mechanism's chosen schedule: its start layer and rate (φ for PSAW, ψ for ETF), or off."""

    start_layer: int | None
    rate: float

    @property
    def enabled(self) -> bool:
        """Whether the mechanism is on (off: no start layer)."""
        return self.start_layer is not None


OFF = Schedule(None, 1.0)


@dataclass(frozen=True)
class Choice:
    """A PSAW and ETF pair with its predicted prefill FLOPs and its worst dropped mass."""

    psaw: Schedule
    etf: Schedule
    flops: int
    dense_flops: int
    psaw_worst: float
    etf_worst: float

    @property
    def saving(self) -> float:
        """The predicted share of the dense prefill FLOPs saved."""
        return 1.0 - self.flops / self.dense_flops if self.dense_flops else 0.0


def layer_windows(m: Measurement, s: Schedule) -> list[float]:
    """PSAW's window fraction at every layer under ``s`` (1.0 where it hides nothing, or ``s`` is off)."""
    return [1.0 if not s.enabled else m.grid.window(i, s.start_layer, s.rate) for i in range(m.grid.num_layers)]


def layer_frozen(m: Measurement, s: Schedule) -> list[int]:
    """ETF's frozen count ``E_ℓ(L)`` at every layer under ``s`` (0 where ``s`` is off)."""
    return [0 if not s.enabled else m.grid.frozen(m.length, i, s.start_layer, s.rate) for i in range(m.grid.num_layers)]


def layer_stats(m: Measurement, kind: str, s: Schedule) -> list[MassStat]:
    """The measured dropped mass of ``kind``'s ("psaw" or "etf") schedule ``s`` at every layer."""
    if not s.enabled:
        return [ZERO] * m.grid.num_layers
    get = m.psaw_stat if kind == "psaw" else m.etf_stat
    return [get(i, s.start_layer, s.rate) for i in range(m.grid.num_layers)]


def _flops(m: Measurement, flops: FlopModel, pairs: VisiblePairs, windows: list[float], frozen: list[int]) -> int:
    """Prefill FLOPs of per-layer window fractions and frozen counts."""
    sink = m.grid.sink
    return sum(flops.layer(m.length, pairs(w, e), max(0, e - sink)) for w, e in zip(windows, frozen))


def evaluate(m: Measurement, flops: FlopModel, psaw: Schedule, etf: Schedule, psaw_prefill: bool = True) -> Choice:
    """The predicted FLOPs and worst dropped masses of one PSAW/ETF pair."""
    pairs = VisiblePairs(m.length, m.grid.sink)
    windows = layer_windows(m, psaw if psaw_prefill else OFF)
    return Choice(psaw, etf, _flops(m, flops, pairs, windows, layer_frozen(m, etf)), flops.dense(m.length),
                  max(s.worst for s in layer_stats(m, "psaw", psaw)), max(s.worst for s in layer_stats(m, "etf", etf)))


def choose(m: Measurement, flops: FlopModel, target: float, *, max_certificate: float | None = None,
           row_target: float | None = None, psaw_prefill: bool = True) -> Choice:
    """The PSAW/ETF pair (either may be off) with the fewest prefill FLOPs among those whose every
    layer keeps its dropped mass (all-row and late-row means) at most ``target`` (and ``g(δ̄)`` at
    most ``max_certificate``, and the 99th percentile of a single (head, late row)'s dropped mass at
    most ``row_target``). Ties go to the smaller dropped mass, then to the deeper PSAW pruning (it
    also saves decode work)."""
    check_target(target)
    if row_target is not None:
        check_target(row_target, "--row-target")
    grid = m.grid

    def ok(stats: list[MassStat]) -> bool:
        return excess(stats, target, row_target, max_certificate) <= 1.0

    psaws = [OFF] + [Schedule(s, p) for s in grid.start_layers for p in grid.phis if ok(layer_stats(m, "psaw", Schedule(s, p)))]
    etfs = [OFF] + [Schedule(s, p) for s in grid.start_layers for p in grid.psis if ok(layer_stats(m, "etf", Schedule(s, p)))]
    pairs = VisiblePairs(m.length, grid.sink)
    dense = flops.dense(m.length)
    etf_rows = [(etf, max(s.worst for s in layer_stats(m, "etf", etf)), layer_frozen(m, etf)) for etf in etfs]
    best: tuple | None = None
    for psaw in psaws:
        p_worst = max(s.worst for s in layer_stats(m, "psaw", psaw))
        windows = layer_windows(m, psaw)
        hidden = sum(1.0 - w for w in windows)
        if not psaw_prefill:
            windows = [1.0] * grid.num_layers
        for etf, e_worst, frozen in etf_rows:
            cost = _flops(m, flops, pairs, windows, frozen)
            key = (cost, max(p_worst, e_worst), -hidden)
            if best is None or key < best[0]:
                best = (key, Choice(psaw, etf, cost, dense, p_worst, e_worst))
    assert best is not None
    return best[1]


def excess(stats: list[MassStat], target: float, row_target: float | None, max_certificate: float | None) -> float:
    """How far a schedule's layers go past the bounds, as the largest ratio of a measured value to its
    bound (mean dropped mass / ``target``, single-row q99 / ``row_target``, ``g`` / ``max_certificate``):
    at most 1 when every layer is within them (what :func:`choose` admits)."""
    return max((max(st.worst / target,
                    0.0 if row_target is None else st.late_q99 / row_target,
                    0.0 if max_certificate is None else st.certificate / max_certificate) for st in stats),
               default=0.0)


@dataclass(frozen=True)
class NearestMiss:
    """The candidate of one mechanism that comes closest to the bounds when none passes."""

    schedule: Schedule
    worst: float  # its largest mean dropped mass over the layers
    late_q99: float  # its largest single-row 99th percentile over the layers
    excess: float  # excess(): > 1, how many times a bound it exceeds at its worst layer


def nearest_miss(m: Measurement, kind: str, target: float, row_target: float | None = None,
                 max_certificate: float | None = None) -> NearestMiss | None:
    """Among ``kind``'s ("psaw" or "etf") candidates of the grid, the one with the smallest
    :func:`excess`, if every candidate exceeds the bounds (None when one passes or there is none)."""
    rates = m.grid.phis if kind == "psaw" else m.grid.psis
    best: NearestMiss | None = None
    for start in m.grid.start_layers:
        for rate in rates:
            stats = layer_stats(m, kind, Schedule(start, rate))
            over = excess(stats, target, row_target, max_certificate)
            if over <= 1.0:
                return None
            if best is None or over < best.excess:
                best = NearestMiss(Schedule(start, rate), max(st.worst for st in stats),
                                   max(st.late_q99 for st in stats), over)
    return best


def beta_emp(m: Measurement, kind: str, s: Schedule) -> list[float | None]:
    """Per layer, ``β_emp = τ*_|S| − τ_S`` of the schedule's kept set against the budget-matched oracle
    (:func:`~prhs_hf.telemetry_counters.oracle_statistics`), on the sampled late rows; ``None`` where untouched."""
    import torch

    from ..schedules import psaw_window_start_tensor
    from ..telemetry_counters import oracle_statistics

    out: list[float | None] = []
    sink, length = m.grid.sink, m.length
    rows = m.sample_rows
    t = rows + 1
    keys = torch.arange(length)
    visible = keys[None, :] < t[:, None]
    for i in range(m.grid.num_layers):
        sample = m.samples[i]
        if not s.enabled or sample is None or len(rows) == 0:
            out.append(None)
            continue
        if kind == "psaw":
            w = m.grid.window(i, s.start_layer, s.rate)
            if w >= 1.0:
                out.append(None)
                continue
            start = psaw_window_start_tensor(t, w, sink).long()
            kept = visible & ((keys[None, :] < sink) | (keys[None, :] >= start[:, None]))
            use = torch.ones(len(rows), dtype=torch.bool)
        else:
            e = m.grid.frozen(length, i, s.start_layer, s.rate)
            if e <= sink:
                out.append(None)
                continue
            kept = visible & ~((keys[None, :] >= sink) & (keys[None, :] < e))
            use = rows >= e
            if not use.any():
                out.append(None)
                continue
        probs = sample[:, :, use]  # [n, H, R, L]
        sel = kept[use].expand(probs.shape[0], probs.shape[1], -1, -1)
        stats = oracle_statistics(probs.reshape(-1, length), sel.reshape(-1, length))
        out.append(float((stats["oracle"] - stats["retained"]).mean()))
    return out
