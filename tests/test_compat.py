"""What prhs_hf.compat does for the transformers versions it serves, on whichever version is installed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
