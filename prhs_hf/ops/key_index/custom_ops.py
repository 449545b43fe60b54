"""The key index's write, update and two-stage retrieval as custom ops (``prhs::write_key_index``,
``prhs::update_key_index``, ``prhs::topk_retrieval_indexed``), registered with their references
(``registry.py``). A custom op takes tensors and scalars, so the :class:`KeyIndex` crosses the op
boundary as its fields."""

from __future__ import annotations

from typing import Optional

import torch

from ..registry import int32_like, register_decode_op
from .key_index import (
    KeyIndex,
    topk_retrieval_indexed,
    topk_retrieval_indexed_reference,
    update_key_index,
    update_key_index_reference,
    write_key_index,
    write_key_index_reference,
)

Tensor = torch.Tensor


@torch.library.custom_op("prhs::write_key_index", mutates_args=("a", "b"))
def write_key_index_op(a: Tensor, b: Tensor, kind: str, page: int, center: Optional[Tensor], k_cache: Tensor,
                       start: int, end: int) -> None:
    write_key_index(KeyIndex(kind, a, b, page, center), k_cache, start, end)


@write_key_index_op.register_fake
def _(a, b, kind, page, center, k_cache, start, end):
    return None


@torch.library.custom_op("prhs::update_key_index", mutates_args=("a", "b"))
def update_key_index_op(a: Tensor, b: Tensor, kind: str, page: int, center: Optional[Tensor], k_cache: Tensor,
                        slot: Tensor) -> None:
    update_key_index(KeyIndex(kind, a, b, page, center), k_cache, slot)


@update_key_index_op.register_fake
def _(a, b, kind, page, center, k_cache, slot):
    return None


@torch.library.custom_op("prhs::topk_retrieval_indexed", mutates_args=())
def topk_retrieval_indexed_op(
    q: Tensor, k_cache: Tensor, a: Tensor, b: Tensor, kind: str, page: int, center: Optional[Tensor], pad: Tensor,
    lo: Tensor, hi: Tensor, retrieve: Tensor, k: int, margin: int, scale: float, grouped: bool,
) -> Tensor:
    return topk_retrieval_indexed(q, k_cache, KeyIndex(kind, a, b, page, center), pad, lo, hi, retrieve, k, margin,
                                  scale, grouped)


@topk_retrieval_indexed_op.register_fake
def _(q, k_cache, a, b, kind, page, center, pad, lo, hi, retrieve, k, margin, scale, grouped):
    return int32_like(q.shape[0], k_cache.shape[1] if grouped else q.shape[1], int(k), like=q)


def _write_key_index_via_op(index: KeyIndex, k_cache: Tensor, start: int, end: int) -> None:
    write_key_index_op(index.a, index.b, index.kind, index.page, index.center, k_cache, start, end)


def _update_key_index_via_op(index: KeyIndex, k_cache: Tensor, slot: Tensor) -> None:
    update_key_index_op(index.a, index.b, index.kind, index.page, index.center, k_cache, slot)


def _topk_retrieval_indexed_via_op(q, k_cache, index: KeyIndex, pad, lo, hi, retrieve, k, margin, scale, grouped):
    return topk_retrieval_indexed_op(q, k_cache, index.a, index.b, index.kind, index.page, index.center, pad, lo, hi,
                                     retrieve, k, margin, scale, grouped)


register_decode_op(write_key_index, write_key_index_reference, _write_key_index_via_op,
                   "the key index of the prefill's slots [start, end), written in place")
register_decode_op(update_key_index, update_key_index_reference, _update_key_index_via_op,
                   "the key index of the step's new slot, written in place")
register_decode_op(topk_retrieval_indexed, topk_retrieval_indexed_reference, _topk_retrieval_indexed_via_op,
                   "step 2 on the key index: the best k + margin candidates, re-ranked exactly on the cache")
