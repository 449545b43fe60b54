"""``cis_match`` as the custom op ``prhs::cis_match``, registered with its reference (``registry.py``)."""

from __future__ import annotations

import torch

from ..registry import int32_like, register_decode_op
from .cis_match import CISMatch, cis_match, cis_match_reference

Tensor = torch.Tensor


@torch.library.custom_op("prhs::cis_match", mutates_args=())
def cis_match_op(
    q: Tensor, anchor_q: Tensor, anchor_count: Tensor, active: Tensor, tau: float
) -> tuple[Tensor, Tensor]:
    return tuple(cis_match(q, anchor_q, anchor_count, active, tau))


@cis_match_op.register_fake
def _(q, anchor_q, anchor_count, active, tau):
    return int32_like(q.shape[0], q.shape[1], like=q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.bool)


def _cis_match_via_op(q, anchor_q, anchor_count, active, tau):
    return CISMatch(*cis_match_op(q, anchor_q, anchor_count, active, tau))


register_decode_op(cis_match, cis_match_reference, _cis_match_via_op,
                   "step 1: each row's most similar anchor above tau, or retrieve")
