"""The attention function registered with transformers as ``"prhs"``.

Like ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` it takes the module,
the query ``[B, Hq, Lq, D]``, the whole cache ``[B, Hkv, Lk, D]`` after the update and the mask
built by the registered mask function (``sdpa_mask``), and returns ``([B, Lq, Hq, D], None)``:
the signature of transformers' ``AttentionInterface``, which both functions here have.
A module of a model that is not patched (no ``_prhs_layer``) gets plain SDPA.

Both names build their masks with :func:`generation_sdpa_mask`: transformers' ``sdpa_mask``, except
that inside :func:`decode_padding_read_once` (a patched ``generate()``) the decode steps ask the
device whether the batch has padding once, not at every step.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask, sdpa_mask

__all__ = ["ATTENTION_NAME", "GQA_SDPA_NAME", "MASK_SLICE_BYTES", "decode_padding_read_once", "generation_sdpa_mask",
           "gqa_sdpa_attention_forward", "prhs_attention_forward", "register"]

ATTENTION_NAME = "prhs"
#: dense SDPA that reads grouped K/V in place, also under a mask (see gqa_sdpa_attention_forward)
GQA_SDPA_NAME = "sdpa_gqa"
#: the most bytes of a 4D mask, widened to the query's dtype, that one SDPA call of
#: :func:`gqa_sdpa_attention_forward` takes: a longer multi-token forward runs in query slices
MASK_SLICE_BYTES = 1 << 28


def gqa_sdpa_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """Dense SDPA as transformers' ``sdpa_attention_forward`` computes it, but with
    ``enable_gqa=True`` whatever the mask: transformers' own path ``repeat_kv``-copies K/V to every
    query head whenever a mask is given (every padded batch, every StaticCache step), which makes
    dense decode of a GQA model several times slower than it has to be. The same function
    mathematically (not bit for bit: ``configs/dense.yaml`` keeps transformers' path).

    A multi-token forward under a 4D mask of more than :data:`MASK_SLICE_BYTES` (once SDPA widens
    it to the query's dtype) runs in slices of query rows, each with its rows of the mask: a chunk of
    a chunked prefill over a long cache (``[B, 1, 16384, 65536]`` at B4 is 8 GiB widened) would
    otherwise need that copy at once. Each query row's attention is computed as without slices.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = q_len > 1 and attention_mask is None and getattr(module, "is_causal", True)
    if is_causal and kv_len > q_len:  # prefill into an empty StaticCache: drop the unwritten slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]

    def attend(q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
            enable_gqa=key.shape[1] != q.shape[1],
        )

    rows = q_len
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] == q_len > 1:
        row_bytes = attention_mask.shape[0] * attention_mask.shape[1] * attention_mask.shape[3] * query.element_size()
        rows = max(1, MASK_SLICE_BYTES // row_bytes)
    if rows >= q_len:
        out = attend(query, attention_mask)
    else:
        out = torch.cat([attend(query[:, :, i:i + rows], attention_mask[:, :, i:i + rows])
                         for i in range(0, q_len, rows)], dim=2)
    return out.transpose(1, 2).contiguous(), None


def prhs_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """PrHS attention: routes to the module's :class:`~prhs_hf.layer.PrHSLayer` with the forward's
    :class:`~prhs_hf.geometry.ForwardContext` (the one object that holds what the forward
    decided: ``runtime.context``, made by the first layer's pre-hook), or SDPA if unpatched."""
    layer = getattr(module, "_prhs_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    context = layer.runtime.context
    if context.dense_step and kwargs.get("sliding_window") is None:
        # a decode step the policy sends to dense with nothing else to do: the fair dense attention,
        # at the host cost of the unpatched "sdpa_gqa" (runtime.PrHSRuntime.begin_forward)
        return gqa_sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return layer.attend(context, module, query, key, value, attention_mask, dropout, scaling, kwargs)


class _DecodePadding:
    """The decode steps of one ``generate()`` of the model whose configs are ``configs``: whether
    their 2D attention mask is all ones (``None`` until the first decode step reads it)."""

    def __init__(self, configs: tuple[Any, ...]):
        self.configs = configs
        self.unpadded: bool | None = None


_DECODE_PADDING: ContextVar[_DecodePadding | None] = ContextVar("prhs_decode_padding", default=None)


@contextmanager
def decode_padding_read_once(model: torch.nn.Module) -> Iterator[None]:
    """For the block (one ``generate()`` of ``model``): the decode steps' masks ask the device
    whether the batch has padding at the first decode step only.

    transformers' ``sdpa_mask`` reads ``attention_mask.all()`` on the host at every decode step to
    pass SDPA no mask where there is no padding. Within one ``generate()`` the answer cannot change:
    each step appends a real token (a 1) to the 2D mask of a full-attention layer's cache, so the
    first decode step's answer holds for the rest and the masks are the ones transformers builds.
    """
    config = model.config
    configs = (config, config.get_text_config()) if hasattr(config, "get_text_config") else (config,)
    token = _DECODE_PADDING.set(_DecodePadding(configs))
    try:
        yield
    finally:
        _DECODE_PADDING.reset(token)


def generation_sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (same arguments, same masks), which inside
    :func:`decode_padding_read_once` reads the decode steps' padding once instead of at each step.

    Only a one-token step of a full-attention layer (no ``local_size``, ``kv_offset`` 0) of the
    block's model that transformers would let skip its mask takes the remembered answer: ``None``
    (no padding: SDPA without a mask, as ``sdpa_mask`` returns then) or the mask built as
    ``sdpa_mask`` builds it. Everything else (prefills, sliding windows, compiled steps, other
    models, forwards outside ``generate()``) is ``sdpa_mask`` itself.
    """
    state = _DECODE_PADDING.get()
    mask_2d = kwargs.get("attention_mask")
    if (state is None or args or kwargs.get("q_length") != 1 or not kwargs.get("allow_is_causal_skip", True)
            or kwargs.get("local_size") is not None or kwargs.get("kv_offset", 0) != 0 or mask_2d is None
            or not any(kwargs.get("config") is c for c in state.configs) or torch.compiler.is_compiling()):
        return sdpa_mask(*args, **kwargs)
    if state.unpadded is None:  # the one host read of this generate()'s decode masks
        kv_length = kwargs["kv_length"]
        state.unpadded = bool(prepare_padding_mask(mask_2d, kv_length, 0)[:, :kv_length].all())
    if state.unpadded:
        return None
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})


def register() -> None:
    """Register the attention functions (``"prhs"`` and ``"sdpa_gqa"``) and their mask builder
    (idempotent); ``model.set_attn_implementation("sdpa_gqa")`` makes a fair dense baseline.

    The mask builder must be registered too: without it transformers builds no mask at all.
    """
    for name, function in ((ATTENTION_NAME, prhs_attention_forward), (GQA_SDPA_NAME, gqa_sdpa_attention_forward)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, generation_sdpa_mask)
