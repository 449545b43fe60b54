"""What the Triton kernels share: the optional Triton import, device queries and shape helpers.

Triton is optional: without it ``triton`` and ``tl`` are stand-ins that let the kernel modules
be imported (so their PyTorch ``*_reference`` functions work) while any attempt to launch a
kernel raises a clear error.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # pragma: no cover - exercised by the environment, not by a test
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

    class _MissingTriton:
        """Stand-in for ``triton``: decorators return a stub that raises when launched."""

        @staticmethod
        def jit(fn: Any = None, **_kw: Any) -> Any:
            def wrap(f: Any) -> Any:
                def _raise(*_a: Any, **_k: Any) -> None:
                    raise RuntimeError("Triton is not installed; use the *_reference functions")

                _raise.__name__ = f.__name__
                _raise.__doc__ = f.__doc__
                return _raise

            return wrap(fn) if fn is not None else wrap

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

    class _MissingTl:
        """Stand-in for ``triton.language``: only what kernel signatures evaluate at import."""

        constexpr = Any

        def __getattr__(self, name: str) -> Any:
            return None

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingTl()  # type: ignore[assignment]


__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "next_pow2",
    "gqa_group",
    "require_triton",
    "NORM_EPS",
    "num_sms",
    "interpreting",
    "layer_rows",
    "unit_vectors",
    "program_bh",
]

#: Floor of a vector norm in the cosine of `cis_match` (a zero vector has cosine 0).
NORM_EPS = 1e-12


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two that is ``>= max(n, minimum)``."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def gqa_group(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (query head ``h`` reads KV head ``h // group``)."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    return num_q_heads // num_kv_heads


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def require_triton(*tensors: torch.Tensor) -> None:
    """Raise unless Triton can run on ``tensors`` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the *_reference functions")
    interpret = interpreting()
    for x in tensors:
        if x.device.type != "cuda" and not interpret:
            raise RuntimeError(
                f"Triton kernels need CUDA tensors (got {x.device}); "
                "set TRITON_INTERPRET=1 to run them on the CPU"
            )


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; 132 = H100/H200 off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def layer_rows(layer: int, batch: int, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors ``(layer, b, h)`` broadcasting to ``[B, H]``: where ``index_put_`` writes one
    entry per row of ``layer`` into a selector's ``[L, B, H, ...]`` state buffer.

    The decode state of all layers lives in one buffer per kind (fewer graph inputs); it is written
    through the buffer itself, not a view of one layer's slice, because under torch.compile a
    mutated view becomes a ``select_scatter``: copies of the slice per layer and of the whole buffer
    back into it at every step (docs/DECODE_PIPELINE.md)."""
    return (torch.full((1, 1), layer, dtype=torch.long, device=device),
            torch.arange(batch, device=device)[:, None], torch.arange(heads, device=device)[None, :])


def unit_vectors(x: torch.Tensor) -> torch.Tensor:
    """``x / max(|x|, NORM_EPS)`` along the last dim, in fp32: the normalisation of every cosine and
    stored anchor of CIS (a zero vector stays zero)."""
    xf = x.float()
    return xf / xf.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


@triton.jit
def program_bh(H: tl.constexpr):
    """This program's row of a ``[B, H]`` grid of one program per row: ``(pid, b, h)``."""
    pid = tl.program_id(0)
    return pid, pid // H, pid % H
