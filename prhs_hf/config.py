"""The PrHS configuration: one YAML file (or dict) drives CIS, PSAW, ETF, backends and telemetry.

The schema is SPEC.md §1: the key names are the user interface and never change. ``null`` means
"the paper's default for this model" and is resolved against the model's layer count by
:meth:`PrHSConfig.resolve`. Every problem (unknown key, wrong type, out-of-range value) raises
:class:`ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = [
    "ConfigError",
    "BudgetConfig",
    "CISConfig",
    "PSAWConfig",
    "ETFConfig",
    "BackendConfig",
    "TelemetryConfig",
    "BaselineConfig",
    "BASELINES",
    "PrHSConfig",
    "ResolvedConfig",
    "load_config",
    "resolve_config_path",
]

PHASES = ("prefill", "decode")
PREFILL_BACKENDS = ("auto", "torch", "triton", "flex")
DECODE_BACKENDS = ("auto", "torch", "triton")


class ConfigError(ValueError):
    """A PrHS config value is unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class BudgetConfig:
    """Token budget of a sparse decode step: sinks, recent (local) tokens and top-k middle tokens."""

    sink: int = 8
    local: int = 32
    topk: int = 88


@dataclass(frozen=True)
class CISConfig:
    """Clustered Index Sharing (SPEC §4)."""

    enabled: bool = True
    block_size: int = 16
    tau: float = 0.8
    dilation_topm: int | None = None  # None: floor(topk / 3)
    dilation_radius: int = 1


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


@dataclass(frozen=True)
class TelemetryConfig:
    """Statistics of SPEC §5; off by default and free when off."""

    enabled: bool = False
    oracle: bool = False


BASELINES = ("oracle", "streaming", "h2o", "quest", "hshare", "direct_reuse", "random_expansion")


@dataclass(frozen=True)
class BaselineConfig:
    """A comparison selector (SPEC §6) that replaces CIS in decode, with the same budget.

    ``name: null`` (the default) means no baseline: CIS (or dense) decides. ``page_size`` is
    Quest's page; ``share_ratio``, ``head_share_ratio`` and ``layer_share_ratio`` are HShare's
    query-, head- and layer-level sharing ratios (the fraction of decode steps, of a layer's heads
    and of the layers that reuse indices instead of retrieving; each in [0, 1)); ``seed`` seeds
    RandomExpansion.
    """

    name: str | None = None
    page_size: int = 16
    share_ratio: float = 0.875
    head_share_ratio: float = 0.5
    layer_share_ratio: float = 0.5
    seed: int = 0


@dataclass(frozen=True)
class PrHSConfig:
    """A whole PrHS configuration, as read from YAML (``null`` values still unresolved)."""

    budget: BudgetConfig = field(default_factory=BudgetConfig)
    cis: CISConfig = field(default_factory=CISConfig)
    psaw: PSAWConfig = field(default_factory=PSAWConfig)
    etf: ETFConfig = field(default_factory=ETFConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (YAML-serialisable)."""
        out = dataclasses.asdict(self)
        out["psaw"]["phases"] = list(self.psaw.phases)
        return out

    def resolve(self, num_layers: int) -> "ResolvedConfig":
        """Fill the ``null`` defaults for a model with ``num_layers`` decoder layers and check layer ranges."""
        if num_layers < 1:
            raise ConfigError(f"the model has {num_layers} decoder layers; PrHS needs at least 1")
        half = num_layers // 2
        psaw_start = half if self.psaw.start_layer is None else self.psaw.start_layer
        etf_start = half if self.etf.start_layer is None else self.etf.start_layer
        for key, value in (("psaw.start_layer", psaw_start), ("etf.start_layer", etf_start)):
            if not 0 <= value < num_layers:
                raise ConfigError(f"{key}: {value} is out of range; allowed 0 <= {key} < {num_layers} (the model's layers)")
        topm = self.budget.topk // 3 if self.cis.dilation_topm is None else self.cis.dilation_topm
        return ResolvedConfig(self, num_layers, psaw_start, etf_start, topm)


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
        return self.budget_total + 2 * self.config.cis.dilation_radius * self.dilation_topm


# --------------------------------------------------------------------------- parsing

_SECTIONS: dict[str, type] = {
    "budget": BudgetConfig,
    "cis": CISConfig,
    "psaw": PSAWConfig,
    "etf": ETFConfig,
    "backend": BackendConfig,
    "telemetry": TelemetryConfig,
    "baseline": BaselineConfig,
}

# key -> (kind, lower, upper, lower_open, nullable[, upper_open]); kind in {"int", "float", "bool", "choice", "phases"}
_RULES: dict[str, tuple] = {
    "budget.sink": ("int", 0, None, False, False),
    "budget.local": ("int", 0, None, False, False),
    "budget.topk": ("int", 1, None, False, False),
    "cis.enabled": ("bool",),
    "cis.block_size": ("int", 1, None, False, False),
    "cis.tau": ("float", -1.0, None, False, False),
    "cis.dilation_topm": ("int", 0, None, False, True),
    "cis.dilation_radius": ("int", 0, None, False, False),
    "psaw.enabled": ("bool",),
    "psaw.phases": ("phases",),
    "psaw.start_layer": ("int", 0, None, False, True),
    "psaw.phi": ("float", 0.0, 1.0, True, False),
    "psaw.alpha": ("float", 0.0, None, False, False),
    "etf.enabled": ("bool",),
    "etf.start_layer": ("int", 0, None, False, True),
    "etf.psi": ("float", 0.0, 1.0, True, False),
    "etf.gamma": ("float", 0.0, None, False, False),
    "backend.prefill": ("choice", PREFILL_BACKENDS),
    "backend.decode": ("choice", DECODE_BACKENDS),
    "telemetry.enabled": ("bool",),
    "telemetry.oracle": ("bool",),
    "baseline.name": ("choice", (None, *BASELINES)),
    "baseline.page_size": ("int", 1, None, False, False),
    "baseline.share_ratio": ("float", 0.0, 1.0, False, False, True),
    "baseline.head_share_ratio": ("float", 0.0, 1.0, False, False, True),
    "baseline.layer_share_ratio": ("float", 0.0, 1.0, False, False, True),
    "baseline.seed": ("int", 0, None, False, False),
}


def _range_text(lower, upper, lower_open, upper_open=False) -> str:
    left = "(" if lower_open else "["
    right = "]" if upper is not None and not upper_open else ")"
    return f"{left}{lower}, {upper if upper is not None else 'inf'}{right}"


def _check_value(key: str, value: Any) -> Any:
    rule = _RULES[key]
    kind = rule[0]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if kind == "choice":
        if value not in rule[1]:
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {', '.join(map(str, rule[1]))}")
        return value
    if kind == "phases":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or any(v not in PHASES for v in value):
            raise ConfigError(f"{key}: expected a list drawn from {list(PHASES)}, got {value!r}")
        return tuple(dict.fromkeys(value))
    _, lower, upper, lower_open, nullable, *rest = rule
    upper_open = bool(rest and rest[0])
    allowed = _range_text(lower, upper, lower_open, upper_open)
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{key}: null is not allowed; expected a {kind} in {allowed}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a {kind}{' or null' if nullable else ''}, got {value!r}")
    if kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{key}: expected an integer, got {value!r}")
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    too_low = value <= lower if lower_open else value < lower
    too_high = upper is not None and (value >= upper if upper_open else value > upper)
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


def config_from_dict(data: Mapping[str, Any]) -> PrHSConfig:
    """Validate plain data against the schema and build a :class:`PrHSConfig`."""
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
    topm = config.cis.dilation_topm
    if topm is not None and topm > config.budget.topk:
        raise ConfigError(f"cis.dilation_topm: {topm} is out of range; allowed [0, budget.topk={config.budget.topk}]")
    return config


SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def resolve_config_path(source: "str | Path") -> Path:
    """A config path as given if it exists, else the shipped config of that name (``cpe`` or ``configs/cpe.yaml``)."""
    given = Path(source)
    if given.is_file() or given.is_absolute():
        return given
    name = given.name if given.suffix in (".yaml", ".yml") else f"{given.name}.yaml"
    candidate = SHIPPED_CONFIGS / name
    return candidate if candidate.is_file() else given


def load_config(
    source: "str | Path | Mapping[str, Any] | PrHSConfig | None" = None,
    overrides: Mapping[str, Any] | None = None,
) -> PrHSConfig:
    """Read a config from a YAML path, a dict or a :class:`PrHSConfig`, then apply ``overrides``.

    ``overrides`` is a nested dict in the same schema, e.g. ``{"telemetry": {"enabled": True}}``.
    """
    if isinstance(source, PrHSConfig):
        data = source.to_dict()
    elif isinstance(source, (str, Path)):
        path = resolve_config_path(source)
        if not path.is_file():
            raise FileNotFoundError(f"PrHS config file not found: {path}")
        with path.open() as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: a PrHS config must be a YAML mapping of sections")
    elif source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        raise ConfigError(f"a PrHS config is a YAML path, a dict or a PrHSConfig, not {type(source).__name__}")
    if overrides:
        data = _merge(data, overrides)
    return config_from_dict(data)
