"""A finished ``prhs-hf calibrate``: what was chosen, as a terminal summary, a YAML config and a plot.

:class:`Calibration` holds the measurement and the chosen and paper schedules;
:meth:`Calibration.yaml_text` writes the config with every section spelled out and the measured
per-layer curves in comments, :func:`write_plot` a PNG of the curves against the target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .flops import FlopModel
from .measurement import LATE_FRACTION, Measurement
from .options import CalibrationError
from .search import Choice, layer_frozen, layer_stats, layer_windows, nearest_miss

__all__ = ["Calibration", "config_yaml_lines", "check_plotting", "write_plot"]


@dataclass
class Calibration:
    """A finished calibration: the measurement, the chosen pair, the paper's pair and the config."""

    model_name: str
    source: str
    measurement: Measurement
    flops: FlopModel
    target: float
    max_certificate: float | None
    row_target: float | None
    chosen: Choice
    paper: Choice
    config: dict[str, Any]
    beta: dict[str, list[float | None]]

    def summary(self) -> str:
        """What was chosen and the predicted saving, for the terminal."""
        c, p, m = self.chosen, self.paper, self.measurement
        return "\n".join([
            f"model: {self.model_name} ({m.grid.num_layers} layers)   text: {self.source}   "
            f"{m.prompts} prompts x {m.length} tokens   target: dropped mass <= {self.target:g} per layer"
            + (f", a single late row's q99 <= {self.row_target:g}" if self.row_target is not None else ""),
            f"chosen:   {_describe(c)}",
            f"          predicted prefill FLOP saving {100 * c.saving:.1f} % "
            f"(decoder layers, {m.length}-token prompt)",
            f"          {_describe_tail(m, c, self.row_target)}",
            *(f"          {line}" for line in self.nearest_misses()),
            f"paper defaults: {_describe(p)}",
            f"          predicted prefill FLOP saving {100 * p.saving:.1f} %",
        ])

    def nearest_misses(self) -> list[str]:
        """For a mechanism the choice leaves off because no candidate passes: its nearest candidate."""
        lines = []
        for kind, label, rate in (("psaw", "PSAW", "phi"), ("etf", "ETF", "psi")):
            if getattr(self.chosen, kind).enabled:
                continue
            miss = nearest_miss(self.measurement, kind, self.target, self.row_target, self.max_certificate)
            if miss is not None:
                lines.append(f"no {label} candidate passes; nearest: from layer {miss.schedule.start_layer}, {rate} "
                             f"{miss.schedule.rate:g} (worst mean {miss.worst:.4f}, worst single-row q99 "
                             f"{miss.late_q99:.4f}: {miss.excess:.2f}x a bound)")
        return lines

    def yaml_text(self) -> str:
        """The config as YAML, every section spelled out, with the measured curves in comments."""
        return _render_yaml(self)


def _describe(c: Choice) -> str:
    psaw = (f"PSAW from layer {c.psaw.start_layer}, phi {c.psaw.rate:g}" if c.psaw.enabled else "PSAW off")
    etf = (f"ETF from layer {c.etf.start_layer}, psi {c.etf.rate:g}" if c.etf.enabled else "ETF off")
    return f"{psaw}; {etf}   (worst dropped mass: PSAW {c.psaw_worst:.4f}, ETF {c.etf_worst:.4f})"


def _describe_tail(m: Measurement, c: Choice, row_target: float | None = None) -> str:
    """The largest mass a single (head, late row) loses under the chosen pair, at any layer, and its 99th percentile."""
    stats = [st for kind, sched in (("psaw", c.psaw), ("etf", c.etf)) for st in layer_stats(m, kind, sched)]
    tail, q99 = max((st.late_max for st in stats), default=0.0), max((st.late_q99 for st in stats), default=0.0)
    bound = (f"q99 bounded by --row-target {row_target:g}" if row_target is not None
             else "not bounded by the target; --row-target bounds its q99")
    return (f"a single late row of one head loses up to {tail:.4f} of its attention mass, q99 {q99:.4f} ({bound}; "
            "see docs/CALIBRATE.md)")


def _fmt(x: float | None) -> str:
    if x is None:
        return "      -"
    return f"{x if abs(x) >= 5e-5 else 0.0:7.4f}"  # no "-0.0000" from rounding noise


def config_yaml_lines(config: Mapping[str, Any]) -> list[str]:
    """A config's sections (``PrHSConfig.to_dict()``), one YAML flow mapping per line, as the shipped configs are."""
    import yaml

    return [f"{name}: {yaml.safe_dump(section, default_flow_style=True, sort_keys=False, width=10_000).strip()}"
            for name, section in config.items()]


def _render_yaml(cal: Calibration) -> str:
    m, c, p = cal.measurement, cal.chosen, cal.paper
    n_layers = m.grid.num_layers
    lines = [
        f"# PSAW and ETF calibrated for {cal.model_name} by `prhs-hf calibrate` (docs/CALIBRATE.md).",
        f"# Calibration text: {cal.source}; {m.prompts} prompts of {m.length} tokens.",
        f"# Target: dropped attention mass <= {cal.target:g} at every layer (mean over heads of all rows and of",
        f"# the last {100 / LATE_FRACTION:g} % of rows)"
        + (f", routing certificate g <= {cal.max_certificate:g}" if cal.max_certificate is not None else "")
        + (f"; and the 99th percentile of a single (head, late row)'s dropped mass <= {cal.row_target:g}"
           if cal.row_target is not None else "") + ".",
        f"# Chosen: {_describe(c)}",
        f"# Predicted prefill FLOP saving: {100 * c.saving:.1f} % (paper defaults: {100 * p.saving:.1f} %, "
        f"worst dropped mass PSAW {p.psaw_worst:.4f}, ETF {p.etf_worst:.4f}).",
        *(f"# {line[0].upper()}{line[1:]}." for line in cal.nearest_misses()),
        "",
    ]
    lines += config_yaml_lines(cal.config)
    lines += [
        "",
        "# Measured per layer (means over heads; rows = all prompt rows, late = the last rows, head = the",
        "# worst head's row mean; g = routing certificate g(delta) of the row mean; beta = beta_emp against",
        "# the budget-matched oracle on sampled late rows; q99, max = the 99th percentile and the largest",
        "# dropped mass of a single (head, late row): bounded only by --row-target (q99), and what one query that",
        "# retrieves an early fact can lose). ETF mass is a proxy: the mass that active rows put on the",
        "# frozen rows. 'paper' = l_s floor(N/2), the base config's phi/psi.",
        "# layer |   w  psaw rows    late    head       g    beta     q99     max | frozen  etf rows    late    head"
        "    beta     q99     max | paper psaw  paper etf",
    ]
    psaw_stats, etf_stats = layer_stats(m, "psaw", c.psaw), layer_stats(m, "etf", c.etf)
    paper_psaw, paper_etf = layer_stats(m, "psaw", p.psaw), layer_stats(m, "etf", p.etf)
    windows, frozen = layer_windows(m, c.psaw), layer_frozen(m, c.etf)
    for i in range(n_layers):
        ps, es = psaw_stats[i], etf_stats[i]
        touched_p, touched_e = windows[i] < 1.0, frozen[i] > m.grid.sink
        lines.append(
            f"# {i:5d} | {windows[i]:5.3f} "
            + (f"{_fmt(ps.rows)} {_fmt(ps.late)} {_fmt(ps.worst_head)} {_fmt(ps.certificate)} {_fmt(cal.beta['psaw'][i])}"
               f" {_fmt(ps.late_q99)} {_fmt(ps.late_max)}" if touched_p else " ".join([_fmt(None)] * 7))
            + f" | {max(0, frozen[i] - m.grid.sink):6d} "
            + (f"{_fmt(es.rows)} {_fmt(es.late)} {_fmt(es.worst_head)} {_fmt(cal.beta['etf'][i])}"
               f" {_fmt(es.late_q99)} {_fmt(es.late_max)}" if touched_e else " ".join([_fmt(None)] * 6))
            + f" |    {_fmt(paper_psaw[i].worst)}    {_fmt(paper_etf[i].worst)}")
    return "\n".join(lines) + "\n"


def check_plotting() -> None:
    """Raise :class:`CalibrationError` saying how to install matplotlib unless it imports (``--plot``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CalibrationError("--plot needs matplotlib, the optional 'plots' extra: pip install 'prhs-hf[plots]' "
                               "(or pip install matplotlib)") from None


def write_plot(cal: Calibration, path: str | os.PathLike[str]) -> Path:
    """A PNG of the per-layer dropped mass (chosen and paper schedules, PSAW and ETF) against the target."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = cal.measurement
    layers = list(range(m.grid.num_layers))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, choice, style, label in (("psaw", cal.chosen.psaw, "-o", "PSAW chosen"), ("etf", cal.chosen.etf, "-s", "ETF chosen (proxy)"),
                                       ("psaw", cal.paper.psaw, ":o", "PSAW paper"), ("etf", cal.paper.etf, ":s", "ETF paper (proxy)")):
        ax.plot(layers, [s.worst for s in layer_stats(m, kind, choice)], style, markersize=3, label=label)
    ax.axhline(cal.target, color="k", linestyle="--", linewidth=1, label=f"target {cal.target:g}")
    ax.set_yscale("symlog", linthresh=max(cal.target / 10, 1e-6))
    ax.set_xlabel("layer")
    ax.set_ylabel("dropped attention mass (max of all-row and late-row means)")
    ax.set_title(f"{cal.model_name}: {m.prompts} x {m.length} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
