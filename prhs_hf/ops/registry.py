"""The decode ops' registry: each op's Triton launcher, its PyTorch reference and its custom op, in one entry.

An op folder registers each of its decode steps once, in its ``custom_ops.py``, beside the launcher
and the reference (:func:`register_decode_op`); the backend tables of ``decode_ops.py``
(``REFERENCE_OPS``, ``TRITON_OPS``) are made from :data:`DECODE_OPS`, one field per entry. Adding
an op is its module (kernels, launcher, reference) and one registration.

The custom op is what ``torch.compile`` traces. Dynamo cannot trace a Triton launcher that runs in
the interpreter, and tracing a real one specialises on its Python-side heuristics (grid sizes,
autotuning). Registered as a ``torch.library`` custom op (namespace ``prhs``) with a fake
implementation that gives the output shapes, each launcher is one opaque node of the graph: the
graph compiles with ``fullgraph=True`` and replays under CUDA graphs, and the launcher runs
unchanged inside it. :func:`compiled_or_eager` makes the functions of ``TRITON_OPS``: in eager
mode they call the launcher directly (a custom op adds dispatcher overhead to every call), under
``torch.compile`` they call the op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["DecodeOp", "DECODE_OPS", "register_decode_op", "compiled_or_eager", "int32_like"]


@dataclass(frozen=True)
class DecodeOp:
    """One decode step as the backend tables see it."""

    name: str  # the field of ``DecodeOps`` (and, for a launcher's own op, ``prhs::<name>``)
    launcher: Callable  # the Triton launcher, called in eager mode
    reference: Callable  # the PyTorch reference, same signature (``backend.decode: torch``)
    compiled: Callable  # what ``torch.compile`` traces: the custom op, or a thin adapter that calls it
    doc: str  # one line: what it does, for ``DecodeOps``' docstring


#: Every registered decode op by name, in registration order.
DECODE_OPS: dict[str, DecodeOp] = {}


def register_decode_op(launcher: Callable, reference: Callable, compiled: Callable, doc: str) -> DecodeOp:
    """Register ``launcher`` (under its ``__name__``) with its reference and its custom op.

    Raises:
        ValueError: a decode op of that name is already registered.
    """
    name = launcher.__name__
    if name in DECODE_OPS:
        raise ValueError(f"decode op {name!r} is registered twice")
    op = DECODE_OPS[name] = DecodeOp(name, launcher, reference, compiled, doc)
    return op


def compiled_or_eager(launcher: Callable) -> Callable:
    """``launcher`` itself in eager mode, its registered custom op while ``torch.compile`` traces.

    Raises:
        KeyError: ``launcher`` is not a registered decode op's launcher.
    """
    ops = [op for op in DECODE_OPS.values() if op.launcher is launcher]
    if not ops:
        raise KeyError(f"{getattr(launcher, '__name__', launcher)!r} is not a registered decode op's launcher "
                       f"(registered: {sorted(DECODE_OPS)})")
    compiled = ops[0].compiled

    @functools.wraps(launcher)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        return launcher(*args, **kwargs)

    return call


def int32_like(*shape: int, like: torch.Tensor) -> torch.Tensor:
    """An empty int32 tensor of ``shape`` on ``like``'s device: what a fake implementation returns."""
    return like.new_empty(shape, dtype=torch.int32)
