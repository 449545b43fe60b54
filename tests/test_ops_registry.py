"""prhs_hf/ops: one registration per decode op makes both backend tables, and the top-k retrieval's
benchmark switches are a tuning hook, not arguments of the launchers."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from prhs_hf.ops import registry
from prhs_hf.ops.decode_ops import REFERENCE_OPS, TRITON_OPS, DecodeOps
from prhs_hf.ops.registry import DECODE_OPS
from prhs_hf.ops.topk import topk_retrieval as tk


def test_the_tables_have_one_field_per_registered_op_and_take_it_from_the_registration() -> None:
    fields = [f.name for f in dataclasses.fields(DecodeOps)]
    assert fields == ["name", *DECODE_OPS]
    assert {"cis_match", "topk_retrieval", "compose_indices", "sparse_decode_attention"} <= set(DECODE_OPS)
    for name, op in DECODE_OPS.items():
        assert getattr(REFERENCE_OPS, name) is op.reference, name
        assert getattr(TRITON_OPS, name).__wrapped__ is op.launcher, name
        assert op.doc and name in DecodeOps.__doc__


def test_every_registered_op_is_a_prhs_custom_op_with_its_references_arguments() -> None:
    for name, op in DECODE_OPS.items():
        assert hasattr(torch.ops.prhs, name), name
        launcher = list(inspect.signature(op.launcher).parameters)
        reference = list(inspect.signature(op.reference).parameters)
        # the attention launchers add num_splits (the split count of their persistent grid) last
        assert launcher[: len(reference)] == reference and set(launcher[len(reference):]) <= {"num_splits"}, name


def test_a_decode_op_registers_once_and_an_unregistered_launcher_is_named(monkeypatch) -> None:
    monkeypatch.setattr(registry, "DECODE_OPS", dict(DECODE_OPS))

    def cis_match(q):
        return q

    with pytest.raises(ValueError, match="'cis_match' is registered twice"):
        registry.register_decode_op(cis_match, cis_match, cis_match, "a second cis_match")

    def new_op(q):
        return q

    with pytest.raises(KeyError, match="'new_op' is not a registered decode op's launcher"):
        registry.compiled_or_eager(new_op)
    registry.register_decode_op(new_op, new_op, new_op, "an op")
    assert registry.compiled_or_eager(new_op)(3) == 3


def test_the_retrieval_launchers_take_no_benchmark_switches() -> None:
    for launcher, reference in ((tk.topk_retrieval, tk.topk_retrieval_reference),
                                (tk.topk_retrieval_grouped, tk.topk_retrieval_grouped_reference)):
        assert inspect.signature(launcher).parameters.keys() == inspect.signature(reference).parameters.keys()
    assert not [p for p in inspect.signature(tk._retrieve).parameters if p.startswith("_")]


def test_retrieval_tuning_applies_inside_its_block_only_and_checks_its_switches() -> None:
    assert tk._tuning == tk.RetrievalTuning()
    with tk.retrieval_tuning(select="radix8", stop_after="score") as tuning:
        assert tk._tuning is tuning and (tuning.select, tuning.stop_after) == ("radix8", "score")
        with tk.retrieval_tuning(merge_rank="count"):  # nested: over the switches in force
            assert (tk._tuning.select, tk._tuning.merge_rank) == ("radix8", "count")
        assert tk._tuning.merge_rank is None
    assert tk._tuning == tk.RetrievalTuning()
    with pytest.raises(RuntimeError), tk.retrieval_tuning(select="tilemax"):
        raise RuntimeError("restored all the same")
    assert tk._tuning == tk.RetrievalTuning()
    with pytest.raises(ValueError, match=r"select='row': expected one of \('tilemax', 'radix8', 'auto'\)"):
        tk.tuned(tk.topk_retrieval, select="row")
    with pytest.raises(ValueError, match="stop_after='blocksort'"):
        with tk.retrieval_tuning(stop_after="blocksort"):
            pass
    with pytest.raises(TypeError, match="_select"):
        tk.tuned(tk.topk_retrieval, _select="radix8")
    assert tk._tuning == tk.RetrievalTuning()
