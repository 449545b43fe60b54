"""The composition and the anchor record as custom ops (``prhs::compose_indices``,
``prhs::dilate_and_compose``, ``prhs::dilate_compose_and_record``, ``prhs::record_anchors``),
registered with their references (``registry.py``)."""

from __future__ import annotations

import torch

from ..registry import int32_like, register_decode_op
from .compose_indices import (
    compose_indices,
    compose_indices_reference,
    dilate_and_compose,
    dilate_and_compose_reference,
    dilate_compose_and_record,
    dilate_compose_and_record_reference,
)
from .dilated_set import dilate_mask, dilated_set_size
from .record_anchors import record_anchors, record_anchors_reference

Tensor = torch.Tensor


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
    return int32_like(B, H, nset, like=best), int32_like(B, H, int(cap), like=best), int32_like(B, H, like=best)


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
    return int32_like(B, H, int(cap), like=sel_idx), int32_like(B, H, like=sel_idx)


def _dilate_tensor(sel_idx: Tensor, dilate) -> Tensor:
    if isinstance(dilate, torch.Tensor):
        return dilate
    return dilate_mask(dilate, sel_idx.shape[0], sel_idx.shape[1], sel_idx.device)


def _compose_indices_via_op(t, lo, hi, win_start, sel_idx, dilate, sink, dil_m, dil_r, cap):
    return compose_indices_op(t, lo, hi, win_start, sel_idx, _dilate_tensor(sel_idx, dilate), sink, dil_m, dil_r, cap)


@torch.library.custom_op("prhs::record_anchors", mutates_args=("anchor_q", "anchor_idx", "anchor_count"))
def record_anchors_op(
    anchor_q: Tensor, anchor_idx: Tensor, anchor_count: Tensor, layer: int, q: Tensor, new_set: Tensor, best: Tensor,
    step: Tensor,
) -> None:
    record_anchors(anchor_q, anchor_idx, anchor_count, layer, q, new_set, best, step)


@record_anchors_op.register_fake
def _(anchor_q, anchor_idx, anchor_count, layer, q, new_set, best, step):
    return None


register_decode_op(compose_indices, compose_indices_reference, _compose_indices_via_op,
                   "step 3: each row's sorted index list, sink + its (dilated) set + the local window")
register_decode_op(dilate_and_compose, dilate_and_compose_reference, dilate_and_compose_op,
                   "step 3 from the anchors' dilated sets: the retrieving rows' sets built once, no sort")
register_decode_op(record_anchors, record_anchors_reference, record_anchors_op,
                   "the retrieving rows' queries and sets written as anchors into every layer's state, in place")
register_decode_op(dilate_compose_and_record, dilate_compose_and_record_reference, dilate_compose_and_record_op,
                   "dilate_and_compose and record_anchors in one launch (the anchor sets read from the state)")
