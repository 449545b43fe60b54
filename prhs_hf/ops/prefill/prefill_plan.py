"""The prefill plan: which keys each query row of a PSAW/ETF prefill sees (SPEC §3).

Every prefill backend takes one :class:`PrefillPlan` beside ``q``, ``k``, ``v`` and the scale:
the Triton kernel and the PyTorch reference (``prefill_attention.py``), FlexAttention
(``flex_prefill.py``) and FlashAttention-4 (``flash_prefill.py``). The layer
(``prhs_hf.layer``) builds one plan per layer and forward.

Layout (HF): ``q [B, Hq, Lq, D]``, ``k``/``v`` ``[B, Hkv, Lk, D]``; query head ``h`` reads KV
head ``h // (Hq // Hkv)``. Real indices exclude left padding: real key ``j`` of sequence ``b``
is slot ``pad[b] + j`` of ``k``/``v``; query row ``r`` has real index ``i = q_start[b] + r``
(rows with ``i < 0`` are padding). Key ``j`` is visible to row ``i`` iff ``0 <= j <= i`` and
(``j < sink`` or ``j >= win_lo[b, r]``) and the row is active: ``i >= 0`` and not
``frozen_lo <= i < frozen_hi`` (ETF). :func:`prefill_visibility` is that predicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_HEAD_DIM", "PrefillPlan", "prefill_visibility"]

#: largest head size the prefill backends take
MAX_HEAD_DIM = 256


def prefill_visibility(
    i: torch.Tensor,
    j: torch.Tensor,
    win: torch.Tensor,
    sink: int,
    frozen_lo: torch.Tensor,
    frozen_hi: torch.Tensor,
) -> torch.Tensor:
    """The SPEC §3 predicate on broadcastable tensors: may query real index ``i`` see key real index ``j``?

    ``win`` is the row's PSAW window start, ``[frozen_lo, frozen_hi)`` the ETF frozen rows.
    Works elementwise on any broadcastable shapes, and inside a FlexAttention ``mask_mod``.
    """
    active = (i >= 0) & ~((i >= frozen_lo) & (i < frozen_hi))
    return active & (j >= 0) & (j <= i) & ((j < sink) | (j >= win))


@dataclass
class PrefillPlan:
    """PSAW/ETF work of one layer for one multi-token forward (layout in the module docstring).

    Attributes:
        pad: ``[B]`` int, the first real cache slot of each sequence.
        q_start: ``[B]`` int, the real index of query row 0 (negative for left-padding rows).
        win_lo: ``[B, Lq]`` int, the PSAW window start ``W(i + 1)`` of each row (``sink``
            everywhere: no PSAW); non-decreasing in ``r`` in practice, though no backend relies on it.
        sink: how many leading real keys stay visible to every active row past its window.
        frozen_lo: ``[B]`` int, first ETF-frozen real row of each sequence.
        frozen_hi: ``[B]`` int, end (exclusive) of the frozen rows (``<= frozen_lo``: none).
        active_rows: flat indices into ``[B * Lq]`` of the rows the model computes (ETF skips
            the others in its projections and MLP); None: all rows. The backends ignore it.
    """

    pad: torch.Tensor
    q_start: torch.Tensor
    win_lo: torch.Tensor
    sink: int
    frozen_lo: torch.Tensor
    frozen_hi: torch.Tensor
    active_rows: torch.Tensor | None = None

    @classmethod
    def dense_causal(cls, pad: torch.Tensor, q_start: torch.Tensor, q_len: int) -> PrefillPlan:
        """The dense causal pattern (every real key ``j <= i``) of ``q_len`` query rows: windows
        that start at key 0 (no PSAW), no sink, no frozen rows (no ETF)."""
        no_rows = torch.zeros(pad.shape[0], dtype=torch.int32, device=pad.device)
        win_lo = torch.zeros(pad.shape[0], q_len, dtype=torch.int32, device=pad.device)
        return cls(pad, q_start, win_lo, 0, no_rows, no_rows)

    def on(self, device: torch.device) -> PrefillPlan:
        """This plan with its index tensors int32 on ``device`` (no copy of those already there)."""
        pad, q_start, win_lo, frozen_lo, frozen_hi = (
            x.to(device=device, dtype=torch.int32) for x in (self.pad, self.q_start, self.win_lo, self.frozen_lo, self.frozen_hi)
        )
        return PrefillPlan(pad, q_start, win_lo, int(self.sink), frozen_lo, frozen_hi, self.active_rows)

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
        """Validate ``q``/``k``/``v`` and this plan's shapes against each other; return ``(B, Hq, Lq, D, Hkv, Lk)``."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("q, k, v must be 4-D: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D]")
        B, Hq, Lq, D = q.shape
        Bk, Hkv, Lk, Dk = k.shape
        if Bk != B or tuple(v.shape) != tuple(k.shape) or Dk != D:
            raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
        if D > MAX_HEAD_DIM:
            raise ValueError(f"head size {D} > {MAX_HEAD_DIM}")
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q/k/v must share one of fp16/bf16/fp32 (got {q.dtype}, {k.dtype}, {v.dtype})")
        for name, shape in (("pad", (B,)), ("q_start", (B,)), ("frozen_lo", (B,)), ("frozen_hi", (B,)), ("win_lo", (B, Lq))):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"plan.{name} must have shape {shape}, got {got}")
        return B, Hq, Lq, D, Hkv, Lk
