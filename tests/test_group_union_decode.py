"""``backend.sparse_attention: group_union`` in a model: the per-query-head index sets of a decode step
are read once per KV group (``sparse_decode_attention_union``) and give per-head attention's tokens.

Tiny random fp32 models, CIS forced sparse (``policy.decode`` left at its ``sparse`` default), the
Triton decode ops through the interpreter (``TRITON_INTERPRET=1``); the ops table of the patched model
is wrapped to count which sparse attention each step calls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import prhs_hf
from prhs_hf.ops.decode_ops import REFERENCE_OPS, TRITON_OPS
from prhs_hf.ops.sparse_attention.group_union import MAX_GROUP
from prhs_hf.ops.sparse_attention.sparse_decode_attention import sparse_decode_attention_union_reference
from prhs_hf.ops.triton_support import HAS_TRITON, interpreting
from tiny_models import SMALL_CIS, padded_batch, tiny_model

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1")

#: the sparse attentions of the ops table, by what they read
ATTENTIONS = {"per_head": "sparse_decode_attention", "group_union": "sparse_decode_attention_union",
              "grouped": "sparse_decode_attention_grouped"}


def _counting_ops(table, calls: dict):
    """``table`` with each sparse attention counting its calls into ``calls[kind]``."""

    def counted(kind, fn):
        def call(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return call

    return dataclasses.replace(table, **{name: counted(kind, getattr(table, name)) for kind, name in ATTENTIONS.items()})


def _generate(model, config: dict, sparse_attention: str, ops=TRITON_OPS, new_tokens: int = 8):
    """Greedy generate() of a left-padded batch under ``config`` with ``backend.sparse_attention``:
    ``(tokens, logits [steps, B, vocab], calls per attention kind, report)``."""
    ids, mask = padded_batch([70, 45])
    backend = "triton" if ops is TRITON_OPS else "torch"
    prhs_hf.patch(model, config, overrides={
        "backend": {"decode": backend, "prefill": "torch", "sparse_attention": sparse_attention}})
    calls = dict.fromkeys(ATTENTIONS, 0)
    model._prhs_runtime._ops[torch.device("cpu")] = _counting_ops(ops, calls)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 output_logits=True, return_dict_in_generate=True)
        report = prhs_hf.telemetry(model)
    finally:
        prhs_hf.unpatch(model)
    return out.sequences, torch.stack(out.logits), calls, report


@needs_interpreter
def test_group_union_generates_the_per_head_tokens():
    """Every sparse step of a GQA model (G = 3) reads its per-head sets through the union op, and the
    tokens and logits are per-head attention's (the union op's output is the per-head op's, to fp32
    rounding)."""
    model = tiny_model("llama", layers=2, heads=6, kv_heads=2, hidden_size=96)
    tokens, logits, calls, report = _generate(model, SMALL_CIS, "per_head")
    assert calls["per_head"] > 0 and calls["group_union"] == calls["grouped"] == 0
    union_tokens, union_logits, union_calls, union_report = _generate(model, SMALL_CIS, "group_union")
    assert union_calls["group_union"] == calls["per_head"] and union_calls["per_head"] == union_calls["grouped"] == 0
    assert torch.equal(union_tokens, tokens)
    torch.testing.assert_close(union_logits, logits, atol=1e-4, rtol=1e-4)
    assert report.sparse_sequence_steps > 0
    assert (union_report.retrieval_ratio, union_report.processed_kv_per_step) == (
        report.retrieval_ratio, report.processed_kv_per_step)


@needs_interpreter
def test_group_union_leaves_group_shared_sets_and_mha_to_their_ops():
    """Sets already one per KV head (cis.selection: group) stay on the grouped op, and a model with one
    query head per KV head (G = 1: nothing to share) stays on the per-head op."""
    gqa = tiny_model("llama", layers=2)
    group = {**SMALL_CIS, "cis": {**SMALL_CIS["cis"], "selection": "group"}}
    assert _generate(gqa, group, "group_union", new_tokens=4)[2] == _generate(gqa, group, "per_head", new_tokens=4)[2]
    mha = tiny_model("llama", layers=2, heads=4, kv_heads=4)
    calls = _generate(mha, SMALL_CIS, "group_union", new_tokens=4)[2]
    assert calls["per_head"] > 0 and calls["group_union"] == calls["grouped"] == 0


def test_the_reference_ops_read_the_union_as_per_head_sets():
    """On the PyTorch backend the union entry is the per-head reference (the same output by its
    definition), and a model decodes through it."""
    assert REFERENCE_OPS.sparse_decode_attention_union is sparse_decode_attention_union_reference
    model = tiny_model("llama", layers=2)
    tokens, _, calls, _ = _generate(model, SMALL_CIS, "per_head", ops=REFERENCE_OPS, new_tokens=4)
    union_tokens, _, union_calls, _ = _generate(model, SMALL_CIS, "group_union", ops=REFERENCE_OPS, new_tokens=4)
    assert union_calls["group_union"] == calls["per_head"] > 0 and torch.equal(union_tokens, tokens)


def test_group_union_refuses_a_model_with_more_than_32_query_heads_per_kv_head():
    model = tiny_model("llama", layers=1, heads=MAX_GROUP + 1, kv_heads=1, hidden_size=4 * (MAX_GROUP + 1))
    with pytest.raises(prhs_hf.ConfigError, match=r"^backend\.sparse_attention: group_union .* 33 query heads per KV "
                                                  r"head; allowed up to 32 .* per_head"):
        prhs_hf.patch(model, "cis", overrides={"backend": {"sparse_attention": "group_union"}})
    assert not prhs_hf.is_patched(model)
    prhs_hf.patch(model, "cis", overrides={"backend": {"sparse_attention": "per_head"}})
    prhs_hf.unpatch(model)
