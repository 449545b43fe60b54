"""The last step of a CIS decode step: store the retrieving rows' queries and sets as new anchors.

Contract (docs/DECODE_PIPELINE.md §5), for every row ``(b, h)`` of ``layer``, with
``slot = min(anchor_count[layer, b, h], s - 1)`` (``s`` slots: the block size)::

    anchor_q[layer, b, h, slot]   = q[b, h] / max(|q[b, h]|, NORM_EPS)      (fp32)
    anchor_idx[layer, b, h, slot] = new_set[b, h]
    anchor_count[layer, b, h]     = 0 if step % s == 0                      (the block's last step)
                                    else anchor_count[layer, b, h] + (best[b, h] == -1)

Every row writes its slot, the first one not in use; only the rows that retrieved (``best == -1``)
count it. A row that did not retrieve so writes a slot that nothing reads (the valid anchors are
the first ``anchor_count``), and no slot in use is ever written: a block of ``s`` steps takes at
most ``s`` anchors, so ``anchor_count < s`` before every write that counts. ``step`` is the
number of decode steps taken since the prefill, this one included (``CISState.step``): at the
last step of every block the record clears the layer's anchors for the next block, so the step
needs no separate clear (a masked fill of the state before the first layer would make
``torch.compile`` copy the whole count buffer and write it back at the end of the step).
The op takes the state of every layer (``CISState``, ``[L, B, H, ...]``) and the layer index, not
a view of one layer's slice: a view mutated in a compiled step becomes copies of the slice and of
the buffer (docs/DECODE_PIPELINE.md). One launch, in place, no copies; inside the launcher (opaque
to the compiler) the kernel is given the layer's slices.

One launch replaces the three ``index_put_`` kernels of the PyTorch reference in a compiled step
(``scripts/probe_decode_kernels.py``).

Layout follows the Triton tutorial 06-fused-attention: the ``@triton.jit`` kernel, its launcher
:func:`record_anchors`, and the PyTorch reference :func:`record_anchors_reference`.
"""

from __future__ import annotations

import torch

from ..triton_support import NORM_EPS, layer_rows, next_pow2, program_bh, require_triton, tl, triton, unit_vectors

__all__ = ["anchor_slots", "check_record", "record_anchors", "record_anchors_reference", "record_launch_args"]


@triton.jit
def _record_row(
    Q, STEP, AQ, AIDX, ACNT, b, h, best,
    stride_qb, stride_qh,
    stride_aqb, stride_aqh, stride_aqs,
    stride_aib, stride_aih, stride_ais,
    stride_cb, stride_ch,
    eps,
    S_ANCH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Row ``(b, h)``'s record but for its set: its unit query into its slot ``min(count, s - 1)``
    and its count (the contract above). Returns the slot's set row, where the caller stores the
    set (copied from ``new_set`` here, from registers in the composition that built it)."""
    cnt_ptr = ACNT + b * stride_cb + h * stride_ch
    cnt = tl.load(cnt_ptr)
    slot = tl.minimum(cnt, S_ANCH - 1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    qn = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=0)), eps)
    aq = AQ + b.to(tl.int64) * stride_aqb + h * stride_aqh + slot * stride_aqs
    tl.store(aq + offs_d, qn, mask=dmask)
    block_end = (tl.load(STEP) % S_ANCH) == 0
    tl.store(cnt_ptr, tl.where(block_end, 0, cnt + (best == -1).to(tl.int32)))
    return AIDX + b.to(tl.int64) * stride_aib + h * stride_aih + slot * stride_ais


@triton.jit
def _record_anchors_kernel(
    Q, SET, BEST, STEP, AQ, AIDX, ACNT,
    stride_qb, stride_qh, stride_sb, stride_sh, stride_bb, stride_bh,
    stride_aqb, stride_aqh, stride_aqs,
    stride_aib, stride_aih, stride_ais,
    stride_cb, stride_ch,
    eps,
    H: tl.constexpr, S_ANCH: tl.constexpr, D: tl.constexpr, NSET: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SET: tl.constexpr,
):
    """One program per (batch, head) row; AQ, AIDX, ACNT point at the layer's slices of the state."""
    _, b, h = program_bh(H)
    best = tl.load(BEST + b * stride_bb + h * stride_bh)
    ai = _record_row(Q, STEP, AQ, AIDX, ACNT, b, h, best, stride_qb, stride_qh, stride_aqb, stride_aqh, stride_aqs,
                     stride_aib, stride_aih, stride_ais, stride_cb, stride_ch, eps, S_ANCH, D, BLOCK_D)
    set_row = SET + b.to(tl.int64) * stride_sb + h * stride_sh
    for j0 in range(0, NSET, BLOCK_SET):
        j = j0 + tl.arange(0, BLOCK_SET)
        tl.store(ai + j, tl.load(set_row + j, mask=j < NSET), mask=j < NSET)


def record_anchors(
    anchor_q: torch.Tensor, anchor_idx: torch.Tensor, anchor_count: torch.Tensor, layer: int, q: torch.Tensor,
    new_set: torch.Tensor, best: torch.Tensor, step: torch.Tensor,
) -> None:
    """Triton anchor record: one launch, one program per row, in place, no sync.

    Args as :func:`record_anchors_reference`.
    """
    require_triton(anchor_q, q)
    B, H = q.shape[:2]
    nset = anchor_idx.shape[-1]
    check_record(anchor_q, anchor_idx, anchor_count, layer, q, new_set.shape, best, step)
    if B * H == 0:
        return
    if new_set.stride(-1) != 1:
        new_set = new_set.contiguous()
    tensors, strides, sizes = record_launch_args(anchor_q, anchor_idx, anchor_count, layer, q, step)
    q, step, aq, ai, ac = tensors
    _record_anchors_kernel[(B * H,)](
        q, new_set, best, step, aq, ai, ac,
        q.stride(0), q.stride(1), new_set.stride(0), new_set.stride(1), best.stride(0), best.stride(1),
        *strides[2:],
        NORM_EPS,
        H=H, NSET=nset, **sizes,
        BLOCK_SET=min(1024, next_pow2(max(nset, 1), 16)),
        num_warps=4 if nset >= 1024 else 2,
    )


def record_launch_args(
    anchor_q: torch.Tensor, anchor_idx: torch.Tensor, anchor_count: torch.Tensor, layer: int, q: torch.Tensor,
    step: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], dict[str, int]]:
    """What a kernel calling ``_record_row`` takes, in its order: the tensors ``(q, step, aq, ai,
    ac)``, with ``aq, ai, ac`` the layer's slices of the state (views, written in place: their
    offset from the buffer's start, layer x stride, stays on the host in 64-bit, where an
    in-kernel int32 product could overflow), their strides ``(q's b, h; aq's b, h, s; ai's b, h,
    s; ac's b, h)`` and the constexprs ``S_ANCH, D, BLOCK_D``."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    aq, ai, ac = anchor_q[int(layer)], anchor_idx[int(layer)], anchor_count[int(layer)]
    strides = (q.stride(0), q.stride(1), aq.stride(0), aq.stride(1), aq.stride(2),
               ai.stride(0), ai.stride(1), ai.stride(2), ac.stride(0), ac.stride(1))
    D = anchor_q.shape[-1]
    return (q, step, aq, ai, ac), strides, dict(S_ANCH=anchor_q.shape[3], D=D, BLOCK_D=next_pow2(D, 16))


def check_record(anchor_q, anchor_idx, anchor_count, layer, q, set_shape, best, step, name="record_anchors") -> None:
    """Raise a ValueError naming ``name`` unless the record's arguments fit (``set_shape``: the new
    sets' shape)."""
    L, B, H, s, D = anchor_q.shape
    if anchor_q.stride(-1) != 1 or anchor_idx.stride(-1) != 1:
        raise ValueError(f"{name}: anchor_q and anchor_idx need a contiguous last dim (they are written in place)")
    if anchor_idx.shape[:4] != (L, B, H, s) or anchor_count.shape != (L, B, H):
        raise ValueError(f"{name}: anchor_idx {tuple(anchor_idx.shape)} / anchor_count "
                         f"{tuple(anchor_count.shape)} do not match anchor_q {tuple(anchor_q.shape)}")
    if q.shape != (B, H, D) or tuple(set_shape) != (B, H, anchor_idx.shape[-1]) or best.shape != (B, H):
        raise ValueError(f"{name}: q {tuple(q.shape)} / new_set {tuple(set_shape)} / best "
                         f"{tuple(best.shape)}: expected [{B}, {H}, {D}] / [{B}, {H}, {anchor_idx.shape[-1]}] / [{B}, {H}]")
    if step.shape != () or step.dtype != torch.int64:
        raise ValueError(f"{name}: step {tuple(step.shape)} {step.dtype}: expected a 0-dim int64 tensor")
    if not 0 <= int(layer) < L:
        raise ValueError(f"{name}: layer {layer} not in [0, {L})")


def record_anchors_reference(
    anchor_q: torch.Tensor, anchor_idx: torch.Tensor, anchor_count: torch.Tensor, layer: int, q: torch.Tensor,
    new_set: torch.Tensor, best: torch.Tensor, step: torch.Tensor,
) -> None:
    """PyTorch reference of :func:`record_anchors` (vectorised, sync-free, in place).

    Args:
        anchor_q: ``[L, B, H, s, D]`` fp32 the anchors' unit queries of every layer.
        anchor_idx: ``[L, B, H, s, n]`` int32 their dilated sets.
        anchor_count: ``[L, B, H]`` int32 valid anchors per row.
        layer: the layer whose rows are written.
        q: ``[B, H, D]`` the queries the anchors are matched on.
        new_set: ``[B, H, n]`` int32 the dilated sets of the retrieving rows.
        best: ``[B, H]`` int32 from ``cis_match`` (``-1``: the row retrieved).
        step: ``[]`` int64 decode steps since the prefill, this one included.
    """
    check_record(anchor_q, anchor_idx, anchor_count, layer, q, new_set.shape, best, step)
    s = anchor_q.shape[3]
    where = anchor_slots(anchor_count, layer, s)
    anchor_q.index_put_(where, unit_vectors(q))
    anchor_idx.index_put_(where, new_set.to(anchor_idx.dtype))
    counted = anchor_count[int(layer)] + (best == -1).to(anchor_count.dtype)
    anchor_count.index_put_(where[:3], torch.where(step % s == 0, torch.zeros_like(counted), counted))


def anchor_slots(anchor_count: torch.Tensor, layer: int, slots: int) -> tuple[torch.Tensor, ...]:
    """Where a record writes each row of ``layer``: index tensors ``(layer, b, h, slot)`` into the
    ``[L, B, H, s, ...]`` state buffers (the whole buffers, not a view of the layer), ``slot =
    min(anchor_count[layer, b, h], slots - 1)``; ``[:3]`` indexes ``anchor_count`` itself. Read the
    slots before the record counts (``CISState`` writes its tail pairs there)."""
    _, b, h = anchor_count.shape
    rows = layer_rows(int(layer), b, h, anchor_count.device)
    return (*rows, anchor_count[int(layer)].clamp(max=slots - 1).long())
