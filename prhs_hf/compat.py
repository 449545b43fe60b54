"""What prhs-hf does differently by transformers version: each piece names the versions it serves.

prhs-hf supports transformers 5.17 to 5.25 (``pyproject.toml``; the tests pass on each minor). The
places where the patch reaches into transformers, and why, are listed in
``docs/notes/runtime_design.md`` ("Where the patch reaches into transformers"). What differs between
those versions lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import transformers

#: the name under which the installed transformers takes a KV cache (``model(...)``, ``generate(...)``):
#: ``past_key_values`` up to 5.23, ``cache`` from 5.24 on (the old name still works there, with a
#: FutureWarning, until 5.40)
CACHE_ARGUMENT_NAME = (
    "cache" if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values")

__all__ = ["CACHE_ARGUMENT_NAME", "assistant_generate_kwargs", "cache_argument"]


def assistant_generate_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a ``generate()`` call of an assistant model (transformers' assisted
    decoding, ``generation_config.is_assistant``), with an all-ones ``attention_mask`` where it has
    none; any other call's are returned as they are.

    Serves transformers 5.18 and later: there ``generate()`` drops an attention mask that is all ones
    (no padding) before it builds the candidate generator, which then calls the assistant's
    ``generate()`` without a mask. That call infers one from ``pad_token_id``, so a token the main
    model generated that happens to have the pad token's id becomes padding after the real tokens:
    transformers would mask the newest token out of its own attention, and PrHS's layout check
    refuses the batch ("padding inside or after their tokens"). The dropped mask was all ones, so
    all ones is the assistant's. transformers 5.17 hands the assistant the main model's mask itself,
    so there the assistant's calls always carry one and this changes nothing.
    """
    config = kwargs.get("generation_config")
    ids = kwargs.get("input_ids")
    if (not getattr(config, "is_assistant", False) or kwargs.get("attention_mask") is not None
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2):
        return kwargs
    return {**kwargs, "attention_mask": torch.ones_like(ids)}


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The KV cache that a decoder layer's keyword arguments, or ``generate()``'s ``model_kwargs``,
    carry (``None`` where there is none).

    Its name is ``past_key_values`` in transformers 5.17 to 5.23 and ``cache`` from 5.24 on: 5.24
    renamed it in every model's and layer's ``forward``, in ``generate()``'s ``model_kwargs`` and in
    the output classes (``output.past_key_values`` stays as a deprecated property, and a caller's
    ``past_key_values=`` argument is renamed to ``cache`` with a warning, until 5.40).
    """
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")
