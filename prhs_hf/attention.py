"""The attention function registered with transformers as ``"prhs"``.

Like ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` it takes the module,
the query ``[B, Hq, Lq, D]``, the whole cache ``[B, Hkv, Lk, D]`` after the update and the mask
built by the registered mask function (``sdpa_mask``), and returns ``([B, Lq, Hq, D], None)``.
A module of a model that is not patched (no ``_prhs_layer``) gets plain SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTENTION_NAME", "prhs_attention_forward", "register"]

ATTENTION_NAME = "prhs"


def prhs_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """PrHS attention: routes to the module's :class:`~prhs_hf.layer.PrHSLayer`, or SDPA if unpatched."""
    layer = getattr(module, "_prhs_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return layer.attend(module, query, key, value, attention_mask, dropout, scaling, kwargs)


def register() -> None:
    """Register the attention function and its mask builder (idempotent).

    The mask builder must be registered too: without it transformers builds no mask at all.
    """
    AttentionInterface.register(ATTENTION_NAME, prhs_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
