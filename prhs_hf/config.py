"""The PrHS configuration: one YAML file (or dict) drives CIS, PSAW, ETF, backends and telemetry.

The schema is SPEC.md §1: the key names are the user interface and never change. ``null`` means
"the paper's default for this model" and is resolved against the model's layer count by
:meth:`PrHSConfig.resolve`. Every problem (unknown key, wrong type, out-of-range value, a file that
is missing, a directory, empty, not UTF-8 or not YAML, a key given twice) raises :class:`ConfigError`
naming the key (or the file and line) and what is allowed. A numpy scalar (``np.int64(4)``,
``np.float32(0.7)``, ``np.bool_(True)``) counts as the matching Python scalar and follows its rules.

Sections you leave out are **off**. ``cis``, ``psaw`` and ``etf`` are on when their section is
present (unless it says ``enabled: false``) and off when it is left out, so ``{cis: {tau: 0.7}}``
is CIS alone; ``baseline`` is off unless ``baseline.name`` is set; ``early_select`` (EarlySelectKV on
CIS or Quest) is on when present; ``telemetry`` is off unless
``telemetry.enabled: true``; ``generation`` (the patched ``generate()`` loop) keeps its defaults; ``budget`` and ``backend`` fall back to neutral defaults (8 sink + 32
local + 88 top-k; ``auto`` backends). An empty mapping, ``None`` or a bare :class:`PrHSConfig` is
therefore dense (nothing on). The paper's settings live in the shipped files, which spell out
every section: ``configs/cis.yaml`` (CIS), ``cpe.yaml`` (CIS + PSAW + ETF), ``cpe_longbench.yaml``
(CPE with the LongBench budget) and ``dense.yaml``.

A config source that is a bare name (``"cis"``, ``"cpe"``: no folder, no ``.yaml``) is the
shipped config of that name; anything else is a path and must exist. The shipped files are
package data (``prhs_hf/configs`` in a wheel, the repository's ``configs/`` in a checkout; see
:func:`shipped_dir`).

Every numeric key has an upper bound: sizes in tokens at most :data:`MAX_TOKENS`, layer indices
below :data:`MAX_LAYERS`, exponents at most :data:`MAX_EXPONENT`; the derived index set and the CIS
state per head are bounded too (:data:`MAX_INDEX_SET`, :data:`MAX_CIS_STATE`), and
:meth:`PrHSConfig.resolve` bounds the sizes in use by the model's positions when it is told them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = [
    "ConfigError",
    "CIS_INDEXES",
    "BudgetConfig",
    "CISConfig",
    "PSAWConfig",
    "ETFConfig",
    "BackendConfig",
    "TelemetryConfig",
    "BaselineConfig",
    "BASELINES",
    "EarlySelectConfig",
    "EARLY_SELECT_TAPS",
    "GenerationLoopConfig",
    "MAX_STOP_CHECK_EVERY",
    "PrHSConfig",
    "ResolvedConfig",
    "load_config",
    "resolve_config_path",
    "shipped_dir",
    "shipped_configs",
    "MAX_TOKENS",
    "MAX_LAYERS",
    "MAX_EXPONENT",
    "MAX_INDEX_SET",
    "MAX_CIS_STATE",
    "MAX_RERANK_TOKENS",
]

PHASES = ("prefill", "decode")
PREFILL_BACKENDS = ("auto", "torch", "triton", "flex", "flash")  # auto: flash where FA4 runs, else triton on CUDA, else torch
DECODE_BACKENDS = ("auto", "torch", "triton")
SPARSE_ATTENTIONS = ("per_head", "group_union")  # backend.sparse_attention

MAX_TOKENS = 2**20
"""Upper bound of every size in tokens (budget keys, ``cis.block_size``, ``cis.dilation_*``,
``baseline.page_size``): 1,048,576, far above any useful budget and safe from int32 overflow."""
MAX_LAYERS = 2**16
"""Upper bound (exclusive) of a layer index before the model is known."""
MAX_EXPONENT = 1000.0
"""Upper bound of ``psaw.alpha`` and ``etf.gamma`` (beyond it ``phi ** (alpha * u)`` underflows)."""
MAX_TAU = 2.0
"""Upper bound of ``cis.tau``: a cosine similarity is at most 1, so any tau above 1 never shares."""
MAX_SEED = 2**32 - 1
"""Upper bound of ``baseline.seed``."""
MAX_POOL_KERNEL = 1023
"""Upper bound of ``baseline.pool_kernel`` (CertKV's SnapKV pooling; SnapKV uses 5 to 13)."""
MAX_INDEX_SET = MAX_TOKENS
"""Upper bound of a decode step's index set: sink + local + top-k + 2 · dilation_radius · dilation_topm."""
MAX_CIS_STATE = 2**24
"""Upper bound of ``cis.block_size`` × the index set: the int32 anchor indices CIS keeps per head and
sequence (64 MiB each at the bound)."""


class ConfigError(ValueError):
    """A PrHS config value is unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class BudgetConfig:
    """Token budget of a sparse decode step: sinks, recent (local) tokens and top-k middle tokens.

    ``topk_fraction`` (null: off) makes the top-k relative to the context: a generation's k is
    ``clamp(round(topk_fraction * context), topk, topk_max)`` (:meth:`topk_for`), with ``topk`` the
    floor and ``topk_max`` (null: none) the cap, ``context`` the cache slots after the generation's
    prefill (the batch's longest prompt under left padding). Every decode step of the generation
    keeps that k, until the next prefill.
    """

    sink: int = 8
    local: int = 32
    topk: int = 88
    topk_fraction: float | None = None
    topk_max: int | None = None

    def topk_for(self, context: int) -> int:
        """The top-k of a generation whose prefill leaves ``context`` cache slots: ``topk`` without a
        ``topk_fraction``, else ``round(topk_fraction * context)`` (halves up) clamped to
        ``[topk, topk_max]``.

        Per generation, not per step or per sequence: k is the width of a retrieval's result and of a
        CIS anchor's set (one tensor for the batch, the same for every step of a block), a constant of
        a compiled step and of a CUDA graph's capture, and a step-by-step k would compile and capture
        again every ``1 / topk_fraction`` tokens. A generation's decode steps add their tokens to a
        context that its prompt sets (RULER, LongBench: 4k-128k prompts, at most a few hundred new
        tokens), so the fraction is of the prompt."""
        if self.topk_fraction is None:
            return self.topk
        k = math.floor(self.topk_fraction * context + 0.5)
        if self.topk_max is not None:
            k = min(k, self.topk_max)
        return max(k, self.topk)


@dataclass(frozen=True)
class CISConfig:
    """Clustered Index Sharing (SPEC §4)."""

    enabled: bool = True
    block_size: int = 16
    tau: float = 0.8
    dilation_topm: int | None = None  # None: floor(topk / 3)
    dilation_radius: int = 1
    # "head": an index set per query head (the paper); "group": one per KV head, shared by the
    # query heads of its group (ranked by the group's largest score; anchors and matching per KV head);
    # "group_mean": the same, ranked by the mean of the group's scores (the score of its mean query)
    selection: str = "head"
    # also keep the tokens that aged from the local window into the middle since the block began:
    # an anchor taken then never scored them (at most block_size - 1 more keys per step)
    keep_anchor_local: bool = False
    # CertKV's tail-summary slot on top of CIS: one slot of each row's top-k budget holds a synthetic
    # key/value for the middle tokens its index set leaves out (prhs_hf/selectors/cis.py)
    tail_slot: bool = False
    # the key index (docs/notes/key_index.md): a low-precision copy of the keys beside the cache that a
    # retrieval scores first; its best k + rerank_margin candidates are then re-ranked exactly on the
    # cache's keys. "none": every retrieval scores the cache itself (bit-identical to no index)
    index: str = "none"
    # m: candidates beyond k re-ranked exactly (pages: rounded up to whole pages). At 128, with codes centred on
    # the prompt's mean key, fp8 and int4 return >= 0.999 of the exact top-k on Qwen2.5-Coder-1.5B at 4k-8k
    # tokens, beta_emp within 0.6 % of no index, and k + m stays within the one-launch select at cis.yaml's k
    # (docs/results/selection_quality_key_index_centred_qwen1.5b*.md, docs/notes/key_index.md)
    rerank_margin: int = 128
    index_page: int = 16  # index: pages, tokens per page (a power of two in [4, 128])


@dataclass(frozen=True)
class PSAWConfig:
    """Progressive Sliding Attention Window (SPEC §2)."""

    enabled: bool = True
    phases: tuple[str, ...] = PHASES
    start_layer: int | None = None  # None: floor(N / 2)
    phi: float = 0.7
    alpha: float = 1.0


@dataclass(frozen=True)
class ETFConfig:
    """Early Token Freezing (SPEC §2), prefill only."""

    enabled: bool = True
    start_layer: int | None = None  # None: floor(N / 2)
    psi: float = 0.5
    gamma: float = 1.0


@dataclass(frozen=True)
class BackendConfig:
    """Which implementation runs each phase: ``auto`` picks Triton on CUDA and PyTorch elsewhere."""

    prefill: str = "auto"
    decode: str = "auto"
    # eager decode: "plain" (transformers' DynamicCache), "buffered" (K/V in buffers made for the
    # generate() call's max_length where it is within kv_growth x the prompt, else grown by kv_growth:
    # no copy of the cache per step),
    # "graphs" (buffered, and each layer's sparse CIS step replayed as a CUDA graph on CUDA), "auto"
    # (graphs where the step can be captured: CIS without tail slot or key index, telemetry off;
    # buffered elsewhere); prhs_hf.runtime.BufferedLayer, docs/notes/runtime_design.md
    eager_step: str = "auto"
    kv_growth: float = 1.25
    # the sparse decode attention over per-query-head index sets: "per_head" (each head reads its own
    # set's K/V rows) or "group_union" (each KV group's union of its heads' sets is read once, every
    # head masked to its own set: the same output, fewer K/V rows where the sets overlap; groups of
    # up to 32 query heads; backend.decode: torch computes it per head). Sets shared by a KV group
    # (cis.selection: group) and models with one query head per KV head are read as with per_head.
    sparse_attention: str = "per_head"


POLICIES = ("auto", "sparse", "dense")


@dataclass(frozen=True)
class PolicyConfig:
    """Which forwards run sparse (``prhs_hf.policy``): ``auto`` asks the cost model of the device
    for each forward (on CUDA and on a CPU, where it decodes dense: its sparse steps are slower
    there; on other devices ``auto`` is sparse),
    ``sparse`` always, ``dense`` never (the fair dense path). ``cost_model``: a JSON file of
    :class:`prhs_hf.policy.CostModel` fields measured on your GPU (null: the shipped constants of the
    device's GPU, :data:`prhs_hf.policy.GPU_COST_MODELS`)."""

    decode: str = "sparse"
    prefill: str = "sparse"
    cost_model: str | None = None


@dataclass(frozen=True)
class TelemetryConfig:
    """Statistics of SPEC §5; off by default and free when off."""

    enabled: bool = False
    oracle: bool = False


BASELINES = ("oracle", "streaming", "h2o", "quest", "hshare", "direct_reuse", "random_expansion", "double_sparsity", "certkv")


@dataclass(frozen=True)
class BaselineConfig:
    """A comparison selector (SPEC §6) that replaces CIS in decode, with the same budget.

    ``name: null`` (the default) means no baseline: CIS (or dense) decides. ``page_size`` is
    Quest's page; ``share_ratio``, ``head_share_ratio`` and ``layer_share_ratio`` are HShare's
    query-, head- and layer-level sharing ratios (the fraction of decode steps, of a layer's heads
    and of the layers that reuse indices instead of retrieving; each in [0, 1)); ``seed`` seeds
    RandomExpansion. ``label_channels`` (a ``.pt`` path or null; relative paths in a YAML file are
    relative to its folder; ``prhs-hf calibrate-ds`` writes one) and ``label_rank`` (r, at most the
    head dimension) are Double Sparsity's calibrated label channels and their count per head (null:
    chosen from each prompt; see :mod:`prhs_hf.selectors.double_sparsity`). ``window`` (the
    observation window W: the last W prompt queries score the prompt), ``pool_kernel`` (1-D max-pool
    of those scores; 1: none) and ``tail_slot`` (one charged tail-summary slot per KV head) are
    CertKV's (:mod:`prhs_hf.selectors.certkv`).
    """

    name: str | None = None
    page_size: int = 16
    share_ratio: float = 0.875
    head_share_ratio: float = 0.5
    layer_share_ratio: float = 0.5
    seed: int = 0
    label_channels: str | None = None
    label_rank: int = 16
    window: int = 32
    pool_kernel: int = 5
    tail_slot: bool = True


EARLY_SELECT_TAPS = ("early", "mid")
EARLY_SELECT_APPLIES_TO = ("CIS (a cis section, no baseline.name)", "baseline.name: quest")
MAX_EARLY_SELECT_RANK = 2**16
"""Upper bound of ``early_select.rank`` (the model's ``W_q`` bounds it further when patched)."""


@dataclass(frozen=True)
class EarlySelectConfig:
    """EarlySelectKV (:mod:`prhs_hf.selectors.early_select`): layer ℓ+1's indices from a proxy query.

    On when the section is present (unless ``enabled: false``), for the selector in force: CIS
    (ES-CIS) or ``baseline.name: quest`` (ES-Quest). ``tap`` is the hidden state the proxy is built
    from: ``early`` (entering layer ℓ) or ``mid`` (after layer ℓ's attention residual); ``rank``
    null projects it with layer ℓ+1's exact ``W_q``, an int ``r`` with the rank-``r`` SVD of it.
    ``side_stream`` (ES-CIS only, ``budget.local >= 1``): layer ℓ+1's CIS selection is launched at
    layer ℓ's tap on a side CUDA stream and joined before layer ℓ+1's attention, so it can overlap
    the rest of layer ℓ (eager and compiled ``generate()``; on the CPU it runs in order). Same
    indices and tokens as without.
    """

    enabled: bool = True
    tap: str = "mid"
    rank: int | None = None
    side_stream: bool = False


MAX_STOP_CHECK_EVERY = 1024
"""Upper bound of ``generation.stop_check_every`` (a generation that stops early runs up to this
many forwards minus one past its end)."""


@dataclass(frozen=True)
class GenerationLoopConfig:
    """The patched model's ``generate()`` loop (:mod:`prhs_hf.patching`), on whatever attention runs.

    ``stop_check_every``: greedy and sampling read the device's "all sequences finished" flag once
    every this many decode steps instead of at each one, so the host can queue steps ahead of the
    GPU; the steps that ran past the real end are undone (tokens, scores, logits, cache, the
    selector's per-generation state), so ``generate()`` returns, and leaves on its cache, what it
    does with ``1`` (the check at every step, plain transformers). Cases that cannot be undone
    exactly check every step (see :func:`prhs_hf.patching.generate_without_step_reads`); CIS reads at
    the latest after a block's last step that a window would undo past.
    """

    stop_check_every: int = 8


@dataclass(frozen=True)
class PrHSConfig:
    """A whole PrHS configuration, as read from YAML (``null`` values still unresolved).

    A section left out is off (see the module docstring): ``PrHSConfig()`` is dense. The section
    classes themselves default to ``enabled=True``, as a section written in a YAML file does.
    """

    budget: BudgetConfig = field(default_factory=BudgetConfig)
    cis: CISConfig = field(default_factory=lambda: CISConfig(enabled=False))
    psaw: PSAWConfig = field(default_factory=lambda: PSAWConfig(enabled=False))
    etf: ETFConfig = field(default_factory=lambda: ETFConfig(enabled=False))
    backend: BackendConfig = field(default_factory=BackendConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    early_select: EarlySelectConfig = field(default_factory=lambda: EarlySelectConfig(enabled=False))
    generation: GenerationLoopConfig = field(default_factory=GenerationLoopConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (YAML-serialisable)."""
        out = dataclasses.asdict(self)
        out["psaw"]["phases"] = list(self.psaw.phases)
        return out

    def resolve(self, num_layers: int, max_positions: int | None = None) -> "ResolvedConfig":
        """Fill the ``null`` defaults for a model with ``num_layers`` decoder layers and check layer ranges.

        ``max_positions`` (the model's ``max_position_embeddings``), when given, bounds every size
        in tokens that the config uses (the budget and ``cis.block_size`` when CIS or a baseline
        selects, ``baseline.page_size`` for Quest): no sequence of the model is longer.
        """
        if num_layers < 1:
            raise ConfigError(f"the model has {num_layers} decoder layers; PrHS needs at least 1")
        if max_positions is not None and max_positions < 1:
            raise ConfigError(f"max_positions: {max_positions} is out of range; allowed a positive int or None")
        half = num_layers // 2
        psaw_start = half if self.psaw.start_layer is None else self.psaw.start_layer
        etf_start = half if self.etf.start_layer is None else self.etf.start_layer
        for key, value in (("psaw.start_layer", psaw_start), ("etf.start_layer", etf_start)):
            if not 0 <= value < num_layers:
                raise ConfigError(f"{key}: {value} is out of range; allowed 0 <= {key} < {num_layers} (the model's layers)")
        if max_positions is not None:
            for key, value in self._sizes_in_use():
                lower = _RULES[key][1]
                if value > max_positions:
                    raise ConfigError(f"{key}: {value} is out of range for this model; allowed [{lower}, {max_positions}] "
                                      f"(its max_position_embeddings): the config is for longer contexts than this "
                                      f"model's; give one with a smaller budget, e.g. the shipped \"cis\" "
                                      f"(8 sink + 32 local + 88 top-k)")
        return ResolvedConfig(self, num_layers, psaw_start, etf_start, self._dilation_topm())

    def with_topk(self, topk: int) -> "PrHSConfig":
        """This config with the fixed top-k ``topk`` in place of its budget's (a context-relative
        budget's k for one generation, :meth:`BudgetConfig.topk_for`; ``topk_fraction`` and
        ``topk_max`` off). Not validated again: ``topk`` must lie within the budget's bounds."""
        if self.budget.topk_fraction is None and topk == self.budget.topk:
            return self
        budget = dataclasses.replace(self.budget, topk=topk, topk_fraction=None, topk_max=None)
        return dataclasses.replace(self, budget=budget)

    def _dilation_topm(self) -> int:
        """``cis.dilation_topm`` with ``null`` filled: floor(top-k / 3)."""
        return self.budget.topk // 3 if self.cis.dilation_topm is None else self.cis.dilation_topm

    def _index_set(self, dilation_topm: int) -> int:
        """The largest index set of a decode step: the budget plus the dilation neighbours."""
        b = self.budget
        aged = self.cis.block_size - 1 if self.cis.enabled and self.cis.keep_anchor_local else 0
        return b.sink + b.local + b.topk + 2 * self.cis.dilation_radius * dilation_topm + aged

    def _sizes_in_use(self) -> list[tuple[str, int]]:
        """The sizes in tokens that this config's decode selection reads, as ``(key, value)``."""
        if not (self.cis.enabled or self.baseline.name is not None):
            return []
        b = self.budget
        sizes = [("budget.sink", b.sink), ("budget.local", b.local), ("budget.topk", b.topk),
                 ("cis.block_size", self.cis.block_size)]
        if self.baseline.name == "quest":
            sizes.append(("baseline.page_size", self.baseline.page_size))
        return sizes


@dataclass(frozen=True)
class ResolvedConfig:
    """A config bound to a model: every default filled in."""

    config: PrHSConfig
    num_layers: int
    psaw_start: int
    etf_start: int
    dilation_topm: int

    @property
    def psaw_prefill(self) -> bool:
        return self.config.psaw.enabled and "prefill" in self.config.psaw.phases

    @property
    def psaw_decode(self) -> bool:
        return self.config.psaw.enabled and "decode" in self.config.psaw.phases

    @property
    def budget_total(self) -> int:
        b = self.config.budget
        return b.sink + b.local + b.topk

    @property
    def index_capacity(self) -> int:
        """Largest index set of a CIS step: the budget plus the dilation neighbours."""
        return self.config._index_set(self.dilation_topm)

    def at_topk(self, topk: int) -> "ResolvedConfig":
        """This resolved config with the fixed top-k ``topk`` (:meth:`PrHSConfig.with_topk`): what a
        generation whose context-relative budget came to ``topk`` runs with (its ``dilation_topm``
        follows a ``null`` ``cis.dilation_topm``: floor(topk / 3))."""
        config = self.config.with_topk(topk)
        if config is self.config:
            return self
        return dataclasses.replace(self, config=config, dilation_topm=config._dilation_topm())


# --------------------------------------------------------------------------- parsing

_SECTIONS: dict[str, type] = {
    "budget": BudgetConfig,
    "cis": CISConfig,
    "psaw": PSAWConfig,
    "etf": ETFConfig,
    "backend": BackendConfig,
    "policy": PolicyConfig,
    "telemetry": TelemetryConfig,
    "baseline": BaselineConfig,
    "early_select": EarlySelectConfig,
    "generation": GenerationLoopConfig,
}

# key -> (kind, lower, upper, lower_open, nullable[, upper_open]); kind in {"int", "float", "bool", "choice", "phases", "path"}
CIS_SELECTIONS = ("head", "group", "group_mean")
CIS_INDEXES = ("none", "fp8", "int4", "pages")
"""``cis.index``: ``none``, or a key index kind that ``prhs_hf.ops.key_index.key_index`` implements
(``INDEX_KINDS``; tests/test_config.py checks that the two agree)."""
MIN_INDEX_PAGE, MAX_INDEX_PAGE = 4, 128
MAX_RERANK_TOKENS = 8192
"""Most candidate tokens a key index's re-rank takes per row (``prhs_hf.ops.key_index.key_index.RERANK_MAX``,
which tests/test_config.py checks this against): ``k + cis.rerank_margin``; ``pages``: the tokens of
``ceil((k + margin + 2 * (index_page - 1)) / index_page)`` pages."""

_RULES: dict[str, tuple] = {
    "budget.sink": ("int", 0, MAX_TOKENS, False, False),
    "budget.local": ("int", 0, MAX_TOKENS, False, False),
    "budget.topk": ("int", 1, MAX_TOKENS, False, False),
    "budget.topk_fraction": ("float", 0.0, 1.0, True, True),
    "budget.topk_max": ("int", 1, MAX_TOKENS, False, True),
    "cis.enabled": ("bool",),
    "cis.block_size": ("int", 1, MAX_TOKENS, False, False),
    "cis.tau": ("float", -1.0, MAX_TAU, False, False),
    "cis.selection": ("choice", CIS_SELECTIONS),
    "cis.keep_anchor_local": ("bool",),
    "cis.tail_slot": ("bool",),
    "cis.dilation_topm": ("int", 0, MAX_TOKENS, False, True),
    "cis.dilation_radius": ("int", 0, MAX_TOKENS, False, False),
    "cis.index": ("choice", CIS_INDEXES),
    "cis.rerank_margin": ("int", 0, MAX_TOKENS, False, False),
    "cis.index_page": ("int", MIN_INDEX_PAGE, MAX_INDEX_PAGE, False, False),
    "psaw.enabled": ("bool",),
    "psaw.phases": ("phases",),
    "psaw.start_layer": ("int", 0, MAX_LAYERS, False, True, True),
    "psaw.phi": ("float", 0.0, 1.0, True, False),
    "psaw.alpha": ("float", 0.0, MAX_EXPONENT, False, False),
    "etf.enabled": ("bool",),
    "etf.start_layer": ("int", 0, MAX_LAYERS, False, True, True),
    "etf.psi": ("float", 0.0, 1.0, True, False),
    "etf.gamma": ("float", 0.0, MAX_EXPONENT, False, False),
    "backend.prefill": ("choice", PREFILL_BACKENDS),
    "backend.decode": ("choice", DECODE_BACKENDS),
    "backend.eager_step": ("choice", ("auto", "plain", "buffered", "graphs")),
    "backend.kv_growth": ("float", 1.0, 4.0, True, False),
    "backend.sparse_attention": ("choice", SPARSE_ATTENTIONS),
    "policy.decode": ("choice", POLICIES),
    "policy.prefill": ("choice", POLICIES),
    "policy.cost_model": ("path",),
    "telemetry.enabled": ("bool",),
    "telemetry.oracle": ("bool",),
    "baseline.name": ("choice", (None, *BASELINES)),
    "baseline.page_size": ("int", 1, MAX_TOKENS, False, False),
    "baseline.share_ratio": ("float", 0.0, 1.0, False, False, True),
    "baseline.head_share_ratio": ("float", 0.0, 1.0, False, False, True),
    "baseline.layer_share_ratio": ("float", 0.0, 1.0, False, False, True),
    "baseline.seed": ("int", 0, MAX_SEED, False, False),
    "baseline.label_channels": ("path",),
    "baseline.label_rank": ("int", 1, 1024, False, False),  # head dimensions are at most 1024
    "baseline.window": ("int", 1, MAX_TOKENS, False, False),
    "baseline.pool_kernel": ("int", 1, MAX_POOL_KERNEL, False, False),
    "baseline.tail_slot": ("bool",),
    "early_select.enabled": ("bool",),
    "early_select.tap": ("choice", EARLY_SELECT_TAPS),
    "early_select.rank": ("int", 1, MAX_EARLY_SELECT_RANK, False, True),
    "early_select.side_stream": ("bool",),
    "generation.stop_check_every": ("int", 1, MAX_STOP_CHECK_EVERY, False, False),
}

_KIND_TEXT = {"int": "an int", "float": "a float"}


def _range_text(lower, upper, lower_open, upper_open=False) -> str:
    left = "(" if lower_open else "["
    right = ")" if upper_open else "]"
    return f"{left}{lower}, {upper}{right}"


def _python_scalar(value: Any) -> Any:
    """A numpy scalar (``np.int64``, ``np.float32``, ``np.bool_``, ...) as the matching Python one
    (``.item()``); anything else as is. numpy is not imported here: a numpy scalar means it already is."""
    numpy = sys.modules.get("numpy")
    return value.item() if numpy is not None and isinstance(value, numpy.generic) else value


def _check_value(key: str, value: Any) -> Any:
    rule = _RULES[key]
    kind = rule[0]
    value = _python_scalar(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if kind == "choice":
        if value not in rule[1]:
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {', '.join(map(str, rule[1]))}")
        return value
    if kind == "path":
        if value is None or (isinstance(value, str) and value.strip()):
            return value
        raise ConfigError(f"{key}: expected a file path (a non-empty string) or null, got {value!r}")
    if kind == "phases":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value or any(v not in PHASES for v in value):
            raise ConfigError(f"{key}: expected a non-empty list drawn from {list(PHASES)} (the phases PSAW windows; "
                              f"psaw.enabled: false turns it off), got {value!r}")
        return tuple(dict.fromkeys(value))
    _, lower, upper, lower_open, nullable, *rest = rule
    upper_open = bool(rest and rest[0])
    allowed = _range_text(lower, upper, lower_open, upper_open)
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{key}: null is not allowed; expected {_KIND_TEXT[kind]} in {allowed}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected {_KIND_TEXT[kind]}{' or null' if nullable else ''}, got {value!r}")
    if kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{key}: expected an int, got {value!r}")
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    too_low = value <= lower if lower_open else value < lower
    too_high = value >= upper if upper_open else value > upper
    if too_low or too_high:
        raise ConfigError(f"{key}: {value!r} is out of range; allowed {allowed}")
    return value


def _merge(base: dict, overrides: Mapping) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: Mapping[str, Any] | None) -> PrHSConfig:
    """Validate plain data against the schema and build a :class:`PrHSConfig`.

    Sections left out are off (module docstring); ``None`` is the empty mapping (dense).
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"a PrHS config must be a mapping of sections, got {type(data).__name__}")
    sections = {}
    for name, section in data.items():
        if name not in _SECTIONS:
            raise ConfigError(f"{name}: unknown section; allowed: {', '.join(_SECTIONS)}")
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"{name}: expected a mapping of keys, got {section!r}")
        cls = _SECTIONS[name]
        allowed = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for key, value in section.items():
            if key not in allowed:
                raise ConfigError(f"{name}.{key}: unknown key; allowed in {name}: {', '.join(allowed)}")
            values[key] = _check_value(f"{name}.{key}", value)
        sections[name] = cls(**values)
    config = PrHSConfig(**sections)
    _check_sizes(config)
    return config


def _require_no_baseline(config: PrHSConfig, key: str, applies_to: str, fix: str) -> None:
    """``key`` is a CIS option: raise if a baseline replaces CIS."""
    if config.baseline.name is not None:
        raise ConfigError(f"{key}: applies to {applies_to} (no baseline.name); this config has baseline.name: "
                          f"{config.baseline.name} ({fix})")


def _require_budget(config: PrHSConfig, key: str, minimum: int, why: str, fix: str = "") -> None:
    """``budget.<key>`` must be at least ``minimum`` for an option that is on (``why`` names it)."""
    value = getattr(config.budget, key)
    if value < minimum:
        raise ConfigError(f"budget.{key}: {value} {why}; allowed >= {minimum}{fix}")


def _check_relative_topk(config: PrHSConfig) -> None:
    """``budget.topk_fraction`` and ``budget.topk_max``: a cap goes with a fraction, at or above the
    floor ``budget.topk``; the fraction sizes CIS's retrievals (the baselines keep a fixed k)."""
    b = config.budget
    if b.topk_max is not None:
        if b.topk_fraction is None:
            raise ConfigError(f"budget.topk_max: {b.topk_max} caps a context-relative top-k and this config has "
                              f"none (set budget.topk_fraction, or budget.topk_max: null)")
        if b.topk_max < b.topk:
            raise ConfigError(f"budget.topk_max: {b.topk_max} is out of range; allowed [budget.topk={b.topk}, "
                              f"{MAX_TOKENS}] or null (budget.topk is the floor of a context-relative top-k)")
    if b.topk_fraction is not None and not (config.cis.enabled and config.baseline.name is None):
        selector = f"baseline.name: {config.baseline.name}" if config.baseline.name else "no selector (cis is off)"
        raise ConfigError(f"budget.topk_fraction: applies to CIS (a cis section, no baseline.name); this config has "
                          f"{selector} (set budget.topk_fraction: null)")


def _check_rerank_room(config: PrHSConfig) -> None:
    """A key index re-ranks at most :data:`MAX_RERANK_TOKENS` candidates per row: the largest k (the cap of a
    context-relative top-k, which must then be set) plus ``cis.rerank_margin`` must fit."""
    b, cis = config.budget, config.cis
    if b.topk_fraction is not None and b.topk_max is None:
        raise ConfigError(f"budget.topk_max: null leaves a context-relative top-k unbounded, and cis.index: "
                          f"{cis.index} re-ranks at most {MAX_RERANK_TOKENS} candidate tokens per row (k + "
                          f"cis.rerank_margin); set budget.topk_max <= {MAX_RERANK_TOKENS - cis.rerank_margin}")
    key, k = ("budget.topk_max", b.topk_max) if b.topk_fraction is not None else ("budget.topk", b.topk)
    page = cis.index_page if cis.index == "pages" else 1
    tokens = math.ceil((k + cis.rerank_margin + 2 * (page - 1)) / page) * page
    if tokens > MAX_RERANK_TOKENS:
        pages = f" (pages of {page}: {tokens} tokens)" if page > 1 else ""
        raise ConfigError(f"{key}: {k} with cis.index: {cis.index} and cis.rerank_margin: {cis.rerank_margin} gives "
                          f"{k + cis.rerank_margin} candidates{pages} to re-rank per row; allowed up to "
                          f"{MAX_RERANK_TOKENS} (lower {key} or cis.rerank_margin, or set cis.index: none)")


def _check_sizes(config: PrHSConfig) -> None:
    """The bounds that involve several keys: ``dilation_topm`` within top-k, the index set and the CIS state."""
    b, cis = config.budget, config.cis
    _check_relative_topk(config)
    if cis.dilation_topm is not None and cis.dilation_topm > b.topk:
        raise ConfigError(f"cis.dilation_topm: {cis.dilation_topm} is out of range; allowed [0, budget.topk={b.topk}]")
    if config.baseline.name == "certkv" and config.baseline.tail_slot:
        _require_budget(config, "topk", 2, "leaves CertKV no real-token slot beside its tail slot (baseline.tail_slot: "
                        "true charges one per KV head)", ", or tail_slot: false")
    if cis.enabled and cis.tail_slot:
        _require_no_baseline(config, "cis.tail_slot", "CIS", "set cis.tail_slot: false, or baseline.tail_slot for certkv")
        _require_budget(config, "topk", 2, "leaves CIS no real-token slot beside its tail slot (cis.tail_slot: true "
                        "charges one per row)", ", or cis.tail_slot: false")
    if cis.index_page & (cis.index_page - 1):
        raise ConfigError(f"cis.index_page: {cis.index_page} is not a power of two; allowed 4, 8, 16, 32, 64 or 128")
    es = config.early_select
    if cis.index != "none" and cis.enabled:
        _check_rerank_room(config)
    if cis.index != "none":
        _require_no_baseline(config, "cis.index", "CIS", "the baselines score the cache itself: set cis.index: none")
        if not cis.enabled:
            raise ConfigError(f"cis.index: applies to CIS; this config has cis.enabled: false (set cis.index: none, "
                              f"or turn CIS on)")
        if es.enabled and es.side_stream:
            raise ConfigError(f"cis.index: {cis.index} cannot run with early_select.side_stream: true (the side "
                              f"stream's selection starts before the step's key is in the cache, so the index could "
                              f"not be updated first); set cis.index: none or early_select.side_stream: false")
        if config.backend.eager_step == "graphs":
            raise ConfigError(f"cis.index: {cis.index} cannot run with backend.eager_step: graphs (an eager step "
                              f"finds the new key's slot in a buffered cache on the host, which a captured step "
                              f"cannot); set cis.index: none or backend.eager_step: plain or buffered")
    if es.enabled and not (config.baseline.name == "quest" or (config.baseline.name is None and cis.enabled)):
        selector = f"baseline.name: {config.baseline.name}" if config.baseline.name else "no selector (cis is off)"
        raise ConfigError(f"early_select: applies to {' or '.join(EARLY_SELECT_APPLIES_TO)}; this config has "
                          f"{selector} (remove the early_select section or set early_select.enabled: false)")
    if es.enabled and es.side_stream:
        _require_no_baseline(config, "early_select.side_stream", "ES-CIS", "set early_select.side_stream: false")
        _require_budget(config, "local", 1, "with early_select.side_stream: the side stream reads the middle while "
                        "the current token's key is written")
    largest = config.with_topk(b.topk_max) if b.topk_max is not None else config  # the cap's k, where one is set
    index_set = largest._index_set(largest._dilation_topm())
    if index_set > MAX_INDEX_SET:
        raise ConfigError(
            f"budget: the index set (budget.sink + budget.local + budget.topk + 2 * cis.dilation_radius * "
            f"dilation_topm, + cis.block_size - 1 with cis.keep_anchor_local) is {index_set}; allowed up to {MAX_INDEX_SET}")
    if cis.enabled and cis.block_size * index_set > MAX_CIS_STATE:
        raise ConfigError(
            f"cis.block_size: {cis.block_size} is too large for this budget: block_size × index set = "
            f"{cis.block_size} × {index_set} = {cis.block_size * index_set} anchor indices per head; "
            f"allowed up to {MAX_CIS_STATE} (lower cis.block_size or the budget)")


_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """The folder of the shipped data files ``name`` (``"configs"`` or ``"tasks"``).

    A wheel installs the repository's ``configs/`` and ``tasks/`` as ``prhs_hf/configs`` and
    ``prhs_hf/tasks`` (``pyproject.toml`` maps them there); a checkout (editable install or
    ``PYTHONPATH``) keeps them at the repository root, beside ``prhs_hf/``. The package folder
    wins; where neither exists that is the path returned, so that errors name it.
    """
    inside = _PACKAGE / name
    checkout = _PACKAGE.parent / name
    if not inside.is_dir() and checkout.is_dir() and (_PACKAGE.parent / "pyproject.toml").is_file():
        return checkout
    return inside


def shipped_configs() -> list[str]:
    """The names of the shipped configs (``cis``, ``cpe``, ...), sorted."""
    return sorted(p.stem for p in shipped_dir("configs").glob("*.yaml"))


class _MissingConfigFile(ConfigError, FileNotFoundError):
    """A config path that does not exist (a :class:`ConfigError` and a :class:`FileNotFoundError`)."""


def _shipped_text() -> str:
    return f"shipped configs: {', '.join(shipped_configs())} (in {shipped_dir('configs')})"


def resolve_config_path(source: "str | Path") -> Path:
    """The file a config source names: a bare name (``"cpe"``: no folder, no ``.yaml``) is the
    shipped config of that name; anything else is a path, which must exist.

    Raises :class:`ConfigError` (also a :class:`FileNotFoundError`) saying "no such file" otherwise,
    and :class:`ConfigError` saying "is a directory" for a directory that is not a shipped name.
    """
    text = str(source)
    given = Path(source)
    bare = isinstance(source, str) and bool(text) and "/" not in text and "\\" not in text \
        and given.suffix not in (".yaml", ".yml") and text not in (".", "..")
    if bare:
        candidate = shipped_dir("configs") / f"{text}.yaml"
        if candidate.is_file():
            return candidate
    if text and given.is_dir():
        raise ConfigError(f"{text}: is a directory; a PrHS config is a YAML file or a shipped config name; "
                          f"{_shipped_text()}")
    if bare:
        raise _MissingConfigFile(f"{text}: no such file, and not a shipped config; {_shipped_text()}")
    if not given.is_file():
        hint = f"; shipped configs are named bare, e.g. {given.stem!r}" if given.stem in shipped_configs() else ""
        raise _MissingConfigFile(f"{text}: no such file (a PrHS config path must exist){hint}")
    return given


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` may be overridden: not a duplicate
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first.start_mark.line + 1}); "
                                f"a key may appear once per mapping", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Mapping[str, Any]:
    """The mapping of sections in the YAML file ``path``; :class:`ConfigError` naming the file (and
    line) if it is not UTF-8 text, not YAML, repeats a key in a mapping or holds anything but a
    mapping (empty, a comment, ``0``, ``[]``, ...)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          f"a PrHS config must be UTF-8 text") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = " ".join(str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from exc
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else f"{type(data).__name__} {data!r}"
        raise ConfigError(f"{path}: a PrHS config must be a YAML mapping of sections ({', '.join(_SECTIONS)}), "
                          f"got {got}")
    return data


def _paths_relative_to(folder: Path, data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` with each relative file path of a ``"path"`` key (``baseline.label_channels``) taken
    relative to ``folder``, the YAML file's own: a config and the file it names travel together."""
    out = dict(data)
    for key, rule in _RULES.items():
        section, name = key.split(".")
        value = out.get(section, {}).get(name) if isinstance(out.get(section), Mapping) else None
        if rule[0] == "path" and isinstance(value, str) and value.strip() and not Path(value).expanduser().is_absolute():
            out[section] = {**out[section], name: str(folder / value)}
    return out


def load_config(
    source: "str | Path | Mapping[str, Any] | PrHSConfig | None" = None,
    overrides: Mapping[str, Any] | None = None,
) -> PrHSConfig:
    """Read a config from a shipped name, a YAML path, a dict or a :class:`PrHSConfig`, then apply ``overrides``.

    A bare name (``"cis"``, ``"cpe"``) is a shipped config; any other string or :class:`~pathlib.Path`
    is a YAML file that must exist (a relative ``baseline.label_channels`` in it is relative to the
    file's folder; given in a dict or in ``overrides``, to the working directory). ``overrides`` is a nested mapping in the same schema, e.g.
    ``{"telemetry": {"enabled": True}}``; anything else (a string such as ``"cis.tau=0.7"``) raises
    :class:`ConfigError`. Sections left out of both are off (see the module docstring).
    """
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a mapping of sections in the config schema, e.g. "
                          f"{{'cis': {{'tau': 0.7}}}}, got {type(overrides).__name__} {overrides!r}")
    if isinstance(source, PrHSConfig):
        data = source.to_dict()
    elif isinstance(source, (str, Path)):
        path = resolve_config_path(source)
        data = _paths_relative_to(path.parent, _read_yaml(path))
    elif source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        raise ConfigError(f"a PrHS config is a shipped name, a YAML path, a dict or a PrHSConfig, not {type(source).__name__}")
    if overrides:
        data = _merge(data, overrides)
        _check_overrides_take_effect(data, overrides)
    return config_from_dict(data)


#: the key that turns each switchable section on, the value that leaves it off, and its value where a
#: section that is present leaves it out (see the module docstring)
_SWITCHES = {"cis": ("enabled", False, True), "psaw": ("enabled", False, True), "etf": ("enabled", False, True),
             "telemetry": ("enabled", False, False), "early_select": ("enabled", False, True),
             "baseline": ("name", None, None)}


def _check_overrides_take_effect(merged: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """Refuse an override that sets keys of a section the config leaves off (``psaw: {phi: 0.5}`` on
    ``cis``, whose ``psaw.enabled`` is false; ``baseline.page_size`` with no ``baseline.name``): it
    would change nothing. An override that sets the switch itself is taken as it is."""
    for name, section in overrides.items():
        if name not in _SWITCHES or not isinstance(section, Mapping) or not section:
            continue
        switch, off, unset = _SWITCHES[name]
        state = merged.get(name)
        if switch in section or not isinstance(state, Mapping) or state.get(switch, unset) is not off:
            continue
        key = next(iter(section))
        turn_on = (f"set {name}.name too (one of {', '.join(BASELINES)})" if switch == "name"
                   else f"add {name}.enabled: true to turn {name} on")
        raise ConfigError(f"{name}.{key}: the config leaves {name} off ({name}.{switch}: "
                          f"{'null' if off is None else 'false'}), so this override would change nothing; {turn_on}")
