"""Dense against PrHS on one prompt: greedy generations, timed with the prefill apart, shown side by side.

The README's first quick start and ``prhs-hf generate`` use it::

    dense = timed_generate(model, tokenizer, inputs, max_new_tokens=16)
    with prhs_hf.patch(model, "cis", overrides={"policy": {"decode": "sparse"}}):
        prhs = timed_generate(model, tokenizer, inputs, max_new_tokens=16)
    print(side_by_side(dense, prhs))  # both texts, whether they agree, decode tokens/s of each

Importing this module loads neither torch nor transformers (the command line imports it at start-up).
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import time
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["Generation", "CPU_SPEED_NOTE", "display_len", "render_texts", "same_prefix", "side_by_side",
           "timed_generate"]

#: What a decode speed measured on a CPU does not show, in one line (the quick start and the demo print it).
CPU_SPEED_NOTE = ("On a CPU PrHS's selection runs as PyTorch reference ops, slower than dense by design: "
                  "its speed is measured on a GPU (docs/results/README.md).")

_SIDE_BY_SIDE_MIN_WIDTH = 80


@dataclass
class Generation:
    """One greedy generation: the new tokens, their text, the wall time it took, the part of it before
    the first new token's logits (the prefill) and the device type it ran on ("cpu", "cuda")."""

    token_ids: list[int]
    text: str
    seconds: float
    prefill_seconds: float = 0.0
    device: str = "cpu"

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens after the first per second of the decode steps that made them."""
        decode = self.seconds - self.prefill_seconds
        return (len(self.token_ids) - 1) / decode if len(self.token_ids) > 1 and decode > 0 else float("nan")


def timed_generate(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", inputs: dict[str, Any],
                   max_new_tokens: int, progress: str | None = None) -> Generation:
    """``model.generate(**inputs)`` greedily, timed, the prefill apart (the clock is read at the first
    new token's logits; on CUDA after a synchronisation). ``inputs``: the tokenizer's output for one
    prompt. ``progress``: a progress bar of the new tokens on stderr with this label, where stderr is
    a terminal."""
    import torch
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    from prhs_hf.evaluation.accuracy.direct import first_logits_clock

    inputs = dict(inputs)
    if inputs["input_ids"].shape[0] != 1:
        raise ValueError(f"timed_generate: inputs must hold one prompt, got a batch of {inputs['input_ids'].shape[0]}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(total=max_new_tokens, desc=progress, unit="token", file=sys.stderr, leave=False,
               disable=None if progress else True)
    clock = first_logits_clock(model, on_call=lambda: bar.update(1))
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([clock]))
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    prefill = seconds if clock.first is None else clock.first - start
    return Generation(new, tokenizer.decode(new, skip_special_tokens=True), seconds, prefill, out.device.type)


def same_prefix(dense: Generation, prhs: Generation) -> int:
    """How many new tokens the two generations share before they first differ."""
    same = 0
    for a, b in zip(dense.token_ids, prhs.token_ids):
        if a != b:
            break
        same += 1
    return same


def side_by_side(dense: Generation, prhs: Generation, columns: int | None = None) -> str:
    """Both texts (in two columns, or one after the other where ``columns`` is narrow; default: the
    terminal's width), whether PrHS's tokens are dense's, and the decode tokens/s of each, with
    :data:`CPU_SPEED_NOTE` where they ran on a CPU."""
    columns = columns or shutil.get_terminal_size((100, 24)).columns
    same = same_prefix(dense, prhs)
    agree = (f"yes, all {same} new tokens" if same == len(dense.token_ids) == len(prhs.token_ids)
             else f"no, the first {same} of {len(dense.token_ids)} new tokens")
    lines = [render_texts(dense.text, prhs.text, columns), "",
             f"same tokens as dense: {agree}",
             f"decode tokens/s: dense {dense.decode_tokens_per_second:.1f}, PrHS {prhs.decode_tokens_per_second:.1f}"]
    if "cpu" in (dense.device, prhs.device):
        lines.append(CPU_SPEED_NOTE)
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in text.strip().splitlines() or [""]:
        lines.extend(textwrap.wrap(paragraph, width) or [""])
    return lines


def render_texts(dense: str, sparse: str, columns: int) -> str:
    """The two texts in two columns, or one after the other under headings if ``columns`` is narrow."""
    titles = ("dense", "PrHS")
    if columns < _SIDE_BY_SIDE_MIN_WIDTH:
        return "\n\n".join(f"── {t} ──\n" + "\n".join(_wrap(x, columns)) for t, x in zip(titles, (dense, sparse)))
    width = (columns - 3) // 2
    left, right = _wrap(dense, width), _wrap(sparse, width)
    left += [""] * (len(right) - len(left))
    right += [""] * (len(left) - len(right))
    rows = [f"{titles[0]:<{width}} │ {titles[1]}", f"{'─' * width}─┼─{'─' * width}"]
    rows += [f"{a}{' ' * (width - display_len(a))} │ {b}" for a, b in zip(left, right)]
    return "\n".join(rows)


def display_len(text: str) -> int:
    """Columns taken by ``text`` (combining marks, as in ρ̂, take none)."""
    return sum(not unicodedata.combining(c) for c in text)
