"""The group-union sparse decode attention: the builders of each KV group's union of per-head index
sets (with head bitmasks; the Triton map builder and the torch-ops one) against their set-based
reference, and the union attention against the per-head attention and its reference (same output:
each head still attends exactly its own set).

Kernels run on the CPU through ``TRITON_INTERPRET=1`` (set by conftest) or on a GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import triton_available
import prhs_hf.ops.sparse_attention.group_union as union_module
from prhs_hf.ops.sparse_attention.group_union import (
    MAX_GROUP,
    group_union,
    group_union_reference,
    group_union_torch,
    union_width,
)
from prhs_hf.ops.sparse_attention.sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_reference,
    sparse_decode_attention_union,
    sparse_decode_attention_union_reference,
)

needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
I32 = torch.int32


def per_head_sets(B: int, Hq: int, G: int, span: int, cap: int, overlap: str, seed: int,
                  pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head sets as compose_indices writes them (ascending, distinct, ``-1`` after count) over the
    ``span - pads[b]`` real keys of each sequence. ``overlap``: ``"heavy"`` (the G heads of a group
    draw from a shared pool of ``cap + cap // 2`` keys) or ``"none"`` (the group's sets are disjoint;
    needs ``span >= G * cap``). Counts 0 .. cap, with head (0, 0) empty and the last head full."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, Hq, cap), -1, dtype=I32)
    count = torch.randint(0, cap + 1, (B, Hq), generator=g, dtype=I32)
    count[0, 0] = 0
    count[-1, -1] = cap
    for b in range(B):
        keys = span - pads[b]
        for kvh in range(Hq // G):
            perm = torch.randperm(keys, generator=g)
            for j in range(G):
                h = kvh * G + j
                if overlap == "heavy":
                    pool = perm[: min(keys, cap + cap // 2)]
                    chosen = pool[torch.randperm(len(pool), generator=g)[:cap]]
                else:
                    chosen = perm[j * cap:(j + 1) * cap]
                n = min(int(count[b, h]), len(chosen))
                count[b, h] = n
                idx[b, h, :n] = chosen[:n].sort().values.to(I32)
    return idx, count


#: the builders under test: the Triton map builder (needs the index bound, the cache's slot count) and
#: the torch-ops one
BUILDERS = {
    "triton": lambda idx, count, kv_heads, span: group_union(idx, count, kv_heads, span),
    "torch": lambda idx, count, kv_heads, span: group_union_torch(idx, count, kv_heads),
}
builders = pytest.mark.parametrize("builder", [pytest.param("triton", marks=needs_triton), "torch"])


def assert_union_equal(idx: torch.Tensor, count: torch.Tensor, kv_heads: int, builder: str,
                       span: int | None = None) -> tuple[torch.Tensor, ...]:
    """The builder's union equals the reference's; ``span`` defaults to one past the largest index. The
    Triton builder's lists are ``union_width(G, cap, span)`` wide: the reference's first columns, the rest
    of which is padding."""
    span = int(idx.max()) + 1 if span is None else span
    got = BUILDERS[builder](idx.to(DEV), count.to(DEV), kv_heads, span)
    want = group_union_reference(idx, count, kv_heads)
    group, cap = idx.shape[1] // kv_heads, idx.shape[2]
    width = union_width(group, cap, span) if builder == "triton" else group * cap
    assert (want[0][..., width:] == -1).all() and (want[1][..., width:] == 0).all()
    for name, g_, w_ in zip(("union_idx", "head_mask", "union_count"), got, want):
        assert g_.dtype == I32, name
        w_ = w_[..., :width] if w_.dim() == 3 else w_
        assert g_.shape == w_.shape, name
        assert torch.equal(g_.cpu(), w_), name
    return want


# ----------------------------------------------------------------------------- the builder


def test_union_reference_by_hand():
    """Two groups of G = 2: shared, single-head and absent keys; entries past count are ignored."""
    idx = torch.tensor([[[1, 4, 9, 7], [4, 5, 9, -1], [3, -1, -1, -1], [8, 2, -1, -1]]], dtype=I32)
    count = torch.tensor([[3, 3, 0, 2]], dtype=I32)  # head 0's 7 is past its count; head 2 is empty
    union_idx, head_mask, union_count = group_union_reference(idx, count, 2)
    assert union_count.tolist() == [[4, 2]]
    assert union_idx[0, 0, :5].tolist() == [1, 4, 5, 9, -1]
    assert head_mask[0, 0, :5].tolist() == [0b01, 0b11, 0b10, 0b11, 0]
    assert union_idx[0, 1, :3].tolist() == [2, 8, -1]
    assert head_mask[0, 1, :3].tolist() == [0b10, 0b10, 0]
    assert union_idx.shape == head_mask.shape == (1, 2, 8)


@builders
@pytest.mark.parametrize("G", [1, 2, 7])
@pytest.mark.parametrize("overlap", ["heavy", "none"])
def test_union_builder_equals_reference(builder, G, overlap):
    Hkv, cap = 2, 11
    idx, count = per_head_sets(2, G * Hkv, G, 200, cap, overlap, 10 + G, [0, 9])
    union_idx, head_mask, union_count = assert_union_equal(idx, count, Hkv, builder, span=200)
    summed = count.view(2, Hkv, G).sum(-1)
    if overlap == "none":
        assert torch.equal(union_count, summed)
    elif G > 1:
        assert (union_count < summed).any()
    assert (union_count <= summed).all()


@builders
def test_union_builder_unsorted_rows_repeats_and_bit_31(builder):
    """Rows need not be sorted nor distinct (a repeated (index, head) pair sets its bit once), and
    head 31 of a group of 32 sets the int32 sign bit."""
    G, cap = 32, 5
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 9, (1, G, cap), generator=g, dtype=I32)  # unsorted, with repeats
    count = torch.randint(0, cap + 1, (1, G), generator=g, dtype=I32)
    count[0, 31] = cap
    idx[0, 31] = torch.tensor([6, 6, 2, 6, 2], dtype=I32)
    union_idx, head_mask, union_count = assert_union_equal(idx, count, 1, builder, span=9)
    for i in range(int(union_count[0, 0])):
        x = int(union_idx[0, 0, i])
        holders = {h for h in range(G) if x in idx[0, h, : int(count[0, h])].tolist()}
        assert {h for h in range(G) if (int(head_mask[0, 0, i]) >> h) & 1} == holders
    assert (head_mask[0, 0, : int(union_count[0, 0])] < 0).any()  # head 31 holds 2 and 6


@builders
def test_union_builder_count_past_cap_and_all_empty(builder):
    idx = torch.tensor([[[5, 2], [-1, -1]]], dtype=I32)
    assert_union_equal(idx, torch.tensor([[9, 0]], dtype=I32), 1, builder)  # count > cap is clamped to cap
    got = assert_union_equal(idx, torch.zeros(1, 2, dtype=I32), 1, builder)
    assert got[2].tolist() == [[0]] and (got[0] == -1).all() and (got[1] == 0).all()


@builders
def test_union_builder_errors_name_the_argument(builder):
    build = BUILDERS[builder]
    idx, count = torch.zeros(1, 4, 3, dtype=I32), torch.zeros(1, 4, dtype=I32)
    with pytest.raises(ValueError, match="kv_heads=3 must be >= 1 and divide Hq=4"):
        build(idx, count, 3, 10)
    with pytest.raises(ValueError, match=r"idx \(1, 4, 3\) / count \(1, 3\)"):
        build(idx, count[:, :3], 2, 10)
    with pytest.raises(ValueError, match=f"G = Hq / kv_heads = 33; allowed 1 .. {MAX_GROUP}"):
        build(torch.zeros(1, 33, 3, dtype=I32), torch.zeros(1, 33, dtype=I32), 1, 10)


# ----------------------------------------------------------------------------- the Triton map builder


def messy_sets(B: int, Hkv: int, G: int, cap: int, span: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head lists as no composition writes them: unsorted, with repeats and ``-1`` entries before
    the count, garbage after it; counts 0 .. cap (head 0 empty, the last head full)."""
    g = torch.Generator().manual_seed(seed)
    Hq = Hkv * G
    idx = torch.randint(-1, span, (B, Hq, cap), generator=g, dtype=I32)
    count = torch.randint(0, cap + 1, (B, Hq), generator=g, dtype=I32)
    count[0, 0] = 0
    count[-1, -1] = cap
    if cap >= 3:
        idx[-1, -1, :3] = torch.tensor([span - 1, -1, span - 1], dtype=I32)  # the last slot, twice, and a -1
    return idx, count


@needs_triton
@pytest.mark.parametrize("G", [1, 2, 3, 6])
@pytest.mark.parametrize("B,Hkv,cap,span,chunk", [
    (1, 1, 5, 16, 16),  # one chunk, exactly the map row
    (2, 2, 9, 70, 16),  # the last chunk partial; the union list (G*cap) longer or shorter than the map
    (1, 3, 24, 40, 8),  # dense marks: most positions of the row are in the union
    (3, 1, 1, 200, 32),  # cap 1: more chunks than union slots (the chunks past the union pad nothing)
])
def test_map_builder_over_chunks(monkeypatch, G, B, Hkv, cap, span, chunk):
    """The Triton builder with chunks much smaller than a map row: each chunk's union entries after the
    counts of the chunks before it, the padding shared among the chunks, every row as the reference's."""
    monkeypatch.setattr(union_module, "MAP_CHUNK", chunk)
    idx, count = messy_sets(B, Hkv, G, cap, span, seed=1000 * G + span + cap)
    assert_union_equal(idx, count, Hkv, "triton", span=span)


@needs_triton
@pytest.mark.parametrize("G", [1, 3, MAX_GROUP])
def test_map_builder_when_every_position_is_marked_by_every_head(monkeypatch, G):
    """A full union (no padding) of identical full sets: every map position in the list, every bit set."""
    monkeypatch.setattr(union_module, "MAP_CHUNK", 16)
    span = 40
    idx = torch.arange(span, dtype=I32).flip(0).expand(1, G, span).contiguous()
    union_idx, head_mask, union_count = assert_union_equal(idx, torch.full((1, G), span, dtype=I32), 1, "triton", span)
    assert union_count.tolist() == [[span]]
    assert (head_mask[0, 0, :span] == (-1 if G == 32 else (1 << G) - 1)).all()


@needs_triton
def test_map_builder_leaves_out_indices_at_or_past_span():
    """The map has ``span`` positions: an index at or past it (no real index of a cache of ``span``
    slots) is left out of the union, never written outside the map."""
    idx = torch.tensor([[[3, 12, 7], [12, 40, 2]]], dtype=I32)
    count = torch.tensor([[3, 3]], dtype=I32)
    got = group_union(idx.to(DEV), count.to(DEV), 1, 10)
    in_span = torch.tensor([[[3, 7, -1], [2, -1, -1]]], dtype=I32)
    want = group_union_reference(in_span, torch.tensor([[2, 1]], dtype=I32), 1)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_.cpu(), w_)
    with pytest.raises(ValueError, match="span=0; allowed >= 1"):
        group_union(idx.to(DEV), count.to(DEV), 1, 0)


@needs_triton
def test_map_builder_of_an_empty_batch_and_of_empty_lists():
    for B, cap in ((0, 4), (2, 0)):
        union_idx, head_mask, union_count = group_union(torch.zeros(B, 4, cap, dtype=I32, device=DEV),
                                                        torch.zeros(B, 4, dtype=I32, device=DEV), 2, 8)
        assert union_idx.shape == head_mask.shape == (B, 2, 2 * cap) and union_count.shape == (B, 2)
        assert (union_count == 0).all()


# ----------------------------------------------------------------------------- the attention

#: The tolerances of tests/test_kernels_decode.py's attention tests.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def attention_case(B: int, G: int, Hkv: int, D: int, S: int, cap: int, dtype: torch.dtype, overlap: str, seed: int,
                   pads: list[int]):
    g = torch.Generator().manual_seed(seed)
    Hq = G * Hkv
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    kc = (2 * torch.randn(B, Hkv, S, D, generator=g)).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    idx, count = per_head_sets(B, Hq, G, S, cap, overlap, seed + 1, pads)
    return q, kc, vc, torch.tensor(pads, dtype=I32), idx, count


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 2, 7])
@pytest.mark.parametrize("overlap", ["heavy", "none"])
def test_union_attention_equals_per_head(dtype, G, overlap):
    """Per-head output, to the per-head tests' tolerance, from the union lists; cap 13 is not a
    multiple of the tile; sequence 1 is left padded; head (0, 0) has count 0; split and unsplit."""
    B, Hkv, D, S, cap = 2, 2, 32, 120, 13
    q, kc, vc, pad, idx, count = attention_case(B, G, Hkv, D, S, cap, dtype, overlap, 40 + G, [0, 11])
    scale = 1 / math.sqrt(D)
    dev = [x.to(DEV) for x in (q, kc, vc, pad, idx, count)]
    ref = sparse_decode_attention_union_reference(q, kc, vc, pad, idx, count, scale)
    per_head = sparse_decode_attention(*dev, scale)
    tol = TOL[dtype]
    for splits in (None, 3):
        out = sparse_decode_attention_union(*dev, scale, num_splits=splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(out.float().cpu(), per_head.float().cpu(), atol=tol, rtol=tol)
        assert (out[0, 0] == 0).all()  # count 0
    assert torch.equal(ref, sparse_decode_attention_reference(q, kc, vc, pad, idx, count, scale))


@needs_triton
def test_union_attention_heads_whose_first_tiles_hold_none_of_their_keys():
    """Head 0 of the group holds only the last keys of a long union (whole tiles masked for it
    before them), head 1 holds none, head 2 the first ones: outputs stay finite and exact, head 1 zero."""
    B, G, Hkv, D, S, cap = 1, 3, 1, 16, 300, 140
    q, kc, vc, pad, _, _ = attention_case(B, G, Hkv, D, S, cap, torch.float32, "heavy", 7, [0])
    idx = torch.full((B, G, cap), -1, dtype=I32)
    idx[0, 0, :4] = torch.tensor([290, 293, 296, 299], dtype=I32)
    idx[0, 2] = torch.arange(cap, dtype=I32) * 2
    count = torch.tensor([[4, 0, cap]], dtype=I32)
    ref = sparse_decode_attention_union_reference(q, kc, vc, pad, idx, count, 0.25)
    for splits in (None, 1, 2):
        out = sparse_decode_attention_union(*(x.to(DEV) for x in (q, kc, vc, pad, idx, count)), 0.25, num_splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
        assert (out[0, 1] == 0).all()


@needs_triton
def test_union_attention_all_counts_zero_and_bad_input():
    q, kc, vc, pad, idx, count = attention_case(1, 2, 2, 16, 40, 5, torch.float32, "heavy", 9, [0])
    out = sparse_decode_attention_union(*(x.to(DEV) for x in (q, kc, vc, pad, idx, torch.zeros_like(count))), 0.25)
    assert (out == 0).all()
    with pytest.raises(ValueError, match=r"expected \[B, Hq, cap\] / \[B, Hq\] with B=1, Hq=4"):
        sparse_decode_attention_union(q, kc, vc, pad, idx[:, :2], count[:, :2], 0.25)  # one list per KV head


class _Unlaunchable:
    """Stands in for a Triton kernel that must not be launched."""

    def __getitem__(self, grid):
        raise AssertionError("the Triton union builder's mark kernel was launched")


@needs_triton
def test_union_attention_builds_the_union_with_the_map_builder(monkeypatch):
    """The union attention's lists come from the Triton map builder (over the cache's slots), not the
    torch-ops one: with the map builder's first kernel unlaunchable, the attention cannot run."""
    q, kc, vc, pad, idx, count = attention_case(1, 3, 2, 16, 50, 6, torch.float32, "heavy", 5, [0])
    dev = [x.to(DEV) for x in (q, kc, vc, pad, idx, count)]
    monkeypatch.setattr(union_module, "MAP_CHUNK", 16)  # 4 chunks of the 50 slots
    ref = sparse_decode_attention_union_reference(q, kc, vc, pad, idx, count, 0.25)
    torch.testing.assert_close(sparse_decode_attention_union(*dev, 0.25).cpu(), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(union_module, "_union_mark_kernel", _Unlaunchable())
    with pytest.raises(AssertionError, match="mark kernel was launched"):
        sparse_decode_attention_union(*dev, 0.25)


@needs_triton
def test_union_lists_are_no_wider_than_the_cache():
    """A group's union has at most S distinct indices: with G*cap > S the Triton lists are S wide (less
    padding to write, fewer attention splits), and the attention over them still equals the per-head one."""
    B, G, Hkv, cap, S, D = 2, 4, 2, 24, 40, 16
    assert union_width(G, cap, S) == S < G * cap and union_width(G, cap) == G * cap
    idx, count = per_head_sets(B, G * Hkv, G, S, cap, "heavy", 5, [0, 0])
    union_idx, head_mask, union_count = group_union(idx.to(DEV), count.to(DEV), Hkv, S)
    assert union_idx.shape == head_mask.shape == (B, Hkv, S)
    assert_union_equal(idx, count, Hkv, "triton", span=S)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, G * Hkv, D, generator=g).to(DEV)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(DEV) for _ in range(2))
    pad = torch.zeros(B, dtype=I32, device=DEV)
    got = sparse_decode_attention_union(q, k, v, pad, idx.to(DEV), count.to(DEV), 0.25)
    want = sparse_decode_attention_reference(q, k, v, pad, idx.to(DEV), count.to(DEV), 0.25)
    assert torch.allclose(got.float().cpu(), want.float().cpu(), atol=1e-5)
