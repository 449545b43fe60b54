#!/usr/bin/env python3
"""Move a large file to the GPU machine in pieces: a device call carries at most 64 MiB.

Not library code: :mod:`prhs_hf` only fetches and loads models. ``pack_for_gpu.py`` splits a GGUF
here, the device calls carry one piece each, and ``gpu_join_and_eval.sh`` joins them there::

    python tools/gpu_transfer.py split FILE OUT_DIR [--piece-mib 60]
    python3 -P tools/gpu_transfer.py join PIECES_DIR OUT_FILE [--sha256 HEX]

It needs ``prhs_hf`` importable (for the checked copy and :class:`~prhs_hf.hub.registry.Digest`); on
the GPU machine ``gpu_join_and_eval.sh`` puts the assembled package on ``PYTHONPATH`` first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from prhs_hf.hub.registry import ChecksumError, Digest
from prhs_hf.hub.wheels import MiB, copy_chunks, progress_bar

__all__ = ["MANIFEST", "MiB", "split_for_transfer", "join_pieces", "main"]

MANIFEST = "MANIFEST.json"


def split_for_transfer(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    piece_mib: float = 60,
    *,
    progress: bool = True,
) -> list[Path]:
    """Split ``path`` into ``<name>.000``, ``<name>.001`` … of ``piece_mib`` MiB in ``out_dir``.

    Also writes ``MANIFEST.json`` (file name, size, sha256 of the whole and of each piece) and
    ``<name>.sha256`` in ``sha256sum -c`` format. Returns the piece paths in order.

    Raises:
        ValueError: ``piece_mib`` is not positive.
    """
    piece_bytes = int(piece_mib * MiB)
    if piece_bytes <= 0:
        raise ValueError(f"piece_mib must be positive, got {piece_mib}")
    src_path = Path(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = src_path.stat().st_size
    whole = hashlib.sha256()
    pieces: list[dict[str, Any]] = []
    with src_path.open("rb") as src, progress_bar(size, f"splitting {src_path.name}", progress) as bar:
        while len(pieces) * piece_bytes < size or not pieces:
            piece = out / f"{src_path.name}.{len(pieces):03d}"
            piece_hash = hashlib.sha256()
            with piece.open("wb") as dst:
                n = copy_chunks(src, dst, [whole, piece_hash], bar, limit=piece_bytes)
            pieces.append({"file": piece.name, "size": n, "sha256": piece_hash.hexdigest()})
    manifest = {"name": src_path.name, "size": size, "sha256": whole.hexdigest(), "pieces": pieces}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / f"{src_path.name}.sha256").write_text(f"{whole.hexdigest()}  {src_path.name}\n")
    return [out / p["file"] for p in pieces]


def join_pieces(
    pieces_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    sha256: str | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Concatenate the pieces written by :func:`split_for_transfer` into ``out_path`` and verify it.

    The order, sizes and whole-file sha256 come from ``MANIFEST.json``; ``sha256`` overrides the
    manifest's digest. Without a manifest the pieces are ``*.NNN`` files in name order and only a
    given ``sha256`` is checked. On a mismatch nothing is left at ``out_path``.

    Raises:
        ChecksumError: a piece is missing or the joined file does not match.
    """
    folder = Path(pieces_dir)
    manifest_path = folder / MANIFEST
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest:
        names: Sequence[str] = [p["file"] for p in manifest["pieces"]]
    else:
        names = sorted(p.name for p in folder.iterdir() if re.search(r"\.\d{3}$", p.name))
    missing = [n for n in names if not (folder / n).is_file()]
    if missing or not names:
        raise ChecksumError(f"{folder}: missing pieces {missing or '(none found)'}")
    expected = sha256 or manifest.get("sha256")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum((folder / n).stat().st_size for n in names)
    hasher = hashlib.sha256()
    try:
        with out.open("wb") as dst, progress_bar(total, f"joining {out.name}", progress) as bar:
            for n in names:
                with (folder / n).open("rb") as src:
                    copy_chunks(src, dst, [hasher], bar)
        expected_size = int(manifest["size"]) if manifest else total
        Digest(expected_size, sha256=expected).check(str(out), total, hasher.hexdigest())
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``split FILE OUT_DIR [--piece-mib N]`` or ``join PIECES_DIR OUT_FILE [--sha256 HEX]``; prints the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_split = sub.add_parser("split", help="cut FILE into pieces with a sha256 manifest")
    p_split.add_argument("file")
    p_split.add_argument("out_dir")
    p_split.add_argument("--piece-mib", type=float, default=60, help="piece size in MiB (default 60)")
    p_join = sub.add_parser("join", help="join and verify the pieces in PIECES_DIR")
    p_join.add_argument("pieces_dir")
    p_join.add_argument("out_file")
    p_join.add_argument("--sha256", default=None, help="expected sha256 (default: the manifest's)")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            print("\n".join(map(str, split_for_transfer(args.file, args.out_dir, args.piece_mib))))
        else:
            print(join_pieces(args.pieces_dir, args.out_file, args.sha256))
    except (ChecksumError, OSError, ValueError) as exc:
        print(f"gpu_transfer: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
