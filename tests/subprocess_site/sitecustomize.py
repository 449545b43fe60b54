"""Imported by Python at start-up in the scripts the tests run as subprocesses (their PYTHONPATH
begins with this folder): the test suite's Triton interpreter speed-ups, as in the test process.

Installed when the script first imports the interpreter (``import triton`` does), not here: a
subprocess that never runs Triton neither imports it nor pays its ~0.5 s import."""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_INTERPRETER = "triton.runtime.interpreter"


def _install() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        import triton_interpreter_speedups

        triton_interpreter_speedups.install()
    finally:
        del sys.path[0]


class _InstallAfterTheInterpreterLoads(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _INTERPRETER:
            return None
        sys.meta_path.remove(self)  # once, and not for its own lookup below
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _InstallAfterTheInterpreterLoads())
