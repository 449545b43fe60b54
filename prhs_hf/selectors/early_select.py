"""EarlySelectKV: a layer's decode indices chosen from a proxy query built one layer early (SPEC §6).

EarlySelectKV (the seed ``earlyselectkv_summary.txt``) is a transformation of a query-conditioned
selector, not a selector of its own: layer ℓ+1's key set is chosen from a *proxy query* built from
an earlier hidden state, while the attention itself keeps the real query. Two taps:

- ``early``: the hidden state entering layer ℓ (the longest preparation window);
- ``mid``: after layer ℓ's attention residual, the input of its ``post_attention_layernorm``
  (higher fidelity; the paper's default).

The proxy is layer ℓ+1's own query path applied to the tap: its ``input_layernorm``, its exact
``W_q`` (and bias), or a rank-``r`` factorisation ``(U_r S_r) (V_rᵀ x)`` of ``W_q`` from one SVD
computed when the model is patched, its ``q_norm`` where the family has one (Qwen3, GLM-4-MoE),
and its RoPE at the current position (the step's ``position_embeddings``; each family's own
``apply_rotary_pos_emb``, so partial rotary is followed). Layer 0 has no earlier tap and selects
with its real query.

Applied to Quest (ES-Quest: the page bounds are scored with the proxy) and to CIS (ES-CIS: the
anchor match, the retrieval and the anchors themselves use the proxy). The wrapped selector is
unchanged, so the budget accounting, ρ̂ and telemetry are exactly its own; the attention of
:class:`~prhs_hf.layer.PrHSLayer` always receives the real query.

Latency hiding (``early_select.side_stream``, ES-CIS): the proxy of layer ℓ+1 is computed in layer
ℓ's hook and only consumed by layer ℓ+1's :meth:`EarlySelectSelector.select`. Everything that
selection reads is ready at the end of the tap: the proxy, layer ℓ+1's anchors, and its cache rows
of the middle region (the current token is always in the local window, so it is never scored).
With ``side_stream`` the hook therefore starts layer ℓ+1's CIS selection
(:meth:`CISSelector.start <prhs_hf.selectors.cis.CISSelector.start>` with ``fork=True``) on a side
CUDA stream (:mod:`prhs_hf.ops.side_stream`), and layer ℓ+1's ``select`` joins it and finishes
the step (anchors recorded, on the main stream). Without it the selection runs at layer ℓ+1. The
same indices either way; under ``torch.compile`` the fork and the join are two custom ops, and the
CUDA graph holds both streams. Not forked: layer 1 with the early tap (its fork would come before
layer 0 opens the step) and the first layer of each device under a ``device_map``.
``scripts/probe_es_side_stream.py`` measures the overlap per layer, ``scripts/bench_e2e_decode.py``
(configs ``es-cis`` and ``es-cis-side``) in the compiled ``generate()`` step.

Fidelity telemetry (``telemetry.oracle``): at every decode step of layers ℓ ≥ 1 the selector
compares the exact top-k middle sets of the proxy and of the real query (overlap
``|S_proxy ∩ S_real| / |S_real|``) and the attention mass of ``sink ∪ S ∪ local`` under the real
query's full attention; :meth:`EarlySelectSelector.fidelity` gives the per-layer means.

Not covered: tensor parallelism (a sharded ``q_proj`` would need its shard's SVD).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import cache_argument
from ..config import ConfigError
from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from ..ops.side_stream import drop_pending
from .set_steps import compose, retrieve_topk, step_frame, to_real, visible_probabilities
from .base import Selector, StepMark, undo_period
from .cis import CISSelector, CISStart

__all__ = ["EarlySelectSelector", "QueryProjection", "TAPS", "low_rank_factors"]

TAPS = ("early", "mid")


def low_rank_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(down [r, in], up [out, r])`` with ``up @ down`` the best rank-``r`` approximation of ``weight [out, in]``.

    One SVD in fp32 (``down = V_rᵀ``, ``up = U_r S_r``), returned in ``weight``'s dtype.
    """
    limit = min(weight.shape)
    if not 1 <= rank <= limit:
        raise ConfigError(f"early_select.rank: {rank} is out of range for this model's W_q of shape "
                          f"{tuple(weight.shape)}; allowed [1, {limit}] or null (the exact W_q)")
    u, s, vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
    return vh[:rank].to(weight.dtype).contiguous(), (u[:, :rank] * s[:rank]).to(weight.dtype).contiguous()


class QueryProjection:
    """Layer ℓ+1's query path applied to another hidden state: norm, ``W_q`` (exact or low rank), q-norm, RoPE."""

    def __init__(self, decoder_layer: nn.Module, rank: int | None = None):
        attn = decoder_layer.self_attn
        self.norm = decoder_layer.input_layernorm
        self.q_proj = attn.q_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.head_dim = attn.head_dim
        self.rope: Callable = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.factors = None if rank is None else low_rank_factors(attn.q_proj.weight, rank)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, D]`` proxy query of ``hidden [B, 1, H]`` at the step's position (``cos``/``sin`` ``[B, 1, ·]``)."""
        w = self.q_proj.weight
        x = self.norm(hidden.to(w.device))
        if self.factors is None:
            q = F.linear(x, w, self.q_proj.bias)  # not the module: ETF's row skipping hooks it for prefill
        else:
            down, up = self.factors
            q = F.linear(F.linear(x, down), up, self.q_proj.bias)
        q = q.view(*x.shape[:-1], -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)  # [B, Hq, 1, D]
        q, _ = self.rope(q, q, cos.to(w.device), sin.to(w.device))
        return q[:, :, 0]


class EarlySelectSelector:
    """A selector (CIS or Quest) whose layers ℓ ≥ 1 select with the proxy query of layer ℓ-1's tap.

    Args:
        base: the wrapped selector; it sees the proxy wherever it would see the query.
        tap: ``"early"`` or ``"mid"`` (``early_select.tap``).
        rank: ``None`` for the exact ``W_q``, else the rank of its SVD factorisation (``early_select.rank``).
        fidelity: measure proxy fidelity per layer at every decode step (``telemetry.oracle``).
        side_stream: start layer ℓ+1's selection at layer ℓ's tap on a side CUDA stream
            (``early_select.side_stream``; ``base`` a :class:`~prhs_hf.selectors.cis.CISSelector`).
    """

    CALL_STATE: tuple[str, ...] = ()  # the proxies are per step; the call state is the base's

    def __init__(self, base: Selector, tap: str = "mid", rank: int | None = None, fidelity: bool = False,
                 side_stream: bool = False):
        if tap not in TAPS:
            raise ConfigError(f"early_select.tap: {tap!r} is not allowed; allowed: {', '.join(TAPS)}")
        if rank is not None and rank < 1:
            raise ConfigError(f"early_select.rank: {rank} is out of range; allowed >= 1 or null")
        if side_stream and not isinstance(base, CISSelector):
            raise ConfigError(f"early_select.side_stream: applies to ES-CIS; the selector is {type(base).__name__}")
        self.base = base
        self.tap = tap
        self.rank = rank
        self.measure_fidelity = fidelity
        self.side_stream = side_stream
        self.projections: dict[int, QueryProjection] = {}  # target layer -> its query path (layers >= 1)
        self.proxies: dict[int, torch.Tensor] = {}  # target layer -> this step's proxy query
        self.started: dict[int, CISStart] = {}  # target layer -> its selection started at the tap (side_stream)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cache = None  # this forward's past_key_values (side_stream)
        self._runtime = None  # geometry, decode params and decode ops of the patched model (side_stream)
        self._layers: nn.ModuleList | None = None
        self._fid: dict[int, torch.Tensor] = {}  # layer -> float64 [rows, overlap, mass_proxy, mass_real]

    # ------------------------------------------------------------------ hooks

    def attach(self, layers: nn.ModuleList, runtime=None) -> list:
        """Build layers 1..N-1's query paths (the SVDs once per selector) and register the taps on ``layers``.

        ``runtime`` (the model's :class:`~prhs_hf.runtime.PrHSRuntime`: the step's geometry, each
        layer's decode params and the device's decode ops) is needed with ``side_stream``. Returns
        the hook handles; the caller removes them (``patch`` keeps them with its own hooks).
        """
        if self.side_stream and runtime is None:
            raise ValueError("early_select.side_stream: attach(layers, runtime) needs the patched model's runtime")
        self._runtime = runtime
        self._layers = layers
        if not self.projections:
            self.projections = {i: QueryProjection(layers[i], self.rank) for i in range(1, len(layers))}
        handles = []
        for i in range(len(layers) - 1):
            handles.append(layers[i].register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
            if self.tap == "mid":
                handles.append(layers[i].post_attention_layernorm.register_forward_pre_hook(self._mid_hook(i)))
        return handles

    def _layer_hook(self, i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[1] != 1:  # a prompt: nothing to precompute
                return
            self._rope = kwargs["position_embeddings"]
            self._cache = cache_argument(kwargs)
            if self.tap == "early":
                self._tap(i + 1, hidden, fork=i > 0)  # layer 1's fork would come before layer 0 opens the step

        return hook

    def _mid_hook(self, i: int):
        def hook(module, args):
            hidden = args[0]
            if hidden.shape[1] == 1:
                self._tap(i + 1, hidden, fork=True)

        return hook

    def _tap(self, layer: int, hidden: torch.Tensor, fork: bool) -> None:
        """Layer ``layer``'s proxy from the tap's ``hidden``; with ``side_stream``, its selection started."""
        proxy = self.projections[layer](hidden, *self._rope)
        self.proxies[layer] = proxy
        layers = getattr(self._cache, "layers", None)
        context = self._runtime.context  # the forward's (its first layer's pre-hook made it)
        if not (self.side_stream and fork and context.is_decoding(hidden.shape[1])
                and layers is not None and len(layers) > layer):
            return  # selected at the layer itself (also a 1-token prompt: a prefill, nothing to select)
        k_cache = layers[layer].keys
        geom = context.geometry_on(k_cache.device)
        params = self._runtime.layers[layer].decode_params
        scale = self._layers[layer].self_attn.scaling
        ops = self._runtime.ops_for(k_cache.device)  # the table the layer's own step gets
        self.started[layer] = self.base.start(layer, proxy.to(device=k_cache.device, dtype=k_cache.dtype), k_cache,
                                              geom, params, scale, ops, fork=True)

    # ------------------------------------------------------------------ selector protocol

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """The wrapped selector's prefill (a prompt's queries are real: nothing is precomputed)."""
        if layer == 0:
            self.proxies.clear()
            self.started.clear()
            drop_pending()
        self.base.observe_prefill(layer, query, key, geom, scale)

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """The wrapped selector's set for the proxy query of ``layer`` (layer 0: the real query), on ``ops``."""
        proxy = q
        if layer > 0:
            proxy = self.proxies.pop(layer, None)
            if proxy is None:
                raise RuntimeError(f"early_select: no proxy query for layer {layer}: the taps are not attached "
                                   f"(patch the model with prhs_hf.patch) or layer {layer - 1} did not run this step")
            proxy = proxy.to(device=q.device, dtype=q.dtype)
            if self.measure_fidelity:
                self._record_fidelity(layer, proxy, q, k_cache, geom, params, scale)
            started = self.started.pop(layer, None)
            if started is not None:
                return self.base.finish(started, proxy, k_cache, v_cache, geom, scale)
        return self.base.select(layer, proxy, k_cache, v_cache, geom, params, scale, ops)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search (the proxies are rebuilt every step)."""
        self.base.reorder(index)

    @property
    def undo_period(self) -> int | None:
        """The wrapped selector's (the proxies are per step: nothing of this one's to undo)."""
        return undo_period(self.base)

    def mark_step(self) -> StepMark:
        """The wrapped selector's mark (:class:`~prhs_hf.selectors.base.UndoesSteps`)."""
        return self.base.mark_step()

    def undo_to(self, mark: StepMark) -> None:
        """Put the wrapped selector's state back to ``mark``."""
        self.base.undo_to(mark)

    def reset(self) -> None:
        """Forget the wrapped selector's state, the proxies and the fidelity counters."""
        self.base.reset()
        self.proxies.clear()
        self.started.clear()
        drop_pending()
        self._fid.clear()

    # ------------------------------------------------------------------ fidelity

    def _record_fidelity(self, layer, proxy, q, k_cache, geom, params, scale) -> None:
        frame = step_frame(geom, params)
        rows = frame.rows(q.shape[1])
        real_set = retrieve_topk(q, k_cache, geom, frame, rows, params.topk, scale)
        proxy_set = retrieve_topk(proxy, k_cache, geom, frame, rows, params.topk, scale)
        hit = (proxy_set[..., :, None] == real_set[..., None, :]) & (real_set[..., None, :] >= 0)
        overlap = hit.any(-1).sum(-1).double() / (real_set >= 0).sum(-1).clamp_min(1).double()
        probs = full_attention(q, k_cache, geom, scale)
        masses = []
        for middle in (proxy_set, real_set):
            idx = compose(frame, middle, params).idx
            masses.append((probs.gather(-1, idx.long().clamp_min(0)) * (idx >= 0)).sum(-1).double())
        act = rows.double()
        acc = torch.stack([act.sum(), (overlap * act).sum(), (masses[0] * act).sum(), (masses[1] * act).sum()])
        self._fid[layer] = self._fid[layer] + acc if layer in self._fid else acc

    def fidelity(self) -> list[dict]:
        """Per layer ``>= 1`` with active rows: ``{layer, rows, topk_overlap, mass_proxy, mass_real,
        retained}``, the means over active (row, step) pairs of the top-k overlap and of the real
        query's attention mass on ``sink ∪ S ∪ local`` for the proxy's and the real top-k ``S``;
        ``retained = mass_proxy / mass_real``."""
        out = []
        for layer in sorted(self._fid):
            rows, overlap, mp, mr = self._fid[layer].tolist()
            if rows == 0:
                continue
            out.append({"layer": layer, "rows": int(rows), "topk_overlap": overlap / rows, "mass_proxy": mp / rows,
                        "mass_real": mr / rows, "retained": mp / mr if mr > 0 else None})
        return out



def full_attention(q: torch.Tensor, k_cache: torch.Tensor, geom: SequenceGeometry, scale: float) -> torch.Tensor:
    """``[B, Hq, S]`` fp32 softmax of ``q [B, Hq, D]`` over every visible token, indexed by real position."""
    return to_real(visible_probabilities(q, k_cache, geom.pad, geom.t_last, scale), geom.pad)
