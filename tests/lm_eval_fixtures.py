"""A tiny offline checkpoint and a handful of GSM8K / CoQA rows for the lm-eval and accuracy tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Small enough that the test prompts (well over 28 tokens) decode sparsely.
SMALL_BUDGET = {"budget": {"sink": 4, "local": 8, "topk": 16}}

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have now?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs are in 5 boxes?",
     "answer": "5 boxes hold 5 * 12 = <<5*12=60>>60 eggs.\n#### 60"},
    {"question": "Ann had $1,250 and spent $250 on a bike. How many dollars does she have left?",
     "answer": "She has 1,250 - 250 = <<1250-250=1000>>1,000 dollars.\n#### 1,000"},
    {"question": "A train travels 60 miles per hour for 2 hours. How far does it go?",
     "answer": "It goes 60 * 2 = <<60*2=120>>120 miles.\n#### 120"},
]


def _coqa(story_id: str, story: str, turns: list[tuple[str, str, list[str]]]) -> dict:
    ids = list(range(1, len(turns) + 1))
    return {
        "id": story_id, "source": "test", "story": story,
        "questions": {"input_text": [q for q, _, _ in turns], "turn_id": ids},
        "answers": {"input_text": [a for _, a, _ in turns], "turn_id": ids},
        "additional_answers": {str(k): {"input_text": [extra[k] for _, _, extra in turns], "turn_id": ids}
                               for k in range(3)},
    }


COQA_ROWS = [
    _coqa("s1", "Cotton was a little white kitten who lived in a barn with her mother and five sisters.",
          [("What color was Cotton?", "white", ["white", "White", "white kitten"]),
           ("Where did she live?", "in a barn", ["a barn", "in a barn", "barn"])]),
    _coqa("s2", "The old lighthouse stood on a rock. Every night the keeper climbed its ninety steps to light the lamp.",
          [("What stood on the rock?", "the old lighthouse", ["a lighthouse", "lighthouse", "the lighthouse"]),
           ("Who climbed the steps?", "the keeper", ["keeper", "the keeper", "its keeper"]),
           ("How many steps?", "ninety", ["90", "ninety steps", "ninety"])]),
    _coqa("s3", "Mia planted tomatoes in May. By August the plants were taller than her.",
          [("What did Mia plant?", "tomatoes", ["tomatoes", "tomato plants", "Tomatoes"])]),
]


def write_local_data(folder: Path) -> Path:
    """``gsm8k_test.jsonl`` and ``coqa_validation.jsonl`` (the names prhs_hf.hub.fetch writes) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("gsm8k_test.jsonl", GSM8K_ROWS), ("coqa_validation.jsonl", COQA_ROWS)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def save_tiny_checkpoint(folder: Path, *, layers: int = 2, max_positions: int = 2048,
                         train_text: str | None = None, head_dim: int = 16) -> Path:
    """A random llama of ``layers`` layers (GQA 4/2, heads of ``head_dim``) with a byte-level tokenizer
    and a chat template: without merges, or with a 320-token BPE trained on ``train_text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if train_text is None:
        vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    else:
        backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if train_text is not None:
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        backend.train_from_iterator([train_text] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token="<|im_start|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_positions,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint (:func:`save_tiny_checkpoint`) for the test module that imports this fixture."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The local GSM8K / CoQA rows (:func:`write_local_data`) for the test module that imports this fixture."""
    return write_local_data(tmp_path_factory.mktemp("data"))
