"""What prhs_hf.compat does for the transformers versions it serves, on whichever version is installed."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import prhs_hf
from prhs_hf.compat import assistant_generate_kwargs, cache_argument
from tiny_models import padded_batch, tiny_model

ROOT = Path(__file__).resolve().parents[1]

#: the PyTorch reference backends and a sparse decode (4 + 8 + 16 keys), as test_user_scenarios' "sparse"
SPARSE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "backend": {"prefill": "torch", "decode": "torch"},
          "policy": {"decode": "sparse", "prefill": "sparse"}}


def _ending_in_the_pad_id():
    """One unpadded sequence whose newest token has the pad token's id (0 in the tiny models): a token
    the main model generated, as transformers' candidate generator hands it to the assistant."""
    ids, _ = padded_batch([40], seed=3)
    ids[0, -1] = 0
    return ids


def _assistant_config(model) -> GenerationConfig:
    """A copy of the model's generation config as transformers' candidate generator makes it."""
    config = copy.deepcopy(model.generation_config)
    config.is_assistant = True
    config.do_sample = False
    return config


def test_a_patched_assistant_called_without_a_mask_reads_its_tokens_unpadded():
    """transformers >= 5.18 drops an all-ones attention mask before assisted decoding and then calls the
    assistant's generate() without one, which infers a mask from pad_token_id: a generated token with
    the pad id became padding after the real tokens, and the layout check refused the call (qwen3's
    test_assisted_generation on 5.23). A patched assistant's call without a mask decodes as with the
    all-ones mask the main model dropped."""
    model = tiny_model("llama", layers=1)
    ids = _ending_in_the_pad_id()
    prhs_hf.patch(model, "cis", overrides=SPARSE)
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=None, generation_config=_assistant_config(model),
                             max_new_tokens=4, return_dict_in_generate=True, output_scores=True)
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  generation_config=_assistant_config(model), max_new_tokens=4,
                                  return_dict_in_generate=True, output_scores=True)
    assert torch.equal(got.sequences, expected.sequences)


def test_only_an_assistant_call_without_a_mask_gets_one():
    """A user's generate() without a mask keeps transformers' own inference from pad_token_id (a pad
    token after the real ones is then right padding, which PrHS refuses), and a mask that is given
    is never replaced."""
    ids = _ending_in_the_pad_id()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    user = {"input_ids": ids, "generation_config": GenerationConfig(), "attention_mask": None}
    assert assistant_generate_kwargs(user) is user
    given = {"input_ids": ids, "generation_config": GenerationConfig(is_assistant=True), "attention_mask": mask}
    assert assistant_generate_kwargs(given) is given
    filled = assistant_generate_kwargs({"input_ids": ids, "generation_config": GenerationConfig(is_assistant=True)})
    assert torch.equal(filled["attention_mask"], torch.ones_like(ids))

    model = tiny_model("llama", layers=1)
    prhs_hf.patch(model, "cis", overrides=SPARSE)
    with torch.no_grad(), pytest.raises(ValueError, match="padding inside or after their tokens"):
        model.generate(input_ids=ids, do_sample=False, max_new_tokens=2)


def test_ci_tests_both_ends_of_the_transformers_pin():
    """pyproject.toml admits the transformers versions the tests pass on: scripts/setup.sh installs the
    lowest (the whole suite runs on it) and .ci/run runs the user-facing files on the highest."""
    pin = re.search(r'"transformers>=(\d+)\.(\d+)\.0,<(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "pyproject.toml: expected transformers>=X.Y.0,<X.Z"
    low, high = (int(pin[1]), int(pin[2])), (int(pin[3]), int(pin[4]) - 1)
    installed = re.search(r'"transformers==(\d+)\.(\d+)\.0"', (ROOT / "scripts" / "setup.sh").read_text())
    assert installed and (int(installed[1]), int(installed[2])) == low
    other = re.search(r"^HIGHEST=(\d+)\.(\d+)\.0$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert other and (int(other[1]), int(other[2])) == high


def test_the_cache_is_read_under_either_name():
    """transformers 5.24 renamed the cache argument ``past_key_values`` to ``cache`` in every layer's
    forward and in generate()'s model_kwargs; the patch reads it under the name the installed version
    passes (under the old name only, a 5.24 model's decoder layers looked uncached to the patch, and
    its layout check refused every decode step)."""
    cache = object()
    assert cache_argument({"cache": cache, "attention_mask": None}) is cache
    assert cache_argument({"past_key_values": cache}) is cache
    assert cache_argument({"cache": None, "past_key_values": cache}) is cache
    assert cache_argument({"attention_mask": None}) is None


def test_a_padded_batch_decodes_sparse_on_the_installed_transformers():
    """The decoder layers' cache argument, whatever the installed version names it, reaches the patch:
    a left-padded batch generates with sparse decode steps and no layout error."""
    model = tiny_model("qwen2")
    ids, mask = padded_batch([60, 48], seed=1)  # longer than the 4 + 8 + 16 keys a step reads
    prhs_hf.patch(model, {**SPARSE, "cis": {"block_size": 4, "tau": 0.0}, "telemetry": {"enabled": True}})
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, ids.shape[1] + 4)
    assert prhs_hf.telemetry(model).sparse_sequence_steps > 0
