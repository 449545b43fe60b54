"""A wheel built from the repository is complete: the shipped configs and the lm-eval task YAMLs
are package data, found after a regular (non-editable) install, and the build has no setuptools
deprecation warnings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # builds and installs a wheel

CHECK = """
import json, sys
import prhs_hf
from prhs_hf.config import shipped_configs
from prhs_hf.evaluation.lm_eval import LOCAL_TASKS, TASKS_DIR, task_manager
from prhs_hf.selectors.double_sparsity import load_label_channels
cfg = prhs_hf.load_config("cis")
ds = prhs_hf.load_config("ds_qwen2.5-coder-1.5b").baseline.label_channels
tasks = task_manager(include_defaults=False).all_tasks
print(json.dumps({"file": prhs_hf.__file__, "tasks_dir": str(TASKS_DIR), "shipped": shipped_configs(),
                  "cis": [cfg.cis.enabled, cfg.psaw.enabled, cfg.etf.enabled],
                  "ds_channels": [ds, list(load_label_channels(ds)[0].shape)],
                  "local_tasks_found": [t for t in LOCAL_TASKS if t in tasks]}))
"""


#: What the build reads (pyproject.toml's package-dir and readme).
SOURCES = ("pyproject.toml", "README.md", "prhs_hf", "configs", "tasks")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel built from a copy of the working tree's sources and the build's output. A copy, because
    setuptools writes build/ and *.egg-info into the source folder: two xdist workers building in the
    checkout at once (each runs this module fixture) removed each other's files (ENOENT in CI)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("prhs_hf-*.whl")
    return wheel, proc.stdout + proc.stderr


def test_wheel_holds_the_configs_and_the_task_yamls(built) -> None:
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/*.pt")]):
        assert f"prhs_hf/configs/{path.name}" in names
    for path in sorted(ROOT.glob("tasks/*.yaml")):
        assert f"prhs_hf/tasks/{path.name}" in names
    assert "prhs_hf/ops/topk/topk_retrieval.py" in names
    for init in sorted((ROOT / "prhs_hf").rglob("__init__.py")):  # every subpackage ships, at any depth
        assert init.relative_to(ROOT).as_posix() in names, init.parent.name
    assert not any(n.startswith(("configs/", "tasks/", "kernels/")) for n in names)  # nothing top-level but prhs_hf


def test_installed_wheel_loads_a_config_by_name_and_finds_the_tasks(built, tmp_path) -> None:
    pytest.importorskip("lm_eval")
    wheel, _ = built
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(target), got["file"]  # the installed copy, not the checkout
    assert Path(got["tasks_dir"]).is_relative_to(target), got["tasks_dir"]
    assert got["shipped"] == sorted(p.stem for p in ROOT.glob("configs/*.yaml"))
    assert got["cis"] == [True, False, False]
    ds_path, ds_shape = got["ds_channels"]  # a shipped YAML's label file, found beside it in the install
    assert Path(ds_path).is_relative_to(target) and ds_shape == [28, 12, 16], got["ds_channels"]
    from prhs_hf.evaluation.lm_eval import LOCAL_TASKS

    assert got["local_tasks_found"] == list(LOCAL_TASKS)


def test_build_has_no_setuptools_deprecation_warnings(built) -> None:
    wheel, output = built
    assert "SetuptoolsDeprecationWarning" not in output and "deprecated" not in output.lower(), output[-3000:]
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/METADATA")
    assert b"License-Expression: Apache-2.0" in metadata
