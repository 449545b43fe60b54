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
