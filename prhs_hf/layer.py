"""What PrHS does at one decoder layer: the prefill plan (PSAW/ETF) and the attention call.

A :class:`PrHSLayer` is attached to each attention module as ``module._prhs_layer`` by
:func:`prhs_hf.patch`. The registered attention function hands every call to it; it routes
prefill to the dense SDPA path (untouched layers; FA4's dense forward under ``backend.prefill: flash``)
or to the sparse prefill backend, and decode
to the decode selector (CIS or a baseline) and sparse attention, the PSAW window, or dense SDPA.
Dense calls read grouped K/V in place (``attention.gqa_sdpa_attention_forward``) unless the config
changes nothing at all, which keeps transformers' own path and so the unpatched model's bits.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .attention import gqa_sdpa_attention_forward
from .decode import DecodeParams, window_decode_step
from .geometry import ForwardContext, SequenceGeometry
from .ops.prefill.prefill_plan import PrefillPlan
from .schedules import etf_frozen_count_tensor, psaw_window_fraction, psaw_window_start_tensor
from .selectors.set_steps import attend_with_tail, visible_probabilities

__all__ = ["PrHSLayer", "PrefillPlan", "StepGraph", "install_row_skip"]


class StepGraph:
    """One layer's sparse decode step as a CUDA graph, replayed while what it bakes in (``key``:
    the cache buffers, the geometry and CIS state buffers, the shapes) stays the same.

    At a new key the step runs eagerly once on a copy of the query that becomes the graph's input
    (Triton compiles and tunes its kernels for these very tensors outside any capture; the step's
    real result), and is captured at the next step with that key and replayed from then on, the
    query copied into the graph's input first. A capture executes nothing: the
    first replay after it computes that step. The graph's output is overwritten by the next replay
    (the layer's output projection reads it before then). Each capture first releases the caching
    allocator's cached blocks (``torch.cuda.empty_cache()``): during a capture the allocator cannot
    release them to make room in the graph pool.
    """

    def __init__(self):
        self.key: tuple | None = None
        self.graph = None
        self.q: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def run(self, key: tuple, step: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor, pool,
            retired: list) -> torch.Tensor:
        """``step(q)`` (``q [B, Hq, D]``): eager at a new ``key``, else captured once into ``pool`` and
        replayed. A graph that a new key replaces goes to ``retired``, never replayed again but kept:
        the pool's other graphs may capture anew only while it holds a graph (its use count above 0)."""
        if key != self.key:  # eager, on the input buffer the capture will read (the same specialisation)
            if self.graph is not None:
                retired.append(self.graph)
            self.key, self.graph, self.out = key, None, None
            self.q = q.clone()
            return step(self.q)
        self.q.copy_(q)
        if self.graph is None:
            # while a capture is under way the caching allocator cannot release the blocks it caches for
            # ordinary allocations (a prefill's activations, a grown buffer's old one) to make room in the
            # pool: release them first, as torch.cuda.graph does
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(q.device)
            side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side):  # torch.cuda.graph without its gc.collect() per capture
                graph.capture_begin(pool=pool)
                try:
                    self.out = step(self.q)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(q.device).wait_stream(side)
            self.graph = graph
        self.graph.replay()
        return self.out


class PrHSLayer:
    """PrHS at decoder layer ``index`` of a patched model."""

    def __init__(self, runtime, index: int):
        """``runtime``: the model's :class:`prhs_hf.runtime.PrHSRuntime` (config, selector,
        backends, telemetry and the current forward's geometry)."""
        r = runtime.resolved
        c = r.config
        self.runtime = runtime
        self.index = index
        n = r.num_layers
        self.psaw_fraction = (
            psaw_window_fraction(index, n, r.psaw_start, c.psaw.phi, c.psaw.alpha) if index >= r.psaw_start else None
        )
        self.psaw_prefill = r.psaw_prefill and self.psaw_fraction is not None
        self.etf = c.etf.enabled and index >= r.etf_start
        # PSAW or ETF work to plan at a prefill: only such a layer (and the first) has a pre-hook
        self.plans_prefill = self.psaw_prefill or self.etf
        self.window_decode = r.psaw_decode and self.psaw_fraction is not None
        # top-k -> this layer's DecodeParams at it (a context-relative budget's k per generation:
        # use_budget); one object per k, so that a compiled step that returns to a k finds its own
        self._params_at: dict[int, DecodeParams] = {}
        self.decode_params = self._params(r)
        self.plan: PrefillPlan | None = None
        self.graphs = StepGraph()  # backend.eager_step: graphs (CUDA)
        # backend.sparse_attention: group_union: per-query-head sets read once per KV group (GQA)
        self.reads_group_union = c.backend.sparse_attention == "group_union"

    def _params(self, r) -> DecodeParams:
        """The :class:`DecodeParams` of the resolved config ``r`` (the runtime's, or that at one
        generation's top-k), made once per top-k."""
        c = r.config
        params = self._params_at.get(c.budget.topk)
        if params is None:
            params = self._params_at[c.budget.topk] = DecodeParams(
                sink=c.budget.sink,
                local=c.budget.local,
                topk=c.budget.topk,
                tau=c.cis.tau,
                dilation_topm=r.dilation_topm,
                dilation_radius=c.cis.dilation_radius,
                capacity=r.index_capacity,
                window_fraction=self.psaw_fraction if self.window_decode else None,
            )
        return params

    def use_budget(self, at_topk) -> None:
        """Decode steps from now on run the budget of ``at_topk`` (the runtime's resolved config at the
        current generation's top-k, :meth:`~prhs_hf.config.ResolvedConfig.at_topk`); eager."""
        self.decode_params = self._params(at_topk)

    # ------------------------------------------------------------------ prefill

    def plan_prefill(self, context: ForwardContext, hidden_states: torch.Tensor,
                     device: torch.device | None = None) -> None:
        """Decoder-layer pre-hook of a layer that :attr:`plans_prefill` (after
        :meth:`PrHSRuntime.begin_forward` made the forward's ``context``): decide this layer's PSAW
        window and ETF frozen rows for this forward, on ``device``, where the layer runs (default: that
        of ``hidden_states``; a ``device_map`` hook moves them after this hook).

        Other layers never have a plan and the hook does not call this: under ``torch.compile``
        every attribute write is replayed in Python after each compiled step (one per layer,
        reached through the layer's hook: host time in every decode step)."""
        self.plan = None
        q_len = hidden_states.shape[1]
        if q_len == 1 or not context.sparse_prefill:  # a decode step, a 1-token prompt, or the policy's dense
            return
        geom = context.geometry_on(hidden_states.device if device is None else device)
        sink = self.runtime.resolved.config.budget.sink
        real = geom.query_real_index(q_len)
        if self.psaw_prefill:
            win_lo = psaw_window_start_tensor(real + 1, self.psaw_fraction, sink)
        else:
            win_lo = torch.full_like(real, sink)
        frozen_lo = torch.full_like(geom.pad, sink)
        frozen_hi = frozen_lo
        active_rows = None
        # ETF freezes prompt rows of a whole-prompt prefill only (row 0 is real index <= 0)
        if self.etf and bool((geom.q_start <= 0).all()):
            etf = self.runtime.resolved.config.etf
            r = self.runtime.resolved
            frozen_hi = torch.maximum(
                etf_frozen_count_tensor(geom.t_last, self.index, r.num_layers, r.etf_start, etf.psi, etf.gamma), frozen_lo
            )
            frozen = (real >= frozen_lo[:, None]) & (real < frozen_hi[:, None])
            active_rows = (~frozen).reshape(-1).nonzero().squeeze(1)
            if self.runtime.telemetry is not None:
                self.runtime.telemetry.record_prefill(
                    self.index, (geom.t_last).sum(), frozen.sum()
                )
            if active_rows.numel() == frozen.numel():
                active_rows = None
        self.plan = PrefillPlan(geom.pad, geom.q_start, win_lo, sink, frozen_lo, frozen_hi, active_rows)

    def active_rows(self) -> torch.Tensor | None:
        """Rows that ETF leaves active in the current forward (None: all of them)."""
        return None if self.plan is None else self.plan.active_rows

    def _prefill(self, query, key, value, scaling):
        fn = self.runtime.prefill_function(query.device, query.dtype)
        return fn(query, key, value, self.plan, scaling), None

    # ------------------------------------------------------------------ decode

    def _dense(self, module, query, key, value, attention_mask, dropout, scaling, kwargs):
        dense = sdpa_attention_forward if self.runtime.passthrough else gqa_sdpa_attention_forward
        return dense(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    def _decode(self, context: ForwardContext, module, query, key, value, attention_mask, dropout, scaling, kwargs):
        """One decode step: ``select → sparse attention → telemetry``, or the PSAW window, or dense."""
        geom = context.geometry_on(query.device)
        telemetry = self.runtime.telemetry
        q = query[:, :, 0, :]
        sparse = context.sparse_decode  # the policy's decision for this forward
        if self.runtime.selector is not None and sparse:
            ops = self.runtime.ops_for(query.device)  # one table for the selection and the attention
            k_all, v_all = self._whole_buffers(context, key, value)
            if self.runtime.graphed and k_all is not key and query.device.type == "cuda":
                graph_key = self._graph_key(context, q, k_all, v_all, geom, ops, scaling)
                if graph_key is not None:
                    out = self.graphs.run(graph_key, lambda x: self._sparse_step(x, k_all, v_all, geom, scaling, ops)[0],
                                          q, self.runtime.graph_pool(query.device), self.runtime.retired_graphs)
                    return out[:, None], None
            out, sel = self._sparse_step(q, k_all, v_all, geom, scaling, ops)
            if telemetry is not None:
                sel = sel.per_query_head(q.shape[1])
                telemetry.record_decode(self.index, geom.t_last, sel.count, sel.retrieved, sel.active)
                if telemetry.oracle:
                    self._record_oracle(q, key, geom, sel, scaling)
            return out[:, None].contiguous(), None
        if self.window_decode and sparse:
            out, processed = window_decode_step(q, key, value, geom, self.decode_params, scaling)
            if telemetry is not None:
                heads = query.shape[1]
                telemetry.record_decode(
                    self.index, geom.t_last, processed[:, None].expand(-1, heads), None, torch.zeros_like(geom.pad, dtype=torch.bool)
                )
            return out[:, None].contiguous(), None
        self.record_dense_decode(geom, query.shape[1])
        return self._dense(module, query, key, value, attention_mask, dropout, scaling, kwargs)

    def _sparse_step(self, q, key, value, geom: SequenceGeometry, scaling: float, ops):
        """The selection and the sparse attention of one decode step: ``(out [B, Hq, D], selection)``.
        ``key``/``value`` are the cache's valid views or its whole buffers (:meth:`_whole_buffers`):
        every op reads slots by the geometry, never past a sequence's valid length."""
        sel = self.runtime.selector.select(self.index, q, key, value, geom, self.decode_params, scaling, ops)
        if sel.tail is not None:  # a synthetic tail pair beside the indices (CertKV): exact PyTorch softmax
            return attend_with_tail(q, key, value, geom.pad, sel.idx, sel.tail, scaling), sel
        if sel.idx.shape[1] != q.shape[1]:  # one set per KV head (cis.selection: group): read once per group
            attend = ops.sparse_decode_attention_grouped
        elif self.reads_group_union and key.shape[1] < q.shape[1]:  # a set per query head, G > 1
            attend = ops.sparse_decode_attention_union  # each group's union of its heads' sets read once
        else:
            attend = ops.sparse_decode_attention
        return attend(q, key, value, geom.pad, sel.idx, sel.count, scaling), sel

    def _whole_buffers(self, context: ForwardContext, key: torch.Tensor,
                       value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole buffers of this layer's :class:`~prhs_hf.runtime.BufferedLayer` (in the forward's
        ``context.kv_buffers``) whose valid views ``key``/``value`` are, for a step that CUDA graphs
        capture (``runtime.graphed``: CIS, which reads slots by the geometry only), else ``key``/``value``: a sparse step on them has fixed addresses
        while the capacity lasts (what a CUDA graph needs). Every other step gets the valid views: the
        baselines, CIS's tail slot and the oracle telemetry read ``key.shape[-2]`` as the cache's length."""
        layers = context.kv_buffers
        if layers is None or not self.runtime.graphed or self.index >= len(layers):
            return key, value
        whole = getattr(layers[self.index], "whole_buffers", None)
        if whole is None or whole[0].data_ptr() != key.data_ptr() or whole[0].shape[:2] != key.shape[:2]:
            return key, value
        return whole

    def _graph_key(self, context: ForwardContext, q, key, value, geom: SequenceGeometry, ops,
                   scaling: float) -> tuple | None:
        """What a CUDA graph of this layer's sparse CIS step (``runtime.graphed``) bakes in (addresses
        and shapes of every tensor it reads or writes), or None where the layer's geometry is a copy
        made for it (``device_map``): it is not captured."""
        selector = self.runtime.selector
        if geom is not context.geometry:
            return None
        state, local = selector.step_state(self.index)  # the anchors made before the capture
        return (key.data_ptr(), value.data_ptr(), tuple(key.shape), tuple(q.shape), q.dtype, q.device,
                geom.pad.data_ptr(), state.anchor_q.data_ptr(), state.anchor_idx.data_ptr(), state.step.data_ptr(),
                local, ops.name, scaling, self.decode_params.topk)

    def record_dense_decode(self, geom: SequenceGeometry, heads: int) -> None:
        """Telemetry of a decode step that attends to every token (no-op with telemetry off)."""
        telemetry = self.runtime.telemetry
        if telemetry is not None:
            t = geom.t_last
            telemetry.record_decode(self.index, t, t[:, None].expand(-1, heads), None, torch.zeros_like(t, dtype=torch.bool))

    def _record_oracle(self, q, key, geom: SequenceGeometry, sel, scaling) -> None:
        """Full attention of the same queries, compared with the selected sets (telemetry.oracle)."""
        batch, heads, dim = q.shape
        slots = key.shape[-2]
        probs = visible_probabilities(q, key, geom.pad, geom.t_last, scaling)
        selected = torch.zeros(batch, heads, slots + 1, dtype=torch.bool, device=q.device)
        slot_idx = torch.where(sel.idx >= 0, sel.idx + geom.pad[:, None, None], slots).long()
        selected.scatter_(-1, slot_idx, True)
        rows = sel.active[:, None].expand(batch, heads).reshape(-1)
        t = geom.t_last[:, None].expand(batch, heads).reshape(-1)
        self.runtime.telemetry.record_oracle(
            probs.reshape(batch * heads, slots)[rows], selected[..., :slots].reshape(batch * heads, slots)[rows], t[rows]
        )

    def _decodes_dense(self) -> bool:
        """Whether this layer's decode steps attend to every token (no selector, no PSAW window)."""
        return self.runtime.selector is None and not self.window_decode

    # ------------------------------------------------------------------ entry point

    def attend(self, context: ForwardContext, module, query, key, value, attention_mask, dropout, scaling, kwargs):
        """The attention call of this layer in the forward of ``context``: ``query [B, Hq, Lq, D]`` →
        ``([B, Lq, Hq, D], None)``."""
        if kwargs.get("sliding_window") is not None:
            raise ValueError("PrHS does not support sliding-window attention layers")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if context.geometry is None:
            raise RuntimeError("PrHS attention was called outside a forward of the patched model's decoder layers")
        decoding = context.is_decoding(query.shape[2])
        if dropout and (self.plan is not None or (decoding and context.sparse_decode and not self._decodes_dense())):
            raise ValueError(
                f"PrHS's sparse attention does not apply attention dropout (layer {self.index} has dropout {dropout} "
                "in train mode): call model.eval(), or train with a config that leaves attention dense "
                "(no psaw/etf in prefill, e.g. 'cis' or 'dense')"
            )
        if decoding:
            return self._decode(context, module, query, key, value, attention_mask, dropout, scaling, kwargs)
        if self.runtime.selector is not None:
            self.runtime.selector.observe_prefill(self.index, query, key, context.geometry_on(query.device), scaling)
        if self.plan is not None:
            return self._prefill(query, key, value, scaling)
        if query.shape[2] > 1 and not self.runtime.passthrough:  # a dense prefill layer of a sparse config
            dense_prefill = self.runtime.dense_prefill_function(query.device, query.dtype)
            if dense_prefill is not None and not dropout:  # FA4's route has no dropout: SDPA applies it
                geom = context.geometry_on(query.device)
                out = dense_prefill(query, key, value, geom.pad, geom.q_start, scaling, no_mask=attention_mask is None)
                return out, None
        return self._dense(module, query, key, value, attention_mask, dropout, scaling, kwargs)


# ETF: a module runs on the active rows only; frozen rows get zeros and cost nothing. Two PyTorch
# module hooks do it (a forward pre-hook gathers the rows, a forward hook scatters the output back);
# removing their handles undoes it, and parameters, ``state_dict`` keys and ``forward`` do not change.


def install_row_skip(module: nn.Module, active_rows: Callable[[], torch.Tensor | None],
                     on_rows: Callable[[int], None] | None = None) -> list[RemovableHandle]:
    """Make ``module`` compute only the rows ``active_rows()`` names; returns the two hooks' handles
    (``handle.remove()`` on both undoes it).

    ``active_rows()`` returns ``None`` (run as usual) or a 1D long tensor of row indices into the
    module's input flattened to ``[B * L, hidden]`` (its first positional argument); the other rows
    of the output are zero. ``on_rows(n)``, if given, is told how many rows were computed (tests
    count them).
    """
    gathered: list[tuple[torch.Tensor, torch.Size]] = []  # (rows, the input's leading shape) of the call running

    def gather_rows(mod: nn.Module, args: tuple):
        if not args:
            raise TypeError(f"PrHS ETF: {type(mod).__name__} was called without a positional input; its rows "
                            "are skipped on the first positional argument")
        x = args[0]
        rows = active_rows()
        gathered.clear()  # (a call that raised left its entry)
        if rows is None:
            if on_rows is not None:
                on_rows(x.shape[:-1].numel())
            return None
        if on_rows is not None:
            on_rows(rows.numel())
        gathered.append((rows, x.shape[:-1]))
        return (x.reshape(-1, x.shape[-1]).index_select(0, rows).unsqueeze(0), *args[1:])

    def scatter_rows(mod: nn.Module, args: tuple, computed: torch.Tensor):
        if not gathered:
            return None
        rows, lead = gathered.pop()
        computed = computed.reshape(-1, computed.shape[-1])
        out = computed.new_zeros(lead.numel(), computed.shape[-1])
        out.index_copy_(0, rows, computed)
        return out.reshape(*lead, computed.shape[-1])

    return [module.register_forward_pre_hook(gather_rows), module.register_forward_hook(scatter_rows)]
