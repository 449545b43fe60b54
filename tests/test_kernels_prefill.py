"""Sparse prefill attention (SPEC §2-§3) on the CPU: schedules, reference, Triton kernel, FlexAttention.

* the pure-Python schedules against hand-computed values;
* ``prefill_attention_reference`` against a naive dense implementation that builds the full
  ``Lq x Lk`` mask element by element (tiny sizes only);
* the Triton kernel (``TRITON_INTERPRET=1`` on the CPU) against the reference, over ragged
  tiles, sinks across a tile boundary, all-frozen tiles, GQA, left padding, PSAW only, ETF
  only, both, chunked prefill, odd head sizes, HF-layout strides, 16-bit inputs;
* the KV tiles the kernel visits (``tile_stats``): frozen tiles visit none, the excluded middle
  is never visited, interior tiles run unmasked;
* the FlexAttention backend (eager on the CPU) against the reference.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import triton_available
from prhs_hf import schedules as sched
from prhs_hf.ops.prefill.prefill_attention import prefill_attention, prefill_attention_reference
from prhs_hf.ops.prefill.prefill_plan import PrefillPlan

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (run: TRITON_INTERPRET=1 pytest tests/test_kernels_prefill.py)",
)


# ----------------------------------------------------------------------------- schedules


def test_layer_depth_and_fractions_by_hand():
    # N = 32, l_s = 16: u = (l - 16) / 16
    assert sched.default_start_layer(32) == 16
    assert sched.depth_fraction(15, 32, 16) is None
    assert sched.depth_fraction(16, 32, 16) == 0.0
    assert sched.depth_fraction(24, 32, 16) == 0.5
    assert sched.depth_fraction(32, 32, 16) == 1.0
    assert sched.depth_fraction(40, 32, 16) == 1.0
    assert sched.psaw_window_fraction(3, 32, 16, 0.7, 1.0) == 1.0
    assert sched.psaw_window_fraction(16, 32, 16, 0.7, 1.0) == 1.0
    assert sched.psaw_window_fraction(32, 32, 16, 0.7, 1.0) == pytest.approx(0.7, abs=0)
    assert sched.psaw_window_fraction(24, 32, 16, 0.49, 1.0) == pytest.approx(0.7, rel=1e-15)
    assert sched.psaw_window_fraction(24, 32, 16, 0.7, 2.0) == pytest.approx(0.7, rel=1e-15)


def test_psaw_window_start_by_hand():
    assert sched.psaw_window_start(100, 0.7, 8) == 30  # floor(0.3 * 100) = floor(30.000000000000004)
    assert sched.psaw_window_start(10, 0.7, 8) == 8  # floor(3.0) < sink
    assert sched.psaw_window_start(1000, 0.5, 8) == 500
    assert sched.psaw_window_start(7, 0.5, 0) == 3
    assert sched.psaw_window_start(37, 1.0, 8) == 8  # no PSAW: everything visible
    assert sched.psaw_window_start(0, 0.3, 4) == 4


def test_etf_frozen_count_by_hand():
    # u = 1: 1 - 0.5 = 0.5; u = 0.5: 1 - 0.5 ** 0.5 = 0.29289...
    assert sched.etf_frozen_count(1000, 32, 32, 16, 0.5, 1.0) == 500
    assert sched.etf_frozen_count(1000, 24, 32, 16, 0.5, 1.0) == 292
    assert sched.etf_frozen_count(1000, 24, 32, 16, 0.5, 2.0) == 500
    assert sched.etf_frozen_count(1000, 16, 32, 16, 0.5, 1.0) == 0
    assert sched.etf_frozen_count(1000, 10, 32, 16, 0.5, 1.0) == 0
    assert sched.etf_frozen_count(4096, 28, 32, 16, 0.5, 1.0) == math.floor((1 - 0.5**0.75) * 4096) == 1660


def test_visible_pairs_by_hand():
    assert sched.causal_pairs(10) == 55
    assert sched.visible_pairs(10, 1.0, 2) == 55
    # w = 0.5, sink 2, L = 6: t = 1..6, W = max(2, floor(t/2)) = 2,2,2,2,2,3
    # row counts: t=1:1, 2:2, 3:2+1, 4:2+2, 5:2+3, 6:2+3 -> 20
    assert sched.visible_pairs(6, 0.5, 2) == 20
    # freezing rows 2..3 (t = 3, 4) removes 3 + 4
    assert sched.visible_pairs(6, 0.5, 2, 2, 4) == 13


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One prefill problem: shapes, padding, PSAW fraction, ETF interval (per sequence)."""

    name: str
    B: int = 1
    Hq: int = 2
    Hkv: int = 1
    Lq: int = 37
    prefix: int = 0  # cached slots before the first query row (chunked prefill)
    D: int = 16
    pads: tuple[int, ...] = (0,)  # left padding; rows of a plain prefill (prefix 0) below it are padding rows
    sink: int = 4
    w: float = 1.0  # PSAW window fraction (1.0: no PSAW)
    frozen: tuple[tuple[int, int], ...] = field(default_factory=tuple)  # per sequence; empty: none
    win_override: str | None = None

    def tensors(self, dtype: torch.dtype = torch.float32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        Lk = self.prefix + self.Lq  # the queries are the last Lq slots
        q = torch.randn(self.B, self.Hq, self.Lq, self.D, generator=g).to(dtype)
        k = torch.randn(self.B, self.Hkv, Lk, self.D, generator=g).to(dtype)
        v = torch.randn(self.B, self.Hkv, Lk, self.D, generator=g).to(dtype)
        pad = torch.tensor(self.pads, dtype=torch.int32)
        # queries are the last Lq slots: slot pad + q_start + r = Lk - Lq + r
        q_start = (Lk - self.Lq - pad).to(torch.int32)
        win = [[sched.psaw_window_start(int(q_start[b]) + r + 1, self.w, self.sink) for r in range(self.Lq)] for b in range(self.B)]
        win_lo = torch.tensor(win, dtype=torch.int32)
        if self.win_override == "beyond_row":  # the second half of the rows sees nothing at all
            r = torch.arange(self.Lq)[None, :]
            win_lo = torch.where(r >= self.Lq // 2, q_start[:, None] + r + 5, win_lo).to(torch.int32)
        elif self.win_override == "non_monotone":  # every third row sees nothing at all
            i = q_start[:, None] + torch.arange(self.Lq)[None, :]
            win_lo = torch.where(i % 3 == 0, i + 5, win_lo).to(torch.int32)
        fr = self.frozen or ((0, 0),) * self.B
        frozen_lo = torch.tensor([a for a, _ in fr], dtype=torch.int32)
        frozen_hi = torch.tensor([b for _, b in fr], dtype=torch.int32)
        return q, k, v, PrefillPlan(pad, q_start, win_lo, self.sink, frozen_lo, frozen_hi), self.D**-0.5


CASES = [
    Case("dense_causal", sink=0),
    Case("dense_with_sinks"),
    Case("psaw_only", Lq=45, w=0.5),
    Case("etf_only", Lq=45, frozen=((4, 25),)),
    Case("psaw_and_etf", Lq=53, w=0.6, frozen=((4, 30),)),
    Case("left_padding", B=3, Lq=41, pads=(0, 3, 11), w=0.7, frozen=((4, 20), (4, 9), (4, 4))),
    Case("gqa", Hq=6, Hkv=2, Lq=40, w=0.5, frozen=((4, 12),)),
    Case("all_rows_frozen", sink=0, Lq=33, frozen=((0, 33),)),
    Case("all_but_sinks_frozen", Lq=35, frozen=((4, 35),)),
    Case("sinks_across_tile_boundary", Lq=60, sink=20, w=0.3),
    Case("ragged_tiles", Lq=19, w=0.5),
    Case("chunked_prefill", B=2, Lq=21, prefix=30, pads=(0, 6), w=0.5),
    Case("head_dim_24", D=24, Lq=30, w=0.6, frozen=((4, 10),)),
    Case("rows_seeing_nothing", sink=0, Lq=30, win_override="beyond_row"),
    Case("single_row", Lq=1, prefix=12, w=0.5),
    Case("non_monotone_windows", Lq=40, w=0.5, win_override="non_monotone"),
]
CASE_IDS = [c.name for c in CASES]


def dead_rows(plan: PrefillPlan) -> torch.Tensor:
    """``[B, Lq]`` bool: the rows that must come out exactly zero (padding rows, ETF-frozen rows)."""
    i = plan.q_start[:, None] + torch.arange(plan.win_lo.shape[1], device=plan.win_lo.device)[None, :]
    return (i < 0) | ((i >= plan.frozen_lo[:, None]) & (i < plan.frozen_hi[:, None]))


def on_device(args: tuple, device: str | torch.device, dtype: torch.dtype) -> tuple:
    """``Case.tensors()`` on ``device``: q/k/v in ``dtype``, the plan's index tensors moved along."""
    q, k, v, plan, scale = args
    return (*(x.to(device, dtype) for x in (q, k, v)), plan.on(torch.device(device)), scale)


def naive_dense(q, k, v, plan: PrefillPlan, scale):
    """Dense float64 attention with the full mask built element by element from SPEC §3."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    mask = torch.zeros(B, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        for r in range(Lq):
            i = int(plan.q_start[b]) + r
            if i < 0 or int(plan.frozen_lo[b]) <= i < int(plan.frozen_hi[b]):
                continue
            for s in range(Lk):
                j = s - int(plan.pad[b])
                if 0 <= j <= i and (j < plan.sink or j >= int(plan.win_lo[b, r])):
                    mask[b, r, s] = True
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    vv = v.double().repeat_interleave(Hq // Hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return (p @ vv).transpose(1, 2)


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_matches_naive_dense(case):
    args = case.tensors()
    ref = prefill_attention_reference(*args)
    assert ref.shape == (case.B, case.Lq, case.Hq, case.D) and ref.is_contiguous() and ref.dtype == torch.float32
    torch.testing.assert_close(ref.double(), naive_dense(*args), atol=1e-5, rtol=1e-5)


def test_reference_chunks_rows(monkeypatch):
    import prhs_hf.ops.prefill.prefill_attention as pa

    case = CASES[5]
    args = case.tensors()
    whole = pa.prefill_attention_reference(*args)
    monkeypatch.setattr(pa, "_reference_chunk_rows", lambda *a, **kw: 7)
    torch.testing.assert_close(pa.prefill_attention_reference(*args), whole, atol=1e-6, rtol=1e-6)


def test_reference_zero_rows_are_exact():
    case = Case("z", B=2, Lq=30, pads=(0, 5), w=0.5, frozen=((4, 17), (4, 9)))
    q, k, v, plan, scale = case.tensors()
    out = prefill_attention_reference(q, k, v, plan, scale)
    dead = dead_rows(plan)
    assert bool(dead.any()) and bool((out[dead] == 0).all()) and bool((out[~dead] != 0).any(dim=-1).all())


def test_plan_index_tensors_may_be_any_integer_dtype():
    """Every backend reads the plan through ``PrefillPlan.on`` (int32 on q's device): int64 index
    tensors give the same bits."""
    q, k, v, plan, scale = CASES[5].tensors()
    wide = dataclasses.replace(plan, **{f: getattr(plan, f).long() for f in ("pad", "q_start", "win_lo", "frozen_lo", "frozen_hi")})
    moved = wide.on(q.device)
    assert all(getattr(moved, f).dtype == torch.int32 for f in ("pad", "q_start", "win_lo", "frozen_lo", "frozen_hi"))
    assert torch.equal(prefill_attention_reference(q, k, v, wide, scale), prefill_attention_reference(q, k, v, plan, scale))
    if triton_available():
        torch.testing.assert_close(prefill_attention(q, k, v, wide, scale), prefill_attention(q, k, v, plan, scale), atol=0, rtol=0)


def test_input_validation():
    q, k, v, plan, scale = CASES[0].tensors()
    assert plan.check(q, k, v) == (1, 2, 37, 16, 1, 37)
    with pytest.raises(ValueError, match="win_lo"):
        dataclasses.replace(plan, win_lo=plan.win_lo[:, :-1]).check(q, k, v)
    with pytest.raises(ValueError, match="frozen_hi"):
        dataclasses.replace(plan, frozen_hi=plan.frozen_hi.repeat(2)).check(q, k, v)
    with pytest.raises(ValueError, match="multiple"):
        plan.check(q[:, :1].expand(1, 3, -1, -1), k.expand(1, 2, -1, -1), v.expand(1, 2, -1, -1))
    with pytest.raises(ValueError, match="head size"):
        big = torch.zeros(1, 1, 4, 320)
        dataclasses.replace(plan, win_lo=plan.win_lo[:, :4]).check(big, big, big)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        plan.check(q.double(), k.double(), v.double())
    for backend in (prefill_attention_reference, prefill_attention):  # every backend checks before it runs
        with pytest.raises(ValueError, match="win_lo"):
            backend(q, k, v, dataclasses.replace(plan, win_lo=plan.win_lo[:, :-1]), scale)


# ----------------------------------------------------------------------------- Triton kernel

BLOCKS = [(16, 16), (32, 16), (16, 32)]


@needs_triton
@pytest.mark.parametrize("blocks", BLOCKS, ids=[f"m{m}n{n}" for m, n in BLOCKS])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference_fp32(case, blocks):
    args = case.tensors()
    ref = prefill_attention_reference(*args)
    out = prefill_attention(*args, block_m=blocks[0], block_n=blocks[1])
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [CASES[4], CASES[5], CASES[6]], ids=["psaw_and_etf", "left_padding", "gqa"])
def test_kernel_matches_reference_16bit(case, dtype):
    args = case.tensors(dtype)
    ref = prefill_attention_reference(*args)  # fp32 math on the same 16-bit inputs
    out = prefill_attention(*args)  # default (interpreter) config
    assert out.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", [Case("plain", B=2, Lq=45, sink=0, pads=(0, 0)),
                                  Case("left_padding", B=3, Hq=6, Hkv=2, Lq=41, sink=0, pads=(0, 3, 11)),
                                  Case("chunked_prefill", B=2, Lq=21, prefix=30, sink=0, pads=(0, 6))],
                         ids=["plain", "left_padding_gqa", "chunked_prefill"])
def test_dense_causal_plan_is_the_causal_attention_of_the_real_tokens(case):
    """The dense pattern the FA4 dense route hands the sparse forward (no window, no frozen rows,
    sink 0) is dense causal attention over the real tokens: the float64 oracle, through the
    reference and (where Triton runs) the kernel."""
    q, k, v, plan, scale = case.tensors()
    dense = PrefillPlan.dense_causal(plan.pad, plan.q_start, case.Lq)
    assert dense.win_lo.shape == plan.win_lo.shape and dense.win_lo.dtype == dense.frozen_lo.dtype == torch.int32
    assert not bool(dense.win_lo.any() or dense.frozen_lo.any() or dense.frozen_hi.any()) and dense.sink == 0
    assert dense.frozen_lo.shape == dense.frozen_hi.shape == (case.B,) and dense.active_rows is None
    want = naive_dense(q, k, v, dense, scale)
    ref = prefill_attention_reference(q, k, v, dense, scale)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    if triton_available():
        got = prefill_attention(q, k, v, dense, scale)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@needs_triton
def test_kernel_zero_rows_are_exact():
    case = Case("z", B=2, Lq=50, pads=(0, 7), w=0.5, frozen=((4, 33), (4, 20)))
    q, k, v, plan, scale = case.tensors(torch.float16)
    out = prefill_attention(q, k, v, plan, scale, block_m=16, block_n=16)
    dead = dead_rows(plan)
    assert bool(dead.any()) and bool((out[dead] == 0).all())
    assert bool(torch.isfinite(out).all())


@needs_triton
def test_kernel_hf_layout_strides():
    """q/k/v as transposed views of [B, L, H, D] (what a fused projection gives)."""
    case = CASES[6]
    q, k, v, *rest = case.tensors()
    qv = q.transpose(1, 2).contiguous().transpose(1, 2)
    kv = torch.cat([k, v], dim=1).transpose(1, 2).contiguous().transpose(1, 2)  # shared storage
    kh, vh = kv[:, : case.Hkv], kv[:, case.Hkv :]
    assert not qv.is_contiguous() and not kh.is_contiguous()
    out = prefill_attention(qv, kh, vh, *rest, block_m=16, block_n=16)
    torch.testing.assert_close(out, prefill_attention_reference(q, k, v, *rest), atol=2e-5, rtol=2e-5)


def _tile_bounds(case: Case, bm: int):
    """Per query tile of sequence b: active-row range, min/max window start (None: no active row)."""
    plan = case.tensors()[3]
    dead = dead_rows(plan)
    out = []
    for b in range(case.B):
        tiles = []
        for t in range(math.ceil(case.Lq / bm)):
            act = [r for r in range(t * bm, min(case.Lq, (t + 1) * bm)) if not dead[b, r]]
            if not act:
                tiles.append(None)
                continue
            i_lo, i_hi = int(plan.q_start[b]) + act[0], int(plan.q_start[b]) + act[-1]
            w = [int(plan.win_lo[b, r]) for r in act]
            tiles.append((i_lo, i_hi, min(w), max(w)))
        out.append(tiles)
    return out


@needs_triton
@pytest.mark.parametrize("case", [CASES[4], CASES[5], CASES[9], Case("long_psaw", Lq=160, sink=4, w=0.25)], ids=lambda c: c.name)
def test_kernel_visits_only_visible_kv_tiles(case):
    bm, bn = 16, 16
    args = case.tensors()
    n_tiles = math.ceil(case.Lq / bm)
    stats = torch.full((case.B, case.Hq, n_tiles, 2), -1, dtype=torch.int32)
    prefill_attention(*args, block_m=bm, block_n=bn, tile_stats=stats)
    assert bool((stats >= 0).all())
    assert bool((stats == stats[:, :1]).all())  # every head of a sequence walks the same tiles
    sink = case.sink
    for b, tiles in enumerate(_tile_bounds(case, bm)):
        for t, bounds in enumerate(tiles):
            visited, unmasked = (int(x) for x in stats[b, 0, t])
            if bounds is None:  # no active row: nothing is loaded
                assert visited == 0, (b, t)
                continue
            i_lo, i_hi, w_lo, w_hi = bounds
            s_end = min(sink, i_hi + 1)
            tail = max(0, i_hi + 1 - max(w_lo, s_end))
            visible = s_end + tail  # union of the visible keys of the tile's rows
            assert visited * bn >= visible, (b, t)
            # the excluded middle [s_end, w_lo) is never visited
            assert visited <= math.ceil(s_end / bn) + math.ceil(tail / bn), (b, t, visited)
            # masked tiles: sinks, PSAW boundary, causal diagonal only
            masked = visited - unmasked
            assert masked <= math.ceil(s_end / bn) + math.ceil((w_hi - w_lo) / bn) + 1 + bm // bn + 1, (b, t)
    if case.name == "long_psaw":  # dense causal would visit far more tiles
        dense = sum(math.ceil((min(case.Lq, (t + 1) * bm)) / bn) for t in range(n_tiles))
        assert int(stats[0, 0, :, 0].sum()) < 0.65 * dense


@needs_triton
def test_kernel_tile_stats_shape_is_checked():
    args = CASES[0].tensors()
    with pytest.raises(ValueError, match="tile_stats"):
        prefill_attention(*args, block_m=16, block_n=16, tile_stats=torch.zeros(1, 2, 1, 2, dtype=torch.int32))


# ----------------------------------------------------------------------------- random problems

_problem = st.fixed_dictionaries(
    {
        "B": st.integers(1, 2),
        "Hkv": st.integers(1, 2),
        "G": st.integers(1, 3),
        "Lq": st.integers(1, 40),
        "prefix": st.integers(0, 8),
        "pads": st.lists(st.integers(0, 6), min_size=2, max_size=2),
        "sink": st.integers(0, 12),
        "w": st.floats(0.05, 1.0),
        "frozen": st.lists(st.tuples(st.integers(0, 45), st.integers(0, 45)), min_size=2, max_size=2),
        "seed": st.integers(0, 2**16),
    }
)


def _case_from(p) -> tuple[Case, int]:
    B = p["B"]
    return (
        Case(
            "random",
            B=B,
            Hq=p["Hkv"] * p["G"],
            Hkv=p["Hkv"],
            Lq=p["Lq"],
            prefix=p["prefix"],
            pads=tuple(p["pads"][:B]),
            sink=p["sink"],
            w=p["w"],
            frozen=tuple(p["frozen"][:B]),
        ),
        p["seed"],
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problem)
def test_reference_matches_naive_dense_random(p):
    case, seed = _case_from(p)
    args = case.tensors(seed=seed)
    torch.testing.assert_close(prefill_attention_reference(*args).double(), naive_dense(*args), atol=1e-5, rtol=1e-5)


@needs_triton
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problem, st.sampled_from(BLOCKS))
def test_kernel_matches_reference_random(p, blocks):
    case, seed = _case_from(p)
    args = case.tensors(seed=seed)
    out = prefill_attention(*args, block_m=blocks[0], block_n=blocks[1])
    torch.testing.assert_close(out, prefill_attention_reference(*args), atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- FlexAttention


@pytest.mark.parametrize(
    "case", [CASES[1], CASES[4], CASES[5], CASES[6], CASES[7], CASES[11], CASES[13]], ids=lambda c: c.name
)
def test_flex_matches_reference(case):
    from prhs_hf.ops.prefill.flex_prefill import flex_prefill_attention

    args = case.tensors()
    out = flex_prefill_attention(*args)
    assert out.shape == (case.B, case.Lq, case.Hq, case.D) and out.is_contiguous()
    torch.testing.assert_close(out, prefill_attention_reference(*args), atol=2e-5, rtol=2e-5)


def test_flex_block_mask_skips_blocks():
    from prhs_hf.ops.prefill.flex_prefill import build_prefill_block_mask

    case = Case("blocks", Lq=256, sink=4, w=0.25, frozen=((4, 96),))
    _, k, _, plan, _ = case.tensors()
    bm = build_prefill_block_mask(plan, k.shape[2], block_size=32)
    dense = bm.to_dense()[0, 0]  # [q blocks, kv blocks]
    assert dense.shape == (8, 8)
    assert dense[1:3].sum() == 0  # rows 32..95 are frozen: no block at all
    assert dense[7, 1:4].sum() == 0  # the excluded middle of the last tile
    assert dense[7, 0] == 1 and dense[7, 7] == 1  # sinks and diagonal
