"""CIS selection on a side CUDA stream: :func:`fork_cis_select` launches it, :func:`join_cis_select` waits.

EarlySelectKV (``early_select.side_stream``) knows layer ℓ+1's proxy query at layer ℓ's tap, so
layer ℓ+1's selection (``decode_ops.cis_select``: match, retrieval, dilated set, composition) can
run beside the rest of layer ℓ. :func:`fork_cis_select` makes a side stream wait for the current
stream's work so far, launches the selection there and returns a *ticket*;
:func:`join_cis_select` makes the current stream wait for that work and returns the selection.
What the side stream reads must not change in between: the anchors of layer ℓ+1 (written only
by its own record, after the join), the geometry, and the cache's middle rows (the current token's
key, written meanwhile, is in the local window: ``budget.local >= 1``).

Reference: ``decode_ops.cis_select`` itself; the pair returns exactly its selection
(``tests/test_side_stream.py``). On the CPU there are no streams and the fork runs it at once.

Under ``torch.compile`` both are custom ops (``prhs::fork_cis_select``, ``prhs::join_cis_select``),
functional for the compiler: the join reads the fork's ticket, so it stays after it, and it takes
the fork's inputs as ``keep``, so no buffer the side stream reads is freed and reused before the
join. Inside a CUDA graph the fork and the join are captured as the graph's edges between the two
streams. The selection in flight is held here, per device and layer, from the fork to the join.

The caller passes the device's ops table (``DecodeOps``) itself; eager forks run on that table. A
custom op takes only tensors and scalars, so the compiled fork carries the table's name
(``ops.name``) across the op boundary and looks the table up once there (:func:`get_decode_ops`).
"""

from __future__ import annotations

import torch

from .decode_ops import DecodeOps, cis_select, get_decode_ops
from .compose.dilated_set import dilated_set_size

__all__ = ["fork_cis_select", "join_cis_select", "pending_selections", "drop_pending"]

Tensor = torch.Tensor

# (device, layer) -> (event the side stream records when done, or None on the CPU; the selection's tensors)
_PENDING: dict[tuple[torch.device, int], tuple[torch.cuda.Event | None, tuple[Tensor, ...]]] = {}
_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def pending_selections() -> int:
    """Selections forked and not yet joined (0 between decode steps)."""
    return len(_PENDING)


def drop_pending() -> None:
    """Forget selections that were never joined (a decode step that raised half way)."""
    _PENDING.clear()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]


def _fork(
    layer: int, ops: DecodeOps, q: Tensor, k_cache: Tensor, pad: Tensor, t: Tensor, lo: Tensor, hi: Tensor,
    win_start: Tensor, anchor_q: Tensor, anchor_count: Tensor, anchor_set: Tensor, active: Tensor,
    tau: float, sink: int, k: int, dil_m: int, dil_r: int, cap: int, scale: float, grouped: bool, group_score: str,
) -> Tensor:
    key = (q.device, layer)
    if key in _PENDING:
        raise RuntimeError(f"fork_cis_select: layer {layer}'s selection was forked twice without a join")
    args = (ops, q, k_cache, pad, t, lo, hi, win_start, anchor_q, anchor_count, anchor_set, active)
    kwargs = dict(tau=tau, sink=sink, k=k, dil_m=dil_m, dil_r=dil_r, cap=cap, scale=scale, grouped=grouped,
                  group_score=group_score)
    if q.device.type != "cuda":
        sel = cis_select(*args, **kwargs)
        done = None
    else:
        side = _side_stream(q.device)
        side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):
            sel = cis_select(*args, **kwargs)
            done = torch.cuda.Event()
            done.record(side)
    _PENDING[key] = (done, (sel.best, sel.new_idx, sel.new_set, sel.idx, sel.count))
    return q.new_empty(0, dtype=torch.int8)


def _join(ticket: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    try:
        done, out = _PENDING.pop((ticket.device, layer))
    except KeyError:
        raise RuntimeError(f"join_cis_select: no selection of layer {layer} in flight (fork_cis_select first)") from None
    if done is not None:
        torch.cuda.current_stream(ticket.device).wait_event(done)
    return out


@torch.library.custom_op("prhs::fork_cis_select", mutates_args=())
def _fork_op(
    layer: int, backend: str, q: Tensor, k_cache: Tensor, pad: Tensor, t: Tensor, lo: Tensor, hi: Tensor,
    win_start: Tensor, anchor_q: Tensor, anchor_count: Tensor, anchor_set: Tensor, active: Tensor,
    tau: float, sink: int, k: int, dil_m: int, dil_r: int, cap: int, scale: float, grouped: bool, group_score: str,
) -> Tensor:
    # the op's schema has no type for the ops table: it arrives as its name, looked up once here
    return _fork(layer, get_decode_ops(backend), q, k_cache, pad, t, lo, hi, win_start, anchor_q, anchor_count,
                 anchor_set, active, tau, sink, k, dil_m, dil_r, cap, scale, grouped, group_score)


@_fork_op.register_fake
def _(layer, backend, q, k_cache, pad, t, lo, hi, win_start, anchor_q, anchor_count, anchor_set, active,
      tau, sink, k, dil_m, dil_r, cap, scale, grouped, group_score):
    return q.new_empty(0, dtype=torch.int8)


@torch.library.custom_op("prhs::join_cis_select", mutates_args=())
def _join_op(
    ticket: Tensor, keep: list[Tensor], layer: int, rows: int, k: int, dil_m: int, dil_r: int, cap: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _join(ticket, layer)


@_join_op.register_fake
def _(ticket, keep, layer, rows, k, dil_m, dil_r, cap):
    like = keep[0]
    batch = like.shape[0]
    return (like.new_empty(batch, rows, dtype=torch.int32), like.new_empty(batch, rows, k, dtype=torch.int32),
            like.new_empty(batch, rows, dilated_set_size(k, dil_m, dil_r), dtype=torch.int32),
            like.new_empty(batch, rows, cap, dtype=torch.int32), like.new_empty(batch, rows, dtype=torch.int32))


def fork_cis_select(
    layer: int, ops: DecodeOps, q: Tensor, k_cache: Tensor, pad: Tensor, t: Tensor, lo: Tensor, hi: Tensor,
    win_start: Tensor, anchor_q: Tensor, anchor_count: Tensor, anchor_set: Tensor, active: Tensor,
    *, tau: float, sink: int, k: int, dil_m: int, dil_r: int, cap: int, scale: float, grouped: bool = False,
    group_score: str = "max",
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Launch ``cis_select(ops, q, …)`` (same arguments) for ``layer`` on the side stream of ``q``'s
    device; returns ``(ticket, keep)``, what :func:`join_cis_select` takes. Under ``torch.compile``
    the fork runs on the table named ``ops.name`` (see the module docstring)."""
    tensors = (q, k_cache, pad, t, lo, hi, win_start, anchor_q, anchor_count, anchor_set, active)
    sizes = (tau, sink, k, dil_m, dil_r, cap, scale, grouped, group_score)
    if torch.compiler.is_compiling():
        ticket = _fork_op(layer, ops.name, *tensors, *sizes)
    else:
        ticket = _fork(layer, ops, *tensors, *sizes)
    return ticket, (q, pad, t, lo, hi, win_start, anchor_count, active)


def join_cis_select(
    ticket: Tensor, keep: tuple[Tensor, ...], layer: int, *, rows: int, k: int, dil_m: int, dil_r: int, cap: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Wait for :func:`fork_cis_select`'s selection of ``layer`` on the current stream; returns its
    ``(best, new_idx, new_set, idx, count)`` (``rows`` per sequence: query heads, or KV heads if grouped)."""
    if torch.compiler.is_compiling():
        return _join_op(ticket, list(keep), layer, rows, k, dil_m, dil_r, cap)
    return _join(ticket, layer)
