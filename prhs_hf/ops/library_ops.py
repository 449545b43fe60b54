"""The Triton decode launchers as ``torch.library`` custom ops, for ``torch.compile``.

Dynamo cannot trace a Triton launcher that runs in the interpreter, and tracing a real one
specialises on its Python-side heuristics (grid sizes, autotuning). Registered as custom ops
(namespace ``prhs``) with a fake implementation that gives the output shapes, each launcher is
one opaque node of the graph: the graph compiles with ``fullgraph=True`` and replays under CUDA
graphs, and the launcher runs unchanged inside it.

:func:`compiled_or_eager` makes the functions of ``decode_ops.TRITON_OPS``: in eager mode they
call the launcher directly (a custom op adds dispatcher overhead to every call), under
``torch.compile`` they call the op.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .cis_match.cis_match import CISMatch, cis_match
from .compose.compose_indices import compose_indices, dilate_and_compose, dilate_compose_and_record
from .compose.dilated_set import dilate_mask, dilated_set_size
from .compose.record_anchors import record_anchors
from .key_index.key_index import KeyIndex, topk_retrieval_indexed, update_key_index, write_key_index
from .sparse_attention.sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_grouped,
    sparse_decode_attention_union,
)
from .topk.topk_retrieval import topk_retrieval, topk_retrieval_grouped

__all__ = ["compiled_or_eager"]

Tensor = torch.Tensor


def _int32(*shape, like: Tensor) -> Tensor:
    return like.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("prhs::cis_match", mutates_args=())
def cis_match_op(
    q: Tensor, anchor_q: Tensor, anchor_count: Tensor, active: Tensor, tau: float
) -> tuple[Tensor, Tensor]:
    return tuple(cis_match(q, anchor_q, anchor_count, active, tau))


@cis_match_op.register_fake
def _(q, anchor_q, anchor_count, active, tau):
    return _int32(q.shape[0], q.shape[1], like=q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.bool)


def _cis_match_via_op(q, anchor_q, anchor_count, active, tau):
    return CISMatch(*cis_match_op(q, anchor_q, anchor_count, active, tau))


def _retrieval_op(launcher: Callable, grouped: bool):
    """``launcher`` (``topk_retrieval`` or its grouped twin) as the op ``prhs::<its name>``."""

    def run(q: Tensor, k_cache: Tensor, pad: Tensor, lo: Tensor, hi: Tensor, retrieve: Tensor, k: int,
            scale: float) -> Tensor:
        return launcher(q, k_cache, pad, lo, hi, retrieve, k, scale)

    op = torch.library.custom_op(f"prhs::{launcher.__name__}", run, mutates_args=())

    @op.register_fake
    def _(q, k_cache, pad, lo, hi, retrieve, k, scale):
        return _int32(q.shape[0], k_cache.shape[1] if grouped else q.shape[1], int(k), like=q)

    return op


topk_retrieval_op = _retrieval_op(topk_retrieval, grouped=False)
topk_retrieval_grouped_op = _retrieval_op(topk_retrieval_grouped, grouped=True)


@torch.library.custom_op("prhs::dilate_and_compose", mutates_args=())
def dilate_and_compose_op(
    t: Tensor, lo: Tensor, hi: Tensor, win_start: Tensor, best: Tensor, anchor_sets: Tensor, new_idx: Tensor,
    sink: int, cap: int, dil_m: int, dil_r: int, span: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    return dilate_and_compose(t, lo, hi, win_start, best, anchor_sets, new_idx, sink, cap, dil_m, dil_r, span)


@dilate_and_compose_op.register_fake
def _(t, lo, hi, win_start, best, anchor_sets, new_idx, sink, cap, dil_m, dil_r, span=0):
    return _composed(best, new_idx, cap, dil_m, dil_r)


def _composed(best: Tensor, new_idx: Tensor, cap: int, dil_m: int, dil_r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Empty ``(new_set, idx, count)`` of the shapes a dilate-and-compose returns."""
    B, H = best.shape
    # dilated_set_size clips m to k and ignores m for r = 0, as the launcher does
    nset = dilated_set_size(new_idx.shape[-1], dil_m, dil_r)
    return _int32(B, H, nset, like=best), _int32(B, H, int(cap), like=best), _int32(B, H, like=best)


@torch.library.custom_op("prhs::dilate_compose_and_record", mutates_args=("anchor_q", "anchor_idx", "anchor_count"))
def dilate_compose_and_record_op(
    t: Tensor, lo: Tensor, hi: Tensor, win_start: Tensor, best: Tensor, new_idx: Tensor, anchor_q: Tensor,
    anchor_idx: Tensor, anchor_count: Tensor, layer: int, q: Tensor, step: Tensor,
    sink: int, cap: int, dil_m: int, dil_r: int, span: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    return dilate_compose_and_record(t, lo, hi, win_start, best, new_idx, anchor_q, anchor_idx, anchor_count, layer, q,
                                     step, sink, cap, dil_m, dil_r, span)


@dilate_compose_and_record_op.register_fake
def _(t, lo, hi, win_start, best, new_idx, anchor_q, anchor_idx, anchor_count, layer, q, step, sink, cap, dil_m, dil_r,
      span=0):
    return _composed(best, new_idx, cap, dil_m, dil_r)


@torch.library.custom_op("prhs::compose_indices", mutates_args=())
def compose_indices_op(
    t: Tensor, lo: Tensor, hi: Tensor, win_start: Tensor, sel_idx: Tensor, dilate: Tensor,
    sink: int, dil_m: int, dil_r: int, cap: int,
) -> tuple[Tensor, Tensor]:
    return compose_indices(t, lo, hi, win_start, sel_idx, dilate, sink, dil_m, dil_r, cap)


@compose_indices_op.register_fake
def _(t, lo, hi, win_start, sel_idx, dilate, sink, dil_m, dil_r, cap):
    B, H = sel_idx.shape[:2]
    return _int32(B, H, int(cap), like=sel_idx), _int32(B, H, like=sel_idx)


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


@torch.library.custom_op("prhs::record_anchors", mutates_args=("anchor_q", "anchor_idx", "anchor_count"))
def record_anchors_op(
    anchor_q: Tensor, anchor_idx: Tensor, anchor_count: Tensor, layer: int, q: Tensor, new_set: Tensor, best: Tensor,
    step: Tensor,
) -> None:
    record_anchors(anchor_q, anchor_idx, anchor_count, layer, q, new_set, best, step)


@record_anchors_op.register_fake
def _(anchor_q, anchor_idx, anchor_count, layer, q, new_set, best, step):
    return None


def _dilate_tensor(sel_idx: Tensor, dilate) -> Tensor:
    if isinstance(dilate, torch.Tensor):
        return dilate
    return dilate_mask(dilate, sel_idx.shape[0], sel_idx.shape[1], sel_idx.device)


def _compose_indices_via_op(t, lo, hi, win_start, sel_idx, dilate, sink, dil_m, dil_r, cap):
    return compose_indices_op(t, lo, hi, win_start, sel_idx, _dilate_tensor(sel_idx, dilate), sink, dil_m, dil_r, cap)


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
    return _int32(q.shape[0], k_cache.shape[1] if grouped else q.shape[1], int(k), like=q)


def _write_key_index_via_op(index: KeyIndex, k_cache: Tensor, start: int, end: int) -> None:
    write_key_index_op(index.a, index.b, index.kind, index.page, index.center, k_cache, start, end)


def _update_key_index_via_op(index: KeyIndex, k_cache: Tensor, slot: Tensor) -> None:
    update_key_index_op(index.a, index.b, index.kind, index.page, index.center, k_cache, slot)


def _topk_retrieval_indexed_via_op(q, k_cache, index: KeyIndex, pad, lo, hi, retrieve, k, margin, scale, grouped):
    return topk_retrieval_indexed_op(q, k_cache, index.a, index.b, index.kind, index.page, index.center, pad, lo, hi,
                                     retrieve, k, margin, scale, grouped)


_OPS: dict[Callable, Callable] = {
    cis_match: _cis_match_via_op,
    topk_retrieval: topk_retrieval_op,
    dilate_and_compose: dilate_and_compose_op,
    dilate_compose_and_record: dilate_compose_and_record_op,
    compose_indices: _compose_indices_via_op,
    sparse_decode_attention: sparse_decode_attention_op,
    topk_retrieval_grouped: topk_retrieval_grouped_op,
    sparse_decode_attention_grouped: sparse_decode_attention_grouped_op,
    sparse_decode_attention_union: sparse_decode_attention_union_op,
    record_anchors: record_anchors_op,
    write_key_index: _write_key_index_via_op,
    update_key_index: _update_key_index_via_op,
    topk_retrieval_indexed: _topk_retrieval_indexed_via_op,
}


def compiled_or_eager(launcher: Callable) -> Callable:
    """``launcher`` itself in eager mode, its custom op while ``torch.compile`` traces."""
    op = _OPS[launcher]

    @functools.wraps(launcher)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return op(*args, **kwargs)
        return launcher(*args, **kwargs)

    return call
