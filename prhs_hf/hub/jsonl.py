"""JSON Lines files, the one reader of the package and its scripts (data sets, prompts, samples).

``read_jsonl(path)`` yields ``(line_number, record)`` for every non-blank line of a ``.jsonl`` file
or its gzip'd ``.jsonl.gz`` (by suffix), lazily; a line that is not JSON raises :class:`JSONLError`
naming the file and the line. Callers that need a record of a certain shape check it themselves
and name their own option or data set in the error.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Iterator

__all__ = ["JSONLError", "read_jsonl", "read_jsonl_records"]


class JSONLError(ValueError):
    """A line of a JSON Lines file that is not JSON (the message names the file and the line)."""


def read_jsonl(path: str | os.PathLike[str], *, errors: str = "strict") -> Iterator[tuple[int, Any]]:
    """``(line_number, record)`` of each non-blank line of ``path`` (gzip'd when it ends in ``.gz``),
    lazily, line numbers from 1. ``errors``: how undecodable UTF-8 is handled (``open``'s argument)."""
    p = Path(path)
    opener = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8", errors=errors) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise JSONLError(f"{p}:{number}: not JSON ({exc.msg})") from None


def read_jsonl_records(path: str | os.PathLike[str], limit: int | None = None) -> list[Any]:
    """The first ``limit`` records of ``path`` (all with ``None``), in file order."""
    records: list[Any] = []
    if limit is not None and limit <= 0:
        return records
    for _, record in read_jsonl(path):
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    return records
