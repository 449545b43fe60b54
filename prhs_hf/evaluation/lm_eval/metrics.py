"""Scoring of GSM8K and CoQA generations: the one implementation behind the lm-eval tasks and
``scripts/run_accuracy.py``.

Pure Python (no lm-eval, no ``datasets``), so the accuracy runner uses it on machines that have
neither.

GSM8K follows lm-eval 0.4.13's ``gsm8k`` / ``gsm8k-cot`` tasks exactly: a regex filter takes the
answer out of the generation (``strict-match``: the ``#### N`` or ``The answer is N.`` form;
``flexible-extract``: the last number), then ``exact_match`` compares it with the reference after
removing ``,``, ``$``, everything up to ``#### `` and a final ``.``, ignoring case.

CoQA follows lm-eval 0.4.13's ``coqa`` task, whose metric code imported
``transformers.data.metrics.squad_metrics`` (removed in transformers 5): the SQuAD answer
normalisation (lower case, no punctuation, no articles, single spaces), exact match and token F1,
each averaged over leave-one-out subsets of the gold answers.
"""

from __future__ import annotations

import collections
import re
import string
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = [
    "FALLBACK",
    "AnswerPattern",
    "GSM8K_STRICT",
    "GSM8K_COT_STRICT",
    "GSM8K_FLEXIBLE",
    "GSM8K_IGNORE",
    "GSM8K_FILTERS",
    "GSM8K_COT_FILTERS",
    "extract_answer",
    "exact_match",
    "gsm8k_scores",
    "normalize_answer",
    "squad_exact",
    "squad_f1",
    "coqa_scores",
]

FALLBACK = "[invalid]"
"""What a filter returns when its pattern does not match (lm-eval's ``RegexFilter`` default)."""


@dataclass(frozen=True)
class AnswerPattern:
    """A regex answer filter: the match ``group_select`` of ``findall`` (lm-eval's ``RegexFilter``)."""

    regex: str
    group_select: int = 0


GSM8K_STRICT = AnswerPattern(r"#### (\-?[0-9\.\,]+)")
"""``strict-match`` of lm-eval's ``gsm8k``: the number after ``#### ``."""

GSM8K_COT_STRICT = AnswerPattern(r"The answer is (\-?[0-9\.\,]+).")
"""``strict-match`` of lm-eval's ``gsm8k-cot``: the number in ``The answer is N.``."""

GSM8K_FLEXIBLE = AnswerPattern(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
"""``flexible-extract`` of both: the last number-like run in the generation."""

GSM8K_IGNORE: tuple[str, ...] = (",", r"\$", "(?s).*#### ", r"\.$")
"""``regexes_to_ignore`` of the ``exact_match`` metric, applied in this order to both sides."""

GSM8K_FILTERS: Mapping[str, AnswerPattern] = {"strict-match": GSM8K_STRICT, "flexible-extract": GSM8K_FLEXIBLE}
GSM8K_COT_FILTERS: Mapping[str, AnswerPattern] = {"strict-match": GSM8K_COT_STRICT,
                                                  "flexible-extract": GSM8K_FLEXIBLE}


def extract_answer(text: str, pattern: AnswerPattern, fallback: str = FALLBACK) -> str:
    """The answer that ``pattern`` finds in ``text``, stripped, or ``fallback`` (lm-eval ``regex`` filter)."""
    if not isinstance(text, str):
        text = ""
    matches = re.findall(pattern.regex, text)
    if not matches:
        return fallback
    match = matches[pattern.group_select]
    if isinstance(match, tuple):  # several groups: the first non-empty one
        match = next((m for m in match if m), fallback)
    return match.strip()


def _normalise_for_exact_match(text: str, ignore: Sequence[str]) -> str:
    for regex in ignore:
        text = re.sub(regex, "", text)
    return text.lower()


def exact_match(prediction: str, reference: str, ignore: Sequence[str] = GSM8K_IGNORE) -> float:
    """1.0 if ``prediction`` equals ``reference`` once ``ignore`` regexes are removed and case is ignored."""
    return float(_normalise_for_exact_match(prediction, ignore) == _normalise_for_exact_match(reference, ignore))


def gsm8k_scores(generation: str, reference: str,
                 filters: Mapping[str, AnswerPattern] = GSM8K_FILTERS) -> dict[str, float]:
    """``{filter name: exact match}`` of one generation against the reference (the full ``answer``
    ending ``#### N``, or just ``N``)."""
    return {name: exact_match(extract_answer(generation, pattern), reference) for name, pattern in filters.items()}


# ------------------------------------------------------------------------------------- SQuAD / CoQA

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split() if text else []


def squad_exact(gold: str, prediction: str) -> int:
    """1 if the normalised answers are equal, else 0."""
    return int(normalize_answer(gold) == normalize_answer(prediction))


def squad_f1(gold: str, prediction: str) -> float:
    """Token-overlap F1 of the normalised answers; 1/0 by agreement when either has no tokens."""
    gold_tokens, pred_tokens = _tokens(gold), _tokens(prediction)
    if not gold_tokens or not pred_tokens:
        return float(gold_tokens == pred_tokens)
    same = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def coqa_scores(golds: Sequence[str], prediction: str) -> dict[str, float]:
    """CoQA ``{"em", "f1"}`` of ``prediction`` against the gold answers of one turn.

    With several golds, each one is left out in turn and the best score against the others is
    taken; the mean over those is reported (the official CoQA evaluation, as lm-eval does it).
    """
    golds = list(golds)
    if len(golds) > 1:
        subsets = [golds[:i] + golds[i + 1:] for i in range(len(golds))]
    else:
        subsets = [golds]
    em = sum(max(squad_exact(g, prediction) for g in subset) for subset in subsets)
    f1 = sum(max(squad_f1(g, prediction) for g in subset) for subset in subsets)
    n = max(1, len(golds))
    return {"em": em / n, "f1": f1 / n}
