"""scripts/probe_flash_attn4.py on the CPU: the clean exit without CUDA / flash_attn, and that the
probe runs the route's own conversion, mask_mod and FA4 calls (``prhs_hf.ops.prefill.flash_prefill``,
whose conversion is tested against a dense mask in tests/test_flash_prefill.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import probe_flash_attn4 as probe  # noqa: E402

from prhs_hf.ops.prefill import flash_prefill  # noqa: E402


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


def test_the_probe_uses_the_route_functions():
    """One home: the probe measures the library's conversion, mask_mod and FA4 calls, not copies."""
    for name in ("fa4_block_sparse", "prefill_mask_mod", "mask_aux_tensors", "flash_block_sparse_attention",
                 "flash_causal_attention", "import_flash_attn", "add_cutlass_dsl_path", "fa4_block_size"):
        assert getattr(probe, name) is getattr(flash_prefill, name), name
    for gone in ("visible_per_block", "block_kinds", "make_fa4_mask_mod", "_add_cutlass_dsl_path"):
        assert not hasattr(probe, gone), gone
