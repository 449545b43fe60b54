"""Imported by Python at start-up in the scripts the tests run as subprocesses (their PYTHONPATH
begins with this folder): the test suite's Triton interpreter speed-ups, as in the test process."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton_interpreter_speedups  # noqa: E402

triton_interpreter_speedups.install()
del sys.path[0]
