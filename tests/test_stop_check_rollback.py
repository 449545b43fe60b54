"""The periodic stop check (``generation.stop_check_every``) undoes the selector's steps too: after a
``generate()`` that ran steps past its end and undid them, the selector's per-generation state on the
returned cache is the one the check at every step leaves, so a continuation from that cache decodes
the same tokens and logits. A selector that cannot undo its steps makes the loop check every step."""

from __future__ import annotations

import copy

import pytest
import torch

import prhs_hf
from prhs_hf import patching
from prhs_hf.ops.compose.dilated_set import SET_NONE
from prhs_hf.runtime import CALL_STATE_ATTRIBUTE, PrHSRuntime, SelectorRollback
from prhs_hf.selectors import SELECTORS, StreamingSelector
from prhs_hf.selectors.base import StepMark
from prhs_hf.selectors.set_steps import LayerStates
from test_generate import EVERY, SPARSE, _counted, _eos_mid, _loop
from tiny_models import padded_batch, tiny_model

#: selectors whose state a decode step advances (SPARSE: CIS, blocks of 4, tau 0: rows retrieve and share)
STATEFUL = {
    "cis": SPARSE,
    # a margin of 2: the index decides the retrieval, so a stale entry would change the tokens
    "cis_fp8": {**SPARSE, "cis": {**SPARSE["cis"], "index": "fp8", "rerank_margin": 2}},
    "h2o": {**SPARSE, "baseline": {"name": "h2o"}},
}
GREEDY = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def _selector_state(model, cache) -> dict:
    """What of ``cache``'s generation's selector state a later step reads, copied: CIS's step, anchor
    counts, valid anchors (none: whether or not the anchor buffers were made) and current key index
    entries; a ``LayerStates`` selector's dicts (its tensors, step counters, host ints); nothing of
    the others."""
    selector = model._prhs_runtime.hold(cache)
    if hasattr(selector, "states"):
        out = {}
        for device, st in selector.states.items():
            valid = torch.arange(st.block_size) < st.anchor_count[..., None]  # [L, B, H, s]
            out[device] = {"step": int(st.step), "count": st.anchor_count.clone(), "index_end": st.index_end}
            if valid.any():
                out[device]["q"] = torch.where(valid[..., None], st.anchor_q, 0.0)
                out[device]["idx"] = torch.where(valid[..., None], st.anchor_idx, SET_NONE)
            if st.key_index_a is not None:
                out[device]["index"] = (st.key_index_a[:, :, :, :st.index_end].clone(),
                                        st.key_index_b[:, :, :, :st.index_end].clone())
        return out
    if isinstance(selector, LayerStates):
        return {name: copy.deepcopy(getattr(selector, name)) for name in LayerStates.CALL_STATE}
    return {}


def _assert_same(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _assert_same(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, f"{what}: {a} != {b}"


def _turns(model, config: dict, every: int, ids, mask, turns: list[dict], cache=None) -> list[tuple]:
    """Patch ``model`` with ``config`` and loop ``every``; generate the first turn from ``ids`` (into
    ``cache``, if given) and each next one from the last one's sequences and cache (its last token the
    only one not in the cache: decode steps from the start). Per turn: ``(output, forwards, selector
    state after it)``."""
    prhs_hf.patch(model, _loop(config, every))
    runs, sequences = [], ids
    for kw in turns:
        mask_now = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - ids.shape[1])], 1)
        out, forwards = _counted(model, input_ids=sequences, attention_mask=mask_now, past_key_values=cache,
                                 **GREEDY, **kw)
        assert CALL_STATE_ATTRIBUTE in out.past_key_values.__dict__
        runs.append((out, forwards, _selector_state(model, out.past_key_values)))
        sequences, cache = out.sequences, out.past_key_values
    return runs


def _assert_turns_equal(every_step: list[tuple], periodic: list[tuple], what: str) -> None:
    """Each turn: the same tokens and logits, and the same selector state after it."""
    for i, ((a, _, a_state), (b, _, b_state)) in enumerate(zip(every_step, periodic, strict=True)):
        assert torch.equal(a.sequences, b.sequences), f"{what}: turn {i + 1}'s tokens differ"
        assert len(a.logits) == len(b.logits), f"{what}: turn {i + 1}: {len(b.logits)} logits against {len(a.logits)}"
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"{what}: turn {i + 1}'s logits differ"
        _assert_same(b_state, a_state, f"{what}: the selector state after turn {i + 1}")


def _first_turn_eos(model, config: dict, ids, mask) -> list[int]:
    """EOS ids that end the first turn (40 tokens at most) by its third token, mid-window."""
    prhs_hf.patch(model, _loop(config, 1))
    return _eos_mid(model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                pad_token_id=0), 0)


def _continuation_runs(config: dict, new_tokens: int) -> dict:
    """Turn 1 ends on EOS by its third token (the loop of ``stop_check_every`` 8 runs steps past it and
    undoes them); turn 2 continues for ``new_tokens`` from its cache. ``{every: turns}``."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    eos = _first_turn_eos(model, config, ids, mask)
    turns = [dict(max_new_tokens=40, eos_token_id=eos), dict(max_new_tokens=new_tokens)]
    runs = {every: _turns(model, config, every, ids, mask, turns) for every in (1, EVERY)}
    prhs_hf.unpatch(model)
    (first, forwards, _), (periodic_first, periodic_forwards, _) = runs[1][0], runs[EVERY][0]
    assert first.sequences.shape[1] <= ids.shape[1] + 3
    assert forwards < periodic_forwards, "the periodic loop ran no step past the end: nothing was undone"
    return runs


@pytest.mark.parametrize("new_tokens", [1, 6])
@pytest.mark.parametrize("config", list(STATEFUL))
def test_a_continuation_on_the_returned_cache_equals_the_check_at_every_step(config, new_tokens):
    """Turn 1 leaves the selector state of the check at every step (CIS: its step, anchor counts,
    valid anchors and key index; H2O: its scores), and turn 2, decode steps on turn 1's cache with no
    prefill to start the selector over, gives the same tokens and logits, bit for bit."""
    runs = _continuation_runs(STATEFUL[config], new_tokens)
    _assert_turns_equal(runs[1], runs[EVERY], config)


@pytest.mark.parametrize("name", [n for n in SELECTORS if n != "h2o"])
def test_every_baseline_selector_undoes_its_steps(name):
    """The other baselines (their own state, step counters, random streams, label caches) the same way."""
    runs = _continuation_runs({**SPARSE, "baseline": {"name": name}}, 6)
    _assert_turns_equal(runs[1], runs[EVERY], name)


@pytest.mark.parametrize("config", ["cis", "cis_fp8"])
def test_a_continuation_that_stops_early_itself_is_undone_too(config):
    """Turn 2 starts with a decode step (the host does not know CIS's step count: it reads it at the
    first step) and ends on EOS mid-window itself; turn 3 continues one token from its cache."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    cfg = STATEFUL[config]
    eos = _first_turn_eos(model, cfg, ids, mask)
    first = _turns(model, cfg, 1, ids, mask, [dict(max_new_tokens=40, eos_token_id=eos)])[0][0]
    probe = dict(past_key_values=copy.deepcopy(first.past_key_values), max_new_tokens=30, do_sample=False, pad_token_id=0,
                 attention_mask=torch.cat([mask, mask.new_ones(2, first.sequences.shape[1] - ids.shape[1])], 1))
    eos2 = _eos_mid(model, {**probe, "input_ids": first.sequences}, 0)
    turns = [dict(max_new_tokens=40, eos_token_id=eos), dict(max_new_tokens=30, eos_token_id=eos2),
             dict(max_new_tokens=1)]
    runs = {every: _turns(model, cfg, every, ids, mask, turns) for every in (1, EVERY)}
    prhs_hf.unpatch(model)
    assert runs[1][1][0].sequences.shape[1] < first.sequences.shape[1] + 30, "EOS did not end turn 2 early"
    assert runs[1][1][1] < runs[EVERY][1][1], "turn 2 undid nothing"
    _assert_turns_equal(runs[1], runs[EVERY], config)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cis", "cis_fp8"])
def test_compiled_steps_on_a_static_cache_are_undone_too(config):
    """A ``StaticCache`` with transformers' compiled decode step (``aot_eager`` on the CPU): no eager
    forward tells the host that a step ran the selector; the policy's decision at the prefill, which
    the compiled steps keep, does. Both turns as with the check at every step."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = CompileConfig(fullgraph=False, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    cfg = STATEFUL[config]
    eos = _first_turn_eos(model, cfg, ids, mask)
    turns = [dict(max_new_tokens=40, eos_token_id=eos, compile_config=compile_config),
             dict(max_new_tokens=6, compile_config=compile_config)]
    graphs = counters["stats"]["unique_graphs"]
    runs = {every: _turns(model, cfg, every, ids, mask, turns,
                          StaticCache(config=model.config, max_cache_len=ids.shape[1] + 60)) for every in (1, EVERY)}
    prhs_hf.unpatch(model)
    assert counters["stats"]["unique_graphs"] > graphs, "no decode step was compiled"
    assert runs[1][0][1] < runs[EVERY][0][1], "turn 1 undid nothing"
    _assert_turns_equal(runs[1], runs[EVERY], f"{config}, compiled")


def test_steps_the_policy_runs_dense_are_undone_with_the_others(monkeypatch):
    """Every third decode step dense (the policy's choice; the selector does not see it, the key index
    catches up at the next sparse step): the host counts only the selector's steps, and the undo is exact."""
    decide = PrHSRuntime._decide

    def every_third_dense(self, cache, cached, q_len, hidden_states, step_config):
        sparse_prefill, _ = decide(self, cache, cached, q_len, hidden_states, step_config)
        return sparse_prefill, cached % 3 != 1

    monkeypatch.setattr(PrHSRuntime, "_decide", every_third_dense)
    for new_tokens in (1, 6):
        runs = _continuation_runs(STATEFUL["cis_fp8"], new_tokens)
        _assert_turns_equal(runs[1], runs[EVERY], f"cis_fp8, {new_tokens} new tokens")


def _read_points(monkeypatch, config: dict, new: int) -> list[int]:
    """The number of forwards before each read of the stop check of a greedy generate() without EOS."""
    reads, forwards = [], []
    read = patching.PeriodicStopCheck._read

    def counted(self):
        reads.append(len(forwards))
        return read(self)

    monkeypatch.setattr(patching.PeriodicStopCheck, "_read", counted)
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    prhs_hf.patch(model, _loop(config, EVERY))
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    handle.remove()
    prhs_hf.unpatch(model)
    assert len(forwards) == new
    return reads


@pytest.mark.parametrize("block, expected", [(4, [5, 9, 13, 16]), (8, [8, 16]), (16, [8, 16])])
def test_cis_reads_the_flags_where_a_window_would_hold_a_block_end_and_a_step_after_it(monkeypatch, block, expected):
    """The loop's first forward is the prefill, so a window of 8 holds CIS steps 8k..8k+7. Blocks of 4:
    steps 4 and 12 end blocks inside a window (read at once, after forward 5 and 13); 8 ends one at
    a window's first step (undoing after it never crosses it): the reads of blocks of 16. The last
    read is finish()'s, at max_new_tokens."""
    config = {**SPARSE, "cis": {**SPARSE["cis"], "block_size": block}}
    assert _read_points(monkeypatch, config, 16) == expected


def test_a_selector_that_cannot_undo_its_steps_makes_generate_check_every_step():
    """A selector without ``mark_step``/``undo_to``: the loop reads the flags at every step (no forward
    past the end), with the tokens of the check at every step."""

    class Forgetful(StreamingSelector):
        mark_step = None
        undo_to = None

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    config = {**SPARSE, "baseline": {"name": "streaming"}}
    eos = _first_turn_eos(model, config, ids, mask)
    outs = []
    for every in (1, EVERY):
        prhs_hf.patch(model, _loop(config, every))
        model._prhs_runtime.selector = Forgetful()
        outs.append(_counted(model, input_ids=ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos,
                             do_sample=False, pad_token_id=0))
    prhs_hf.unpatch(model)
    (a, a_forwards), (b, b_forwards) = outs
    assert torch.equal(a, b) and a.shape[1] <= ids.shape[1] + 3
    assert a_forwards == b_forwards


@pytest.mark.parametrize("sampling", [False, True])
def test_the_rng_state_is_copied_only_where_the_steps_draw(monkeypatch, sampling):
    """Greedy steps draw nothing: no RNG copy per step. Sampling copies it at every step (and puts back
    the one after the last real step: test_generate's stop check tests)."""
    copies = []
    rng_state = patching._rng_state
    monkeypatch.setattr(patching, "_rng_state", lambda device: copies.append(1) or rng_state(device))
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([50, 41])
    prhs_hf.patch(model, _loop(SPARSE, EVERY))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                       do_sample=sampling, top_k=20)
    prhs_hf.unpatch(model)
    assert len(copies) == (6 if sampling else 0)


def test_a_wrong_host_count_of_the_selector_steps_raises():
    """The read checks the host's count against the selector's step counters: an undo across a block
    end followed by another step (which would not be exact) raises instead of returning another state."""
    rollback = SelectorRollback.__new__(SelectorRollback)
    rollback.period, rollback.marks, rollback.stop = 4, [StepMark(None)] * 5, None
    rollback.read([1, 2, 3, 3, 4], 1)  # undoes 3, a dense step and 4 (a block end) as the last: exact
    rollback.marks = [StepMark(None)] * 5
    with pytest.raises(RuntimeError, match="across the end of a block of 4"):
        rollback.read([2, 3, 4, 5, 6], 1)
