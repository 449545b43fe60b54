"""The decode steps by backend name: ``REFERENCE_OPS`` (PyTorch) and ``TRITON_OPS``.

Each is a :class:`DecodeOps` with one field per op of the registry (``registry.DECODE_OPS``: the
four steps ``cis_match``, ``topk_retrieval``, ``compose_indices`` and ``sparse_decode_attention``
of the signatures in docs/DECODE_PIPELINE.md, and their variants: the group-shared and union
attentions, the anchor-set composition ``dilate_and_compose``, ``record_anchors``, the key index's
ops), made from the registry: each op folder's ``custom_ops.py`` registers its ops, and the
imports below load them all. :func:`get_decode_ops` picks a table by name (``"torch"``/``"reference"``
or ``"triton"``); :func:`cis_select` chains match, retrieval and composition from the anchors' sets
(the CIS selector, ``prhs_hf.selectors.cis``, calls it around its state; the stateless whole step
with the sparse attention, for tests and benchmarks, is ``scripts/_bench_common.py``'s
``cis_decode_step``).
"""

from __future__ import annotations

from dataclasses import make_dataclass
from typing import Callable, NamedTuple, Optional

import torch

# each op folder's custom_ops registers its decode ops (registry.DECODE_OPS) on import
from .cis_match import custom_ops as _cis_match_ops  # noqa: F401
from .compose import custom_ops as _compose_ops  # noqa: F401
from .compose.dilated_set import dilated_set_size
from .key_index import custom_ops as _key_index_ops  # noqa: F401
from .key_index.key_index import KeyIndex
from .registry import DECODE_OPS, compiled_or_eager
from .sparse_attention import custom_ops as _sparse_attention_ops  # noqa: F401
from .topk import custom_ops as _topk_ops  # noqa: F401
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

#: One backend's implementation of the decode ops: ``name`` and one field per registered op.
DecodeOps = make_dataclass(
    "DecodeOps", [("name", str)] + [(name, Callable) for name in DECODE_OPS], frozen=True,
    namespace={"__module__": __name__, "__doc__": "One backend's implementation of the decode ops:\n\n"
               + "\n".join(f"* ``{op.name}``: {op.doc}" for op in DECODE_OPS.values())},
)

REFERENCE_OPS = DecodeOps(name="torch", **{name: op.reference for name, op in DECODE_OPS.items()})

#: The Triton launchers (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), called
#: directly in eager mode and as ``torch.ops.prhs.*`` custom ops under ``torch.compile``
#: (registry.py). Importable without Triton; calling them then raises (check ``HAS_TRITON``).
TRITON_OPS = DecodeOps(name="triton", **{name: compiled_or_eager(op.launcher) for name, op in DECODE_OPS.items()})


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
