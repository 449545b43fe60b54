#!/usr/bin/env python
"""Prepare ``.xfer/`` for an accuracy run on the GPU machine, and print the device calls to make.

The GPU machine has no internet, no lm-eval, no ``datasets`` and no ``gguf``, and each device call
carries at most 64 MiB. A path carried by one call is *not* there in the next call unless that call
carries it again (the machine removes it); what lies outside the repository tree, e.g. ``/tmp``,
stays while the machine is warm. So every call copies what it carried to ``/tmp``
(:data:`STAGE`), and ``tools/gpu_join_and_eval.sh`` takes it from there. This script writes,
under ``.xfer/`` (git-ignored through ``.git/info/exclude``):

- ``data/gsm8k_test.jsonl.gz``, ``data/coqa_validation.jsonl.gz``: the converted data sets;
- ``models/<name>/<file>.gguf.NNN`` + ``MANIFEST.json``: the model's GGUF in pieces
  (:func:`gpu_transfer.split_for_transfer`; ``join_pieces`` checks every sha256 there);
- ``whl/gguf-<version>-py3-none-any.whl``: the ``gguf`` wheel (pure Python) for Python 3.12;
- ``PLAN.md``: the device calls, also printed: one per piece, each staging its piece in
  ``/tmp/pieces/<name>`` and checking its sha256 (the first also stages the data, wheel and
  manifest in ``/tmp``); the last one then runs ``tools/gpu_join_and_eval.sh`` (join, export,
  evaluate); then the resume call, which carries nothing and is repeated while rows are left.

Without ``--configs`` after ``--``, the plan names
:data:`prhs_hf.evaluation.accuracy.configs.DEFAULT_CONFIGS` explicitly. ``--plan-only`` rewrites
``PLAN.md`` from what ``.xfer/`` already holds, fetching and cutting nothing.

Example::

    python tools/pack_for_gpu.py --model qwen2.5-coder-1.5b -- --configs dense,cis-s16,cpe --limit 500
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

import gpu_transfer  # beside this script (its folder comes first on sys.path)
from prhs_hf.hub import fetch
from prhs_hf.evaluation.accuracy import configs as accuracy_configs

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT_MIB = 64
MAX_CARRY_PATHS = 8
MAX_COMMAND_CHARS = 2000
#: Outside the repository tree, so it survives between device calls (gpu_join_and_eval.sh's PRHS_STAGE).
STAGE = "/tmp"
#: What the last piece call and the resume call run (relative to the repository root).
GPU_SCRIPT = "tools/gpu_join_and_eval.sh"


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
    p.add_argument("--piece-mib", type=float, default=52,
                   help="piece size (default 52: a call carries 64 MiB with the working tree, ~7 MiB now)")
    p.add_argument("--gguf-version", default=None, help="gguf wheel version (default: the installed one)")
    p.add_argument("--plan-only", action="store_true",
                   help="only rewrite PLAN.md from the data, wheel and pieces already in --xfer")
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
                and max(p["size"] for p in known["pieces"]) <= int(piece_mib * gpu_transfer.MiB)):
            return manifest, pieces
        shutil.rmtree(folder)
    return manifest, gpu_transfer.split_for_transfer(gguf, folder, piece_mib)


def packed(xfer: Path, name: str) -> tuple[list[Path], Path, list[Path], Path]:
    """What an earlier run left in ``xfer``: data files, manifest, pieces and wheel (for ``--plan-only``)."""
    data = sorted((xfer / "data").glob("*.jsonl.gz"))
    manifest = xfer / "models" / name / "MANIFEST.json"
    wheels = sorted((xfer / "whl").glob("gguf-*.whl"))
    if not data or not wheels or not manifest.is_file():
        raise SystemExit(f"--plan-only: {xfer} lacks the data, the gguf wheel or {manifest}; run without it first")
    pieces = [manifest.parent / p["file"] for p in json.loads(manifest.read_text())["pieces"]]
    missing = [p.name for p in pieces if not p.is_file()]
    if missing:
        raise SystemExit(f"--plan-only: pieces missing in {manifest.parent}: {missing}")
    return data, manifest, pieces, wheels[-1]


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


def eval_args(run_args: Sequence[str]) -> list[str]:
    """``run_args`` with ``--configs`` set to the current default list when they do not name one."""
    if any(a == "--configs" or a.startswith("--configs=") for a in run_args):
        return list(run_args)
    return ["--configs", ",".join(accuracy_configs.DEFAULT_CONFIGS), *run_args]


def eval_command(model: str, run_args: Sequence[str]) -> str:
    """The shell command that joins, exports and evaluates (it finds what earlier calls staged)."""
    return shlex.join(["bash", GPU_SCRIPT, model, *eval_args(run_args)])


def plan_calls(model: str, manifest: Path, pieces: Sequence[Path], small: Sequence[Path],
               run_args: Sequence[str]) -> list[DeviceCall]:
    """The device calls: one per piece, each copying what it carries to :data:`STAGE`.

    The first call also carries ``small`` (data and wheel folders go to ``/tmp/<folder>``; files
    that lie next to the pieces, the manifest and the ``.sha256``, go with the pieces into
    ``/tmp/pieces/<model>``). Every call checks its piece's sha256 against the staged manifest; the
    last one then runs :func:`eval_command`. See :func:`resume_call` for the calls after it.
    """
    stage = shlex.quote(f"{STAGE}/pieces/{model}")
    folder = manifest.parent
    calls = []
    for i, piece in enumerate(pieces):
        steps = [f"mkdir -p {stage}"]
        if i == 0:
            dirs = [shlex.quote(_rel(p)) for p in small if p.resolve().parent != folder.resolve()]
            files = [shlex.quote(_rel(p)) for p in small if p.resolve().parent == folder.resolve()]
            if dirs:
                steps.append(f"cp -r {' '.join(dirs)} {STAGE}/")
            files.append(shlex.quote(_rel(piece)))
            steps.append(f"cp {' '.join(files)} {stage}/")
        else:
            steps.append(f"cp {shlex.quote(_rel(piece))} {stage}/")
        name = shlex.quote(piece.name)
        steps.append(f"(cd {stage} && grep -q \"$(sha256sum {name} | cut -c1-64)\" MANIFEST.json) "
                     f"|| {{ echo 'piece {i + 1}/{len(pieces)}: staging or sha256 check failed "
                     f"(no staged manifest: machine restarted?): start again at call 1'; exit 1; }}")
        steps.append(f"echo \"piece {i + 1}/{len(pieces)} ok, $(ls {stage} | wc -l) files staged\"")
        last = i == len(pieces) - 1
        if last:
            steps.append(eval_command(model, run_args))
        calls.append(DeviceCall([_rel(p) for p in small] + [_rel(piece)] if i == 0 else [_rel(piece)],
                                " && ".join(steps), 600 if last else 120))
    return calls


def resume_call(model: str, run_args: Sequence[str]) -> DeviceCall:
    """The call that continues the evaluation: it carries nothing; gpu_join_and_eval.sh re-stages from /tmp."""
    return DeviceCall([], eval_command(model, run_args), 600)


def working_tree_bytes(repo: Path = REPO) -> int:
    """What every device call takes besides its carry: the tracked and the untracked, not ignored
    files of the checkout (it grows with the committed results, so a piece size that fit once
    stops fitting)."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=repo, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def _check_sizes(calls: Sequence[DeviceCall], tree_bytes: int) -> None:
    for call in calls:
        size = sum((REPO / c).stat().st_size if (REPO / c).is_file()
                   else sum(f.stat().st_size for f in (REPO / c).rglob("*") if f.is_file()) for c in call.carry)
        if size + tree_bytes > (CARRY_LIMIT_MIB - 2) * gpu_transfer.MiB or len(call.carry) > MAX_CARRY_PATHS:
            raise SystemExit(f"a call would carry {size / gpu_transfer.MiB:.1f} MiB in {len(call.carry)} paths "
                             f"beside the {tree_bytes / gpu_transfer.MiB:.1f} MiB working tree (the device takes "
                             f"{CARRY_LIMIT_MIB} MiB in all); cut the model again with a smaller --piece-mib")
        if len(call.command) >= MAX_COMMAND_CHARS:
            raise SystemExit(f"a call's command has {len(call.command)} characters (the device takes fewer than "
                             f"{MAX_COMMAND_CHARS}); pass fewer arguments after --")


def _render_call(label: str, call: DeviceCall) -> list[str]:
    return [f"{label} run(kind=\"nvidia-h200\", timeout_s={call.timeout_s}, carry={json.dumps(call.carry)},",
            f"      command={json.dumps(call.command)})"]


def render_plan(model: str, calls: Sequence[DeviceCall], resume: DeviceCall | None = None) -> str:
    """The calls as Markdown, ready to paste into device ``run`` calls."""
    lines = [f"# Device calls for the accuracy run of {model}", "",
             "Make them back to back (the machine goes back after ~30 s idle; a fresh one starts bare).",
             "A carried path is gone in the next call unless that call carries it again, so each call",
             f"copies what it carries to {STAGE} (kept while the machine is warm). If a call says the",
             "manifest is missing, the machine was restarted: start again at call 1.",
             f"Call {len(calls)} stages the last piece, then joins, exports and evaluates.", ""]
    for i, call in enumerate(calls, 1):
        lines += _render_call(f"{i}.", call)
    if resume is not None:
        lines += ["", "While the output ends with rows left, repeat this call (it carries nothing; "
                  f"gpu_join_and_eval.sh takes the manifest, data and wheel from {STAGE}, and the joined GGUF "
                  "and checkpoint stay in /tmp/prhs_gpu):", ""]
        lines += _render_call("R.", resume)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Pack ``.xfer/`` (unless ``--plan-only``) and print the plan."""
    args = build_parser().parse_args(argv)
    run_args = [a for a in args.run_accuracy_args if a != "--"] if args.run_accuracy_args else []
    xfer = Path(args.xfer).resolve()
    if args.plan_only:
        data, manifest, pieces, wheel = packed(xfer, args.model)
    else:
        data = pack_data(xfer)
        manifest, pieces = pack_model(xfer, args.model, args.piece_mib)
        wheel = pack_wheel(xfer, args.gguf_version)
    sha_file = manifest.parent / f"{json.loads(manifest.read_text())['name']}.sha256"
    calls = plan_calls(args.model, manifest, pieces, [xfer / "data", xfer / "whl", manifest, sha_file], run_args)
    resume = resume_call(args.model, run_args)
    _check_sizes([*calls, resume], working_tree_bytes())
    plan = render_plan(args.model, calls, resume)
    (xfer / "PLAN.md").write_text(plan)
    total = sum(p.stat().st_size for p in pieces)
    print(f"{'planned' if args.plan_only else 'packed'} {len(pieces)} pieces ({total / gpu_transfer.MiB:.1f} MiB), "
          f"{len(data)} data files, {wheel.name} under {xfer}\n", file=sys.stderr)
    print(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
