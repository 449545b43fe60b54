"""The PrHS state of one patched model: resolved config, layers, backends, telemetry, and the
state of each generation, which lives on that generation's cache (:class:`CallState`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import threading
import warnings
import weakref
from contextvars import ContextVar
from typing import Any, Callable

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer

from .backends import dense_prefill_function, pick_decode_ops, prefill_function
from .compat import cache_argument
from .config import ConfigError, ResolvedConfig
from .geometry import ForwardContext, SequenceGeometry, check_layout, geometry_from_mask
from .layer import PrHSLayer, StepGraph
from .ops.decode_ops import DecodeOps
from .ops.key_index.key_index import candidate_count, index_bytes_per_slot
from .ops.sparse_attention.group_union import MAX_GROUP
from .policy import DecodeShape, cost_model_for
from .selectors import CISSelector, cis_set_size, make_selector
from .selectors.base import StepMark, export_call_state, import_call_state, undo_period, undoes_steps
from .telemetry_counters import Telemetry

__all__ = ["BufferedLayer", "CallState", "PrHSRuntime", "SelectorRollback", "CALL_STATE_ATTRIBUTE", "DENSE_RUNTIMES",
           "buffer_cache"]

CALL_STATE_ATTRIBUTE = "_prhs_call_state"
"""The cache attribute that holds the :class:`CallState` of the generation that fills the cache."""

DENSE_RUNTIMES: ContextVar[frozenset] = ContextVar("prhs_dense_runtimes", default=frozenset())
"""The runtimes whose forwards in this context attend densely whatever the policy decides (a
patched ``generate()`` in assisted decoding: ``prhs_hf.patching.generate_without_step_reads``)."""

#: the batch edits of a ``Cache`` that the state on it follows (:class:`FollowBatchEdit`)
BATCH_EDITS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave")


class CallState:
    """What a patched model remembers of one generation between its forwards: the selector's
    ``CALL_STATE`` (CIS anchors, a baseline's scores), kept on the generation's cache.

    So the state follows the cache as its keys and values do: a continuation from a cache sees
    only what that cache's forwards left, whatever other ``generate()`` calls ran in between, and
    ``copy.deepcopy(cache)`` copies it with the cache (a prefix cache). ``runtime`` is the patch
    the state belongs to (never copied); ``prefilled``: a prefill of this cache ran under it.
    Of the last eager forward over the cache (what :class:`SelectorRollback` reads):
    ``sparse_decode``, the policy's decision (a compiled decode step that follows keeps it), and
    ``prefill_end``, the cache's slots after the last prefill (None before any).

    So that the state follows what transformers does to the cache between forwards: ``batch``, the
    sequences of the last prefill (``Cache.reorder_cache``, ``batch_select_indices`` and
    ``batch_repeat_interleave`` carry the state along: :class:`FollowBatchEdit`); ``slots``, the
    cache's tokens after the last eager forward, against which the next one sees a ``Cache.crop``;
    and ``history``, ``(slots, mark)`` before each of the last sparse decode steps since the last
    prefill (``history_complete``: none dropped), to which a crop puts the state back
    (:meth:`PrHSRuntime._follow_crop`).
    """

    def __init__(self, runtime: "PrHSRuntime", fields: list[dict[str, Any]]):
        self.runtime = runtime
        self.fields = fields
        self.prefilled = False
        self.sparse_decode = False
        self.prefill_end: int | None = None
        # the cache is compileable (a StaticCache): compiled steps over it read the selector's state
        # without binding it, so a finished generate() leaves it bound (PrHSRuntime._unbind)
        self.compiled_steps = False
        self.batch: int | None = None
        self.slots: int | None = None
        self.history: list[tuple[int, StepMark]] = []
        self.history_complete = True

    def cut(self, slots: int) -> None:
        """The cache was cut back to ``slots`` tokens and the state put back to match (the periodic
        stop check's undo): the marks of the steps undone go."""
        self.slots = slots
        self.history = [entry for entry in self.history if entry[0] < slots]

    def __deepcopy__(self, memo: dict) -> "CallState":
        if self.runtime.bound is self:  # the selector holds the live objects: take them first
            self.fields = export_call_state(self.runtime.selector)
        twin = CallState(self.runtime, copy.deepcopy(self.fields, memo))
        twin.prefilled, twin.sparse_decode, twin.prefill_end = self.prefilled, self.sparse_decode, self.prefill_end
        twin.compiled_steps = self.compiled_steps
        twin.batch, twin.slots, twin.history_complete = self.batch, self.slots, self.history_complete
        twin.history = copy.deepcopy(self.history, memo)
        return twin

    def __reduce__(self):
        # a pickled cache leaves its PrHS state behind (the runtime is not picklable): decoding on
        # the unpickled copy then raises, as on any cache this patch did not prefill
        return (_no_call_state, ())


def _no_call_state() -> None:
    return None


class FollowBatchEdit:
    """One of a cache's :data:`BATCH_EDITS`, set on the cache instance when a patch first keeps its
    state there: it runs the cache's own method, then makes the state of every sequence follow its
    row (:meth:`PrHSRuntime.follow_batch`). A copy of the cache (``copy.deepcopy``) gets its own; a
    pickled cache, which leaves its state behind (``CallState.__reduce__``), gets the plain method.

    It holds its cache by a weak reference: a strong one, in the cache's own ``__dict__``, would make a
    reference cycle, and a finished ``generate()``'s cache (its whole KV memory) would then outlive the
    call until Python's cyclic garbage collector ran, still held while the next ``generate()``
    allocates its cache and prefills beside it (an out-of-memory at a size where one cache fits)."""

    def __init__(self, cache, name: str):
        self._cache = weakref.ref(cache)
        self.name = name

    @property
    def cache(self):
        """The cache this edit belongs to (alive while it is called: it is found on the cache)."""
        return self._cache()

    def __call__(self, *args, **kwargs):
        cache = self.cache
        getattr(type(cache), self.name)(cache, *args, **kwargs)
        arg = args[0] if args else next(iter(kwargs.values()))  # (the beam / kept indices, or the repeats)
        call = cache.__dict__.get(CALL_STATE_ATTRIBUTE)
        if call is None or call.batch is None:
            return None
        # on the index's device, no read (beam search reorders at every step)
        rows = torch.arange(call.batch, device=arg.device if isinstance(arg, torch.Tensor) else None)
        if self.name == "batch_repeat_interleave":
            rows = rows.repeat_interleave(arg)
        else:  # a reordering (beam search), or the sequences kept (any index: tensor, list, mask)
            rows = rows[arg]
        call.runtime.follow_batch(call, rows)
        return None

    def __deepcopy__(self, memo: dict) -> "FollowBatchEdit":
        return FollowBatchEdit(copy.deepcopy(self.cache, memo), self.name)

    def __reduce__(self):  # (pickle only: a copy keeps following, __deepcopy__)
        return (getattr, (self.cache, self.name))


def _follow_batch_edits(cache) -> None:
    """Make ``cache``'s :data:`BATCH_EDITS` carry its PrHS state along (:class:`FollowBatchEdit`)."""
    for name in BATCH_EDITS:
        if callable(getattr(type(cache), name, None)) and name not in cache.__dict__:
            setattr(cache, name, FollowBatchEdit(cache, name))


class PrHSRuntime:
    """Everything :func:`prhs_hf.patch` attaches to a model (``model._prhs_runtime``)."""

    def __init__(self, resolved: ResolvedConfig, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 reduce_group: Any = None):
        """``reduce_group``: the tensor parallel ranks' process group that ``telemetry(reduce=True)``
        reduces over (None without tensor parallelism)."""
        self.resolved = resolved
        self.reduce_group = reduce_group
        # what the patch installed on the model for this runtime (prhs_hf.patching.Installation), while
        # it is installed: attach / detach
        self._installed: Any = None
        self.num_heads = num_heads
        self.head_dim = head_dim
        c = resolved.config
        self.telemetry = Telemetry(resolved.num_layers, num_heads, c.telemetry.oracle, num_kv_heads) if c.telemetry.enabled else None
        self.layers = [PrHSLayer(self, i) for i in range(resolved.num_layers)]
        # the decode selector: a baseline that baseline.name names, else CIS if it is on, else none
        self.selector = make_selector(resolved, num_heads, ops_for=self.ops_for,  # one ops table per device
                                      last_query_slot=self.last_query_slot, decodes_sparse=self.decodes_sparse)
        # a config that changes nothing keeps transformers' own dense path (the unpatched model's bits)
        self.passthrough = self.selector is None and not any(
            layer.plans_prefill or layer.window_decode for layer in self.layers
        )
        self._ops: dict[torch.device, DecodeOps] = {}  # device -> its decode ops table (ops_for)
        # prefill routes per (device, attention dtype): FA4 takes fp16/bf16 only
        self._prefill: dict[tuple[torch.device, torch.dtype], Callable] = {}
        self._dense_prefill: dict[tuple[torch.device, torch.dtype], Callable | None] = {}
        # the geometry's fixed buffers (_store_geometry), which the forwards' contexts hold
        self._geometry: SequenceGeometry | None = None
        # the generation whose state the selector holds now, and the empty state a new one starts from
        self.bound: CallState | None = None
        self._fresh_state = copy.deepcopy(export_call_state(self.selector)) if self.selector is not None else None
        # one eager forward at a time (patch() takes it around the model's forward): the forward's
        # geometry, plans and bound state are the runtime's, so two threads' forwards take turns
        self.forward_lock = threading.RLock()
        self.num_kv_heads = num_kv_heads or num_heads
        _check_sparse_attention(c.backend.sparse_attention, num_heads, self.num_kv_heads)
        self._cost_models: dict[str, object] = {}  # device type -> its cost model (None: auto is sparse)
        # backend.eager_step: a DynamicCache's layers become BufferedLayers (all but "plain"),
        # whose whole buffers the sparse step reads (ForwardContext.kv_buffers: this forward's cache layers)
        backend = resolved.config.backend
        self.kv_growth = backend.kv_growth if backend.eager_step != "plain" else None
        # the sparse steps PrHSLayer captures as CUDA graphs: plain CIS (its tail slot allocates in the
        # step; the baselines read the host) with telemetry off; "auto" also leaves a key index's
        # steps uncaptured (their index update finds the new key's slot on the host), which
        # "graphs" refuses (config validation)
        self.graphed = (backend.eager_step in ("graphs", "auto") and self.telemetry is None
                        and type(self.selector) is CISSelector and not self.selector.tail_slot
                        and (backend.eager_step == "graphs" or resolved.config.cis.index == "none"))
        self._generating = 0  # patched generate() calls running (generate_starts / generate_ends)
        self._graph_pools: dict[torch.device, Any] = {}
        self.retired_graphs: list = []  # StepGraph.run: replaced graphs, kept until the next prefill
        self._never_sparse = self.selector is None and not any(layer.window_decode for layer in self.layers)
        self._taps = getattr(self.selector, "attach", None) is not None  # hooks that read the geometry
        # the CIS selector whose anchor sets follow the generation's k (ES-CIS: the one EarlySelectKV wraps)
        base = getattr(self.selector, "base", self.selector)
        self._cis = base if isinstance(base, CISSelector) else None
        self._budget = resolved  # the resolved config at the top-k the layers and CIS run now (use_budget)
        # the last eager forward's decision and state (begin_forward makes one per eager forward; a
        # compiled step runs on the last one): before any forward, the policy's defaults at budget.topk
        self.context = ForwardContext(decoding=False, sparse_prefill=True, sparse_decode=True, dense_step=False,
                                      geometry=None, step_config=resolved, last_query_slot=None)

    def attach(self, installed: Any) -> None:
        """The patch installed this runtime on a model (``installed``: what it put there, a
        :class:`prhs_hf.patching.Installation`, which :meth:`detach` hands back)."""
        if self._installed is not None:
            raise RuntimeError("PrHS: this runtime is installed on a model already (unpatch it first)")
        self._installed = installed

    def detach(self) -> Any:
        """The patch takes this runtime off its model: what :meth:`attach` was given."""
        installed, self._installed = self._installed, None
        return installed

    def begin_forward(self, hidden_states: torch.Tensor, kwargs: dict) -> ForwardContext:
        """The first decoder layer's pre-hook: this forward's :class:`ForwardContext` (its decision,
        geometry and step state), made once for all layers, kept as :attr:`context` and returned.

        A forward is a *decode step* when it has one query row and the cache already holds tokens;
        anything else (a prompt, also a 1-token one, or a multi-token forward over a cache) is a
        prefill, after which CIS starts over. Eager forwards check the padding layout (it
        synchronises), decide (:meth:`_decide`) and make the context; a forward under
        ``torch.compile`` makes none (an attribute write that Dynamo would replay after every
        compiled step): it is taken as a decode step of the shape the last eager forward set up, on
        that forward's context, whose geometry buffers it updates in place (``generate()`` runs its
        prefill eagerly; a hand-compiled prefill must be followed by an eager one first).
        """
        cache = cache_argument(kwargs)
        batch, q_len = hidden_states.shape[:2]
        device = hidden_states.device
        mask = kwargs.get("attention_mask")
        if kwargs.get("output_attentions") and not self.passthrough:
            raise ValueError(
                "PrHS attention returns no attention weights: output_attentions=True needs a model that runs its "
                "own attention, the unpatched model or one patched with 'dense' (on attn_implementation 'eager')")
        cached = _cached_tokens(cache)  # None only under torch.compile with a StaticCache
        compiling = torch.compiler.is_compiling()
        if not compiling:
            _check_room(cache, cached, q_len)
            _check_batch(cache, cached, batch)
        if self.passthrough and self.telemetry is None:
            return self.context  # the model's own attention runs every layer: nothing of this forward is needed
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ValueError(
                f"PrHS reads each sequence's geometry off an SDPA or eager attention mask; this forward's is a "
                f"{type(mask).__name__} (flex_attention): patch a model with attn_implementation 'sdpa' or 'eager'"
            )
        decoding, dense_step, last_query_slot = q_len == 1, False, None
        if not compiling:
            decoding, last_query_slot = q_len == 1 and cached > 0, cached + q_len - 1
            self._bind(cache, cached, batch, decoding)
            prefill_end = self.bound.prefill_end if decoding and self.bound is not None else None
            step_config = self.use_budget(cached + q_len if prefill_end is None else prefill_end)
            sparse_prefill, sparse_decode = self._decide(cache, cached, q_len, hidden_states, step_config)
            if self.bound is not None:  # the generation's record of this forward (SelectorRollback)
                self._record(self.bound, cache, cached, q_len, batch, decoding, sparse_decode)
            kv_buffers = buffer_cache(cache, self.kv_growth) if self.kv_growth is not None else None
            # a dense decode step needs no geometry: SDPA reads the mask, and the layout check guards
            # only the sparse steps' reading of slots (a prefill and every sparse step still check it)
            dense_step = decoding and self.telemetry is None and not self._taps and (
                not sparse_decode or self._never_sparse)
        geometry = self._geometry
        if not dense_step:
            kv_len = mask.shape[-1] if mask is not None else q_len + (cached or 0)
            geom = geometry_from_mask(mask, batch, q_len, kv_len, device)
            if not compiling:
                check_layout(mask, geom, last_query_slot)
            if not decoding:
                self.prepare(device, batch, hidden_states.dtype)
            geometry = self._store_geometry(geom)
        if not compiling:
            self.context = ForwardContext(
                decoding=decoding, sparse_prefill=sparse_prefill, sparse_decode=sparse_decode, dense_step=dense_step,
                geometry=geometry, step_config=step_config, last_query_slot=last_query_slot, kv_buffers=kv_buffers)
        elif geometry is not self.context.geometry:  # new buffers: another batch shape than the last eager forward's
            self.context = dataclasses.replace(self.context, geometry=geometry)
        if self.passthrough and self.telemetry is not None and decoding:
            for layer in self.layers:  # the model's own attention runs: count its steps here
                layer.record_dense_decode(geometry, self.num_heads)
        return self.context

    def _bind(self, cache, cached: int, batch: int, decoding: bool) -> None:
        """Give the selector the state of ``cache``'s generation (a new one if the cache has none
        of this patch's), keeping the state it held on its own cache (eager forwards only: a
        compiled step continues the generation that the eager forward before it bound). A decode
        step (``decoding``) first follows a ``Cache.crop`` since the last forward (``cached``: the tokens the cache
        holds now) and refuses a batch of ``batch`` sequences that the state does not hold."""
        if self.selector is None:
            return
        call = self.call_state_of(cache)
        if call is None:
            call = CallState(self, copy.deepcopy(self._fresh_state))
            if cache is not None:
                setattr(cache, CALL_STATE_ATTRIBUTE, call)
                _follow_batch_edits(cache)
        self._hold(call)
        call.compiled_steps = bool(getattr(cache, "is_compileable", False))
        if not decoding:
            call.prefilled = True
            return
        if not call.prefilled:
            raise ValueError(
                "PrHS: a decode step on a cache whose prompt this patch did not prefill (a cache filled by "
                "the unpatched model, by another patch, or by a copy of the model): run the prompt through "
                "the patched model with this cache first, or start from input_ids alone"
            )
        if call.batch is not None and batch != call.batch:
            raise ValueError(
                f"PrHS: a decode step of {batch} sequences on a cache whose PrHS state holds {call.batch}: its "
                "batch was changed other than through the cache's reorder_cache, batch_select_indices or "
                "batch_repeat_interleave (which the state follows); run the prompt again on a new cache")
        if call.slots is not None and cached < call.slots:
            self._follow_crop(call, cached)

    def _record(self, call: CallState, cache, cached: int, q_len: int, batch: int, decoding: bool,
                sparse_decode: bool) -> None:
        """Keep on ``call`` what this eager forward (``q_len`` tokens after ``cached``, a batch of
        ``batch``; a decode step where ``decoding``) leaves: the policy's decision ``sparse_decode``,
        the slots, and before a sparse decode step the selector's mark (the history a crop goes back
        to; not for a cache that cannot be cropped)."""
        call.sparse_decode = sparse_decode
        call.slots = cached + q_len
        if not decoding:
            call.prefill_end, call.batch = cached + q_len, batch
            call.history, call.history_complete = [], True
        elif sparse_decode and not self._never_sparse and not isinstance(cache, StaticCache) and undoes_steps(
                self.selector):
            call.history.append((cached, self.selector.mark_step()))
            if len(call.history) > self._history_length():
                del call.history[0]
                call.history_complete = False

    def _history_length(self) -> int:
        """Marks a :class:`CallState` keeps: two blocks and one (an undo is exact back to the step after
        the last block end but one, and to any block end); 32 for a selector that undoes any steps."""
        period = undo_period(self.selector)
        return 32 if period is None else 2 * period + 1

    def _follow_crop(self, call: CallState, cached: int) -> None:
        """The state of a cache cut back to ``cached`` tokens since its last forward (``Cache.crop``,
        eager): the state before the first sparse step past ``cached`` where an undo to it is exact
        (:class:`~prhs_hf.selectors.base.UndoesSteps`: within reach of the kept marks, not across a block
        end that a later step overwrote); a cut into the last prefill's tokens starts over as a prefill
        of what is left does. Elsewhere the state starts over (the next step opens a new block) with a
        warning: keep a ``copy.deepcopy`` of a cache to go back to a point exactly."""
        history, call.history = call.history, []
        if not undoes_steps(self.selector):  # (it keeps no marks)
            history, call.history_complete = [(cached, None)], False
        if call.prefill_end is not None and cached < call.prefill_end:
            self._restart(cached, 0)
            call.prefill_end, call.history_complete = cached, True
            return
        later = [i for i, (slots, _) in enumerate(history) if slots >= cached]
        if not later:  # no sparse step ran past ``cached``: the state is the one it had there
            call.history = history
            return
        first = later[0]
        slots, mark = history[first]
        if mark is not None and (first > 0 or call.history_complete) and self._undo_is_exact(mark):
            self.selector.undo_to(mark)
            call.history = history[:first]
            return
        self._restart(cached, cached)
        call.history_complete = False
        warnings.warn(
            f"PrHS: this cache was cut back (Cache.crop) to {cached} tokens, further than its CIS state can be "
            "put back exactly (past the end of a block of decode steps that a later step overwrote); the state "
            "starts over there, as after a prefill: the next decode step opens a new block. To go back to a "
            "point of a generation exactly, keep a copy.deepcopy of its cache there", stacklevel=2)

    def _undo_is_exact(self, mark: StepMark) -> bool:
        """Whether undoing the steps after ``mark`` is exact (one read of the selector's step counters)."""
        period = undo_period(self.selector)
        if period is None:
            return True
        now = self.selector.mark_step().counter
        then_count, now_count = torch.stack([mark.counter, now.to(mark.counter.device)]).tolist()
        return then_count % period == 0 or (now_count - 1) // period == then_count // period

    def _restart(self, cached: int, index_valid: int) -> None:
        """The selector's state starts over at ``cached`` tokens (:meth:`CISSelector.restart`, whose key
        index entries from ``index_valid`` on are written again)."""
        restart = getattr(self.selector, "restart", None)
        if restart is None:
            raise ValueError(
                f"PrHS: this cache was cut back (Cache.crop) to {cached} tokens, and the {type(self.selector).__name__} "
                "selector cannot follow a crop: run the prompt again on a new cache")
        restart(index_valid)

    def follow_batch(self, call: CallState, rows: torch.Tensor) -> None:
        """Make ``call``'s state follow a batch edit of its cache: sequence ``i`` becomes old sequence
        ``rows[i]`` (:class:`FollowBatchEdit`). The marks of a crop go (they hold the old rows)."""
        with self.forward_lock:
            self._hold(call)
            self.selector.reorder(rows)
            call.batch = rows.numel()
            call.history, call.history_complete = [], False

    def use_budget(self, context: int) -> ResolvedConfig:
        """Run the top-k of a generation whose prefill left ``context`` cache slots
        (:meth:`~prhs_hf.config.BudgetConfig.topk_for`: ``budget.topk`` unless ``budget.topk_fraction``
        is set) from this forward on: every layer's decode params, the CIS anchor sets that the next
        prefill makes; returns the resolved config at that k (the forward's
        :attr:`ForwardContext.step_config`, which the policy prices). An eager forward calls it with
        the slots of the prefill that began the cache's generation (a decode step: the bound
        ``CallState.prefill_end``), so a generation keeps its k whatever other caches ran in
        between; a compiled step keeps the last eager forward's."""
        topk = self.resolved.config.budget.topk_for(context)
        if topk != self._budget.config.budget.topk:
            self._budget = self.resolved.at_topk(topk)
            for layer in self.layers:
                layer.use_budget(self._budget)
            if self._cis is not None:
                self._cis.set_size = cis_set_size(self._budget)
        return self._budget

    def _hold(self, call: CallState) -> None:
        """Make ``call``'s state the selector's, keeping the state it held on its own :class:`CallState`."""
        if call is not self.bound:
            if self.bound is not None:
                self.bound.fields = export_call_state(self.selector)
            import_call_state(self.selector, call.fields)
            self.bound = call

    def _decide(self, cache, cached: int, q_len: int, hidden_states: torch.Tensor,
                step_config: ResolvedConfig) -> tuple[bool, bool]:
        """``(sparse_prefill, sparse_decode)`` of this eager forward (``q_len`` query rows after ``cached``
        tokens, at the generation's ``step_config``): the one place the policy decides. ``policy``,
        its cost model where it is ``auto``; a prefill into a ``StaticCache`` decides for the compiled
        decode steps that follow it; a runtime in :data:`DENSE_RUNTIMES` (assisted decoding) is dense."""
        if self in DENSE_RUNTIMES.get():  # (assisted decoding: generate_without_step_reads)
            return False, False
        policy = self.resolved.config.policy
        sparse_prefill = policy.prefill == "sparse"
        sparse_decode = policy.decode == "sparse"
        if "auto" not in (policy.decode, policy.prefill):
            return sparse_prefill, sparse_decode
        device_type = hidden_states.device.type
        if device_type not in self._cost_models:  # once per device type: policy.cost_model is a file
            self._cost_models[device_type] = cost_model_for(hidden_states.device, policy.cost_model)
        model = self._cost_models[device_type]
        if policy.prefill == "auto":
            sparse_prefill = model is None or model.sparse_prefill_wins(q_len, cached)
        if policy.decode == "auto":
            shape = self.decode_shape(hidden_states.shape[0], cached + q_len, hidden_states.dtype, step_config)
            # a compiled step, or an eager one whose sparse layers replay CUDA graphs: few host launches
            decoding = q_len == 1 and cached > 0
            compiled = (not decoding and isinstance(cache, StaticCache)) or (
                self.graphed and hidden_states.device.type == "cuda" and isinstance(cache, DynamicCache))
            sparse_decode = model is None or model.sparse_decode_wins(shape, compiled)
        return sparse_prefill, sparse_decode

    def decode_shape(self, batch: int, context: int, dtype: torch.dtype,
                     step_config: ResolvedConfig | None = None) -> DecodeShape:
        """What the cost model prices of this patch's decode step of one layer: ``batch`` sequences
        attending to ``context`` tokens, the cache in ``dtype``, at ``step_config``'s top-k (default: the
        last eager forward's, :attr:`ForwardContext.step_config`) (:class:`~prhs_hf.policy.DecodeShape`)."""
        step_config = self.context.step_config if step_config is None else step_config
        grouped = getattr(self.selector, "grouped", False)
        return DecodeShape(
            batch=batch, context=context, kv_heads=self.num_kv_heads,
            rows=self.num_kv_heads if grouped else self.num_heads, head_dim=self.head_dim,
            itemsize=dtype.itemsize, index_set=step_config.index_capacity,
            union_group=self._union_group(grouped),
            **{"topk": step_config.config.budget.topk, **self._key_index_cost(dtype, step_config)},
        )

    def _union_group(self, grouped: bool) -> int:
        """The query heads per KV head whose per-head sets ``backend.sparse_attention: group_union``
        reads once as their union (:class:`DecodeShape`), 0 where each row reads its own set."""
        union = self.resolved.config.backend.sparse_attention == "group_union"
        return self.num_heads // self.num_kv_heads if union and not grouped else 0

    def _key_index_cost(self, dtype: torch.dtype, step_config: ResolvedConfig | None = None) -> dict:
        """The retrieval's work with a key index (``cis.index``), as :class:`DecodeShape` fields: the
        index's bytes per key, the candidate tokens a retrieving row re-reads exactly (``top-k +
        margin``; pages: the tokens of the candidate pages) and the size of its select, the stage-1
        top-(k + margin) (pages: of the candidate pages) in place of the top-k. A few host operations,
        once per eager forward that the policy decides (not per layer), so it is not kept."""
        c = self.resolved.config
        if self.selector is None or c.cis.index == "none":
            return {}
        page = c.cis.index_page if c.cis.index == "pages" else 1
        try:
            per_slot = index_bytes_per_slot(c.cis.index, self.head_dim, dtype, page)
        except ValueError:  # an index the head size cannot take: the selector's prefill says so (cis.index)
            return {}
        topk = (self.context.step_config if step_config is None else step_config).config.budget.topk
        candidates = candidate_count(topk, c.cis.rerank_margin, page)
        return {"scored_key_bytes": per_slot, "reranked": candidates * page, "topk": candidates}

    def last_query_slot(self) -> int | None:
        """The cache slot of the current eager forward's last query row, known on the host without a
        read: the tokens the cache held before the forward plus its query rows, minus one (a decode
        step's new key; :func:`~prhs_hf.geometry.check_layout` checks every sequence's last token
        against it). None before the first eager forward; a forward under ``torch.compile`` leaves
        the last eager forward's (a compiled step reads no host value): :attr:`ForwardContext.last_query_slot`."""
        return self.context.last_query_slot

    def decodes_sparse(self) -> bool:
        """The policy's decision of the last eager forward (:attr:`ForwardContext.sparse_decode`) for a config with a
        sparse decode: whether that decode step runs sparse or, at a prefill, whether the decode steps
        after it do (compiled ones keep it; eager ones decide again). CIS makes its anchor buffers at a
        prefill only where it is True, else at the first sparse step; the speed map records it per row."""
        return self.context.sparse_decode and not self._never_sparse

    def _store_geometry(self, geom: SequenceGeometry) -> SequenceGeometry:
        """Keep ``geom`` in fixed buffers (allocated per batch size and device), which later
        forwards update in place, and return them: a compiled step then rebinds no attribute (which
        would make its tensors extra graph outputs) and CUDA graphs see fixed addresses."""
        kept = self._geometry
        if kept is not None and kept.pad.shape == geom.pad.shape and kept.pad.device == geom.pad.device:
            for buffer, value in zip(kept.tensors(), geom.tensors()):
                buffer.copy_(value)
        else:
            with torch.inference_mode(False):  # normal tensors: a later forward outside inference_mode updates them
                kept = SequenceGeometry(*(x.clone() for x in geom.tensors()))
            if not torch.compiler.is_compiling():
                for buffer in kept.tensors():
                    torch._dynamo.mark_static_address(buffer)
            self._geometry = kept
        return kept

    def generate_starts(self) -> None:
        """A patched ``generate()`` begins (:meth:`generate_ends` follows it, also on an error)."""
        with self.forward_lock:
            self._generating += 1

    def generate_ends(self) -> None:
        """A patched ``generate()`` has returned: let go of the last forward's cache layers
        (:attr:`ForwardContext.kv_buffers`, which every eager forward's context holds), so that a cache its caller
        drops is freed with its keys and values instead of living until the model's next forward.
        When no other ``generate()`` is running (threads), the selector's state (CIS's anchors and key
        index) also goes back to the cache it belongs to (:meth:`_unbind`; not a ``StaticCache``'s)
        and the sparse step's CUDA graphs, with their memory pool, are dropped: a dropped cache then
        frees all of it. The next forward binds the cache it runs on again; a generation's graphs are
        made again after its prefill anyway (:meth:`prepare`)."""
        with self.forward_lock:
            self._generating -= 1
            if self.context.kv_buffers is not None:
                self.context = dataclasses.replace(self.context, kv_buffers=None)
            if self._generating == 0:
                self._unbind()
                self._drop_graphs()

    def call_state_of(self, cache) -> CallState | None:
        """The :class:`CallState` this patch keeps on ``cache`` (None: no cache, or none of this patch's)."""
        call = None if cache is None else cache.__dict__.get(CALL_STATE_ATTRIBUTE)
        return call if call is not None and call.runtime is self else None

    def hold(self, cache) -> Any:
        """Make the state of ``cache``'s generation the selector's, as the next forward over ``cache``
        would, and return the selector: how to look at a finished generation's CIS anchors or key index
        (``runtime.hold(out.past_key_values).states``), which :meth:`generate_ends` has given back to
        its cache. Raises ``ValueError`` for a cache this patch has not prefilled."""
        call = self.call_state_of(cache)
        if call is None:
            raise ValueError("PrHS: this cache holds no state of this patch: pass the past_key_values of a "
                             "generate() (return_dict_in_generate=True) or forward the patched model ran")
        with self.forward_lock:
            self._hold(call)
        return self.selector

    def _unbind(self) -> None:
        """The selector's live state back to its :class:`CallState` (on its cache), the selector left
        with an empty one: it then holds nothing of a finished generation. Not for a compileable cache
        (a ``StaticCache``, which transformers keeps for the next call anyway): a compiled forward over
        it, a user's ``torch.compile(model.forward)`` prefill too, reads the selector's state without
        binding its cache first."""
        if self.bound is not None and not self.bound.compiled_steps:
            self.bound.fields = export_call_state(self.selector)
            import_call_state(self.selector, copy.deepcopy(self._fresh_state))
            self.bound = None

    def _drop_graphs(self) -> None:
        """The sparse step's graphs go with their pool; new ones take a new pool."""
        if self.graphed:
            for layer in self.layers:
                layer.graphs = StepGraph()
            self._graph_pools, self.retired_graphs = {}, []

    def prepare(self, device: torch.device, batch: int, dtype: torch.dtype) -> None:
        """At a prefill of ``batch`` sequences in ``dtype`` (eager): pick the backends and allocate the
        telemetry counters for ``device``, so that a compiled decode step that follows only looks them up."""
        if self.selector is not None:
            self.ops_for(device)
        if any(layer.plans_prefill for layer in self.layers):
            self.prefill_function(device, dtype)
        if self.telemetry is not None:
            self.telemetry.prepare(device, batch)
        self._drop_graphs()  # the last generation's

    def ops_for(self, device: torch.device) -> DecodeOps:
        """The decode ops table of ``device``, picked by ``backend.decode`` the first time the device
        is seen (its first prefill; a layer that a ``device_map`` puts elsewhere, at its first step)
        and kept: a model moved by ``.to()`` gets its new device's. A layer's decode step looks it
        up once and passes it to the selector and to the sparse attention; CIS writes a prompt's key
        index on it too (the selector holds this method)."""
        if device not in self._ops:
            self._ops[device] = pick_decode_ops(self.resolved.config.backend.decode, device)
        return self._ops[device]

    def graph_pool(self, device: torch.device):
        """The memory pool that every layer's :class:`~prhs_hf.layer.StepGraph` on ``device`` captures
        into (one per device: the layers' graphs replay one after the other on one stream)."""
        if device not in self._graph_pools:
            self._graph_pools[device] = torch.cuda.graph_pool_handle()
        return self._graph_pools[device]

    def prefill_function(self, device: torch.device, dtype: torch.dtype) -> Callable:
        """The sparse prefill attention for attention in ``dtype`` on ``device`` (chosen once for each)."""
        key = (device, dtype)
        if key not in self._prefill:
            self._prefill[key] = prefill_function(self.resolved.config.backend.prefill, device, dtype, self.head_dim)
        return self._prefill[key]

    def dense_prefill_function(self, device: torch.device, dtype: torch.dtype) -> Callable | None:
        """The dense prefill attention of layers without a PSAW/ETF plan for attention in ``dtype`` on
        ``device``, or None (the model's SDPA); chosen once for each (:func:`~prhs_hf.backends.dense_prefill_function`)."""
        key = (device, dtype)
        if key not in self._dense_prefill:
            self._dense_prefill[key] = dense_prefill_function(
                self.resolved.config.backend.prefill, device, dtype, self.head_dim)
        return self._dense_prefill[key]

    def reset(self) -> None:
        """Forget CIS anchors (of the generation bound now) and telemetry (a new, unrelated generation follows)."""
        for layer in self.layers:
            layer.plan = None
        if self.selector is not None:  # in place: a compiled decode step keeps its buffers
            self.selector.reset()
        if self.telemetry is not None:
            self.telemetry.reset()


class SelectorRollback:
    """The selector's part of the periodic stop check (:class:`prhs_hf.patching.PeriodicStopCheck`)
    in the generation that fills one cache: the selector's state after each forward of the window
    (:meth:`~prhs_hf.selectors.base.UndoesSteps.mark_step`), from which :meth:`undo` puts back the
    state after the first finished step, so that the cache's generation continues as after the
    check at every step.

    A selector with an ``undo_period`` ``p`` (CIS: its block size) undoes exactly only steps that hold
    no step ending a block of ``p`` of its steps followed by another of its steps. :meth:`mark`
    counts the selector's steps on the host (a decode forward runs the selector where the policy
    decided sparse: ``CallState.sparse_decode``) and asks for the window to be read right after
    such a step unless it is the window's first. The count is 0 after a prefill; where the
    generation's first forward was not one (a continuation on a cache), the first mark asks for a
    read, which takes the count off the device (the marks' counters ride along with every read,
    which checks the host's count against them).
    """

    def __init__(self, runtime: PrHSRuntime, call: CallState, prompt_slots: int):
        self.runtime = runtime
        self.call = call
        self.period = undo_period(runtime.selector)
        # the selector's steps since the prefill, as the host knows them (None: not known)
        self.counter: int | None = 0 if call.prefill_end == prompt_slots else None
        self.marks: list[StepMark] = []  # after each forward of the window
        self.stop: int | None = None  # the mark of the window's first finished step, once read
        self._first = True

    @classmethod
    def of(cls, runtime: PrHSRuntime, cache, prompt_slots: int) -> "SelectorRollback | None":
        """The rollback of ``cache``'s generation, whose prompt (the first forward of the loop) left
        ``prompt_slots`` cache slots; None where there is no selector state to undo."""
        call = runtime.call_state_of(cache)
        if runtime.selector is None or call is None:
            return None
        if not undoes_steps(runtime.selector):
            raise RuntimeError(f"{type(runtime.selector).__name__} cannot undo decode steps: the loop must check "
                               "every step (prhs_hf.patching._rollback_supported)")
        return cls(runtime, call, prompt_slots)

    def mark(self) -> bool:
        """Keep the selector's state after the forward just run; whether the window must be read now
        (an undo past this step would not be exact, or the host does not know the step count)."""
        stepped = not self._first and self.call.sparse_decode  # every forward after the loop's first decodes
        self._first = False
        with self.runtime.forward_lock:
            self.runtime._hold(self.call)
            self.marks.append(self.runtime.selector.mark_step())
        if self.period is None:
            return False
        if self.counter is None:
            return True
        if stepped:
            self.counter += 1
            return self.counter % self.period == 0 and len(self.marks) > 1
        return False

    def counters(self) -> torch.Tensor | None:
        """The selector's step counters after each forward of the window (``[n]`` int64 on the
        device, for the read), or None (no ``undo_period``)."""
        if self.period is None or not self.marks:
            return None
        return torch.stack([m.counter for m in self.marks])

    def read(self, counters: list[int], stop: int | None) -> None:
        """After the read of the window: ``counters`` (what :meth:`counters` held, read), ``stop`` the
        index of the first finished step (None: none; the marks are dropped). Raises where an undo to
        ``stop`` would not be exact (the host's count of the selector's steps was wrong)."""
        if counters:
            if stop is not None:
                for j in range(stop + 1, len(counters) - 1):
                    if counters[j] % self.period == 0 and counters[j] != counters[j - 1] and counters[-1] != counters[j]:
                        raise RuntimeError(
                            f"PrHS: the stop check would undo decode steps across the end of a block of "
                            f"{self.period} selector steps (counters {counters}); the selector state would not be "
                            "the check at every step's. Set generation.stop_check_every: 1")
            self.counter = counters[-1] if stop is None else counters[stop]
        self.stop = stop
        if stop is None:
            self.marks = []

    def undo(self) -> None:
        """Put the selector's state back to the mark of the first finished step (after a :meth:`read`
        that found one); the marks are dropped."""
        if self.stop is not None and self.stop < len(self.marks) - 1:
            with self.runtime.forward_lock:
                self.runtime._hold(self.call)
                self.runtime.selector.undo_to(self.marks[self.stop])
        self.marks, self.stop = [], None


def _check_sparse_attention(sparse_attention: str, num_heads: int, num_kv_heads: int) -> None:
    """Refuse ``backend.sparse_attention: group_union`` on a model whose KV groups have more query heads
    than the union's int32 head bitmask has bits."""
    group = num_heads // max(num_kv_heads, 1)
    if sparse_attention == "group_union" and group > MAX_GROUP:
        raise ConfigError(f"backend.sparse_attention: group_union marks each key with the query heads of its KV "
                          f"group in an int32 bitmask, and this model has {group} query heads per KV head; allowed "
                          f"up to {MAX_GROUP} (set backend.sparse_attention: per_head)")


def _check_room(cache, cached: int | None, q_len: int) -> None:
    """Raise where this forward's tokens would not fit in a ``StaticCache`` (eager: a host int)."""
    if not isinstance(cache, StaticCache) or cached is None:
        return
    room = cache.get_max_length()
    if isinstance(room, int) and room > 0 and cached + q_len > room:
        raise ValueError(
            f"the static cache is full: it holds {room} tokens, {cached} are cached and this forward adds {q_len}. "
            "Start a new generation (a new cache), make the static cache longer (a larger max_cache_len, or "
            "max_new_tokens in the first generate() call), or use a DynamicCache"
        )


def _check_batch(cache, cached: int, batch: int) -> None:
    """Raise where a cache that holds tokens holds another number of sequences than this forward's
    ``batch`` (transformers' concatenation or PrHS's buffer write would fail inside the layer)."""
    layers = getattr(cache, "layers", None) if cached else None
    if not layers:
        return
    # (a BufferedLayer's whole buffer: its keys are a view, which would be one more op per step)
    if isinstance(layers[0], BufferedLayer):
        keys = None if layers[0].whole_buffers is None else layers[0].whole_buffers[0]
    else:
        keys = getattr(layers[0], "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[0] != batch:
        raise ValueError(
            f"the cache holds {keys.shape[0]} sequences and this forward has {batch}: generate() repeats input_ids "
            "for num_return_sequences and num_beams, not a cache passed in. Expand the cache first "
            "(cache.batch_repeat_interleave(n), which carries its PrHS state along), or pass as many sequences "
            "as it holds (a beam search's cache holds every beam)")


def _cached_tokens(cache) -> int | None:
    """Tokens the cache held before this forward; ``None`` where only the device knows (a
    ``StaticCache`` inside a compiled step)."""
    if cache is None:
        return 0
    n = cache.get_seq_length()
    if isinstance(n, torch.Tensor):
        if torch.compiler.is_compiling():
            return None
        n = int(n)
    return n


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers of ``[B, H, capacity, D]`` that grow
    by ``growth`` (geometrically: amortised O(1) per token), so a decode step writes its token in
    place instead of copying the whole cache as ``torch.cat`` does (``backend.eager_step``).

    Users and transformers see a ``DynamicLayer``: ``keys``/``values`` are the valid views
    ``buffer[:, :, :n]`` (what ``update`` returns), ``get_seq_length``, ``crop``, beam reordering,
    ``batch_repeat_interleave``/``batch_select_indices``, deepcopy and pickling behave as
    ``DynamicLayer``'s. Assigning ``keys``/``values`` (what those methods do) copies into the
    buffer where the tensor fits (same batch, heads, head size, dtype and device; a prefix view of
    the buffer itself, a crop, copies nothing), so a reorder keeps the buffer's address; otherwise
    the tensor moves into a new buffer. The slots past ``n`` hold stale or uninitialised values:
    only the sparse decode step reads the whole buffer (:attr:`buffers`), and it reads slots by each
    sequence's geometry, never past its valid length.
    """

    #: what a new buffer's slots hold before they are written (None: uninitialised; tests fill NaN
    #: to prove that no attention path reads past the valid length)
    fill: float | None = None

    def __init__(self, growth: float = 1.25, reserve: int = 0):
        self.growth = growth
        self.reserve = reserve  # slots a new buffer takes at least (generate()'s max_length: no growth in one call)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = [0, 0]  # valid tokens of the keys and of the values (crop assigns them one by one)
        self._empty: torch.Tensor | None = None
        super().__init__()

    @classmethod
    def from_layer(cls, layer: DynamicLayer, growth: float) -> "BufferedLayer":
        """A buffered twin of ``layer`` holding its tokens."""
        twin = cls(growth)
        if layer.is_initialized:
            # the dtype from the keys: transformers 5.24 on keeps no ``dtype`` on a DynamicLayer
            twin.dtype, twin.device, twin.is_initialized = layer.keys.dtype, layer.device, True
            twin._empty = torch.empty(0, dtype=layer.keys.dtype, device=layer.device)
            twin.keys, twin.values = layer.keys, layer.values
        return twin

    def _view(self, buffer: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if buffer is None:
            return self._empty  # None before lazy initialisation, an empty tensor after (as DynamicLayer)
        return buffer[:, :, :n]

    @property
    def keys(self) -> torch.Tensor | None:
        return self._view(self._k, self._n[0])

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k = self._adopt(self._k, value, 0)

    @property
    def values(self) -> torch.Tensor | None:
        return self._view(self._v, self._n[1])

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = self._adopt(self._v, value, 1)

    @property
    def whole_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(keys, values)`` of the whole capacity, or None before the first token."""
        return None if self._k is None else (self._k, self._v)

    def _capacity(self, tokens: int) -> int:
        if tokens <= self.reserve:
            return self.reserve
        return max(tokens, 128 * math.ceil(self.growth * tokens / 128))

    def _allocate(self, like: torch.Tensor, tokens: int) -> torch.Tensor:
        shape = (*like.shape[:2], self._capacity(tokens), like.shape[-1])
        if self.fill is None:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        return torch.full(shape, self.fill, dtype=like.dtype, device=like.device)

    def _adopt(self, buffer: torch.Tensor | None, value: torch.Tensor | None, which: int) -> torch.Tensor | None:
        """The buffer that holds ``value`` (assigned to ``keys``, ``which`` 0, or ``values``, 1) as its valid part."""
        if value is None or value.dim() != 4 or value.shape[-2] == 0:
            self._n[which] = 0
            if value is not None:
                self._empty = value if value.numel() == 0 else self._empty
            return None
        n = value.shape[-2]
        buffer = _writable(buffer)
        fits = (buffer is not None and buffer.shape[:2] == value.shape[:2] and buffer.shape[-1] == value.shape[-1]
                and n <= buffer.shape[-2] and buffer.dtype == value.dtype and buffer.device == value.device)
        if not fits:
            buffer = self._allocate(value, n)
        if not (value.data_ptr() == buffer.data_ptr() and value.stride() == buffer.stride()):
            buffer[:, :, :n].copy_(value)
        self._n[which] = n
        return buffer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens after the valid ones (growing the buffers when they are full);
        returns the valid views, as ``DynamicLayer.update`` returns its concatenation."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self._n[0], key_states.shape[-2]
        self._k, self._v = _writable(self._k), _writable(self._v)
        k = self._k
        if k is None or self._v is None or n + new > min(k.shape[-2], self._v.shape[-2]):
            grown_k, grown_v = self._allocate(key_states, n + new), self._allocate(value_states, n + new)
            if n:
                grown_k[:, :, :n].copy_(k[:, :, :n])
                grown_v[:, :, :n].copy_(self._v[:, :, :n])
            self._k, self._v = grown_k, grown_v
        self._k[:, :, n : n + new].copy_(key_states)
        self._v[:, :, n : n + new].copy_(value_states)
        self._n = [n + new, n + new]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n[0]


def _writable(buffer: torch.Tensor | None) -> torch.Tensor | None:
    """``buffer``, or a normal copy of it where it was made under ``torch.inference_mode`` and is written
    outside it now (a turn under ``no_grad`` after one under ``inference_mode``), which PyTorch refuses
    for an inference tensor; ``DynamicLayer``'s ``torch.cat`` makes a new tensor anyway."""
    if buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled():
        return buffer.clone()
    return buffer


def buffer_cache(cache, growth: float, reserve: int | None = None) -> list | None:
    """Make the ``DynamicLayer``s of the ``DynamicCache`` ``cache`` :class:`BufferedLayer`s of
    ``growth`` in place (their tokens kept; the layers it creates later too) and return its layer
    list; ``None`` for any other cache (a StaticCache, sliding-window or offloaded layers stay as they are).

    ``reserve`` (the slots one ``generate()`` fills: its ``max_length``) makes every buffer that is
    allocated from now on, by these layers or later ones, hold at least that many slots: the call then
    never grows a buffer (no copy, no ``growth`` overshoot: the memory of a static cache of that
    length), while a later turn past it grows by ``growth``."""
    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        return None
    layers = cache.layers
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[i] = BufferedLayer.from_layer(layer, growth)
    made = cache.layer_class_to_replicate
    if made is DynamicLayer:
        cache.layer_class_to_replicate = made = functools.partial(BufferedLayer, growth)
    if reserve:  # (a generate()'s prefill; every other forward leaves the layers and the factory as they are)
        if isinstance(made, functools.partial) and made.func is BufferedLayer:
            kept = made.keywords.get("reserve", 0)
            cache.layer_class_to_replicate = functools.partial(BufferedLayer, growth, reserve=max(reserve, kept))
        for layer in layers:
            if type(layer) is BufferedLayer:
                layer.reserve = max(layer.reserve, reserve)
    return layers
