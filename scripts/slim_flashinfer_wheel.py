#!/usr/bin/env python
"""Shrink a flashinfer-python wheel to what its dense decode path needs, for the GPU machine.

flashinfer-python 0.7.2.post1 is a 62 MB wheel (426 MB unpacked), and everything one device call
carries (the working tree and the wheels) must stay under 64 MiB. Its dense decode and prefill
kernels are JIT-compiled from the top-level ``flashinfer/data/csrc/*.cu`` / ``*.jinja`` files and
the headers in ``data/include``, ``data/cutlass``, ``data/cccl`` and ``data/spdlog``; the
subfolders of ``data/csrc`` (MoE, MLA, GDN, Blackwell and other kernels' sources, ~240 MB) are not
used by them. This writes a copy of the wheel without those subfolders, with a consistent RECORD,
under the same file name (pip installs it with ``--no-deps`` as usual):

    python scripts/slim_flashinfer_wheel.py .whl/flashinfer_python-0.7.2.post1-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

#: members under this prefix, one folder or more below it, are dropped
CSRC = "flashinfer/data/csrc/"


def keep(name: str) -> bool:
    """False for files inside a subfolder of ``flashinfer/data/csrc`` (kernel sources of other ops)."""
    return not (name.startswith(CSRC) and "/" in name[len(CSRC):])


def slim(src: Path, dst: Path) -> tuple[int, int]:
    """Write ``src`` without the dropped members to ``dst``; returns (members kept, members dropped)."""
    kept = dropped = 0
    tmp = dst.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        names = zin.namelist()
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record is None:
            raise ValueError(f"{src}: no .dist-info/RECORD, not a wheel")
        for name in names:
            if name == record:
                continue
            if not keep(name):
                dropped += 1
                continue
            zout.writestr(zin.getinfo(name), zin.read(name))
            kept += 1
        lines = [ln for ln in zin.read(record).decode().splitlines() if ln and keep(ln.split(",", 1)[0])]
        zout.writestr(record, "\n".join(lines) + "\n")
    tmp.replace(dst)
    return kept, dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="the flashinfer_python-*.whl to shrink (rewritten in place)")
    args = ap.parse_args(argv)
    if not args.wheel.name.startswith("flashinfer_python-"):
        print(f"{args.wheel}: expected a flashinfer_python-*.whl", file=sys.stderr)
        return 2
    before = args.wheel.stat().st_size
    kept, dropped = slim(args.wheel, args.wheel)
    after = args.wheel.stat().st_size
    print(f"{args.wheel}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({kept} members kept, {dropped} dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
