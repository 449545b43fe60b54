"""What PrHS did, measured (SPEC §5): processed KV, retrieval ratio, oracle comparison, ETF rows.

Off by default and free when off (no recorder exists). When on, counters accumulate on the
device and are read once by :meth:`Telemetry.report`, so recording does not synchronise.
``docs/TELEMETRY.md`` defines every field of :class:`TelemetryReport`; :meth:`TelemetryReport.summary`
says the main ones in a few lines.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["Telemetry", "TelemetryReport", "OracleReport", "oracle_statistics", "routing_certificate"]


@dataclass
class OracleReport:
    """Selected sets against the budget-matched top-k oracle of full attention (means over sparse rows)."""

    rows: int
    retained_mass: float
    dropped_mass: float
    beta_emp: float
    overlap: float
    overlap_top50: float
    mean_context: float
    certificate: float


@dataclass
class TelemetryReport:
    """What PrHS did since patching or the last reset; :meth:`summary` says it in a few lines and
    :meth:`as_dict` gives JSON-ready data. Every field is defined in ``docs/TELEMETRY.md``.

    A *row* is one (sequence, query head, layer) of one decode step: the unit that selects keys
    and attends to them.
    """

    #: decode forward passes; each advances every sequence of the batch by one token
    decode_steps: int
    #: (sequence, decode step) pairs: ``decode_steps`` times the batch size of each step
    decode_sequence_steps: int | None
    #: (sequence, decode step) pairs that ran sparse, in the layer that ran sparse most often (at
    #: most ``decode_sequence_steps``; a sequence runs dense while its context fits the budget)
    sparse_sequence_steps: int
    #: share of the sparse rows that retrieved (scored the whole cache for a fresh top-k) rather
    #: than reuse their block anchor's keys; ``None`` without a sparse CIS row
    retrieval_ratio: float | None
    #: keys a row attended to, mean over every row (sparse and dense) of every layer and step
    processed_kv_per_step: float
    #: keys a row would attend to under dense attention (its whole context), same mean
    dense_kv_per_step: float
    per_layer_retrieval_ratio: list[float | None] = field(default_factory=list)
    per_layer_processed_kv: list[float] = field(default_factory=list)
    per_head_retrievals: list[list[int]] = field(default_factory=list)
    #: share of (sparse step, layer, sequence, KV head) in which at least one query head of the KV
    #: head's group retrieved: the share of the keys an exact retrieval must read (equal to
    #: ``retrieval_ratio`` without GQA, at most ``G`` times it with G query heads per KV head)
    kv_group_retrieval_ratio: float | None = None
    prefill_rows: list[int] = field(default_factory=list)
    prefill_rows_frozen: list[int] = field(default_factory=list)
    oracle: OracleReport | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def sparse_steps(self) -> int:
        """Deprecated name of :attr:`sparse_sequence_steps` (it counts sequence-steps, not decode steps)."""
        warnings.warn("TelemetryReport.sparse_steps is deprecated: it is sparse_sequence_steps, the (sequence, "
                      "decode step) pairs that ran sparse", DeprecationWarning, stacklevel=2)
        return self.sparse_sequence_steps

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TelemetryReport":
        """The report of an :meth:`as_dict` dict (as lm-eval and ``scripts/run_accuracy.py`` write it).

        A dict with ``sparse_steps`` in place of ``sparse_sequence_steps`` is read as that, and one
        without ``decode_sequence_steps`` gets ``None`` there; unknown keys are ignored.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        if "sparse_sequence_steps" not in values and "sparse_steps" in data:
            values["sparse_sequence_steps"] = data["sparse_steps"]
        values.setdefault("decode_sequence_steps", None)
        if isinstance(values.get("oracle"), Mapping):
            values["oracle"] = OracleReport(**values["oracle"])
        return cls(**values)

    def summary(self) -> str:
        """A few lines: decode steps and the share that ran sparse, keys read against dense, the
        retrieval ratio and the share of rows that reused their anchor's keys (and, where
        recorded, ETF's frozen prefill rows and the oracle comparison)."""
        if not self.decode_steps:
            return "PrHS telemetry: no decode step recorded"
        sparse = self.sparse_sequence_steps
        of = self.decode_sequence_steps
        share = f" ({_percent(sparse / of)})" if of else ""
        lines = [f"PrHS telemetry: {self.decode_steps:,} decode steps, {sparse:,}"
                 + (f" of {of:,}" if of else "") + f" sequence-steps sparse{share}"]
        if self.dense_kv_per_step:
            lines.append(f"  keys read per head and step: {self.processed_kv_per_step:,.1f} of dense's "
                         f"{self.dense_kv_per_step:,.1f} ({_percent(self.processed_kv_per_step / self.dense_kv_per_step)})")
        if self.retrieval_ratio is not None:
            line = (f"  retrieval ratio ρ̂: {_percent(self.retrieval_ratio)} of sparse rows scored the whole cache; "
                    f"{_percent(1.0 - self.retrieval_ratio)} reused their anchor's keys")
            if self.kv_group_retrieval_ratio is not None:
                line += f" (KV groups with a retrieving head: {_percent(self.kv_group_retrieval_ratio)})"
            lines.append(line)
        elif not sparse:
            lines.append("  no sparse step: every context fitted the budget (sink + local + top-k), or the "
                         "config selects nothing in decode")
        frozen, rows = sum(self.prefill_rows_frozen), sum(self.prefill_rows)
        if frozen:
            lines.append(f"  ETF froze {frozen:,} of {rows:,} prefill rows ({_percent(frozen / rows)})")
        if self.oracle is not None:
            o = self.oracle
            lines.append(f"  against the top-k oracle ({o.rows:,} rows): retained mass {o.retained_mass:.3f}, "
                         f"β_emp {o.beta_emp:.3f}, overlap {o.overlap:.2f}, certificate {o.certificate:.3f}")
        return "\n".join(lines)


def _percent(share: float) -> str:
    return f"{100 * share:.1f} %"


def routing_certificate(dropped_mass: float, context: float) -> float:
    """``g(δ) = 2 [h_b(δ) + δ ln L]`` with the binary entropy ``h_b`` in nats."""
    d = min(max(dropped_mass, 0.0), 1.0)
    hb = 0.0 if d in (0.0, 1.0) else -(d * math.log(d) + (1 - d) * math.log(1 - d))
    return 2.0 * (hb + d * math.log(max(context, 1.0)))


def oracle_statistics(probs: torch.Tensor, selected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row oracle comparison of a selected key set.

    Args:
        probs: ``[R, S]`` full-attention probabilities of each row (zero on invisible keys).
        selected: ``[R, S]`` bool, the keys the sparse step attended to.
    Returns ``[R]`` tensors: retained mass ``τ_S``, oracle mass ``τ*_N`` (``N = |S|``), overlap with
    the oracle set and with the smallest set holding half of the mass.
    """
    probs = probs.float()
    n = selected.sum(-1)
    retained = (probs * selected).sum(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    cum = sorted_p.cumsum(-1)
    oracle_mass = cum.gather(-1, (n - 1).clamp(min=0)[:, None]).squeeze(-1) * (n > 0)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    in_oracle = rank < n[:, None]
    overlap = (in_oracle & selected).sum(-1) / n.clamp(min=1)
    # smallest prefix of the sorted keys whose mass reaches one half: keys before the crossing, plus it
    half = (cum - sorted_p) < 0.5
    in_half = torch.zeros_like(selected)
    in_half.scatter_(-1, order, half)
    overlap_half = (in_half & selected).sum(-1) / in_half.sum(-1).clamp(min=1)
    return {"retained": retained, "oracle": oracle_mass, "overlap": overlap, "overlap_half": overlap_half}


#: the oracle comparison's counters (telemetry.oracle)
ORACLE_COUNTERS = ("o_rows", "o_retained", "o_beta", "o_overlap", "o_overlap_half", "o_context")


class Telemetry:
    """Device-side counters for every patched layer of one model."""

    def __init__(self, num_layers: int, num_heads: int, oracle: bool, num_kv_heads: int | None = None):
        if num_kv_heads is not None and (num_kv_heads < 1 or num_heads % num_kv_heads):
            raise ValueError(f"telemetry: num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.heads_per_kv_head = num_heads // self.num_kv_heads
        self.oracle = oracle
        self._t: dict[str, torch.Tensor] = {}

    @torch.compiler.disable
    def _allocate(self, name: str, shape: tuple, device: torch.device, dtype: torch.dtype = torch.float64) -> None:
        # eager even inside a compiled forward, at a fixed address: a CUDA-graph-captured step
        # accumulates into it in place, and no graph output is kept across steps
        with torch.inference_mode(False):  # normal tensors: reset() and later steps update them outside inference_mode
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(buffer)
        self._t[name] = buffer

    def prepare(self, device: torch.device, batch: int | None = None) -> None:
        """Allocate every counter on ``device`` now (eager, at prefill), so a compiled decode step
        finds them all and only accumulates in place; with ``batch``, also the per-step stage of
        :meth:`record_decode` for that many sequences."""
        # one-element counters, not 0-dim: an in-place add_() to a 0-dim float64 input of a compiled
        # graph is lost (torch 2.13, aot_eager on the CPU), while a [1] tensor is updated
        one, layers, heads = (1,), (self.num_layers,), (self.num_layers, self.num_heads)
        shapes = {"decode_steps": one, "processed": layers, "dense": layers, "rows": layers, "sparse_rows": layers,
                  "retrievals": heads, "kv_retrievals": layers, "prefill_rows": layers, "prefill_frozen": layers}
        if self.oracle:
            shapes.update({name: one for name in ORACLE_COUNTERS})
        for name, shape in shapes.items():
            if name not in self._t or self._t[name].device != device:
                self._allocate(name, shape, device)
        if batch is not None:
            self._stage(batch, device)

    def _stage(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[L, 3, B, Hq]`` int32: this decode step's processed keys, retrievals and sparse rows per layer."""
        shape = (self.num_layers, 3, batch, self.num_heads)
        stage = self._t.get("stage")
        if stage is None or stage.shape != shape or stage.device != device:
            self._allocate("stage", shape, device, torch.int32)
        return self._t["stage"]

    def _home(self, device: torch.device) -> torch.device:
        """Where the counters live: where they were first prepared, else ``device``."""
        buffer = self._t.get("decode_steps")
        return device if buffer is None else buffer.device

    def _acc(self, name: str, value: torch.Tensor, layer: int | None = None) -> None:
        if name not in self._t:
            self._allocate(name, (self.num_layers,) if layer is not None else (1,), self._home(value.device))
        value = value.to(self._t[name].device)
        # add_(), not +=: rebinding a dict item is a side effect a compiled step would replay
        if layer is None:
            self._t[name].add_(value)
        else:
            self._t[name][layer].add_(value)

    def record_decode(
        self, layer: int, t: torch.Tensor, processed: torch.Tensor, retrieved: torch.Tensor | None, active: torch.Tensor
    ) -> None:
        """One decode step of one layer.

        ``t [B]`` visible tokens, ``processed [B, Hq]`` keys attended, ``retrieved [B, Hq]`` bool
        (None without CIS), ``active [B]`` bool, sequences that ran a sparse step.

        Every patched layer records every decode step, in layer order: a layer only copies its
        three ``[B, Hq]`` maps into the step's stage (one fused write), and the last layer folds the
        stage into the counters (a few reductions per step instead of a dozen per layer: in a
        compiled step each is a kernel).
        """
        batch, heads = processed.shape
        if heads != self.num_heads:
            raise ValueError(
                f"telemetry counts {self.num_heads} query heads per layer, layer {layer} has {heads} "
                "(under tensor parallelism patch the sharded model, whose ranks hold their share of the heads)"
            )
        # the counters stay where they were prepared (the first layer's device): a layer on another
        # device (device_map) copies its maps over instead of moving them all
        home = self._home(t.device)
        self.prepare(home)
        stage = self._stage(batch, home)
        sparse = active[:, None].expand(batch, heads)
        fresh = torch.zeros_like(sparse) if retrieved is None else retrieved & sparse
        stage[layer].copy_(torch.stack([processed.to(torch.int32), fresh.to(torch.int32), sparse.to(torch.int32)]))
        if layer == self.num_layers - 1:
            t = t.to(home)
            per_layer = stage.sum(2, dtype=torch.float64)  # [L, 3, Hq]
            self._t["processed"].add_(per_layer[:, 0].sum(-1))
            self._t["retrievals"].add_(per_layer[:, 1])
            # (sequence, KV head) pairs with a retrieving query head: the keys an exact retrieval reads
            grouped = stage[:, 1].view(self.num_layers, batch, self.num_kv_heads, self.heads_per_kv_head)
            self._t["kv_retrievals"].add_(grouped.amax(-1).sum((1, 2), dtype=torch.float64))
            self._t["sparse_rows"].add_(per_layer[:, 2].sum(-1))
            self._t["dense"].add_(t.sum(dtype=torch.float64) * heads)
            self._t["rows"].add_(float(batch * heads))
            self._t["decode_steps"].add_(1)

    def record_oracle(self, probs: torch.Tensor, selected: torch.Tensor, t: torch.Tensor) -> None:
        """Oracle comparison for the rows of a sparse step: ``[R, S]`` probabilities and selections, ``[R]`` contexts."""
        stats = oracle_statistics(probs, selected)
        self._acc("o_rows", torch.tensor(float(probs.shape[0]), device=probs.device))
        self._acc("o_retained", stats["retained"].double().sum())
        self._acc("o_beta", (stats["oracle"] - stats["retained"]).double().sum())
        self._acc("o_overlap", stats["overlap"].double().sum())
        self._acc("o_overlap_half", stats["overlap_half"].double().sum())
        self._acc("o_context", t.double().sum())

    def record_prefill(self, layer: int, rows: torch.Tensor, frozen: torch.Tensor) -> None:
        """ETF at one layer: real prompt rows seen and frozen."""
        self._acc("prefill_rows", rows.double(), layer)
        self._acc("prefill_frozen", frozen.double(), layer)

    def reset(self) -> None:
        for buffer in self._t.values():
            buffer.zero_()

    def report(self, group=None) -> TelemetryReport:
        """Read the counters (one synchronisation) into a :class:`TelemetryReport`.

        ``group``: a ``torch.distributed`` process group of tensor parallel ranks, each holding
        its share of every layer's query heads (contiguous, in rank order), that all call this
        together: the counters over rows and heads are summed across the ranks, the per-head
        retrievals concatenated in head order, and the per-sequence counters (decode steps, ETF
        prefill rows) kept, as every rank saw the same sequences. ``None``: this process's own.
        """
        v = {k: x.cpu() for k, x in self._t.items()}
        heads = self.num_heads
        if group is not None:
            v, heads = _reduce_across_ranks(self._t, group), heads * torch.distributed.get_world_size(group)
        zeros = torch.zeros(self.num_layers, dtype=torch.float64)
        rows, processed, dense = v.get("rows", zeros), v.get("processed", zeros), v.get("dense", zeros)
        sparse_rows = v.get("sparse_rows", zeros)
        retrievals = v.get("retrievals")
        cis_layers = [] if retrievals is None else [i for i in range(self.num_layers) if sparse_rows[i] > 0]
        ratio = kv_ratio = None
        per_layer_ratio: list[float | None] = [None] * self.num_layers
        if retrievals is not None and cis_layers:
            total = float(sum(sparse_rows[i] for i in cis_layers))
            ratio = float(retrievals[cis_layers].sum()) / total
            kv_ratio = float(v["kv_retrievals"][cis_layers].sum()) / (total / self.heads_per_kv_head)
            for i in cis_layers:
                per_layer_ratio[i] = float(retrievals[i].sum() / sparse_rows[i])
        n_rows = float(rows.sum())
        oracle = None
        if "o_rows" in v and float(v["o_rows"]) > 0:
            n = float(v["o_rows"])
            retained = float(v["o_retained"]) / n
            context = float(v["o_context"]) / n
            oracle = OracleReport(
                rows=int(n),
                retained_mass=retained,
                dropped_mass=1.0 - retained,
                beta_emp=float(v["o_beta"]) / n,
                overlap=float(v["o_overlap"]) / n,
                overlap_top50=float(v["o_overlap_half"]) / n,
                mean_context=context,
                certificate=routing_certificate(1.0 - retained, context),
            )
        return TelemetryReport(
            decode_steps=int(v["decode_steps"]) if "decode_steps" in v else 0,
            decode_sequence_steps=int(round(float(rows[0]) / heads)) if n_rows else 0,
            sparse_sequence_steps=int(round(float(sparse_rows.max()) / heads)) if n_rows else 0,
            retrieval_ratio=ratio,
            processed_kv_per_step=float(processed.sum()) / n_rows if n_rows else 0.0,
            dense_kv_per_step=float(dense.sum()) / n_rows if n_rows else 0.0,
            per_layer_retrieval_ratio=per_layer_ratio,
            per_layer_processed_kv=[float(processed[i] / rows[i]) if rows[i] else 0.0 for i in range(self.num_layers)],
            per_head_retrievals=retrievals.long().tolist() if cis_layers else [],
            kv_group_retrieval_ratio=kv_ratio,
            prefill_rows=v.get("prefill_rows", zeros).long().tolist(),
            prefill_rows_frozen=v.get("prefill_frozen", zeros).long().tolist(),
            oracle=oracle,
        )


#: counters of the rows (sequence x head) a rank computed: summed over tensor parallel ranks
_SUMMED = ("processed", "dense", "rows", "sparse_rows", "kv_retrievals") + ORACLE_COUNTERS


def _reduce_across_ranks(counters: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """The counters of all ranks of ``group`` on the CPU (see :meth:`Telemetry.report`): a sum
    where the ranks counted disjoint heads, the per-head retrievals side by side, the rest as is."""
    world = torch.distributed.get_world_size(group)
    out = {}
    for name in sorted(counters):  # the same order on every rank: the collectives pair up
        x = counters[name]
        if name in _SUMMED:
            x = x.clone()
            torch.distributed.all_reduce(x, group=group)
        elif name == "retrievals":  # [L, H_local] -> [L, world * H_local]
            parts = [torch.empty_like(x) for _ in range(world)]
            torch.distributed.all_gather(parts, x.contiguous(), group=group)
            x = torch.cat(parts, dim=1)
        out[name] = x.cpu()
    return out
