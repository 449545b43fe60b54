"""Prompts and references built from GSM8K and CoQA rows (upstream schemas), shared by the lm-eval
tasks in ``tasks/`` and by ``scripts/run_accuracy.py``.

Pure Python. The GSM8K rows are ``openai/gsm8k``'s ``{question, answer}`` (``answer`` ends with
``#### N``); the CoQA rows are ``EleutherAI/coqa``'s stories ``{story, questions, answers,
additional_answers}`` (see :func:`prhs_hf.fetch.convert_coqa`).
"""

from __future__ import annotations

from itertools import zip_longest
from typing import Any, Mapping

__all__ = [
    "GSM8K_CHAT_INSTRUCTION",
    "COQA_STOP",
    "gsm8k_chat_prompt",
    "gsm8k_gold",
    "coqa_prompt",
    "coqa_golds",
    "coqa_prediction",
    "coqa_answer_done",
]

GSM8K_CHAT_INSTRUCTION = "Solve step by step. End with 'The answer is N'."
"""The zero-shot instruction of the chat GSM8K prompt (``shared/design/REAL_MODELS.md``)."""

COQA_STOP = "\nQ:"
"""Where a CoQA answer ends (lm-eval's ``until``)."""


def gsm8k_chat_prompt(doc: Mapping[str, Any]) -> str:
    """The user message of the zero-shot chat GSM8K prompt: the instruction, a blank line, the question."""
    return f"{GSM8K_CHAT_INSTRUCTION}\n\n{doc['question']}"


def gsm8k_gold(doc: Mapping[str, Any]) -> str:
    """The final answer ``N`` of a GSM8K row (the text after ``####``)."""
    return str(doc["answer"]).split("####")[-1].strip()


def coqa_prompt(doc: Mapping[str, Any]) -> str:
    """lm-eval's CoQA prompt: the story, then every question with its answer except the last, whose
    answer the model writes after ``A:``."""
    text = doc["story"] + "\n\n"
    for question, answer in zip_longest(doc["questions"]["input_text"], doc["answers"]["input_text"][:-1]):
        text += f"Q: {question}\n\n" + (f"A: {answer}\n\n" if answer is not None else "A:")
    return text


def coqa_golds(doc: Mapping[str, Any]) -> list[str]:
    """The gold answers of the last turn: the reference answer, then each additional answer that
    differs from those before it (case-insensitively), as lm-eval's ``doc_to_target``."""
    turn = len(doc["questions"]["input_text"])
    golds = [doc["answers"]["input_text"][turn - 1]]
    for extra in (doc.get("additional_answers") or {}).values():
        answer = extra["input_text"][turn - 1]
        if answer.lower() not in map(str.lower, golds):
            golds.append(answer)
    return golds


def coqa_prediction(generation: str) -> str:
    """The answer in a CoQA generation: the text before :data:`COQA_STOP` (lm-eval's ``until``; a no-op
    on lm-eval's already cut generations), stripped, then its first line (lm-eval's ``process_results``)."""
    return generation.split(COQA_STOP)[0].strip().split("\n")[0]


def coqa_answer_done(generation: str) -> bool:
    """Whether more text can no longer change :func:`coqa_prediction`: the stop string has appeared,
    or a line break follows some non-blank text. Lets a generator stop early with the same answer."""
    return COQA_STOP in generation or "\n" in generation.lstrip()
