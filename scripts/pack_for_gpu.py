#!/usr/bin/env python
"""Prepare ``.xfer/`` for an accuracy run on the GPU machine, and print the device calls to make.

The GPU machine has no internet, no lm-eval, no ``datasets`` and no ``gguf``, and each device call
carries at most 64 MiB (files left there by earlier calls stay while the machine is warm). This
script writes, under ``.xfer/`` (git-ignored through ``.git/info/exclude``):

- ``data/gsm8k_test.jsonl.gz``, ``data/coqa_validation.jsonl.gz``: the converted data sets;
- ``models/<name>/<file>.gguf.NNN`` + ``MANIFEST.json``: the model's GGUF in pieces
  (:func:`prhs_hf.fetch.split_for_transfer`; ``join_pieces`` checks every sha256 there);
- ``whl/gguf-<version>-py3-none-any.whl``: the ``gguf`` wheel (pure Python) for Python 3.12;
- ``PLAN.md``: the device calls, also printed: one per piece (the first also carries the data,
  wheel and manifest), then ``scripts/gpu_join_and_eval.sh`` runs (join, export, evaluate).

Example::

    python scripts/pack_for_gpu.py --model qwen2.5-coder-1.5b -- --configs dense,cis-s16,cpe --limit 500
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

from prhs_hf import fetch

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT_MIB = 64
MAX_CARRY_PATHS = 8


@dataclass(frozen=True)
class DeviceCall:
    """One ``run`` of the device tool: what it carries and what it runs."""

    carry: list[str]
    command: str
    timeout_s: int


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script; arguments after ``--`` go to ``run_accuracy.py`` on the GPU."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(fetch.MODELS),
                   help="registered model to bring (default qwen2.5-coder-1.5b)")
    p.add_argument("--xfer", default=str(REPO / ".xfer"), help="transfer folder (default <repo>/.xfer)")
    p.add_argument("--piece-mib", type=float, default=60)
    p.add_argument("--gguf-version", default=None, help="gguf wheel version (default: the installed one)")
    p.add_argument("run_accuracy_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for run_accuracy.py on the GPU (e.g. --configs … --limit …)")
    return p


def pack_data(xfer: Path) -> list[Path]:
    """Gzip the converted GSM8K and CoQA files into ``xfer/data`` (fetched into the cache first if needed)."""
    out = xfer / "data"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("gsm8k", "coqa"):
        src = fetch.fetch_dataset(name)
        dst = out / f"{src.name}.gz"
        if not dst.is_file() or dst.stat().st_mtime < src.stat().st_mtime:
            with src.open("rb") as fin, gzip.open(dst, "wb", compresslevel=9) as fout:
                shutil.copyfileobj(fin, fout)
        paths.append(dst)
    return paths


def pack_model(xfer: Path, name: str, piece_mib: float) -> tuple[Path, list[Path]]:
    """Split the model's GGUF into ``xfer/models/<name>``; reuse pieces whose manifest matches."""
    gguf = fetch.fetch_model(name)
    folder = xfer / "models" / name
    manifest = folder / "MANIFEST.json"
    if manifest.is_file():
        known = json.loads(manifest.read_text())
        pieces = [folder / p["file"] for p in known["pieces"]]
        if (known["name"] == gguf.name and known["size"] == gguf.stat().st_size
                and all(p.is_file() for p in pieces)
                and max(p["size"] for p in known["pieces"]) <= int(piece_mib * fetch.MiB)):
            return manifest, pieces
        shutil.rmtree(folder)
    return manifest, fetch.split_for_transfer(gguf, folder, piece_mib)


def pack_wheel(xfer: Path, version: str | None) -> Path:
    """Download the ``gguf`` wheel for CPython 3.12 / manylinux x86_64 into ``xfer/whl``."""
    version = version or metadata.version("gguf")
    out = xfer / "whl"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("gguf-*.whl"):
        if not old.name.startswith(f"gguf-{version}-"):
            old.unlink()
    existing = sorted(out.glob(f"gguf-{version}-*.whl"))
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux2014_x86_64", "-d", str(out), f"gguf=={version}"]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return sorted(out.glob(f"gguf-{version}-*.whl"))[0]


def _rel(path: Path) -> str:
    return str(path.resolve().relative_to(REPO))


def plan_calls(model: str, manifest: Path, pieces: Sequence[Path], small: Sequence[Path],
               run_args: Sequence[str]) -> list[DeviceCall]:
    """The device calls: pieces one per call (the first with ``small``), then join + evaluate."""
    calls = []
    for i, piece in enumerate(pieces):
        carry = ([_rel(p) for p in small] if i == 0 else []) + [_rel(piece)]
        check = (f"grep -q \"$(sha256sum {_rel(piece)} | cut -c1-64)\" {_rel(manifest)} "
                 f"&& echo 'piece {i + 1}/{len(pieces)} ok' && ls .xfer/models/{model} | wc -l")
        calls.append(DeviceCall(carry, check, 120))
    run = shlex.join(["bash", "scripts/gpu_join_and_eval.sh", model, *run_args])
    calls.append(DeviceCall([], run, 600))
    return calls


def _check_sizes(calls: Sequence[DeviceCall]) -> None:
    for call in calls:
        size = sum((REPO / c).stat().st_size if (REPO / c).is_file()
                   else sum(f.stat().st_size for f in (REPO / c).rglob("*") if f.is_file()) for c in call.carry)
        if size > (CARRY_LIMIT_MIB - 2) * fetch.MiB or len(call.carry) > MAX_CARRY_PATHS:
            raise SystemExit(f"a call would carry {size / fetch.MiB:.1f} MiB in {len(call.carry)} paths; "
                             f"use a smaller --piece-mib")


def render_plan(model: str, calls: Sequence[DeviceCall]) -> str:
    """The calls as Markdown, ready to paste into device ``run`` calls."""
    lines = [f"# Device calls for the accuracy run of {model}", "",
             "Make them back to back (the machine goes back after ~30 s idle; a fresh one starts bare).",
             "Repeat the last call until no row is left (its output says so): it resumes, and each call stops in time.", ""]
    for i, call in enumerate(calls, 1):
        lines.append(f"{i}. run(kind=\"nvidia-h200\", timeout_s={call.timeout_s}, carry={json.dumps(call.carry)},")
        lines.append(f"      command={json.dumps(call.command)})")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Pack ``.xfer/`` and print the plan."""
    args = build_parser().parse_args(argv)
    run_args = [a for a in args.run_accuracy_args if a != "--"] if args.run_accuracy_args else []
    xfer = Path(args.xfer).resolve()
    data = pack_data(xfer)
    manifest, pieces = pack_model(xfer, args.model, args.piece_mib)
    wheel = pack_wheel(xfer, args.gguf_version)
    sha_file = manifest.parent / f"{json.loads(manifest.read_text())['name']}.sha256"
    calls = plan_calls(args.model, manifest, pieces, [xfer / "data", xfer / "whl", manifest, sha_file], run_args)
    _check_sizes(calls)
    plan = render_plan(args.model, calls)
    (xfer / "PLAN.md").write_text(plan)
    total = sum(p.stat().st_size for p in pieces)
    print(f"packed {len(pieces)} pieces ({total / fetch.MiB:.1f} MiB), {len(data)} data files, {wheel.name} "
          f"under {xfer}\n", file=sys.stderr)
    print(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
