"""Prompts and references built from GSM8K and CoQA rows (upstream schemas), shared by the lm-eval
tasks in ``tasks/`` and by ``scripts/run_accuracy.py``.

The 8-shot chain-of-thought GSM8K exemplars of lm-eval's ``gsm8k-cot`` live here only:
``tasks/gsm8k_cot_local.yaml`` reads them through :func:`.task_hooks.gsm8k_cot_fewshot`.

Pure Python. The GSM8K rows are ``openai/gsm8k``'s ``{question, answer}`` (``answer`` ends with
``#### N``); the CoQA rows are ``EleutherAI/coqa``'s stories ``{story, questions, answers,
additional_answers}`` (see :func:`prhs_hf.hub.fetch.convert_coqa`).
"""

from __future__ import annotations

from itertools import zip_longest
from typing import Any, Mapping, Sequence

__all__ = [
    "GSM8K_CHAT_INSTRUCTION",
    "GSM8K_COT_EXEMPLARS",
    "GSM8K_COT_STOP",
    "COQA_STOP",
    "gsm8k_chat_prompt",
    "gsm8k_cot_question",
    "gsm8k_cot_prompt",
    "cut_at_stop",
    "gsm8k_gold",
    "coqa_prompt",
    "coqa_golds",
    "coqa_prediction",
    "coqa_answer_done",
]

GSM8K_CHAT_INSTRUCTION = "Solve step by step. End with 'The answer is N'."
"""The zero-shot instruction of the chat GSM8K prompt (``shared/design/REAL_MODELS.md``)."""

GSM8K_COT_EXEMPLARS: tuple[dict[str, str], ...] = tuple({"question": q, "target": t} for q, t in (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. "
     "The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers "
     "were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he "
     "had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
))
"""The 8 ``{question, target}`` exemplars of lm-eval 0.4.13's ``gsm8k-cot`` (``fewshot_config.samples``), verbatim."""

GSM8K_COT_STOP: tuple[str, ...] = ("Q:", "</s>", "<|im_end|>")
"""``until`` of lm-eval 0.4.13's ``gsm8k-cot``: the generation is cut at the first of these (lm-eval
adds the tokenizer's EOS, which ends generation anyway)."""

COQA_STOP = "\nQ:"
"""Where a CoQA answer ends (lm-eval's ``until``)."""


def gsm8k_chat_prompt(doc: Mapping[str, Any]) -> str:
    """The user message of the zero-shot chat GSM8K prompt: the instruction, a blank line, the question."""
    return f"{GSM8K_CHAT_INSTRUCTION}\n\n{doc['question']}"


def gsm8k_cot_question(doc: Mapping[str, Any]) -> str:
    """``gsm8k-cot``'s ``doc_to_text``: ``Q: {question}\\nA:``."""
    return f"Q: {doc['question']}\nA:"


def gsm8k_cot_prompt(doc: Mapping[str, Any]) -> str:
    """lm-eval's 8-shot ``gsm8k-cot`` context (no chat template): each exemplar as
    ``Q: {question}\\nA: {target}`` (target delimiter ``" "``), exemplars and the question joined by
    the few-shot delimiter ``"\\n\\n"``, ending with the question's ``A:``."""
    shots = [f"{gsm8k_cot_question(ex)} {ex['target']}" for ex in GSM8K_COT_EXEMPLARS]
    return "\n\n".join([*shots, gsm8k_cot_question(doc)])


def cut_at_stop(generation: str, stop: Sequence[str]) -> str:
    """The generation before the first occurrence of any stop string (lm-eval's ``until`` post-processing,
    applied in order: ``generation.split(term)[0]`` for each term)."""
    for term in stop:
        if term:
            generation = generation.split(term)[0]
    return generation


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
