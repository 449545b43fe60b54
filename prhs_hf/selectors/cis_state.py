"""The state of Clustered Index Sharing for every layer: the anchors of the current block (SPEC §4).

One fixed-shape device tensor per kind for the whole model (``[L, B, Hq, ...]``), allocated once
per prompt shape and updated in place without host synchronisation, so that a compiled,
CUDA-graph-captured decode step sees few, fixed graph inputs. Anchors hold real indices (left
padding excluded), which stay valid while a sequence grows and follow their sequence under beam
reordering.

The state is made at a prefill (``CISSelector.observe_prefill``) with the anchor counts and the step
counter; the anchors themselves (``anchor_q``, ``anchor_idx``, the largest buffers: ``[L, B, Hq, s,
n]`` int32) are made by :meth:`CISState.ensure_anchors` only once a decode step will run sparse: at
that prefill where the policy decides that the decode steps after it do (the decision compiled steps
keep), else at the generation's first sparse eager step. A generation that the policy decodes dense
never holds them.

With ``cis.index`` the state also holds the key index of every layer (``kernels.key_index``): one
capacity buffer per tensor of the index, ``[L, B, Hkv, S_cap, ...]`` over cache slots, of which each
step reads a view of the cache's slots (:meth:`CISState.key_index`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..ops.compose.dilated_set import SET_NONE
from ..ops.compose.record_anchors import anchor_slots
from ..ops.decode_ops import AnchorRecord, DecodeOps
from ..ops.key_index.key_index import KeyIndex, allocate_key_index

__all__ = ["CISState", "KeyIndexSpec", "INDEX_GROWTH"]

INDEX_GROWTH = 1.5
"""A key index that a growing (dynamic) cache outgrows is reallocated this many times larger."""


class KeyIndexSpec(NamedTuple):
    """The layout of a model's key index: ``kind`` (``fp8``, ``int4``, ``pages``), the cache's KV
    heads, head size and dtype, ``page`` (tokens per page of ``pages``; 1 otherwise) and whether its
    codes are centred (``KeyIndex.center``: fp8 and int4 for per-head rows)."""

    kind: str
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page: int
    centered: bool = False


class CISState:
    """The block's anchors for every (layer, sequence, query head).

    Attributes:
        shape: ``(L, B, Hq, D)``, the decode steps' layers, sequences, rows (query heads, or KV heads
            with group selection) and query size the buffers are made for; ``device`` their device.
        anchor_q: ``[L, B, Hq, s, D]`` fp32 unit query vectors; None until :meth:`ensure_anchors`.
        anchor_idx: ``[L, B, Hq, s, n]`` int32 each anchor's dilated middle set, sorted once when
            the anchor is taken (``kernels.dilated_set.dilated_set``: top-k plus the ±r
            neighbours of the top-m, encoded ``(j << 1) | neighbour_only``, ``SET_NONE`` padded),
            so sharing steps only filter it to the current middle region; None until
            :meth:`ensure_anchors`.
        anchor_count: ``[L, B, Hq]`` int32 number of valid anchors in the current block.
        step: ``[]`` int64 decode steps taken since the last prefill (one per forward, all layers).
        tail_k, tail_v, tail_log_mass: with ``cis.tail_slot`` (made by :meth:`ensure_tails`, else
            None): ``[L, B, Hq, s, D]`` fp32 each anchor's tail-summary key/value and ``[L, B, Hq, s]``
            its log-mass (``-inf``: none), written with the anchor by :meth:`record`.
        key_index_a, key_index_b: with ``cis.index`` (``index`` given, else None): the key index of
            every layer, ``[L, B, Hkv, S_cap, ...]`` (pages: ``ceil(S_cap / page)`` pages), the
            ``a``/``b`` of :class:`~prhs_hf.ops.key_index.key_index.KeyIndex`; ``S_cap`` (``index_slots``)
            is at least the cache's slot count (:meth:`grow_key_index`).
        index_end: host int, the cache slots ``[0, index_end)`` whose index entries are current
            (kept by the selector's eager forwards; a compiled step leaves it behind, which only
            makes the next eager step rewrite entries that were already current).
    """

    def __init__(
        self, layers: int, batch: int, heads: int, head_dim: int, block_size: int, set_size: int, device: torch.device,
        index: KeyIndexSpec | None = None, index_slots: int = 0,
    ):
        self.shape = (layers, batch, heads, head_dim)
        self.block_size = block_size
        self.set_size = set_size
        self.anchor_q: torch.Tensor | None = None
        self.anchor_idx: torch.Tensor | None = None
        self.anchor_count = torch.zeros(layers, batch, heads, dtype=torch.int32, device=device)
        self.device = self.anchor_count.device  # with its index ("cuda:0" for "cuda"), as matches() compares
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        for buffer in (self.anchor_count, self.step):
            # fixed addresses: a compiled, CUDA-graph-captured decode step mutates them in place
            torch._dynamo.mark_static_address(buffer)
        self.tail_k: torch.Tensor | None = None
        self.tail_v: torch.Tensor | None = None
        self.tail_log_mass: torch.Tensor | None = None
        self.index_spec = index
        self.index_slots = 0
        self.index_end = 0
        # the slots [start, end) that every layer of the open eager step writes before its update
        # (steps the selector did not see: a dense forward of the policy, a compiled one), or None
        self.index_gap: tuple[int, int] | None = None
        self.key_index_a: torch.Tensor | None = None
        self.key_index_b: torch.Tensor | None = None
        self.key_index_center: torch.Tensor | None = None  # [L, B, Hkv, D] fp32 with a centred index
        if index is not None:
            self._make_key_index(index_slots)

    def ensure_anchors(self) -> None:
        """Make the anchor buffers (``anchor_q`` zeroed, ``anchor_idx`` ``SET_NONE``) if they are not
        there yet; kept from then on, reset in place with the rest. A decode step reads only the first
        ``anchor_count`` of them, so buffers made after some steps that did not run the selector hold
        what buffers made at the prefill would. (A plain check, so that a compiled prefill that finds
        them made traces no call; the making is eager.)"""
        if self.anchor_q is None:
            self._make_anchors()

    @torch.compiler.disable
    def _make_anchors(self) -> None:
        # eager even inside a compiled forward, and normal tensors even under inference_mode, as the
        # state itself (CISSelector._allocate)
        layers, batch, heads, head_dim = self.shape
        with torch.inference_mode(False):
            self.anchor_q = torch.zeros(layers, batch, heads, self.block_size, head_dim, dtype=torch.float32,
                                        device=self.device)
            self.anchor_idx = torch.full((layers, batch, heads, self.block_size, self.set_size), SET_NONE,
                                         dtype=torch.int32, device=self.device)
        for buffer in (self.anchor_q, self.anchor_idx):
            torch._dynamo.mark_static_address(buffer)

    def _make_key_index(self, slots: int) -> None:
        """Zeroed index buffers for ``slots`` cache slots (the layers side by side on the batch axis
        of one :func:`~prhs_hf.ops.key_index.key_index.allocate_key_index`)."""
        spec = self.index_spec
        layers, batch = self.shape[:2]
        made = allocate_key_index(spec.kind, layers * batch, spec.kv_heads, slots, spec.head_dim, spec.dtype,
                                  self.device, spec.page)
        self.key_index_a = made.a.view(layers, batch, *made.a.shape[1:])
        self.key_index_b = made.b.view(layers, batch, *made.b.shape[1:])
        self.index_slots = slots
        if spec.centered and self.key_index_center is None:  # kept when the index grows
            self.key_index_center = torch.zeros(layers, batch, spec.kv_heads, spec.head_dim, dtype=torch.float32,
                                                device=self.device)
            torch._dynamo.mark_static_address(self.key_index_center)
        for buffer in (self.key_index_a, self.key_index_b):
            torch._dynamo.mark_static_address(buffer)

    def _index_rows(self, slots: int) -> int:
        """Rows of the index's slot axis that cover ``slots`` cache slots (pages: whole pages)."""
        return -(-slots // self.index_spec.page)

    @torch.compiler.disable
    def grow_key_index(self, slots: int) -> None:
        """Make room for ``slots`` cache slots: a new buffer ``INDEX_GROWTH`` times larger (at least
        ``slots``), the current entries copied. Eager even inside a compiled forward; a static cache
        never needs it (its slot count is the index's from its prefill)."""
        if slots <= self.index_slots:
            return
        old_a, old_b, old_slots = self.key_index_a, self.key_index_b, self.index_slots
        with torch.inference_mode(False):  # as the state's other buffers
            self._make_key_index(max(slots, math.ceil(old_slots * INDEX_GROWTH)))
            rows = self._index_rows(old_slots)
            self.key_index_a[:, :, :, :rows].copy_(old_a[:, :, :, :rows])
            self.key_index_b[:, :, :, :rows].copy_(old_b[:, :, :, :rows])

    def key_index(self, layer: int, slots: int) -> KeyIndex:
        """``layer``'s key index over the first ``slots`` cache slots (views into the buffers, which
        the ops write in place; not contiguous where the capacity exceeds ``slots``)."""
        rows = self._index_rows(slots)
        spec = self.index_spec
        center = None if self.key_index_center is None else self.key_index_center[layer]
        return KeyIndex(spec.kind, self.key_index_a[layer, :, :, :rows], self.key_index_b[layer, :, :, :rows],
                        spec.page, center)

    def index_nbytes(self) -> int:
        """Bytes the key index buffers hold (0 without an index)."""
        buffers = (self.key_index_a, self.key_index_b, self.key_index_center)
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    @torch.compiler.disable
    def ensure_tails(self, dim: int) -> None:
        """The anchors' tail-pair buffers for head size ``dim`` (kept while they fit; eager even
        inside a compiled forward, as the state itself: they must live outside any CUDA graph pool).
        Made by the first sparse step's tail summary (``CISSelector._tail_step``), as the anchors."""
        if self.tail_k is not None and self.tail_k.shape[-1] == dim:
            return
        shape = (*self.shape[:3], self.block_size, dim)
        with torch.inference_mode(False):  # as the state's other buffers (CISSelector._allocate)
            self._make_tails(shape)

    def _make_tails(self, shape: tuple[int, ...]) -> None:
        self.tail_k = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.tail_log_mass = torch.full(shape[:-1], float("-inf"), dtype=torch.float32, device=self.device)
        for buffer in (self.tail_k, self.tail_v, self.tail_log_mass):
            torch._dynamo.mark_static_address(buffer)

    def anchor_tails(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tail_k, tail_v, tail_log_mass)`` of ``layer`` (views; after :meth:`ensure_tails`)."""
        return self.tail_k[layer], self.tail_v[layer], self.tail_log_mass[layer]

    #: the buffers with a batch axis (axis 1), as attribute names (those not made yet are None)
    BATCHED = ("anchor_q", "anchor_idx", "anchor_count", "tail_k", "tail_v", "tail_log_mass", "key_index_a",
               "key_index_b", "key_index_center")

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(b for b in (getattr(self, name) for name in self.BATCHED) if b is not None)

    def matches(
        self, layers: int, batch: int, heads: int, head_dim: int, device: torch.device,
        index: KeyIndexSpec | None = None, index_slots: int = 0,
    ) -> bool:
        """Whether the buffers fit decode steps of this shape, with a key index of layout ``index``
        (None: none) and room for ``index_slots`` cache slots."""
        return (self.shape == (layers, batch, heads, head_dim) and self.device == device
                and self.index_spec == index and (index is None or index_slots <= self.index_slots))

    def reset(self) -> None:
        """Start over (a new prompt) in place: no anchors, step 0; the addresses stay the same (anchor
        buffers made for an earlier prompt are kept). The key index stays: its entries follow the
        cache's keys, which a reset leaves as they are (a prefill rewrites those of the slots it
        writes, :attr:`index_end`)."""
        self.anchor_count.zero_()
        self.step.zero_()

    def mark(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What a decode step changes that a later step reads: copies of ``anchor_count`` and ``step``
        (no host read), and ``index_end``; :meth:`undo_to` puts them back.

        That is all of it within a block: a record writes each row's slot ``anchor_count`` or past
        it, never a valid anchor (the first ``anchor_count``), and the same slot of the tail pairs;
        a key index update writes the new key's slot (``pages``: its page, recomputed from the
        cache's keys up to it), which the next step after the undo writes again. Not across a block's
        last step followed by another step: that step clears the counts and the next one writes
        slot 0 on, over anchors that the undone-to state counts (``CISSelector.undo_period``).
        """
        return self.anchor_count.clone(), self.step.clone(), self.index_end

    def undo_to(self, mark: tuple[torch.Tensor, torch.Tensor, int]) -> None:
        """Put back the state :meth:`mark` took (in place: the addresses stay)."""
        count, step, index_end = mark
        self.anchor_count.copy_(count)
        self.step.copy_(step)
        self.index_end = index_end
        self.index_gap = None

    def begin_step(self) -> None:
        """Open a decode step (once per forward, before any layer). The anchors of a block of ``s``
        steps are cleared by each layer's :meth:`record` at the block's last step (the contract of
        ``record_anchors``)."""
        # add_(), not +=: ``x += y`` rebinds the attribute, which Dynamo replays after every
        # compiled step as an extra graph output and a Python setattr (host time per step)
        self.step.add_(1)

    def anchors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(anchor_q, anchor_idx, anchor_count)`` of ``layer`` (views; after :meth:`ensure_anchors`)."""
        return self.anchor_q[layer], self.anchor_idx[layer], self.anchor_count[layer]

    def anchor_record(self, layer: int) -> AnchorRecord:
        """Where a selection records ``layer``'s anchors in its own launch (``decode_ops.cis_select``'s
        ``record``, the same contract as :meth:`record`; after :meth:`ensure_anchors`)."""
        return AnchorRecord(self.anchor_q, self.anchor_idx, self.anchor_count, layer, self.step)

    def record(
        self, ops: DecodeOps, layer: int, q: torch.Tensor, indices: torch.Tensor, best: torch.Tensor,
        tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store ``(q / ||q||, dilated set)`` (and, with ``tail``, its tail pair ``(key [B, H, D],
        value [B, H, D], log_mass [B, H])``) as a new anchor of each row of ``layer`` that retrieved
        (``best == -1``), with ``ops.record_anchors`` (its contract: every row writes its slot
        ``anchor_count``, the first one not in use, and only the rows that retrieved count it; a
        block of ``s`` steps takes at most ``s`` anchors, so the slot is always in range, and at
        the block's last step the record clears the layer's anchors for the next block)."""
        if tail is not None:  # at the slot the record takes, before it counts
            where = anchor_slots(self.anchor_count, layer, self.block_size)
            self.tail_k.index_put_(where, tail[0])
            self.tail_v.index_put_(where, tail[1])
            self.tail_log_mass.index_put_(where, tail[2])
        ops.record_anchors(self.anchor_q, self.anchor_idx, self.anchor_count, layer, q, indices, best, self.step)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow the cache's batch: sequence ``i`` becomes old sequence ``index[i]`` in every layer (a
        beam reordering, in place: the addresses stay fixed; or ``Cache.batch_select_indices`` /
        ``batch_repeat_interleave``, whose ``index`` has another length: new buffers of that batch)."""
        index = index.to(self.device)
        if index.numel() == self.shape[1]:
            for buffer in self._buffers():
                buffer.copy_(buffer.index_select(1, index))
            return
        with torch.inference_mode(False):  # normal tensors, as the state's others (CISSelector._allocate)
            for name in self.BATCHED:
                buffer = getattr(self, name)
                if buffer is not None:
                    moved = buffer.index_select(1, index)
                    torch._dynamo.mark_static_address(moved)
                    setattr(self, name, moved)
        layers, _, heads, head_dim = self.shape
        self.shape = (layers, index.numel(), heads, head_dim)
