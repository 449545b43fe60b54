"""Tests of the GPU-transfer tooling in tools/ (split/join, the device-call plan, the GPU-side script)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prhs_hf.hub import fetch
from prhs_hf.hub.fetch import ChecksumError
from prhs_hf.evaluation.accuracy import configs as accuracy_configs

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))  # as when the scripts run: their own folder first

import gpu_transfer  # noqa: E402
import pack_for_gpu  # noqa: E402

KiB = 1024


# --------------------------------------------------------------------------------------------
# Out of the library
# --------------------------------------------------------------------------------------------


def test_transfer_tooling_is_not_in_the_library() -> None:
    assert not hasattr(fetch, "split_for_transfer") and not hasattr(fetch, "join_pieces")
    library = [p for p in (REPO / "prhs_hf").rglob("*.py")]
    assert not [p.name for p in library if re.search(r"split_for_transfer|join_pieces", p.read_text())]
    moved = ["pack_for_gpu.py", "gpu_join_and_eval.sh", "bring_model_to_gpu.md", "gpu_transfer.py"]
    assert [name for name in moved if (TOOLS / name).is_file()] == moved
    assert not [name for name in moved if (REPO / "scripts" / name).exists() or (REPO / "prhs_hf" / name).exists()]
    script = (TOOLS / "gpu_join_and_eval.sh").read_text()
    assert "from prhs_hf.hub.fetch import join_pieces" not in script
    assert '$PY "$REPO/tools/gpu_transfer.py" join' in script


# --------------------------------------------------------------------------------------------
# Split and join
# --------------------------------------------------------------------------------------------


def test_split_and_join_round_trip(tmp_path) -> None:
    data = os.urandom(5000)
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    pieces = gpu_transfer.split_for_transfer(src, tmp_path / "xfer", piece_mib=2 * KiB / gpu_transfer.MiB,
                                             progress=False)
    assert [p.name for p in pieces] == ["model.gguf.000", "model.gguf.001", "model.gguf.002"]
    assert [p.stat().st_size for p in pieces] == [2048, 2048, 904]
    sha = hashlib.sha256(data).hexdigest()
    assert (tmp_path / "xfer" / "model.gguf.sha256").read_text() == f"{sha}  model.gguf\n"
    out = gpu_transfer.join_pieces(tmp_path / "xfer", tmp_path / "back" / "model.gguf", progress=False)
    assert out.read_bytes() == data
    (tmp_path / "xfer" / gpu_transfer.MANIFEST).unlink()  # without a manifest: name order + given digest
    joined = gpu_transfer.join_pieces(tmp_path / "xfer", tmp_path / "b2.gguf", sha256=sha, progress=False)
    assert joined.read_bytes() == data


def test_join_detects_corruption_and_missing_pieces(tmp_path) -> None:
    src = tmp_path / "m.bin"
    src.write_bytes(os.urandom(3000))
    pieces = gpu_transfer.split_for_transfer(src, tmp_path / "x", piece_mib=KiB / gpu_transfer.MiB, progress=False)
    pieces[1].write_bytes(b"\0" * 1024)
    with pytest.raises(ChecksumError, match="sha256"):
        gpu_transfer.join_pieces(tmp_path / "x", tmp_path / "out.bin", progress=False)
    assert not (tmp_path / "out.bin").exists()
    pieces[2].unlink()
    with pytest.raises(ChecksumError, match="missing pieces \\['m.bin.002'\\]"):
        gpu_transfer.join_pieces(tmp_path / "x", tmp_path / "out.bin", progress=False)


def test_command_line_splits_and_joins_under_python_dash_capital_p(tmp_path) -> None:
    """As gpu_join_and_eval.sh runs it: ``python3 -P tools/gpu_transfer.py``, prhs_hf from PYTHONPATH."""
    src = tmp_path / "m.bin"
    src.write_bytes(os.urandom(3000))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-P", str(TOOLS / "gpu_transfer.py")]
    split = subprocess.run([*run, "split", str(src), str(tmp_path / "x"), "--piece-mib", str(KiB / gpu_transfer.MiB)],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert split.returncode == 0, split.stderr
    assert len(split.stdout.split()) == 3
    join = subprocess.run([*run, "join", str(tmp_path / "x"), str(tmp_path / "back.bin")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert join.returncode == 0, join.stderr
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    bad = subprocess.run([*run, "join", str(tmp_path / "x"), str(tmp_path / "b.bin"), "--sha256", "0" * 64],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 1 and "gpu_transfer: error:" in bad.stderr and "sha256 is" in bad.stderr


# --------------------------------------------------------------------------------------------
# The device-call plan (tools/pack_for_gpu.py)
# --------------------------------------------------------------------------------------------


def _pack(root: Path, n: int) -> tuple[Path, list[Path], list[Path]]:
    """A model ``m`` split into ``n`` pieces of 1 KiB, with data and wheel folders, laid out as in ``.xfer``."""
    src = root / "m.gguf"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(os.urandom(n * KiB))
    folder = root / ".xfer" / "models" / "m"
    pieces = gpu_transfer.split_for_transfer(src, folder, piece_mib=KiB / gpu_transfer.MiB, progress=False)
    for sub in ("data", "whl"):
        (root / ".xfer" / sub).mkdir()
        (root / ".xfer" / sub / f"{sub}.txt").write_text(sub)
    manifest = folder / gpu_transfer.MANIFEST
    return manifest, pieces, [root / ".xfer" / "data", root / ".xfer" / "whl", manifest, folder / "m.gguf.sha256"]


def test_gpu_plan_carries_one_piece_per_call_and_runs_the_tools_script() -> None:
    folder = pack_for_gpu.REPO / ".xfer" / "models" / "m"
    pieces = [folder / f"m.gguf.{i:03d}" for i in range(3)]
    small = [pack_for_gpu.REPO / ".xfer" / "data", pack_for_gpu.REPO / ".xfer" / "whl", folder / "MANIFEST.json",
             folder / "m.gguf.sha256"]
    calls = pack_for_gpu.plan_calls("m", folder / "MANIFEST.json", pieces, small, ["--limit", "5"])
    m = ".xfer/models/m/"
    assert [c.carry for c in calls] == [
        [".xfer/data", ".xfer/whl", m + "MANIFEST.json", m + "m.gguf.sha256", m + "m.gguf.000"],
        [m + "m.gguf.001"], [m + "m.gguf.002"]]
    assert "cp -r .xfer/data .xfer/whl /tmp/" in calls[0].command
    assert "piece 2/3 ok" in calls[1].command and "gpu_join_and_eval" not in calls[1].command
    default = ",".join(accuracy_configs.DEFAULT_CONFIGS)
    assert calls[-1].command.endswith(f"bash tools/gpu_join_and_eval.sh m --configs '{default}' --limit 5")
    resume = pack_for_gpu.resume_call("m", ["--configs=dense"])
    assert resume.carry == [] and resume.command == "bash tools/gpu_join_and_eval.sh m --configs=dense"
    assert (REPO / pack_for_gpu.GPU_SCRIPT).is_file()
    plan = pack_for_gpu.render_plan("m", calls, resume)
    assert "R. run(" in plan and all(len(c.command) < pack_for_gpu.MAX_COMMAND_CHARS for c in [*calls, resume])


def test_gpu_plan_stages_real_pieces_across_calls_that_lose_their_carry(tmp_path, monkeypatch) -> None:
    """Run the piece calls as the device does (each call's tree holds only what it carries) on pieces
    cut by gpu_transfer, whose manifest the calls check every sha256 against."""
    src = tmp_path / "here"
    manifest, pieces, small = _pack(src, 3)
    monkeypatch.setattr(pack_for_gpu, "REPO", src)
    monkeypatch.setattr(pack_for_gpu, "STAGE", str(tmp_path / "stage"))
    calls = pack_for_gpu.plan_calls("m", manifest, pieces, small, [])

    def run(call: pack_for_gpu.DeviceCall) -> subprocess.CompletedProcess[str]:
        there = tmp_path / "there"
        shutil.rmtree(there, ignore_errors=True)
        for rel in call.carry:
            dst = there / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (src / rel).is_dir() else shutil.copy)(src / rel, dst)
        command = call.command.split(f" && bash {pack_for_gpu.GPU_SCRIPT}")[0]  # stop before the evaluation
        return subprocess.run(["bash", "-c", command], cwd=there, capture_output=True, text=True)

    for i, call in enumerate(calls, 1):
        r = run(call)
        assert r.returncode == 0 and f"piece {i}/3 ok" in r.stdout, r.stderr
    staged = tmp_path / "stage" / "pieces" / "m"
    joined = gpu_transfer.join_pieces(staged, tmp_path / "m.gguf", progress=False)
    assert joined.read_bytes() == (src / "m.gguf").read_bytes()
    pieces[1].write_bytes(b"x" * KiB)  # a corrupted piece fails its check
    assert run(calls[1]).returncode == 1


# --------------------------------------------------------------------------------------------
# The GPU-side script (tools/gpu_join_and_eval.sh)
# --------------------------------------------------------------------------------------------


def test_gpu_join_script_runs_its_python_without_the_cwd_on_sys_path() -> None:
    """The inline Python sees PYTHONPATH (the checkout's root, the installed wheels), not the working directory."""
    text = (TOOLS / "gpu_join_and_eval.sh").read_text()
    assert 'PY="python3 -P"' in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "python3 -c" in line or "python3 -m" in line]
    assert [line.split()[0:2] for line in code if "python3 " in line and "-P" not in line] == [
        ["python3", "scripts/run_accuracy.py"]]


@pytest.mark.slow
def test_gpu_join_script_joins_and_exports_from_the_stage(tmp_path) -> None:
    """Steps 0-3 of gpu_join_and_eval.sh on this machine: staged pieces of a tiny GGUF are joined by
    tools/gpu_transfer.py and exported; step 4 (CUDA) is not what is tested here."""
    from test_fetch import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    stage, work = tmp_path / "stage", tmp_path / "work"
    gpu_transfer.split_for_transfer(gguf, stage / "pieces" / "tiny", piece_mib=64 * KiB / gpu_transfer.MiB,
                                    progress=False)
    (stage / "data").mkdir(parents=True)
    (stage / "data" / "gsm8k_test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    (work / "site").mkdir(parents=True)
    (work / "site" / ".done").touch()  # the wheels are installed here already (gguf is in this venv)
    bin_dir = Path(sys.executable).parent  # this venv's python3 first on PATH
    assert (bin_dir / "python3").is_file()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PRHS_STAGE": str(stage),
           "PRHS_GPU_WORK": str(work), "OUT": str(tmp_path / "out"), "PYTHONPATH": "",
           "PRHS_CALIBRATE": "--n 1 --length 48 --oracle-rows 2", "PRHS_CALIBRATE_TARGETS": "0.01 0.5"}
    r = subprocess.run(["bash", str(TOOLS / "gpu_join_and_eval.sh"), "tiny", "--limit", "1"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=600)
    log = r.stdout + r.stderr
    assert "joined " in log and "exported " in log, log
    assert (work / "tiny.gguf").read_bytes() == gguf.read_bytes()
    assert (work / "ckpt-tiny" / "config.json").is_file()
    for target in ("0.01", "0.5"):  # step 3b: one calibrated config per target, loadable, back in $OUT
        cal = work / "results" / f"cpe_calibrated_tiny_t{target}.yaml"
        assert cal.is_file(), log
        assert (tmp_path / "out" / cal.name).is_file()
        import prhs_hf
        assert prhs_hf.load_config(cal).psaw is not None


def test_gpu_plan_counts_the_working_tree_against_the_carry_limit(tmp_path, monkeypatch) -> None:
    """Each device call takes the checkout too: pieces that fit alone but not beside the tree are refused."""
    manifest, pieces, small = _pack(tmp_path, 2)
    monkeypatch.setattr(pack_for_gpu, "REPO", tmp_path)
    calls = pack_for_gpu.plan_calls("m", manifest, pieces, small, [])
    pack_for_gpu._check_sizes(calls, tree_bytes=0)
    with pytest.raises(SystemExit, match="working tree"):
        pack_for_gpu._check_sizes(calls, tree_bytes=(pack_for_gpu.CARRY_LIMIT_MIB - 2) * gpu_transfer.MiB)
    assert pack_for_gpu.working_tree_bytes(REPO) > 0
