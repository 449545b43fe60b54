"""The four CIS decode steps (docs/DECODE_PIPELINE.md) on small shapes, CPU-friendly.

* each ``*_reference`` against a naive per-row Python loop written here (float64, sets, sorted
  lists): that is how the references are known to be right; these run everywhere;
* each Triton launcher against its reference (``TRITON_INTERPRET=1`` on the CPU, or CUDA):
  GQA, ragged lengths (per-sequence ``t`` and ``pad``), ``k`` larger than the middle region,
  empty middle, exact ties, duplicates from dilation, dilation clipped at region edges, rows
  with ``count = 0``, fp16/bf16/fp32, head sizes 16/80/256, split and unsplit attention;
* hypothesis properties of ``compose_indices`` (sorted, unique, in range, holds sink and
  window, size bound, ``-1`` tail), on the reference and on the kernel;
* one whole decode step, ``TRITON_OPS`` against ``REFERENCE_OPS``.

Run on a CPU: ``TRITON_INTERPRET=1 pytest tests/test_kernels_decode.py``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from script_loader import load_script
from conftest import triton_available
import prhs_hf.ops.compose.compose_indices as compose_module
import prhs_hf.ops.compose.dilated_set as dilated_module
from prhs_hf.ops.cis_match.cis_match import cis_match, cis_match_reference
from prhs_hf.ops.compose.compose_indices import (
    compose_from_sets, compose_from_sets_reference, compose_indices, compose_indices_reference,
    dilate_and_compose, dilate_and_compose_reference, dilate_compose_and_record, dilate_compose_and_record_reference,
)
from prhs_hf.ops.compose.dilated_set import SET_NONE, dilated_set, dilated_set_reference, dilated_set_size
from prhs_hf.ops.decode_ops import REFERENCE_OPS, TRITON_OPS, cis_select, get_decode_ops, group_query
from prhs_hf.ops.sparse_attention.sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_grouped,
    sparse_decode_attention_grouped_reference,
    sparse_decode_attention_reference,
)
from prhs_hf.ops.topk.topk_retrieval import (
    SELECT_MODES,
    compact_rows,
    topk_retrieval,
    topk_retrieval_grouped,
    topk_retrieval_grouped_reference,
    topk_retrieval_reference,
    tuned,
)

cis_decode_step = load_script("_bench_common").cis_decode_step  # the whole stateless step (tests, benchmark)

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 "
    "(run: TRITON_INTERPRET=1 pytest tests/test_kernels_decode.py)",
)

# Kernels run on the GPU when there is one (and the interpreter is off), else on the CPU.
DEV = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
I32 = torch.int32
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


# ----------------------------------------------------------------------------- naive loops


def naive_cis_match(q, anchor_q, anchor_count, active, tau):
    B, H, _ = q.shape
    out = torch.full((B, H), -2, dtype=I32)
    for b in range(B):
        if not bool(active[b]):
            continue
        for h in range(H):
            qv = q[b, h].double()
            best, best_sim = -1, -math.inf
            for a in range(int(anchor_count[b, h])):
                av = anchor_q[b, h, a].double()
                sim = float(qv @ av) / (max(qv.norm().item(), 1e-12) * max(av.norm().item(), 1e-12))
                if sim > best_sim:  # strict: the lowest anchor wins a tie
                    best, best_sim = a, sim
            out[b, h] = best if best >= 0 and best_sim >= tau else -1
    return out


def naive_topk(q, k_cache, pad, lo, hi, retrieve, k, scale):
    B, H, _ = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    out = torch.full((B, H, k), -1, dtype=I32)
    for b in range(B):
        for h in range(H):
            if not bool(retrieve[b, h]):
                continue
            kvh = h // (H // Hkv)
            scored = []
            for j in range(max(int(lo[b]), 0), int(hi[b])):
                slot = int(pad[b]) + j
                if slot >= S:
                    break
                s = scale * float(q[b, h].double() @ k_cache[b, kvh, slot].double())
                scored.append((-s, j))
            for i, (_, j) in enumerate(sorted(scored)[:k]):
                out[b, h, i] = j
    return out


def naive_index_set(t, lo, hi, win_start, p, dilate, sink, dil_m, dil_r):
    """The index set of one row, straight from the formula of DECODE_PIPELINE §3."""
    middle = {x for x in p if x >= 0}
    if dilate:
        middle |= {x + j for x in p[:dil_m] if x >= 0 for j in range(-dil_r, dil_r + 1)}
    middle = {x for x in middle if lo <= x < hi}
    return set(range(min(sink, t))) | middle | set(range(max(win_start, 0), t))


def naive_compose(t, lo, hi, win_start, sel_idx, dilate, sink, dil_m, dil_r, cap):
    B, H, _ = sel_idx.shape
    idx = torch.full((B, H, cap), -1, dtype=I32)
    cnt = torch.zeros((B, H), dtype=I32)
    for b in range(B):
        for h in range(H):
            d = bool(dilate) if not isinstance(dilate, torch.Tensor) else bool(dilate[b, h])
            s = sorted(
                naive_index_set(
                    int(t[b]), int(lo[b]), int(hi[b]), int(win_start[b]),
                    sel_idx[b, h].tolist(), d, sink, dil_m, dil_r,
                )
            )
            assert len(s) <= cap
            idx[b, h, : len(s)] = torch.tensor(s, dtype=I32)
            cnt[b, h] = len(s)
    return idx, cnt


def naive_attention(q, k_cache, v_cache, pad, idx, count, scale):
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.zeros((B, H, D), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            n = int(count[b, h])
            if n == 0:
                continue
            kvh = h // (H // Hkv)
            slots = [int(pad[b]) + int(j) for j in idx[b, h, :n]]
            kk = k_cache[b, kvh, slots].double()
            vv = v_cache[b, kvh, slots].double()
            w = torch.softmax(scale * (kk @ q[b, h].double()), dim=0)
            out[b, h] = w @ vv
    return out


# ----------------------------------------------------------------------------- inputs


def geometry(S, pads, ends, sink, local):
    """Per-sequence left padding and visible tokens; middle = [sink, t - local) clipped."""
    pad = i32(pads)
    t = i32([S - p - e for p, e in zip(pads, ends)])
    lo = torch.minimum(torch.full_like(t, sink), t)
    hi = torch.maximum(lo, t - local)
    return pad, t, lo, hi


def unit_anchors(B, H, s, D, g):
    a = torch.randn(B, H, s, D, generator=g)
    return a / a.norm(dim=-1, keepdim=True)


def assert_out_close(out, ref, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- references


def test_reference_cis_match_against_naive():
    g = torch.Generator().manual_seed(1)
    B, H, s, D = 3, 4, 5, 12
    q = torch.randn(B, H, D, generator=g)
    q[0, 1] = 0.0  # zero query: cosine 0
    anchors = unit_anchors(B, H, s, D, g)
    anchors[1, 0, 3] = anchors[1, 0, 1]  # exact tie: anchor 1 must win
    anchors[1, 0, 1] = q[1, 0] / q[1, 0].norm()
    anchors[1, 0, 3] = anchors[1, 0, 1]
    count = i32([[0, 1, 5, 3], [5, 2, 4, 5], [5, 5, 5, 5]])
    active = torch.tensor([True, True, False])
    for tau in (-1.0, 0.0, 0.2, 0.8):
        ref, retrieve = cis_match_reference(q, anchors, count, active, tau)
        assert torch.equal(ref, naive_cis_match(q, anchors, count, active, tau))
        assert retrieve.dtype == torch.bool and torch.equal(retrieve, ref == -1)
    ref = cis_match_reference(q, anchors, count, active, 0.8).best
    assert ref[1, 0] == 1 and ref[0, 0] == -1 and (ref[2] == -2).all()
    assert ref[0, 1] == -1  # zero query against tau > 0


@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_reference_topk_against_naive(Hkv):
    g = torch.Generator().manual_seed(2)
    B, H, D, S = 3, 4, 8, 40
    q = torch.randn(B, H, D, generator=g)
    kc = torch.randn(B, Hkv, S, D, generator=g)
    pad, t, lo, hi = geometry(S, [0, 5, 9], [0, 2, 0], sink=3, local=4)
    lo[2], hi[2] = 7, 7  # empty middle
    retrieve = torch.rand(B, H, generator=g) > 0.3
    for k in (1, 6, 40):  # 40 > every middle region: -1 tail
        ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 0.3)
        assert torch.equal(ref, naive_topk(q, kc, pad, lo, hi, retrieve, k, 0.3))
    assert (ref[2] == -1).all() and (ref[~retrieve] == -1).all()


def test_reference_topk_ties_lower_index_first():
    # Integer data: exact dot products, many equal scores.
    g = torch.Generator().manual_seed(3)
    B, H, D, S = 2, 2, 4, 30
    q = torch.randint(-1, 2, (B, H, D), generator=g).float()
    kc = torch.randint(-1, 2, (B, 1, S, D), generator=g).float()
    pad, t, lo, hi = geometry(S, [0, 3], [0, 0], sink=2, local=2)
    retrieve = torch.ones(B, H, dtype=torch.bool)
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 12, 1.0)
    assert torch.equal(ref, naive_topk(q, kc, pad, lo, hi, retrieve, 12, 1.0))


@pytest.mark.parametrize("dilate", ["all", "none", "per_row"])
def test_reference_compose_against_naive(dilate):
    g = torch.Generator().manual_seed(4)
    B, H, k, S = 3, 4, 6, 60
    t = i32([60, 33, 9])
    lo = i32([4, 4, 4])
    hi = i32([50, 20, 4])  # the last middle is empty
    ws = i32([50, 14, 2])  # window overlapping the middle (row 1) and the sink (row 2)
    sel = torch.randint(-1, 55, (B, H, k), generator=g, dtype=I32)
    sel[0, 0] = i32([4, 49, 5, 48, -1, 30])  # neighbours clipped at both edges, duplicates
    sel[0, 1] = i32([10, 11, 12, 10, -1, -1])
    sel[1, 2] = -1
    d = {"all": True, "none": False, "per_row": torch.rand(B, H, generator=g) > 0.5}[dilate]
    cap = 4 + 10 + k + 2 * 2 * 3 + 60
    ref = compose_indices_reference(t, lo, hi, ws, sel, d, 4, 3, 2, cap)
    nv = naive_compose(t, lo, hi, ws, sel, d, 4, 3, 2, cap)
    assert torch.equal(ref[0], nv[0]) and torch.equal(ref[1], nv[1])


def _small_attention_case(seed, H, Hkv, cap, counts, D=16, S=30):
    """Attention inputs of the reference tests: ``len(counts[0])`` index lists per sequence of
    distinct ascending indices, ``-1`` after each list's count (``counts``, a ``[2, L]`` list),
    sequence 1 left-padded by 4: ``(q, kc, vc, pad, idx, count)``."""
    g = torch.Generator().manual_seed(seed)
    count = i32(counts)
    B, L = count.shape
    q = torch.randn(B, H, D, generator=g)
    kc = torch.randn(B, Hkv, S, D, generator=g)
    vc = torch.randn(B, Hkv, S, D, generator=g)
    idx = torch.stack(
        [torch.stack([torch.randperm(S - 4, generator=g)[:cap].sort().values for _ in range(L)]) for _ in range(B)]
    ).to(I32)
    idx[torch.arange(cap) >= count[..., None].long()] = -1
    return q, kc, vc, i32([0, 4]), idx, count


def test_reference_attention_against_naive():
    q, kc, vc, pad, idx, count = _small_attention_case(5, 4, 2, 12, [[12, 0, 5, 1], [3, 12, 7, 0]])
    ref = sparse_decode_attention_reference(q, kc, vc, pad, idx, count, 0.25)
    torch.testing.assert_close(ref.double(), naive_attention(q, kc, vc, pad, idx, count, 0.25), atol=1e-5, rtol=1e-5)
    assert (ref[0, 1] == 0).all() and (ref[1, 3] == 0).all()


def test_decode_ops_tables():
    for ops in (REFERENCE_OPS, TRITON_OPS):
        for name in ("cis_match", "topk_retrieval", "compose_indices", "sparse_decode_attention"):
            assert callable(getattr(ops, name))
    assert get_decode_ops("torch") is REFERENCE_OPS and get_decode_ops("triton") is TRITON_OPS
    assert REFERENCE_OPS.topk_retrieval is topk_retrieval_reference
    # eager: the launcher itself; under torch.compile: its torch.ops.prhs custom op (test_compile.py)
    assert TRITON_OPS.topk_retrieval.__wrapped__ is topk_retrieval
    with pytest.raises(ValueError):
        get_decode_ops("cuda")


# ----------------------------------------------------------------------------- kernels


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,D", [(4, 16), (8, 80), (16, 128)])
def test_cis_match_kernel(dtype, s, D):
    g = torch.Generator().manual_seed(10 + s)
    B, H = 3, 4
    q = torch.randn(B, H, D, generator=g).to(dtype)
    q[0, 1] = 0
    anchors = unit_anchors(B, H, s, D, g)
    anchors[1, 2, 1] = q[1, 2].float() / q[1, 2].float().norm()  # similarity 1 ...
    anchors[1, 2, s - 1] = anchors[1, 2, 1]  # ... twice: the lower anchor wins
    anchors[2, 3, 0] = -anchors[2, 3, 0]
    count = torch.randint(0, s + 1, (B, H), generator=g, dtype=I32)
    count[1, 2] = s
    count[0, 0] = 0
    active = torch.tensor([True, True, False])
    for tau in (-1.0, 0.05, 0.97):
        out, retrieve = (x.cpu() for x in cis_match(q.to(DEV), anchors.to(DEV), count.to(DEV), active.to(DEV), tau))
        ref = cis_match_reference(q, anchors, count, active, tau).best
        assert out.dtype == I32 and torch.equal(out, ref)
        assert retrieve.dtype == torch.bool and torch.equal(retrieve, ref == -1)
    assert out[1, 2] == 1 and (out[2] == -2).all() and out[0, 0] == -1


@needs_triton
def test_compact_rows():
    flags = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1] * 300, dtype=torch.bool)  # > one tile
    order, count = compact_rows(flags.to(DEV))
    n = int(count.item())
    assert n == int(flags.sum())
    assert torch.equal(order[:n].cpu().long(), flags.nonzero().flatten())
    assert torch.equal(order[n:].cpu().long(), (~flags).nonzero().flatten().flip(0))


def _topk_case(B, H, Hkv, D, S, pads, ends, sink, local, dtype, seed, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # exact scores in every precision: ties are real ties
        q = torch.randint(-1, 2, (B, H, D), generator=g).to(dtype)
        kc = torch.randint(-1, 2, (B, Hkv, S, D), generator=g).to(dtype)
    else:
        q = torch.randn(B, H, D, generator=g).to(dtype)
        kc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    pad, t, lo, hi = geometry(S, pads, ends, sink, local)
    retrieve = torch.rand(B, H, generator=g) > 0.35
    return q, kc, pad, lo, hi, retrieve


def _check_topk(q, kc, pad, lo, hi, retrieve, k, scale):
    out = topk_retrieval(*(x.to(DEV) for x in (q, kc, pad, lo, hi, retrieve)), k, scale).cpu()
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, scale)
    assert out.shape == ref.shape and out.dtype == I32
    assert torch.equal(out, ref), (out, ref)
    return out


@needs_triton
@pytest.mark.parametrize(
    "dtype,Hkv",
    [(torch.float32, 1), (torch.float16, 2), (torch.bfloat16, 4), (torch.bfloat16, 2)],
)
def test_topk_kernel_ragged_gqa(dtype, Hkv):
    B, H, D, S = 3, 4, 32, 96
    q, kc, pad, lo, hi, retrieve = _topk_case(B, H, Hkv, D, S, [0, 7, 30], [0, 3, 0], 4, 8, dtype, 20 + Hkv)
    for k in (5, 16):
        _check_topk(q, kc, pad, lo, hi, retrieve, k, 1 / math.sqrt(D))


@needs_triton
def test_topk_kernel_k_larger_than_middle_and_empty_middle():
    B, H, D, S = 3, 2, 16, 64
    q, kc, pad, lo, hi, retrieve = _topk_case(B, H, 2, D, S, [0, 10, 40], [0, 0, 0], 4, 8, torch.float32, 30)
    retrieve[:] = True
    lo[0], hi[0] = 10, 10  # empty middle
    out = _check_topk(q, kc, pad, lo, hi, retrieve, 40, 0.5)  # middles: 0, 42 and 12 keys
    assert (out[0] == -1).all()
    n2 = int(hi[2] - lo[2])
    assert n2 < 40 and (out[2, :, :n2] >= 0).all() and (out[2, :, n2:] == -1).all()


@needs_triton
def test_topk_kernel_exact_ties():
    q, kc, pad, lo, hi, retrieve = _topk_case(2, 4, 2, 8, 80, [0, 5], [0, 0], 2, 4, torch.float16, 31, integer=True)
    out = _check_topk(q, kc, pad, lo, hi, retrieve, 24, 1.0)
    assert (out[retrieve] >= 0).all()


@needs_triton
def test_topk_kernel_all_scores_equal():
    # 200 equal scores, k = 20: the radix passes go to full depth, then the 20 lowest indices.
    B, H, D, S = 1, 2, 8, 220
    q = torch.ones(B, H, D)
    kc = torch.ones(B, 1, S, D)
    pad, t, lo, hi = geometry(S, [3], [0], 10, 7)
    retrieve = torch.ones(B, H, dtype=torch.bool)
    out = _check_topk(q, kc, pad, lo, hi, retrieve, 20, 1.0)
    assert out[0, 0].tolist() == list(range(10, 30))
    # Larger keys after many ties: the 10 larger ones first, then the 10 lowest tied indices.
    kc[0, 0, pad[0] + 200 : pad[0] + 210] = 2.0
    out = _check_topk(q, kc, pad, lo, hi, retrieve, 20, 1.0)
    assert out[0, 1].tolist() == list(range(200, 210)) + list(range(10, 20))


@needs_triton
def test_topk_kernel_no_row_retrieves():
    q, kc, pad, lo, hi, retrieve = _topk_case(2, 2, 1, 16, 40, [0, 3], [0, 0], 2, 4, torch.bfloat16, 32)
    retrieve[:] = False
    assert (_check_topk(q, kc, pad, lo, hi, retrieve, 8, 1.0) == -1).all()


@needs_triton
def test_topk_kernel_large_k():
    # k = 300 (candidate sort of 512 packed keys), middle regions of 300-1100 keys
    # (several radix-select tiles and several score chunks).
    q, kc, pad, lo, hi, retrieve = _topk_case(2, 2, 1, 16, 1200, [0, 900], [0, 0], 4, 16, torch.float32, 33)
    retrieve[:] = True
    out = _check_topk(q, kc, pad, lo, hi, retrieve, 300, 0.25)
    assert (out[1, :, 280:] == -1).all() and (out[0] >= 0).all()


@needs_triton
@pytest.mark.slow
def test_topk_kernel_k_4096():
    # The largest k: a 4096-slot candidate buffer with no spare room, so the radix passes run
    # until the k-th key is pinned down; 4642-key middle region. Quantised data (multiples of
    # 1/8): every score is exact in fp32 whatever the summation order (on Gaussian data the
    # tensor-core dot and torch's matmul ordered one near-tie differently), and exact ties
    # are plentiful, so the tie order is checked at full radix depth too.
    g = torch.Generator().manual_seed(34)
    q = torch.randint(-8, 9, (1, 2, 16), generator=g).float() / 8
    kc = torch.randint(-8, 9, (1, 1, 4700, 16), generator=g).float() / 8
    retrieve = torch.tensor([[True, False]])
    out = _check_topk(q, kc, i32([0]), i32([8]), i32([4650]), retrieve, 4096, 0.25)
    assert (out[0, 0] >= 0).all() and (out[0, 1] == -1).all()


def _compose_case(seed, B, H, k, T, sink, local, neg_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=I32)
    lo = torch.minimum(torch.full_like(t, sink), t)
    hi = torch.maximum(lo, t - local)
    sel = torch.randint(0, T, (B, H, k), generator=g, dtype=I32)
    sel[torch.rand(B, H, k, generator=g) < neg_frac] = -1
    return t, lo, hi, hi.clone(), sel, g


def _check_compose(t, lo, hi, ws, sel, dilate, sink, m, r, cap):
    dd = dilate.to(DEV) if isinstance(dilate, torch.Tensor) else dilate
    idx, cnt = compose_indices(*(x.to(DEV) for x in (t, lo, hi, ws, sel)), dd, sink, m, r, cap)
    ref = compose_indices_reference(t, lo, hi, ws, sel, dilate, sink, m, r, cap)
    assert idx.dtype == I32 and cnt.dtype == I32
    assert torch.equal(idx.cpu(), ref[0]) and torch.equal(cnt.cpu(), ref[1])
    return idx.cpu(), cnt.cpu()


@needs_triton
@pytest.mark.parametrize("m,r", [(0, 1), (3, 1), (8, 2), (4, 0)])
def test_compose_kernel_dilation(m, r):
    B, H, k, sink, local = 2, 3, 8, 4, 6
    t, lo, hi, ws, sel, g = _compose_case(40 + m + r, B, H, k, 64, sink, local)
    sel[0, 0] = torch.tensor([int(lo[0]), int(hi[0]) - 1, int(lo[0]) + 1, -1, 20, 21, 22, 20], dtype=I32)
    dilate = torch.rand(B, H, generator=g) > 0.3
    dilate[0, 0] = True
    cap = sink + local + k + 2 * r * m
    idx, cnt = _check_compose(t, lo, hi, ws, sel, dilate, sink, m, r, cap)
    _check_compose(t, lo, hi, ws, sel, True, sink, m, r, cap)
    _check_compose(t, lo, hi, ws, sel, False, sink, m, r, cap)
    row = idx[0, 0, : cnt[0, 0]].tolist()
    assert len(set(row)) == len(row)  # the duplicates from dilation are gone
    lo0, hi0, ws0, t0 = int(lo[0]), int(hi[0]), int(ws[0]), int(t[0])
    middle = [x for x in row if not (x < min(sink, t0) or ws0 <= x < t0)]
    assert all(lo0 <= x < hi0 for x in middle)  # neighbours of the edge indices are clipped
    if r > 0 and m >= 3:
        assert lo0 + 1 + r in middle or lo0 + 1 + r >= hi0  # the neighbour of the 3rd index


@needs_triton
def test_compose_kernel_edge_geometries():
    # window overlapping middle and sink, empty middle, tiny t, out-of-region selections.
    t = i32([30, 12, 3, 0])
    lo = i32([4, 4, 3, 0])
    hi = i32([25, 4, 3, 0])
    ws = i32([20, 2, -5, 0])
    sel = torch.randint(-1, 40, (4, 2, 5), generator=torch.Generator().manual_seed(50), dtype=I32)
    idx, cnt = _check_compose(t, lo, hi, ws, sel, True, 4, 5, 1, 40)
    assert cnt[3].tolist() == [0, 0] and (idx[3] == -1).all()  # t = 0: empty set
    assert cnt[2].tolist() == [3, 3]


@needs_triton
def test_compose_kernel_many_candidates():
    # k = 100 and 2*r*m = 120 neighbours: a 256-wide register sort; window of 40.
    t, lo, hi, ws, sel, g = _compose_case(51, 2, 2, 100, 600, 8, 40, neg_frac=0.05)
    _check_compose(t, lo, hi, ws, sel, True, 8, 30, 2, 8 + 40 + 100 + 120)


@st.composite
def compose_inputs(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    k = draw(st.integers(1, 12))
    sink, local = draw(st.integers(0, 6)), draw(st.integers(0, 8))
    m, r = draw(st.integers(0, k)), draw(st.integers(0, 3))
    t = [draw(st.integers(0, 80)) for _ in range(B)]
    lo = [min(sink + draw(st.integers(0, 4)), tt) for tt in t]
    hi = [max(l, tt - local) for l, tt in zip(lo, t)]
    ws = [h - draw(st.integers(0, 3)) for h in hi]
    sel = [[[draw(st.integers(-1, 90)) for _ in range(k)] for _ in range(H)] for _ in range(B)]
    dil = [[draw(st.booleans()) for _ in range(H)] for _ in range(B)]
    cap = sink + (local + 3 + 4) + k + 2 * r * m
    return (i32(t), i32(lo), i32(hi), i32(ws), i32(sel), torch.tensor(dil), sink, m, r, cap)


def _compose_properties(args, idx, cnt):
    t, lo, hi, ws, sel, dil, sink, m, r, cap = args
    B, H, k = sel.shape
    for b in range(B):
        for h in range(H):
            n = int(cnt[b, h])
            row = idx[b, h].tolist()
            got = row[:n]
            assert all(x == -1 for x in row[n:])
            assert got == sorted(set(got))  # sorted, unique
            assert all(0 <= x < int(t[b]) for x in got)  # in range
            s = set(got)
            assert set(range(min(sink, int(t[b])))) <= s  # sink
            assert set(range(max(int(ws[b]), 0), int(t[b]))) <= s  # window
            budget = min(sink, int(t[b])) + max(int(t[b]) - max(int(ws[b]), 0), 0) + k
            assert n <= budget + (2 * r * m if bool(dil[b, h]) else 0)
            assert s == naive_index_set(
                int(t[b]), int(lo[b]), int(hi[b]), int(ws[b]), sel[b, h].tolist(),
                bool(dil[b, h]), sink, m, r,
            )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compose_inputs())
def test_compose_reference_properties(args):
    _compose_properties(args, *compose_indices_reference(*args))


@needs_triton
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compose_inputs())
def test_compose_kernel_properties(args):
    _compose_properties(args, *_check_compose(*args))


def _attention_case(B, H, Hkv, D, S, cap, dtype, seed, pads, lists=None):
    """Attention inputs with ``lists`` index lists per sequence (default ``H``: one per query head;
    ``Hkv``: one per KV head, group-shared), counts 0 .. cap."""
    lists = H if lists is None else lists
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    kc = (2 * torch.randn(B, Hkv, S, D, generator=g)).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    pad = i32(pads)
    rows = []
    for b in range(B):
        rows.append(torch.stack([torch.randperm(S - pads[b], generator=g)[:cap].sort().values for _ in range(lists)]))
    idx = torch.stack(rows).to(I32)
    count = torch.randint(0, cap + 1, (B, lists), generator=g, dtype=I32)
    count[0, 0] = 0
    count[-1, -1] = cap
    idx[torch.arange(cap) >= count[..., None].long()] = -1
    return q, kc, vc, pad, idx, count


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv,D,splits", [(4, 16, 1), (2, 80, 3), (1, 64, None), (2, 256, 2)])
def test_attention_kernel(dtype, Hkv, D, splits):
    B, H, S, cap = 2, 4, 90, 70
    q, kc, vc, pad, idx, count = _attention_case(B, H, Hkv, D, S, cap, dtype, 60 + D, [0, 13])
    scale = 1 / math.sqrt(D)
    out = sparse_decode_attention(
        *(x.to(DEV) for x in (q, kc, vc, pad, idx, count)), scale, num_splits=splits
    )
    ref = sparse_decode_attention_reference(q, kc, vc, pad, idx, count, scale)
    assert_out_close(out, ref, dtype)
    assert (out[0, 0] == 0).all()  # count 0
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), naive_attention(q, kc, vc, pad, idx, count, scale), atol=1e-5, rtol=1e-5)


@needs_triton
def test_attention_schedule_splits_only_below_two_programs_per_sm():
    """The split rule the H200 sweep picked (docs/results/bench_decode_attention.json): one split (no
    combine launch) from about 2 programs per SM or for lists under 8 tiles, else chunks of >= 8 tiles."""
    from prhs_hf.ops.sparse_attention.sparse_decode_attention import attention_schedule

    cpu = torch.device("cpu")  # num_sms: 132, the H200's, off CUDA
    assert attention_schedule(32 * 12, 186, 128, cpu)[2] == 1  # Qwen 12/2 B32/16k (was 2)
    assert attention_schedule(8 * 12, 186, 128, cpu)[2] == 1  # B8/32k: 96 rows, a 3-tile list
    assert attention_schedule(16 * 32, 2046, 128, cpu)[2] == 1  # MHA B16/16k (was 4)
    assert attention_schedule(8 * 32, 2046, 128, cpu)[2] == 2  # MHA B8/16k: 2 measured best
    assert attention_schedule(32, 4500, 128, cpu)[2] == 9  # few rows, a long list: chunks of 8 tiles
    block_n, chunk, n = attention_schedule(4, 1000, 128, cpu, num_splits=3)
    assert (block_n, n) == (64, 3) and chunk * n >= 1000


def test_attention_kernel_hf_strides():
    # Caches as HF slices of a [B, S, Hkv, D] buffer (non-contiguous head/seq strides).
    B, H, Hkv, D, S, cap = 2, 4, 2, 32, 50, 24
    q, kc, vc, pad, idx, count = _attention_case(B, H, Hkv, D, S, cap, torch.float16, 70, [0, 5])
    kc_s = kc.transpose(1, 2).contiguous().transpose(1, 2)
    vc_s = vc.transpose(1, 2).contiguous().transpose(1, 2)
    assert not kc_s.is_contiguous()
    out = sparse_decode_attention(*(x.to(DEV) for x in (q, kc_s, vc_s, pad, idx, count)), 0.2, num_splits=2)
    assert_out_close(out, sparse_decode_attention_reference(q, kc, vc, pad, idx, count, 0.2), torch.float16)


def _step_case(seed, dtype, B=3, H=4, Hkv=2, D=32, S=120, s=4):
    """Inputs of a whole decode step: ``(q, kc, vc, pad, t, lo, hi, ws, anchors, anchor_count,
    anchor_idx, active)`` with the first two heads' anchor 0 planted (they share), and the budget
    keywords (sink 4, local 8, k 12, m 4, r 1; the capacity lets inactive rows attend to all t)."""
    g = torch.Generator().manual_seed(seed)
    sink, local, k, m, r = 4, 8, 12, 4, 1
    q = torch.randn(B, H, D, generator=g).to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    pad, t, lo, hi = geometry(S, [0, 9, 100], [0, 0, 0], sink, local)
    active = t > sink + local + k
    ws = torch.where(active, hi, lo)
    anchors = unit_anchors(B, H, s, D, g)
    anchors[:, :2, 0] = q[:, :2].float() / q[:, :2].float().norm(dim=-1, keepdim=True)
    anchor_count = torch.randint(0, s + 1, (B, H), generator=g, dtype=I32)
    anchor_count[:, :2] = s
    anchor_idx = torch.randint(-1, S, (B, H, s, k), generator=g, dtype=I32)
    kw = dict(tau=0.9, sink=sink, k=k, dil_m=m, dil_r=r, cap=sink + local + k + 2 * r * m + S, scale=D**-0.5)
    return (q, kc, vc, pad, t, lo, hi, ws, anchors, anchor_count, anchor_idx, active), kw


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_decode_step_triton_equals_reference(dtype):
    """match -> retrieve -> compose -> attend (_bench_common.cis_decode_step), both backends."""
    inputs, kw = _step_case(80, dtype)
    results = []
    for ops, dev in ((REFERENCE_OPS, torch.device("cpu")), (TRITON_OPS, DEV)):
        res = cis_decode_step(ops, *(x.to(dev) for x in inputs), **kw)
        results.append([x.cpu() for x in (res.best, res.new_idx, res.idx, res.count, res.out)])
    (b0, n0, i0, c0, o0), (b1, n1, i1, c1, o1) = results
    assert (b0[:, :2] == 0).logical_or(b0[:, :2] == -2).all()  # the planted anchors are shared
    assert (b0 == -1).any()  # and some rows retrieve
    assert torch.equal(b0, b1) and torch.equal(n0, n1) and torch.equal(i0, i1) and torch.equal(c0, c1)
    assert_out_close(o1, o0, dtype)


# -------------------------------------------------- anchor sets: building them (§3a), composing from them (§3b)


def test_compose_indices_re_exports_the_dilated_set():
    """The dilated set lives in dilated_set.py; compose_indices re-exports its public names (the
    imports from before it moved keep working) and holds none of its tunables or kernels, so a
    monkeypatch of them on compose_indices fails instead of changing nothing."""
    for name in ("SET_NONE", "dilate_mask", "dilated_set", "dilated_set_reference", "dilated_set_size"):
        assert name in compose_module.__all__ and getattr(compose_module, name) is getattr(dilated_module, name)
    for name in ("MAP_CHUNK", "MAP_COLLECT", "MAP_COLLECTS", "MAP_FROM_ENTRIES", "_collect_map",
                 "_dilated_set_kernel", "_dilated_collect_kernel", "_dilated_count_kernel", "_dilated_write_kernel"):
        assert hasattr(dilated_module, name) and not hasattr(compose_module, name), name


def naive_dilated_set(p, dil_m, dil_r):
    """Encoded set of one row: (v << 1) | only-neighbour, ascending."""
    sel = {x for x in p if x >= 0}
    nbs = {x + j for x in p[:dil_m] if x >= 0 for j in range(-dil_r, dil_r + 1) if j != 0}
    return sorted([2 * v for v in sel] + [2 * v + 1 for v in nbs - sel])


def _set_case(seed, B, H, k, T, neg_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    sel = torch.randint(0, T, (B, H, k), generator=g, dtype=I32)
    sel[torch.rand(B, H, k, generator=g) < neg_frac] = -1
    sel[0, 0, :3] = i32([0, 1, 1])[: min(3, k)]  # negative neighbours and duplicates
    rows = torch.rand(B, H, generator=g) > 0.3
    rows[0, 0] = True
    return sel, rows, g


@pytest.mark.parametrize("m,r", [(0, 1), (3, 1), (8, 2), (4, 0), (100, 3)])
def test_reference_dilated_set_against_naive(m, r):
    sel, rows, _ = _set_case(90 + m + r, 2, 3, 8, 40)
    ref = dilated_set_reference(sel, rows, m, r)
    assert ref.shape[-1] == dilated_set_size(8, m, r) and ref.dtype == I32
    for b in range(2):
        for h in range(3):
            want = naive_dilated_set(sel[b, h].tolist(), min(m, 8) if r > 0 else 0, r) if rows[b, h] else []
            got = ref[b, h].tolist()
            assert got[: len(want)] == want and all(x == SET_NONE for x in got[len(want):])


#: dilated_set's map path with each collect: one program per row, or programs per (row, chunk)
MAP_METHODS = ("map", "map_parallel")


@needs_triton
@pytest.mark.parametrize("k,m,r", [(8, 0, 1), (8, 3, 1), (8, 8, 2), (8, 4, 0), (100, 30, 2), (5, 9, 3)])
def test_dilated_set_kernel(k, m, r):
    sel, rows, _ = _set_case(110 + k + m + r, 2, 3, k, 300)
    for rr in (rows, True, False):
        want = dilated_set_reference(sel, rr, m, r)
        dev_rows = rr.to(DEV) if isinstance(rr, torch.Tensor) else rr
        for method in ("sort", *MAP_METHODS):  # the map path marks [-r, span + r): indices 0 and span - 1 included
            got = dilated_set(sel.to(DEV), dev_rows, m, r, span=300, _method=method).cpu()
            assert torch.equal(got, want), method
        assert torch.equal(dilated_set(sel.to(DEV), dev_rows, m, r).cpu(), want)  # auto, no span: the sort


@needs_triton
def test_dilated_set_map_path_at_the_bench_size_and_its_errors():
    """The size where "auto" takes the map (k 1036, m 345: 1726 entries), edge indices, -1 holes."""
    g = torch.Generator().manual_seed(5)
    span, k = 4000, 1036
    sel = torch.stack([torch.randperm(span, generator=g)[:k] for _ in range(3)]).view(1, 3, k).to(I32)
    sel[0, 0, :4] = i32([0, span - 1, 1, span - 2])  # neighbours below 0 and at/after span
    sel[0, 1, 5:40] = -1
    rows = torch.tensor([[True, True, False]])
    want = dilated_set_reference(sel, rows, 345, 1)
    for method in ("auto", "sort", *MAP_METHODS):  # span + 2 = 4002 map positions: two chunks of 2048
        assert torch.equal(dilated_set(sel.to(DEV), rows.to(DEV), 345, 1, span=span, _method=method).cpu(), want)
    for method in MAP_METHODS:
        with pytest.raises(ValueError, match=f"_method='{method}' needs span > 0"):
            dilated_set(sel.to(DEV), rows.to(DEV), 345, 1, _method=method)
    with pytest.raises(ValueError, match="_method='bitmap'.*'map_parallel'"):
        dilated_set(sel.to(DEV), rows.to(DEV), 345, 1, span=span, _method="bitmap")


@needs_triton
@pytest.mark.parametrize("B,H,span,chunk,k,m,r", [
    (1, 1, 60, 16, 8, 3, 2),  # L = span + 2r = 64: a whole number of chunks
    (2, 3, 300, 64, 8, 8, 1),  # L = 302: the last chunk partial
    (3, 2, 300, 16, 8, 0, 1),  # 19 chunks for 8 entries: the chunks past the set pad nothing
    (2, 2, 200, 32, 40, 13, 0),  # r = 0: no neighbours (the map keeps a margin of 1)
    (1, 4, 97, 8, 30, 30, 2),  # 13 chunks of a densely marked row: many duplicates
])
def test_dilated_set_parallel_collect_over_chunks(monkeypatch, B, H, span, chunk, k, m, r):
    """The parallel collect with chunks much smaller than a map row: each chunk's entries at the
    count of the chunks before it, the padding shared among the chunks; the serial collect's and
    the reference's sets, for flagged rows, rows without the flag, all rows and none."""
    monkeypatch.setattr(dilated_module, "MAP_CHUNK", chunk)
    sel, rows, _ = _set_case(200 + span + chunk + k + m + r, B, H, k, span)
    sel[-1, -1, :2] = i32([span - 1, span - 2])  # neighbours at and after span
    for rr in (rows, True, False):
        want = dilated_set_reference(sel, rr, m, r)
        dev_rows = rr.to(DEV) if isinstance(rr, torch.Tensor) else rr
        for method in MAP_METHODS:
            got = dilated_set(sel.to(DEV), dev_rows, m, r, span=span, _method=method).cpu()
            assert torch.equal(got, want), (method, rr)


@needs_triton
@pytest.mark.parametrize("method", MAP_METHODS)
def test_dilated_set_map_collect_of_full_sets(monkeypatch, method):
    """Sets without padding (distinct indices 5 apart, r 2: every candidate its own entry), one in
    the first and one in the last slots of the map."""
    monkeypatch.setattr(dilated_module, "MAP_CHUNK", 16)
    B, H, k, m, r = 2, 2, 12, 12, 2
    span = 5 * k
    g = torch.Generator().manual_seed(4)
    sel = torch.stack([torch.randperm(k, generator=g) * 5 for _ in range(B * H)]).view(B, H, k).to(I32)
    sel[1, 1] = sel[1, 1] + 4  # 4 .. span - 1: neighbours up to span + 1
    want = dilated_set_reference(sel, True, m, r)
    assert (want != SET_NONE).all()
    assert torch.equal(dilated_set(sel.to(DEV), True, m, r, span=span, _method=method).cpu(), want)


@needs_triton
@pytest.mark.parametrize("collect", ["serial", "parallel"])
def test_map_collect_stores_no_more_than_the_set_size(monkeypatch, collect):
    """A map with more marks than a set has entries (no dilated set has): each row holds its first
    ``nset`` marked positions and nothing is stored past its end (a guard of the last row's stores)."""
    monkeypatch.setattr(dilated_module, "MAP_CHUNK", 16)
    B, H, nset, R, span = 1, 3, 10, 1, 100
    marks = torch.zeros(B * H, span + 2 * R, dtype=torch.int8)
    marks[:, ::3] = 1
    marks[:, 1::7] = 2
    marks[1] = 0
    marks[1, 5] = 2  # one entry, then padding
    flag = torch.tensor([[True, True, False]])
    buf = torch.full((B * H * nset + 64,), -7, dtype=I32, device=DEV)
    dilated_module._collect_map(marks.to(DEV), flag.to(DEV), buf[: B * H * nset].view(B, H, nset), R,
                                parallel=collect == "parallel")
    got = buf.cpu()
    j = torch.arange(span + 2 * R)
    row0 = (((j - R) << 1) | (marks[0] == 1).int())[marks[0] != 0][:nset].to(I32)
    want = torch.cat([row0, i32([((5 - R) << 1)] + [SET_NONE] * (nset - 1)), torch.full((nset,), SET_NONE, dtype=I32),
                      torch.full((64,), -7, dtype=I32)])
    assert torch.equal(got, want)


def _sets_case(seed, B, H, s, k, m, r, T, sink, local):
    """best in {-2, -1, 0..s-1}, anchors' sets from random top-k lists, a fresh top-k."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=I32)
    lo = torch.minimum(torch.full_like(t, sink), t)
    hi = torch.maximum(lo, t - local)
    ws = hi - torch.randint(0, 3, (B,), generator=g, dtype=I32)
    anchor_idx = torch.randint(-1, T, (B, H, s, k), generator=g, dtype=I32)
    new_idx = torch.randint(-1, T, (B, H, k), generator=g, dtype=I32)
    best = torch.randint(-1, s, (B, H), generator=g, dtype=I32)
    best[-1] = -2  # an inactive sequence
    new_idx[best != -1] = -1
    sets = dilated_set_reference(anchor_idx.view(B, H * s, k), True, m, r).view(B, H, s, -1)
    new_set = dilated_set_reference(new_idx, best == -1, m, r)
    cap = sink + local + 3 + k + 2 * r * m
    return t, lo, hi, ws, best, anchor_idx, new_idx, sets, new_set, cap


@pytest.mark.parametrize("m,r", [(0, 1), (3, 1), (8, 2), (4, 0)])
def test_reference_compose_from_sets_is_compose_indices(m, r):
    """§3b = §3: composing from the dilated sets gives the index lists of the top-k lists."""
    B, H, s, k, sink, local = 3, 4, 3, 8, 4, 6
    t, lo, hi, ws, best, anchor_idx, new_idx, sets, new_set, cap = _sets_case(
        130 + m + r, B, H, s, k, m, r, 60, sink, local
    )
    got = compose_from_sets_reference(t, lo, hi, ws, best, sets, new_set, sink, cap)
    pick = best.clamp_min(0).long().view(B, H, 1, 1).expand(B, H, 1, k)
    shared_idx = torch.gather(anchor_idx, 2, pick).view(B, H, k)
    sel = torch.where((best == -1)[..., None], new_idx, torch.where((best >= 0)[..., None], shared_idx, -1))
    want = compose_indices_reference(t, lo, hi, ws, sel, best >= 0, sink, m, r, cap)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[0], naive_compose(t, lo, hi, ws, sel, best >= 0, sink, m, r, cap)[0])


@needs_triton
@pytest.mark.parametrize("m,r", [(0, 1), (3, 1), (8, 2), (4, 0)])
def test_compose_from_sets_kernel(m, r):
    B, H, s, k, sink, local = 3, 4, 3, 8, 4, 6
    t, lo, hi, ws, best, _, _, sets, new_set, cap = _sets_case(150 + m + r, B, H, s, k, m, r, 60, sink, local)
    for c in (cap, cap - 5):  # also a capacity that truncates
        got = compose_from_sets(*(x.to(DEV) for x in (t, lo, hi, ws, best, sets, new_set)), sink, c)
        want = compose_from_sets_reference(t, lo, hi, ws, best, sets, new_set, sink, c)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@needs_triton
@pytest.mark.parametrize("k,m,r", [(8, 0, 1), (8, 3, 1), (8, 8, 2), (8, 4, 0), (40, 13, 3)])
def test_dilate_and_compose_kernel(k, m, r):
    """One launch = dilated_set then compose_from_sets: the retrieving rows' sets and every row's list."""
    B, H, s, sink, local = 3, 4, 3, 4, 6
    t, lo, hi, ws, best, _, new_idx, sets, _, cap = _sets_case(170 + k + m + r, B, H, s, k, m, r, 90, sink, local)
    for c in (cap, cap - 5):  # also a capacity that truncates
        want = dilate_and_compose_reference(t, lo, hi, ws, best, sets, new_idx, sink, c, m, r, 90)
        got = dilate_and_compose(*(x.to(DEV) for x in (t, lo, hi, ws, best, sets, new_idx)), sink, c, m, r, 90)
        for g_, w_ in zip(got, want):
            assert torch.equal(g_.cpu(), w_)
    assert (want[0][best == -1] != SET_NONE).any() and (want[0][best != -1] == SET_NONE).all()


@needs_triton
def test_dilate_and_compose_map_sized_sets_and_errors():
    """Sets of the map path's size (k 600, m 200, r 1: 1000 entries, 1024 padded) take the two
    launchers and give the same; a set size that does not match the anchors' is refused."""
    B, H, s, k, m, r, sink, local, T = 1, 3, 2, 600, 200, 1, 4, 8, 2000
    t, lo, hi, ws, best, _, new_idx, sets, _, cap = _sets_case(7, B + 1, H, s, k, m, r, T, sink, local)
    want = dilate_and_compose_reference(t, lo, hi, ws, best, sets, new_idx, sink, cap, m, r, T)
    for span in (T, 0):  # with span: the map path; without: the fused sort
        got = dilate_and_compose(*(x.to(DEV) for x in (t, lo, hi, ws, best, sets, new_idx)), sink, cap, m, r, span)
        for g_, w_ in zip(got, want):
            assert torch.equal(g_.cpu(), w_)
    for fn in (dilate_and_compose_reference, dilate_and_compose):
        with pytest.raises(ValueError, match="dilated_set_size"):
            fn(*(x.to(DEV) for x in (t, lo, hi, ws, best, sets, new_idx)), sink, cap, m + 1, r)


class _Unlaunchable:
    """Stands in for a Triton kernel that must not be launched."""

    def __getitem__(self, grid):
        raise AssertionError("a kernel that must not be launched was launched")


@needs_triton
@pytest.mark.parametrize("collect", ["serial", "parallel"])
def test_dilate_and_compose_map_path_takes_map_collect(monkeypatch, collect):
    """MAP_COLLECT picks the collect of dilated_set's "auto" map path, and so of dilate_and_compose's
    on map-sized sets: neither the fused sort nor the other collect can launch, and the result is
    the reference's."""
    not_chosen = {"serial": "_dilated_count_kernel", "parallel": "_dilated_collect_kernel"}[collect]
    monkeypatch.setattr(dilated_module, "MAP_COLLECT", collect)
    monkeypatch.setattr(dilated_module, not_chosen, _Unlaunchable())
    monkeypatch.setattr(compose_module, "_dilate_compose_kernel", _Unlaunchable())  # map-sized: not the fused sort
    monkeypatch.setattr(dilated_module, "MAP_CHUNK", 256)  # 8 chunks of the 2002 map positions
    B, H, s, k, m, r, sink, local, T = 1, 3, 2, 600, 200, 1, 4, 8, 2000
    t, lo, hi, ws, best, _, new_idx, sets, _, cap = _sets_case(9, B + 1, H, s, k, m, r, T, sink, local)
    want = dilate_and_compose_reference(t, lo, hi, ws, best, sets, new_idx, sink, cap, m, r, T)
    got = dilate_and_compose(*(x.to(DEV) for x in (t, lo, hi, ws, best, sets, new_idx)), sink, cap, m, r, T)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_.cpu(), w_)
    assert (want[0][best == -1] != SET_NONE).any()


@needs_triton
def test_dilated_set_names_map_collect_when_it_is_unknown(monkeypatch):
    """An unknown MAP_COLLECT is refused by every "auto" call, with or without the map path."""
    monkeypatch.setattr(dilated_module, "MAP_COLLECT", "bitonic")
    sel = torch.zeros(1, 1, 1024, dtype=I32, device=DEV)
    for span in (10, 0):
        with pytest.raises(ValueError, match="MAP_COLLECT='bitonic'; expected one of 'serial', 'parallel'"):
            dilated_set(sel, True, 0, 0, span=span)


def _record_case(seed, k, m, r, s=4, L=3, D=16, dtype=torch.float32):
    """A dilate-and-compose case and a state of L layers consistent with it: every sharing row's
    anchor is in use (best < count) and no row holds s anchors before a step."""
    B, H, sink, local, T = 3, 4, 4, 6, 90
    t, lo, hi, ws, _, _, new_idx, sets, _, cap = _sets_case(seed, B, H, s, k, m, r, T, sink, local)
    g = torch.Generator().manual_seed(seed + 1)
    best = torch.arange(B * H, dtype=I32).view(B, H) % s - 1  # -1 (retrieve), 0 .. s - 2 (share)
    best[-1] = -2  # an inactive sequence
    new_idx = torch.where((best == -1)[..., None], torch.randint(-1, T, (B, H, k), generator=g, dtype=I32), -1)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    q[0, 1] = 0  # a zero query stores a zero vector
    aq = torch.randn(L, B, H, s, D, generator=g)
    ai = torch.randint(0, 2 * T, (L, B, H, s, sets.shape[-1]), generator=g, dtype=I32)
    ac = torch.randint(0, s, (L, B, H), generator=g, dtype=I32)
    base = (best + 1).clamp_min(0)  # counts in [base, s - 1]
    ac[1] = base + (torch.rand(B, H, generator=g) * (s - base).float()).floor().to(I32)
    ai[1] = sets
    return (t, lo, hi, ws, best, new_idx), (aq, ai, ac), q, (sink, cap, m, r)


@pytest.mark.parametrize("step", [5, 8])
def test_reference_dilate_compose_and_record_is_compose_then_record(step):
    """The reference reads the layer's sets as dilate_and_compose and records as record_anchors."""
    from prhs_hf.ops.compose.record_anchors import record_anchors_reference

    frame, state, q, (sink, cap, m, r) = _record_case(180, 8, 3, 1)
    step = torch.tensor(step)
    want_state = [x.clone() for x in state]
    t, lo, hi, ws, best, new_idx = frame
    want = dilate_and_compose_reference(t, lo, hi, ws, best, want_state[1][1].clone(), new_idx, sink, cap, m, r, 90)
    record_anchors_reference(*want_state, 1, q, want[0], best, step)
    got = dilate_compose_and_record_reference(*frame, *state, 1, q, step, sink, cap, m, r, 90)
    for g_, w_ in zip((*got, *state), (*want, *want_state)):
        assert torch.equal(g_, w_)
    assert (state[2][1] == 0).all() if int(step) % 4 == 0 else (state[2][1] >= 1).any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,m,r,step", [(8, 3, 1, 5), (40, 13, 3, 8), (8, 4, 0, 6)])
def test_dilate_compose_and_record_kernel(dtype, k, m, r, step):
    """One launch = dilate_and_compose on the layer's anchor sets, then record_anchors of its new
    sets: the same outputs and the same state of every layer."""
    frame, state, q, (sink, cap, m, r) = _record_case(190 + k + m + r, k, m, r, dtype=dtype)
    step = torch.tensor(step)
    want_state = [x.clone() for x in state]
    want = dilate_compose_and_record_reference(*frame, *want_state, 1, q, step, sink, cap, m, r, 90)
    dev_state = [x.clone().to(DEV) for x in state]
    got = dilate_compose_and_record(*(x.to(DEV) for x in frame), *dev_state, 1, q.to(DEV), step.to(DEV),
                                    sink, cap, m, r, 90)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_.cpu(), w_)
    torch.testing.assert_close(dev_state[0].cpu(), want_state[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(dev_state[1].cpu(), want_state[1]) and torch.equal(dev_state[2].cpu(), want_state[2])
    assert not torch.equal(want_state[1], state[1])  # the record wrote the layer's slots


@needs_triton
def test_dilate_compose_and_record_errors_name_the_op():
    frame, state, q, (sink, cap, m, r) = _record_case(7, 8, 3, 1)
    for fn in (dilate_compose_and_record_reference, dilate_compose_and_record):
        with pytest.raises(ValueError, match="layer 3 not in"):
            fn(*frame, *state, 3, q, torch.tensor(5), sink, cap, m, r)
    with pytest.raises(ValueError, match="dilate_compose_and_record: step"):
        dilate_compose_and_record(*frame, *state, 1, q, torch.tensor(5, dtype=torch.int32), sink, cap, m, r)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_decode_step_anchor_sets(dtype):
    """The §3b fast path (anchor sets) gives the same step as the top-k path, both backends."""
    inputs, kw = _step_case(81, dtype)
    B, H, s, k = inputs[10].shape
    m, r = kw["dil_m"], kw["dil_r"]
    base = [x.cpu() for x in cis_decode_step(REFERENCE_OPS, *inputs, **kw)[:5]]
    for ops, dev in ((REFERENCE_OPS, torch.device("cpu")), (TRITON_OPS, DEV)):
        a = [x.to(dev) for x in inputs]
        sets = dilated_set_reference(a[10].view(B, H * s, k), True, m, r).view(B, H, s, -1)
        a[10] = sets
        res = cis_decode_step(ops, *a, **kw, anchor_sets=True)
        got = [x.cpu() for x in res[:5]]
        for x, y in zip(got[:4], base[:4]):
            assert torch.equal(x, y)
        assert_out_close(got[4], base[4], dtype)
        want_set = dilated_set_reference(base[1], base[0] == -1, m, r)
        assert torch.equal(res.new_set.cpu(), want_set)
        assert (base[0] == -1).any() and (base[0] >= 0).any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_step_is_the_group_selection_then_the_grouped_attention(dtype):
    """cis_decode_step(grouped=True): cis_select's group rows, then one K/V read per group; the
    Triton ops give the reference's rows and output (the bench's "CIS-16 group step" column)."""
    g = torch.Generator().manual_seed(82)
    B, H, Hkv, D, S, s = 2, 6, 2, 16, 110, 4
    G = H // Hkv
    sink, local, k, m, r = 4, 8, 12, 4, 1
    q = torch.randn(B, H, D, generator=g).to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    pad, t, lo, hi = geometry(S, [0, 7], [0, 0], sink, local)
    active = t > sink + local + k
    ws = torch.where(active, hi, lo)
    anchors = unit_anchors(B, Hkv, s, G * D, g)
    anchors[:, 0, 1] = group_query(q, Hkv)[:, 0] / math.sqrt(G)  # KV head 0 shares, head 1 retrieves
    anchor_count = torch.full((B, Hkv), s, dtype=I32)
    raw = torch.randint(-1, S, (B, Hkv * s, k), generator=g, dtype=I32)
    cap = sink + local + k + 2 * r * m + S
    kw = dict(tau=0.9, sink=sink, k=k, dil_m=m, dil_r=r, cap=cap, scale=D**-0.5)
    with pytest.raises(ValueError, match="anchor_sets=True"):
        cis_decode_step(REFERENCE_OPS, q, kc, vc, pad, t, lo, hi, ws, anchors, anchor_count,
                        raw.view(B, Hkv, s, k), active, **kw, grouped=True)
    base = None
    for ops, dev in ((REFERENCE_OPS, torch.device("cpu")), (TRITON_OPS, DEV)):
        a = [x.to(dev) for x in (q, kc, vc, pad, t, lo, hi, ws, anchors, anchor_count, raw, active)]
        a[10] = dilated_set_reference(a[10], True, m, r).view(B, Hkv, s, -1)
        res = cis_decode_step(ops, *a, **kw, anchor_sets=True, grouped=True)
        got = [x.cpu() for x in res[:5]]
        if base is None:
            base = got
            sel = cis_select(ops, a[0], a[1], *a[3:], **kw, grouped=True)
            assert torch.equal(got[2], sel.idx) and got[2].shape[1] == Hkv
            assert (got[0] == -1).any() and (got[0] >= 0).any()
            per_head = REFERENCE_OPS.sparse_decode_attention(q, kc, vc, pad, sel.idx.repeat_interleave(G, 1),
                                                             sel.count.repeat_interleave(G, 1), D**-0.5)
            assert_out_close(got[4], per_head, dtype)
            continue
        for x, y in zip(got[:4], base[:4]):
            assert torch.equal(x, y)
        assert_out_close(got[4], base[4], dtype)


# ----------------------------------------------------------------------------- GQA
# Group-aware scoring (one read of a KV head's keys for all retrieving heads of its group),
# both selects, and the group-shared launchers (one index list per KV head).


def naive_topk_grouped(q, k_cache, pad, lo, hi, retrieve, k, scale):
    """DECODE_PIPELINE §2 with one list per KV head, ranked by the max over the group's heads."""
    B, H, _ = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    out = torch.full((B, Hkv, k), -1, dtype=I32)
    for b in range(B):
        for kvh in range(Hkv):
            if not bool(retrieve[b, kvh]):
                continue
            scored = []
            for j in range(max(int(lo[b]), 0), int(hi[b])):
                slot = int(pad[b]) + j
                if slot >= S:
                    break
                kv = k_cache[b, kvh, slot].double()
                s = max(scale * float(q[b, kvh * G + g].double() @ kv) for g in range(G))
                scored.append((-s, j))
            for i, (_, j) in enumerate(sorted(scored)[:k]):
                out[b, kvh, i] = j
    return out


@pytest.mark.parametrize("Hq,Hkv", [(4, 1), (4, 2), (6, 2), (8, 8)])
def test_reference_topk_grouped_against_naive(Hq, Hkv):
    g = torch.Generator().manual_seed(90 + Hq)
    B, D, S = 3, 8, 40
    q = torch.randn(B, Hq, D, generator=g)
    kc = torch.randn(B, Hkv, S, D, generator=g)
    pad, t, lo, hi = geometry(S, [0, 5, 9], [0, 2, 0], sink=3, local=4)
    lo[2], hi[2] = 7, 7  # empty middle
    retrieve = torch.rand(B, Hkv, generator=g) > 0.3
    retrieve[0, 0] = True
    for k in (1, 6, 40):
        ref = topk_retrieval_grouped_reference(q, kc, pad, lo, hi, retrieve, k, 0.3)
        assert ref.shape == (B, Hkv, k)
        assert torch.equal(ref, naive_topk_grouped(q, kc, pad, lo, hi, retrieve, k, 0.3))
    assert (ref[2] == -1).all() and (ref[~retrieve] == -1).all()
    if Hq == Hkv:  # G = 1: the per-head retrieval
        assert torch.equal(ref, topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 40, 0.3))


def test_reference_attention_grouped_against_naive():
    Hq, Hkv = 6, 2
    q, kc, vc, pad, idx, count = _small_attention_case(91, Hq, Hkv, 11, [[11, 0], [3, 7]])
    ref = sparse_decode_attention_grouped_reference(q, kc, vc, pad, idx, count, 0.25)
    G = Hq // Hkv
    naive = naive_attention(q, kc, vc, pad, idx.repeat_interleave(G, 1), count.repeat_interleave(G, 1), 0.25)
    torch.testing.assert_close(ref.double(), naive, atol=1e-5, rtol=1e-5)
    assert (ref[0, 3:6] == 0).all()  # the second group of sequence 0 has count 0


def _gqa_topk_case(B, Hq, Hkv, D, S, pads, dtype, seed):
    """Integer data (exact scores in every precision and summation order, many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (B, Hq, D), generator=g).to(dtype)
    kc = torch.randint(-2, 3, (B, Hkv, S, D), generator=g).to(dtype)
    pad, t, lo, hi = geometry(S, pads, [0] * B, 3, 5)
    return q, kc, pad, lo, hi


@needs_triton
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (12, 2), (4, 4), (16, 1)])
def test_topk_kernel_partial_groups(Hq, Hkv):
    """Groups with no, one, some and all heads retrieving; every select."""
    B, D, S = 2, 16, 70
    q, kc, pad, lo, hi = _gqa_topk_case(B, Hq, Hkv, D, S, [0, 11], torch.float16, 100 + Hq)
    G = Hq // Hkv
    retrieve = torch.zeros(B, Hq, dtype=torch.bool)
    retrieve[0, 0] = True  # group (0, 0): one head
    retrieve[1, : G * Hkv // 2 + 1] = True  # sequence 1: whole groups and a partial one
    if Hkv > 1:
        retrieve[0, G * (Hkv - 1) :: 2] = True  # the last group of sequence 0: every other head
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 9, 0.5)
    dev = [x.to(DEV) for x in (q, kc, pad, lo, hi, retrieve)]
    for select in SELECT_MODES:
        out = tuned(topk_retrieval, select=select)(*dev, 9, 0.5).cpu()
        assert torch.equal(out, ref), select
    assert (out[~retrieve] == -1).all() and (out[retrieve] >= 0).all()


@needs_triton
@pytest.mark.parametrize("k", [1, 7, 40, 300])
def test_topk_selects_ties_and_short_regions(k):
    """Both selects on exact ties spread over several select chunks, k above and below the middle."""
    B, Hq, Hkv, D, S = 2, 4, 2, 4, 1500  # 2 select chunks of 1024 (select_block; the default 2048: one)
    q, kc, pad, lo, hi = _gqa_topk_case(B, Hq, Hkv, D, S, [0, 900], torch.float32, 110 + k)
    retrieve = torch.ones(B, Hq, dtype=torch.bool)
    retrieve[1, 2] = False
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 1.0)
    for select in SELECT_MODES:
        retrieval = tuned(topk_retrieval, select=select, select_block=1024)
        out = retrieval(*(x.to(DEV) for x in (q, kc, pad, lo, hi, retrieve)), k, 1.0).cpu()
        assert torch.equal(out, ref), select


@needs_triton
def test_topk_selects_all_equal_across_chunks():
    """2200 equal scores over 3 chunks of 1024 (``select_block``), k = 700: full radix depth, the
    700 lowest indices taken across chunk boundaries (the cross-chunk rank of the tied keys)."""
    B, H, D, S = 1, 2, 4, 2300
    q = torch.ones(B, H, D)
    kc = torch.ones(B, 1, S, D)
    kc[0, 0, 1500:1510] = 2.0  # ten larger keys in the second chunk
    pad, t, lo, hi = geometry(S, [0], [0], 10, 50)
    retrieve = torch.ones(B, H, dtype=torch.bool)
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 700, 1.0)
    for select in SELECT_MODES:
        retrieval = tuned(topk_retrieval, select=select, select_block=1024)
        out = retrieval(*(x.to(DEV) for x in (q, kc, pad, lo, hi, retrieve)), 700, 1.0).cpu()
        assert out[0, 0].tolist() == list(range(1500, 1510)) + list(range(10, 700)), select
        assert torch.equal(out, ref), select


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 2), (12, 2), (8, 1)])
def test_topk_grouped_kernel(dtype, Hq, Hkv):
    B, D, S = 2, 16, 60
    q, kc, pad, lo, hi = _gqa_topk_case(B, Hq, Hkv, D, S, [0, 9], dtype, 120 + Hq + Hkv)
    retrieve = torch.tensor([[True] * Hkv, [i % 2 == 0 for i in range(Hkv)]])
    dev = [x.to(DEV) for x in (q, kc, pad, lo, hi, retrieve)]
    for k in (5, 60):  # 60 > every middle region: -1 tail
        ref = topk_retrieval_grouped_reference(q, kc, pad, lo, hi, retrieve, k, 0.5)
        for select in SELECT_MODES:
            out = tuned(topk_retrieval_grouped, select=select)(*dev, k, 0.5).cpu()
            assert out.shape == (B, Hkv, k) and out.dtype == I32
            assert torch.equal(out, ref), select
    assert (out[~retrieve] == -1).all()


@needs_triton
def test_topk_modes_are_checked():
    """Unknown selects and stop points name the allowed values; the removed switches (the per-row
    score, the probe-only stop points) are refused, not ignored."""
    q, kc, pad, lo, hi = (x.to(DEV) for x in _gqa_topk_case(1, 2, 1, 16, 20, [0], torch.float32, 1))
    retrieve = torch.ones(1, 2, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="select='row'.*tilemax"):
        tuned(topk_retrieval, select="row")(q, kc, pad, lo, hi, retrieve, 3, 1.0)
    with pytest.raises(ValueError, match="stop_after='blocksort'.*score"):
        tuned(topk_retrieval, stop_after="blocksort")(q, kc, pad, lo, hi, retrieve, 3, 1.0)
    with pytest.raises(TypeError, match="_score"):
        topk_retrieval(q, kc, pad, lo, hi, retrieve, 3, 1.0, _score="row")


def _grouped_attention_case(B, Hq, Hkv, D, S, cap, dtype, seed, pads):
    return _attention_case(B, Hq, Hkv, D, S, cap, dtype, seed, pads, lists=Hkv)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 4, 6, 8])
def test_attention_grouped_kernel(dtype, D, G):
    B, Hkv, S, cap = 2, 2, 48, 13  # odd cap; counts 0 .. cap; left padding in sequence 1
    Hq = G * Hkv
    q, kc, vc, pad, idx, count = _grouped_attention_case(B, Hq, Hkv, D, S, cap, dtype, 130 + G + D, [0, 7])
    scale = 1 / math.sqrt(D)
    ref = sparse_decode_attention_grouped_reference(q, kc, vc, pad, idx, count, scale)
    for splits in ((None, 3) if G in (1, 6) else (None,)):
        out = sparse_decode_attention_grouped(
            *(x.to(DEV) for x in (q, kc, vc, pad, idx, count)), scale, num_splits=splits
        )
        assert_out_close(out, ref, dtype)
        assert (out[0, :G] == 0).all()  # group (0, 0) has count 0
    if dtype == torch.float32:
        naive = naive_attention(q, kc, vc, pad, idx.repeat_interleave(G, 1), count.repeat_interleave(G, 1), scale)
        torch.testing.assert_close(out.double().cpu(), naive, atol=1e-5, rtol=1e-5)


@needs_triton
def test_attention_grouped_rejects_per_head_lists():
    q, kc, vc, pad, idx, count = (x.to(DEV) for x in _attention_case(1, 4, 2, 16, 30, 5, torch.float32, 1, [0]))
    with pytest.raises(ValueError, match="Hkv"):
        sparse_decode_attention_grouped(q, kc, vc, pad, idx, count, 0.25)  # idx is [B, Hq, cap]


@needs_triton
def test_grouped_ops_compile_fullgraph():
    """The new launchers as torch.ops.prhs custom ops: one graph, same results as eager."""
    from prhs_hf.ops import registry

    B, Hq, Hkv, D, S, cap = 2, 4, 2, 16, 40, 9
    q, kc, vc, pad, idx, count = _grouped_attention_case(B, Hq, Hkv, D, S, cap, torch.float32, 140, [0, 3])
    _, _, lo, hi = geometry(S, [0, 3], [0, 0], 2, 4)
    retrieve = torch.tensor([[True, False], [True, True]])
    topk = registry.compiled_or_eager(topk_retrieval_grouped)
    attend = registry.compiled_or_eager(sparse_decode_attention_grouped)

    def step(q, kc, vc, pad, lo, hi, retrieve, idx, count):
        return topk(q, kc, pad, lo, hi, retrieve, 6, 0.25), attend(q, kc, vc, pad, idx, count, 0.25)

    args = [x.to(DEV) for x in (q, kc, vc, pad, lo, hi, retrieve, idx, count)]
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], atol=0, rtol=0)
    assert torch.equal(eager[0].cpu(), topk_retrieval_grouped_reference(q, kc, pad, lo, hi, retrieve, 6, 0.25))


@needs_triton
def test_probe_gqa_kernels_quick(capsys):
    """scripts/probe_gqa_kernels.py --quick runs on the CPU interpreter and prints its table."""

    mod = load_script("probe_gqa_kernels")
    rows = mod.main(["--quick"])
    out = capsys.readouterr().out
    names = {r["name"] for r in rows}
    # the names test_gpu_probe_gqa_kernels_runs compares (it read a stale one once)
    assert {mod.DEFAULT_RETRIEVAL, "retrieval tilemax", "retrieval radix8", "retrieval grouped", "attention per-head",
            "attention grouped"} <= names
    assert mod.DEFAULT_RETRIEVAL in out and all(r["ms"] > 0 for r in rows)


@needs_triton
def test_probe_select_table_at_a_given_k_shape_and_variants(capsys):
    """The select table at the real model's pattern: --topk, --select-shape and the radix8 variants
    (keys per select item x warps; the score kernel's tile x warps x stages x keys per program) run
    and are exact."""
    mod = load_script("probe_gqa_kernels")
    rows = mod.main(["--quick", "--select-only", "--select-shape", "1,600,2,1", "--topk", "9",
                     "--select-variants", "256x4,32x4x2x128", "--retrieve-frac", "0.5"])
    by_name = {r["name"]: r for r in rows}
    assert {"select B1 0k 2/1 r1 k9 radix8", "select B1 0k 2/1 r1 k9 radix8 b256w4",
            "select B1 0k 2/1 r1 k9 radix8 score n32w4s2c128"} <= set(by_name)
    assert all(r["exact"] for r in rows)
    assert "radix8 b256w4" in capsys.readouterr().out


@needs_triton
def test_probe_score_table_default_and_variants(capsys):
    """The group score table (--score-only): the default (device-side split) and the score tunings
    (a fixed chunk; a fifth number, programs per SM) run at every row and at a quarter retrieving,
    and each variant's retrieval equals the default's."""
    mod = load_script("probe_gqa_kernels")
    rows = mod.main(["--quick", "--score-only", "--topk", "9", "--select-variants", "64x4x2x128,64x4x2x0x1"])
    names = [r["name"] for r in rows]
    assert len(rows) == 6 and all(r["exact"] and r["ms"] > 0 and r["mb"] > 0 for r in rows)
    assert "score B2 1k 4/2 r8 g4 default (device split)" in names
    assert any(n.endswith("n64w4s2c128") for n in names) and any(n.endswith("n64w4s2c0p1") for n in names)
    assert "group score stage" in capsys.readouterr().out
