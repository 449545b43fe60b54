"""When a forward runs sparse: a cost model of one layer's attention, dense against PrHS.

``policy.decode: auto`` (the shipped sparse configs') asks :meth:`CostModel.sparse_decode_wins`
at every eager forward, and at the eager prefill for the compiled decode steps that follow it
(a ``StaticCache``: ``generate()`` compiles its decode step, which then keeps that decision for
the generation). ``policy.prefill: auto`` runs a PSAW/ETF prefill only for a whole prompt of at
least :attr:`CostModel.min_sparse_prefill` tokens; shorter prompts and multi-token forwards over a
cache (assisted generation's verification, a second turn) run dense. Where the policy goes
dense, the forward takes the fair dense path (SDPA reading grouped K/V in place) of every layer.

The model, per layer and decode step, with ``itemsize`` bytes per element:

- dense reads every key and value: ``B · Hkv · L · D · 2 · itemsize`` bytes;
- PrHS reads the selected keys and values of each selecting row (a query head, or a KV head
  with ``cis.selection: group``), ``B · rows · min(n, L) · D · 2 · itemsize`` with ``n`` the
  largest index set (with ``backend.sparse_attention: group_union``, the union of a KV group's
  ``G`` per-head sets read once per KV head instead: ``B · Hkv · min(L, max(n, union_fraction · G · n))``
  keys and values, ``union_fraction`` the measured share of the group's summed sets that are distinct
  keys), plus, for a retrieval, every key of the retrieving KV groups
  (``retrieval_rate · B · Hkv · L · D · itemsize``; with a key index, its entry per key instead of
  ``D · itemsize`` plus the exact re-read of ``top-k + margin`` keys per row, ``pages``: the tokens of
  the candidate pages), plus the selection's own work
  ``overhead_us + per_key_ns · B · rows · n`` (its launches, on the host in eager mode, and the
  matching, top-k and composition of every row's set), plus ``topk_latency_ns · k`` for a top-k of
  ``k`` keys (with a key index, ``k`` is its first stage's ``top-k + margin`` candidates; pages: its
  candidate pages): the select's candidate collection and the dilated set's sort, whose programs work
  through a row's k entries one after another, so that their time grows with k and not with the
  rows (on the H100 at B1 × 128k, 32/8 heads: select + dilated set 40 µs at k = 88 against 199 µs
  at k = 4,096, docs/results/bench_decode_attention_lb.md). ``k`` is the k the generation runs:
  with ``budget.topk_fraction``, the budget's k for its prompt (``BudgetConfig.topk_for``);
- sparse runs where its time is below ``margin`` times dense's, both at ``bandwidth_gbs``.

The shipped constants, per GPU by the device's name (:func:`cost_model_for`, :data:`GPU_COST_MODELS`):
:data:`H100` on an H100 and :data:`H200` on an H200, each with its own read rate (about 0.82 of its
HBM peak, 3.35 and 4.8 TB/s), select cost and fixed step cost, fitted to that GPU's operator
benchmarks and checked against every measured end-to-end cell of that GPU (docs/results/policy_h100.md,
policy_h200.md, written by ``scripts/policy_table.py`` from the result JSONs); another GPU gets the
H200's constants and a warning, once. :data:`CPU` on a CPU, from decode steps of SmolLM2-135M on two
cores (docs/results/policy_cpu.md). On a CPU a sparse step runs the PyTorch reference ops, whose
work per selected key (the gather and the set's composition) dwarfs what dense attention reads, so
``auto`` decodes dense there at every context a CPU runs (``cis``'s 128-key sets would win past
about 80k tokens on SmolLM2's shape, ``cis_longbench``'s past millions) and a CPU user does not get
a slower decode by default; the accuracy studies and the tests that check sparse steps force
``policy.decode: sparse``. On other devices (no model) ``auto`` runs sparse. On another GPU, measure
the speed map with the policy forced each way (``prhs-hf bench --configs cis/sparse,cis/dense``) and
write the constants that reproduce its crossover to a JSON file of :class:`CostModel` fields, named
by ``policy.cost_model`` (docs/results/policy_h200.md, "Re-measuring").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["CPU", "DEFAULT_GPU", "GPU_COST_MODELS", "CostModel", "DecodeBytes", "DecodeShape", "H100", "H200",
           "cost_model_for", "gpu_key", "load_cost_model"]


@dataclass(frozen=True)
class DecodeShape:
    """What the cost of one layer's decode step depends on (host ints, known before the step)."""

    batch: int
    context: int  # tokens the longest sequence attends to (its cache slots)
    kv_heads: int
    rows: int  # selecting rows per sequence: query heads, or KV heads with group selection
    head_dim: int
    itemsize: int
    index_set: int  # the largest set a row attends to (sink + local + top-k + dilation)
    # with a key index (cis.index): the bytes a retrieval reads per key of its KV group (the index's
    # entry instead of the key), and the keys per retrieving row it re-reads exactly (top-k + margin;
    # pages: the tokens of the candidate pages, key_index.candidate_count)
    scored_key_bytes: float | None = None
    reranked: int = 0
    topk: int = 0  # entries a retrieval's select keeps (the budget's k; with a key index k + margin; 0: not priced)
    # backend.sparse_attention: group_union: the query heads per KV head whose per-head sets are read
    # once as their union (0: each row reads its own set)
    union_group: int = 0


class DecodeBytes(NamedTuple):
    """The bytes of one layer's decode step (:meth:`CostModel.decode_bytes`)."""

    dense: float  # dense attention: every key and value
    gathered: float  # PrHS's sparse attention: the selected keys and values
    scored: float  # a retrieval's score: the retrieving KV groups' keys (or key index entries)
    reranked: float  # a key index's exact re-read of its candidates' keys


@dataclass(frozen=True)
class CostModel:
    """Constants of one GPU (see the module docstring for the model)."""

    bandwidth_gbs: float
    eager_overhead_us: float
    compiled_overhead_us: float
    per_key_ns: float
    retrieval_rate: float
    margin: float
    min_sparse_prefill: int
    topk_latency_ns: float = 0.0  # per entry of a retrieval's top-k, once per layer (module docstring)
    # distinct keys / summed keys of a KV group's per-head sets (group_union's reads, module docstring)
    union_fraction: float = 0.33

    def decode_bytes(self, shape: DecodeShape, retrieval_rate: float | None = None) -> DecodeBytes:
        """The bytes one layer's decode step of ``shape`` reads (the module docstring), a retrieval
        reading the keys of ``retrieval_rate`` of the KV groups (default: :attr:`retrieval_rate`)."""
        s, rate = shape, self.retrieval_rate if retrieval_rate is None else retrieval_rate
        token_bytes = s.head_dim * s.itemsize  # one key (or one value) of one head
        if s.union_group:
            union = max(s.index_set, self.union_fraction * s.union_group * s.index_set)
            gathered = s.batch * s.kv_heads * min(union, s.context) * 2 * token_bytes
        else:
            gathered = s.batch * s.rows * min(s.index_set, s.context) * 2 * token_bytes
        key_bytes = token_bytes if s.scored_key_bytes is None else s.scored_key_bytes
        return DecodeBytes(dense=s.batch * s.kv_heads * s.context * 2 * token_bytes, gathered=gathered,
                           scored=rate * s.batch * s.kv_heads * s.context * key_bytes,
                           reranked=rate * s.batch * s.rows * min(s.reranked, s.context) * token_bytes)

    def decode_times_us(self, shape: DecodeShape, compiled: bool) -> tuple[float, float]:
        """``(dense, sparse)`` microseconds of one layer's decode step of ``shape``."""
        s, moved = shape, self.decode_bytes(shape)
        per_us = self.bandwidth_gbs * 1e3  # bytes per microsecond
        launches = self.compiled_overhead_us if compiled else self.eager_overhead_us
        overhead = (launches + self.per_key_ns * 1e-3 * s.batch * s.rows * s.index_set
                    + self.topk_latency_ns * 1e-3 * s.topk)
        return moved.dense / per_us, overhead + (moved.gathered + moved.scored + moved.reranked) / per_us

    def sparse_decode_wins(self, shape: DecodeShape, compiled: bool) -> bool:
        """Whether PrHS's decode step of ``shape`` beats the fair dense one by the margin."""
        if shape.context <= shape.index_set:
            return False  # the set is every token: nothing to skip
        dense, sparse = self.decode_times_us(shape, compiled)
        return sparse < self.margin * dense

    def sparse_prefill_wins(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a PSAW/ETF prefill of ``prompt_tokens`` new tokens after ``cached_tokens`` runs sparse."""
        return cached_tokens == 0 and prompt_tokens >= self.min_sparse_prefill


#: Fitted per GPU (docs/results/policy_h200.md, policy_h100.md, written by scripts/policy_table.py from the
#: result JSONs). ``bandwidth_gbs``: the median effective read rate of the fastest dense decode attention in
#: the operator benchmarks (bench_decode_attention*.json), about 0.82 of the HBM peak on both GPUs.
#: ``compiled_overhead_us`` and ``topk_latency_ns``: a least-squares fit of the operator rows' CIS step
#: time (per-head and group sets) beyond its modelled reads, ``fixed + topk_latency_ns · k`` (a fit
#: with a per-key term gives it about zero once the gather's bytes are priced, so ``per_key_ns`` is 0).
#: ``eager_overhead_us``: the host time of an eager step without CUDA graphs (``backend.eager_step:
#: plain | buffered``), bounded by the measured cells (below ~340 µs: the llama2-7b B8/16k eager cell
#: ran sparse 1.06× on the H200; above ~40 µs: the eager cells that lost); the default ``eager_step:
#: auto`` replays CUDA graphs, priced as compiled.
#: ``union_fraction``: Qwen2.5-Coder-1.5B's ``cis_longbench`` sets at 16k (G = 6: 0.325, p10–p90
#: 0.284–0.365, docs/results/probe_group_set_mass_qwen1.5b_16k.md), measured on the CPU.
H200 = CostModel(
    bandwidth_gbs=3960.0,
    eager_overhead_us=300.0,
    compiled_overhead_us=53.0,
    per_key_ns=0.0,
    retrieval_rate=0.5,
    topk_latency_ns=30.0,
    union_fraction=0.33,
    margin=0.9,
    min_sparse_prefill=4096,
)

#: The H100 (80 GB HBM3, 3.35 TB/s peak): as :data:`H200`, from the H100's operator rows
#: (bench_decode_attention_lb.json, bench_union_lb.json; their retrievals score at a measured share of
#: 0.5, slower per byte than the gather, which the fixed term takes up). The eager host term is the
#: H200's: no H100 cell ran eager steps without CUDA graphs sparse against dense.
H100 = dataclasses.replace(H200, bandwidth_gbs=2710.0, compiled_overhead_us=90.0, topk_latency_ns=24.0)

#: The constants per GPU, by a name that the device's name contains (``torch.cuda.get_device_name``:
#: "NVIDIA H100 80GB HBM3", "NVIDIA H200"); another GPU gets :data:`DEFAULT_GPU`'s with a warning.
GPU_COST_MODELS: dict[str, "CostModel"] = {"H100": H100, "H200": H200}
DEFAULT_GPU = "H200"


#: Fitted to decode steps of SmolLM2-135M (fp32, 9 query / 3 KV heads, head size 64) on two CPU cores,
#: dense against forced-sparse PrHS (docs/results/policy_cpu.md): ``cis_longbench``'s 7,146-key sets cost
#: about 0.3 s per layer and step beyond dense at 1k and at 4.7k tokens alike (its step 9-10x dense's),
#: ``cis``'s 186-key sets about nothing, so the cost is per selected key and row (``per_key_ns``), not
#: per token of the context. ``bandwidth_gbs``: what dense attention reads per second from memory on
#: such a CPU (an estimate: its attention is a small part of a CPU decode step, too small to fit).
#: The prefill keeps the sparse path (``min_sparse_prefill`` 0), as before: PSAW/ETF on a CPU not measured.
CPU = CostModel(
    bandwidth_gbs=10.0,
    eager_overhead_us=0.0,
    compiled_overhead_us=0.0,
    per_key_ns=4700.0,
    retrieval_rate=0.5,
    topk_latency_ns=0.0,
    margin=0.9,
    min_sparse_prefill=0,
)


def load_cost_model(path: str | Path) -> CostModel:
    """A :class:`CostModel` from a JSON object of its fields (``policy.cost_model``); the fields it
    leaves out keep :data:`H200`'s."""
    from .config import ConfigError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"policy.cost_model: cannot read {path}: {err}") from None
    fields = {f.name: f.type for f in dataclasses.fields(CostModel)}
    if not isinstance(data, dict) or set(data) - set(fields):
        raise ConfigError(f"policy.cost_model: {path} must be a JSON object with keys from {', '.join(fields)}")
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"policy.cost_model: {path}: {key} must be a number >= 0, got {value!r}")
    return dataclasses.replace(H200, **data)


def gpu_key(name: str) -> str | None:
    """The key of :data:`GPU_COST_MODELS` that a GPU's name contains ("NVIDIA H100 80GB HBM3": "H100"), or None."""
    return next((key for key in GPU_COST_MODELS if key in name.upper()), None)


def cost_model_for(device: torch.device, path: str | None = None) -> CostModel | None:
    """The cost model of ``device``: ``path``'s where given; on CUDA the constants of the GPU its name
    names (:data:`GPU_COST_MODELS`; another GPU gets :data:`DEFAULT_GPU`'s, and a warning says so once per
    name); :data:`CPU`'s on a CPU; else ``None`` (``auto`` then runs sparse)."""
    if path is not None:
        return load_cost_model(path)
    device = torch.device(device)
    if device.type == "cuda":
        return _gpu_cost_model(torch.cuda.get_device_name(device))
    return CPU if device.type == "cpu" else None


@functools.lru_cache(maxsize=None)
def _gpu_cost_model(name: str) -> CostModel:
    key = gpu_key(name)
    if key is None:
        warnings.warn(f"policy: auto has no cost model measured on {name!r}; it uses the {DEFAULT_GPU}'s constants "
                      f"({', '.join(GPU_COST_MODELS)} are measured). Measure yours and name it in policy.cost_model "
                      f"(docs/results/policy_h200.md says how)", stacklevel=3)
        key = DEFAULT_GPU
    return GPU_COST_MODELS[key]
