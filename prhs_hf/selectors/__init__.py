"""Comparison selectors (SPEC §6), one per module, chosen by the config's ``baseline.name``."""

from __future__ import annotations

from typing import Callable

import torch

from ..config import ResolvedConfig
from ..ops.compose.dilated_set import dilated_set_size
from ..ops.decode_ops import DecodeOps
from .base import Selector
from .certkv import CertKVSelector
from .cis import CISSelector
from .direct_reuse import DirectReuseSelector
from .double_sparsity import DoubleSparsitySelector
from .early_select import EarlySelectSelector
from .h2o import H2OSelector
from .hshare import HShareSelector
from .oracle import OracleSelector
from .quest import QuestSelector
from .random_expansion import RandomExpansionSelector
from .streaming import StreamingSelector

__all__ = [
    "Selector",
    "make_selector",
    "cis_set_size",
    "CISSelector",
    "SELECTORS",
    "OracleSelector",
    "StreamingSelector",
    "H2OSelector",
    "QuestSelector",
    "HShareSelector",
    "DirectReuseSelector",
    "RandomExpansionSelector",
    "DoubleSparsitySelector",
    "CertKVSelector",
    "EarlySelectSelector",
]

#: ``baseline.name`` -> factory ``(resolved config, number of query heads) -> selector``.
SELECTORS: dict[str, Callable[[ResolvedConfig, int], Selector]] = {
    "oracle": lambda r, h: OracleSelector(),
    "streaming": lambda r, h: StreamingSelector(),
    "h2o": lambda r, h: H2OSelector(),
    "quest": lambda r, h: QuestSelector(r.config.baseline.page_size),
    "hshare": lambda r, h: HShareSelector(
        r.num_layers, h, query_share=r.config.baseline.share_ratio, head_share=r.config.baseline.head_share_ratio,
        layer_share=r.config.baseline.layer_share_ratio),
    "direct_reuse": lambda r, h: DirectReuseSelector(r.config.cis.block_size),
    "random_expansion": lambda r, h: RandomExpansionSelector(r.config.cis.block_size, r.config.baseline.seed),
    "double_sparsity": DoubleSparsitySelector.from_config,
    "certkv": lambda r, h: CertKVSelector(r.config.baseline.window, r.config.baseline.pool_kernel,
                                          r.config.baseline.tail_slot),
}


def make_selector(resolved: ResolvedConfig, num_heads: int,
                  ops_for: Callable[[torch.device], DecodeOps] | None = None,
                  last_query_slot: Callable[[], int | None] | None = None,
                  decodes_sparse: Callable[[], bool] | None = None) -> Selector | None:
    """The decode selector of a config: the baseline that ``baseline.name`` names (see
    :data:`SELECTORS`), else CIS when ``cis.enabled``, else ``None`` (decode stays dense, or the
    PSAW window). With an ``early_select`` section the selector (CIS or Quest) is wrapped in an
    :class:`EarlySelectSelector` (its taps are attached by :func:`prhs_hf.patch`). The decode ops
    table of a step is an argument of ``select`` (the runtime's, picked per device); ``ops_for``
    (the runtime's :meth:`~prhs_hf.runtime.PrHSRuntime.ops_for`) gives CIS the same table for its
    prompt's key index write (None: the PyTorch references); ``last_query_slot`` (the runtime's
    :meth:`~prhs_hf.runtime.PrHSRuntime.last_query_slot`) gives CIS the slot of an eager decode
    step's new key for its key index (None: read off the geometry where needed); ``decodes_sparse``
    (the runtime's :meth:`~prhs_hf.runtime.PrHSRuntime.decodes_sparse`) tells CIS at a prefill whether
    to make its anchor buffers then (None: always); the baselines take none of them."""
    c = resolved.config
    selector = _base_selector(resolved, num_heads, ops_for, last_query_slot, decodes_sparse)
    es = c.early_select
    if selector is None or not es.enabled:
        return selector
    return EarlySelectSelector(selector, es.tap, es.rank, fidelity=c.telemetry.enabled and c.telemetry.oracle,
                               side_stream=es.side_stream)


def cis_set_size(resolved: ResolvedConfig) -> int:
    """Entries of a CIS anchor's dilated set under ``resolved``'s budget (its ``budget.topk``: use
    :meth:`~prhs_hf.config.ResolvedConfig.at_topk` for a context-relative budget's k)."""
    c = resolved.config
    kept = c.budget.topk - (1 if c.cis.tail_slot else 0)  # the tail slot is charged to the top-k
    return dilated_set_size(kept, resolved.dilation_topm, c.cis.dilation_radius)


def _base_selector(resolved: ResolvedConfig, num_heads: int,
                   ops_for: Callable[[torch.device], DecodeOps] | None,
                   last_query_slot: Callable[[], int | None] | None,
                   decodes_sparse: Callable[[], bool] | None) -> Selector | None:
    c = resolved.config
    name = c.baseline.name
    if name is None:
        if not c.cis.enabled:
            return None
        return CISSelector(resolved.num_layers, c.cis.block_size, cis_set_size(resolved), grouped=c.cis.selection != "head",
                           group_score="mean" if c.cis.selection == "group_mean" else "max",
                           keep_anchor_local=c.cis.keep_anchor_local, tail_slot=c.cis.tail_slot,
                           index=c.cis.index, rerank_margin=c.cis.rerank_margin, index_page=c.cis.index_page,
                           ops_for=ops_for, last_query_slot=last_query_slot, decodes_sparse=decodes_sparse)
    try:
        factory = SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown baseline selector {name!r}; known: {', '.join(SELECTORS)}") from None
    return factory(resolved, num_heads)
