"""Dense forwards of the unpatched model that hand every layer's query and key to a hook.

Both calibrations read the model this way: ``prhs-hf calibrate``
(:func:`prhs_hf.calibration.measurement.measure`: the attention mass PSAW and ETF would drop) and
Double Sparsity's label channels (:func:`prhs_hf.calibration.ds_channels.label_contributions`).
:func:`layer_qk_hooks` sets the pass up and takes it down again: the model's attention becomes
dense SDPA (:func:`~prhs_hf.attention.gqa_sdpa_attention_forward`) that first calls the layer's
hook with its post-RoPE query and key.

Whether a model is patched comes from :func:`prhs_hf.patching.is_patched`: nothing in the runtime
core imports this package, so that import makes no cycle.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention import gqa_sdpa_attention_forward
from ..families import check_model, decoder_layers
from ..patching import is_patched

__all__ = ["QKHook", "layer_qk_hooks"]

QKHook = Callable[[torch.Tensor, torch.Tensor, float], None]
"""``hook(query [B, Hq, T, D], key [B, Hkv, S, D], scaling)``: one layer's query and key (after RoPE)
and its softmax scale, once per forward."""

_NAME = "prhs_calibrate"
"""The attention implementation (and mask) the pass registers with transformers."""
_HOOK = "_prhs_calibration"
"""The attribute of a layer's ``self_attn`` that holds its hook while the pass is in force."""


def _calibration_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Dense SDPA for the model's output; on the way, the module's calibration hook sees ``query`` and ``key``."""
    hook = getattr(module, _HOOK, None)
    if hook is not None:
        hook(query, key, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return gqa_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@contextmanager
def layer_qk_hooks(
    model: nn.Module, make_hook: Callable[[int], QKHook], *, error: type[ValueError] = ValueError,
) -> Iterator[nn.ModuleList]:
    """Inside the block, layer ``i``'s attention calls ``make_hook(i)`` with its query and key, then
    runs dense SDPA; yields the decoder layers.

    The block runs the forwards (the callers use ``torch.inference_mode()`` and ``use_cache=False``,
    so that a hook sees one whole prompt's query and key). On entry the model is checked: a model
    PrHS does not support raises :class:`~prhs_hf.families.UnsupportedModelError`, a patched one
    ``error`` (the caller's error type: a subclass of ``ValueError``). ``make_hook`` is called once
    per layer on entry; the hooks it returns run only during the block's forwards. When the block
    ends, by an exception too, every hook is removed and the model's attention implementation is
    the one it had before.
    """
    check_model(model)
    if is_patched(model):
        raise error("the model is patched with PrHS; calibrate the unpatched model (prhs_hf.unpatch(model))")
    layers = decoder_layers(model)
    AttentionInterface.register(_NAME, _calibration_attention)
    AttentionMaskInterface.register(_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    try:
        for i, layer in enumerate(layers):
            setattr(layer.self_attn, _HOOK, make_hook(i))
        model.set_attn_implementation(_NAME)
        yield layers
    finally:
        model.set_attn_implementation(previous)
        for layer in layers:
            if _HOOK in layer.self_attn.__dict__:
                delattr(layer.self_attn, _HOOK)
