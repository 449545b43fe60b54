"""Imported by Python at start-up in the scripts the tests run as subprocesses (their PYTHONPATH
begins with this folder): what the test process does to the library, done in the script too.

- The test suite's Triton interpreter speed-ups, installed when the script first imports the
  interpreter (``import triton`` does), not here: a subprocess that never runs Triton neither imports
  it nor pays its ~0.5 s import.
- ``policy: auto`` runs sparse on a CPU, as ``tests/conftest.py``'s ``_make_auto_sparse_on_a_cpu``
  makes it in the test process (the scripts' CPU tests check sparse steps through the shipped configs,
  whose ``auto`` decodes dense on a CPU, :data:`prhs_hf.policy.CPU`), set when ``prhs_hf.runtime``
  loads. A test that checks the CPU's own decision in a subprocess sets ``PRHS_TEST_CPU_POLICY=1``.
"""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path


def _install_speedups(module) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        import triton_interpreter_speedups

        triton_interpreter_speedups.install()
    finally:
        del sys.path[0]


def _auto_runs_sparse_on_a_cpu(runtime) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from auto_sparse_on_cpu import install
    finally:
        del sys.path[0]
    install(runtime)


class _AfterLoading(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once, after the module ``name`` is first loaded."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once, and not for its own lookup below
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterLoading("triton.runtime.interpreter", _install_speedups))
if os.environ.get("PRHS_TEST_CPU_POLICY") != "1":
    sys.meta_path.insert(0, _AfterLoading("prhs_hf.runtime", _auto_runs_sparse_on_a_cpu))
