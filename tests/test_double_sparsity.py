"""Double Sparsity: label channels, the label cache and the selection, against naive references."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import prhs_hf
from prhs_hf.calibration.ds_channels import calibrate_label_channels, save_label_channels
from prhs_hf.config import ConfigError
from prhs_hf.geometry import SequenceGeometry
from prhs_hf.selectors import DoubleSparsitySelector, OracleSelector, make_selector
from prhs_hf.selectors.double_sparsity import label_keys, load_label_channels
from test_selectors import (
    B, BUDGET, D, HKV, HQ, PADS, S0, SCALE, _compose, _data, _frame, _got, _params, _patched, _ranked, _row_keys,
    _swapped,
)
from test_compile import SMALL as COMPILE_SMALL
from test_compile import _generate as generate_static
from tiny_models import padded_batch, tiny_model

G = HQ // HKV
STEPS = 8  # local = 3: the keys appended at steps 0..4 reach the middle before the last step


def _channels(r, layers=1, seed=5):
    """Random calibrated channels ``[layers, HQ, r]`` (distinct per head, unsorted)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(HQ)]) for _ in range(layers)])


def _naive_middle(q, keys, t, p, channels):
    """Top-k of the middle by ``SCALE · Σ_{c ∈ channels} q[c] k[j, c]`` (fp64), one row."""
    _, lo, hi = _frame(t, p)
    cs = sorted(int(c) for c in channels)
    scores = keys.double()[:, cs] @ q.double()[cs] * SCALE
    return _ranked(scores, range(lo, hi))[: p.topk]


def _prefill(selector, ks, seed=9):
    """Prefill the cache slots ``[0, S0 - 1)`` of layer 0 with random queries; returns them ``[B, HQ, S0-1, D]``."""
    L = S0 - 1
    pad = torch.tensor(PADS, dtype=torch.int32)
    geom = SequenceGeometry(pad, L - pad, -pad)
    query = torch.randn(B, HQ, L, D, generator=torch.Generator().manual_seed(seed))
    selector.observe_prefill(0, query, ks[0][:, :, :L], geom, SCALE)
    return query


def _drive(selector, p, prefill=True):
    """Prefill (optional) then ``STEPS`` decode steps of layer 0; yields (selection, t per row, q, cache)."""
    ks, vs, qs = _data(STEPS)
    if prefill:
        _prefill(selector, ks)
    for step in range(STEPS):
        slots = S0 + step
        pad = torch.tensor(PADS, dtype=torch.int32)
        geom = SequenceGeometry(pad, slots - pad, slots - pad - 1)
        k = ks[0][:, :, :slots]
        yield selector.select(0, qs[step][0], k, vs[0][:, :, :slots], geom, p, SCALE), geom.t_last.tolist(), qs[step][0], k


def _check_against_naive(selector, p, channels_of, prefill=True):
    for sel, ts, q, k in _drive(selector, p, prefill):
        for b in range(B):
            for h in range(HQ):
                t = ts[b]
                expected = _compose(t, p, _naive_middle(q[b, h], _row_keys(k, b, h, t), t, p, channels_of(b, h)))
                assert _got(sel, b, h) == expected, (b, h, t)
        assert (sel.retrieved == sel.active[:, None]).all()  # every active row scores every step: ρ̂ = 1
    return k


@pytest.mark.parametrize("r", [1, 3, D])
@pytest.mark.parametrize("window", [None, 0.6])
def test_calibrated_selection_is_top_k_of_the_label_score(r, window):
    """Left padding (pads 0 and 21: one row turns active mid-run), GQA (2 query heads per KV head)."""
    p = _params(window, topk=6)
    channels = _channels(r)
    sel = DoubleSparsitySelector(r, channels, head_dim=D)
    k = _check_against_naive(sel, p, lambda b, h: channels[0, h])
    # the label cache (prefill + one appended key per step) is the label channels of the cache
    st = sel.state[0]
    assert torch.equal(st["label"][:, :, : k.shape[2]], label_keys(k, st["channels"]))


def test_calibrated_without_prefill_builds_the_label_cache_from_the_cache():
    channels = _channels(3)
    _check_against_naive(DoubleSparsitySelector(3, channels, D), _params(topk=6), lambda b, h: channels[0, h],
                         prefill=False)


def test_prompt_channels_when_uncalibrated():
    """No file: each sequence's channels are the top-r of mean |q[c] k[c]| over its own real prompt rows."""
    r = 3
    sel = DoubleSparsitySelector(r)
    assert not sel.calibrated
    ks, _, _ = _data(STEPS)
    query = _prefill(sel, ks)
    expected = {}
    for b in range(B):
        for h in range(HQ):
            rows = range(PADS[b], S0 - 1)  # the real prompt slots
            contrib = sum((query[b, h, i].double() * ks[0][b, h // G, i].double()).abs() for i in rows) / len(rows)
            expected[b, h] = sorted(torch.topk(contrib, r).indices.tolist())
            assert sel.state[0]["channels"][b, h].tolist() == expected[b, h]
    sel.reset()
    _check_against_naive(sel, _params(topk=6), lambda b, h: expected[b, h])


def test_full_rank_is_the_oracle():
    p = _params(topk=6)
    ds = list(_drive(DoubleSparsitySelector(D), p))
    oracle = list(_drive(OracleSelector(), p))
    for (a, _, _, _), (o, _, _, _) in zip(ds, oracle):
        assert torch.equal(a.idx, o.idx) and torch.equal(a.count, o.count) and torch.equal(a.retrieved, o.retrieved)


def test_uncalibrated_decode_without_prefill_is_an_error():
    with pytest.raises(RuntimeError, match="baseline.label_channels"):
        list(_drive(DoubleSparsitySelector(4), _params(), prefill=False))


def test_reorder_follows_beams():
    channels = _channels(3, layers=2)
    checked = 0
    for sa, sb, after in _swapped(lambda: DoubleSparsitySelector(3, channels, D), _params()):
        if after:
            assert torch.equal(sa.idx, sb.idx)
            checked += 1
    assert checked == 6


# ----------------------------------------------------------------------------- config and files


@pytest.mark.parametrize("baseline, key", [
    ({"label_rank": 0}, "baseline.label_rank"),
    ({"label_rank": 1025}, "baseline.label_rank"),
    ({"label_rank": "16"}, "baseline.label_rank"),
    ({"label_channels": 3}, "baseline.label_channels"),
    ({"label_channels": ""}, "baseline.label_channels"),
])
def test_config_keys_are_validated(baseline, key):
    with pytest.raises(ConfigError, match=key):
        prhs_hf.load_config({"baseline": {"name": "double_sparsity", **baseline}})


def test_config_file_round_trip_and_errors(tmp_path):
    channels = _channels(D, layers=3)
    path = save_label_channels(tmp_path / "ds.pt", channels, D)
    loaded, head_dim = load_label_channels(path)
    assert torch.equal(loaded, channels) and head_dim == D

    def make(layers=3, heads=HQ, **baseline):
        cfg = prhs_hf.load_config({"baseline": {"name": "double_sparsity", "label_channels": str(path), **baseline}})
        return make_selector(cfg.resolve(layers), heads)

    sel = make(label_rank=4)
    assert sel.calibrated and sel.rank == 4
    assert torch.equal(sel.channels, channels[..., :4].sort(-1).values)  # the 4 best, in channel order
    uncal = make_selector(prhs_hf.load_config({"baseline": {"name": "double_sparsity"}}).resolve(3), HQ)
    assert not uncal.calibrated and uncal.rank == 16
    with pytest.raises(ConfigError, match="baseline.label_channels.*3 layers x 4 heads"):
        make(layers=2)
    with pytest.raises(ConfigError, match="baseline.label_channels"):
        make(heads=8)
    with pytest.raises(ConfigError, match="baseline.label_rank"):
        make(label_rank=D + 1)
    with pytest.raises(ConfigError, match="baseline.label_channels.*does not exist"):
        load_label_channels(tmp_path / "missing.pt")
    (tmp_path / "bad.pt").write_text("not a tensor")
    with pytest.raises(ConfigError, match="baseline.label_channels"):
        load_label_channels(tmp_path / "bad.pt")
    torch.save({"channels": channels, "head_dim": D - 1}, tmp_path / "range.pt")
    with pytest.raises(ConfigError, match="baseline.label_channels"):
        load_label_channels(tmp_path / "range.pt")
    wrong_dim = DoubleSparsitySelector(2, channels[:1], head_dim=2 * D)  # checked when the model's D is seen
    with pytest.raises(ConfigError, match="head_dim"):
        list(_drive(wrong_dim, _params(), prefill=False))


def test_prompt_rank_above_head_dim_names_the_key():
    with pytest.raises(ConfigError, match="baseline.label_rank"):
        list(_drive(DoubleSparsitySelector(D + 1), _params()))


# ----------------------------------------------------------------------------- calibration


class _Tokenizer:
    """Whitespace-free toy tokenizer: one token id per character (ids 1..127)."""

    def __call__(self, text, return_tensors="pt", truncation=True, max_length=4096):
        ids = [1 + (ord(c) % 127) for c in text][:max_length]
        return {"input_ids": torch.tensor([ids], dtype=torch.long)}


def _naive_calibration(model, texts, r):
    """Top-r channels of mean |q[c] k[c]| from q/k recomputed from each attention module's input (fp64)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    sums = [torch.zeros(HQ, 16, dtype=torch.float64) for _ in layers]
    tokens = 0
    handles = []

    def make(i, attn):
        def pre(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            shape = (*h.shape[:-1], -1, 16)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(HQ // k.shape[1], dim=1)
            sums[i] += (q.double() * k.double()).abs()[0].sum(1)
        return pre

    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.register_forward_pre_hook(make(i, layer.self_attn), with_kwargs=True))
    try:
        with torch.no_grad():
            for text in texts:
                ids = _Tokenizer()(text)["input_ids"]
                model(input_ids=ids, use_cache=False)
                tokens += ids.shape[1]
    finally:
        for hd in handles:
            hd.remove()
    return torch.stack([torch.topk(s / tokens, r).indices for s in sums])


def test_calibrate_label_channels_matches_a_naive_recomputation(tmp_path):
    model = tiny_model("llama")
    texts = ["the quick brown fox jumps over the lazy dog " * 2, "0123456789 abcdefghij"]
    ids = _Tokenizer()(texts[0])["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    got = calibrate_label_channels(model, _Tokenizer(), texts, 5)
    assert got.shape == (4, HQ, 5) and got.dtype == torch.int64
    assert torch.equal(got, _naive_calibration(model, texts, 5))  # same channels, by descending contribution
    assert model.config._attn_implementation == "sdpa"  # the model is given back as it was
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    prhs_hf.patch(model, {"baseline": {"name": "oracle"}, "budget": BUDGET})
    with pytest.raises(ValueError, match="unpatch"):
        calibrate_label_channels(model, _Tokenizer(), texts, 5)
    prhs_hf.unpatch(model)
    with pytest.raises(ValueError, match="texts"):
        calibrate_label_channels(model, _Tokenizer(), [""], 5)


def test_the_selector_only_loads_label_channels():
    """The offline calibration lives in prhs_hf.calibration; the selector reads its file and imports
    none of it (a patched model runs without the calibration package)."""
    code = ("import sys, prhs_hf.selectors.double_sparsity as ds; "
            "print(sorted(m for m in sys.modules if m.startswith('prhs_hf.calibration')), "
            "[n for n in ('label_contributions', 'calibrate_label_channels', 'save_label_channels') if hasattr(ds, n)])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[]", "[]"]


# ----------------------------------------------------------------------------- in a model


def _generate(name, **extra):
    model, rec = _patched(name, **extra)
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0  # left padding
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    return out, rec, report


def test_generate_full_rank_equals_the_oracle():
    """Tiny llama: head_dim 16 = the default label_rank, so the label score is the exact score."""
    out, rec, report = _generate("double_sparsity")
    assert not rec.inner.calibrated and rec.inner.rank == 16
    out_o, rec_o, _ = _generate("oracle")
    assert torch.equal(out, out_o)
    assert len(rec.calls) == len(rec_o.calls) == 13 * 4
    for (_, a, *_), (_, o, *_) in zip(rec.calls, rec_o.calls):
        assert torch.equal(a.idx, o.idx) and torch.equal(a.count, o.count)
    assert report.retrieval_ratio == pytest.approx(1.0)


def test_generate_with_calibrated_low_rank_channels(tmp_path):
    model = tiny_model("llama")
    channels = calibrate_label_channels(model, _Tokenizer(), ["calibration text that is not the prompt " * 3], 16)
    path = save_label_channels(tmp_path / "tiny.pt", channels, 16)
    out, rec, report = _generate("double_sparsity", baseline={"name": "double_sparsity", "label_channels": str(path),
                                                              "label_rank": 4})
    assert rec.inner.calibrated and rec.inner.rank == 4
    assert out.shape == (2, 64) and len(rec.calls) == 13 * 4
    budget = sum(BUDGET.values())
    for _, sel, t, pad, slots, _ in rec.calls:
        valid = torch.arange(sel.idx.shape[-1]) < sel.count[..., None]
        assert (torch.where(valid, sel.idx, 0) < t[:, None, None]).all() and (pad[:, None, None] + sel.idx < slots).all()
        assert (sel.idx[..., 1:] > sel.idx[..., :-1])[valid[..., 1:]].all()
        assert sel.active.all() and (sel.count == budget).all()  # a full middle selection every step
    assert report.retrieval_ratio == pytest.approx(1.0)
    assert report.processed_kv_per_step == pytest.approx(budget)
    o = report.oracle
    assert o.rows == 13 * 4 * 2 * HQ and -1e-6 <= o.beta_emp <= 1 and 0 <= o.overlap_top50 <= 1


# ----------------------------------------------------------------------------- tables


def test_selection_quality_has_a_double_sparsity_row():
    import argparse

    from test_selection_quality import _load_script

    seen = []

    def run(variant):
        seen.append(variant)
        return {"rho_hat": 0.25, "processed_kv": sum(BUDGET.values()), "variant": variant.label}

    _load_script().run_schedule(run, dict(BUDGET), argparse.Namespace(quick=True, seed=0, page_size=16), 4, HQ)
    ds = [v for v in seen if v.config.get("baseline", {}).get("name") == "double_sparsity"]
    assert len(ds) == 1 and ds[0].config["budget"] == BUDGET and ds[0].family == "double_sparsity"
    prhs_hf.load_config(ds[0].config)  # a valid config


def test_accuracy_table_has_a_ds_row_at_the_cis_budget():
    from prhs_hf.evaluation.accuracy import configs as ac

    ds = ac.load_named_config(ac.named_config("ds"))
    assert ds.baseline.name == "double_sparsity" and ds.baseline.label_rank == 16 and ds.telemetry.enabled
    assert ds.budget == ac.load_named_config(ac.named_config("cis-s16")).budget


@pytest.mark.parametrize("kwargs", [{"cache_implementation": "static"}, {"num_beams": 3}])
def test_static_cache_and_beam_search_follow_the_oracle_at_full_rank(kwargs):
    """A StaticCache writes each new key at ``pad + t - 1`` of a fixed-size cache; beams reorder the label cache
    (13 steps > local = 8: generated keys reach the middle, where a stale label row would be scored)."""
    runs = {}
    for name in ("double_sparsity", "oracle"):
        model, rec = _patched(name)
        ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        ids[1, :4], mask[1, :4] = 0, 0
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, **kwargs)
        prhs_hf.unpatch(model)
        runs[name] = (out, rec.calls)
    (out, calls), (out_o, calls_o) = runs["double_sparsity"], runs["oracle"]
    assert torch.equal(out, out_o) and len(calls) == len(calls_o) == 13 * 4
    assert all(torch.equal(a[1].idx, o[1].idx) for a, o in zip(calls, calls_o))


# ----------------------------------------------------------------------------- under torch.compile

# DS alone (rank 4 < head_dim 16) at test_compile's small budget, the PyTorch decode path
DS_COMPILED = {**COMPILE_SMALL, "baseline": {"name": "double_sparsity", "label_rank": 4}, "psaw": {"enabled": False},
               "etf": {"enabled": False}, "backend": {"decode": "torch", "prefill": "torch"}}

def test_compiled_static_decode_is_one_graph_with_eager_tokens():
    """bench_e2e_decode's ``ds-s16`` path: generate() with a StaticCache compiles the decode step
    (here ``fullgraph=True`` on the CPU, as tests/test_compile.py does). The label cache is one
    static buffer written in place, so the step is one graph without a break or an extra output,
    a second prompt (its own label channels, chosen at its prefill) reuses it, and the tokens are
    the eager ones (rank 4 < head_dim: not the oracle's)."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([150, 110])
    prhs_hf.patch(model, "configs/cpe.yaml", overrides=DS_COMPILED)
    torch._dynamo.reset()
    counters.clear()
    compiled, r_compiled = generate_static(model, ids, mask, compiled=True)
    eager, r_eager = generate_static(model, ids, mask, compiled=False)
    again, _ = generate_static(model, ids[[1, 0]], mask[[1, 0]], compiled=True)  # another prompt, the same graph
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(compiled, eager)
    eager_swapped, _ = generate_static(model, ids[[1, 0]], mask[[1, 0]], compiled=False)
    assert torch.equal(again, eager_swapped)
    assert r_eager.sparse_sequence_steps > 0 and r_compiled.decode_steps == r_eager.decode_steps == 13
    assert r_compiled.processed_kv_per_step == r_eager.processed_kv_per_step


def test_compiled_decode_graph_returns_only_the_logits():
    """The label cache is written in place: the DS step adds no graph output to the dense step's
    (a rebound dict item or attribute would be one more output, and a Python replay, per layer)."""
    outputs = []

    def backend(gm, example_inputs):
        outputs.append(len(next(n for n in gm.graph.nodes if n.op == "output").args[0]))
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    ids, mask = padded_batch([90, 70])
    for patched in (False, True):
        model = tiny_model("llama", layers=2)
        if patched:
            prhs_hf.patch(model, "configs/cpe.yaml", overrides=DS_COMPILED)
        torch._dynamo.reset()
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
                       compile_config=config)
    assert len(outputs) == 2, outputs  # one decode graph each
    assert outputs[1] == outputs[0], f"dense decode graph has {outputs[0]} outputs, DS {outputs[1]}"
