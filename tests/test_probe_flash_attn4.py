"""scripts/probe_flash_attn4.py on the CPU: the schedule -> FA4 block-sparse tensors conversion
against a dense mask of the SPEC §3 predicate, and the clean exit without CUDA / flash_attn."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import probe_flash_attn4 as probe  # noqa: E402

from prhs_hf import schedules as sched  # noqa: E402
from prhs_hf.kernels.prefill_attention import prefill_visibility  # noqa: E402


def _schedule(L: int, w: float, sink: int) -> torch.Tensor:
    return sched.psaw_window_start_tensor(torch.arange(1, L + 1), w, sink)


def _dense_kinds(win: torch.Tensor, sink: int, flo: int, fhi: int, kv_len: int, bm: int, bn: int) -> torch.Tensor:
    """Tile kinds straight from the dense ``Lq x Lk`` mask (0 skipped, 1 partial, 2 full)."""
    L = win.shape[0]
    i = torch.arange(L)[:, None]
    j = torch.arange(kv_len)[None, :]
    vis = prefill_visibility(i, j, win[:, None], sink, torch.tensor(flo), torch.tensor(fhi))
    M, N = -(-L // bm), -(-kv_len // bn)
    kinds = torch.zeros(M, N, dtype=torch.int8)
    for m in range(M):
        for n in range(N):
            tile = vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
            if tile.any():
                kinds[m, n] = 2 if tile.all() and tile.shape == (bm, bn) else 1
    return kinds


CASES = [
    # L, kv_len, w, sink, frozen_lo, frozen_hi, block
    (256, 256, 0.7, 8, 8, 8, (32, 32)),  # PSAW only
    (300, 300, 0.7, 8, 8, 150, (32, 16)),  # PSAW + ETF, ragged last tiles
    (256, 256, 1.0, 8, 8, 8, (64, 32)),  # dense-equivalent: causal tiles only
    (200, 200, 0.5, 40, 40, 120, (16, 16)),  # a sink wider than a tile, frozen rows across tiles
    (130, 130, 0.9, 0, 0, 0, (32, 32)),  # no sink
]


@pytest.mark.parametrize("L,kv_len,w,sink,flo,fhi,block", CASES)
def test_block_sparse_tensors_match_the_dense_mask(L, kv_len, w, sink, flo, fhi, block):
    win = _schedule(L, w, sink)
    got = probe.fa4_block_sparse(win, sink, flo, fhi, kv_len, block)
    want = _dense_kinds(win, sink, flo, fhi, kv_len, *block)
    assert torch.equal(got["kinds"], want)
    assert got["block_size"] == block
    M, N = want.shape
    for name, kind in (("mask", 1), ("full", 2)):
        cnt, idx = got[f"{name}_block_cnt"], got[f"{name}_block_idx"]
        assert cnt.dtype == idx.dtype == torch.int32
        assert tuple(cnt.shape) == (1, 1, M) and tuple(idx.shape) == (1, 1, M, N)
        for m in range(M):
            cols = (want[m] == kind).nonzero().flatten().to(torch.int32)
            assert int(cnt[0, 0, m]) == cols.numel()
            assert torch.equal(idx[0, 0, m, : cols.numel()], cols)  # ascending, packed left


@pytest.mark.parametrize("L,w,sink,fhi", [(257, 0.7, 8, 100), (512, 0.6, 4, 4)])
def test_visible_pairs_per_tile_sum_to_the_schedule(L, w, sink, fhi):
    win = _schedule(L, w, sink)
    pairs, capacity = probe.visible_per_block(win, sink, sink, fhi, L, 64, 32)
    assert int(pairs.sum()) == sched.visible_pairs(L, w, sink, sink, fhi)
    assert bool((pairs <= capacity).all())


def test_no_cuda_exits_cleanly_and_records_the_import(tmp_path):
    out = tmp_path / "probe"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PRHS_GIT_COMMIT": "test-commit"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "probe_flash_attn4.py"), "--out", str(out), "--fa4-cache", ""],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device" in proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    for key in ("command", "gpu", "versions", "date", "git_commit"):
        assert key in data["meta"]
    assert "flash_attn_4" in data["meta"]["versions"]
    assert data["fa4"]["versions"]["flash-attn-4"]
    if importlib.util.find_spec("flash_attn") is None:  # this venv has no FA4: the failure is recorded in full
        assert data["fa4"]["ok"] is False
        assert "flash_attn" in data["fa4"]["error"]
        assert data["errors"][0]["where"] == "import flash_attn.cute"
        assert "Traceback (most recent call last)" in data["errors"][0]["traceback"]
        assert "flash_attn" in proc.stdout  # the traceback is printed too
    md = out.with_suffix(".md").read_text()
    assert "flash-attn-4 probe" in md and "command:" in md and "no CUDA device" in md
