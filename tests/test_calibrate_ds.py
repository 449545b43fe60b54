"""Tests of ``prhs-hf calibrate-ds`` (prhs_hf/calibration/ds_channels.py): Double Sparsity's offline label
channels, on a tiny random llama, CPU only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import prhs_hf
from prhs_hf import cli
from prhs_hf.calibration import ds_channels
from prhs_hf.calibration.ds_channels import label_contributions
from prhs_hf.calibration.options import CalibrationError
from prhs_hf.calibration.texts import pack_prompts
from prhs_hf.config import ConfigError
from prhs_hf.selectors.double_sparsity import load_label_channels, top_channels

from lm_eval_fixtures import save_tiny_checkpoint

STORY = ("The lighthouse keeper wrote the weather in a notebook every evening, and the boats left "
         "before dawn when the wind came from the west. ") * 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ds"))


@pytest.fixture()
def story_file(tmp_path) -> Path:
    path = tmp_path / "story.txt"
    path.write_text(STORY)
    return path


def test_cli_writes_channels_and_a_config_that_uses_them(checkpoint, story_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cal" / "ds_tiny"
    rc = cli.main(["calibrate-ds", str(checkpoint), "--text", str(story_file), "--n", "2", "--length", "64",
                   "--rank", "5", "--out", str(out), "--device", "cpu"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "calibrate-ds" in captured.err  # the progress bar
    assert "label channels of" in captured.out and f"wrote {out}.yaml and {out}.pt" in captured.out

    # the channels are the top 5 of the contributions over the same packed prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    prompts = pack_prompts([STORY], tokenizer, 64, 2)
    expect = top_channels(label_contributions(model, iter(prompts)), 5)
    channels, head_dim = load_label_channels(f"{out}.pt")
    assert head_dim == 16 and channels.shape == (2, 4, 5) and torch.equal(channels, expect)

    # the YAML names the file relative to itself: it still loads from another folder, moved with it
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for suffix in (".yaml", ".pt"):
        shutil.move(f"{out}{suffix}", moved / f"ds_tiny{suffix}")
    monkeypatch.chdir(tmp_path)
    text = (moved / "ds_tiny.yaml").read_text()
    assert "label_channels: ds_tiny.pt" in text and "# layer   0: " in text
    config = prhs_hf.load_config(moved / "ds_tiny.yaml")
    assert config.baseline.name == "double_sparsity" and config.baseline.label_rank == 5
    assert Path(config.baseline.label_channels) == moved / "ds_tiny.pt"

    # and it runs: the patched model decodes with the calibrated channels
    ids = tokenizer(STORY[:300], return_tensors="pt")["input_ids"]
    small = {"budget": {"sink": 4, "local": 8, "topk": 16}}
    with prhs_hf.patch(model, moved / "ds_tiny.yaml", overrides=small) as handle:
        model.generate(ids, max_new_tokens=3, do_sample=False)
        assert handle.runtime.selector.calibrated


def test_a_relative_label_file_is_relative_to_the_yaml_not_to_the_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "ds.yaml").write_text("baseline: {name: double_sparsity, label_channels: sub/ds.pt}\n")
    monkeypatch.chdir(tmp_path)
    assert prhs_hf.load_config(folder / "ds.yaml").baseline.label_channels == str(folder / "sub" / "ds.pt")
    # a dict (or overrides) is relative to the working directory, as any path given in code
    assert prhs_hf.load_config({"baseline": {"name": "double_sparsity", "label_channels": "sub/ds.pt"}}) \
        .baseline.label_channels == "sub/ds.pt"
    absolute = str(tmp_path / "abs.pt")
    (folder / "abs.yaml").write_text(f"baseline: {{name: double_sparsity, label_channels: {absolute}}}\n")
    assert prhs_hf.load_config(folder / "abs.yaml").baseline.label_channels == absolute
    (folder / "bad.yaml").write_text("baseline: {name: double_sparsity, label_channels: ''}\n")
    with pytest.raises(ConfigError, match="baseline.label_channels"):
        prhs_hf.load_config(folder / "bad.yaml")


@pytest.mark.parametrize("argv, message", [
    (["--rank", "0"], "--rank: 0 is out of range; allowed >= 1"),
    (["--n", "0"], "--n: 0 is out of range; allowed >= 1"),
    ([], "give the calibration text with --text PATH"),
    (["--text", "/no/such/text.txt"], "--text: no such file or folder: /no/such/text.txt"),
])
def test_cli_errors_before_loading_the_model(argv, message, story_file, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("prhs_hf.hub.fetch.load_model", no_loading)
    if argv[:1] in (["--rank"], ["--n"]):
        argv = [*argv, "--text", str(story_file)]
    assert cli.main(["calibrate-ds", "smollm2-135m", *argv]) == 1
    assert message in capsys.readouterr().err


def test_cli_refuses_more_channels_than_the_head_has(checkpoint, story_file, capsys):
    assert cli.main(["calibrate-ds", str(checkpoint), "--text", str(story_file), "--rank", "17", "--n", "1",
                     "--length", "32", "--device", "cpu"]) == 1
    assert "--rank: 17 is out of range for this model; allowed [1, 16]" in capsys.readouterr().err


def test_help_lists_calibrate_ds():
    assert "calibrate-ds" in cli.build_parser().format_help()


@pytest.mark.parametrize("kwargs, message", [({"rank": True}, "--rank: True is out of range"),
                                             ({"n": False}, "--n: False is out of range"),
                                             ({"length": 2.5}, "--length: 2.5 is out of range")])
def test_the_python_api_refuses_a_bool_or_a_float_for_a_count(kwargs, message, story_file):
    with pytest.raises(CalibrationError, match=message):
        ds_channels.run("smollm2-135m", text=story_file, **kwargs)
