"""FlashAttention-4 backend of the prefill (``backend.prefill: flash``; ``auto`` picks it where it runs).

Same contract and signature as :func:`prefill_attention.prefill_attention` (``q, k, v, plan, scale``;
``q [B, Hq, Lq, D]``, ``k``/``v`` ``[B, Hkv, Lk, D]`` in HF layout, a :class:`~prefill_plan.PrefillPlan`;
returns ``[B, Lq, Hq, D]`` contiguous), run through FlashAttention-4 (``flash_attn.cute``, the
CuTe DSL; sm90 and sm100 forwards):

* **PSAW/ETF layers** (:func:`flash_prefill_attention`): FA4's block-sparse forward. The schedule
  becomes FA4's block-sparse tensors (FlexAttention's layout, one pattern per sequence shared by
  all heads) by :func:`fa4_block_sparse`: a ``block_m x block_n`` tile of (query row, cache slot)
  with no visible pair is skipped, a whole tile with every pair visible runs unmasked ("full"),
  every other tile ("partial": PSAW boundary, causal diagonal, sink edge, ETF edge, padding edge,
  ragged edge) applies the exact SPEC §3 predicate through the CuTe ``mask_mod`` of
  :func:`prefill_mask_mod`, which reads the plan (per-sequence pad offset, query start, window
  starts, sink, frozen rows) from aux tensors (:func:`mask_aux_tensors`). Left padding is thus exact.
* **dense layers** (:func:`flash_dense_prefill_attention`): FA4's dense causal forward when the
  forward has no mask and ``Lq == Lk`` (no padding, no cache before the prompt); otherwise
  (left padding, a StaticCache, a prefill over cached tokens) the block-sparse forward with the
  dense pattern (every real key ``j <= i``), exact like the rest.

Rows that see no key (ETF-frozen, padding) are zero, as in the other backends. fp16/bf16 only
(FA4 has no fp32 forward): an fp32 model is refused, never silently cast.

Nothing here imports ``flash_attn`` at import time: the tile conversion is plain PyTorch and runs
(and is tested) on the CPU; :func:`require_flash_attn` imports FA4 and checks the device, with
an error that names ``backend.prefill: flash`` and how to install it (:data:`INSTALL_HINT`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from .prefill_plan import PrefillPlan

__all__ = [
    "INSTALL_HINT",
    "SUPPORTED_MAJORS",
    "FlashBlockSparse",
    "add_cutlass_dsl_path",
    "block_kinds",
    "check_flash_capability",
    "check_flash_inputs",
    "fa4_block_size",
    "fa4_block_sparse",
    "flash_block_sparse_attention",
    "flash_causal_attention",
    "flash_dense_prefill_attention",
    "flash_prefill_attention",
    "import_flash_attn",
    "mask_aux_tensors",
    "prefill_mask_mod",
    "require_flash_attn",
    "visible_per_block",
]

#: compute capability majors whose FA4 forward this route targets: 9 (sm90: H100/H200), 10 (sm100: B200/GB200)
SUPPORTED_MAJORS = (9, 10)

INSTALL_HINT = (
    "install FlashAttention-4 and its CuTe DSL stack: pip install flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 "
    "nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels apache-tvm-ffi "
    "torch-c-dlpack-ext einops (the -cu13 libs are needed with a CUDA 13 driver, e.g. 580; with a CUDA 12 driver "
    "use nvidia-cutlass-dsl-libs-cu12); after pip install --target DIR put DIR and DIR/nvidia_cutlass_dsl/dsl_packages "
    "on PYTHONPATH (the wheel's .pth file only runs in a site directory)"
)
_OTHERS = "or use backend.prefill: triton, flex, torch or auto"


# ----------------------------------------------------------------------------- FA4 availability


def add_cutlass_dsl_path() -> str | None:
    """Put ``nvidia_cutlass_dsl/dsl_packages`` on ``sys.path`` if the wheel is found but its ``.pth`` did not run.

    ``pip install --target DIR`` plus ``PYTHONPATH=DIR`` skips ``nvidia_cutlass_dsl_packages.pth``
    (``.pth`` files run only in site directories), so ``import cutlass`` fails without this.
    Returns the added path, or None.
    """
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "dsl_packages")
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
            return path
    return None


def import_flash_attn() -> ModuleType:
    """``flash_attn.cute`` (with its interface and block-sparsity modules), or a ``RuntimeError``
    naming ``backend.prefill: flash``, the import error and :data:`INSTALL_HINT`."""
    add_cutlass_dsl_path()
    try:
        fa4 = importlib.import_module("flash_attn.cute")
        importlib.import_module("flash_attn.cute.interface")
        importlib.import_module("flash_attn.cute.block_sparsity")
    except Exception as exc:  # ImportError, or the DSL loader's own errors (a missing libcuda, a CUDA mismatch)
        raise RuntimeError(
            f"backend.prefill: flash needs FlashAttention-4 (flash_attn.cute), which did not import "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT}; {_OTHERS}"
        ) from exc
    return fa4


def check_flash_capability(capability: tuple[int, int], device: Any = "cuda") -> None:
    """Raise ``RuntimeError`` unless ``capability`` (``torch.cuda.get_device_capability``) is one FA4's forward targets."""
    if capability[0] not in SUPPORTED_MAJORS:
        raise RuntimeError(
            f"backend.prefill: flash runs FlashAttention-4's sm90/sm100 forward (compute capability 9.x: H100/H200, "
            f"10.x: B200); {device} has compute capability {capability[0]}.{capability[1]}; {_OTHERS}"
        )


@functools.lru_cache(maxsize=None)
def _require(device_type: str, index: int | None) -> ModuleType:
    if device_type != "cuda":
        raise RuntimeError(
            f"backend.prefill: flash runs FlashAttention-4 on an NVIDIA GPU (sm90: H100/H200, sm100: B200); the model "
            f"is on {device_type}; {_OTHERS}"
        )
    fa4 = import_flash_attn()
    check_flash_capability(torch.cuda.get_device_capability(index), torch.device(device_type, index))
    return fa4


def require_flash_attn(device: torch.device) -> ModuleType:
    """``flash_attn.cute`` if the flash route can run on ``device``, else a ``RuntimeError`` that
    names ``backend.prefill: flash``, what is missing and how to install it (cached per device
    once it succeeds; a failure is raised again on every call)."""
    device = torch.device(device)
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    return _require(device.type, index)


def check_flash_inputs(q: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``q``'s dtype and head size are ones FA4's forward takes."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"backend.prefill: flash runs FlashAttention-4, which computes fp16/bf16 attention only; this model's "
            f"attention is {q.dtype} (load the model in bfloat16 or float16, {_OTHERS})"
        )
    d = q.shape[-1]
    if d % 8 or not 8 <= d <= 256:
        raise ValueError(f"backend.prefill: flash supports head sizes 8..256 that are multiples of 8, got {d}; {_OTHERS}")


def fa4_block_size(capability: tuple[int, int], head_dim: int) -> tuple[int, int]:
    """The sparse tile ``(block_m, block_n)`` handed to FA4 for this GPU and head size.

    sm90: FA4's forward tile is 128 x 128 for ``D <= 128`` (``_tile_size_fwd_sm90``), and the
    sparse KV block must be a multiple of its ``tile_n`` (112 or 80 past 128): 64 there, to which
    FA4 shrinks ``tile_n``. sm100 runs two 128-row Q stages per CTA: 256 x 128.
    """
    block_n = 128 if head_dim <= 128 else 64
    return (256, block_n) if capability[0] == 10 else (128, block_n)


# ----------------------------------------------------------------------------- tile mask -> FA4 block sparsity


def _overlap(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor) -> torch.Tensor:
    """Length of ``[a, b) ∩ [c0, c1)`` elementwise (0 when empty)."""
    return (torch.minimum(b, c1) - torch.maximum(a, c0)).clamp(min=0)


def visible_per_block(plan: PrefillPlan, kv_len: int, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible (query row, cache slot) pairs of every ``block_m x block_n`` tile of each sequence of ``plan``.

    An active row ``r`` (real index ``i = q_start + r >= 0``, not ETF-frozen) sees the real keys
    ``[0, s) ∪ [max(win, s), i + 1)`` with ``s = min(sink, i + 1)``, the keys of
    :func:`prefill_plan.prefill_visibility` as two disjoint intervals, i.e. the slots ``pad +`` those; so no
    ``Lq x Lk`` mask is built (``Lq x n_blocks`` counts, one sequence at a time). Returns
    ``(pairs [B, M, N], capacity [M, N])`` int64, capacity being the tile's rows ``< Lq`` times
    its slots ``< kv_len``.
    """
    dev = plan.win_lo.device
    B, lq = plan.win_lo.shape
    sink = plan.sink
    n_blocks = -(-kv_len // block_n)
    m_blocks = -(-lq // block_m)
    c0 = (torch.arange(n_blocks, device=dev, dtype=torch.int64) * block_n)[None, :]
    c1 = torch.clamp(c0 + block_n, max=kv_len)
    rows = torch.arange(lq, device=dev, dtype=torch.int64)
    pad, q_start, win_lo, frozen_lo, frozen_hi = (
        x.to(dev, torch.int64) for x in (plan.pad, plan.q_start, plan.win_lo, plan.frozen_lo, plan.frozen_hi)
    )
    out = torch.zeros(B, m_blocks, n_blocks, dtype=torch.int64, device=dev)
    for b in range(B):  # one sequence at a time: Lq x N counts, not B x Lq x N
        i = q_start[b] + rows
        win = win_lo[b]
        active = (i >= 0) & ((i < frozen_lo[b]) | (i >= frozen_hi[b]))
        s = torch.clamp(i + 1, min=0, max=sink)
        lo2 = torch.maximum(win, s)
        first = pad[b] + torch.zeros_like(i)  # slot of real key 0
        per_row = _overlap(first[:, None], (first + s)[:, None], c0, c1)
        per_row += _overlap((first + lo2)[:, None], (first + i + 1)[:, None], c0, c1)
        per_row *= active[:, None]
        padded = torch.zeros(m_blocks * block_m, n_blocks, dtype=torch.int64, device=dev)
        padded[:lq] = per_row
        out[b] = padded.view(m_blocks, block_m, n_blocks).sum(dim=1)
    tile_rows = torch.clamp(lq - torch.arange(m_blocks, device=dev) * block_m, max=block_m)
    capacity = tile_rows[:, None] * (c1 - c0)
    return out, capacity


def block_kinds(pairs: torch.Tensor, capacity: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Tile kinds from :func:`visible_per_block`: 0 skipped, 1 partial (needs the mask), 2 full.

    A tile is full only when it is a whole ``block_m x block_n`` tile with every pair visible; a
    ragged edge tile with pairs is partial (the mask is exact there, full would not be).
    """
    full = (pairs == capacity) & (capacity == block_m * block_n)
    kinds = torch.where(pairs > 0, 1, 0)
    return torch.where(full, 2, kinds).to(torch.int8)


def _ordered(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count [B, 1, M], indices [B, 1, M, N])`` int32 of the selected columns per row, ascending, packed left."""
    count = sel.sum(dim=-1).to(torch.int32)
    order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None].contiguous(), order[:, None].contiguous()


@dataclass
class FlashBlockSparse:
    """A prefill schedule as FA4's block-sparse tensors (FlexAttention's layout, heads broadcast).

    ``mask_block_*``: the partial tiles (the kernel applies the ``mask_mod``); ``full_block_*``:
    the tiles run without a mask; counts ``[B, 1, M]``, indices ``[B, 1, M, N]`` int32, ascending
    and packed left. ``kinds [B, M, N]`` int8 (0 skipped, 1 partial, 2 full) is for statistics
    and tests.
    """

    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor
    block_size: tuple[int, int]
    kinds: torch.Tensor

    def to_fa4(self) -> Any:
        """``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch`` of these tensors (imports FA4)."""
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        return BlockSparseTensorsTorch(
            mask_block_cnt=self.mask_block_cnt, mask_block_idx=self.mask_block_idx,
            full_block_cnt=self.full_block_cnt, full_block_idx=self.full_block_idx, block_size=self.block_size,
        )


def fa4_block_sparse(plan: PrefillPlan, kv_len: int, block: tuple[int, int] = (128, 128)) -> FlashBlockSparse:
    """The PSAW/ETF schedule ``plan`` of a (left-padded) prefill over ``kv_len`` cache slots as FA4's
    block-sparse tensors, tiles ``block`` (see :func:`fa4_block_size`)."""
    bm, bn = block
    pairs, capacity = visible_per_block(plan, kv_len, bm, bn)
    kinds = block_kinds(pairs, capacity, bm, bn)
    mask_cnt, mask_idx = _ordered(kinds == 1)
    full_cnt, full_idx = _ordered(kinds == 2)
    return FlashBlockSparse(mask_cnt, mask_idx, full_cnt, full_idx, (bm, bn), kinds)


# ----------------------------------------------------------------------------- the CuTe mask_mod


def mask_aux_tensors(plan: PrefillPlan, rows: int | None = None) -> list[torch.Tensor]:
    """The aux tensors of :func:`prefill_mask_mod` for ``plan``: ``[win_lo int32 [B, rows], geo int32 [B, 5]]``,
    ``geo[b] = (pad, q_start, frozen_lo, frozen_hi, sink)``, contiguous on ``win_lo``'s device.

    ``rows`` (default ``Lq``) pads ``win_lo`` with its last column up to whole query tiles, so
    that the mask_mod never reads past it in the ragged last tile (those rows are discarded).
    """
    plan = plan.on(plan.win_lo.device)
    win = plan.win_lo
    if rows is not None and rows > win.shape[1]:
        win = torch.cat([win, win[:, -1:].expand(-1, rows - win.shape[1])], dim=1)
    sink_col = torch.full_like(plan.pad, plan.sink)
    geo = torch.stack([plan.pad, plan.q_start, plan.frozen_lo, plan.frozen_hi, sink_col], dim=1)
    return [win.contiguous(), geo.contiguous()]


@functools.lru_cache(maxsize=None)
def prefill_mask_mod() -> Callable:
    """The SPEC §3 predicate as a CuTe ``mask_mod`` for FA4's partial tiles (imports the CuTe DSL).

    ``mask_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors)`` with the aux tensors of
    :func:`mask_aux_tensors`: query row ``m`` has real index ``i = q_start[b] + m``, cache slot
    ``n`` holds real key ``j = n - pad[b]``; visible iff the row is active (``i >= 0``, not in
    ``[frozen_lo, frozen_hi)``), ``0 <= j <= i`` and (``j < sink`` or ``j >= win_lo[b, m]``):
    :func:`prefill_plan.prefill_visibility`, which FA4 cannot call. The values live in
    tensors, not in the closure, so one compiled kernel serves every length, depth and batch
    (one function object: FA4 keys its compile cache on it).
    """
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def prhs_prefill_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        win_lo = aux_tensors[0]
        geo = aux_tensors[1]
        b = batch[0]
        win = utils.scalar_to_ssa(win_lo[b, m_idx[0]], cutlass.Int32)
        pad = utils.scalar_to_ssa(geo[b, 0], cutlass.Int32)
        q0 = utils.scalar_to_ssa(geo[b, 1], cutlass.Int32)
        f_lo = utils.scalar_to_ssa(geo[b, 2], cutlass.Int32)
        f_hi = utils.scalar_to_ssa(geo[b, 3], cutlass.Int32)
        sink = utils.scalar_to_ssa(geo[b, 4], cutlass.Int32)
        zero = utils.scalar_to_ssa(0, cutlass.Int32)
        i = m_idx + q0
        j = n_idx - pad
        active = (i >= zero) & ((i < f_lo) | (i >= f_hi))
        return active & (j >= zero) & (j <= i) & ((j < sink) | (j >= win))

    return prhs_prefill_mask


# ----------------------------------------------------------------------------- attention


def _first(res: Any) -> torch.Tensor:
    return res[0] if isinstance(res, tuple) else res


def flash_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: FlashBlockSparse, aux: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """FA4's block-sparse forward of ``q [B, Hq, Lq, D]`` over ``k``/``v`` ``[B, Hkv, Lk, D]`` (HF
    layout, read in place through strided views) with the tiles ``blocks`` and the aux tensors of
    :func:`mask_aux_tensors` → ``[B, Lq, Hq, D]`` contiguous."""
    from flash_attn.cute import flash_attn_func

    gqa = q.shape[1] != k.shape[1]
    res = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=float(scale), causal=False,
        mask_mod=prefill_mask_mod(), aux_tensors=aux, block_sparse_tensors=blocks.to_fa4(), pack_gqa=gqa,
    )
    return _first(res).contiguous()


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PrefillPlan, scale: float) -> torch.Tensor:
    """Sparse PSAW/ETF prefill attention through FA4's block-sparse forward (the prefill contract)."""
    _, _, _, D, _, Lk = plan.check(q, k, v)
    check_flash_inputs(q)
    require_flash_attn(q.device)
    plan = plan.on(q.device)
    block = fa4_block_size(torch.cuda.get_device_capability(q.device), D)
    blocks = fa4_block_sparse(plan, Lk, block)
    aux = mask_aux_tensors(plan, rows=blocks.kinds.shape[1] * block[0])
    return flash_block_sparse_attention(q, k, v, blocks, aux, scale)


def flash_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """FA4's dense causal forward (bottom-right aligned: the queries are the last ``Lq`` of ``Lk``
    keys, no padding) of HF-layout ``q``/``k``/``v`` → ``[B, Lq, Hq, D]`` contiguous."""
    check_flash_inputs(q)
    require_flash_attn(q.device)
    from flash_attn.cute import flash_attn_func

    res = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=float(scale), causal=True)
    return _first(res).contiguous()


def flash_dense_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pad: torch.Tensor,
    q_start: torch.Tensor,
    scale: float,
    *,
    no_mask: bool,
) -> torch.Tensor:
    """Dense causal prefill (every real key ``j <= i``) of a layer without a PSAW/ETF plan, through FA4.

    ``no_mask``: the forward had no attention mask (no padding). With it and ``Lq == Lk``, FA4's
    dense causal forward; else (left padding ``pad``/``q_start``, a StaticCache, cached tokens
    before the queries) the block-sparse forward with the dense pattern, exact like the sparse route.
    """
    if no_mask and q.shape[2] == k.shape[2]:
        return flash_causal_attention(q, k, v, scale)
    return flash_prefill_attention(q, k, v, PrefillPlan.dense_causal(pad, q_start, q.shape[2]), scale)
