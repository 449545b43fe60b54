"""The two selects of top-k retrieval (``select="tilemax"``, the default up to k = 256, and
``"radix8"``, the default above; prhs_hf/ops/topk/topk_select.py) and the group score kernel that feeds them,
against the PyTorch reference: every tie path (ties inside and across select chunks, at full radix
depth), rows not retrieving, regions shorter than k and empty, left padding, several merge blocks,
the persistent grids with fewer programs than work items, the benchmark's stop points, scratch that
starts as garbage, and that every kernel compiles for sm_90 (so a GPU run does not die on a compile
error).

Run on a CPU: ``TRITON_INTERPRET=1 pytest tests/test_topk_select.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import triton_available
from prhs_hf.ops.topk import topk_retrieval as tk
from prhs_hf.ops.topk import topk_select as ts
from prhs_hf.ops.topk.topk_retrieval import (
    SELECT_MODES,
    topk_retrieval,
    topk_retrieval_grouped,
    topk_retrieval_grouped_reference,
    topk_retrieval_reference,
    tuned,
)

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
DEV = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
I32 = torch.int32


def _case(B, Hq, Hkv, D, S, pads, mids, seed, levels=2):
    """Integer data (exact scores in any summation order; few levels: many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (B, Hq, D), generator=g).float()
    kc = torch.randint(-levels, levels + 1, (B, Hkv, S, D), generator=g).float()
    pad = torch.tensor(pads, dtype=I32)
    lo = torch.full((B,), 3, dtype=I32)
    hi = torch.tensor([min(3 + m, S - p) for m, p in zip(mids, pads)], dtype=I32)
    return q, kc, pad, lo, hi


def _dev(*xs):
    return [x.to(DEV) for x in xs]


def _poison_empty(monkeypatch):
    """``torch.empty`` whose int32/int64 tensors start as garbage (7s): scratch that a kernel
    forgets to zero shows up (fresh CPU allocations are often zero by chance)."""
    empty = torch.empty

    def poisoned(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(7) if t.dtype in (torch.int32, torch.int64) else t

    monkeypatch.setattr(torch, "empty", poisoned)


def test_the_selects_are_the_defaults():
    """Only the selects a default path runs are left: tilemax up to TILEMAX_MAX_K, radix8 above."""
    assert SELECT_MODES == ("tilemax", "radix8")
    assert {tk.default_select(1), tk.default_select(tk.TILEMAX_MAX_K + 1)} == set(SELECT_MODES)


@needs_triton
@pytest.mark.parametrize("select,k", [(select, k) for k in (1, 40, 300, 1100) for select in SELECT_MODES
                                      # tilemax at k 1100: not a default (k > TILEMAX_MAX_K); its path there
                                      # (fewer sub-tiles than k: every key a candidate) is the k 200 case of
                                      # test_tilemax_threshold_paths, and this one cost 147 s of interpreter
                                      if not (select == "tilemax" and k > 1000)])
def test_selects_match_reference(select, k):
    """One select chunk of the default 2048 keys and two of 1024 (``select_block=1024``), ragged
    padding, a region shorter than k (sequence 1), an empty one (sequence 2), rows not retrieving;
    radix8 at 300 and 1100 spreads the candidates over 2 and 8 merge blocks (1 and 40: one)."""
    B, Hq, Hkv, D, S = 3, 4, 2, 4, 1500
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 700, 20], [1490, 600, 0], 200 + k)
    retrieve = torch.ones(B, Hq, dtype=torch.bool)
    retrieve[0, 1] = retrieve[1, 3] = False
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 1.0)
    for block in (None, 1024):
        retrieval = tuned(topk_retrieval, select=select, select_block=block)
        out = retrieval(*_dev(q, kc, pad, lo, hi, retrieve), k, 1.0).cpu()
        assert torch.equal(out, ref), (select, block)
    assert (out[~retrieve] == -1).all() and (out[2] == -1).all()
    if k > 600:
        assert (out[1][retrieve[1]][:, 600:] == -1).all()


@needs_triton
@pytest.mark.parametrize("select", SELECT_MODES)
def test_radix8_exact_ties_at_full_depth_across_chunks(select):
    """2200 equal scores over three chunks of 1024 (two of the default 2048) with 10 larger ones
    in the second: after four 8-bit passes the equal keys are exact ties; the lowest indices are
    taken across chunk boundaries, and 700 candidates span three merge blocks."""
    q = torch.ones(1, 2, 4)
    kc = torch.ones(1, 1, 2300, 4)
    kc[0, 0, 1500:1510] = 2.0
    pad = torch.zeros(1, dtype=I32)
    lo, hi = torch.tensor([10], dtype=I32), torch.tensor([2250], dtype=I32)
    retrieve = torch.tensor([[True, False]])
    for block in (None, 1024):
        retrieval = tuned(topk_retrieval, select=select, select_block=block)
        out = retrieval(*_dev(q, kc, pad, lo, hi, retrieve), 700, 1.0).cpu()
        assert out[0, 0].tolist() == list(range(1500, 1510)) + list(range(10, 700)), block
        assert (out[0, 1] == -1).all()
        assert torch.equal(out, topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 700, 1.0)), block


@needs_triton
@pytest.mark.parametrize("select", SELECT_MODES)
def test_radix8_persistent_grid_strides_over_items(select, monkeypatch):
    """Fewer persistent programs (3) than live (row, chunk) and (row, block) items: each
    program takes several, including items of different rows."""
    monkeypatch.setattr(ts, "_persistent_programs", lambda device: 3)
    B, Hq, Hkv, D, S = 2, 4, 1, 4, 1300
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 100], [1290, 1100], 230, levels=3)
    retrieve = torch.tensor([[True, True, False, True], [False, True, True, False]])
    for k in (5, 400):
        ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 0.5)
        out = tuned(topk_retrieval, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), k, 0.5).cpu()
        assert torch.equal(out, ref), k


@needs_triton
@pytest.mark.parametrize("select", SELECT_MODES)
@pytest.mark.parametrize("grouped", [False, True])
def test_group_score_splits_follow_the_live_count(select, grouped, monkeypatch):
    """The group score kernel's persistent grid cuts each live group's region into a number of
    chunks chosen on the device from the live count: every group live (1 long chunk each with 4
    programs, 6 of 256 keys with 24), one group live (4 or 6 chunks), and a fixed chunk of 128 keys
    with fewer programs than items (each program strides over several, of different groups).
    Ragged regions (1,490 and 1,000 keys behind a pad of 130), so chunks end inside a tile; the
    tile maxima (tilemax) are built, and the radix scratch (radix8) zeroed, per item."""
    B, Hq, Hkv, D, S = 2, 4, 2, 4, 1500
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 130], [1490, 1000], 240, levels=3)
    rows = Hkv if grouped else Hq
    one = torch.zeros(B, rows, dtype=torch.bool)
    one[1, rows - 1] = True
    fn, ref_fn = ((topk_retrieval_grouped, topk_retrieval_grouped_reference) if grouped
                  else (topk_retrieval, topk_retrieval_reference))
    for sms, cfg in ((132, None), (1, None), (1, (64, 4, 2, 128))):
        monkeypatch.setattr(tk, "num_sms", lambda device, n=sms: n)
        for retrieve in (torch.ones(B, rows, dtype=torch.bool), one):
            ref = ref_fn(q, kc, pad, lo, hi, retrieve, 30, 0.5)
            out = tuned(fn, select=select, score_cfg=cfg)(*_dev(q, kc, pad, lo, hi, retrieve), 30, 0.5).cpu()
            assert torch.equal(out, ref), (sms, cfg, int(retrieve.sum()))


class _Launches:
    """Stands in for a Triton kernel in ``tk``: counts the launches and runs the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@needs_triton
def test_radix8_finishes_with_a_block_sort_and_a_merge_rank(monkeypatch):
    """Every radix8 finish is one block-sort and one merge-rank launch, with one merge block (k_pad
    <= 256, e.g. k = 88: 128) or several (k = 300: two of 256); all exact."""
    launches = {name: _Launches(getattr(ts, name)) for name in ("_block_sort_kernel", "_merge_rank_kernel")}
    for name, fake in launches.items():
        monkeypatch.setattr(ts, name, fake)
    q, kc, pad, lo, hi = _case(2, 4, 2, 4, 900, [0, 30], [880, 400], 260, levels=3)
    retrieve = torch.tensor([[True, False, True, True], [False, True, True, False]])
    for k in (88, 300):
        before = {name: fake.count for name, fake in launches.items()}
        out = tuned(topk_retrieval, select="radix8")(*_dev(q, kc, pad, lo, hi, retrieve), k, 0.5).cpu()
        assert torch.equal(out, topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 0.5)), k
        assert {name: fake.count - before[name] for name, fake in launches.items()} == {
            "_block_sort_kernel": 1, "_merge_rank_kernel": 1}, k


@needs_triton
@pytest.mark.parametrize("merge_rank", ["search", "count"])
def test_radix8_merge_finishes_match_reference(merge_rank, monkeypatch):
    """Both merge finishes (``merge_rank``) over merge blocks of 16 candidates (``_MERGE_BLOCK``
    shrunk, so that several blocks stay cheap in the interpreter): k 37 (not a power of two; 64
    candidate slots, 4 blocks) and 100 (8 blocks), three score levels (runs of exact ties inside and
    across blocks), a region shorter than k (sequence 1: 60 keys) and an empty one (sequence 2),
    rows not retrieving, every scratch buffer (the rank counts too) starting as garbage, and a
    persistent grid of 3 programs (each strides over items of several rows and blocks)."""
    _poison_empty(monkeypatch)
    monkeypatch.setattr(ts, "_MERGE_BLOCK", 16)
    B, Hq, Hkv, D, S = 3, 4, 2, 4, 300
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 40, 9], [290, 60, 0], 310, levels=1)
    retrieve = torch.ones(B, Hq, dtype=torch.bool)
    retrieve[0, 2] = retrieve[1, 0] = False
    for programs in (None, 3):
        if programs is not None:
            monkeypatch.setattr(ts, "_persistent_programs", lambda device, n=programs: n)
        for k in (37, 100):
            ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, k, 1.0)
            retrieval = tuned(topk_retrieval, select="radix8", merge_rank=merge_rank)
            out = retrieval(*_dev(q, kc, pad, lo, hi, retrieve), k, 1.0).cpu()
            assert torch.equal(out, ref), (programs, k)
            assert (out[~retrieve] == -1).all() and (out[2] == -1).all() and (out[1][retrieve[1]][:, 60:] == -1).all()


@needs_triton
def test_merge_rank_constant_picks_the_finish_and_is_checked(monkeypatch):
    """``MERGE_RANK`` ("search", the default) picks radix8's finish where ``merge_rank`` is not set,
    read at each call: "search" is the merge rank launch, "count" the pair count and the rank scatter
    launches instead (the block sort before either); ``_merge_rank`` wins over it. A value outside
    MERGE_RANKS, as the constant or the switch, is refused naming the allowed ones, whatever the select."""
    assert ts.MERGE_RANKS == ("search", "count") and ts.MERGE_RANK == "search"
    names = ("_block_sort_kernel", "_merge_rank_kernel", "_merge_count_kernel", "_rank_scatter_kernel")
    launches = {name: _Launches(getattr(ts, name)) for name in names}
    for name, fake in launches.items():
        monkeypatch.setattr(ts, name, fake)
    q, kc, pad, lo, hi = _case(1, 2, 1, 4, 700, [0], [690], 320, levels=2)
    retrieve = torch.tensor([[True, False]])
    args = _dev(q, kc, pad, lo, hi, retrieve)
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 300, 1.0)
    for constant, switch, finish in (("search", None, "search"), ("count", None, "count"),
                                     ("count", "search", "search"), ("search", "count", "count")):
        monkeypatch.setattr(ts, "MERGE_RANK", constant)
        before = {name: fake.count for name, fake in launches.items()}
        assert torch.equal(tuned(topk_retrieval, merge_rank=switch)(*args, 300, 1.0).cpu(), ref), (constant, switch)
        ran = {name: fake.count - before[name] for name, fake in launches.items()}
        assert ran == {"_block_sort_kernel": 1, "_merge_rank_kernel": int(finish == "search"),
                       "_merge_count_kernel": int(finish == "count"), "_rank_scatter_kernel": int(finish == "count")}
    monkeypatch.setattr(ts, "MERGE_RANK", "scan")
    with pytest.raises(ValueError, match="MERGE_RANK='scan'.*'search', 'count'"):
        topk_retrieval(*args, 300, 1.0)
    monkeypatch.setattr(ts, "MERGE_RANK", "search")
    for select in ("radix8", "tilemax"):
        with pytest.raises(ValueError, match="merge_rank='scan'.*'search', 'count'"):
            tuned(topk_retrieval, select=select, merge_rank="scan")(*args, 300, 1.0)


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_radix8_stop_points_launch_their_stages_only(grouped, monkeypatch):
    """``stop_after`` at each stage of radix8 (the benchmark's select breakdown) launches the stages
    up to it and none after, and returns the output unwritten: "passes" (four pass launches),
    "collect", "block_sort", then "select" (the merge, the whole output); with either finish. The
    tilemax select has no such stages: those stop points name the ones it has."""
    _poison_empty(monkeypatch)
    names = ("_radix_pass_kernel", "_radix_collect_kernel", "_block_sort_kernel", "_merge_rank_kernel",
             "_merge_count_kernel", "_rank_scatter_kernel")
    launches = {name: _Launches(getattr(ts, name)) for name in names}
    for name, fake in launches.items():
        monkeypatch.setattr(ts, name, fake)
    q, kc, pad, lo, hi = _case(2, 4, 2, 4, 600, [0, 30], [590, 500], 330, levels=2)
    retrieve = torch.tensor([[True, False], [True, True]] if grouped else [[True, False, False, True], [False] * 4])
    fn, ref_fn = ((topk_retrieval_grouped, topk_retrieval_grouped_reference) if grouped
                  else (topk_retrieval, topk_retrieval_reference))
    args = _dev(q, kc, pad, lo, hi, retrieve)
    stages = {"score": {}, "passes": {"_radix_pass_kernel": 4}}
    stages["collect"] = dict(stages["passes"], _radix_collect_kernel=1)
    stages["block_sort"] = dict(stages["collect"], _block_sort_kernel=1)
    for merge_rank, finish in (("search", {"_merge_rank_kernel": 1}),
                               ("count", {"_merge_count_kernel": 1, "_rank_scatter_kernel": 1})):
        stages["select"] = dict(stages["block_sort"], **finish)
        for stop, want in stages.items():
            before = {name: fake.count for name, fake in launches.items()}
            out = tuned(fn, select="radix8", stop_after=stop, merge_rank=merge_rank)(*args, 300, 1.0).cpu()
            ran = {name: fake.count - before[name] for name, fake in launches.items()}
            assert ran == {name: want.get(name, 0) for name in names}, (merge_rank, stop)
            if stop == "select":
                assert torch.equal(out, ref_fn(q, kc, pad, lo, hi, retrieve, 300, 1.0)), merge_rank
            else:
                assert (out == 7).all(), (merge_rank, stop)  # torch.empty's garbage, not written
    for stop in ("passes", "collect", "block_sort"):
        with pytest.raises(ValueError, match=f"stop_after='{stop}'.*radix8.*'compact', 'score', 'select'"):
            tuned(fn, select="tilemax", stop_after=stop)(*args, 20, 1.0)


@needs_triton
@pytest.mark.parametrize("select", SELECT_MODES)
def test_radix8_grouped(select):
    """Group-shared retrieval (one row per KV head, max over its heads) with the new selects."""
    B, Hq, Hkv, D, S = 2, 6, 2, 4, 1100
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 40], [1090, 50], 240)
    retrieve = torch.tensor([[True, False], [True, True]])
    for k in (9, 260):
        ref = topk_retrieval_grouped_reference(q, kc, pad, lo, hi, retrieve, k, 0.5)
        out = tuned(topk_retrieval_grouped, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), k, 0.5).cpu()
        assert torch.equal(out, ref), k


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("select", SELECT_MODES)
def test_group_score_compacts_the_flags_without_a_launch(select, grouped, monkeypatch):
    """The group score kernel finds the live groups itself and writes the rows' order for the
    select: no `_compact_kernel` launch, the same output as the reference for no, some (in
    several groups, not the first) and all rows, over scratch that starts as garbage. With more
    flags than it compacts in registers, the compaction launch comes back."""
    _poison_empty(monkeypatch)
    B, Hq, Hkv, D, S = 3, 6, 2, 4, 400
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 9, 30], [390, 200, 5], 270, levels=3)
    rows = Hkv if grouped else Hq
    some = torch.zeros(B, rows, dtype=torch.bool)
    some[1, rows - 1] = some[2, 0] = some[0, rows // 2] = True
    fn, ref_fn = ((topk_retrieval_grouped, topk_retrieval_grouped_reference) if grouped
                  else (topk_retrieval, topk_retrieval_reference))
    spy = _Launches(tk._compact_kernel)
    monkeypatch.setattr(tk, "_compact_kernel", spy)
    for retrieve in (torch.zeros(B, rows, dtype=torch.bool), some, torch.ones(B, rows, dtype=torch.bool)):
        ref = ref_fn(q, kc, pad, lo, hi, retrieve, 12, 0.5)
        out = tuned(fn, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), 12, 0.5).cpu()
        assert torch.equal(out, ref), int(retrieve.sum())
    assert spy.count == 0
    monkeypatch.setattr(tk, "_SCORE_COMPACT_MAX", 8)
    out = tuned(fn, select=select)(*_dev(q, kc, pad, lo, hi, some), 12, 0.5).cpu()
    assert torch.equal(out, ref_fn(q, kc, pad, lo, hi, some, 12, 0.5)) and spy.count == 1


@needs_triton
def test_radix8_no_row_retrieves():
    q, kc, pad, lo, hi = _case(2, 2, 1, 4, 300, [0, 5], [290, 290], 250)
    retrieve = torch.zeros(2, 2, dtype=torch.bool)
    for select in SELECT_MODES:
        out = tuned(topk_retrieval, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), 17, 1.0).cpu()
        assert (out == -1).all(), select


@needs_triton
def test_stop_points_run_and_are_checked():
    """Both selects stop after "compact" and "score" (the benchmark's stage breakdown); unknown stop
    points name the allowed values."""
    q, kc, pad, lo, hi = _case(1, 2, 1, 4, 200, [0], [190], 260)
    retrieve = torch.ones(1, 2, dtype=torch.bool)
    args = _dev(q, kc, pad, lo, hi, retrieve)
    for select in SELECT_MODES:
        for stop in ("compact", "score"):
            assert tuned(topk_retrieval, select=select, stop_after=stop)(*args, 20, 1.0).shape == (1, 2, 20)
    for stop in ("blocksort", "sort", "merge"):
        with pytest.raises(ValueError, match=f"stop_after='{stop}'.*'passes', 'collect', 'block_sort'"):
            tuned(topk_retrieval, stop_after=stop)(*args, 20, 1.0)


_SM90_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prhs_hf.ops.topk import topk_select as ts

SCALARS = ("S", "K", "CHUNK", "NCH", "NBLK")


def compile_sm90(fn, constexprs, num_warps):
    sig = {}
    for n in fn.arg_names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n.isupper() and n not in SCALARS:
            sig[n] = "*i64" if n == "CAND" else "*i32"
        else:
            sig[n] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


c = dict(H=32, K_PAD=2048)
r8 = dict(c, BLOCK=1024)
kernels = [(ts._radix_pass_kernel, dict(r8, P=p), 4) for p in range(4)]
kernels += [
    (ts._radix_collect_kernel, r8, 4),
    (ts._block_sort_kernel, dict(c, MB=256, ZERO_RANK=False), 4),
    (ts._block_sort_kernel, dict(c, MB=256, ZERO_RANK=True), 4),
    (ts._merge_rank_kernel, dict(c, MB=256, LOG_MB=8), 4),
    (ts._merge_count_kernel, dict(c, MB=256, FAN=ts._count_fan(256)), 4),
    (ts._rank_scatter_kernel, dict(c, MB=256), 4),
]
tm = dict(H=12, SUB=32, K_PAD=128, CAP=4096, RADIX_PAD=128, BLOCK=2048, TBLOCK=1024, THETA_PASSES=3,
          CBLOCK=1024)
kernels += [(ts._tilemax_select_kernel, tm, 8)]
for fn, constexprs, num_warps in kernels:
    assert "cubin" in compile_sm90(fn, constexprs, num_warps).asm, fn.__name__
print("compiled", len(kernels))
"""


def _has_cuda_backend() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_cuda_backend(), reason="needs Triton with its CUDA backend (ptxas)")
def test_select_kernels_compile_for_sm90():
    """Every select kernel at the H200 shape (K_PAD 2048, chunks of 1024; both merge finishes)
    compiles to a cubin for sm_90 on this machine (a subprocess without the interpreter):
    interpreter-only tests do not see compiler-only errors (constexpr rules, types)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_CHECK], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiled 11" in res.stdout


@needs_triton
@pytest.mark.parametrize("merge_rank", [None, "count"])
@pytest.mark.parametrize("k", [2049, 4096])
def test_default_select_is_radix8_above_tilemax_k_and_exact_beyond_the_one_program_buffer(k, merge_rank):
    """The default select ("auto") at cpe_longbench's top-k (4096) is radix8: a 2900-key run of
    exact ties straddles k, so the candidates overflow any 2048 buffer. With the default merge
    finish and with "count" at the real merge block (16 blocks of 256 candidates at k 4096)."""
    assert tk.RetrievalTuning().select == "auto"
    assert tk.default_select(k) == "radix8" and tk.default_select(tk.TILEMAX_MAX_K) == "tilemax"
    q, kc, pad, lo, hi = _case(1, 2, 1, 16, 6000, [3], [5987], seed=5, levels=3)
    kc[0, 0, 100:3000] = kc[0, 0, 100]
    ret = torch.tensor([[True, False]])
    want = topk_retrieval_reference(q, kc, pad, lo, hi, ret, k, 0.25)
    got = tuned(topk_retrieval, merge_rank=merge_rank)(*_dev(q, kc, pad, lo, hi, ret), k, 0.25)
    assert torch.equal(got.cpu(), want)


@needs_triton
def test_auto_select_runs_tilemax_up_to_its_k_and_radix8_above(monkeypatch):
    """``select="auto"``: one tilemax launch (and no radix pass) for k <= TILEMAX_MAX_K (cis.yaml's
    88), the radix8 passes above it; both exact."""
    launches = {name: _Launches(getattr(ts, name)) for name in ("_tilemax_select_kernel", "_radix_pass_kernel")}
    for name, fake in launches.items():
        monkeypatch.setattr(ts, name, fake)
    q, kc, pad, lo, hi = _case(1, 4, 2, 4, 1400, [5], [1390], 7, levels=3)
    ret = torch.tensor([[True, False, True, True]])
    for k, tilemax in ((88, True), (tk.TILEMAX_MAX_K, True), (tk.TILEMAX_MAX_K + 1, False)):
        before = {name: fake.count for name, fake in launches.items()}
        got = topk_retrieval(*_dev(q, kc, pad, lo, hi, ret), k, 0.5)
        assert torch.equal(got.cpu(), topk_retrieval_reference(q, kc, pad, lo, hi, ret, k, 0.5)), k
        ran = {name: fake.count - before[name] for name, fake in launches.items()}
        assert (ran["_tilemax_select_kernel"], ran["_radix_pass_kernel"] > 0) == ((1, False) if tilemax else (0, True)), k


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_tilemax_threshold_paths(grouped, monkeypatch):
    """``select="tilemax"`` on each of its paths, against the reference: candidates that fit the
    first sort tier (distinct scores), more than that (runs of 600 and 3000 ties over the
    threshold: the radix select of the candidates), more than the candidate buffer (the same
    cases with a 512-slot buffer: the radix select of the whole row), and fewer sub-tiles than k
    (theta is the smallest key: every key a candidate)."""
    B, Hq, Hkv, D, S = 1, 2, 1, 8, 3200
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-3, 4, (B, Hq, D), generator=g).float()
    base = torch.randint(-3, 4, (B, Hkv, S, D), generator=g).float()
    pad, lo, hi = torch.tensor([4], dtype=I32), torch.tensor([6], dtype=I32), torch.tensor([3150], dtype=I32)
    retrieve = torch.ones(B, Hkv if grouped else Hq, dtype=torch.bool)
    ref_fn = topk_retrieval_grouped_reference if grouped else topk_retrieval_reference
    run = topk_retrieval_grouped if grouped else topk_retrieval
    ties600 = base.clone()
    ties600[0, 0, 1000:1600] = 4.0  # 600 equal keys above every other score
    ties3000 = base.clone()
    ties3000[0, 0, 100:3100] = 4.0
    for cap in (ts._TILE_CAP, 512):
        monkeypatch.setattr(ts, "_TILE_CAP", cap)
        for kc, k in ((base, 40), (ties600, 40), (ties600, 100), (ties3000, 88), (base, 200)):
            want = ref_fn(q, kc, pad, lo, hi, retrieve, k, 0.5)
            got = tuned(run, select="tilemax")(*_dev(q, kc, pad, lo, hi, retrieve), k, 0.5)
            assert torch.equal(got.cpu(), want), (cap, k)


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_radix8_scratch_starts_as_garbage_over_many_rows(grouped, monkeypatch):
    """41 retrieving rows (23 groups), every scratch buffer filled with garbage first: the score
    kernel zeroes the histograms and counters of exactly the rows it writes; per-head and group rows."""
    select = "radix8"
    _poison_empty(monkeypatch)
    B, Hq, Hkv, D, S = 6, 8, 4, 4, 300
    q, kc, pad, lo, hi = _case(B, Hq, Hkv, D, S, [0, 9, 0, 30, 2, 0], [290] * 6, 270, levels=3)
    if grouped:
        retrieve = torch.ones(B, Hkv, dtype=torch.bool)
        retrieve[2, 1] = False
        assert int(retrieve.sum()) == 23
        ref = topk_retrieval_grouped_reference(q, kc, pad, lo, hi, retrieve, 5, 1.0)
        out = tuned(topk_retrieval_grouped, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), 5, 1.0)
    else:
        retrieve = torch.ones(B, Hq, dtype=torch.bool)
        retrieve.view(-1)[::7] = False
        assert int(retrieve.sum()) == 41
        ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 5, 1.0)
        out = tuned(topk_retrieval, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), 5, 1.0)
    assert torch.equal(out.cpu(), ref)


@needs_triton
@pytest.mark.parametrize("select", SELECT_MODES)
def test_selects_all_scores_negative_with_partial_tiles(select):
    """Every score negative (all pass-0 digits below the one of 0.0) and regions that end
    inside a score tile: the masked lanes of the last tile (score 0.0 there) must not count
    in any histogram or sub-tile maximum, per head and grouped."""
    B, Hq, Hkv, D, S = 2, 4, 2, 4, 1400
    g = torch.Generator().manual_seed(280)
    q = torch.randint(1, 4, (B, Hq, D), generator=g).float()
    kc = -torch.randint(1, 4, (B, Hkv, S, D), generator=g).float()
    pad = torch.tensor([0, 11], dtype=I32)
    lo = torch.tensor([3, 0], dtype=I32)
    hi = torch.tensor([1390, 1377], dtype=I32)
    retrieve = torch.tensor([[True, False, True, True], [False, True, False, False]])
    ref = topk_retrieval_reference(q, kc, pad, lo, hi, retrieve, 100, 1.0)
    out = tuned(topk_retrieval, select=select)(*_dev(q, kc, pad, lo, hi, retrieve), 100, 1.0)
    assert torch.equal(out.cpu(), ref)
    rg = torch.tensor([[True, False], [False, True]])
    ref_g = topk_retrieval_grouped_reference(q, kc, pad, lo, hi, rg, 100, 1.0)
    out_g = tuned(topk_retrieval_grouped, select=select)(*_dev(q, kc, pad, lo, hi, rg), 100, 1.0)
    assert torch.equal(out_g.cpu(), ref_g)


_SM90_SCORE_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prhs_hf.ops.topk import topk_retrieval as tk

TYPES = {"Q": "*bf16", "K": "*bf16", "FLAG": "*i1", "scale": "fp32", "S": "i32", "CHUNK": "i32", "R": "i32",
         "MIN_CHUNK": "i32", "MAX_SPLITS": "i32"}


def compile_sm90(fn, constexprs, num_warps):
    # constexprs with defaults must still be named (an unnamed upper-case one would become a pointer)
    constexprs = {**{n: v for n, v in (("TILE_MAX", False), ("SUB", 32), ("COMPACT", False), ("BLOCK_R", 16),
                                       ("FG", 1), ("FGP", 1), ("NGP", 16), ("KFMT", 0)) if n in fn.arg_names}, **constexprs}
    sig = {n: "constexpr" if n in constexprs else TYPES.get(n, "*i32" if n.isupper() else "i32")
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


kernels = [(tk._compact_kernel, dict(GROUP=4, GP=4, BLOCK=512, BLOCK_G=128, WITH_GROUPS=True), 4)]
radix = dict(D=128, BLOCK_D=128, BLOCK_N=128, ZERO_SCRATCH=True, HIST_ROW=1024)  # select="radix8", bf16 tiles
for group, agg in ((4, False), (4, True), (1, False), (6, False)):  # 32/8, grouped, 32/32, Qwen 12/2
    kernels.append((tk._group_score_kernel, dict(radix, HKV=8, GROUP=group, BLOCK_M=16, AGG_MAX=agg, IEEE=False,
                                                 ZROWS=1 if agg else group), 4))
tile = dict(D=128, BLOCK_D=128, BLOCK_N=128, TILE_MAX=True, SUB=32, ZERO_SCRATCH=False, HIST_ROW=1024)  # "tilemax"
for group, agg, compact in ((6, False, False), (6, True, False), (6, False, True), (6, True, True)):
    # compact: the flags compacted in the kernel (the default), Qwen B32: 384 rows, 64 groups
    fg = 1 if agg else group
    kernels.append((tk._group_score_kernel, dict(tile, HKV=2, GROUP=group, BLOCK_M=16, AGG_MAX=agg, IEEE=False,
                                                 ZROWS=1 if agg else group, COMPACT=compact,
                                                 BLOCK_R=512 if not agg else 64, FG=fg,
                                                 FGP=triton.next_power_of_2(fg), NGP=64), 4))
for fn, constexprs, num_warps in kernels:
    assert "cubin" in compile_sm90(fn, constexprs, num_warps).asm, fn.__name__
print("compiled", len(kernels))
"""


@pytest.mark.skipif(not _has_cuda_backend(), reason="needs Triton with its CUDA backend (ptxas)")
def test_score_kernels_compile_for_sm90():
    """The compaction and the group score kernel in each of its modes (zeroing the radix8 scratch:
    per-head G = 4, 1, 6 and grouped; writing the tilemax sub-tile maxima, with and without the
    in-kernel compaction, Qwen 12/2) compile to a cubin for sm_90 at the H200 shapes (d 128)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_SCORE_CHECK], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiled 9" in res.stdout
