"""Which Hugging Face model families PrHS patches and how to find their decoder layers.

A leaf module (it imports only ``torch.nn``, and that only where a model is checked): code that must
not import the runtime (the calibration pass, the patch itself) checks a model here, and a command
line checks a checkpoint's ``model_type`` (:func:`check_model_type`) before it imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torch import nn

__all__ = ["SUPPORTED_FAMILIES", "UnsupportedModelError", "decoder_layers", "check_model", "check_model_type"]

# model_type values whose decoder layers use the standard q/k/v/o attention with
# `ALL_ATTENTION_FUNCTIONS` and a residual `mlp` branch.
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "glm", "glm4", "qwen2_moe", "qwen3_moe", "glm4_moe")
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")


class UnsupportedModelError(ValueError):
    """The model cannot be patched: family, attention layout, dtype or sliding-window layers."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers``) or of a base model (``model.layers``)."""
    from torch import nn

    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder layers found at model.model.layers")
    return layers


def check_model_type(model_type: str | None) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model_type`` (a config's) is a supported family."""
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"PrHS does not support model_type {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )


def check_model(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` naming what is supported, or return quietly."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    check_model_type(model_type)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or getattr(config, "sliding_window", None) is not None and model_type == "qwen3_moe":
        raise UnsupportedModelError(
            f"{model_type} with sliding-window attention layers is not supported; PrHS supports full-attention layers only "
            "(set use_sliding_window=False)"
        )
    for i, layer in enumerate(decoder_layers(model)):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "o_proj", "layer_idx")) or not hasattr(layer, "mlp"):
            raise UnsupportedModelError(f"layer {i} of {model_type} lacks self_attn.q_proj/o_proj or mlp")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(f"PrHS supports dtypes {', '.join(SUPPORTED_DTYPES)}; the model is {dtype}")
