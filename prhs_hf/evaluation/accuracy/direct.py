"""GSM8K and CoQA accuracy without lm-eval: prompts, batched greedy generation and scoring.

For machines without lm-eval or ``datasets`` (the GPU machine). The prompts come from
:mod:`prhs_hf.evaluation.lm_eval.prompts` and the scores from :mod:`prhs_hf.evaluation.lm_eval.metrics` (pure Python,
importing neither lm-eval nor ``datasets``), the same code the lm-eval tasks
``gsm8k_chat_local``, ``gsm8k_cot_local`` and ``coqa_local`` run, and the generation follows
lm-eval's ``HFLM``: left padding, no special tokens added to the prompt (the chat template brings
its own), greedy, new tokens decoded without special tokens.

- ``gsm8k``: the zero-shot chat prompt (:func:`prhs_hf.evaluation.lm_eval.prompts.gsm8k_chat_prompt` in the tokenizer's chat
  template), 384 new tokens, scored ``strict-match`` (``The answer is N.``) and ``flexible-extract``
  (the last number).
- ``gsm8k_cot``: lm-eval's 8-shot ``gsm8k-cot`` completion prompt (:func:`prhs_hf.evaluation.lm_eval.prompts.gsm8k_cot_prompt`,
  no chat template; 726–891 tokens, mean 764, with the Qwen2.5 tokenizer: a longer context for
  the retrieval ratio), 256 new tokens, generation stopped and cut at ``gsm8k-cot``'s ``until``
  strings (:data:`prhs_hf.evaluation.lm_eval.prompts.GSM8K_COT_STOP`), scored like ``gsm8k``.
- ``coqa``: lm-eval's completion prompt (no chat template), scored ``em``/``f1`` on the first line.
  Generation stops once that line is complete (:func:`prhs_hf.evaluation.lm_eval.prompts.coqa_answer_done`), which cannot
  change the answer lm-eval would score from its up to 256 tokens.
- ``ruler_<task>_<length>`` (:func:`task_named`): a RULER task of :mod:`prhs_hf.evaluation.ruler` at one
  prepared length, read from ``ruler_<task>_<length>.jsonl`` in the data folder; completion prompt
  (``input`` then ``gen_prefix``), lm-eval's ``max_gen_toks``, no stop string, ``string_match_all``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

from prhs_hf.evaluation.lm_eval import metrics, prompts

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DirectTask", "DIRECT_TASKS", "DirectResult", "Generation", "batches", "task_named",
           "ruler_task_names", "build_prompt", "first_logits_clock", "generate", "evaluate"]

Doc = Mapping[str, Any]


@dataclass(frozen=True)
class DirectTask:
    """How one data set is prompted, generated and scored.

    ``lm_eval_task`` names the task in ``tasks/`` that does the same through lm-eval (with
    ``--apply_chat_template`` when ``chat``). ``until``: lm-eval's stop strings; generation stops
    once one appears and the text is cut before the first one (as lm-eval's ``generate_until``).
    ``done``: another early stop that must not change the score. ``load(data_dir, limit)``: how the
    docs are read (None: the registered data set ``dataset`` through :func:`prhs_hf.evaluation.lm_eval.data.load_rows`).
    ``lm_eval_metadata``: task metadata the lm-eval task needs besides ``data_dir``.
    """

    name: str
    dataset: str
    chat: bool
    max_new_tokens: int
    prompt: Callable[[Doc], str]
    score: Callable[[Doc, str], dict[str, float]]
    lm_eval_task: str
    done: Callable[[str], bool] | None = None
    until: tuple[str, ...] = ()
    load: Callable[[str | None, int | None], list[dict[str, Any]]] | None = None
    lm_eval_metadata: Mapping[str, Any] | None = None

    def finished(self) -> Callable[[str], bool] | None:
        """When a row's generation may stop: ``done``, or one of ``until`` has appeared (None: never early)."""
        until, done = tuple(s for s in self.until if s), self.done
        if not until:
            return done
        return lambda text: any(s in text for s in until) or (done is not None and done(text))

    def cut(self, generation: str) -> str:
        """The generation lm-eval would score: the text before the first ``until`` string."""
        return prompts.cut_at_stop(generation, self.until)


def _score_gsm8k(doc: Doc, generation: str) -> dict[str, float]:
    return metrics.gsm8k_scores(generation, str(doc["answer"]), metrics.GSM8K_COT_FILTERS)


def _score_coqa(doc: Doc, generation: str) -> dict[str, float]:
    return metrics.coqa_scores(prompts.coqa_golds(doc), prompts.coqa_prediction(generation))


DIRECT_TASKS: dict[str, DirectTask] = {
    "gsm8k": DirectTask("gsm8k", "gsm8k", chat=True, max_new_tokens=384, prompt=prompts.gsm8k_chat_prompt,
                        score=_score_gsm8k, lm_eval_task="gsm8k_chat_local"),
    "gsm8k_cot": DirectTask("gsm8k_cot", "gsm8k", chat=False, max_new_tokens=256, prompt=prompts.gsm8k_cot_prompt,
                            score=_score_gsm8k, lm_eval_task="gsm8k_cot_local", until=prompts.GSM8K_COT_STOP),
    "coqa": DirectTask("coqa", "coqa", chat=False, max_new_tokens=256, prompt=prompts.coqa_prompt,
                       score=_score_coqa, lm_eval_task="coqa_local", done=prompts.coqa_answer_done),
}


def _ruler_direct_task(name: str) -> DirectTask | None:
    """``ruler_<task>_<length>`` as a :class:`DirectTask`, or None if ``name`` is not of that form."""
    from prhs_hf.evaluation import ruler as lc

    head, sep, length = name.rpartition("_")
    if not (sep and length.isdigit() and head.startswith("ruler_") and head[len("ruler_"):] in lc.RULER_TASKS):
        return None
    task, n = lc.RULER_TASKS[head[len("ruler_"):]], int(length)
    return DirectTask(name, task.direct_name(n), chat=False, max_new_tokens=task.max_new_tokens,
                      prompt=lc.prompt_text, score=lc.score, lm_eval_task=task.lm_eval_task,
                      load=lambda data_dir, limit: lc.load_prepared(task, [n], data_dir, limit),
                      lm_eval_metadata={"max_seq_lengths": [n]})


def task_named(name: str) -> DirectTask:
    """The task ``name``: one of :data:`DIRECT_TASKS`, or ``ruler_<task>_<length>`` (a RULER task of
    :data:`prhs_hf.evaluation.ruler.RULER_TASKS` at a prepared length)."""
    task = DIRECT_TASKS.get(name) or _ruler_direct_task(name)
    if task is None:
        from prhs_hf.evaluation import ruler as lc

        raise ValueError(f"unknown task {name!r}; known: {', '.join(DIRECT_TASKS)}, ruler_<task>_<length> with task "
                         f"one of {', '.join(lc.RULER_TASKS)}, or ruler (every prepared file in the data folder)")
    return task


def ruler_task_names(data_dir: str | None = None) -> list[str]:
    """``ruler_<task>_<length>`` of every RULER file prepared in ``data_dir`` (or ``$PRHS_HF_DATA_DIR``)."""
    from prhs_hf.evaluation import ruler as lc

    names = [task.direct_name(length) for task, length in lc.prepared(data_dir)]
    if not names:
        raise FileNotFoundError(f"no RULER file (ruler_<task>_<length>.jsonl) in {lc.data_folder(data_dir)}; "
                                f"prepare them with `prhs-hf ruler prepare --model NAME --out DIR`")
    return names


@dataclass
class DirectResult:
    """One task on one model: mean scores, examples, generation time and the per-example records.

    ``prefill_seconds``: the prefill time summed over the batches (each :attr:`Generation.prefill_seconds`),
    part of ``seconds``; ``prompt_tokens``: the real (unpadded) prompt tokens those batches prefilled.
    None where not measured.
    """

    metrics: dict[str, float]
    n: int
    seconds: float
    new_tokens: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    prefill_seconds: float | None = None
    prompt_tokens: int | None = None


class Generation(NamedTuple):
    """One batch of :func:`generate`: the decoded new text per row, the new tokens, the batch's prefill
    time (seconds from just before ``model.generate`` to its first logits, device synchronised) and
    the real prompt tokens it prefilled (padding not counted)."""

    texts: list[str]
    new_tokens: int
    prefill_seconds: float
    prompt_tokens: int


def build_prompt(tokenizer: "PreTrainedTokenizerBase", task: DirectTask, doc: Doc) -> str:
    """The text fed to the model: the task's prompt, in the chat template when the task is a chat task
    and the tokenizer has one."""
    text = task.prompt(doc)
    if task.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return text


def _stop_ids(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase") -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _text_stop(tokenizer: "PreTrainedTokenizerBase", start: int, done: Callable[[str], bool]):
    from transformers import StoppingCriteria
    import torch

    class TextDone(StoppingCriteria):
        """Per row: stop when ``done`` holds for the text generated so far."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            texts = tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
            return torch.tensor([done(t) for t in texts], dtype=torch.bool, device=input_ids.device)

    return TextDone()


def first_logits_clock(model: "PreTrainedModel", on_call: Callable[[], None] | None = None) -> "LogitsProcessor":
    """A ``transformers.LogitsProcessor`` that reads the clock at its first call and changes nothing.

    ``model.generate`` calls its logits processors once per new token, the first time with the logits
    of the prefill forward: at that call the device of ``model`` is synchronised (CUDA only) and
    ``time.perf_counter()`` kept in the processor's ``first`` (None until then). ``on_call`` (e.g. a
    progress bar's update) runs at every call. The scores come back unchanged (the same tensor), so
    decoding is not affected.
    """
    import torch
    from transformers import LogitsProcessor

    class FirstLogitsClock(LogitsProcessor):
        first: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.first is None:
                _synchronize(model)
                self.first = time.perf_counter()
            if on_call is not None:
                on_call()
            return scores

    return FirstLogitsClock()


def generate(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", texts: Sequence[str],
             max_new_tokens: int, done: Callable[[str], bool] | None = None) -> Generation:
    """Greedy continuations of ``texts`` as one left-padded batch, with the batch's prefill time.

    The prefill time runs from just before ``model.generate`` (device synchronised) to its first
    logits (:func:`first_logits_clock`): the prompt's forward and generate's own setup, not the first
    token's sampling. ``prompt_tokens`` counts the real prompt tokens (attention mask), not padding.
    A tokenizer without a pad token gets its UNK, else its EOS, as pad token (as lm-eval's ``HFLM`` does).
    """
    import torch
    from transformers import LogitsProcessorList, StoppingCriteriaList

    if tokenizer.pad_token_id is None:  # lm-eval's rule (models/utils.py configure_pad_token): UNK, else EOS
        tokenizer.pad_token = tokenizer.unk_token if tokenizer.unk_token is not None else tokenizer.eos_token
    pad = tokenizer.pad_token_id
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = saved_side
    prompt_tokens = int(enc["attention_mask"].sum())
    enc = enc.to(model.device)
    start = enc["input_ids"].shape[1]
    stopping = StoppingCriteriaList([_text_stop(tokenizer, start, done)]) if done else None
    clock = first_logits_clock(model)
    with torch.inference_mode():
        _synchronize(model)
        began = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=pad, eos_token_id=_stop_ids(model, tokenizer) or None,
                             stopping_criteria=stopping, logits_processor=LogitsProcessorList([clock]))
    if clock.first is None:  # no logits (no new token): the whole call is the prefill
        _synchronize(model)
        clock.first = time.perf_counter()
    new = out[:, start:]
    n_new = int((new != pad).sum())
    return Generation(tokenizer.batch_decode(new, skip_special_tokens=True), n_new, clock.first - began,
                      prompt_tokens)


def batches(lengths: Sequence[int], batch_size: int, batch_tokens: int | None = None) -> list[list[int]]:
    """Doc indices in generation batches: longest prompts first, at most ``batch_size`` docs a batch
    and, with ``batch_tokens``, at most that many padded prompt tokens (docs x the batch's longest
    prompt; a prompt longer than ``batch_tokens`` goes alone)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    if batch_tokens is not None and batch_tokens < 1:
        raise ValueError(f"batch_tokens={batch_tokens}: expected >= 1 or None")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    b = 0
    while b < len(order):
        size = batch_size
        if batch_tokens is not None:
            size = max(1, min(size, batch_tokens // max(1, lengths[order[b]])))
        out.append(order[b:b + size])
        b += size
    return out


def evaluate(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", task: DirectTask, docs: Sequence[Doc],
             batch_size: int, max_new_tokens: int | None = None,
             on_batch: Callable[[int], None] | None = None, batch_tokens: int | None = None) -> DirectResult:
    """Generate for every doc (longest prompts first, :func:`batches` of ``batch_size`` docs and at most
    ``batch_tokens`` padded prompt tokens) and score them.

    ``on_batch(n)`` is called after each batch with the number of docs done in it (a progress bar).
    The result's ``metrics`` are the means of the per-doc scores, ``samples`` the per-doc records in
    doc order (generations cut at the task's ``until`` strings), ``prefill_seconds`` and
    ``prompt_tokens`` the sums of the batches' (:class:`Generation`; real prompt tokens, no padding).
    """
    texts = [build_prompt(tokenizer, task, doc) for doc in docs]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    generations: list[str] = [""] * len(docs)
    new_tokens, prefill_seconds, prompt_tokens = 0, 0.0, 0
    limit = task.max_new_tokens if max_new_tokens is None else max_new_tokens
    start = time.perf_counter()
    for batch in batches(lengths, batch_size, batch_tokens):
        gen = generate(model, tokenizer, [texts[i] for i in batch], limit, task.finished())
        new_tokens += gen.new_tokens
        prefill_seconds += gen.prefill_seconds
        prompt_tokens += gen.prompt_tokens
        for i, text in zip(batch, gen.texts):
            generations[i] = task.cut(text)
        if on_batch is not None:
            on_batch(len(batch))
    _synchronize(model)
    seconds = time.perf_counter() - start
    samples = [{"index": i, "prompt_tokens": lengths[i], "generation": generations[i],
                "scores": task.score(doc, generations[i])} for i, doc in enumerate(docs)]
    names = list(samples[0]["scores"]) if samples else []
    means = {k: sum(s["scores"][k] for s in samples) / len(samples) for k in names}
    return DirectResult(means, len(docs), seconds, new_tokens, samples, prefill_seconds=prefill_seconds,
                        prompt_tokens=prompt_tokens)


def _synchronize(model: "PreTrainedModel") -> None:
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
