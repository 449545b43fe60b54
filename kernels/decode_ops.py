"""The four decode steps by backend name: ``REFERENCE_OPS`` (PyTorch) and ``TRITON_OPS``.

Each is a :class:`DecodeOps` with ``cis_match``, ``topk_retrieval``, ``compose_indices`` and
``sparse_decode_attention`` of the signatures in docs/DECODE_PIPELINE.md;
:func:`get_decode_ops` picks one by name (``"torch"``/``"reference"`` or ``"triton"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ._common import HAS_TRITON
from .cis_match import cis_match, cis_match_reference
from .compose_indices import compose_indices, compose_indices_reference
from .sparse_decode_attention import sparse_decode_attention, sparse_decode_attention_reference
from .topk_retrieval import topk_retrieval, topk_retrieval_reference

__all__ = ["DecodeOps", "REFERENCE_OPS", "TRITON_OPS", "HAS_TRITON", "get_decode_ops"]


@dataclass(frozen=True)
class DecodeOps:
    """One backend's implementation of the four decode steps."""

    name: str
    cis_match: Callable
    topk_retrieval: Callable
    compose_indices: Callable
    sparse_decode_attention: Callable


REFERENCE_OPS = DecodeOps(
    name="torch",
    cis_match=cis_match_reference,
    topk_retrieval=topk_retrieval_reference,
    compose_indices=compose_indices_reference,
    sparse_decode_attention=sparse_decode_attention_reference,
)

#: The Triton launchers (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``). Importable
#: without Triton; calling them then raises (check ``HAS_TRITON``).
TRITON_OPS = DecodeOps(
    name="triton",
    cis_match=cis_match,
    topk_retrieval=topk_retrieval,
    compose_indices=compose_indices,
    sparse_decode_attention=sparse_decode_attention,
)


def get_decode_ops(name: str) -> DecodeOps:
    """Backend by name: ``"torch"`` / ``"reference"`` or ``"triton"``."""
    if name in ("torch", "reference"):
        return REFERENCE_OPS
    if name == "triton":
        return TRITON_OPS
    raise ValueError(f"unknown decode backend {name!r} (expected 'torch' or 'triton')")
