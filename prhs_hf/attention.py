"""The attention function registered with transformers as ``"prhs"``.

Like ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` it takes the module,
the query ``[B, Hq, Lq, D]``, the whole cache ``[B, Hkv, Lk, D]`` after the update and the mask
built by the registered mask function (``sdpa_mask``), and returns ``([B, Lq, Hq, D], None)``:
the signature of transformers' ``AttentionInterface``, which both functions here have.
A module of a model that is not patched (no ``_prhs_layer``) gets plain SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTENTION_NAME", "GQA_SDPA_NAME", "gqa_sdpa_attention_forward", "prhs_attention_forward", "register"]

ATTENTION_NAME = "prhs"
#: dense SDPA that reads grouped K/V in place, also under a mask (see gqa_sdpa_attention_forward)
GQA_SDPA_NAME = "sdpa_gqa"


def gqa_sdpa_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """Dense SDPA as transformers' ``sdpa_attention_forward`` computes it, but with
    ``enable_gqa=True`` whatever the mask: transformers' own path ``repeat_kv``-copies K/V to every
    query head whenever a mask is given (every padded batch, every StaticCache step), which makes
    dense decode of a GQA model several times slower than it has to be. The same function
    mathematically (not bit for bit: ``configs/dense.yaml`` keeps transformers' path).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = q_len > 1 and attention_mask is None and getattr(module, "is_causal", True)
    if is_causal and kv_len > q_len:  # prefill into an empty StaticCache: drop the unwritten slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def prhs_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """PrHS attention: routes to the module's :class:`~prhs_hf.layer.PrHSLayer`, or SDPA if unpatched."""
    layer = getattr(module, "_prhs_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return layer.attend(module, query, key, value, attention_mask, dropout, scaling, kwargs)


def register() -> None:
    """Register the attention functions (``"prhs"`` and ``"sdpa_gqa"``) and their mask builder
    (idempotent); ``model.set_attn_implementation("sdpa_gqa")`` makes a fair dense baseline.

    The mask builder must be registered too: without it transformers builds no mask at all.
    """
    for name, function in ((ATTENTION_NAME, prhs_attention_forward), (GQA_SDPA_NAME, gqa_sdpa_attention_forward)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
