"""The options of ``prhs-hf calibrate`` and ``prhs-hf calibrate-ds``: defaults, allowed values, checks.

Importing this module imports neither torch nor transformers: the command line builds its parser
from these defaults (``prhs-hf --help`` stays instant). A wrong option raises
:class:`CalibrationError`, whose message names the option and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

__all__ = [
    "CalibrationError",
    "DEFAULT_LENGTH",
    "DEFAULT_PROMPTS",
    "DEFAULT_TARGET",
    "DEFAULT_CONFIG",
    "PHI_GRID",
    "PSI_GRID",
    "TEXT_SUFFIXES",
    "CALIBRATION_DATASETS",
    "parse_floats",
    "parse_layers",
    "is_count",
    "check_target",
    "model_slug",
]

DEFAULT_LENGTH = 4096
"""Tokens per calibration prompt (``--length``, both commands)."""
DEFAULT_PROMPTS = 8
"""Calibration prompts of ``prhs-hf calibrate`` (``--n``)."""
DEFAULT_TARGET = 0.01
"""Largest dropped attention mass allowed per layer (``--target``)."""
DEFAULT_CONFIG = "cpe"
"""The config whose budget, CIS, α, γ, backends and telemetry ``prhs-hf calibrate`` keeps (``--config``)."""
PHI_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
"""Candidate PSAW rates φ (the paper's 0.7 and the base config's are always added)."""
PSI_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
"""Candidate ETF rates ψ (the paper's 0.5 and the base config's are always added)."""
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
"""The files read from a ``--text`` folder (``.jsonl``: one JSON object with a ``"text"`` string per line)."""
CALIBRATION_DATASETS = {"coqa": ("story",), "gsm8k": ("question", "answer")}
"""The fetcher's data sets usable with ``--dataset`` and the fields joined into one text. Both are
evaluation data (CoQA's stories, GSM8K's test problems): calibrating on them and evaluating on
them overlaps, so neither is a default."""


class CalibrationError(ValueError):
    """A calibration option or input is wrong; the message names the option and what is allowed."""


def parse_floats(text: str | Sequence[float], option: str, low: float = 0.0, high: float = 1.0) -> tuple[float, ...]:
    """``"0.6,0.7"`` → ``(0.6, 0.7)``, each in the open interval ``(low, high)``; :class:`CalibrationError` otherwise."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            value = float(item)
        except (TypeError, ValueError):
            raise CalibrationError(f"{option}: {item!r} is not a number; give a comma-separated list such as 0.6,0.7") from None
        if not (low < value < high):
            raise CalibrationError(f"{option}: {value!r} is out of range; allowed ({low}, {high})")
        out.append(value)
    if not out:
        raise CalibrationError(f"{option}: empty list; give at least one value in ({low}, {high})")
    return tuple(sorted(set(out)))


def parse_layers(text: str | Sequence[int] | None, num_layers: int, option: str = "--start-layers") -> tuple[int, ...]:
    """Start layers from ``"A:B"`` (``A ≤ ℓ < B``), ``"7,9,12"`` or ints; default ``N/4 .. N-1``."""
    if text is None:
        return tuple(range(num_layers // 4, num_layers))
    values: list[int] = []
    try:
        if isinstance(text, str) and ":" in text:
            lo, hi = text.split(":", 1)
            values = list(range(int(lo) if lo else 0, int(hi) if hi else num_layers))
        else:
            values = [int(v) for v in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise CalibrationError(f"{option}: {text!r} is not a layer range; give A:B or a comma-separated list of ints") from None
    bad = [v for v in values if not 0 <= v < num_layers]
    if bad or not values:
        raise CalibrationError(f"{option}: {text!r} names no layer or layers out of range {bad}; allowed 0 <= layer < {num_layers}")
    return tuple(sorted(set(values)))


def is_count(value, minimum: int) -> bool:
    """Whether ``value`` is an int (not a bool: ``True`` would run as 1) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_target(target: float, option: str = "--target") -> float:
    """``target`` as a float if it is a dropped mass in ``(0, 1)``; :class:`CalibrationError` naming ``option`` otherwise."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not (0.0 < float(target) < 1.0):
        raise CalibrationError(f"{option}: {target!r} is out of range; allowed a dropped mass in (0, 1), e.g. {DEFAULT_TARGET}")
    return float(target)


def model_slug(name: str) -> str:
    """The model's name as it goes into a default ``--out`` file name (a path's last part, no ``.gguf``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(name)).name.removesuffix(".gguf")).strip("-") or "model"
