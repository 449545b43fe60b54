"""Run a module on the active rows only (ETF): frozen rows get zeros and cost nothing.

The module's ``forward`` is replaced on the instance (as accelerate's hooks do) and restored by
:func:`remove_row_skip`; parameters and ``state_dict`` keys do not change.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["install_row_skip", "remove_row_skip"]

_SAVED = "_prhs_saved_forward"


def install_row_skip(module: nn.Module, active_rows: Callable[[], torch.Tensor | None], on_rows=None) -> None:
    """Make ``module`` compute only the rows ``active_rows()`` names.

    ``active_rows()`` returns ``None`` (run as usual) or a 1D long tensor of row indices into the
    input flattened to ``[B * L, hidden]``; the other rows of the output are zero. ``on_rows(n)``,
    if given, is told how many rows were computed (tests count them).
    """
    if _SAVED in module.__dict__:
        return
    inner = module.forward
    module.__dict__[_SAVED] = module.__dict__.get("forward")

    def forward(x: torch.Tensor, *args, **kwargs):
        rows = active_rows()
        if rows is None:
            if on_rows is not None:
                on_rows(x.shape[:-1].numel())
            return inner(x, *args, **kwargs)
        flat = x.reshape(-1, x.shape[-1])
        if on_rows is not None:
            on_rows(rows.numel())
        computed = inner(flat.index_select(0, rows).unsqueeze(0), *args, **kwargs)
        computed = computed.reshape(-1, computed.shape[-1])
        out = computed.new_zeros(flat.shape[0], computed.shape[-1])
        out.index_copy_(0, rows, computed)
        return out.reshape(*x.shape[:-1], computed.shape[-1])

    module.forward = forward


def remove_row_skip(module: nn.Module) -> None:
    """Undo :func:`install_row_skip` exactly (an earlier instance-level forward is put back)."""
    if _SAVED not in module.__dict__:
        return
    saved = module.__dict__.pop(_SAVED)
    if saved is None:
        del module.forward
    else:
        module.forward = saved
