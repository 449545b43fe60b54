"""The named PrHS configurations of the accuracy table (paper Table II) and how to load them.

Each is a shipped config of ``configs/`` by its bare name (``cis``, ``cpe``: found from any working
directory and in an installed wheel) plus overrides in the config schema. ``cis-s{8,16,20}`` sweep
the CIS block size s; ``cis*`` is CIS with a smaller top-k (72, so a lower ρ̂); ``cis-t0.6`` and
``cis-t0.7`` lower the similarity threshold τ (s = 16) so that more queries share their anchor's
indices (on Qwen2.5-Coder-1.5B the paper's τ = 0.8 retrieves at ρ̂ ≈ 20 % on zero-shot GSM8K, above
the 10 % the accuracy target is stated at). ``cis-t0.7-local`` adds ``cis.keep_anchor_local`` (the
tokens that aged out of the local window since the anchor was taken, which it never scored);
``cis-t0.7-local-r2`` also widens the dilation to ±2 (chosen on calibration text, not on an evaluation
set: ``docs/results/selection_quality_low_rho_qwen0.5b.md``, where it matches CIS-main's β_emp at ρ̂ 10 %;
shipped as ``cis_low_rho.yaml``);
``cis-group`` and ``cis-group-t0.7-local`` use ``cis.selection: group`` (one index set per KV head,
shared by its query heads), ``cis-group-mean`` its mean-score ranking (``group_mean``). ``cis-union`` is
``cis`` with ``backend.sparse_attention: group_union`` (the per-head sets, each KV group's union of them
read once: the same output, so not a default row). ``cis-tail`` is ``cis-s16`` with ``cis.tail_slot`` (one slot of the
top-k holds a synthetic key/value for what the index set leaves out, CertKV's tail-summary slot).
``cis-lb`` is ``cis_longbench.yaml``: CIS alone (s = 16, τ = 0.8) at the paper's long-context budget,
the one of ``cpe_longbench.yaml`` (64 sink + 256 local + 4096 top-k: LongBench), where every other CIS
row keeps the GSM8K/CoQA budget of 128 tokens also on 32k-token prompts.
``cpe-lb`` is ``cpe_longbench.yaml`` (the paper's PSAW/ETF defaults at that budget); ``cpe-cal-lb`` the
same budget with the schedule ``prhs-hf calibrate`` chose for Qwen2.5-Coder-1.5B at a 5 % dropped-mass
target (PSAW from layer 7, φ 0.9; ETF from layer 25, ψ 0.95:
``docs/results/cpe_calibrated_qwen2.5-coder-1.5b_t0.05.yaml``, calibrated on Python stdlib text; at 1 %
no schedule passes and the calibrated config is CIS alone, ``cis-lb``).
``cpe-no-etf`` and ``cpe-no-psaw`` are the ablations of
CPE (CIS + PSAW, CIS + ETF). The baselines replace CIS in decode with the same
8/32/88 budget through ``baseline.name``. HShare appears at the paper's two settings of (query,
head, layer) sharing ratios: ``hshare-1`` (1/2, 1/4, 1/4: ρ̂ = 1/2 · 3/4 · 3/4 ≈ 28.1 %) and
``hshare-2`` (1/2, 1/2, 1/2: ρ̂ = 12.5 %), as ``baseline.share_ratio`` / ``head_share_ratio`` /
``layer_share_ratio``. EarlySelectKV (``early_select``) appears on Quest and on CIS (s = 16, τ = 0.8):
``es-quest`` and ``es-cis`` (the mid tap, layer ℓ+1's exact ``W_q``), ``es-cis-early`` (the early tap)
and ``es-quest-r256`` / ``es-cis-r256`` (the mid tap through a rank-256 SVD of ``W_q``). ``hshare-1-lb``,
``cis-fp8``, ``cis-fp8-m512``, ``cis-int4`` and ``cis-pages`` are ``cis-s16`` retrieving through a key index
(``cis.index``; ``-m512``: ``cis.rerank_margin`` 512).
``quest-lb`` … ``es-cis-lb``, ``cis-tail-lb``, ``cis-group-lb``, ``cis-union-lb``, ``cis-fp8-lb`` …
(:data:`LONG_CONTEXT_BASELINES`) are those
baselines, seed selectors and CIS variants at ``cis-lb``'s long-context budget, for the RULER table; ``ds-cal-lb`` is Double Sparsity
with the label channels calibrated for Qwen2.5-Coder-1.5B (``ds_qwen2.5-coder-1.5b.yaml``) at that budget. Anything else given as a name is a YAML path.

The frontier candidates of issue 54 (:data:`FRONTIER_CONFIGS`), all ``cis_longbench.yaml`` (sink 64, window
256, s = 16, τ 0.8, ±1 dilation of the best floor(k/3)) with a smaller or context-relative top-k, named
``cis-<sets>-<budget>[-fp8]``: ``<sets>`` is ``group`` (``cis.selection: group``, one set per KV head) or
``head`` (a set per query head); ``<budget>`` is ``8k`` / ``2k`` / ``1k`` (``budget.topk`` 8,192 / 2,048 / 1,024) or
``f8`` / ``f16`` (``budget.topk_fraction`` 1/8 / 1/16 of the prompt, floor 1,024, cap 8,192); ``-fp8`` adds
the fp8 key index (``cis.index: fp8``, the shipped margin 128; with group sets its codes are not centred,
which a group's largest score cannot use: docs/notes/key_index.md; ``f8``/``f16`` then cap k at 8,064, as
the re-rank takes at most 8,192 candidates, k + margin). The k 4,096 ones are ``cis-lb``,
``cis-group-lb``, ``cis-fp8-lb`` and ``cis-group-fp8-lb``.

These names are what the result files (``docs/results/accuracy*.json``, ``ruler_*.json``) call their
rows, and :func:`load_any_config` loads them wherever a config is given by name: ``prhs-hf generate
--config``, ``prhs-hf bench --configs`` and lm-eval's ``prhs_config``, beside the shipped configs
and YAML paths. (``scripts/bench_e2e_decode.py`` labels its timing rows with names of its own,
such as ``cpe-s16-share``; each of its result files maps them to a base YAML and overrides under
``"configs"``.)
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import prhs_hf
from prhs_hf.config import MAX_RERANK_TOKENS

__all__ = ["NamedConfig", "ACCURACY_CONFIGS", "DEFAULT_CONFIGS", "FRONTIER_CONFIGS", "KEY_INDEX_CONFIGS",
           "LONG_CONTEXT_BASELINES", "ACCURACY_POLICIES", "with_policy", "named_config", "load_named_config",
           "load_any_config", "known_config_names", "unknown_config_message"]


@dataclass(frozen=True)
class NamedConfig:
    """A row label of the table: a base YAML and overrides (telemetry is always switched on)."""

    name: str
    base: str
    overrides: Mapping[str, Any] = field(default_factory=dict)


ACCURACY_CONFIGS: dict[str, NamedConfig] = {
    c.name: c
    for c in (
        NamedConfig("dense", "dense"),
        NamedConfig("cis-s8", "cis", {"cis": {"block_size": 8}}),
        NamedConfig("cis-s16", "cis", {"cis": {"block_size": 16}}),
        NamedConfig("cis-s20", "cis", {"cis": {"block_size": 20}}),
        NamedConfig("cis*", "cis", {"budget": {"topk": 72}}),
        NamedConfig("cis-t0.6", "cis", {"cis": {"block_size": 16, "tau": 0.6}}),
        NamedConfig("cis-t0.7", "cis", {"cis": {"block_size": 16, "tau": 0.7}}),
        NamedConfig("cis-t0.7-local", "cis", {"cis": {"block_size": 16, "tau": 0.7, "keep_anchor_local": True}}),
        NamedConfig("cis-t0.7-local-r2", "cis_low_rho"),
        NamedConfig("cis-group", "cis", {"cis": {"block_size": 16, "selection": "group"}}),
        NamedConfig("cis-group-mean", "cis", {"cis": {"block_size": 16, "selection": "group_mean"}}),
        NamedConfig("cis-tail", "cis", {"cis": {"block_size": 16, "tail_slot": True}}),
        NamedConfig("cis-group-t0.7-local", "cis", {"cis": {
            "block_size": 16, "tau": 0.7, "selection": "group", "keep_anchor_local": True}}),
        NamedConfig("cis-lb", "cis_longbench"),
        NamedConfig("cpe", "cpe"),
        NamedConfig("cpe-lb", "cpe_longbench"),
        NamedConfig("cpe-cal-lb", "cpe_longbench", {
            "psaw": {"start_layer": 7, "phi": 0.9}, "etf": {"start_layer": 25, "psi": 0.95}}),
        NamedConfig("cpe-no-etf", "cpe", {"etf": {"enabled": False}}),
        NamedConfig("cpe-no-psaw", "cpe", {"psaw": {"enabled": False}}),
        NamedConfig("hshare-1", "cis", {"baseline": {
            "name": "hshare", "share_ratio": 0.5, "head_share_ratio": 0.25, "layer_share_ratio": 0.25}}),
        NamedConfig("hshare-2", "cis", {"baseline": {
            "name": "hshare", "share_ratio": 0.5, "head_share_ratio": 0.5, "layer_share_ratio": 0.5}}),
        NamedConfig("quest", "cis", {"baseline": {"name": "quest"}}),
        NamedConfig("ds", "cis", {"baseline": {"name": "double_sparsity"}}),
        NamedConfig("streaming", "cis", {"baseline": {"name": "streaming"}}),
        NamedConfig("h2o", "cis", {"baseline": {"name": "h2o"}}),
        NamedConfig("certkv", "cis", {"baseline": {"name": "certkv"}}),
        NamedConfig("es-quest", "cis", {"baseline": {"name": "quest"}, "early_select": {"tap": "mid"}}),
        NamedConfig("es-quest-r256", "cis", {"baseline": {"name": "quest"}, "early_select": {"tap": "mid", "rank": 256}}),
        NamedConfig("es-cis", "cis", {"early_select": {"tap": "mid"}}),
        NamedConfig("es-cis-early", "cis", {"early_select": {"tap": "early"}}),
        NamedConfig("es-cis-r256", "cis", {"early_select": {"tap": "mid", "rank": 256}}),
    )
}

DEFAULT_CONFIGS = tuple(ACCURACY_CONFIGS)

#: ``cis-s16`` reading each KV group's union of its heads' index sets once (backend.sparse_attention:
#: group_union): a speed variant with per-head attention's output, so its accuracy is ``cis-s16``'s and it
#: is not one of the :data:`DEFAULT_CONFIGS`
ACCURACY_CONFIGS["cis-union"] = NamedConfig("cis-union", "cis", {"backend": {"sparse_attention": "group_union"}})
#: ``cis-s16`` retrieving through a key index (``cis.index``: ``docs/notes/key_index.md``), with the shipped
#: re-rank margin or (``-m512``) the one at which fp8 returned >= 0.99 of the exact top-k on
#: Qwen2.5-Coder-1.5B at 4k-8k tokens before its codes were centred (centred, 128 returns 1.000 there):
#: the candidates of issue 38 for the speed map and the accuracy runs
#: (``prhs-hf bench --configs cis,cis-fp8``). Not :data:`DEFAULT_CONFIGS`: the index is off by default.
KEY_INDEX_CONFIGS = {"cis-fp8": {"index": "fp8"}, "cis-fp8-m512": {"index": "fp8", "rerank_margin": 512},
                     "cis-int4": {"index": "int4"}, "cis-pages": {"index": "pages"}}
ACCURACY_CONFIGS.update(
    (name, NamedConfig(name, "cis", {"cis": {"block_size": 16, **index}})) for name, index in KEY_INDEX_CONFIGS.items())

#: The baselines, the seed selectors and the CIS variants at the long-context budget of ``cis-lb`` (64 sink +
#: 256 local + 4096 top-k), for the RULER table and the speed map: ``<name>-lb`` is ``<name>`` on
#: ``cis_longbench.yaml`` (``cis-group-lb``: one index set per KV head, a candidate default whose sets
#: read a KV group's keys once; ``cis-union-lb``: the shipped default's per-head sets, each KV group's
#: union of them read once, for the speed map). Not in
#: :data:`DEFAULT_CONFIGS`: below 4,417 tokens (GSM8K, CoQA) they attend to every key.
LONG_CONTEXT_BASELINES = ("hshare-1", "hshare-2", "quest", "streaming", "h2o", "certkv",
                          "es-quest", "es-cis", "cis-tail", "cis-group", "cis-union", *KEY_INDEX_CONFIGS)
ACCURACY_CONFIGS.update(
    (f"{name}-lb", NamedConfig(f"{name}-lb", "cis_longbench", ACCURACY_CONFIGS[name].overrides))
    for name in LONG_CONTEXT_BASELINES)
#: Double Sparsity with the label channels calibrated offline for Qwen2.5-Coder-1.5B-Instruct
#: (``configs/ds_qwen2.5-coder-1.5b.yaml``, the accuracy table's DS row) at ``cis-lb``'s budget.
ACCURACY_CONFIGS["ds-cal-lb"] = NamedConfig("ds-cal-lb", "ds_qwen2.5-coder-1.5b", {
    "budget": {"sink": 64, "local": 256, "topk": 4096}})

#: Issue 54's frontier candidates on ``cis_longbench.yaml`` (module docstring: ``cis-<sets>-<budget>[-fp8]``),
#: for the RULER table and the speed map; the sets' selection and the budget of each, the ``-fp8`` twins
#: added below. Not :data:`DEFAULT_CONFIGS`: below their budget (1,344 tokens and up) they attend to every key.
_RELATIVE = {"topk": 1024, "topk_max": 8192}
_FRONTIER_SHAPES = {
    "cis-group-8k": ("group", {"topk": 8192}),
    "cis-group-2k": ("group", {"topk": 2048}),
    "cis-group-1k": ("group", {"topk": 1024}),
    "cis-head-2k": ("head", {"topk": 2048}),
    "cis-head-1k": ("head", {"topk": 1024}),
    "cis-group-f8": ("group", {**_RELATIVE, "topk_fraction": 1 / 8}),
    "cis-group-f16": ("group", {**_RELATIVE, "topk_fraction": 1 / 16}),
}
FRONTIER_CONFIGS: dict[str, NamedConfig] = {}
for _name, (_selection, _budget) in _FRONTIER_SHAPES.items():
    FRONTIER_CONFIGS[_name] = NamedConfig(_name, "cis_longbench", {"budget": _budget, "cis": {"selection": _selection}})
    # the index re-ranks at most MAX_RERANK_TOKENS candidates, k + the margin (128): a cap of 8,064, and
    # no fp8 twin for a fixed k above it (cis-group-8k)
    if _budget.get("topk", 0) + 128 > MAX_RERANK_TOKENS:
        continue
    _indexed = {**_budget, "topk_max": MAX_RERANK_TOKENS - 128} if "topk_max" in _budget else _budget
    FRONTIER_CONFIGS[f"{_name}-fp8"] = NamedConfig(f"{_name}-fp8", "cis_longbench", {
        "budget": _indexed, "cis": {"selection": _selection, "index": "fp8"}})
FRONTIER_CONFIGS["cis-group-fp8-lb"] = NamedConfig("cis-group-fp8-lb", "cis_longbench", {
    "cis": {"selection": "group", "index": "fp8"}})
ACCURACY_CONFIGS.update(FRONTIER_CONFIGS)


def named_config(name: str) -> NamedConfig:
    """The registered config ``name``, a shipped config by its name, or a YAML path taken as a config
    of its own (named by its stem)."""
    from prhs_hf.config import shipped_configs

    if name in ACCURACY_CONFIGS:
        return ACCURACY_CONFIGS[name]
    if name in shipped_configs():
        return NamedConfig(name, name)
    if name.endswith((".yaml", ".yml")):
        return NamedConfig(Path(name).stem, name)
    raise ValueError(unknown_config_message(name))


#: What ``scripts/run_accuracy.py --policy`` takes: ``sparse`` (every forward of a sparse config runs
#: sparse, whatever the cost model of the machine would pick: the accuracy of the method), ``auto`` or
#: ``dense``, or ``config`` (each config's own ``policy`` section).
ACCURACY_POLICIES = ("sparse", "auto", "dense", "config")


def with_policy(config: NamedConfig, policy: str) -> NamedConfig:
    """``config`` with ``policy.decode`` and ``policy.prefill`` set to ``policy`` (one of
    :data:`ACCURACY_POLICIES`; ``config`` returns it unchanged). The row keeps its name: its
    ``prhs_config`` records the policy it ran with."""
    if policy not in ACCURACY_POLICIES:
        raise ValueError(f"policy {policy!r}: allowed {', '.join(ACCURACY_POLICIES)}")
    if policy == "config":
        return config
    overrides = {**config.overrides, "policy": {**config.overrides.get("policy", {}),
                                                "decode": policy, "prefill": policy}}
    return dataclasses.replace(config, overrides=overrides)


def load_named_config(config: NamedConfig) -> prhs_hf.PrHSConfig:
    """The validated config of ``config`` with telemetry on."""
    overrides = dict(config.overrides)
    overrides["telemetry"] = {**overrides.get("telemetry", {}), "enabled": True}
    return prhs_hf.load_config(config.base, overrides)


def known_config_names() -> str:
    """The config names :func:`load_any_config` takes, as an error message or a help text lists them."""
    from prhs_hf.config import shipped_configs

    return (f"shipped configs: {', '.join(shipped_configs())}; named configs of the result tables: "
            f"{', '.join(ACCURACY_CONFIGS)}")


def unknown_config_message(name: str) -> str:
    """Why ``name`` is no config: the closest known name first, if one is close (then the named configs
    of the result tables are counted, not listed), else every name."""
    from prhs_hf.config import shipped_configs
    from prhs_hf.hub.registry import did_you_mean

    hint = did_you_mean(name, [*shipped_configs(), *ACCURACY_CONFIGS])
    names = (f"shipped configs: {', '.join(shipped_configs())}; {len(ACCURACY_CONFIGS)} named configs of the "
             f"result tables (cis-s16, cis-lb, ...: `prhs-hf lm-eval --help` lists them)") if hint else (
        f"{known_config_names()} (the timing labels of scripts/bench_e2e_decode.py, such as cpe-s16-share, are "
        f"that script's own: its result files give each one's base YAML and overrides)")
    return f"unknown config {name!r}: not a config name and no such file; {hint}{names}; or a YAML path"


def load_any_config(name: "str | Path", overrides: Mapping[str, Any] | None = None) -> prhs_hf.PrHSConfig:
    """The config ``name`` plus ``overrides``: a named config of the result tables
    (:data:`ACCURACY_CONFIGS`, e.g. ``cis-s16``, ``cis-lb``), a shipped config (``cis``,
    ``cis_longbench``) or a YAML path. Telemetry stays as the config and ``overrides`` set it.

    Raises:
        prhs_hf.ConfigError: a bare name that is none of these (the message lists the names), or
            a config or override that does not validate.
    """
    from prhs_hf.config import ConfigError, shipped_configs

    text = str(name)
    if text in ACCURACY_CONFIGS:
        named = ACCURACY_CONFIGS[text]
        config = prhs_hf.load_config(named.base, named.overrides)
        return prhs_hf.load_config(config, overrides) if overrides else config
    bare = isinstance(name, str) and "/" not in text and "\\" not in text and Path(text).suffix not in (".yaml", ".yml")
    if bare and text not in shipped_configs() and not Path(text).is_file():
        raise ConfigError(unknown_config_message(text))
    return prhs_hf.load_config(name, overrides)
