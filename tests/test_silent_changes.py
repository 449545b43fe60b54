"""Inputs that changed nothing, or changed with the batch, without a word: each now works exactly or
is refused at once naming what to do (issue 53 item 8)."""

from __future__ import annotations

import pytest
import torch

import prhs_hf
from prhs_hf.config import ConfigError
from tiny_models import padded_batch, tiny_model


@pytest.mark.parametrize("override, message", [
    ({"psaw": {"phi": 0.5}}, "psaw.phi: the config leaves psaw off (psaw.enabled: false), so this override would "
                             "change nothing; add psaw.enabled: true to turn psaw on"),
    ({"etf": {"psi": 0.3}}, "etf.psi: the config leaves etf off"),
    ({"telemetry": {"oracle": True}}, "add telemetry.enabled: true"),
    ({"baseline": {"page_size": 32}}, "baseline.page_size: the config leaves baseline off (baseline.name: null), "
                                      "so this override would change nothing; set baseline.name too (one of oracle"),
])
def test_an_override_of_a_section_the_config_leaves_off_is_refused(override, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prhs_hf.load_config("cis", override)


def test_an_override_that_turns_the_section_on_or_names_its_switch_is_taken() -> None:
    config = prhs_hf.load_config("cis", {"psaw": {"phi": 0.5, "enabled": True}, "baseline": {"name": "quest",
                                                                                             "page_size": 32}})
    assert (config.psaw.enabled, config.psaw.phi, config.baseline.page_size) == (True, 0.5, 32)
    off = prhs_hf.load_config("cis", {"psaw": {"phi": 0.5, "enabled": False}})  # said so: taken as it is
    assert off.psaw.enabled is False
    assert prhs_hf.load_config({}, {"psaw": {"phi": 0.5}}).psaw.enabled  # a section left out: present turns it on
    cis = prhs_hf.load_config("cis")
    assert prhs_hf.load_config(cis, cis.to_dict()) == cis  # a whole config as overrides names every switch


def test_every_named_config_still_loads() -> None:
    from prhs_hf.config import shipped_configs
    from prhs_hf.evaluation.accuracy.configs import ACCURACY_CONFIGS, load_any_config

    for name in [*shipped_configs(), *ACCURACY_CONFIGS]:
        load_any_config(name, {"telemetry": {"enabled": True}})


RANDOM_EXPANSION = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4},
                    "baseline": {"name": "random_expansion", "seed": 3},
                    "backend": {"prefill": "torch", "decode": "torch"}}


def test_random_expansion_gives_each_sequence_the_same_tokens_alone_and_in_a_batch() -> None:
    """Its draws came from one generator stream over the whole batch's [B, H, slots]: a sequence's
    random indices depended on the batch it was in."""
    model = tiny_model("llama")
    lengths = [70, 45, 58]
    ids, mask = padded_batch(lengths)
    prhs_hf.patch(model, RANDOM_EXPANSION)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
        for i, n in enumerate(lengths):
            alone = model.generate(ids[i:i + 1, -n:], attention_mask=mask[i:i + 1, -n:], do_sample=False,
                                   max_new_tokens=12)
            assert torch.equal(batch[i, -12:], alone[0, -12:]), f"sequence {i}"
    prhs_hf.unpatch(model)
