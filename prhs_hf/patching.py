"""``patch(model, config)`` / ``unpatch(model)``: switch a Hugging Face model to PrHS and back.

Patching selects the ``"prhs"`` attention implementation (registered with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``), attaches a :class:`~prhs_hf.layer.PrHSLayer`
to every attention module, adds one forward pre-hook per decoder layer (the PSAW/ETF prefill
plan), wraps ``q_proj``/``o_proj``/``mlp`` of ETF layers so frozen rows are not computed, and
lets beam search reorder the CIS state. Unpatching removes all of it and restores the original
attention implementation; patching twice replaces the first patch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from transformers import DynamicCache, StaticCache

from . import attention
from .config import PrHSConfig, load_config
from .families import check_model, decoder_layers
from .row_skip import install_row_skip, remove_row_skip
from .runtime import PrHSRuntime
from .stats import TelemetryReport

__all__ = ["PatchHandle", "patch", "unpatch", "is_patched", "telemetry", "reset"]

SUPPORTED_CACHES = (DynamicCache, StaticCache)
_RUNTIME = "_prhs_runtime"


class PatchHandle:
    """What :func:`patch` returns: the runtime, and a context manager that unpatches on exit."""

    def __init__(self, model: nn.Module, runtime: PrHSRuntime):
        self.model = model
        self.runtime = runtime

    @property
    def config(self) -> PrHSConfig:
        return self.runtime.resolved.config

    def telemetry(self) -> TelemetryReport:
        return telemetry(self.model)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        unpatch(self.model)


def _check_cache(cache: Any) -> None:
    if cache is not None and not isinstance(cache, SUPPORTED_CACHES):
        names = ", ".join(c.__name__ for c in SUPPORTED_CACHES)
        raise TypeError(f"PrHS supports the caches {names}; got {type(cache).__name__}")


def _make_pre_hook(layer, first: bool):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if first:
            _check_cache(kwargs.get("past_key_values"))
            if hidden.shape[1] > 1:
                layer.runtime.prepare(hidden.device, hidden.shape[0])
            mask = kwargs.get("attention_mask")
            # the padding layout is fixed at prefill: check it there (it synchronises), not per decode step
            if mask is not None and hidden.shape[1] > 1 and not torch.compiler.is_compiling():
                from .geometry import geometry_from_mask

                geometry_from_mask(mask, hidden.shape[0], hidden.shape[1], mask.shape[-1], hidden.device, check=True)
        layer.plan_prefill(hidden, kwargs)

    return hook


def patch(
    model: nn.Module,
    config: "str | Path | Mapping[str, Any] | PrHSConfig | None" = None,
    overrides: Mapping[str, Any] | None = None,
) -> PatchHandle:
    """Make ``model`` run PrHS as ``config`` (YAML path, dict or :class:`PrHSConfig`) says.

    Supported: the families in :data:`prhs_hf.families.SUPPORTED_FAMILIES`, fp16/bf16/fp32,
    ``DynamicCache`` and ``StaticCache``. Returns a :class:`PatchHandle` (a context manager).
    """
    cfg = load_config(config, overrides)
    check_model(model)
    if is_patched(model):
        unpatch(model)
    layers = decoder_layers(model)
    resolved = cfg.resolve(len(layers))
    attention.register()
    runtime = PrHSRuntime(resolved, model.config.num_attention_heads, layers[0].self_attn.head_dim)
    runtime.original_attn_implementation = model.config._attn_implementation
    runtime.hooks = []
    runtime.wrapped = []
    for index, (decoder_layer, prhs_layer) in enumerate(zip(layers, runtime.layers)):
        decoder_layer.self_attn._prhs_layer = prhs_layer
        runtime.hooks.append(
            decoder_layer.register_forward_pre_hook(_make_pre_hook(prhs_layer, index == 0), with_kwargs=True)
        )
        if prhs_layer.etf:
            for module in (decoder_layer.self_attn.q_proj, decoder_layer.self_attn.o_proj, decoder_layer.mlp):
                install_row_skip(module, prhs_layer.active_rows)
                runtime.wrapped.append(module)
    model.set_attn_implementation(attention.ATTENTION_NAME)

    def reorder_cache(cache, beam_idx):
        cache.reorder_cache(beam_idx)
        runtime.reorder(beam_idx)
        return cache

    model._reorder_cache = reorder_cache
    setattr(model, _RUNTIME, runtime)
    return PatchHandle(model, runtime)


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in force on ``model``."""
    return getattr(model, _RUNTIME, None) is not None


def unpatch(model: nn.Module) -> None:
    """Undo :func:`patch` exactly; a model that is not patched is left as it is."""
    runtime: PrHSRuntime | None = model.__dict__.pop(_RUNTIME, None)
    if runtime is None:
        return
    for hook in runtime.hooks:
        hook.remove()
    for module in runtime.wrapped:
        remove_row_skip(module)
    for decoder_layer in decoder_layers(model):
        decoder_layer.self_attn.__dict__.pop("_prhs_layer", None)
    model.__dict__.pop("_reorder_cache", None)
    model.set_attn_implementation(runtime.original_attn_implementation)


def _runtime(model: nn.Module) -> PrHSRuntime:
    runtime = getattr(model, _RUNTIME, None)
    if runtime is None:
        raise ValueError("the model is not patched with PrHS (call prhs_hf.patch first)")
    return runtime


def telemetry(model: nn.Module) -> TelemetryReport:
    """The statistics of a patched model since patching or :func:`reset` (config ``telemetry.enabled``)."""
    runtime = _runtime(model)
    if runtime.telemetry is None:
        raise ValueError("telemetry is off: patch with telemetry: {enabled: true}")
    return runtime.telemetry.report()


def reset(model: nn.Module) -> None:
    """Forget the CIS anchors and the telemetry of a patched model."""
    _runtime(model).reset()
