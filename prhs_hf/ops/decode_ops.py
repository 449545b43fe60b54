"""The four decode steps by backend name: ``REFERENCE_OPS`` (PyTorch) and ``TRITON_OPS``.

Each is a :class:`DecodeOps` with ``cis_match``, ``topk_retrieval``, ``compose_indices`` and
``sparse_decode_attention`` of the signatures in docs/DECODE_PIPELINE.md (plus
``sparse_decode_attention_union``, the per-head sets read once per KV group, sparse_decode_attention.py;
``dilate_and_compose``, the anchor-set fast path, see compose_indices.py and dilated_set.py;
``record_anchors``; and the key index's ``write_key_index``, ``update_key_index`` and
``topk_retrieval_indexed``, key_index.py);
:func:`get_decode_ops` picks one by name (``"torch"``/``"reference"`` or ``"triton"``);
:func:`cis_select` chains match, retrieval and composition from the anchors' sets (the CIS
selector, ``prhs_hf.selectors.cis``, calls it around its state; the stateless whole step with the
sparse attention, for tests and benchmarks, is ``scripts/_bench_common.py``'s ``cis_decode_step``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from . import library_ops
from .cis_match.cis_match import cis_match, cis_match_reference
from .compose.compose_indices import (
    compose_indices,
    compose_indices_reference,
    dilate_and_compose,
    dilate_and_compose_reference,
    dilate_compose_and_record,
    dilate_compose_and_record_reference,
)
from .compose.dilated_set import dilated_set_size
from .compose.record_anchors import record_anchors, record_anchors_reference
from .key_index.key_index import (
    KeyIndex,
    topk_retrieval_indexed,
    topk_retrieval_indexed_reference,
    update_key_index,
    update_key_index_reference,
    write_key_index,
    write_key_index_reference,
)
from .sparse_attention.sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_grouped,
    sparse_decode_attention_grouped_reference,
    sparse_decode_attention_reference,
    sparse_decode_attention_union,
    sparse_decode_attention_union_reference,
)
from .topk.topk_retrieval import (
    topk_retrieval,
    topk_retrieval_grouped,
    topk_retrieval_grouped_reference,
    topk_retrieval_reference,
)
from .triton_support import HAS_TRITON, unit_vectors

__all__ = [
    "DecodeOps",
    "REFERENCE_OPS",
    "TRITON_OPS",
    "HAS_TRITON",
    "get_decode_ops",
    "cis_select",
    "CISSelection",
    "AnchorRecord",
    "group_query",
    "dilated_set_size",
]


@dataclass(frozen=True)
class DecodeOps:
    """One backend's implementation of the four decode steps."""

    name: str
    cis_match: Callable
    topk_retrieval: Callable
    compose_indices: Callable
    sparse_decode_attention: Callable
    # the per-head sets read once per KV group (backend.sparse_attention: group_union): the same output
    sparse_decode_attention_union: Callable
    dilate_and_compose: Callable
    # group-shared selection (cis.selection: group): one set per KV head for its query heads
    topk_retrieval_grouped: Callable
    sparse_decode_attention_grouped: Callable
    # the retrieving rows' anchors written into the state of every layer, in place
    record_anchors: Callable
    # dilate_and_compose and record_anchors in one launch (the layer's anchor sets read from the state)
    dilate_compose_and_record: Callable
    # the key index (key_index.py): its prefill write, its per-step update, the two-stage retrieval on it
    write_key_index: Callable
    update_key_index: Callable
    topk_retrieval_indexed: Callable


REFERENCE_OPS = DecodeOps(
    name="torch",
    cis_match=cis_match_reference,
    topk_retrieval=topk_retrieval_reference,
    compose_indices=compose_indices_reference,
    sparse_decode_attention=sparse_decode_attention_reference,
    sparse_decode_attention_union=sparse_decode_attention_union_reference,
    dilate_and_compose=dilate_and_compose_reference,
    topk_retrieval_grouped=topk_retrieval_grouped_reference,
    sparse_decode_attention_grouped=sparse_decode_attention_grouped_reference,
    record_anchors=record_anchors_reference,
    dilate_compose_and_record=dilate_compose_and_record_reference,
    write_key_index=write_key_index_reference,
    update_key_index=update_key_index_reference,
    topk_retrieval_indexed=topk_retrieval_indexed_reference,
)

#: The Triton launchers (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), called
#: directly in eager mode and as ``torch.ops.prhs.*`` custom ops under ``torch.compile``
#: (library_ops.py). Importable without Triton; calling them then raises (check ``HAS_TRITON``).
_via = library_ops.compiled_or_eager
TRITON_OPS = DecodeOps(
    name="triton",
    cis_match=_via(cis_match),
    topk_retrieval=_via(topk_retrieval),
    compose_indices=_via(compose_indices),
    sparse_decode_attention=_via(sparse_decode_attention),
    sparse_decode_attention_union=_via(sparse_decode_attention_union),
    dilate_and_compose=_via(dilate_and_compose),
    topk_retrieval_grouped=_via(topk_retrieval_grouped),
    sparse_decode_attention_grouped=_via(sparse_decode_attention_grouped),
    record_anchors=_via(record_anchors),
    dilate_compose_and_record=_via(dilate_compose_and_record),
    write_key_index=_via(write_key_index),
    update_key_index=_via(update_key_index),
    topk_retrieval_indexed=_via(topk_retrieval_indexed),
)


def get_decode_ops(name: str) -> DecodeOps:
    """Backend by name: ``"torch"`` / ``"reference"`` or ``"triton"``."""
    if name in ("torch", "reference"):
        return REFERENCE_OPS
    if name == "triton":
        return TRITON_OPS
    raise ValueError(f"unknown decode backend {name!r} (expected 'torch' or 'triton')")


class CISSelection(NamedTuple):
    """Outputs of :func:`cis_select`; ``H`` is ``Hq``, or ``Hkv`` with ``grouped=True``."""

    best: torch.Tensor  # [B, H] int32 matched anchor, -1 retrieve, -2 inactive
    new_idx: torch.Tensor  # [B, H, k] int32 fresh top-k of the retrieving rows
    new_set: torch.Tensor  # [B, H, n] int32 their dilated sets (what to store as their anchors)
    idx: torch.Tensor  # [B, H, cap] int32 composed index lists
    count: torch.Tensor  # [B, H] int32
    match_q: torch.Tensor  # [B, H, D] or [B, Hkv, G*D]: the query the anchors are matched on


class AnchorRecord(NamedTuple):
    """Where :func:`cis_select` records the step's anchors in its composition launch
    (``ops.dilate_compose_and_record``): the state buffers of every layer (``CISState``) whose
    ``layer`` slices are the ``anchor_q``, ``anchor_count`` and ``anchor_set`` it is given, and the
    step counter."""

    anchor_q: torch.Tensor  # [L, B, H, s, D] fp32
    anchor_idx: torch.Tensor  # [L, B, H, s, n] int32
    anchor_count: torch.Tensor  # [L, B, H] int32
    layer: int
    step: torch.Tensor  # [] int64


def group_query(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``q [B, Hq, D]`` → ``[B, Hkv, G*D]``: each KV head's query heads, each normalised, side by
    side. The cosine of two such vectors is the mean of the heads' cosines: group-shared CIS
    matches a group's queries as one."""
    B, H, D = q.shape
    qn = unit_vectors(q)
    return qn.reshape(B, kv_heads, (H // kv_heads) * D)


def cis_select(
    ops: DecodeOps,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pad: torch.Tensor,
    t: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    win_start: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_count: torch.Tensor,
    anchor_set: torch.Tensor,
    active: torch.Tensor,
    *,
    tau: float,
    sink: int,
    k: int,
    dil_m: int,
    dil_r: int,
    cap: int,
    scale: float,
    grouped: bool = False,
    group_score: str = "max",
    record: Optional[AnchorRecord] = None,
    key_index: Optional[KeyIndex] = None,
    margin: int = 0,
) -> CISSelection:
    """SPEC §4 steps 1-4 from the anchors' dilated sets (``anchor_set [B, H, s, n]``, as made by
    ``ops.dilate_and_compose``): match each query against its head's anchors, retrieve a fresh exact
    top-k where none is similar enough, build the retrieving rows' dilated sets once, and compose
    every row's index list from a set without sorting.

    ``grouped=True`` (``cis.selection: group``): the rows are the KV heads; a group's queries are
    matched as one (:func:`group_query`; ``anchor_q [B, Hkv, s, G*D]``) and retrieve one top-k,
    ranked by the largest of the group's scores (``ops.topk_retrieval_grouped``), or with
    ``group_score="mean"`` by their mean: the score of the group's mean query, one row per KV head
    of ``ops.topk_retrieval``.

    ``record`` (the state the anchors are slices of): the retrieving rows are recorded as anchors
    (``ops.record_anchors`` of ``match_q`` and ``new_set``) in the composition's launch
    (``ops.dilate_compose_and_record``); the caller must not record them again.

    ``key_index`` (this layer's :class:`~.key_index.KeyIndex`, written by the caller for every
    slot the region reads): the retrieval is two-stage, ``ops.topk_retrieval_indexed`` (the best
    ``k + margin`` candidates on the index, re-ranked exactly on ``k_cache``) instead of
    ``ops.topk_retrieval[_grouped]``; ``None`` (the default) leaves the exact retrieval."""
    if group_score not in ("max", "mean"):
        raise ValueError(f"cis_select: group_score={group_score!r}; expected 'max' or 'mean'")
    kv_heads = k_cache.shape[1]
    match_q = group_query(q, kv_heads) if grouped else q
    best, retrieve = ops.cis_match(match_q, anchor_q, anchor_count, active, tau)
    if grouped and group_score == "mean":
        B, H, D = q.shape
        mean_q = q.view(B, kv_heads, H // kv_heads, D).float().mean(2).to(q.dtype)
        if key_index is None:
            new_idx = ops.topk_retrieval(mean_q, k_cache, pad, lo, hi, retrieve, k, scale)
        else:
            new_idx = ops.topk_retrieval_indexed(mean_q, k_cache, key_index, pad, lo, hi, retrieve, k, margin, scale,
                                                 False)
    elif key_index is not None:
        new_idx = ops.topk_retrieval_indexed(q, k_cache, key_index, pad, lo, hi, retrieve, k, margin, scale, grouped)
    else:
        retrieval = ops.topk_retrieval_grouped if grouped else ops.topk_retrieval
        new_idx = retrieval(q, k_cache, pad, lo, hi, retrieve, k, scale)
    if record is None:
        new_set, idx, count = ops.dilate_and_compose(t, lo, hi, win_start, best, anchor_set, new_idx, sink, cap,
                                                     dil_m, dil_r, k_cache.shape[2])
    else:
        new_set, idx, count = ops.dilate_compose_and_record(
            t, lo, hi, win_start, best, new_idx, record.anchor_q, record.anchor_idx, record.anchor_count, record.layer,
            match_q, record.step, sink, cap, dil_m, dil_r, k_cache.shape[2])
    return CISSelection(best, new_idx, new_set, idx, count, match_q)
