"""A compressed copy of the key cache (the *key index*) and the two-stage top-k retrieval on it.

The exact retrieval (:mod:`.topk_retrieval`) reads every bf16 key of the middle region. The key
index holds a low-precision copy of K beside the cache, written at prefill
(:func:`write_key_index`) and at every decode step (:func:`update_key_index`, graph-safe: one
launch, no host sync, fixed shapes). :func:`topk_retrieval_indexed` then retrieves in two
stages: (1) approximate scores from the index over the region and the best ``k + margin``
candidates; (2) the exact fp32 score of every candidate from the bf16 keys and the ``k`` best,
in the contract of :func:`~.topk_retrieval.topk_retrieval_reference` (``[B, H, k]`` int32 real
indices, best first, ties lower index first, ``-1`` padded; rows not retrieving all ``-1``).

Index kinds (:data:`INDEX_KINDS`), all over cache *slots* (slot = pad + real index):

* ``fp8``: ``a [B, Hkv, S, D]`` uint8, the float8_e4m3fn bits of ``key / scale``; ``b [B, Hkv, S]``
  fp32 the per-(head, slot) scale ``amax(|key|) / 448`` (1 for a zero key). Codes round to
  nearest even, clamped to ``±448``.
* ``int4``: ``a [B, Hkv, S, D / 2]`` uint8, two signed 4-bit codes per byte (low nibble: the even
  channel), symmetric in ``[-7, 7]``; ``b [B, Hkv, S, D / INT4_GROUP]`` fp32 the scale ``amax / 7``
  of each group of :data:`INT4_GROUP` channels (1 for a zero group). Codes are
  ``floor(key / scale + 0.5)`` clamped to ``[-7, 7]`` (round to nearest, ties upward).
* ``pages``: ``a`` / ``b [B, Hkv, ceil(S / page), D]`` the per-channel max / min of each page of
  ``page`` slots, in the cache dtype (Quest). A page's bounds cover exactly the slots written so
  far, left-pad slots included: the bound is an upper bound of every written key of the page,
  the real ones among them.

Centred codes (``KeyIndex.center``, fp8 and int4): the codes then hold ``key - center`` with
``center [B, Hkv, D]`` fp32 one vector per (sequence, KV head), the mean of the prompt's keys
(:func:`key_index_center`, set by the caller before the first write). Many models' keys share a
large component (a ``k_proj`` bias, slow RoPE channels); quantising what is left of each key
keeps the rounding error small against the differences between keys' scores. Stage 1 omits
``q . center``, the same for every key of a row, so a centred index ranks per-head rows as
``q . (code * s + center)`` would; a grouped row's maximum over its heads would not be, so
grouped rows take an index without a centre.

Stage 1 scores: fp8 ``scale * (q . code) * s_slot``; int4 ``scale * q . (code * s_group)``; pages
the Quest bound ``scale * sum_d max(q_d * max_d, q_d * min_d)``, computed as
``scale * (q+ . max + q- . min)`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``: the same value, two
dot products), every token of a page getting its page's bound; the best
``ceil((k + margin + 2 * (page - 1)) / page)`` pages are taken (:func:`candidate_count`) and all
their tokens inside the region are the candidates: at least ``k + margin`` of them, or the whole
region, even where the two pages cut by the region's ends hold one token of it each. Grouped rows
(``grouped=True``, one per KV head) rank by the maximum over the group's heads in both stages, as
:func:`~.topk_retrieval.topk_retrieval_grouped_reference`.
When ``k + margin`` covers the whole region the result equals the exact top-k bit for bit.

Layout as :mod:`.topk_retrieval` (Triton tutorial 06): kernels, launchers and the PyTorch
references (``*_reference``) side by side in this file.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..topk.topk_retrieval import _dot, _group_scores, _retrieve, _topk_of_scores
from ..topk.topk_select import _orderable_key
from ..triton_support import gqa_group, interpreting, next_pow2, require_triton, tl, triton

__all__ = [
    "INDEX_KINDS",
    "INT4_GROUP",
    "FP8_MAX",
    "KeyIndex",
    "index_bytes_per_slot",
    "allocate_key_index",
    "write_key_index_reference",
    "update_key_index_reference",
    "topk_retrieval_indexed_reference",
    "dequantize_key_index",
    "key_index_center",
    "write_key_index",
    "update_key_index",
    "topk_retrieval_indexed",
    "RERANK_MAX",
]

#: The index kinds implemented end to end (reference and Triton).
INDEX_KINDS = ("fp8", "int4", "pages")
#: Channels per int4 scale group.
INT4_GROUP = 32
#: Largest finite float8_e4m3fn value: the fp8 scale maps a key's largest channel onto it.
FP8_MAX = 448.0
#: Largest int4 code (symmetric: codes in [-7, 7]).
INT4_MAX = 7.0
#: Most stage-1 candidate tokens per row (``k + margin``; pages: the tokens of
#: :func:`candidate_count` pages) the re-rank sorts in one program's registers.
RERANK_MAX = 8192
#: The score kernel's key format of each kind (topk_retrieval._score_tile).
_KFMT = {"fp8": 1, "int4": 2, "pages": 3}


class KeyIndex(NamedTuple):
    """One layer's key index: codes/bounds over the cache slots (slot = pad + real index)."""

    kind: str  # "fp8" | "int4" | "pages"
    a: torch.Tensor  # fp8: [B, Hkv, S, D] uint8; int4: [B, Hkv, S, D // 2] uint8; pages: [B, Hkv, P, D] page max
    b: torch.Tensor  # fp8: [B, Hkv, S] fp32; int4: [B, Hkv, S, D // INT4_GROUP] fp32; pages: [B, Hkv, P, D] page min
    page: int  # tokens per page (pages); 1 otherwise
    center: torch.Tensor | None = None  # fp8 / int4: [B, Hkv, D] fp32 subtracted before quantising (None: 0)


def _check_kind(kind: str, head_dim: int, page: int) -> None:
    if kind not in INDEX_KINDS:
        raise ValueError(f"key index kind {kind!r}: expected one of {INDEX_KINDS}")
    if kind == "int4" and head_dim % INT4_GROUP != 0:
        raise ValueError(f"int4 key index: head_dim={head_dim} must be a multiple of {INT4_GROUP}")
    if kind == "pages" and (int(page) < 1 or int(page) & (int(page) - 1)):
        raise ValueError(f"pages key index: page={page}; expected a power of two >= 1")


def _check_index(index: KeyIndex, head_dim: int) -> None:
    """Raise unless ``index`` is a key index of its kind for keys of ``head_dim`` channels."""
    _check_kind(index.kind, head_dim, index.page)
    if index.kind != "pages" and index.page != 1:
        raise ValueError(f"{index.kind} key index: page={index.page}; expected 1 (pages are the 'pages' kind's)")
    if index.center is not None and (index.kind == "pages" or index.center.shape != (*index.a.shape[:2], head_dim)
                                     or index.center.dtype != torch.float32):
        raise ValueError(f"{index.kind} key index: center of shape {tuple(index.center.shape)} "
                         f"({index.center.dtype}); expected [B, Hkv, {head_dim}] float32, fp8 and int4 only")
    width = head_dim // 2 if index.kind == "int4" else head_dim
    if index.a.dim() != 4 or index.a.shape[-1] != width:
        raise ValueError(f"{index.kind} key index: a of shape {tuple(index.a.shape)}; expected [B, Hkv, slots, {width}]"
                         f" for head_dim {head_dim} (allocate_key_index makes one)")


def _check_rows(index: KeyIndex, grouped: bool) -> None:
    """Raise for a centred index asked to rank grouped rows (its stage 1 omits each head's ``q . center``)."""
    if grouped and index.center is not None:
        raise ValueError("topk_retrieval_indexed: a centred key index (KeyIndex.center) ranks per-head rows only "
                         "(grouped=False); grouped rows take an index without a centre")


def index_bytes_per_slot(kind: str, head_dim: int, dtype: torch.dtype, page: int) -> float:
    """Bytes of the key index per KV head and cache slot (the cache itself: ``head_dim`` x the
    dtype's size)."""
    _check_kind(kind, head_dim, page)
    if kind == "fp8":
        return float(head_dim + 4)
    if kind == "int4":
        return head_dim / 2 + 4 * head_dim / INT4_GROUP
    return 2 * head_dim * dtype.itemsize / page


def allocate_key_index(kind: str, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device | str, page: int = 16) -> KeyIndex:
    """A zeroed key index of ``kind`` for ``slots`` cache slots (``page``: tokens per page of
    ``"pages"``, ignored otherwise)."""
    _check_kind(kind, head_dim, page)
    B, H, S, D = int(batch), int(kv_heads), int(slots), int(head_dim)
    if kind == "fp8":
        return KeyIndex(kind, torch.zeros(B, H, S, D, dtype=torch.uint8, device=device),
                        torch.zeros(B, H, S, dtype=torch.float32, device=device), 1)
    if kind == "int4":
        return KeyIndex(kind, torch.zeros(B, H, S, D // 2, dtype=torch.uint8, device=device),
                        torch.zeros(B, H, S, D // INT4_GROUP, dtype=torch.float32, device=device), 1)
    P = -(-S // int(page))
    return KeyIndex(kind, torch.zeros(B, H, P, D, dtype=dtype, device=device),
                    torch.zeros(B, H, P, D, dtype=dtype, device=device), int(page))


# ----------------------------------------------------------------------------- references


def _true_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device, as the kernels' ``div_rn``: PyTorch's CUDA
    division by a Python scalar multiplies by its rounded reciprocal instead (1 ulp off at times)."""
    return x / torch.full_like(x, divisor)


def key_index_center(k_cache: torch.Tensor, pad: torch.Tensor, end: int) -> torch.Tensor:
    """The centre of a centred index (module docstring): the mean of each (sequence, KV head)'s keys
    in its real slots ``[pad[b], end)`` of ``k_cache [B, Hkv, S, D]``, ``[B, Hkv, D]`` fp32 (0 for a
    sequence with none). Any centre gives a correct index; this one makes it most precise."""
    B, H, S, D = k_cache.shape
    end = min(int(end), S)
    slot = torch.arange(end, device=k_cache.device)
    real = (slot[None, :] >= pad.long().view(B, 1)).to(torch.float32)  # [B, end]
    total = torch.einsum("bs,bhsd->bhd", real, k_cache[:, :, :end].float())
    return total / real.sum(dim=1).clamp_min(1.0).view(B, 1, 1)


def _quantize(kind: str, keys: torch.Tensor, center: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` entries of ``keys [..., D]`` for ``fp8`` / ``int4`` (module docstring), of
    ``keys - center`` where a centre (broadcasting to ``keys``) is given."""
    kf = keys.float() if center is None else keys.float() - center
    if kind == "fp8":
        amax = kf.abs().amax(dim=-1)
        s = torch.where(amax > 0, _true_div(amax, FP8_MAX), torch.ones_like(amax))
        codes = (kf / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8), s
    D = kf.shape[-1]
    grouped = kf.reshape(*kf.shape[:-1], D // INT4_GROUP, INT4_GROUP)
    amax = grouped.abs().amax(dim=-1)
    s = torch.where(amax > 0, _true_div(amax, INT4_MAX), torch.ones_like(amax))
    codes = torch.floor(grouped / s.unsqueeze(-1) + 0.5).clamp(-INT4_MAX, INT4_MAX).to(torch.int32)
    codes = codes.reshape(*kf.shape[:-1], D // 2, 2) & 15
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8), s


def _int4_codes(a: torch.Tensor) -> torch.Tensor:
    """The signed codes ``[..., D]`` (fp32) of packed int4 bytes ``a [..., D / 2]``."""
    a = a.to(torch.int32)
    nib = torch.stack([a & 15, a >> 4], dim=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
    return ((nib ^ 8) - 8).float()


def dequantize_key_index(index: KeyIndex) -> torch.Tensor:
    """The keys an ``fp8`` / ``int4`` index stands for, ``code * scale`` (plus the centre of a centred
    one) of every slot, ``[B, Hkv, S, D]`` fp32."""
    codes = _dequantize_codes(index)
    return codes if index.center is None else codes + index.center.unsqueeze(2)


def _dequantize_codes(index: KeyIndex) -> torch.Tensor:
    """``code * scale`` of every slot (a centred index's keys less its centre), ``[B, Hkv, S, D]`` fp32."""
    if index.kind == "fp8":
        return index.a.view(torch.float8_e4m3fn).float() * index.b.unsqueeze(-1)
    if index.kind == "int4":
        return _int4_codes(index.a) * index.b.repeat_interleave(INT4_GROUP, dim=-1)
    raise ValueError(f"dequantize_key_index: kind {index.kind!r} has no codes; expected 'fp8' or 'int4'")


def _page_bounds(k_cache: torch.Tensor, p0: int, p1: int, page: int,
                 last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(max, min)`` of pages ``[p0, p1)`` of ``k_cache [B, Hkv, S, D]`` over their
    slots ``<= last`` (``last`` broadcasting to ``[B, 1, pages, page]``): ``[B, Hkv, pages, D]``."""
    B, H, S, D = k_cache.shape
    n = (p1 - p0) * page
    ks = k_cache[:, :, p0 * page: p0 * page + n]
    if ks.shape[2] < n:  # the last page runs past the cache end
        ks = torch.cat([ks, ks.new_zeros(B, H, n - ks.shape[2], D)], dim=2)
    ks = ks.reshape(B, H, p1 - p0, page, D)
    slot = p0 * page + torch.arange(n, device=k_cache.device).reshape(1, 1, p1 - p0, page)
    keep = (slot <= last).unsqueeze(-1)  # [B or 1, 1, pages, page, 1]
    mx = torch.where(keep, ks, torch.full_like(ks, float("-inf"))).amax(dim=3)
    mn = torch.where(keep, ks, torch.full_like(ks, float("inf"))).amin(dim=3)
    return mx, mn


def write_key_index_reference(index: KeyIndex, k_cache: torch.Tensor, start: int, end: int) -> None:
    """Write, in place, the index entries of cache slots ``[start, end)`` from ``k_cache
    [B, Hkv, S, D]`` (a prefill or a chunk of one). ``pages``: every page that overlaps
    ``[start, end)`` is recomputed from all its slots ``< end``."""
    _check_index(index, k_cache.shape[-1])
    start, end = max(int(start), 0), min(int(end), k_cache.shape[2])
    if start >= end:
        return
    if index.kind == "pages":
        p0, p1 = start // index.page, -(-end // index.page)
        last = torch.tensor(end - 1, device=k_cache.device)
        mx, mn = _page_bounds(k_cache, p0, p1, index.page, last)
        index.a[:, :, p0:p1] = mx.to(index.a.dtype)
        index.b[:, :, p0:p1] = mn.to(index.b.dtype)
        return
    center = None if index.center is None else index.center.unsqueeze(2)
    a, b = _quantize(index.kind, k_cache[:, :, start:end], center)
    index.a[:, :, start:end] = a
    index.b[:, :, start:end] = b


def update_key_index_reference(index: KeyIndex, k_cache: torch.Tensor, slot: torch.Tensor) -> None:
    """Write, in place, the entry of cache slot ``slot[b]`` (``[B]`` int) of every sequence ``b``
    from ``k_cache [B, Hkv, S, D]`` (a decode step's new key). ``pages``: the page of that slot is
    recomputed from its slots ``<= slot[b]``. Graph-safe: no host sync, fixed shapes."""
    B, H, S, D = k_cache.shape
    _check_index(index, D)
    dev = k_cache.device
    bi = torch.arange(B, device=dev)[:, None]
    hi = torch.arange(H, device=dev)[None, :]
    slot = slot.long().reshape(B)
    if index.kind == "pages":
        page = index.page
        pg = slot // page  # [B]
        rows = pg[:, None] * page + torch.arange(page, device=dev)[None, :]  # [B, page] the page's slots
        ks = k_cache[bi[:, :, None], hi[:, :, None], rows.clamp_max(S - 1)[:, None, :]]  # [B, H, page, D]
        keep = (rows <= slot[:, None])[:, None, :, None]
        mx = torch.where(keep, ks, torch.full_like(ks, float("-inf"))).amax(dim=2)
        mn = torch.where(keep, ks, torch.full_like(ks, float("inf"))).amin(dim=2)
        index.a.index_put_((bi, hi, pg[:, None]), mx.to(index.a.dtype))
        index.b.index_put_((bi, hi, pg[:, None]), mn.to(index.b.dtype))
        return
    a, b = _quantize(index.kind, k_cache[bi, hi, slot[:, None]], index.center)  # [B, H, D] keys
    index.a.index_put_((bi, hi, slot[:, None]), a)
    index.b.index_put_((bi, hi, slot[:, None]), b)


def _approx_scores(q: torch.Tensor, index: KeyIndex, scale: float) -> torch.Tensor:
    """Stage 1 scores ``[B, Hkv, G, S']`` fp32 over the index's slots (pages: ``S'`` pages)."""
    B, Hq, D = q.shape
    Hkv = index.a.shape[1]
    qf = q.float().reshape(B, Hkv, gqa_group(Hq, Hkv), D)
    if index.kind == "fp8":
        codes = index.a.view(torch.float8_e4m3fn).float()
        return torch.matmul(qf, codes.transpose(-1, -2)) * index.b.unsqueeze(2) * scale
    if index.kind == "int4":
        return torch.matmul(qf, _dequantize_codes(index).transpose(-1, -2)) * scale
    qpos, qneg = qf.clamp_min(0), qf.clamp_max(0)
    return (torch.matmul(qpos, index.a.float().transpose(-1, -2))
            + torch.matmul(qneg, index.b.float().transpose(-1, -2))) * scale


def page_region(pad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, slots: int,
                page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pad, lo, hi)`` of the pages a region covers: zero pad, the pages ``[lo_p, hi_p)`` that
    hold a slot of the (clipped) region ``[pad + lo, pad + hi)``; empty where the region is."""
    lo_c = lo.long().clamp_min(0)
    hi_c = torch.minimum(hi.long(), slots - pad.long())
    lo_p = (pad.long() + lo_c) // page
    hi_p = torch.where(hi_c > lo_c, (pad.long() + hi_c + page - 1) // page, lo_p)
    return torch.zeros_like(pad), lo_p.to(torch.int32), hi_p.to(torch.int32)


def candidate_count(k: int, margin: int, page: int) -> int:
    """Stage 1 candidates per row: ``k + margin`` tokens (``page`` 1), or enough pages that their
    tokens inside the region number at least ``k + margin`` (or the whole region) wherever it starts
    and ends, ``ceil((k + margin + 2 * (page - 1)) / page)``: the region's first and last pages may
    each hold as few as one of its tokens."""
    if int(k) < 0 or int(margin) < 0:
        raise ValueError(f"topk_retrieval_indexed: k={k}, margin={margin}; expected both >= 0")
    return math.ceil((int(k) + int(margin) + 2 * (int(page) - 1)) / int(page))


def topk_retrieval_indexed_reference(q: torch.Tensor, k_cache: torch.Tensor, index: KeyIndex, pad: torch.Tensor,
                                     lo: torch.Tensor, hi: torch.Tensor, retrieve: torch.Tensor, k: int, margin: int,
                                     scale: float, grouped: bool) -> torch.Tensor:
    """PyTorch reference of :func:`topk_retrieval_indexed`: two-stage top-k (module docstring).

    Args as :func:`~.topk_retrieval.topk_retrieval_reference` (``grouped=True``: as
    :func:`~.topk_retrieval.topk_retrieval_grouped_reference`, ``retrieve [B, Hkv]``), plus
    ``index`` (this layer's :class:`KeyIndex`, written for every slot the region reads) and
    ``margin`` (stage 1 keeps ``k + margin`` candidates; pages: :func:`candidate_count` pages,
    whose tokens inside the region are at least as many, or the whole region).

    Returns:
        ``[B, H, k]`` int32 real indices, best exact score first, ties lower index first, ``-1``
        padded: a retrieving row holds ``min(k, region)`` indices.
    """
    _check_index(index, q.shape[-1])
    _check_rows(index, grouped)
    B, Hq, D = q.shape
    S = k_cache.shape[2]
    n_cand = candidate_count(k, margin, index.page)

    def rows(scores: torch.Tensor) -> torch.Tensor:  # [B, Hkv, G, S] -> the rows' [B, H, S]
        return scores.amax(dim=2) if grouped else scores.reshape(B, Hq, -1)

    approx = rows(_approx_scores(q, index, scale))
    if index.kind == "pages":
        ppad, plo, phi = page_region(pad, lo, hi, S, index.page)
        pages = _topk_of_scores(approx, ppad, plo, phi, retrieve, n_cand).long()  # [B, H, n] page ids
        tokens = pages.unsqueeze(-1) * index.page + torch.arange(index.page, device=q.device)  # [B, H, n, page]
        slots = torch.where(pages.unsqueeze(-1) >= 0, tokens, -1).flatten(-2)
    else:
        cand = _topk_of_scores(approx, pad, lo, hi, retrieve, n_cand).long()  # real indices
        slots = torch.where(cand >= 0, cand + pad.long().view(B, 1, 1), -1)
    # candidate slots -> a [B, H, S] mask (slot -1 and slots past the cache go to a dropped column)
    slots = torch.where((slots >= 0) & (slots < S), slots, S)
    mask = torch.zeros(*slots.shape[:2], S + 1, dtype=torch.bool, device=q.device)
    mask.scatter_(-1, slots, True)
    exact = rows(_group_scores(q, k_cache, scale))
    return _topk_of_scores(exact, pad, lo, hi, retrieve, k, candidates=mask[..., :S])


# ----------------------------------------------------------------------------- kernels
# Design (no host sync; every grid from B, H, S, k and margin only):
#   * write / update: one program per (sequence, KV head) and block of slots (or page); the update is
#     one launch per layer and step, the slot of each sequence read on the device.
#   * stage 1: topk_retrieval's group score kernel with the index's key format (each live KV group's
#     index read once for its G heads, one tensor-core dot per tile; pages: two, over the pages), then
#     its selects for the k + margin best (pages: over the pages, with pad 0 and the region in pages).
#   * stage 2 (`_rerank_kernel`): one program per row; the retrieving rows gather their candidates'
#     keys from the cache, score them exactly (one dot per block, the group's maximum in grouped mode),
#     pack each as ``orderable score << 32 | ~index`` (all distinct; descending order is the output
#     order) and sort them in registers.


@triton.jit
def _fp8_e4m3_bits(x):
    """The float8_e4m3fn bits (uint8) of fp32 ``x`` in ``[-448, 448]``, rounded to nearest even, in
    integer arithmetic (the same bits on every backend; the interpreter's own conversion does not
    round to nearest even)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    mag = bits & 2147483647
    # normal (>= 2^-6): keep 3 of the 23 mantissa bits, ties to even, rebias the exponent (127 -> 7)
    r = (mag + 524287 + ((mag >> 20) & 1)) >> 20
    normal = r - ((127 - 7) << 3)
    # subnormal: the multiple of 2^-9 nearest (ties even: the fp32 add of 2^23 rounds so); 8 is 2^-6
    sub = ((tl.abs(x) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return (tl.where(mag >= (121 << 23), normal, sub) | sign).to(tl.uint8)


@triton.jit
def _index_write_kernel(
    K, A, BS, C, SLOT, start, end,
    stride_kb, stride_kh, stride_ks, stride_ab, stride_ah, stride_as, stride_bb, stride_bh, stride_bs,
    stride_cb, stride_ch,
    HKV: tl.constexpr, KIND: tl.constexpr, FROM_SLOT: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CENTERED: tl.constexpr,
):
    """Index entries of one (sequence, KV head) (program 0 axis) from the keys of K. FROM_SLOT (the
    update): the slot ``SLOT[b]``; else (the write) block ``program_id(1)`` of slots ``[start, end)``.
    KIND 1 fp8, 2 int4 (BLOCK_S slots per program, one with FROM_SLOT); 3 pages (one page per
    program, PAGE = BLOCK_S: its bounds over its slots up to the slot / below ``end``). CENTERED (1, 2):
    the codes of ``key - C[b, h]``."""
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    offs_s = tl.arange(0, BLOCK_S)
    if FROM_SLOT:
        last = tl.load(SLOT + b).to(tl.int64)
        if KIND == 3:
            first = (last // PAGE) * PAGE
        else:
            first = last
    else:
        last = end - 1
        if KIND == 3:
            first = ((start // PAGE) + tl.program_id(1)) * PAGE
        else:
            first = start + tl.program_id(1) * BLOCK_S
    rows = first + offs_s
    m = rows <= last
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    mk = m[:, None] & dmask[None, :]
    kp = K + b.to(tl.int64) * stride_kb + h * stride_kh + rows.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    a_base = A + b.to(tl.int64) * stride_ab + h * stride_ah
    b_base = BS + b.to(tl.int64) * stride_bb + h * stride_bh
    kt = tl.load(kp, mask=mk, other=0.0).to(tl.float32)  # pages: min / max exact in fp32, stored back exactly
    if CENTERED:  # fp8 / int4 (the launcher's): the codes of key - C[b, h]
        kt = kt - tl.load(C + b.to(tl.int64) * stride_cb + h * stride_ch + offs_d, mask=dmask, other=0.0)[None, :]
    if KIND == 3:
        mx = tl.max(tl.where(mk, kt, float("-inf")), axis=0)
        mn = tl.min(tl.where(mk, kt, float("inf")), axis=0)
        pg = first // PAGE
        tl.store(a_base + pg * stride_as + offs_d, mx.to(A.dtype.element_ty), mask=dmask)
        tl.store(b_base + pg * stride_bs + offs_d, mn.to(BS.dtype.element_ty), mask=dmask)
    elif KIND == 1:
        amax = tl.max(tl.abs(kt), axis=1)
        sc = tl.where(amax > 0, tl.div_rn(amax, tl.full([BLOCK_S], 448.0, tl.float32)), 1.0)
        x = tl.div_rn(kt, tl.broadcast_to(sc[:, None], [BLOCK_S, BLOCK_D]))
        code = _fp8_e4m3_bits(tl.minimum(tl.maximum(x, -448.0), 448.0))
        tl.store(a_base + rows.to(tl.int64)[:, None] * stride_as + offs_d[None, :], code, mask=mk)
        tl.store(b_base + rows.to(tl.int64) * stride_bs, sc, mask=m)
    else:
        kg = tl.reshape(kt, [BLOCK_S, BLOCK_D // 32, 32])
        amax = tl.max(tl.abs(kg), axis=2)
        sc = tl.where(amax > 0, tl.div_rn(amax, tl.full([BLOCK_S, BLOCK_D // 32], 7.0, tl.float32)), 1.0)
        x = tl.div_rn(kg, tl.broadcast_to(sc[:, :, None], [BLOCK_S, BLOCK_D // 32, 32]))
        code = tl.minimum(tl.maximum(tl.floor(x + 0.5), -7.0), 7.0).to(tl.int32) & 15
        even, odd = tl.split(tl.reshape(code, [BLOCK_S, BLOCK_D // 2, 2]))
        byte = (even | (odd << 4)).to(tl.uint8)
        offs_h = tl.arange(0, BLOCK_D // 2)
        tl.store(a_base + rows.to(tl.int64)[:, None] * stride_as + offs_h[None, :], byte,
                 mask=m[:, None] & (offs_h < D // 2)[None, :])
        offs_g = tl.arange(0, BLOCK_D // 32)
        tl.store(b_base + rows.to(tl.int64)[:, None] * stride_bs + offs_g[None, :], sc,
                 mask=m[:, None] & (offs_g < D // 32)[None, :])


@triton.jit
def _rerank_kernel(
    Q, K, CAND, FLAG, OUT, SCR, PAD, LO, HI,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, scale, S, KOUT, NC,
    H: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, GROUPED: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    C_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    """Stage 2 of one row (``b * H + r``): its NC candidates (real indices, or PAGED: pages of PAGE slots)
    scored exactly on the keys of K and the KOUT best written to OUT, best first, ties lower index
    first, -1 padded (all -1 for a row that does not retrieve). SCR: C_PAD int64 per row."""
    row = tl.program_id(0)
    b = row // H
    r = row % H
    offs_c = tl.arange(0, C_PAD)
    out_row = OUT + row.to(tl.int64) * KOUT
    if tl.load(FLAG + row) == 0:
        tl.store(out_row + offs_c, tl.full([C_PAD], -1, tl.int32), mask=offs_c < KOUT)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        if GROUPED:
            kvh = r
            head = r * GROUP + offs_m
            mrow = offs_m < GROUP
        else:
            kvh = r // GROUP
            head = r + offs_m * 0
            mrow = offs_m < 1
        q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mrow[:, None] & dmask[None, :], other=0.0)
        if IEEE:
            q = q.to(tl.float32)
        pad = tl.load(PAD + b)
        lo = tl.maximum(tl.load(LO + b), 0)
        hi = tl.minimum(tl.load(HI + b), S - pad)
        k_base = K + b.to(tl.int64) * stride_kb + kvh * stride_kh
        cand_base = CAND + row.to(tl.int64) * NC
        scr = SCR + row.to(tl.int64) * C_PAD
        for c0 in range(0, C_PAD, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            if PAGED:
                pg = tl.load(cand_base + c // PAGE, mask=c < NC * PAGE, other=-1)
                real = pg * PAGE + c % PAGE - pad
            else:
                pg = tl.load(cand_base + c, mask=c < NC, other=-1)
                real = pg
            valid = (pg >= 0) & (real >= lo) & (real < hi)
            kt = tl.load(k_base + (pad + real).to(tl.int64)[None, :] * stride_ks + offs_d[:, None],
                         mask=valid[None, :] & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_C]
            s = (_dot(q, kt, IEEE) * scale).to(tl.float32)
            s = tl.max(tl.where(mrow[:, None], s, float("-inf")), axis=0)
            packed = (_orderable_key(s).to(tl.int64) << 32) | (2147483647 - real).to(tl.int64)
            tl.store(scr + c, tl.where(valid, packed, -9223372036854775808))
        tl.debug_barrier()
        x = tl.sort(tl.load(scr + offs_c), descending=True)
        idx = tl.where(x != -9223372036854775808, (2147483647 - (x & 4294967295)).to(tl.int32), -1)
        tl.store(out_row + offs_c, idx, mask=offs_c < KOUT)


# ----------------------------------------------------------------------------- launchers


def _write(index: KeyIndex, k_cache: torch.Tensor, start: int, end: int, slot: torch.Tensor | None) -> None:
    """Launch the write (``slot`` None: slots ``[start, end)``) or the update (``slot [B]``)."""
    require_triton(k_cache, index.a)
    B, H, S, D = k_cache.shape
    _check_index(index, D)
    kind = _KFMT[index.kind]
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    from_slot = slot is not None
    block_s = index.page if kind == 3 else (1 if from_slot else 16)
    if from_slot:
        grid: tuple[int, ...] = (B * H,)
    else:
        n = -(-end // index.page) - start // index.page if kind == 3 else triton.cdiv(end - start, block_s)
        grid = (B * H, n)
        slot = torch.zeros(1, dtype=torch.int32, device=k_cache.device)  # unused
    a, bs = index.a, index.b
    center = bs if index.center is None else index.center.contiguous()  # unused without a centre
    _index_write_kernel[grid](
        k_cache, a, bs, center, slot, start, end,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), a.stride(0), a.stride(1), a.stride(2),
        bs.stride(0), bs.stride(1), bs.stride(2), center.stride(0), center.stride(1),
        HKV=H, KIND=kind, FROM_SLOT=from_slot, PAGE=index.page, BLOCK_S=block_s, D=D,
        BLOCK_D=next_pow2(D, 32), CENTERED=index.center is not None, num_warps=4,
    )


def write_key_index(index: KeyIndex, k_cache: torch.Tensor, start: int, end: int) -> None:
    """Triton :func:`write_key_index_reference`: one launch, a program per (sequence, KV head) and
    block of 16 slots (pages: per page)."""
    start, end = max(int(start), 0), min(int(end), k_cache.shape[2])
    if start < end:
        _write(index, k_cache, start, end, None)


def update_key_index(index: KeyIndex, k_cache: torch.Tensor, slot: torch.Tensor) -> None:
    """Triton :func:`update_key_index_reference`: one launch (a program per sequence and KV head, the
    slot read on the device), graph-safe."""
    _write(index, k_cache, 0, 0, slot.reshape(-1).to(torch.int32))


def topk_retrieval_indexed(q: torch.Tensor, k_cache: torch.Tensor, index: KeyIndex, pad: torch.Tensor,
                           lo: torch.Tensor, hi: torch.Tensor, retrieve: torch.Tensor, k: int, margin: int,
                           scale: float, grouped: bool) -> torch.Tensor:
    """Triton :func:`topk_retrieval_indexed_reference` (no host sync, grids from shapes only).

    Stage 1 is :func:`~.topk_retrieval.topk_retrieval`'s score launch on the index (its key format)
    and its select of the ``k + margin`` best (pages: of :func:`candidate_count` pages); stage 2 one
    launch of the re-rank, a program per row. The candidate tokens, ``k + margin`` (pages: the
    tokens of those pages), must be at most :data:`RERANK_MAX` (they are sorted in registers)."""
    require_triton(q, k_cache, index.a)
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    _check_index(index, D)
    _check_rows(index, grouped)
    n_cand = candidate_count(k, margin, index.page)
    tokens = n_cand * index.page
    if tokens > RERANK_MAX:
        paged = (f" (pages of {index.page}: {n_cand} pages, room for the region's cut end pages included, "
                 f"{tokens} tokens)" if index.page > 1 else "")
        raise ValueError(f"topk_retrieval_indexed: k + margin = {int(k) + int(margin)}{paged} exceeds "
                         f"RERANK_MAX = {RERANK_MAX} candidate tokens")
    group = gqa_group(Hq, Hkv)
    H = Hkv if grouped else Hq
    k = int(k)
    if k == 0 or B * H == 0 or S == 0:
        return torch.full((B, H, k), -1, dtype=torch.int32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    kfmt = _KFMT[index.kind]
    if kfmt == 3:
        spad, slo, shi = page_region(pad, lo, hi, S, index.page)
    else:
        spad, slo, shi = pad, lo, hi
    cand = _retrieve(q, index.a, spad, slo, shi, retrieve, n_cand, scale, grouped=grouped, key_format=kfmt,
                     key_b=index.b)
    c_pad = next_pow2(tokens, 16)
    out = torch.empty((B, H, k), dtype=torch.int32, device=q.device)
    scratch = torch.empty((B * H, c_pad), dtype=torch.int64, device=q.device)
    block_d = next_pow2(D, 16)
    _rerank_kernel[(B * H,)](
        q, k_cache, cand, retrieve.reshape(-1).contiguous(), out, scratch, pad, lo, hi,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), float(scale), S, k,
        n_cand, H=H, HKV=Hkv, GROUP=group, GROUPED=grouped, PAGED=kfmt == 3, PAGE=index.page, D=D,
        BLOCK_M=max(16, next_pow2(group if grouped else 1)), BLOCK_C=min(c_pad, max(16, 8192 // block_d)),
        BLOCK_D=block_d, C_PAD=c_pad, IEEE=q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16),
        num_warps=8 if c_pad >= 2048 else 4,
    )
    return out
