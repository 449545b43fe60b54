"""``policy: auto`` runs sparse on a CPU in the test process (``conftest.py``) and in the scripts the
tests run as subprocesses (``subprocess_site/sitecustomize.py``): the suite checks PrHS's sparse decode
on tiny models through the shipped configs, whose ``auto`` decodes dense on a CPU
(:data:`prhs_hf.policy.CPU`: its sparse steps are slower than dense there)."""

import torch


def sparse_on_a_cpu(device, path=None):
    """``prhs_hf.policy.cost_model_for``, but no cost model on a CPU: ``auto`` runs sparse there."""
    from prhs_hf import policy

    if path is None and torch.device(device).type == "cpu":
        return None  # no cost model: `auto` runs sparse (prhs_hf.runtime)
    return policy.cost_model_for(device, path)


def install(runtime) -> None:
    """Make the module ``prhs_hf.runtime`` price with :func:`sparse_on_a_cpu`."""
    runtime.cost_model_for = sparse_on_a_cpu
