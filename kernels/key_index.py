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

Stage 1 scores: fp8 ``scale * (q . code) * s_slot``; int4 ``scale * q . (code * s_group)``; pages
the Quest bound ``scale * sum_d max(q_d * max_d, q_d * min_d)``, computed as
``scale * (q+ . max + q- . min)`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``: the same value, two
dot products), every token of a page getting its page's bound; the best
``ceil((k + margin) / page)`` pages are taken and all their tokens inside the region are the
candidates. Grouped rows (``grouped=True``, one per KV head) rank by the maximum over the
group's heads in both stages, as :func:`~.topk_retrieval.topk_retrieval_grouped_reference`.
When ``k + margin`` covers the whole region the result equals the exact top-k bit for bit.

Layout as :mod:`.topk_retrieval` (Triton tutorial 06): kernels, launchers and the PyTorch
references (``*_reference``) side by side in this file.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .topk_retrieval import _group_scores, _topk_of_scores
from .triton_support import gqa_group

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
]

#: The index kinds implemented end to end (reference and Triton).
INDEX_KINDS = ("fp8", "int4", "pages")
#: Channels per int4 scale group.
INT4_GROUP = 32
#: Largest finite float8_e4m3fn value: the fp8 scale maps a key's largest channel onto it.
FP8_MAX = 448.0
#: Largest int4 code (symmetric: codes in [-7, 7]).
INT4_MAX = 7.0


class KeyIndex(NamedTuple):
    """One layer's key index: codes/bounds over the cache slots (slot = pad + real index)."""

    kind: str  # "fp8" | "int4" | "pages"
    a: torch.Tensor  # fp8: [B, Hkv, S, D] uint8; int4: [B, Hkv, S, D // 2] uint8; pages: [B, Hkv, P, D] page max
    b: torch.Tensor  # fp8: [B, Hkv, S] fp32; int4: [B, Hkv, S, D // INT4_GROUP] fp32; pages: [B, Hkv, P, D] page min
    page: int  # tokens per page (pages); 1 otherwise


def _check_kind(kind: str, head_dim: int, page: int) -> None:
    if kind not in INDEX_KINDS:
        raise ValueError(f"key index kind {kind!r}: expected one of {INDEX_KINDS}")
    if kind == "int4" and head_dim % INT4_GROUP != 0:
        raise ValueError(f"int4 key index: head_dim={head_dim} must be a multiple of {INT4_GROUP}")
    if kind == "pages" and (int(page) < 1 or int(page) & (int(page) - 1)):
        raise ValueError(f"pages key index: page={page}; expected a power of two >= 1")


def index_bytes_per_slot(kind: str, head_dim: int, dtype: torch.dtype, page: int) -> float:
    """Bytes of the key index per KV head and cache slot (the cache itself: ``head_dim`` x the
    dtype's size)."""
    _check_kind(kind, head_dim, page)
    if kind == "fp8":
        return float(head_dim + 4)
    if kind == "int4":
        return head_dim / 2 + 4 * head_dim / INT4_GROUP
    return 2 * head_dim * torch.empty((), dtype=dtype).element_size() / page


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


def _quantize(kind: str, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` entries of ``keys [..., D]`` for ``fp8`` / ``int4`` (module docstring)."""
    kf = keys.float()
    if kind == "fp8":
        amax = kf.abs().amax(dim=-1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        codes = (kf / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8), s
    D = kf.shape[-1]
    grouped = kf.reshape(*kf.shape[:-1], D // INT4_GROUP, INT4_GROUP)
    amax = grouped.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    codes = torch.floor(grouped / s.unsqueeze(-1) + 0.5).clamp(-INT4_MAX, INT4_MAX).to(torch.int32)
    codes = codes.reshape(*kf.shape[:-1], D // 2, 2) & 15
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8), s


def _int4_codes(a: torch.Tensor) -> torch.Tensor:
    """The signed codes ``[..., D]`` (fp32) of packed int4 bytes ``a [..., D / 2]``."""
    a = a.to(torch.int32)
    nib = torch.stack([a & 15, a >> 4], dim=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
    return ((nib ^ 8) - 8).float()


def dequantize_key_index(index: KeyIndex) -> torch.Tensor:
    """``code * scale`` of every slot of an ``fp8`` / ``int4`` index, ``[B, Hkv, S, D]`` fp32."""
    if index.kind == "fp8":
        return index.a.view(torch.float8_e4m3fn).float() * index.b.unsqueeze(-1)
    if index.kind == "int4":
        return _int4_codes(index.a) * index.b.repeat_interleave(INT4_GROUP, dim=-1)
    raise ValueError(f"dequantize_key_index: kind {index.kind!r} has no codes; expected 'fp8' or 'int4'")


def _page_bounds(k_cache: torch.Tensor, p0: int, p1: int, page: int, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    a, b = _quantize(index.kind, k_cache[:, :, start:end])
    index.a[:, :, start:end] = a
    index.b[:, :, start:end] = b


def update_key_index_reference(index: KeyIndex, k_cache: torch.Tensor, slot: torch.Tensor) -> None:
    """Write, in place, the entry of cache slot ``slot[b]`` (``[B]`` int) of every sequence ``b``
    from ``k_cache [B, Hkv, S, D]`` (a decode step's new key). ``pages``: the page of that slot is
    recomputed from its slots ``<= slot[b]``. Graph-safe: no host sync, fixed shapes."""
    B, H, S, D = k_cache.shape
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
    a, b = _quantize(index.kind, k_cache[bi, hi, slot[:, None]])  # [B, H, D] keys
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
        return torch.matmul(qf, dequantize_key_index(index).transpose(-1, -2)) * scale
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
    """Stage 1 candidates per row: ``k + margin`` tokens, or the pages that hold as many."""
    if int(k) < 0 or int(margin) < 0:
        raise ValueError(f"topk_retrieval_indexed: k={k}, margin={margin}; expected both >= 0")
    return math.ceil((int(k) + int(margin)) / int(page))


def topk_retrieval_indexed_reference(q: torch.Tensor, k_cache: torch.Tensor, index: KeyIndex, pad: torch.Tensor,
                                     lo: torch.Tensor, hi: torch.Tensor, retrieve: torch.Tensor, k: int, margin: int,
                                     scale: float, grouped: bool) -> torch.Tensor:
    """PyTorch reference of :func:`topk_retrieval_indexed`: two-stage top-k (module docstring).

    Args as :func:`~.topk_retrieval.topk_retrieval_reference` (``grouped=True``: as
    :func:`~.topk_retrieval.topk_retrieval_grouped_reference`, ``retrieve [B, Hkv]``), plus
    ``index`` (this layer's :class:`KeyIndex`, written for every slot the region reads) and
    ``margin`` (stage 1 keeps ``k + margin`` candidates).

    Returns:
        ``[B, H, k]`` int32 real indices, best exact score first, ties lower index first, ``-1``
        padded (also where the candidates are fewer than ``k``: pages cut by the region's ends).
    """
    _check_kind(index.kind, q.shape[-1], index.page)
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


# ----------------------------------------------------------------------------- launchers


def write_key_index(index: KeyIndex, k_cache: torch.Tensor, start: int, end: int) -> None:
    """Triton :func:`write_key_index_reference`."""
    raise NotImplementedError("write_key_index: the Triton kernel is not written yet; use the reference")


def update_key_index(index: KeyIndex, k_cache: torch.Tensor, slot: torch.Tensor) -> None:
    """Triton :func:`update_key_index_reference`."""
    raise NotImplementedError("update_key_index: the Triton kernel is not written yet; use the reference")


def topk_retrieval_indexed(q: torch.Tensor, k_cache: torch.Tensor, index: KeyIndex, pad: torch.Tensor,
                           lo: torch.Tensor, hi: torch.Tensor, retrieve: torch.Tensor, k: int, margin: int,
                           scale: float, grouped: bool) -> torch.Tensor:
    """Triton :func:`topk_retrieval_indexed_reference`."""
    raise NotImplementedError("topk_retrieval_indexed: the Triton kernels are not written yet; use the reference")
