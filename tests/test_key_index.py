"""The key index (prhs_hf/ops/key_index/key_index.py): quantisation, page bounds, the two-stage retrieval.

* the PyTorch references against naive per-element loops written here (the naive oracle):
  fp8 / int4 codes and scales, page min/max over the written slots only, write vs update,
  the two-stage retrieval (exact top-k when ``k + margin`` covers the region, else the exact
  re-rank of the stage-1 candidates), per-head and grouped, left padding, empty regions, ``k``
  larger than the region, rows not retrieving, pages cut by the region's ends (still ``min(k,
  region)`` indices at small margins);
* ``decode_ops.cis_select`` with and without a key index;
* each Triton launcher against its reference (``TRITON_INTERPRET=1`` on the CPU, or CUDA), and
  ``gpu``-marked tests at realistic sizes.

Run on a CPU: ``TRITON_INTERPRET=1 pytest tests/test_key_index.py``.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from conftest import triton_available
from test_topk_select import _has_cuda_backend
from prhs_hf.ops.decode_ops import REFERENCE_OPS, TRITON_OPS, cis_select
from prhs_hf.ops.key_index.key_index import (
    FP8_MAX,
    INDEX_KINDS,
    INT4_GROUP,
    KeyIndex,
    allocate_key_index,
    dequantize_key_index,
    index_bytes_per_slot,
    key_index_center,
    topk_retrieval_indexed_reference,
    update_key_index_reference,
    write_key_index_reference,
)
from prhs_hf.ops.topk.topk_retrieval import topk_retrieval_grouped_reference, topk_retrieval_reference

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (run: TRITON_INTERPRET=1 pytest tests/test_key_index.py)",
)
DEV = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
I32 = torch.int32


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def build(kind, kc, page=4, upto=None):
    """An index of ``kind`` written by the reference for slots ``[0, upto)`` (all by default)."""
    B, H, S, D = kc.shape
    index = allocate_key_index(kind, B, H, S, D, kc.dtype, kc.device, page=page)
    write_key_index_reference(index, kc, 0, S if upto is None else upto)
    return index


# ----------------------------------------------------------------------------- naive oracle


def naive_fp8(key):
    """``(codes as float, scale)`` of one key vector, element by element."""
    amax = max(abs(float(x)) for x in key.float())
    s = torch.tensor(amax, dtype=torch.float32) / FP8_MAX if amax > 0 else torch.tensor(1.0)
    codes = [float(torch.tensor(float(x) / float(s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float())
             for x in key.float()]
    return codes, float(s)


def naive_unpack_int4(row):
    """Signed codes of one packed row (low nibble = even channel), byte by byte."""
    out = []
    for byte in row.tolist():
        for nib in (byte & 15, byte >> 4):
            out.append(nib - 16 if nib >= 8 else nib)
    return out


def naive_page_bounds(kc, b, h, p, page, last):
    """Per-channel (max, min) of page ``p`` over its slots ``<= last``."""
    slots = [s for s in range(p * page, (p + 1) * page) if s <= last and s < kc.shape[2]]
    keys = kc[b, h, slots].double()
    return keys.max(dim=0).values, keys.min(dim=0).values


def naive_stage1(kind, q, index, b, h, kvh, slot, page):
    """The approximate score of one (query head, slot) from the index, in float64 (pages: its page's bound)."""
    qv = q[b, h].double()
    if kind == "pages":
        mx, mn = index.a[b, kvh, slot // page].double(), index.b[b, kvh, slot // page].double()
        return float(sum(max(qd * x, qd * n) for qd, x, n in zip(qv.tolist(), mx.tolist(), mn.tolist())))
    if kind == "fp8":
        deq = index.a[b, kvh, slot].view(torch.float8_e4m3fn).double() * float(index.b[b, kvh, slot])
    else:
        codes = naive_unpack_int4(index.a[b, kvh, slot])
        deq = torch.tensor([c * float(index.b[b, kvh, slot, d // INT4_GROUP]) for d, c in enumerate(codes)],
                           dtype=torch.float64)
    return float(qv @ deq)


def naive_indexed(kind, q, kc, index, pad, lo, hi, retrieve, k, margin, scale, grouped, page=1):
    """Both stages, row by row: candidates by the index's scores (pages: the best pages, then
    their tokens), then the exact float64 scores of the candidates, ties lower index first."""
    B, Hq, D = q.shape
    Hkv, S = kc.shape[1], kc.shape[2]
    G = Hq // Hkv
    H = Hkv if grouped else Hq
    out = torch.full((B, H, k), -1, dtype=I32)
    n_cand = k + margin
    if kind == "pages":  # the fewest pages that hold k + margin region tokens even if two (cut) hold one each
        n_cand = next(n for n in itertools.count() if n * page - 2 * (page - 1) >= k + margin)
    for b in range(B):
        region = [j for j in range(max(int(lo[b]), 0), int(hi[b])) if int(pad[b]) + j < S]
        for r in range(H):
            if not bool(retrieve[b, r]):
                continue
            kvh = r if grouped else r // G
            heads = [kvh * G + g for g in range(G)] if grouped else [r]

            def score(fn):
                return max(fn(h) for h in heads)

            if kind == "pages":
                pages = sorted({(int(pad[b]) + j) // page for j in region})
                ranked = sorted(pages, key=lambda p: (-score(lambda h: naive_stage1(kind, q, index, b, h, kvh,
                                                                                     p * page, page)), p))
                keep = set(ranked[:n_cand])
                cands = [j for j in region if (int(pad[b]) + j) // page in keep]
            else:
                ranked = sorted(region, key=lambda j: (-score(lambda h: naive_stage1(
                    kind, q, index, b, h, kvh, int(pad[b]) + j, page)), j))
                cands = ranked[:n_cand]
            exact = sorted(cands, key=lambda j: (-score(lambda h: scale * float(
                q[b, h].double() @ kc[b, kvh, int(pad[b]) + j].double())), j))
            for i, j in enumerate(exact[:k]):
                out[b, r, i] = j
    return out


# ----------------------------------------------------------------------------- quantisation


def test_fp8_codes_and_scales_against_naive():
    g = torch.Generator().manual_seed(1)
    kc = (torch.randn(2, 2, 9, 16, generator=g) * torch.rand(2, 2, 9, 1, generator=g) * 4).to(torch.bfloat16)
    kc[1, 0, 3] = 0  # a zero key: scale 1, codes 0
    index = build("fp8", kc)
    assert index.a.dtype == torch.uint8 and index.a.shape == kc.shape and index.b.shape == kc.shape[:3]
    for b, h, s in [(0, 0, 0), (0, 1, 8), (1, 0, 3), (1, 1, 5)]:
        codes, scale = naive_fp8(kc[b, h, s])
        assert index.b[b, h, s].item() == scale
        assert index.a[b, h, s].view(torch.float8_e4m3fn).float().tolist() == codes
    assert index.b[1, 0, 3].item() == 1.0 and (index.a[1, 0, 3] == 0).all()
    # every key's largest channel maps to +-448; the error is at most half an fp8 step (3 mantissa
    # bits: 2^-4 relative for normal codes, 2^-10 * scale in the subnormal range)
    deq, kf = dequantize_key_index(index), kc.float()
    bound = torch.maximum(kf.abs() * 2.0**-4, index.b.unsqueeze(-1) * 2.0**-10) * (1 + 1e-6)
    assert ((deq - kf).abs() <= bound).all()
    amax_codes = index.a.view(torch.float8_e4m3fn).float().abs().amax(-1)
    assert torch.equal(amax_codes[kc.float().abs().amax(-1) > 0], torch.full_like(amax_codes, FP8_MAX)[
        kc.float().abs().amax(-1) > 0])


def test_int4_codes_and_scales_against_naive():
    g = torch.Generator().manual_seed(2)
    D = 64
    kc = torch.randn(2, 3, 7, D, generator=g) * 3
    kc[0, 1, 2, :INT4_GROUP] = 0  # a zero group: scale 1
    index = build("int4", kc)
    assert index.a.shape == (2, 3, 7, D // 2) and index.b.shape == (2, 3, 7, D // INT4_GROUP)
    for b in range(2):
        for h in range(3):
            for s in range(7):
                codes = naive_unpack_int4(index.a[b, h, s])
                for gi in range(D // INT4_GROUP):
                    grp = kc[b, h, s, gi * INT4_GROUP:(gi + 1) * INT4_GROUP].tolist()
                    amax = max(abs(x) for x in grp)
                    scale = float(index.b[b, h, s, gi])
                    assert scale == (float(torch.tensor(amax) / 7) if amax > 0 else 1.0)
                    for d, x in enumerate(grp):
                        c = codes[gi * INT4_GROUP + d]
                        assert -7 <= c <= 7 and c == max(-7, min(7, math.floor(x / scale + 0.5)))
                        assert abs(c * scale - x) <= scale / 2 * (1 + 1e-5)
    assert torch.equal(dequantize_key_index(index)[0, 1, 2, :INT4_GROUP], torch.zeros(INT4_GROUP))


def test_page_bounds_cover_exactly_the_written_slots():
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(2, 2, 23, 8, generator=g).to(torch.bfloat16)  # 6 pages of 4, the last one of 3 slots
    index = build("pages", kc, page=4, upto=14)  # pages 0-3 written; page 3 holds slots 12, 13 only
    assert index.a.shape == (2, 2, 6, 8) and index.a.dtype == torch.bfloat16
    for b in range(2):
        for h in range(2):
            for p in range(4):
                mx, mn = naive_page_bounds(kc, b, h, p, 4, 13)
                assert torch.equal(index.a[b, h, p].double(), mx) and torch.equal(index.b[b, h, p].double(), mn)
    assert (index.a[:, :, 4:] == 0).all()  # not written yet
    write_key_index_reference(index, kc, 14, 23)  # the rest: page 3 recomputed from all its slots
    mx, mn = naive_page_bounds(kc, 1, 0, 5, 4, 22)
    assert torch.equal(index.a[1, 0, 5].double(), mx) and torch.equal(index.b[1, 0, 3].double(),
                                                                       naive_page_bounds(kc, 1, 0, 3, 4, 22)[1])


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_write_then_updates_equals_one_write(kind):
    """A prefill of n slots, then m decode steps (one slot each), equals a write of n + m."""
    g = torch.Generator().manual_seed(4)
    B, H, S, D = 2, 2, 29, 32
    kc = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
    n, m = 10, 13
    index = build(kind, kc, page=8, upto=n)
    for i in range(m):
        update_key_index_reference(index, kc, torch.full((B,), n + i, dtype=I32))
    want = build(kind, kc, page=8, upto=n + m)
    assert torch.equal(index.a, want.a) and torch.equal(index.b, want.b)


def test_update_ragged_slots_and_pad_pages():
    """Each sequence updates its own slot; a page's bounds cover its slots up to the update, the left-pad
    slots among them (an upper bound of the real keys all the same)."""
    g = torch.Generator().manual_seed(5)
    B, H, S, D = 3, 2, 24, 32
    kc = torch.randn(B, H, S, D, generator=g)
    slot = i32([5, 12, 23])
    for kind in INDEX_KINDS:
        index = allocate_key_index(kind, B, H, S, D, kc.dtype, "cpu", page=8)
        update_key_index_reference(index, kc, slot)
        for b in range(B):
            s = int(slot[b])
            if kind == "pages":
                for h in range(H):
                    mx, mn = naive_page_bounds(kc, b, h, s // 8, 8, s)
                    assert torch.equal(index.a[b, h, s // 8].double(), mx)
                    assert torch.equal(index.b[b, h, s // 8].double(), mn)
            else:
                one = build(kind, kc[b:b + 1, :, s:s + 1])
                assert torch.equal(index.a[b, :, s], one.a[0, :, 0]) and torch.equal(index.b[b, :, s], one.b[0, :, 0])
        untouched = torch.ones_like(index.a, dtype=torch.bool)
        for b in range(B):
            untouched[b, :, int(slot[b]) // (8 if kind == "pages" else 1)] = False
        assert (index.a[untouched] == 0).all()
    # pad slots: a page holding pad and real slots bounds every real key of it
    index = build("pages", kc, page=8)
    pad = 5
    q = torch.randn(H, D, generator=g)
    bound = (q.clamp_min(0) @ index.a[0, :, 0].T.float() + q.clamp_max(0) @ index.b[0, :, 0].T.float()).diagonal()
    for j in range(8 - pad):
        assert (bound >= (q * kc[0, :, pad + j]).sum(-1) - 1e-5).all()


def test_key_index_center_is_the_mean_of_each_sequences_real_keys():
    g = torch.Generator().manual_seed(6)
    kc = torch.randn(2, 3, 10, 8, generator=g).to(torch.bfloat16)
    center = key_index_center(kc, i32([0, 4]), 7)
    assert center.shape == (2, 3, 8) and center.dtype == torch.float32
    torch.testing.assert_close(center[0], kc[0, :, :7].float().mean(1))
    torch.testing.assert_close(center[1], kc[1, :, 4:7].float().mean(1))
    assert (key_index_center(kc, i32([0, 9]), 7)[1] == 0).all()  # no real key below the end: 0


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_a_centred_index_keeps_the_top_k_of_keys_that_share_a_large_component(kind):
    """Keys with a large shared component (a k_proj bias; Qwen2.5's keys have one): quantising what is
    left of each key after the centre keeps the exact top-k at a small margin, where the plain codes'
    rounding of the shared part, the same size for every key, loses some. The centred index's keys
    (dequantised) are within half a code step of what is left of each key."""
    g = torch.Generator().manual_seed(12)
    B, Hq, Hkv, S, D, k, margin = 2, 4, 2, 400, 64, 24, 8
    shared = torch.zeros(1, Hkv, 1, D)
    shared[..., :4] = 40.0  # a few large channels, as in real models
    kc = (torch.randn(B, Hkv, S, D, generator=g) + shared).to(torch.bfloat16)
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16)
    pad, lo, hi = i32([0, 0]), i32([0, 0]), i32([S, S])
    retrieve = torch.ones(B, Hq, dtype=torch.bool)
    exact = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 0.125)
    plain = build(kind, kc)
    centered = allocate_key_index(kind, B, Hkv, S, D, kc.dtype, "cpu")._replace(center=key_index_center(kc, pad, S))
    write_key_index_reference(centered, kc, 0, S)

    def overlap(index):
        got = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.125, False)
        return (got.unsqueeze(-1) == exact.unsqueeze(-2)).any(-1).float().mean().item()

    assert overlap(centered) >= 0.98 > overlap(plain) + 0.02, (overlap(centered), overlap(plain))
    rest = kc.float() - centered.center.unsqueeze(2)
    if kind == "fp8":  # half an fp8 step, as test_fp8_codes_and_scales_against_naive, of what is left
        bound = torch.maximum(rest.abs() * 2.0**-4, centered.b.unsqueeze(-1) * 2.0**-10)
    else:  # half a code step of each group's scale
        bound = centered.b.repeat_interleave(INT4_GROUP, -1) / 2
    assert ((dequantize_key_index(centered) - kc.float()).abs() <= bound * (1 + 1e-5) + 1e-6).all()


def test_a_centred_index_refuses_grouped_rows():
    q, kc, pad, lo, hi, g = retrieval_case(2, 4, 2, 32, 20, [0, 3], 7)
    index = build("fp8", kc)._replace(center=key_index_center(kc, pad, 20))
    with pytest.raises(ValueError, match="centred key index"):
        topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, flags(2, 2, g), 4, 2, 0.3, True)
    with pytest.raises(ValueError, match="center of shape"):
        write_key_index_reference(build("fp8", kc)._replace(center=torch.zeros(2, 2, 31)), kc, 0, 4)


def test_sizes_and_bad_input():
    assert index_bytes_per_slot("fp8", 128, torch.bfloat16, 1) == 132
    assert index_bytes_per_slot("int4", 128, torch.bfloat16, 1) == 64 + 16
    assert index_bytes_per_slot("pages", 128, torch.bfloat16, 16) == 32
    with pytest.raises(ValueError, match="expected one of"):
        allocate_key_index("int8", 1, 1, 4, 32, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="multiple of 32"):
        allocate_key_index("int4", 1, 1, 4, 48, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        allocate_key_index("pages", 1, 1, 4, 32, torch.bfloat16, "cpu", page=6)
    index = allocate_key_index("fp8", 1, 1, 4, 32, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="expected 1"):  # a page size on a kind without pages
        update_key_index_reference(index._replace(page=8), torch.zeros(1, 1, 4, 32), i32([0]))
    with pytest.raises(ValueError, match="head_dim 64"):  # an index for other keys
        write_key_index_reference(index, torch.zeros(1, 1, 4, 64), 0, 4)
    with pytest.raises(ValueError, match="margin"):
        topk_retrieval_indexed_reference(torch.zeros(1, 1, 32), torch.zeros(1, 1, 4, 32), index, i32([0]), i32([0]),
                                         i32([4]), torch.ones(1, 1, dtype=torch.bool), 2, -1, 1.0, False)


# ----------------------------------------------------------------------------- two-stage retrieval


def retrieval_case(B, Hq, Hkv, D, S, pads, seed, dtype=torch.float32, integer=False):
    """Inputs with ragged left padding, an empty region (sequence 1 when B > 1) and some rows not
    retrieving. ``integer``: keys whose groups all hold their amax (±7 / 2) in one channel, so
    the fp8 / int4 codes are exact multiples of one scale and every score is exact (ties real)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        q = torch.randint(-2, 3, (B, Hq, D), generator=g).to(dtype)
        kc = torch.randint(-2, 3, (B, Hkv, S, D), generator=g).float()
        kc[..., ::INT4_GROUP] = 2.0
        kc = kc.to(dtype)
    else:
        q = torch.randn(B, Hq, D, generator=g).to(dtype)
        kc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    pad = i32(pads)
    lo = torch.full((B,), 3, dtype=I32)
    hi = (S - pad - 4).to(I32)
    if B > 1:
        lo[1], hi[1] = 9, 9
    return q, kc, pad, lo, hi, g


def flags(B, H, g, frac=0.7):
    r = torch.rand(B, H, generator=g) < frac
    r[0, 0] = True
    return r


@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("grouped", [False, True])
def test_indexed_reference_is_exact_when_the_margin_covers_the_region(kind, grouped):
    q, kc, pad, lo, hi, g = retrieval_case(3, 8, 2, 32, 40, [0, 4, 7], 10 + grouped, torch.bfloat16)
    index = build(kind, kc, page=8)
    retrieve = flags(3, 2 if grouped else 8, g)
    exact = topk_retrieval_grouped_reference if grouped else topk_retrieval_reference
    for k, margin in ((5, 40), (40, 0), (60, 3)):  # k + margin >= every region (<= 33 keys); k > region
        out = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.3, grouped)
        assert torch.equal(out, exact(q, kc, pad, lo, hi, retrieve, k, 0.3))
    assert (out[1] == -1).all() and (out[~retrieve] == -1).all()


@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("grouped", [False, True])
def test_indexed_reference_against_naive(kind, grouped):
    """Small margins: the exact re-rank of the stage-1 candidates, against the naive oracle (integer
    data: no rounding decides an order)."""
    q, kc, pad, lo, hi, g = retrieval_case(3, 4, 2, 32, 37, [0, 4, 6], 20 + grouped, integer=True)
    index = build(kind, kc, page=4)
    retrieve = flags(3, 2 if grouped else 4, g)
    for k, margin in ((3, 0), (6, 4), (9, 2)):
        out = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.5, grouped)
        want = naive_indexed(kind, q, kc, index, pad, lo, hi, retrieve, k, margin, 0.5, grouped, page=4)
        assert torch.equal(out, want), (k, margin)
    assert (out[retrieve & (torch.arange(3) != 1)[:, None]] >= 0).any()


def test_indexed_reference_random_data_subset_consistent():
    """Gaussian data, margin 0: every index returned is a stage-1 candidate (the best k + margin
    by the index's own scores), in exact-score order."""
    q, kc, pad, lo, hi, g = retrieval_case(2, 4, 4, 32, 60, [0, 5], 30)
    lo[1], hi[1] = 2, 50
    retrieve = torch.ones(2, 4, dtype=torch.bool)
    for kind in ("fp8", "int4"):
        index = build(kind, kc)
        deq = dequantize_key_index(index)
        out = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, 8, 4, 1.0, False)
        cand = topk_retrieval_reference(q, deq.to(q.dtype), pad, lo, hi, retrieve, 12, 1.0)
        for b in range(2):
            for h in range(4):
                row = out[b, h].tolist()
                assert set(row) <= set(cand[b, h].tolist())
                exact = [float(q[b, h] @ kc[b, h, int(pad[b]) + j]) for j in row]
                assert exact == sorted(exact, reverse=True)


def cut_pages_case(seed):
    """Pages of constant keys (every slot of a page, pads included, holds its page's vector), so the
    pages index ranks exactly as the keys do; integer data (exact scores). Regions start and end
    inside pages, and the pages they cut score best, so a stage 1 of ``ceil((k + margin) / page)``
    pages finds fewer than ``k`` tokens inside the region. Sequence 2's region is 5 tokens across two
    cut pages; 3's starts at a page boundary past its pads and ends inside a page."""
    page, S, D = 8, 70, 32
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(1, 3, (4, 4, D), generator=g).float()  # positive: a larger key channel scores higher
    pages = torch.randint(-2, 3, (4, 2, -(-S // page), D), generator=g).float()
    pad, lo = i32([0, 5, 3, 6]), i32([7, 2, 3, 2])
    hi = i32([57, S - 5 - 9, 8, 50])  # sequence 0: one token of each cut page inside the region
    for b in range(4):  # the cut pages (first and last of the region) score best
        first, last = (int(pad[b]) + int(lo[b])) // page, (int(pad[b]) + int(hi[b]) - 1) // page
        pages[b, :, first] += 6
        pages[b, :, last] += 5
    kc = pages.repeat_interleave(page, dim=2)[:, :, :S].contiguous()
    return q, kc, build("pages", kc, page=page), pad, lo, hi, g


def _assert_full_exact_top_k(out, q, kc, pad, lo, hi, retrieve, k, grouped):
    """Every retrieving row returns ``min(k, region)`` indices, the exact top-k; the others all -1."""
    exact = (topk_retrieval_grouped_reference if grouped else topk_retrieval_reference)(
        q, kc, pad, lo, hi, retrieve, k, 0.5)
    region = (hi - lo.clamp_min(0)).clamp_min(0)
    found = (out >= 0).sum(-1)
    want = torch.where(retrieve, region.clamp_max(k)[:, None], 0)
    assert torch.equal(found, want), (k, found.tolist(), want.tolist())
    assert torch.equal(out, exact), k


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("margin", [0, 1, 3, 7, 9, 13])
def test_indexed_reference_pages_cut_by_the_region_still_give_k(grouped, margin):
    """Small margins (below two pages) on a region whose end pages are cut and rank first: stage 1
    takes enough pages that the candidates inside the region cover ``k + margin`` (or the region), so
    every row gets ``min(k, region)`` indices, the exact top-k where the index ranks as the keys."""
    q, kc, index, pad, lo, hi, g = cut_pages_case(90 + margin)
    retrieve = flags(4, 2 if grouped else 4, g)
    for k in (1, 3, 4, 5, 8, 12, 40):
        out = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.5, grouped)
        _assert_full_exact_top_k(out, q, kc, pad, lo, hi, retrieve, k, grouped)


# ----------------------------------------------------------------------------- decode_ops


def step_case(seed, dtype):
    """A decode step's inputs, with some rows matching an anchor and some retrieving."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, D, S, s, k = 3, 4, 2, 32, 120, 4, 12
    q = torch.randn(B, H, D, generator=g).to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    pad = i32([0, 9, 30])
    t = (S - pad).to(I32)
    lo = torch.full((B,), 4, dtype=I32)
    hi = (t - 8).to(I32)
    active = torch.ones(B, dtype=torch.bool)
    anchors = torch.randn(B, H, s, D, generator=g)
    anchors = anchors / anchors.norm(dim=-1, keepdim=True)
    anchors[:, :2, 0] = q[:, :2].float() / q[:, :2].float().norm(dim=-1, keepdim=True)
    count = torch.full((B, H), s, dtype=I32)
    sets = torch.randint(0, 2 * S, (B, H, s, k + 8), generator=g, dtype=I32).sort(-1).values
    kw = dict(tau=0.9, sink=4, k=k, dil_m=4, dil_r=1, cap=4 + 8 + k + 8 + S, scale=D**-0.5)
    return (q, kc, pad, t, lo, hi, hi, anchors, count, sets, active), kw


def _tables():
    return [(REFERENCE_OPS, torch.device("cpu"))] + ([(TRITON_OPS, DEV)] if triton_available() else [])


@pytest.mark.parametrize("grouped,group_score", [(False, "max"), (True, "max"), (True, "mean")])
def test_cis_select_key_index(grouped, group_score):
    """key_index=None is the exact retrieval (the chain of the ops, unchanged); a key index whose
    k + margin covers the region gives the same selection bit for bit; a small margin changes only
    the retrieving rows' fresh top-k (the re-rank of the index's candidates)."""
    inputs, kw = step_case(7, torch.bfloat16)
    q, kc, pad, t, lo, hi = inputs[:6]
    if grouped:
        inputs = (*inputs[:7], torch.randn(3, 2, 4, 2 * 32), torch.full((3, 2), 4, dtype=I32),
                  inputs[9][:, :2], inputs[10])
    for ops, dev in _tables():
        x = [v.to(dev) for v in inputs]
        base = cis_select(ops, *x, grouped=grouped, group_score=group_score, **kw)
        best, retrieve = ops.cis_match(base.match_q, x[7], x[8], x[10], kw["tau"])
        if grouped and group_score == "mean":
            B, H, D = x[0].shape
            mean_q = x[0].view(B, 2, H // 2, D).float().mean(2).to(x[0].dtype)
            want = ops.topk_retrieval(mean_q, x[1], x[2], x[4], x[5], retrieve, kw["k"], kw["scale"])
        else:
            retrieval = ops.topk_retrieval_grouped if grouped else ops.topk_retrieval
            want = retrieval(x[0], x[1], x[2], x[4], x[5], retrieve, kw["k"], kw["scale"])
        assert torch.equal(base.best, best) and torch.equal(base.new_idx, want)
        assert (base.best == -1).any()
        for kind in INDEX_KINDS:
            index = build(kind, x[1], page=8)
            full = cis_select(ops, *x, grouped=grouped, group_score=group_score, key_index=index, margin=200, **kw)
            for a, b in zip(full, base):
                assert torch.equal(a, b), kind
            small = cis_select(ops, *x, grouped=grouped, group_score=group_score, key_index=index, margin=0, **kw)
            q_rows = mean_q if grouped and group_score == "mean" else x[0]
            want = topk_retrieval_indexed_reference(*(v.cpu() for v in (q_rows, x[1])), KeyIndex(
                kind, index.a.cpu(), index.b.cpu(), index.page), *(v.cpu() for v in (x[2], x[4], x[5], retrieve)),
                kw["k"], 0, kw["scale"], grouped and group_score == "max")
            assert torch.equal(small.new_idx.cpu(), want) and torch.equal(small.best, base.best)


# ----------------------------------------------------------------------------- Triton (interpreter or CUDA)


def _on(*xs):
    return [x.to(DEV) for x in xs]


def _index_on(index):
    center = None if index.center is None else index.center.to(DEV)
    return KeyIndex(index.kind, index.a.to(DEV), index.b.to(DEV), index.page, center)


@needs_triton
@pytest.mark.parametrize("kind,centered", [*((kind, False) for kind in INDEX_KINDS), ("fp8", True), ("int4", True)])
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.float32, 96)])
def test_write_and_update_kernels_equal_the_reference(kind, centered, dtype, D):
    """A chunked prefill (two writes, the second starting inside a page) and decode steps at ragged slots,
    bit for bit; one update launch per step. Centred: keys with a shared offset, codes of key - centre."""
    from prhs_hf.ops.key_index.key_index import update_key_index, write_key_index

    g = torch.Generator().manual_seed(40)
    B, H, S = 3, 2, 45
    kc = torch.randn(B, H, S, D, generator=g) * torch.rand(B, H, S, 1, generator=g) * 3
    if centered:
        kc = kc + torch.randn(1, H, 1, D, generator=g) * 8
    kc = kc.to(dtype)
    kc[0, 1, 7] = 0  # a zero key
    ref = allocate_key_index(kind, B, H, S, D, dtype, "cpu", page=8)
    if centered:
        ref = ref._replace(center=key_index_center(kc, i32([0, 3, 9]), 21))
    out = _index_on(ref)
    for start, end in ((0, 21), (21, 30)):
        write_key_index_reference(ref, kc, start, end)
        write_key_index(out, kc.to(DEV), start, end)
    for step in range(4):
        slot = i32([30 + step, 33 + 2 * step, 44 - step])
        update_key_index_reference(ref, kc, slot)
        update_key_index(out, kc.to(DEV), slot.to(DEV))
    assert torch.equal(out.a.cpu(), ref.a) and torch.equal(out.b.cpu(), ref.b)


@needs_triton
def test_fp8_rounding_ties_and_subnormals_in_the_kernel():
    """The kernel's integer fp8 conversion rounds as torch's float8_e4m3fn cast: every midpoint of two
    fp8 values (ties to even), the subnormal range, the largest value."""
    from prhs_hf.ops.key_index.key_index import write_key_index

    codes = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (codes[:-1] + codes[1:]) / 2
    vals = torch.cat([mid, -mid, codes, -codes, torch.linspace(-0.03, 0.03, 250)])
    D = 64
    n = -(-vals.numel() // (D - 1))
    keys = torch.zeros(n * (D - 1))
    keys[:vals.numel()] = vals
    # one channel of every key holds 448: scale 1, so the codes are the values themselves
    kc = torch.cat([keys.view(1, 1, n, D - 1), torch.full((1, 1, n, 1), FP8_MAX)], dim=-1)
    ref, out = build("fp8", kc), allocate_key_index("fp8", 1, 1, n, D, kc.dtype, DEV)
    write_key_index(out, kc.to(DEV), 0, n)
    assert (ref.b == 1).all() and torch.equal(out.a.cpu(), ref.a) and torch.equal(out.b.cpu(), ref.b)


def _check_indexed(q, kc, index, pad, lo, hi, retrieve, k, margin, scale, grouped):
    from prhs_hf.ops.key_index.key_index import topk_retrieval_indexed

    out = topk_retrieval_indexed(*_on(q, kc), _index_on(index), *_on(pad, lo, hi, retrieve), k, margin, scale, grouped)
    ref = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, k, margin, scale, grouped)
    assert out.shape == ref.shape and out.dtype == I32
    assert torch.equal(out.cpu(), ref), (index.kind, k, margin, grouped)
    return out.cpu()


@needs_triton
@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("dtype,Hq,Hkv", [(torch.bfloat16, 4, 4), (torch.bfloat16, 4, 2), (torch.float32, 8, 2),
                                          (torch.bfloat16, 12, 2)])
@pytest.mark.parametrize("grouped", [False, True])
def test_indexed_kernel_equals_the_reference(kind, dtype, Hq, Hkv, grouped):
    """GQA groups 1/2/4/6, per head and grouped, ragged padding, an empty region, rows not
    retrieving; margins from 0 to past the region, k larger than the region."""
    q, kc, pad, lo, hi, g = retrieval_case(3, Hq, Hkv, 32, 70, [0, 5, 11], 50 + Hq + grouped, dtype)
    index = build(kind, kc, page=8)
    retrieve = flags(3, Hkv if grouped else Hq, g)
    for k, margin in ((4, 0), (9, 7), (16, 100), (70, 3)):
        out = _check_indexed(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.3, grouped)
    assert (out[1] == -1).all() and (out[~retrieve] == -1).all()


@needs_triton
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_indexed_kernel_on_a_centred_index_equals_the_reference(kind):
    """Per-head rows of a centred index (GQA 6, ragged padding, keys with a shared offset); grouped rows
    are refused by the kernel's launcher as by the reference."""
    from prhs_hf.ops.key_index.key_index import topk_retrieval_indexed

    q, kc, pad, lo, hi, g = retrieval_case(3, 12, 2, 32, 70, [0, 5, 11], 61, torch.bfloat16)
    kc = (kc.float() + torch.randn(1, 2, 1, 32, generator=g) * 6).to(torch.bfloat16)
    index = allocate_key_index(kind, 3, 2, 70, 32, kc.dtype, "cpu")._replace(center=key_index_center(kc, pad, 70))
    write_key_index_reference(index, kc, 0, 70)
    retrieve = flags(3, 12, g)
    for k, margin in ((4, 0), (9, 7), (16, 100)):
        _check_indexed(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.3, False)
    with pytest.raises(ValueError, match="centred key index"):
        topk_retrieval_indexed(*_on(q, kc), _index_on(index), *_on(pad, lo, hi, flags(3, 2, g)), 4, 2, 0.3, True)


@needs_triton
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_indexed_kernel_radix8_candidates_and_ties(kind):
    """k + margin above the tilemax select's range (stage 1 through radix8), and integer data with
    exact ties in both stages (lower index first)."""
    q, kc, pad, lo, hi, g = retrieval_case(2, 4, 2, 32, 700, [0, 37], 60, torch.bfloat16, integer=True)
    lo[1], hi[1] = 10, 600
    index = build(kind, kc, page=16)
    for grouped in (False, True):
        retrieve = flags(2, 2 if grouped else 4, g, frac=0.8)
        _check_indexed(q, kc, index, pad, lo, hi, retrieve, 200, 120, 0.5, grouped)
        _check_indexed(q, kc, index, pad, lo, hi, retrieve, 7, 5, 0.5, grouped)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [96, 128])
@pytest.mark.parametrize("grouped", [False, True])
def test_int4_stage1_kernel_equals_the_reference_over_several_groups(dtype, D, grouped):
    """The int4 score tile alone (stage 1 of the indexed retrieval, no re-rank to hide it): three or four
    scale groups per key, each group of channels at its own magnitude (a scale applied to the wrong
    group, or an even channel's code to an odd one, moves the scores), 150 slots (a full key tile and a
    tail), ragged pads, an empty region, rows not retrieving: its candidates, in order, equal those of
    the reference's stage-1 scores, for every row up to the whole region."""
    from prhs_hf.ops.key_index.key_index import _approx_scores
    from prhs_hf.ops.topk.topk_retrieval import _retrieve, _topk_of_scores

    B, Hq, Hkv, S = 3, 8, 2, 150
    q, kc, pad, lo, hi, g = retrieval_case(B, Hq, Hkv, D, S, [0, 5, 11], 70 + D + grouped, dtype)
    magnitude = 4.0 ** (torch.arange(D) // INT4_GROUP)  # 1, 4, 16, 64 per group
    kc = (kc.float() * magnitude).to(dtype)
    index = build("int4", kc)
    group_scale = index.b.mean(dim=(0, 1, 2))
    assert (group_scale[1:] > 2 * group_scale[:-1]).all()  # the groups' scales differ
    retrieve = flags(B, Hkv if grouped else Hq, g)
    approx = _approx_scores(q, index, 0.3)  # [B, Hkv, G, S]
    rows = approx.amax(dim=2) if grouped else approx.reshape(B, Hq, S)
    for n in (1, 17, 150):
        out = _retrieve(*_on(q, index.a, pad, lo, hi, retrieve), n, 0.3, grouped=grouped, key_format=2,
                        key_b=index.b.to(DEV))
        assert torch.equal(out.cpu(), _topk_of_scores(rows, pad, lo, hi, retrieve, n)), n
    assert (out[0, 0] >= 0).sum() == hi[0] - lo[0]  # n = 150 orders every key of the region


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_indexed_kernel_pages_cut_by_the_region_still_give_k(grouped):
    """The kernel path of :func:`test_indexed_reference_pages_cut_by_the_region_still_give_k`: the same
    page count in stage 1, so ``min(k, region)`` indices per row, equal to the reference's."""
    for margin in (0, 3, 13):
        q, kc, index, pad, lo, hi, g = cut_pages_case(90 + margin)
        retrieve = flags(4, 2 if grouped else 4, g)
        for k in (1, 3, 5, 12, 40):
            out = _check_indexed(q, kc, index, pad, lo, hi, retrieve, k, margin, 0.5, grouped)
            _assert_full_exact_top_k(out, q, kc, pad, lo, hi, retrieve, k, grouped)


@needs_triton
def test_indexed_kernel_errors():
    from prhs_hf.ops.key_index.key_index import RERANK_MAX, topk_retrieval_indexed

    q, kc, pad, lo, hi, g = retrieval_case(1, 2, 2, 32, 40, [0], 70)
    index = _index_on(build("pages", kc, page=8))
    r = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="RERANK_MAX"):
        topk_retrieval_indexed(*_on(q, kc), index, *_on(pad, lo, hi, r), RERANK_MAX, 1, 1.0, False)
    # k + margin fits in whole pages (1023 of 8), not with room for the region's cut end pages
    with pytest.raises(ValueError, match=rf"k \+ margin = {RERANK_MAX - 13} \(pages of 8: 1025 pages, .* 8200 tokens\)"
                                         rf" exceeds RERANK_MAX = {RERANK_MAX}"):
        topk_retrieval_indexed(*_on(q, kc), index, *_on(pad, lo, hi, r), RERANK_MAX - 20, 7, 1.0, False)
    assert (topk_retrieval_indexed(*_on(q, kc), index, *_on(pad, lo, hi, r), 0, 5, 1.0, False).shape == (1, 2, 0))


@needs_triton
@pytest.mark.parametrize("kind,centered", [*((kind, False) for kind in INDEX_KINDS), ("fp8", True)])
def test_key_index_ops_compile_fullgraph(kind, centered):
    """TRITON_OPS' key-index ops under torch.compile (fullgraph): the update mutates the index in
    place (a view of a per-layer state buffer, as the selector holds it) and the retrieval reads
    it, with the eager results; a centred index's centre passes through the ops."""
    q, kc, pad, lo, hi, g = retrieval_case(2, 4, 2, 32, 40, [0, 3], 90, torch.bfloat16)
    lo[1], hi[1] = 2, 30
    retrieve = flags(2, 4, g)
    layers = [allocate_key_index(kind, 2, 2, 40, 32, kc.dtype, DEV, page=8) for _ in range(2)]
    state_a, state_b = torch.stack([x.a for x in layers]), torch.stack([x.b for x in layers])  # [L, ...]
    center = key_index_center(kc, pad, 36) if centered else None
    view = KeyIndex(kind, state_a[1], state_b[1], layers[1].page, None if center is None else center.to(DEV))
    TRITON_OPS.write_key_index(view, kc.to(DEV), 0, 36)
    slot = i32([36, 38]).to(DEV)

    def step(q, kc, pad, lo, hi, retrieve, slot):
        TRITON_OPS.update_key_index(view, kc, slot)
        return TRITON_OPS.topk_retrieval_indexed(q, kc, view, pad, lo, hi, retrieve, 5, 3, 0.3, False)

    args = [x.to(DEV) for x in (q, kc, pad, lo, hi, retrieve, slot)]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    got_a, got_b = state_a.clone(), state_b.clone()
    ref = allocate_key_index(kind, 2, 2, 40, 32, kc.dtype, "cpu", page=8)._replace(center=center)
    write_key_index_reference(ref, kc, 0, 36)
    update_key_index_reference(ref, kc, slot.cpu())
    assert torch.equal(got_a[1].cpu(), ref.a) and torch.equal(got_b[1].cpu(), ref.b)
    assert (got_a[0] == 0).all()  # the other layer untouched
    assert torch.equal(compiled, step(*args))
    assert torch.equal(compiled.cpu(), topk_retrieval_indexed_reference(q, kc, ref, pad, lo, hi, retrieve, 5, 3, 0.3,
                                                                         False))


_SM90_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prhs_hf.ops.key_index import key_index as ki
from prhs_hf.ops.topk import topk_retrieval as tk

SCALARS = {"S": "i32", "R": "i32", "CHUNK": "i32", "MIN_CHUNK": "i32", "MAX_SPLITS": "i32", "KOUT": "i32", "NC": "i32"}


def compile_sm90(fn, constexprs, types, num_warps=4):
    types = {**SCALARS, **types}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*i32" if n.isupper() else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    assert "cubin" in triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm


n = 0
for kind, a, b in ((1, "*u8", "*fp32"), (2, "*u8", "*fp32"), (3, "*bf16", "*bf16")):
    for from_slot, centered in ((True, False), (False, False), *(((True, True), (False, True)) if kind != 3 else ())):
        compile_sm90(ki._index_write_kernel, dict(HKV=8, KIND=kind, FROM_SLOT=from_slot, PAGE=16 if kind == 3 else 1,
                     BLOCK_S=16 if kind == 3 or not from_slot else 1, D=128, BLOCK_D=128, CENTERED=centered),
                     {"K": "*bf16", "A": a, "BS": b, "C": "*fp32"})
        n += 1
    base = dict(D=128, BLOCK_D=128, BLOCK_N=128, TILE_MAX=True, SUB=32, ZERO_SCRATCH=False, HIST_ROW=1024, HKV=8,
                GROUP=4, BLOCK_M=16, IEEE=False, COMPACT=True, BLOCK_R=512, FGP=4, NGP=128, KFMT=kind)
    for agg in (False, True):
        compile_sm90(tk._group_score_kernel, dict(base, AGG_MAX=agg, ZROWS=1 if agg else 4, FG=1 if agg else 4),
                     {"Q": "*bf16", "K": a, "KB": b, "FLAG": "*i1", "scale": "fp32"})
        n += 1
for grouped, paged in ((False, False), (True, True)):
    compile_sm90(ki._rerank_kernel, dict(H=8 if grouped else 32, HKV=8, GROUP=4, GROUPED=grouped, PAGED=paged,
                 PAGE=16 if paged else 1, D=128, BLOCK_M=16, BLOCK_C=64, BLOCK_D=128, C_PAD=ki.RERANK_MAX,
                 IEEE=False), {"Q": "*bf16", "K": "*bf16", "FLAG": "*i1", "OUT": "*i32", "SCR": "*i64",
                 "scale": "fp32"}, 8)
    n += 1
print("compiled", n)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _has_cuda_backend(), reason="needs Triton with its CUDA backend (ptxas)")
def test_key_index_kernels_compile_for_sm90():
    """The write/update kernel (each kind, both modes, fp8 and int4 centred or not), the group score
    kernel on each index format (per head and grouped) and the re-rank at its largest candidate count
    compile to sm_90 cubins at d 128 (a subprocess without the interpreter: the interpreter does not
    see compiler-only errors)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_CHECK], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiled 18" in res.stdout


# ----------------------------------------------------------------------------- GPU, realistic sizes


def _gpu_case(B=4, Hq=32, Hkv=8, D=128, S=16384, frac=0.5, seed=80, gaussian=False):
    """bf16 decode inputs at a realistic size on CUDA. Default: keys on the grid of multiples of 1/8 in
    [-7/8, 7/8] with one channel of every group of 32 at 7/8, so the fp8 scale is 1/512 and the int4
    scale 1/8: the codes are exact, and so is every stage-1 and stage-2 score in fp32 whatever the
    summation order (exact comparisons, exact ties). ``gaussian``: normal keys and queries."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    if gaussian:
        q = torch.randn(B, Hq, D, generator=g, device=dev).bfloat16()
        kc = torch.randn(B, Hkv, S, D, generator=g, device=dev).bfloat16()
    else:
        q = (torch.randint(-8, 9, (B, Hq, D), generator=g, device=dev).float() / 8).bfloat16()
        kc = torch.randint(-7, 8, (B, Hkv, S, D), generator=g, device=dev).float() / 8
        kc[..., ::INT4_GROUP] = 7 / 8
        kc = kc.bfloat16()
    pad = torch.randint(0, S // 8, (B,), generator=g, device=dev).to(I32)
    pad[0] = 0
    lo = torch.full((B,), 64, dtype=I32, device=dev)
    hi = (S - pad - 256).to(I32)
    hi[-1] = lo[-1] + 700  # a region shorter than k + margin
    r_head = torch.rand(B, Hq, generator=g, device=dev) < frac
    r_head[0, 0] = True
    return q, kc, pad, lo, hi, r_head, r_head.view(B, Hkv, -1).any(-1), D**-0.5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_gpu_write_update_equal_the_reference(kind):
    from prhs_hf.ops.key_index.key_index import update_key_index, write_key_index

    q, kc, pad, *_ = _gpu_case(gaussian=True)
    B, H, S, D = kc.shape
    ref = allocate_key_index(kind, B, H, S, D, kc.dtype, kc.device)
    out = allocate_key_index(kind, B, H, S, D, kc.dtype, kc.device)
    write_key_index_reference(ref, kc, 0, S - 40)
    write_key_index(out, kc, 0, S - 40)
    for step in range(40):
        slot = torch.full((B,), S - 40 + step, dtype=I32, device=kc.device)
        update_key_index_reference(ref, kc, slot)
        update_key_index(out, kc, slot)
    assert torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("k,margin", [(512, 512), (2048, 512), (100, 60)])
def test_gpu_indexed_exact_on_quantised_data(kind, grouped, k, margin):
    """B4, 32/8 heads, 16k slots, half the rows retrieving: equal to the reference (exact data)."""
    from prhs_hf.ops.key_index.key_index import topk_retrieval_indexed

    q, kc, pad, lo, hi, r_head, r_group, scale = _gpu_case()
    retrieve = r_group if grouped else r_head
    index = allocate_key_index(kind, *kc.shape[:3], kc.shape[3], kc.dtype, kc.device)
    write_key_index_reference(index, kc, 0, kc.shape[2])
    out = topk_retrieval_indexed(q, kc, index, pad, lo, hi, retrieve, k, margin, scale, grouped)
    ref = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, retrieve, k, margin, scale, grouped)
    assert torch.equal(out, ref)
    assert (out[~retrieve] == -1).all() and (out[retrieve][:, 0] >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_gpu_indexed_gaussian_scores_match(kind):
    """Gaussian data: summation order may swap near-equal scores (in either stage), so compare the exact
    scores of the selections."""
    from prhs_hf.ops.key_index.key_index import topk_retrieval_indexed

    q, kc, pad, lo, hi, r_head, _, scale = _gpu_case(gaussian=True, seed=81)
    index = allocate_key_index(kind, *kc.shape[:3], kc.shape[3], kc.dtype, kc.device)
    write_key_index_reference(index, kc, 0, kc.shape[2])
    out = topk_retrieval_indexed(q, kc, index, pad, lo, hi, r_head, 512, 512, scale, False)
    ref = topk_retrieval_indexed_reference(q, kc, index, pad, lo, hi, r_head, 512, 512, scale, False)
    assert torch.equal(out < 0, ref < 0)
    B, Hq, _ = q.shape
    kvh = torch.arange(Hq, device=q.device) // (Hq // kc.shape[1])
    b_ix = torch.arange(B, device=q.device)[:, None, None]

    def scores(idx):
        slots = pad.long()[:, None, None] + idx.long().clamp_min(0)
        return (kc[b_ix, kvh[None, :, None], slots].double() @ q.double()[..., None])[..., 0]

    valid = out >= 0
    torch.testing.assert_close(scores(out)[valid], scores(ref)[valid], atol=1e-3, rtol=1e-4)
    assert ((out == ref) | ~valid).float().mean() > 0.98


@pytest.mark.gpu
def test_gpu_int4_score_costs_at_most_a_few_times_fp8s():
    """Stage 1's score launch alone (B16, 16k slots, 32/8 heads, half the rows retrieving): int4 reads
    half of fp8's code bytes through the same kernel, so it must not cost much more (its score tile
    once unpacked every channel into an fp32 tile and took about 120x fp8's time on an H100; one dot
    per group of channels took about 1.6x)."""
    from triton.testing import do_bench

    from prhs_hf.ops.topk.topk_retrieval import _retrieve, tuned

    q, kc, pad, lo, hi, r_head, _, scale = _gpu_case(B=16, gaussian=True, seed=83)
    ms = {}
    for kind, key_format in (("fp8", 1), ("int4", 2)):
        index = allocate_key_index(kind, *kc.shape[:3], kc.shape[3], kc.dtype, kc.device)
        write_key_index_reference(index, kc, 0, kc.shape[2])
        ms[kind] = do_bench(lambda: tuned(_retrieve, stop_after="score")(q, index.a, pad, lo, hi, r_head, 1164, scale,
                                                                         grouped=False, key_format=key_format,
                                                                         key_b=index.b),
                            warmup=50, rep=300)
    assert ms["int4"] < 3 * ms["fp8"], ms


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_gpu_update_and_retrieval_sync_free_and_graph_capturable(kind):
    from script_loader import load_script
    from prhs_hf.ops.key_index.key_index import topk_retrieval_indexed, update_key_index, write_key_index

    common = load_script("_bench_common")
    q, kc, pad, lo, hi, r_head, r_group, scale = _gpu_case(B=8, S=8192, gaussian=True, seed=82)
    B, H, S, D = kc.shape
    index = allocate_key_index(kind, B, H, S, D, kc.dtype, kc.device)
    write_key_index(index, kc, 0, S - 1)
    slot = (S - 1 - torch.arange(B, device=kc.device) % 3).to(I32)

    def step():
        update_key_index(index, kc, slot)
        return (topk_retrieval_indexed(q, kc, index, pad, lo, hi, r_head, 512, 256, scale, False),
                topk_retrieval_indexed(q, kc, index, pad, lo, hi, r_group, 512, 256, scale, True))

    eager = step()
    common.call_sync_free(step)
    graph, captured = common.capture_graph(step)
    q.copy_(torch.randn_like(q))
    kc[:, :, S - 1] = torch.randn_like(kc[:, :, S - 1])
    graph.replay()
    torch.cuda.synchronize()
    a_after, b_after = index.a.clone(), index.b.clone()
    expect = step()
    assert torch.equal(index.a, a_after) and torch.equal(index.b, b_after)  # the replay updated the index
    assert torch.equal(captured[0], expect[0]) and torch.equal(captured[1], expect[1])
    assert not torch.equal(captured[0], eager[0])


@needs_triton
@pytest.mark.slow
def test_bench_key_index_cpu_smoke(tmp_path):
    """scripts/bench_decode_attention.py --index runs (tiny shape through the interpreter without CUDA) and
    writes every column of its JSON: timings, recalls, the step against the dense columns."""
    import json

    from script_loader import load_script

    bench = load_script("bench_decode_attention")
    assert bench.main(["--index", "--index-margins", "8", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "bench_key_index.json").read_text())["rows"][0]
    k = row["k"]
    for kind in INDEX_KINDS:
        assert row[f"retrieval_k{k}_{kind}_m8_ms"] > 0 and 0 <= row[f"retrieval_k{k}_{kind}_m8_recall"] <= 1
        assert row[f"step_{kind}_m8_ms"] > 0 and row[f"update_{kind}_ms"] > 0
        assert row[f"grouped_k{k}_{kind}_m8_recall"] <= 1
    assert row["retrieving_rows"] > 0 and row["fastest_dense_ms"] > 0 and row["step_exact_ms"] > 0
