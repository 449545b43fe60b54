"""The calibration text: reading ``--text`` and ``--dataset``, and packing it into token prompts.

Both calibrations (``prhs-hf calibrate``, ``prhs-hf calibrate-ds``) read their text here:
:func:`calibration_texts` checks the options and yields the documents lazily, :func:`pack_prompts`
tokenizes them one after another and cuts ``[n, length]`` prompts, each starting with the
tokenizer's own prefix (:func:`special_prefix`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

from ..hub.jsonl import JSONLError, read_jsonl
from .options import CALIBRATION_DATASETS, TEXT_SUFFIXES, CalibrationError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = ["read_texts", "dataset_texts", "calibration_texts", "special_prefix", "pack_prompts"]


def _jsonl_texts(path: Path) -> Iterator[str]:
    try:
        for number, row in read_jsonl(path, errors="replace"):
            if not isinstance(row, Mapping) or not isinstance(row.get("text"), str):
                raise CalibrationError(f"{path}:{number}: expected a JSON object with a \"text\" string field")
            yield row["text"]
    except JSONLError as exc:
        raise CalibrationError(f"{exc}; a .jsonl file needs one object with a \"text\" string per line") from None


def read_texts(path: str | os.PathLike[str]) -> Iterator[str]:
    """The documents of ``--text``: a file (``.jsonl``: the ``"text"`` field of each line; anything
    else: the whole file as plain text) or a folder (its files ending in
    :data:`~prhs_hf.calibration.options.TEXT_SUFFIXES`, recursively, in sorted order). Lazy: only
    what the prompts need is read."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CalibrationError(f"--text: no such file or folder: {p}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CalibrationError(f"--text: {p} holds no file ending in {', '.join(TEXT_SUFFIXES)}")
    else:
        files = [p]
    for f in files:
        if f.suffix.lower() == ".jsonl":
            yield from _jsonl_texts(f)
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def dataset_texts(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """The texts of one of the fetcher's data sets
    (:data:`~prhs_hf.calibration.options.CALIBRATION_DATASETS`), fetched offline."""
    if name not in CALIBRATION_DATASETS:
        raise CalibrationError(f"--dataset: {name!r} is not allowed; allowed: {', '.join(CALIBRATION_DATASETS)}")
    from ..hub.fetch import fetch_dataset

    fields = CALIBRATION_DATASETS[name]
    for _, row in read_jsonl(fetch_dataset(name, cache_dir)):
        yield "\n".join(str(row[f]) for f in fields)


def calibration_texts(text: str | os.PathLike[str] | None, dataset: str | None,
                      cache_dir: str | os.PathLike[str] | None = None,
                      status: Callable[[str], None] = lambda message: None) -> tuple[Iterable[str], str]:
    """The calibration documents of exactly one of ``--text`` (:func:`read_texts`) and ``--dataset``
    (:func:`dataset_texts`, with a warning: they are evaluation data), and a line naming them."""
    if (text is None) == (dataset is None):
        raise CalibrationError(
            "give the calibration text with --text PATH (a plain-text or .jsonl file with a \"text\" field, or a folder "
            f"of {', '.join(TEXT_SUFFIXES)} files), or --dataset {'/'.join(CALIBRATION_DATASETS)}; there is no default, "
            "since the fetcher's data sets (CoQA stories, GSM8K problems) are evaluation data")
    if text is not None:
        if not Path(text).expanduser().exists():
            raise CalibrationError(f"--text: no such file or folder: {text}")
        return read_texts(text), str(text)
    if dataset not in CALIBRATION_DATASETS:
        raise CalibrationError(f"--dataset: {dataset!r} is not allowed; allowed: {', '.join(CALIBRATION_DATASETS)}")
    status(f"warning: {dataset} is evaluation data; a config calibrated on it is not an independent result")
    return (dataset_texts(dataset, cache_dir),
            f"the fetcher's {dataset} data set (evaluation data: calibration and evaluation overlap)")


def special_prefix(tokenizer: "PreTrainedTokenizerBase") -> list[int]:
    """The ids the tokenizer puts before a text (a BOS token), or none."""
    probe = "calibration"
    with_special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    k = len(with_special) - len(plain)
    return list(with_special[:k]) if k > 0 and with_special[k:] == plain else []


def pack_prompts(texts: Iterable[str], tokenizer: "PreTrainedTokenizerBase", length: int, n: int) -> "torch.Tensor":
    """``[n, length]`` token ids: the documents tokenized one after another (EOS between them, or a
    blank line where the tokenizer has none) and cut into prompts, each starting with the
    tokenizer's own prefix (its BOS token, if it adds one)."""
    import torch

    prefix = special_prefix(tokenizer)
    body = length - len(prefix)
    need = n * body
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    for text in texts:
        if len(stream) >= need:
            break
        if text.strip():
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            stream.extend(sep)
    if len(stream) < need:
        raise CalibrationError(
            f"the calibration text has {len(stream)} tokens; --n {n} prompts of --length {length} need {need} "
            f"(give more text with --text, or lower --n or --length)")
    rows = [prefix + stream[k * body:(k + 1) * body] for k in range(n)]
    return torch.tensor(rows, dtype=torch.long)
