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
    """CIS for every layer of a model: the anchors in one :class:`CISState` per device (one for the
    whole model unless ``device_map`` splits it), set up at each prompt.

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
        self.states: dict[torch.device, CISState] = {}
        # layer -> (its device, its index in that device's state), fixed at each prefill
        self._slot: dict[int, tuple[torch.device, int]] = {}
        self._prompt_devices: dict[int, torch.device] = {}

    @property
    def state(self) -> CISState | None:
        """The state of layer 0's device (the only one unless ``device_map`` splits the model)."""
        slot = self._slot.get(0)
        return None if slot is None else self.states[slot[0]]

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """A new prompt: once its last layer has been seen, the state of every device that holds
        layers is set up for its shape (or reset in place)."""
        if layer == 0:
            self._prompt_devices = {}
        self._prompt_devices[layer] = query.device
        if layer == self.num_layers - 1:
            batch, heads, _, head_dim = query.shape
            if self.grouped:  # a row per KV head, its anchors the group's queries side by side
                heads, head_dim = key.shape[1], head_dim * (heads // key.shape[1])
            self._setup_layers(batch, heads, head_dim, self._prompt_devices)

    def setup(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        """Buffers for decode steps of this shape with every layer on ``device``."""
        self._setup_layers(batch, heads, head_dim, dict.fromkeys(range(self.num_layers), device))

    def _setup_layers(self, batch: int, heads: int, head_dim: int, devices: dict[int, torch.device]) -> None:
        """One state per device for the layers on it; existing ones of the right shape are reset
        in place, so that a compiled step keeps seeing the same addresses from one generate()
        call to the next."""
        if sorted(devices) != list(range(self.num_layers)):
            raise RuntimeError(f"CIS saw the prefill of layers {sorted(devices)} of {self.num_layers}")
        per_device: dict[torch.device, list[int]] = {}
        for layer in range(self.num_layers):
            per_device.setdefault(devices[layer], []).append(layer)
        self._slot = {layer: (dev, i) for dev, layers in per_device.items() for i, layer in enumerate(layers)}
        for dev, layers in per_device.items():
            state = self.states.get(dev)
            if state is None or not state.matches(len(layers), batch, heads, head_dim, dev):
                self._allocate(dev, len(layers), batch, heads, head_dim)
            else:
                state.reset()
        for dev in [d for d in self.states if d not in per_device]:
            del self.states[dev]

    @torch.compiler.disable
    def _allocate(self, device: torch.device, layers: int, batch: int, heads: int, head_dim: int) -> None:
        # eager even inside a compiled forward: the buffers must live outside any CUDA graph pool
        self.states[device] = CISState(layers, batch, heads, head_dim, self.block_size, self.set_size, device)

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float,
    ) -> DecodeSelection:
        """One decode step of ``layer`` for ``q [B, Hq, D]`` (SPEC §4 steps 1-4); the first layer
        of each device's state opens the step for its layers."""
        slot = self._slot.get(layer)
        if slot is None:
            raise RuntimeError("CIS decode step before any prefill: run the prompt through the patched model first")
        device, local = slot
        state = self.states[device]
        if local == 0:
            state.begin_step()
        p = params
        f = step_frame(geom, p)
        anchor_q, anchor_set, anchor_count = state.anchors(local)
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
        state.record(local, sel.match_q, sel.new_set, retrieved)
        return DecodeSelection(sel.idx, sel.count, retrieved, f.active)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search."""
        for state in self.states.values():
            state.reorder(index)

    def reset(self) -> None:
        """Forget the anchors (the buffers stay)."""
        for state in self.states.values():
            state.reset()
