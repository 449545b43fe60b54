"""Clustered Index Sharing (SPEC §4), PrHS's own decode selector.

Each query head keeps, per block of ``s`` decode steps, anchors: a unit query and the dilated set
of its exact top-k middle indices. A query whose cosine with one of its head's anchors is ≥ τ
reuses that anchor's set (its top-k plus ±r around the best m, clipped to the current middle);
otherwise it retrieves a fresh exact top-k and becomes an anchor. The set is
``sink ∪ middle ∪ local``; sequences with ``t <= sink + local + k`` attend to every token (those
PSAW leaves visible). The steps run on the ops table of the device (PyTorch reference or Triton
kernels, ``prhs_hf.kernels.decode_ops``); the state of every layer lives in one
:class:`~prhs_hf.cis_state.CISState`. No host synchronisation: the step can be graph-captured.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..cis_state import CISState
from ..decode import DecodeParams, DecodeSelection, step_frame
from ..geometry import SequenceGeometry
from ..kernels.decode_ops import DecodeOps, cis_select

__all__ = ["CISSelector"]


class CISSelector:
    """CIS for every layer of a model: one :class:`CISState`, set up at each prompt.

    ``grouped=True`` (``cis.selection: group``): one index set per KV head, shared by the query
    heads of its group; its anchors hold the group's queries side by side
    (``decode_ops.group_query``) and a retrieval ranks keys by the group's largest score. Each KV
    head's keys are then read once per retrieval and its selected K/V rows once per step.
    """

    def __init__(
        self, num_layers: int, block_size: int, set_size: int, ops_for: Callable[[torch.device], DecodeOps],
        grouped: bool = False,
        keep_anchor_local: bool = False,
    ):
        self.num_layers = num_layers
        self.block_size = block_size
        self.set_size = set_size
        self.ops_for = ops_for
        self.grouped = grouped
        self.keep_anchor_local = keep_anchor_local
        self.state: CISState | None = None

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """A new prompt: at its first layer, the state is set up for its shape (or reset in place)."""
        if layer == 0:
            batch, heads, _, head_dim = query.shape
            if self.grouped:  # a row per KV head, its anchors the group's queries side by side
                heads, head_dim = key.shape[1], head_dim * (heads // key.shape[1])
            self.setup(batch, heads, head_dim, query.device)

    def setup(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        """Buffers for decode steps of this shape; existing ones of the right shape are reset in
        place, so that a compiled step keeps seeing the same addresses from one generate() call
        to the next."""
        if self.state is None or not self.state.matches(self.num_layers, batch, heads, head_dim, device):
            self._allocate(batch, heads, head_dim, device)
        else:
            self.state.reset()

    @torch.compiler.disable
    def _allocate(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        # eager even inside a compiled forward: the buffers must live outside any CUDA graph pool
        self.state = CISState(self.num_layers, batch, heads, head_dim, self.block_size, self.set_size, device)

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float,
    ) -> DecodeSelection:
        """One decode step of ``layer`` for ``q [B, Hq, D]`` (SPEC §4 steps 1-4); the first layer
        opens the step for all."""
        state = self.state
        if state is None:
            raise RuntimeError("CIS decode step before any prefill: run the prompt through the patched model first")
        if layer == 0:
            state.begin_step()
        p = params
        f = step_frame(geom, p)
        anchor_q, anchor_set, anchor_count = state.anchors(layer)
        win_start = f.win_start
        if self.keep_anchor_local:
            # the window reaches back to where the middle ended at the block's first step: the
            # tokens that aged out of the local window since then were in no anchor's candidates
            since_block_start = torch.remainder(state.step - 1, self.block_size).to(torch.int32)
            win_start = torch.minimum(f.win_start, torch.maximum(f.hi - since_block_start, f.lo))
        sel = cis_select(
            self.ops_for(q.device), q, k_cache, geom.pad, f.t, f.lo, f.hi, win_start,
            anchor_q, anchor_count, anchor_set, f.active,
            tau=p.tau, sink=p.sink, k=p.topk, dil_m=p.dilation_topm, dil_r=p.dilation_radius, cap=p.capacity, scale=scale,
            grouped=self.grouped,
        )
        retrieved = sel.best == -1
        state.record(layer, sel.match_q, sel.new_set, retrieved)
        return DecodeSelection(sel.idx, sel.count, retrieved, f.active)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search."""
        if self.state is not None:
            self.state.reorder(index)

    def reset(self) -> None:
        """Forget the anchors (the buffers stay)."""
        if self.state is not None:
            self.state.reset()
