"""The top-k retrievals as the custom ops ``prhs::topk_retrieval`` and ``prhs::topk_retrieval_grouped``,
registered with their references (``registry.py``)."""

from __future__ import annotations

from typing import Callable

import torch

from ..registry import int32_like, register_decode_op
from .topk_retrieval import (
    topk_retrieval,
    topk_retrieval_grouped,
    topk_retrieval_grouped_reference,
    topk_retrieval_reference,
)

Tensor = torch.Tensor


def _retrieval_op(launcher: Callable, grouped: bool):
    """``launcher`` (``topk_retrieval`` or its grouped twin) as the op ``prhs::<its name>``."""

    def run(q: Tensor, k_cache: Tensor, pad: Tensor, lo: Tensor, hi: Tensor, retrieve: Tensor, k: int,
            scale: float) -> Tensor:
        return launcher(q, k_cache, pad, lo, hi, retrieve, k, scale)

    op = torch.library.custom_op(f"prhs::{launcher.__name__}", run, mutates_args=())

    @op.register_fake
    def _(q, k_cache, pad, lo, hi, retrieve, k, scale):
        return int32_like(q.shape[0], k_cache.shape[1] if grouped else q.shape[1], int(k), like=q)

    return op


topk_retrieval_op = _retrieval_op(topk_retrieval, grouped=False)
topk_retrieval_grouped_op = _retrieval_op(topk_retrieval_grouped, grouped=True)

register_decode_op(topk_retrieval, topk_retrieval_reference, topk_retrieval_op,
                   "step 2: the exact top-k of the middle region for the retrieving rows")
register_decode_op(topk_retrieval_grouped, topk_retrieval_grouped_reference, topk_retrieval_grouped_op,
                   "step 2, group-shared (cis.selection: group): one top-k per KV head, its heads' max score")
