"""The FLOP model ``prhs-hf calibrate`` ranks schedules by: prefill FLOPs of the decoder layers.

Embeddings and the LM head are the same for every schedule, so they are left out. FLOPs are two
per multiply-add:

- attention: ``4 · head_dim · H_q`` FLOPs per visible query-key pair (``QKᵀ`` and ``PV``),
  visible pairs counted with SPEC §3's predicate (sinks plus window per active row, nothing for a
  frozen row: :class:`VisiblePairs`);
- projections and MLP: ``2 ·`` their multiply-adds per row: ``k_proj`` and ``v_proj`` for every
  row (frozen rows still give keys and values), ``q_proj``, ``o_proj`` and the MLP only for the
  active rows (what :func:`prhs_hf.layer.install_row_skip` skips). A gated MLP has ``3 · d · d_ff``
  multiply-adds per row; for a mixture of experts ``d_ff`` is the routed experts per token times
  their width, plus the shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FlopModel", "VisiblePairs"]


@dataclass(frozen=True)
class FlopModel:
    """Prefill FLOPs of the decoder layers (the module docstring says what is counted and what is left out)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int

    @classmethod
    def from_config(cls, config: Any) -> "FlopModel":
        """From a transformers config (``head_dim`` defaults to ``hidden / heads``; MoE widths as documented)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        routed = getattr(config, "num_experts_per_tok", None)
        if routed and getattr(config, "moe_intermediate_size", None):
            width = routed * config.moe_intermediate_size
            shared = getattr(config, "shared_expert_intermediate_size", None)
            if shared is None and getattr(config, "n_shared_experts", None):
                shared = config.n_shared_experts * config.moe_intermediate_size
            width += shared or 0
        else:
            width = config.intermediate_size
        return cls(config.num_hidden_layers, config.hidden_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, width)

    @property
    def per_pair(self) -> int:
        """Attention FLOPs per visible query-key pair (all query heads)."""
        return 4 * self.head_dim * self.heads

    @property
    def per_row_kv(self) -> int:
        """``k_proj`` + ``v_proj`` FLOPs per row (computed for frozen rows too)."""
        return 2 * 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def per_active_row(self) -> int:
        """``q_proj`` + ``o_proj`` + gated MLP FLOPs per active row."""
        return 2 * (2 * self.hidden * self.heads * self.head_dim + 3 * self.hidden * self.mlp_width)

    def layer(self, length: int, pairs: int, frozen: int) -> int:
        """One layer's prefill FLOPs for ``pairs`` visible pairs and ``frozen`` frozen rows."""
        return self.per_pair * pairs + length * self.per_row_kv + (length - frozen) * self.per_active_row

    def dense(self, length: int) -> int:
        """Dense causal prefill of ``length`` tokens."""
        from ..schedules import causal_pairs

        return self.num_layers * self.layer(length, causal_pairs(length), 0)


class VisiblePairs:
    """Visible pairs of SPEC §3 for a window fraction and frozen count, from a cached per-row prefix sum.

    ``pairs(w, frozen_hi)``: the query-key pairs a ``length``-token prompt computes when PSAW's
    window fraction is ``w`` and rows ``[sink, frozen_hi)`` are frozen (none when ``frozen_hi ≤ sink``).
    """

    def __init__(self, length: int, sink: int):
        self.length, self.sink = length, sink
        self._prefix: dict[float, list[int]] = {}

    def __call__(self, w: float, frozen_hi: int) -> int:
        import torch

        from ..schedules import psaw_window_start_tensor

        prefix = self._prefix.get(w)
        if prefix is None:
            t = torch.arange(1, self.length + 1)
            seen = t.clamp(max=self.sink) + (t - psaw_window_start_tensor(t, w, self.sink).long()).clamp(min=0)
            prefix = [0] + seen.cumsum(0).tolist()
            self._prefix[w] = prefix
        total = prefix[self.length]
        if frozen_hi > self.sink:
            total -= prefix[frozen_hi] - prefix[self.sink]
        return total
