"""CertKV (seeds/certkv_paper.txt §4): prefill-time compression under an exact slot budget.

Three choices, each in the shared budget accounting (SPEC §4, :func:`compose`):

1. **Scores.** SnapKV's observation window: the last ``W`` prompt queries' causal softmax over
   the prompt, summed over those queries (``π_{h,j}``, averaged over the query heads of KV head
   ``h``) and max-pooled along the sequence (``pool_kernel``; 1 = none), ranks the compressible
   prompt tokens ``[sink, hi0)`` of each KV head (``hi0`` is the local window's start at the first
   decode step; ties go to the lower index).
2. **Allocation (§4.1).** The live budget of a layer is ``B_live = Hkv · topk`` middle slots;
   with the tail slot on, one per KV head is charged to it: ``B_real = B_live - Hkv`` real-token
   slots, split as ``Σ_h b_h = B_real`` exactly with ``b_h >= max(1, ⌊0.2 B_real / Hkv⌋)``, in
   proportion to each head's centered value dispersion ``m_h M_2,h = Σ_{j∈E_h} π_j ‖v_j − v*_h‖²``
   over the tokens ``E_h`` it would omit at the even split (App. C.3: the observation-weighted
   dispersion envelope of the tail), by largest remainders (deterministic repair: ties to the lower
   head). A head never gets more than its candidates; a prompt the budget covers is kept whole
   (then fewer than ``B_real`` slots are used, as every selector attends to fewer keys than its
   budget on a short middle).
3. **Tail-summary slot.** The omitted tokens ``E_h`` of head ``h`` become one synthetic pair:
   ``k* = Σ r_j k_j``, ``v* = Σ r_j v_j`` with ``r_j = π_j / m_h`` (the conditional tail
   distribution under the observation window), attended with logit ``scale · q·k* + β_h``. The
   bias ``β_h`` is the tail's log-mass in logit units: the mean over the window queries of
   ``log Σ_{j∈E_h} exp(scale · q_w·k_j) − scale · q_w·k*``, so that for the window the synthetic
   key carries the omitted tokens' softmax mass (``β = log n`` for ``n`` equal keys). No omitted
   token: ``β = -inf`` and the slot is not charged.

Decode attends to ``sinks ∪ kept prompt tokens ∪ [hi0, t)``: the kept tokens, every token after
``hi0`` (the last prompt tokens and all generated ones, as SnapKV/CertKV never evict generated
tokens) and the tail slot. So the first step costs exactly ``sink + local + b_h (+1)`` keys per
head (the layer's total middle is ``Hkv · topk``, as every selector's) and each generated token
adds one. With PSAW on decode the kept set is clipped to the window ``[lo, hi)`` (compose), the
tail still summarises only the prefill-time omissions.

The selection is one index set per KV head (``DecodeSelection`` rows are ``Hkv``), the scores and
the allocation are computed at a layer's first decode step from the stored window queries (the
values are needed and ``observe_prefill`` sees only keys). Retrieval ratio: decode never scores
keys, so ρ̂ = 0 (the scoring is prefill work, as StreamingLLM's ρ̂ is 0).
"""

from __future__ import annotations

import dataclasses

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from .set_steps import LayerStates, compose, step_frame, tail_log_mass, tail_moments, to_real, window_scores

__all__ = ["CertKVSelector", "window_scores", "allocate_budget", "FLOOR_FRACTION"]

FLOOR_FRACTION = 0.2
"""§4.1's per-head floor: ``b_h >= max(1, ⌊0.2 B_real / H⌋)``."""


def allocate_budget(
    dispersion: torch.Tensor, total: int, cap: torch.Tensor, floor_fraction: float = FLOOR_FRACTION
) -> torch.Tensor:
    """§4.1's split of ``total`` slots over the heads: ``[B, H]`` int64 with ``Σ_h = min(total, Σ_h cap)``.

    Every head gets at least ``min(cap, max(1, ⌊floor_fraction · total / H⌋))``, at most ``cap``
    (``[B]`` or ``[B, H]``), and the rest in proportion to ``dispersion [B, H]`` (>= 0; all zero:
    evenly) by largest remainders, ties to the lower head; heads at their cap pass their share on.
    """
    B, H = dispersion.shape
    dev = dispersion.device
    cap = cap.long().expand(B, H) if cap.dim() == 2 else cap.long()[:, None].expand(B, H)
    base = torch.minimum(cap, torch.full_like(cap, max(1, int(floor_fraction * total / H))))
    target = torch.minimum(cap.sum(-1), torch.full_like(cap[:, 0], total))
    w = dispersion.double().clamp_min(0)
    closed = base >= cap
    # the pool above the floors goes to the open heads in proportion; a head whose share reaches its
    # cap is closed at the cap and the rest is shared again (each round closes one or settles)
    for _ in range(H + 1):
        pool = (target - torch.where(closed, cap, base).sum(-1)).double()
        wo = torch.where(closed, torch.zeros_like(w), w)
        wo = torch.where(wo.sum(-1, keepdim=True) > 0, wo, (~closed).double())
        ideal = base + pool[:, None] * wo / wo.sum(-1, keepdim=True).clamp_min(1e-300)
        closed = closed | (ideal >= cap)
    whole = torch.where(closed, cap, torch.floor(ideal + 1e-9).long())
    left = target - whole.sum(-1)
    key = torch.where(closed, torch.full_like(ideal, -1.0), ideal - whole)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(H, device=dev).expand(B, H).contiguous())
    return whole + ((rank < left[:, None]) & ~closed).long()


class CertKVSelector(LayerStates):
    """SnapKV window scores + dispersion-allocated per-KV-head budgets + a tail-summary slot."""

    CALL_STATE = (*LayerStates.CALL_STATE, "widths", "planned")

    def __init__(self, window: int = 32, pool_kernel: int = 5, tail_slot: bool = True,
                 floor_fraction: float = FLOOR_FRACTION):
        super().__init__()
        if window < 1 or pool_kernel < 1:
            raise ValueError(f"CertKV: baseline.window ({window}) and baseline.pool_kernel ({pool_kernel}) "
                             f"must be >= 1")
        self.window = window
        self.pool_kernel = pool_kernel
        self.tail_slot = tail_slot
        self.floor_fraction = floor_fraction
        self.widths: dict[int, int] = {}  # per layer: the most kept tokens of a head (host int)
        self.planned: dict[int, int] = {}  # per layer: the decode step that planned

    # ------------------------------------------------------------------ prefill

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """Keep the last ``window`` prompt queries (across a continued prefill); the plan waits for decode."""
        W = min(self.window, query.shape[2])
        q_win = query[:, :, -W:].float()
        pos = geom.query_real_index(query.shape[2])[:, -W:]
        old = self.state.get(layer)
        continued = not bool((geom.q_start <= 0).all())
        if continued and old is not None and "q" in old and old["q"].shape[:2] == q_win.shape[:2]:
            q_win = torch.cat([old["q"], q_win], dim=2)[:, :, -self.window:]
            pos = torch.cat([old["pos"], pos], dim=1)[:, -self.window:]
        self.begin_prompt(layer)
        self.state[layer] = {"q": q_win, "pos": pos}

    # ------------------------------------------------------------------ the plan (first decode step)

    def _plan(self, layer: int, st: dict, k_cache: torch.Tensor, v_cache: torch.Tensor, geom: SequenceGeometry,
              p: DecodeParams, scale: float, hi0: torch.Tensor) -> None:
        """Rank, allocate and summarise the omitted tail of ``layer`` (writes ``st``)."""
        B, Hkv, S, D = k_cache.shape
        pi, logits = window_scores(st["q"], st["pos"], k_cache, geom.pad, scale)  # [B, Hkv, S] real
        score = pi
        if self.pool_kernel > 1:
            k = self.pool_kernel
            score = torch.nn.functional.max_pool1d(pi.reshape(B * Hkv, 1, S), k, 1, k // 2)[..., :S].reshape(B, Hkv, S)
        real = torch.arange(S, device=k_cache.device)
        cand = (real[None, :] >= p.sink) & (real[None, :] < hi0[:, None])  # [B, S] compressible prompt
        n_cand = cand.sum(-1)
        ranked = score.masked_fill(~cand[:, None], float("-inf"))
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, real.expand(B, Hkv, S).contiguous())  # rank of real j
        total = Hkv * (p.topk - (1 if self.tail_slot else 0))
        vr = to_real(v_cache.float().movedim(-1, -2), geom.pad).movedim(-1, -2)  # [B, Hkv, S, D] real
        even = torch.clamp(n_cand, max=total // Hkv)[:, None]
        dispersion = tail_moments(pi, vr, cand[:, None] & (rank >= even[..., None]))[2]
        budget = allocate_budget(dispersion, total, n_cand, self.floor_fraction)  # [B, Hkv]
        width = max(1, int(budget.max()))
        keep = order[..., :width]
        keep = torch.where(torch.arange(width, device=keep.device) < budget[..., None], keep, -1).to(torch.int32)
        st.update(keep=keep, hi0=hi0, budget=budget.to(torch.int32))
        if self.tail_slot:
            omitted = cand[:, None] & (rank >= budget[..., None])  # [B, Hkv, S] by real index
            kr = to_real(k_cache.float().movedim(-1, -2), geom.pad).movedim(-1, -2)
            _, tail_k, _ = tail_moments(pi, kr, omitted)
            _, tail_v, _ = tail_moments(pi, vr, omitted)
            log_mass = tail_log_mass(logits, omitted, st["q"], st["pos"], tail_k, geom.pad, scale)
            st.update(tail_k=tail_k, tail_v=tail_v, log_mass=log_mass)
        self.widths[layer] = width
        st.pop("q")
        st.pop("pos")

    # ------------------------------------------------------------------ decode

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """Sinks, the kept prompt tokens, ``[hi0, t)`` and the tail slot (one set per KV head; ``ops`` unused)."""
        B, Hq, _ = q.shape
        step = self.advance(layer)
        frame = step_frame(geom, params)
        st = self.state.get(layer)
        if st is None or ("keep" not in st and "q" not in st) or next(iter(st.values())).shape[0] != B:
            # no prefill seen: this step's query is the observation window
            st = self.state[layer] = {"q": q[:, :, None].float(), "pos": geom.t_last[:, None] - 1}
        if "keep" not in st:
            self._plan(layer, st, k_cache, v_cache, geom, params, scale, frame.hi)
            self.planned[layer] = step
        keep, hi0 = st["keep"], st["hi0"]
        win = torch.where(frame.active, torch.maximum(frame.lo, torch.minimum(hi0, frame.hi)), frame.win_start)
        # every key of the step fits: sinks, kept tokens and [hi0, t) (local + one per step since the plan)
        need = params.sink + self.widths[layer] + params.local + step - self.planned[layer] + 1
        sel = compose(frame, keep, dataclasses.replace(params, capacity=max(params.capacity, need)), win_start=win)
        if not self.tail_slot:
            return sel
        charged = frame.active[:, None] & torch.isfinite(st["log_mass"])
        log_mass = torch.where(charged, st["log_mass"], torch.full_like(st["log_mass"], float("-inf")))
        return dataclasses.replace(sel, count=sel.count + charged.to(sel.count.dtype),
                                   tail=(st["tail_k"], st["tail_v"], log_mass))

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search (every state tensor has the batch first)."""
        super().reorder(index)

    def reset(self) -> None:
        """Forget every layer's plan."""
        super().reset()
        self.widths.clear()
        self.planned.clear()
