"""The sparse decode attentions as custom ops (``prhs::sparse_decode_attention`` and its ``_grouped`` and
``_union`` twins), registered with their references (``registry.py``)."""

from __future__ import annotations

from typing import Callable

import torch

from ..registry import register_decode_op
from .sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_grouped,
    sparse_decode_attention_grouped_reference,
    sparse_decode_attention_reference,
    sparse_decode_attention_union,
    sparse_decode_attention_union_reference,
)

Tensor = torch.Tensor


def _attention_op(launcher: Callable):
    """``launcher`` (``sparse_decode_attention``, its grouped or its union twin) as the op ``prhs::<its name>``."""

    def run(q: Tensor, k_cache: Tensor, v_cache: Tensor, pad: Tensor, idx: Tensor, count: Tensor,
            scale: float) -> Tensor:
        return launcher(q, k_cache, v_cache, pad, idx, count, scale)

    op = torch.library.custom_op(f"prhs::{launcher.__name__}", run, mutates_args=())

    @op.register_fake
    def _(q, k_cache, v_cache, pad, idx, count, scale):
        return torch.empty_like(q)

    return op


sparse_decode_attention_op = _attention_op(sparse_decode_attention)
sparse_decode_attention_grouped_op = _attention_op(sparse_decode_attention_grouped)
sparse_decode_attention_union_op = _attention_op(sparse_decode_attention_union)

register_decode_op(sparse_decode_attention, sparse_decode_attention_reference, sparse_decode_attention_op,
                   "step 4: exact attention of each query head over its index list")
register_decode_op(sparse_decode_attention_union, sparse_decode_attention_union_reference,
                   sparse_decode_attention_union_op,
                   "step 4 over the union of a KV group's per-head sets, read once (sparse_attention: group_union)")
register_decode_op(sparse_decode_attention_grouped, sparse_decode_attention_grouped_reference,
                   sparse_decode_attention_grouped_op,
                   "step 4, group-shared (cis.selection: group): one index list per KV head for its query heads")
