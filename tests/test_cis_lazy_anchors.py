"""CIS's anchor buffers (``anchor_q``, ``anchor_idx``: ``[L, B, Hq, block, set]``, 1.79 GB at B4/64k on
the llama3-8b shape with cis_longbench) exist only once a decode step will run sparse: a prefill makes
them where the policy decides that the steps after it run sparse (the decision compiled steps keep),
an eager generation at its first sparse step. A generation that the policy runs dense holds only the
anchor counts, the step counter and the key index; one that turns sparse mid-way decodes as if the
anchors had been there, empty, from its prefill."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import prhs_hf
from prhs_hf.config import load_config
from prhs_hf.policy import CostModel
from test_generate import EVERY, SPARSE, _eos_mid
from test_stop_check_rollback import _assert_same, _assert_turns_equal, _selector_state, _turns
from tiny_models import padded_batch, tiny_model

GREEDY = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
PROMPT = [50, 41]  # left padded to 50 slots: decode step i attends to a context of 50 + i


def _cost_model(tmp_path, first_sparse: int, eager_overhead_us: float = 0.0, compiled_overhead_us: float = 0.0,
                config: dict = SPARSE, rows: int = 4, kv_heads: int = 2) -> str:
    """A ``policy.cost_model`` JSON under which the decode steps of a model of ``rows`` query heads
    and ``kv_heads`` KV heads patched with ``config`` run sparse from a context of ``first_sparse``
    tokens on, apart from the overheads (the tiny llama's 4 and 2 by default).

    Every other cost of the model zero (no retrieval, no per-key or top-k time), dense reads ``B · kv_heads · L · 2 · D · itemsize`` bytes
    and the sparse step ``B · rows · n · 2 · D · itemsize`` (``n`` the index set): sparse wins where
    ``rows · n < margin · kv_heads · L``; the margin puts that threshold half a token below
    ``first_sparse``."""
    index_set = load_config(config).resolve(2).index_capacity
    margin = rows * index_set / (kv_heads * (first_sparse - 0.5))
    path = tmp_path / f"cost_{first_sparse}_{eager_overhead_us}_{compiled_overhead_us}.json"
    fields = dict.fromkeys((f.name for f in dataclasses.fields(CostModel)), 0.0)
    fields.update(bandwidth_gbs=1.0, eager_overhead_us=eager_overhead_us, compiled_overhead_us=compiled_overhead_us,
                  margin=margin, min_sparse_prefill=1 << 30)
    path.write_text(json.dumps(fields))
    return str(path)


def _auto(tmp_path, first_sparse: int, **overheads) -> dict:
    return {**SPARSE, "policy": {"decode": "auto", "cost_model": _cost_model(tmp_path, first_sparse, **overheads)}}


def _tensor_bytes(state) -> int:
    """Bytes of every tensor a :class:`~prhs_hf.selectors.cis_state.CISState` holds."""
    return sum(v.numel() * v.element_size() for v in vars(state).values() if isinstance(v, torch.Tensor))


def _anchors_made(model, cache=None) -> bool:
    """Whether the anchor buffers exist: in the generation bound now, or in ``cache``'s."""
    runtime = model._prhs_runtime
    states = (runtime.hold(cache) if cache is not None else runtime.selector).states.values()
    made = {st.anchor_q is not None and st.anchor_idx is not None for st in states}
    assert len(made) == 1, "some devices' states have anchors, others not"
    return made.pop()


def _assert_no_anchor_buffer(model, cache, layers: int, batch: int, heads: int) -> None:
    """The state of ``cache``'s generation holds its anchor counts (int32 per layer, sequence and head)
    and its step counter (one int64), nothing else."""
    (state,) = model._prhs_runtime.hold(cache).states.values()
    assert state.anchor_q is None and state.anchor_idx is None and state.tail_k is None
    assert _tensor_bytes(state) == layers * batch * heads * 4 + 8


@pytest.mark.parametrize("policy", ["dense", "auto"])
def test_a_generation_the_policy_decodes_dense_makes_no_anchor_buffer(policy, tmp_path):
    config = {**SPARSE, "policy": {"decode": policy, "cost_model": _cost_model(tmp_path, first_sparse=1 << 20)}}
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(PROMPT)
    prhs_hf.patch(model, config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    _assert_no_anchor_buffer(model, out.past_key_values, layers=2, batch=2, heads=4)


@pytest.mark.parametrize(("cache", "compiled_overhead_us", "made"), [
    ("static", 0.0, True),  # the compiled steps that follow run sparse: they find the buffers in place
    ("static", 1e9, False),  # they run dense
    ("dynamic", 0.0, False),  # eager steps decide for themselves (here: dense, the eager overhead)
])
def test_a_prefill_makes_the_anchors_where_the_steps_after_it_run_sparse(cache, compiled_overhead_us, made, tmp_path):
    """A prefill into a ``StaticCache`` decides for the compiled steps that follow it (their overhead)."""
    config = _auto(tmp_path, first_sparse=40, eager_overhead_us=1e9, compiled_overhead_us=compiled_overhead_us)
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(PROMPT)
    prhs_hf.patch(model, config)
    with torch.no_grad():  # one forward: the prefill alone
        out = model.generate(ids, attention_mask=mask, max_new_tokens=1, cache_implementation=cache,
                             disable_compile=True, **GREEDY)
    assert model._prhs_runtime.context.sparse_decode is made
    if made:
        (state,) = model._prhs_runtime.hold(out.past_key_values).states.values()
        assert state.anchor_q.shape == (2, 2, 4, 4, 16) and state.anchor_idx.shape[:4] == (2, 2, 4, 4)
    else:
        _assert_no_anchor_buffer(model, out.past_key_values, layers=2, batch=2, heads=4)


def _track(model) -> tuple[list, object]:
    """After each forward: ``(the policy's decision, anchors made, the anchor counts and step)``."""
    runtime = model._prhs_runtime
    seen = []

    def record(*_):
        (state,) = runtime.selector.states.values()
        seen.append((runtime.context.sparse_decode, _anchors_made(model), state.anchor_count.clone(), int(state.step)))

    return seen, model.register_forward_hook(record)


def test_a_generation_that_turns_sparse_mid_way_makes_the_anchors_at_its_first_sparse_step(tmp_path):
    """Contexts 51-54 dense, 55 on sparse: the anchors appear at that step, empty, and the step is the
    block's first (every active row retrieves and takes anchor slot 0). Tokens, logits and the state
    after the generation (step, counts, valid anchors) equal, bit for bit, a generation whose prefill
    made the anchors, as before they were made lazily: the dense steps never touch them."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(PROMPT)
    prhs_hf.patch(model, _auto(tmp_path, first_sparse=55))
    runs = {}
    for when in ("first sparse step", "prefill"):
        selector = model._prhs_runtime.selector
        if when == "prefill":  # as before: the prefill makes the anchors whatever the policy decides
            selector.decodes_sparse = lambda: True
        seen, hook = _track(model)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY)
        hook.remove()
        runs[when] = (out, seen, _selector_state(model, out.past_key_values))

    out, seen, state = runs["first sparse step"]
    decisions = [s[0] for s in seen]
    assert decisions == [False] * 5 + [True] * 7  # the prefill and contexts 51-54, then 55-61
    assert [s[1] for s in seen] == decisions, "the anchors must appear at the first sparse step, not before"
    assert [s[1] for s in runs["prefill"][1]] == [True] * 12
    first_sparse = seen[5]
    assert first_sparse[3] == 1 and bool((first_sparse[2] == 1).all()), "the first sparse step opens a block"
    assert [s[3] for s in seen] == [0] * 5 + list(range(1, 8))  # the step counts the selector's steps only
    reference, _, reference_state = runs["prefill"]
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, reference.logits, strict=True))
    _assert_same(state, reference_state, "the selector state after the generation")


def test_a_stop_check_that_undoes_the_first_sparse_steps_equals_the_check_at_every_step(tmp_path):
    """Turn 1 ends on EOS by its third token (contexts 51-52 dense); the periodic check runs steps past
    it, sparse from context 54, which make the anchors, and undoes them. Its state after the turn (no
    valid anchor, step 0) and turn 2 (sparse from the same context on) equal the check at every step's,
    whose turn 1 never made the anchors."""
    config = _auto(tmp_path, first_sparse=54)
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(PROMPT)
    prhs_hf.patch(model, {**config, "generation": {"stop_check_every": 1}})
    eos = _eos_mid(model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                               pad_token_id=0), 0)
    turns = [dict(max_new_tokens=40, eos_token_id=eos), dict(max_new_tokens=6)]
    runs, made = {}, {}
    for every in (1, EVERY):
        runs[every] = _turns(model, config, every, ids, mask, turns[:1])
        made[every] = _anchors_made(model, runs[every][0][0].past_key_values)
        runs[every] += _turns_from(model, runs[every][0][0], ids, mask, turns[1])
    prhs_hf.unpatch(model)
    assert runs[1][0][0].sequences.shape[1] <= ids.shape[1] + 3
    assert not made[1] and made[EVERY], "the periodic check ran no sparse step past the end"
    _assert_turns_equal(runs[1], runs[EVERY], "crossover")


def _turns_from(model, first, ids, mask, kw: dict) -> list[tuple]:
    """One more turn on ``first``'s sequences and cache, with the patch in place."""
    mask_now = torch.cat([mask, mask.new_ones(mask.shape[0], first.sequences.shape[1] - ids.shape[1])], 1)
    with torch.no_grad():
        out = model.generate(input_ids=first.sequences, attention_mask=mask_now, past_key_values=first.past_key_values,
                             **GREEDY, **kw)
    return [(out, None, _selector_state(model, out.past_key_values))]


@pytest.mark.gpu
def test_graphed_steps_that_turn_sparse_mid_way_equal_the_anchors_made_at_the_prefill(tmp_path):
    """CUDA graphs of the sparse step (``eager_step: graphs``): the anchors are made before the first
    sparse step's graph key is taken and its capture, and the tokens and logits equal, bit for bit,
    those of a generation whose prefill made them."""
    from test_eager_step import GPU_SPARSE, _cuda_model, graphs_after_each_forward

    model, ids, mask = _cuda_model()  # 2 sequences of 300 slots, 8 query and 4 KV heads
    config = {**GPU_SPARSE, "backend": {**GPU_SPARSE["backend"], "eager_step": "graphs"}}
    config["policy"] = {"decode": "auto", "prefill": "sparse",
                        "cost_model": _cost_model(tmp_path, 303, config=config, rows=8, kv_heads=4)}
    runs = {}
    with prhs_hf.patch(model, config) as handle:
        for when in ("first sparse step", "prefill"):
            if when == "prefill":
                handle.runtime.selector.decodes_sparse = lambda: True
            seen, hook = _track(model)
            with torch.no_grad(), graphs_after_each_forward(model, handle.runtime) as captured:
                runs[when] = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
            hook.remove()
            assert captured[-1], when
            assert [s[0] for s in seen] == [False] * 3 + [True] * 5  # the prefill, contexts 301-302, then 303-307
            assert [s[1] for s in seen] == ([s[0] for s in seen] if when != "prefill" else [True] * 8)
    lazy, reference = runs["first sparse step"], runs["prefill"]
    assert torch.equal(lazy.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(lazy.logits, reference.logits, strict=True))
