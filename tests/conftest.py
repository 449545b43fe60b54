import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests, with the reason, where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


CPU_POLICY_MARKER = "cpu_policy"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{CPU_POLICY_MARKER}: sees the CPU's own `policy: auto` decision (the "
                                       "rest of the suite runs `auto` sparse on a CPU, see _make_auto_sparse_on_a_cpu)")


def _make_auto_sparse_on_a_cpu() -> None:
    """Sparse steps wherever a config says ``policy: auto``, on a CPU, for the whole test process.

    The suite checks PrHS's sparse decode on tiny models on a CPU, many tests through the shipped
    configs, whose ``policy: auto`` decodes dense there (:data:`prhs_hf.policy.CPU`: its sparse steps
    are slower than dense). So the test process runs ``auto`` sparse on a CPU, as before that cost
    model, from its start: module-scoped fixtures that generate are covered too. A test marked
    ``cpu_policy`` sees the CPU's own decision (:func:`_cpu_policy_where_marked`). A script a test runs
    in a subprocess does the same (``subprocess_site/sitecustomize.py``), unless its environment sets
    ``PRHS_TEST_CPU_POLICY=1``.
    """
    from auto_sparse_on_cpu import install
    from prhs_hf import runtime

    install(runtime)


_make_auto_sparse_on_a_cpu()


@pytest.fixture(autouse=True)
def _cpu_policy_where_marked(request, monkeypatch):
    """A test marked ``cpu_policy`` sees the CPU's own ``policy: auto`` decision."""
    if CPU_POLICY_MARKER in request.keywords:
        from prhs_hf import policy, runtime

        monkeypatch.setattr(runtime, "cost_model_for", policy.cost_model_for)


def triton_available() -> bool:
    """True where Triton kernels can run: on CUDA, or on the CPU through TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


# The Triton interpreter's two slow spots, sped up for the tests (same values; see the module)
from triton_interpreter_speedups import install as _install_interpreter_speedups  # noqa: E402

INTERPRETER_SPEEDUPS = _install_interpreter_speedups()
if INTERPRETER_SPEEDUPS:  # and in the scripts the tests run as subprocesses (they inherit the environment)
    _SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subprocess_site")
    os.environ["PYTHONPATH"] = os.pathsep.join([_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])
