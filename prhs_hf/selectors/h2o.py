"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023), budget-matched (SPEC §6).

Each (sequence, query head) keeps an accumulated attention score per real token: the column sums
of the prompt's causal softmax (from :meth:`H2OSelector.observe_prefill`, computed over chunks of
query rows so that no ``L x L`` tensor exists), plus, at each decode step, the softmax weights of
that step's query over the keys it attended to. An active row attends to
``sink ∪ top-k(accumulated score over the middle) ∪ local``: the ``topk`` heavy hitters of the
middle plus the recent window (H2O's heavy + recent split, with CIS's sinks and local window).

Equivalence with H2O's greedy eviction: a token outside the selected set receives no attention,
so its score is frozen, while selected tokens' scores only grow and the middle only gains tokens
(from the local window). The k-th largest middle score therefore never decreases, and a token
that drops out of the top-k never returns, exactly as an evicted H2O token. The scores come from
dense causal prefill attention (PSAW/ETF prefill is not reflected; the comparison runs without
them).

Retrieval ratio: H2O ranks every middle token by its score at every step, so every active row
counts as retrieving (ρ̂ = 1), like the oracle and Quest.
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from .set_steps import LayerStates, compose, grow_last, set_probabilities, step_frame, to_real, topk_of_scores

__all__ = ["H2OSelector", "prefill_column_sums"]


def prefill_column_sums(
    query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float, row_chunk: int = 256
) -> torch.Tensor:
    """``[B, Hq, Lk]`` fp32 column sums (by cache slot) of the causal softmax of the prefill rows.

    ``query [B, Hq, Lq, D]`` are the rows at real positions ``geom.q_start + i``; ``key
    [B, Hkv, Lk, D]`` the cache. Query row ``i`` sees the real keys ``0..q_start+i``; padding
    rows contribute nothing. Rows are processed ``row_chunk`` at a time.
    """
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    g = Hq // Hkv
    kf = key.float()[:, :, None]  # [B, Hkv, 1, Lk, D]
    key_real = torch.arange(Lk, device=query.device)[None, :] - geom.pad.long()[:, None]  # [B, Lk]
    rows_real = geom.query_real_index(query.shape[2]).long()  # [B, Lq]
    sums = torch.zeros(B, Hq, Lk, dtype=torch.float32, device=query.device)
    for r0 in range(0, Lq, row_chunk):
        qr = rows_real[:, r0 : r0 + row_chunk]  # [B, c]
        qf = query[:, :, r0 : r0 + row_chunk].float().reshape(B, Hkv, g, -1, D)
        scores = torch.matmul(qf, kf.transpose(-1, -2)).reshape(B, Hq, -1, Lk) * scale
        visible = (key_real[:, None, :] >= 0) & (key_real[:, None, :] <= qr[:, :, None])  # [B, c, Lk]
        probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
        probs = torch.where(visible[:, None], probs, torch.zeros_like(probs))  # rows with no key: 0, not NaN
        sums += probs.sum(dim=2)
    return sums


class H2OSelector(LayerStates):
    """Heavy hitters by accumulated attention + sinks + local window."""

    def __init__(self, row_chunk: int = 256):
        super().__init__()
        self.row_chunk = row_chunk

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """Add the prompt rows' attention to the layer's scores (a prompt from position 0 starts over)."""
        sums = to_real(prefill_column_sums(query, key, geom, scale, self.row_chunk), geom.pad)
        old = self.state.get(layer)
        fresh = bool((geom.q_start <= 0).all())
        if fresh or old is None or old["score"].shape[:2] != sums.shape[:2]:
            self.state[layer] = {"score": sums}
        else:  # a continued prefill (more prompt after a cached part)
            length = max(old["score"].shape[-1], sums.shape[-1])
            self.state[layer] = {"score": grow_last(old["score"], length) + grow_last(sums, length)}
        self.steps[layer] = 0

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """Top-k middle tokens by accumulated score; then this step's attention is added to the scores
        (``ops`` unused)."""
        B, H, _ = q.shape
        slots = k_cache.shape[-2]
        st = self.layer_state(layer, B, lambda: {"score": torch.zeros(B, H, slots, device=q.device)})
        score = grow_last(st["score"], slots)
        self.advance(layer)
        frame = step_frame(geom, params)
        rows = frame.rows(H)
        middle = topk_of_scores(score, frame, rows, params.topk)
        sel = compose(frame, middle, params, retrieved=rows)
        probs = set_probabilities(q, k_cache, geom.pad, sel, scale)
        width = score.shape[-1]
        target = torch.where(sel.idx >= 0, sel.idx.long(), width)
        st["score"] = grow_last(score, width + 1).scatter_add(-1, target, probs)[..., :width]
        return sel
