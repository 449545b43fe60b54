"""HShare (Wu et al., ICLR 2025): hierarchical index sharing across steps, heads and layers (SPEC §6).

HShare shares the critical-token indices of a decode step at three levels, each with a sharing
ratio (its knobs, next to the sink / local / heavy budgets, which are ``budget.sink``,
``budget.local`` and ``budget.topk`` here): *query* level (consecutive decode steps), *head*
level (heads of a layer) and *layer* level (layers). It shares without a similarity gate and
without dilation. The scheme implemented here:

- Query level, ratio ``r_q`` (``baseline.share_ratio``): indices are recomputed every
  ``P = ceil(1 / (1 - r_q))`` decode steps, counted from the first decode step (steps
  ``0, P, 2P, ...``), and reused unchanged (clipped to the current middle) in between. A
  sequence that becomes active between refreshes refreshes at once.
- Head level, ratio ``r_h`` (``baseline.head_share_ratio``): the ``Hq`` query heads are cut into
  ``n_h = max(1, round(Hq (1 - r_h)))`` contiguous groups of (nearly) equal size; at a refresh
  the first head of each group computes the exact top-k of the middle with its own query (the
  CIS retrieval) and every head of the group takes those indices. (HShare clusters heads offline by index similarity; contiguous
  groups are the calibration-free stand-in, and with GQA they keep query heads of the same KV
  head together.)
- Layer level, ratio ``r_l`` (``baseline.layer_share_ratio``): the ``N`` layers are cut into
  ``n_l = max(1, round(N (1 - r_l)))`` contiguous groups of adjacent layers; only a group's
  first layer retrieves (at a refresh), and the later layers of the group take its indices of
  the same step. (HShare picks the sharing
  layers offline by similarity; adjacent layers are the calibration-free stand-in.)

Every layer's set is ``sink ∪ clip(shared top-k) ∪ local`` with its own middle region. Only the
representative heads of representative layers retrieve, at refresh steps, so
``ρ̂ ≈ (n_h / Hq) (n_l / N) / P``: with the defaults ``r_h = r_l = 1/2`` and
``baseline.share_ratio = 0.875`` (P = 8), ρ̂ ≈ 1/32. The paper's settings are HShare-1
(``r_q, r_h, r_l = 1/2, 1/4, 1/4``: ρ̂ = 1/2 · 3/4 · 3/4 ≈ 28.1 %) and HShare-2 (1/2, 1/2, 1/2:
12.5 %), the ``hshare-1`` / ``hshare-2`` rows of :mod:`prhs_hf.evaluation.accuracy.configs`;
``scripts/selection_quality.py`` picks the three ratios to match CIS's ρ̂.
"""

from __future__ import annotations

import math

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from .set_steps import LayerStates, compose, retrieve_topk, step_frame

__all__ = ["HShareSelector", "group_representatives", "refresh_period"]


def refresh_period(query_share: float) -> int:
    """``ceil(1 / (1 - r_q))`` decode steps between index refreshes (1 when ``r_q = 0``)."""
    if not 0.0 <= query_share < 1.0:
        raise ValueError(f"query share ratio must be in [0, 1), got {query_share}")
    return max(1, math.ceil(1.0 / (1.0 - query_share) - 1e-9))


def group_representatives(n: int, share: float) -> list[int]:
    """For each of ``n`` members, the first member of its group: ``round(n (1 - share))`` contiguous groups."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share ratio must be in [0, 1), got {share}")
    groups = max(1, min(n, round(n * (1.0 - share))))
    group_of = [i * groups // n for i in range(n)]
    first = {}
    for i, g in enumerate(group_of):
        first.setdefault(g, i)
    return [first[g] for g in group_of]


class HShareSelector(LayerStates):
    """Indices shared across ``P`` steps, head groups and groups of adjacent layers."""

    def __init__(
        self, num_layers: int, num_heads: int, query_share: float = 0.875, head_share: float = 0.5,
        layer_share: float = 0.5,
    ):
        super().__init__()
        self.period = refresh_period(query_share)
        self.query_share, self.head_share, self.layer_share = query_share, head_share, layer_share
        self.head_rep = group_representatives(num_heads, head_share)
        self.layer_rep = group_representatives(num_layers, layer_share)
        self.num_heads = num_heads

    @property
    def expected_ratio(self) -> float:
        """ρ̂ when every layer is sparse and steps come in whole periods: ``(n_h/Hq)(n_l/N)/P``."""
        heads = len(set(self.head_rep)) / len(self.head_rep)
        layers = len(set(self.layer_rep)) / len(self.layer_rep)
        return heads * layers / self.period

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """Refresh (representatives retrieve or copy) or reuse, then compose the set; periods count
        from the first decode step after a prefill (``ops`` unused)."""
        B, H, _ = q.shape
        if H != self.num_heads:
            raise ValueError(f"HShare was built for {self.num_heads} query heads, the layer has {H}")
        k = params.topk
        st = self.layer_state(layer, B, lambda: {
            "idx": torch.full((B, H, k), -1, dtype=torch.int32, device=q.device),
            "has": torch.zeros(B, dtype=torch.bool, device=q.device),
        })
        step = self.advance(layer)
        frame = step_frame(geom, params)
        refresh = frame.active & (~st["has"] | (step % self.period == 0))  # [B]
        rep_layer = self.layer_rep[layer] if layer < len(self.layer_rep) else layer
        head_rep = torch.tensor(self.head_rep, device=q.device)
        if rep_layer == layer:
            is_rep_head = head_rep == torch.arange(H, device=q.device)
            retrieve = refresh[:, None] & is_rep_head[None, :]
            fresh = retrieve_topk(q, k_cache, geom, frame, retrieve, k, scale)
            fresh = fresh.index_select(1, head_rep)  # every head takes its representative's indices
        else:
            retrieve = torch.zeros(B, H, dtype=torch.bool, device=q.device)
            source = self.state.get(rep_layer)
            if source is None or source["idx"].shape != st["idx"].shape:
                raise RuntimeError(f"HShare: layer {layer} shares layer {rep_layer}'s indices, which it has not selected")
            fresh = source["idx"]
        # replaced, not written in place (LayerStates.mark_step keeps the tensors themselves)
        st["idx"] = torch.where(refresh[:, None, None], fresh, st["idx"])
        st["has"] = st["has"] | refresh
        middle = torch.where(frame.active[:, None, None], st["idx"], -1)
        return compose(frame, middle, params, retrieved=retrieve)
