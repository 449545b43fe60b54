"""What PSAW and ETF would drop: the attention mass of every candidate schedule, per layer, from dense forwards.

On calibration text that is not the evaluation's, one dense forward per prompt measures, for every
layer and every candidate of a :class:`Grid`, how much attention mass PSAW's window and ETF's
freezing would take away (SPEC §2, §5). For a layer ``ℓ``, a prompt of ``L`` tokens and query row
``i`` (seeing ``t = i + 1`` tokens), ``A[h, i, :]`` is the dense causal attention of head ``h``
(float32, from the layer's own query and key after RoPE):

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
for both (:mod:`~prhs_hf.calibration.search`). The worst head's row mean, the routing certificate
``g(δ̄)`` of SPEC §5 (:func:`~prhs_hf.telemetry_counters.routing_certificate`) and the tail of single
(head, late row) masses are kept beside them; a few sampled late rows per layer keep their whole
attention row for ``β_emp`` (:func:`~prhs_hf.calibration.search.beta_emp`).

Scores are computed in query-row chunks sized so that one chunk holds at most
:data:`CHUNK_ELEMENTS` scores over all heads: the ``L × L`` matrix of all heads never exists.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .options import CalibrationError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel

__all__ = ["CHUNK_ELEMENTS", "LATE_FRACTION", "Grid", "MassStat", "ZERO", "Measurement", "measure"]

CHUNK_ELEMENTS = 2**23
"""Most attention scores (all heads) held at once: query rows are processed in chunks of at most this."""
LATE_FRACTION = 8
"""The late rows are the last ``L // LATE_FRACTION`` rows of a prompt (at least one)."""


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
"""The stat of a schedule that drops nothing at a layer."""

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
    row for :func:`~prhs_hf.calibration.search.beta_emp`.
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
