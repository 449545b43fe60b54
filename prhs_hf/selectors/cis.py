"""Clustered Index Sharing (SPEC §4), PrHS's own decode selector.

Each query head keeps, per block of ``s`` decode steps, anchors: a unit query and the dilated set
of its exact top-k middle indices. A query whose cosine with one of its head's anchors is ≥ τ
reuses that anchor's set (its top-k plus ±r around the best m, clipped to the current middle);
otherwise it retrieves a fresh exact top-k and becomes an anchor. The set is
``sink ∪ middle ∪ local``; sequences with ``t <= sink + local + k`` attend to every token (those
PSAW leaves visible). A step runs on the ops table it is given (PyTorch reference or Triton
kernels, ``prhs_hf.ops.decode_ops``; the runtime passes the one picked for the device); the
state of every layer lives in one :class:`~prhs_hf.selectors.cis_state.CISState`. No host
synchronisation: the step can be graph-captured.

Where the state is made: at each prompt's prefill (its last layer), with the anchor counts, the step
counter and the key index; the anchor buffers (``anchor_q``, ``anchor_idx``, ``[L, B, H, s, n]``)
at that prefill only where the policy decides that the decode steps after it run sparse (the
runtime's ``decodes_sparse``, the decision compiled steps keep), else at the first decode step that
runs the selector (:meth:`CISSelector.step_state`, eager); a generation that the policy decodes dense
never makes them. That step finds no anchor (``anchor_count`` 0, ``step`` 0: the steps the policy
ran dense did not count), so it opens a block and every active row retrieves, as the first step after
a prefill does.

CIS + tail (``cis.tail_slot: true``): CertKV's tail-summary slot on top of CIS. Each row's budget
is charged one slot: a retrieval keeps the top ``k - 1`` middle tokens and the row attends, beside
its index set, to one synthetic key/value (:func:`~prhs_hf.selectors.set_steps.tail_summary`) that
summarises the middle tokens the set leaves out, so an active step processes
``sink + (k - 1) + 1 + local`` keys as CIS's ``sink + k + local`` (the synthetic slot is counted in
``count`` wherever it carries mass).

The tail's moments need the query's scores over the whole middle, which only a *retrieval*
computes, so a retrieving row computes two pairs from its own exact softmax (``key``/``value`` the
softmax-weighted means of the omitted tokens, ``log_mass`` the log of their mass over the
synthetic key's logit):

- its own step attends to its undilated top ``k - 1``; its pair summarises the rest of
  ``[lo, min(hi, win_start))`` (with ``selection: head`` the step is then exact full attention
  over what it sees);
- the pair stored with the anchor summarises the middle minus the dilated set, which its sharers
  attend to (a dilation neighbour is never both attended and in the tail).

A sharing row reuses its anchor's stored pair, as it reuses the anchor's indices: the summary is
the anchor's, over the middle of the anchor's step. With ``selection: group`` the pair is one per
KV head, the group's softmax averaged (CertKV's convention). The summary and the attention with
the pair (:func:`~prhs_hf.selectors.set_steps.attend_with_tail`) run in PyTorch on either ops table
(docs/notes/runtime_design.md: what this costs and what it leaves out).

The key index (``cis.index``: ``fp8``, ``int4`` or ``pages``; docs/notes/key_index.md): a
low-precision copy of every layer's keys in the :class:`CISState`, which a retrieval scores first;
its best ``k + cis.rerank_margin`` candidates are re-ranked exactly on the cache's keys
(``ops.topk_retrieval_indexed``). The prompt's entries are written when the prompt's last layer has
been seen (``ops.write_key_index`` of the slots the prefill wrote, on the ops table the runtime picks
for each device, the one its decode steps get), the new key's at each decode step before the
layer's selection (``ops.update_key_index``, graph-safe). An eager step first writes the slots of
steps the selector did not see (a forward the policy ran dense); a dynamic cache that outgrows the
index makes it grow ×1.5 (:meth:`CISState.grow_key_index`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .base import StepMark
from .cis_state import CISState, KeyIndexSpec
from ..decode import DecodeParams, DecodeSelection, StepFrame, step_frame
from ..geometry import SequenceGeometry
from ..ops.compose.dilated_set import SET_NONE
from ..ops.decode_ops import REFERENCE_OPS, CISSelection, DecodeOps, cis_select, group_query
from ..config import ConfigError
from ..ops.key_index.key_index import INDEX_KINDS, INT4_GROUP, KeyIndex, key_index_center
from ..ops.side_stream import fork_cis_select, join_cis_select
from .set_steps import tail_summaries

__all__ = ["CISSelector", "CISStart"]


class CISStart(NamedTuple):
    """A step :meth:`CISSelector.start` began: its ops table, its frame and the selection, or, forked
    onto the side stream, ``forked = (ticket, keep, sizes)`` for the join. A selection that was not
    forked recorded its anchors itself (in its composition launch) unless ``cis.tail_slot`` is on."""

    layer: int
    ops: DecodeOps
    params: DecodeParams
    frame: StepFrame
    win_start: torch.Tensor
    selection: CISSelection | None
    forked: tuple | None


def _reference_ops(device: torch.device) -> DecodeOps:
    """The PyTorch references, on every device (a :class:`CISSelector` made without ``ops_for``)."""
    return REFERENCE_OPS


def _every_step_sparse() -> bool:
    """Decode steps run the selector (a :class:`CISSelector` made without ``decodes_sparse``)."""
    return True


class CISSelector:
    """CIS for every layer of a model: the anchors in one :class:`CISState` per device (one for the
    whole model unless ``device_map`` splits it), set up at each prompt, the anchor buffers once a
    decode step will run sparse (see the module docstring).

    ``grouped=True`` (``cis.selection: group``): one index set per KV head, shared by the query
    heads of its group; its anchors hold the group's queries side by side
    (``decode_ops.group_query``) and a retrieval ranks keys by the group's largest score. Each KV
    head's keys are then read once per retrieval and its selected K/V rows once per step.
    ``group_score="mean"`` (``cis.selection: group_mean``) ranks by the mean of the group's scores
    instead, the score of the group's mean query.

    ``tail_slot=True`` (``cis.tail_slot``): retrievals keep ``k - 1`` middle tokens (``set_size``
    is then ``dilated_set_size(k - 1, m, r)``) and every active row attends to one tail-summary pair
    besides (see the module docstring); the pairs of the anchors are kept in the
    :class:`CISState` (``tail_k``/``tail_v`` ``[L, B, H, s, D]``, ``tail_log_mass``).

    ``index`` (``cis.index``): ``"none"`` (every retrieval scores the cache), or the key index kind
    that retrievals score first, re-ranking their best ``topk + rerank_margin`` candidates exactly
    (``index_page``: tokens per page of ``"pages"``); see the module docstring. ``ops_for`` gives the
    ops table of a device that writes the prompt's index entries there: the runtime passes its own
    (:meth:`~prhs_hf.runtime.PrHSRuntime.ops_for`, the table its decode steps hand :meth:`select`);
    None: the PyTorch references, as :meth:`select`'s default. ``last_query_slot`` gives the cache slot
    of the current eager decode step's new key as the host knows it (the runtime passes its
    :meth:`~prhs_hf.runtime.PrHSRuntime.last_query_slot`), so that the step's index update reads
    nothing from the device whatever the cache's capacity; None (a selector driven without the
    runtime): :meth:`_open_index_step` reads the slot off the geometry where it is not the cache's last.
    ``decodes_sparse`` tells a prefill whether the decode steps after it run sparse (the runtime passes
    its :meth:`~prhs_hf.runtime.PrHSRuntime.decodes_sparse`, the policy's decision): only then does the
    prefill make the anchor buffers, which a compiled step must find in place; None (a selector driven
    without the runtime): every prefill makes them.
    """

    CALL_STATE = ("states", "_slot", "_prompt_devices")

    def __init__(
        self, num_layers: int, block_size: int, set_size: int,
        grouped: bool = False,
        group_score: str = "max",
        keep_anchor_local: bool = False,
        tail_slot: bool = False,
        index: str = "none",
        rerank_margin: int = 0,
        index_page: int = 16,
        ops_for: Callable[[torch.device], DecodeOps] | None = None,
        last_query_slot: Callable[[], int | None] | None = None,
        decodes_sparse: Callable[[], bool] | None = None,
    ):
        if index != "none" and index not in INDEX_KINDS:
            raise ValueError(f"cis.index: {index!r} is not allowed; allowed: none, {', '.join(INDEX_KINDS)}")
        if rerank_margin < 0:
            raise ValueError(f"cis.rerank_margin: {rerank_margin} is out of range; allowed >= 0")
        self.num_layers = num_layers
        self.block_size = block_size
        self.set_size = set_size
        self.grouped = grouped
        self.group_score = group_score
        self.keep_anchor_local = keep_anchor_local
        self.tail_slot = tail_slot
        self.index = index
        self.rerank_margin = rerank_margin
        self.index_page = index_page if index == "pages" else 1
        self.ops_for = ops_for if ops_for is not None else _reference_ops
        self.last_query_slot = last_query_slot
        self.decodes_sparse = decodes_sparse if decodes_sparse is not None else _every_step_sparse
        # layer -> its key cache, kept from its prefill until the prompt's last layer writes the index
        self._prompt_keys: dict[int, torch.Tensor] = {}
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
        layers is set up for its shape (or reset in place), with the anchor buffers where the decode
        steps after it run sparse (:attr:`decodes_sparse`)."""
        if layer == 0:
            self._prompt_devices = {}
            self._prompt_keys = {}
        self._prompt_devices[layer] = query.device
        if self.index != "none":
            self._prompt_keys[layer] = key
        if layer == self.num_layers - 1:
            batch, heads, q_len, head_dim = query.shape
            if self.grouped:  # a row per KV head, its anchors the group's queries side by side
                heads, head_dim = key.shape[1], head_dim * (heads // key.shape[1])
            index = self._index_spec(key)
            self._setup_layers(batch, heads, head_dim, self._prompt_devices, index, key.shape[2],
                               anchors=self.decodes_sparse())
            if index is not None:
                keys, self._prompt_keys = self._prompt_keys, {}
                self._write_prompt_index(keys, q_len, geom)

    def _index_spec(self, key: torch.Tensor) -> KeyIndexSpec | None:
        """The key index layout for a cache of keys like ``key [B, Hkv, S, D]`` (None: no index)."""
        if self.index == "none":
            return None
        if self.index == "int4" and key.shape[-1] % INT4_GROUP:
            raise ConfigError(f"cis.index: int4 needs a head size that is a multiple of {INT4_GROUP} (its scale "
                              f"groups); this model's is {key.shape[-1]}: use fp8 or pages")
        # codes centred on the prompt's mean key, but for grouped rows ranked by their heads' maximum
        # (prhs_hf/ops/key_index/key_index.py: stage 1 omits q . center, which differs between a group's heads)
        centered = self.index != "pages" and not (self.grouped and self.group_score == "max")
        return KeyIndexSpec(self.index, key.shape[1], key.shape[-1], key.dtype, self.index_page, centered)

    @staticmethod
    def _write_index(ops: DecodeOps, index: KeyIndex, k_cache: torch.Tensor, start: int, end: int,
                     pad: torch.Tensor | None) -> None:
        """``ops.write_key_index`` of slots ``[start, end)``; a write from slot 0 (the prompt's, or the
        first after steps that ran without the index) first sets a centred index's centre to the mean
        of the keys it writes (``pad``: each sequence's left padding, None: none), eager."""
        if start == 0 and index.center is not None:
            if pad is None:
                pad = torch.zeros(k_cache.shape[0], dtype=torch.int32, device=k_cache.device)
            index.center.copy_(key_index_center(k_cache, pad, end))
        ops.write_key_index(index, k_cache, start, end)

    def _write_prompt_index(self, keys: dict[int, torch.Tensor], q_len: int, geom: SequenceGeometry | None) -> None:
        """Write the index entries of the slots this prefill wrote (the ``q_len`` slots from the first
        query row's, the same in every sequence; without ``geom``, the cache's last ``q_len``) and of
        any slot before them that the index missed, for every layer (eager: reads one int)."""
        slots = keys[self.num_layers - 1].shape[2]
        start = slots - q_len if geom is None else int((geom.pad + geom.q_start).max())
        end = start + q_len
        for layer, key in keys.items():
            device, local = self._slot[layer]
            state = self.states[device]
            self._write_index(self.ops_for(device), state.key_index(local, key.shape[2]), key,
                              min(state.index_end, start), end, None if geom is None else geom.pad)
        for state in self.states.values():
            state.index_end = end

    def setup(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        """Buffers for decode steps of this shape with every layer on ``device`` (the anchors' too)."""
        self._setup_layers(batch, heads, head_dim, dict.fromkeys(range(self.num_layers), device), anchors=True)

    def _setup_layers(
        self, batch: int, heads: int, head_dim: int, devices: dict[int, torch.device],
        index: KeyIndexSpec | None = None, index_slots: int = 0, anchors: bool = True,
    ) -> None:
        """One state per device for the layers on it; existing ones of the right shape are reset
        in place, so that a compiled step keeps seeing the same addresses from one generate()
        call to the next. ``index``: the key index layout (None: none), with room for
        ``index_slots`` cache slots (an index of that layout that is too small grows, its entries
        kept: a chunked prefill writes only its own slots). ``anchors``: make the anchor buffers
        now (:meth:`CISState.ensure_anchors`; else the first sparse step does, :meth:`step_state`)."""
        if sorted(devices) != list(range(self.num_layers)):
            raise RuntimeError(f"CIS saw the prefill of layers {sorted(devices)} of {self.num_layers}")
        per_device: dict[torch.device, list[int]] = {}
        for layer in range(self.num_layers):
            per_device.setdefault(devices[layer], []).append(layer)
        self._slot = {layer: (dev, i) for dev, layers in per_device.items() for i, layer in enumerate(layers)}
        for dev, layers in per_device.items():
            state = self.states.get(dev)
            if state is not None and state.set_size != self.set_size:
                state = None  # anchor sets of another top-k (budget.topk_fraction: the runtime sets set_size)
            if state is not None and index is not None and state.index_spec == index:
                state.grow_key_index(index_slots)
            if state is None or not state.matches(len(layers), batch, heads, head_dim, dev, index, index_slots):
                self._allocate(dev, len(layers), batch, heads, head_dim, index, index_slots)
            else:
                state.reset()
            if anchors:
                self.states[dev].ensure_anchors()
        for dev in [d for d in self.states if d not in per_device]:
            del self.states[dev]

    @torch.compiler.disable
    def _allocate(
        self, device: torch.device, layers: int, batch: int, heads: int, head_dim: int,
        index: KeyIndexSpec | None = None, index_slots: int = 0,
    ) -> None:
        # eager even inside a compiled forward: the buffers must live outside any CUDA graph pool; and
        # normal tensors even under inference_mode: reset() zeroes them in place outside it (lm-eval)
        with torch.inference_mode(False):
            self.states[device] = CISState(layers, batch, heads, head_dim, self.block_size, self.set_size, device,
                                           index, index_slots)

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """One decode step of ``layer`` for ``q [B, Hq, D]`` (SPEC §4 steps 1-4) on the decode ops
        ``ops``; the first layer of each device's state opens the step for its layers."""
        return self.finish(self.start(layer, q, k_cache, geom, params, scale, ops), q, k_cache, v_cache, geom, scale)

    def start(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, geom: SequenceGeometry, params: DecodeParams,
        scale: float, ops: DecodeOps = REFERENCE_OPS, fork: bool = False,
    ) -> CISStart:
        """Match, retrieval and composition of ``layer``'s step (:func:`cis_select` on ``ops``), the
        part that reads only the anchors, the middle of the cache and ``q``. ``fork=True`` launches it
        on a side CUDA stream (:func:`~prhs_hf.ops.side_stream.fork_cis_select`; EarlySelectKV's
        ``side_stream``), unless ``layer`` opens its device's step; :meth:`finish` joins it."""
        state, local = self.step_state(layer)
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
        k = p.topk - 1 if self.tail_slot else p.topk  # the tail slot is charged to the top-k budget
        sizes = dict(tau=p.tau, sink=p.sink, k=k, dil_m=p.dilation_topm, dil_r=p.dilation_radius, cap=p.capacity,
                     scale=scale, grouped=self.grouped, group_score=self.group_score)
        args = (q, k_cache, geom.pad, f.t, f.lo, f.hi, win_start, anchor_q, anchor_count, anchor_set, f.active)
        if fork and local > 0:
            if self.index != "none":  # the config refuses it: the step's key is not in the cache yet
                raise ValueError("cis.index: a forked (side stream) selection cannot update the key index first")
            ticket, keep = fork_cis_select(layer, ops, *args, **sizes)
            return CISStart(layer, ops, p, f, win_start, None, (ticket, keep, sizes))
        # the anchors recorded in the composition's launch, unless the tail pairs go with them
        record = None if self.tail_slot else state.anchor_record(local)
        key_index = None if self.index == "none" else self._step_index(state, local, k_cache, geom, ops)
        selection = cis_select(ops, *args, **sizes, record=record, key_index=key_index, margin=self.rerank_margin)
        return CISStart(layer, ops, p, f, win_start, selection, None)

    def step_state(self, layer: int) -> tuple[CISState, int]:
        """``(the state of layer's device, the layer's index in it)`` for a decode step that runs the
        selector, with the anchor buffers made where the prefill left them out (the generation's
        first sparse step, eager: before a CUDA graph of the step is captured)."""
        slot = self._slot.get(layer)
        if slot is None:
            raise RuntimeError("CIS decode step before any prefill: run the prompt through the patched model first")
        device, local = slot
        state = self.states[device]
        if state.anchor_q is None:
            if torch.compiler.is_compiling():
                raise RuntimeError("CIS: a compiled decode step runs sparse where the eager forward before it "
                                   "decided dense and made no anchors: run an eager forward that decides sparse first")
            state.ensure_anchors()
        return state, local

    def _step_index(
        self, state: CISState, local: int, k_cache: torch.Tensor, geom: SequenceGeometry, ops: DecodeOps
    ) -> KeyIndex:
        """``layer``'s key index with this step's key written (``ops.update_key_index`` of the slot
        ``pad + t - 1``, graph-safe). An eager step first makes room (a dynamic cache that outgrew the
        index; an index set up by :meth:`setup`, before any key) and writes the slots of the steps
        this selector did not see (:meth:`_open_index_step`)."""
        slots = k_cache.shape[2]
        if state.key_index_a is None or slots > state.index_slots:
            if torch.compiler.is_compiling() and state.key_index_a is None:
                raise RuntimeError("cis.index: a compiled decode step before the key index was set up: run the "
                                   "prompt through the patched model eagerly first")
            self._index_room(state, k_cache)
        index = state.key_index(local, slots)
        if not torch.compiler.is_compiling():
            if local == 0:
                self._open_index_step(state, slots, geom)
            if state.index_gap is not None:
                self._write_index(ops, index, k_cache, *state.index_gap, geom.pad)
        ops.update_key_index(index, k_cache, geom.pad + geom.t_last - 1)
        return index

    @torch.compiler.disable
    def _index_room(self, state: CISState, k_cache: torch.Tensor) -> None:
        if state.key_index_a is None:
            with torch.inference_mode(False):
                state.index_spec = self._index_spec(k_cache)
                state._make_key_index(k_cache.shape[2])
            state.index_end = 0
        state.grow_key_index(k_cache.shape[2])

    def _open_index_step(self, state: CISState, slots: int, geom: SequenceGeometry) -> None:
        """At an eager step's first layer: the slots its layers write before their update
        (``state.index_gap``: those after ``state.index_end`` and before the new key's, or None).
        The new key's slot is the runtime's host count (:attr:`last_query_slot`: no read, whatever
        the cache). Without it (a selector driven by hand) the key is taken to be at the cache's last
        slot when the index is current up to it (a dynamic cache's steps); elsewhere (a static or
        buffered cache, steps the selector missed, a cropped cache) its slot is read (one sync)."""
        newest = None if self.last_query_slot is None else self.last_query_slot()
        if newest is None:
            newest = slots - 1
            if newest != state.index_end:
                newest = int((geom.pad + geom.t_last).max()) - 1
        state.index_gap = (state.index_end, newest) if newest > state.index_end else None
        state.index_end = newest + 1

    def finish(
        self, started: CISStart, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, scale: float,
    ) -> DecodeSelection:
        """The rest of the step :meth:`start` began (joined first if it was forked), on the start's ops:
        the anchors of the retrieving rows recorded (a forked selection's; the others recorded them),
        the tail pairs with ``cis.tail_slot``, the selection."""
        device, local = self._slot[started.layer]
        state = self.states[device]
        f = started.frame
        sel = started.selection
        if sel is None:
            ticket, keep, sizes = started.forked
            kv_heads = k_cache.shape[1]
            rows = kv_heads if self.grouped else q.shape[1]
            best, new_idx, new_set, idx, count = join_cis_select(
                ticket, keep, started.layer, rows=rows, k=sizes["k"], dil_m=sizes["dil_m"], dil_r=sizes["dil_r"],
                cap=sizes["cap"])
            sel = CISSelection(best, new_idx, new_set, idx, count, group_query(q, kv_heads) if self.grouped else q)
        retrieved = sel.best == -1
        ops = started.ops
        if not self.tail_slot:
            if started.forked is not None:
                state.record(ops, local, sel.match_q, sel.new_set, sel.best)
            return DecodeSelection(sel.idx, sel.count, retrieved, f.active)
        tail, stored = self._tail_step(state, local, q, k_cache, v_cache, geom, f.t, f.lo,
                                       torch.minimum(f.hi, started.win_start), sel, started.params, scale)
        state.record(ops, local, sel.match_q, sel.new_set, sel.best, stored)
        charged = torch.isfinite(tail[2])
        return DecodeSelection(sel.idx, sel.count + charged.to(sel.count.dtype), retrieved, f.active, tail)

    def _tail_step(
        self, state: CISState, local: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, t: torch.Tensor, lo: torch.Tensor, end: torch.Tensor, sel: CISSelection,
        p: DecodeParams, scale: float,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(this step's tail pair of every row, the pair a retrieving row stores as its anchor's)``
        (``log_mass = -inf``: none). A retrieving row's own pair summarises ``[lo, end)`` minus its
        top-k, a sharing row takes its anchor's; the stored one is ``[lo, end)`` minus the dilated set."""
        B, H = sel.best.shape
        member_sets = [sel.new_idx]
        dilated = p.dilation_radius > 0 and p.dilation_topm > 0
        if dilated:
            member_sets.append(torch.where(sel.new_set != SET_NONE, torch.div(sel.new_set, 2, rounding_mode="floor"), -1))
        own, *rest = tail_summaries(q, k_cache, v_cache, geom.pad, t, lo, end, member_sets, scale)
        stored = rest[0] if dilated else own
        state.ensure_tails(k_cache.shape[-1])
        tk, tv, tm = state.anchor_tails(local)  # [B, H, s, D], [B, H, s]
        D = tk.shape[-1]
        best = sel.best.clamp_min(0).long()[:, :, None]
        shared = (tk.gather(2, best[..., None].expand(B, H, 1, D)).squeeze(2),
                  tv.gather(2, best[..., None].expand(B, H, 1, D)).squeeze(2),
                  tm.gather(2, best).squeeze(2))
        retrieved = (sel.best == -1)
        none = torch.full_like(own[2], float("-inf"))
        log_mass = torch.where(retrieved, own[2], torch.where(sel.best >= 0, shared[2], none))
        pick = retrieved[..., None]
        return (torch.where(pick, own[0], shared[0]), torch.where(pick, own[1], shared[1]), log_mass), stored

    @property
    def undo_period(self) -> int:
        """An undo of decode steps is exact up to a block end followed by another step
        (:meth:`CISState.mark`): the block size."""
        return self.block_size

    def mark_step(self) -> StepMark:
        """Each device state's :meth:`CISState.mark`; the counter is layer 0's state's ``step``
        (:class:`~prhs_hf.selectors.base.UndoesSteps`)."""
        marks = {device: state.mark() for device, state in self.states.items()}
        slot = self._slot.get(0)
        return StepMark(marks, None if slot is None else marks[slot[0]][1])

    def undo_to(self, mark: StepMark) -> None:
        """Put every device state back to ``mark``."""
        for device, kept in mark.state.items():
            self.states[device].undo_to(kept)

    def index_nbytes(self) -> int:
        """Bytes the key index of the generation in progress holds on every device (0 without one)."""
        return sum(state.index_nbytes() for state in self.states.values())

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search."""
        for state in self.states.values():
            state.reorder(index)

    def reset(self) -> None:
        """Forget the anchors (the buffers stay)."""
        for state in self.states.values():
            state.reset()

    def restart(self, index_valid: int) -> None:
        """Start over on a cache that was cut back (``Cache.crop``): no anchors, step 0, as after a
        prefill; the key index entries of the slots from ``index_valid`` on are written again by the
        next step (``index_valid`` 0: all of them, a centred index's centre too, as a prompt's)."""
        for state in self.states.values():
            state.reset()
            state.index_end = min(state.index_end, index_valid)
            state.index_gap = None
