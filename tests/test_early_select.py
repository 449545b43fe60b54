"""EarlySelectKV (issue 15 item 2): proxy queries from an earlier tap, against naive references."""

from __future__ import annotations

import argparse

import pytest
import torch

import prhs_hf
from prhs_hf.config import ConfigError, load_config
from prhs_hf.selectors import CISSelector, EarlySelectSelector, QuestSelector, make_selector
from prhs_hf.selectors.early_select import QueryProjection
from prhs_hf.ops.compose.dilated_set import dilated_set_size
from test_selectors import B, HQ, SCALE, _compose, _data, _frame, _geom, _got, _params, _row_keys, _topk_middle
from tiny_models import tiny_model

BUDGET = {"sink": 4, "local": 8, "topk": 16}
LAYERS = 3


# ----------------------------------------------------------------------------- naive references


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _naive_proxy(decoder_layer, hidden, cos, sin, weight=None):
    """Layer ``decoder_layer``'s query of ``hidden [B, H]`` in float64: norm, W_q (+ bias), q-norm, RoPE (llama style)."""
    attn = decoder_layer.self_attn
    x = decoder_layer.input_layernorm(hidden).double()
    w = attn.q_proj.weight.double() if weight is None else weight
    q = x @ w.T
    if attn.q_proj.bias is not None:
        q = q + attn.q_proj.bias.double()
    q = q.view(hidden.shape[0], -1, attn.head_dim)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q.float()).double()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]  # [B, 1, D]
    return q * c + _rotate_half(q) * s


def _quest_middle(q, keys, t, p, page):
    """Quest's chosen middle tokens for one row: whole pages by min/max bound, the last cut at top-k."""
    _, lo, hi = _frame(t, p)
    bound = {}
    for first in range(0, t, page):
        members = [j for j in range(first, first + page) if lo <= j < hi]
        if members:
            kmin, kmax = keys[members].min(0).values, keys[members].max(0).values
            bound[first // page] = float(torch.maximum(q * kmin, q * kmax).sum()) * SCALE
    chosen = []
    for i in sorted(bound, key=lambda i: (-bound[i], i)):
        chosen += [j for j in range(i * page, (i + 1) * page) if lo <= j < hi]
    return chosen[: p.topk]


def _proxies(qs, seed=1):
    """Per-step proxy queries of every layer: the real ones plus noise (a proxy is close, not equal)."""
    g = torch.Generator().manual_seed(seed)
    return [q + 0.8 * torch.randn(q.shape, generator=g) for q in qs]


def _drive(selector, p, steps=4, with_proxy=True):
    """Decode steps of LAYERS layers; the proxies are set as the taps would set them. Yields (layer, sel, t, q, proxy, k)."""
    ks, vs, qs = _data(steps, LAYERS)
    ps = _proxies(qs)
    for step in range(steps):
        slots = 30 + step
        geom = _geom(slots)
        for layer in range(LAYERS):
            if with_proxy and layer + 1 < LAYERS:
                selector.proxies[layer + 1] = ps[step][layer + 1]
            sel = selector.select(layer, qs[step][layer], ks[layer][:, :, :slots], vs[layer][:, :, :slots], geom, p, SCALE)
            yield layer, sel, geom.t_last.tolist(), qs[step][layer], ps[step][layer], ks[layer][:, :, :slots]


# ----------------------------------------------------------------------------- selectors on synthetic data


def test_es_quest_is_quest_of_the_proxy_query():
    p, page = _params(topk=7), 4
    es = EarlySelectSelector(QuestSelector(page))
    differs = False
    for layer, sel, ts, q, proxy, k in _drive(es, p):
        used = q if layer == 0 else proxy  # layer 0 has no earlier tap: its real query
        for b in range(B):
            for h in range(HQ):
                t = ts[b]
                keys = _row_keys(k, b, h, t).double()
                expected = _compose(t, p, _quest_middle(used[b, h].double(), keys, t, p, page))
                assert _got(sel, b, h) == expected
                if layer > 0:
                    differs |= expected != _compose(t, p, _quest_middle(q[b, h].double(), keys, t, p, page))
    assert differs  # the proxies are not the real queries: the test could fail


def test_es_cis_matches_and_retrieves_with_the_proxy():
    """ES-CIS is CIS fed the proxies (anchors included), layer 0 the real query."""
    p = _params(topk=5)
    size = dilated_set_size(p.topk, p.dilation_topm, p.dilation_radius)
    make = lambda: CISSelector(LAYERS, 4, size)  # noqa: E731
    es, plain, real = EarlySelectSelector(make()), make(), make()
    for cis in (es.base, plain, real):
        cis.setup(B, HQ, 8, torch.device("cpu"))
    differs = False
    for layer, sel, ts, q, proxy, k in _drive(es, p, steps=6):
        used = q if layer == 0 else proxy
        ref = plain.select(layer, used, k, k, _geom(k.shape[2]), p, SCALE)
        other = real.select(layer, q, k, k, _geom(k.shape[2]), p, SCALE)
        assert torch.equal(sel.idx, ref.idx) and torch.equal(sel.count, ref.count)
        assert torch.equal(sel.retrieved, ref.retrieved)
        differs |= not torch.equal(sel.idx, other.idx)
    assert torch.equal(es.base.state.anchor_q, plain.state.anchor_q)  # the anchors hold proxies
    assert differs


def test_missing_proxy_is_an_error():
    es = EarlySelectSelector(QuestSelector(4))
    with pytest.raises(RuntimeError, match="no proxy query for layer 1"):
        list(_drive(es, _params(), steps=1, with_proxy=False))


def test_fidelity_is_the_topk_overlap_and_retained_mass_under_the_real_query():
    p = _params(topk=5)
    es = EarlySelectSelector(QuestSelector(4), fidelity=True)
    naive = {}
    for layer, _, ts, q, proxy, k in _drive(es, p):
        if layer == 0:
            continue
        for b in range(B):
            t = ts[b]
            if not _frame(t, p)[0]:
                continue  # inactive sequences select nothing
            for h in range(HQ):
                keys = _row_keys(k, b, h, t).double()
                real_set = _topk_middle(q[b, h], keys, t, p)
                proxy_set = _topk_middle(proxy[b, h], keys, t, p)
                probs = torch.softmax(keys @ q[b, h].double() * SCALE, dim=0)
                mass = [float(probs[_compose(t, p, s)].sum()) for s in (proxy_set, real_set)]
                acc = naive.setdefault(layer, [0, 0.0, 0.0, 0.0])
                for i, v in enumerate((1, len(set(real_set) & set(proxy_set)) / len(real_set), *mass)):
                    acc[i] += v
    got = {f["layer"]: f for f in es.fidelity()}
    assert sorted(got) == sorted(naive) == [1, 2]
    for layer, (rows, overlap, mp, mr) in naive.items():
        f = got[layer]
        assert f["rows"] == rows
        assert f["topk_overlap"] == pytest.approx(overlap / rows)
        assert f["mass_proxy"] == pytest.approx(mp / rows, rel=1e-5)
        assert f["mass_real"] == pytest.approx(mr / rows, rel=1e-5)
        assert f["retained"] == pytest.approx(mp / mr, rel=1e-5)
        assert 0 < f["topk_overlap"] < 1 and f["retained"] < 1  # the proxies are noisy
    es.reset()
    assert es.fidelity() == []


# ----------------------------------------------------------------------------- the proxy in a model


class _Capture:
    """Wraps a selector to keep each decode call's (layer, query it was given)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select(self, layer, q, *args):
        self.calls.append((layer, q.clone()))
        return self.inner.select(layer, q, *args)


def _config(tap="mid", rank=None, selector=None, **extra):
    cfg = {"budget": BUDGET, "psaw": {"enabled": False}, "etf": {"enabled": False},
           "early_select": {"tap": tap, "rank": rank}, **(selector or {"baseline": {"name": "quest", "page_size": 4}})}
    return {**cfg, **extra}


def _prompt(seed=4):
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0  # left padding
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tap", ["early", "mid"])
def test_proxy_is_the_next_layers_query_path_of_the_tap(family, tap):
    """At every decode step, layer l+1 selects with ``naive(tap of layer l)``, and ``naive(input of layer l+1)``
    is layer l+1's real query (which checks the naive reference itself)."""
    model = tiny_model(family)
    layers = model.model.layers
    prhs_hf.patch(model, _config(tap))
    es = model._prhs_runtime.selector
    outer, inner = _Capture(es), _Capture(es.base)
    es.base, model._prhs_runtime.selector = inner, outer
    taps, handles = [], []
    try:
        for i, layer in enumerate(layers):
            def pre(module, args, kwargs, i=i):
                if args[0].shape[1] == 1:
                    taps.append({"layer": i, "input": args[0][:, 0].clone(), "rope": kwargs["position_embeddings"]})
            def post(module, args, out, i=i):
                if out[0].shape[1] == 1:
                    taps[-1]["attn"] = out[0][:, 0].clone()
            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(post))
        with torch.no_grad():
            model.generate(*_prompt()[:1], attention_mask=_prompt()[1], max_new_tokens=4, do_sample=False)
    finally:
        for h in handles:
            h.remove()
        prhs_hf.unpatch(model)
    n = len(layers)
    assert len(taps) == len(outer.calls) == len(inner.calls) == 3 * n
    for rec, (layer, real_q), (layer_in, used_q) in zip(taps, outer.calls, inner.calls):
        assert rec["layer"] == layer == layer_in
        cos, sin = (x[:, 0] for x in rec["rope"])
        own = _naive_proxy(layers[layer], rec["input"], cos, sin)
        torch.testing.assert_close(own.float(), real_q, rtol=1e-4, atol=1e-4)  # the reference is the query path
        if layer == 0:
            assert torch.equal(used_q, real_q)
    for prev, nxt, (layer, used_q) in zip(taps, taps[1:], inner.calls[1:]):
        if layer == 0:
            continue
        hidden = prev["input"] if tap == "early" else prev["input"] + prev["attn"]
        cos, sin = (x[:, 0] for x in nxt["rope"])
        expected = _naive_proxy(layers[layer], hidden, cos, sin)
        torch.testing.assert_close(used_q, expected.float(), rtol=1e-4, atol=1e-4)


def test_low_rank_proxy_is_the_truncated_svd_of_w_q():
    model = tiny_model("qwen2")  # q_proj has a bias
    layer = model.model.layers[1]
    hidden = torch.randn(2, 1, 64)
    pos = torch.tensor([[40], [17]])
    cos, sin = model.model.rotary_emb(hidden, pos)
    with torch.no_grad():
        exact = QueryProjection(layer)(hidden, cos, sin)
        torch.testing.assert_close(exact.double(), _naive_proxy(layer, hidden[:, 0], cos[:, 0], sin[:, 0]),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(QueryProjection(layer, 64)(hidden, cos, sin), exact, rtol=1e-3, atol=1e-3)
        u, s, vh = torch.linalg.svd(layer.self_attn.q_proj.weight.double())
        w8 = (u[:, :8] * s[:8]) @ vh[:8]
        low = QueryProjection(layer, 8)(hidden, cos, sin)
        torch.testing.assert_close(low.double(), _naive_proxy(layer, hidden[:, 0], cos[:, 0], sin[:, 0], w8),
                                   rtol=1e-4, atol=1e-4)
    assert not torch.allclose(low, exact, atol=1e-2)
    with pytest.raises(ConfigError, match=r"early_select.rank: 65 is out of range for this model.*\[1, 64\]"):
        prhs_hf.patch(tiny_model("llama"), _config(rank=65))


class _Replay:
    """A selector that returns recorded selections in order (whatever query it is given)."""

    def __init__(self, sels):
        self.sels = list(sels)

    def observe_prefill(self, *args):
        pass

    def select(self, layer, q, *args):
        return self.sels.pop(0)

    def reorder(self, index):
        pass

    def reset(self):
        pass


def test_attention_uses_the_real_query():
    """Replaying ES-Quest's index sets under a plain patch (whose attention gets the real query) gives the
    same logits; and those sets are not Quest's own."""
    model = tiny_model("llama")
    ids, mask = _prompt()
    runs = {}
    for name, cfg in (("es", _config()), ("quest", {k: v for k, v in _config().items() if k != "early_select"})):
        prhs_hf.patch(model, cfg)
        rec = _Capture(model._prhs_runtime.selector)
        sels = []
        inner_select = rec.select
        rec.select = lambda *a: sels.append(inner_select(*a)) or sels[-1]
        model._prhs_runtime.selector = rec
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        prhs_hf.unpatch(model)
        runs[name] = (torch.stack(out.scores), sels)
    prhs_hf.patch(model, {k: v for k, v in _config().items() if k != "early_select"})
    model._prhs_runtime.selector = _Replay(runs["es"][1])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    prhs_hf.unpatch(model)
    torch.testing.assert_close(torch.stack(out.scores), runs["es"][0], rtol=0, atol=0)
    assert any(not torch.equal(a.idx, b.idx) for a, b in zip(runs["es"][1], runs["quest"][1]))


@pytest.mark.parametrize("selector", [{"baseline": {"name": "quest", "page_size": 4}}, {"cis": {"block_size": 4}}])
@pytest.mark.parametrize("tap, rank", [("mid", None), ("early", None), ("mid", 8)])
def test_generate_keeps_the_base_budget_and_telemetry(selector, tap, rank):
    model = tiny_model("llama")
    ids, mask = _prompt()
    with torch.no_grad():
        dense = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    cfg = _config(tap, rank, selector, telemetry={"enabled": True, "oracle": True})
    with prhs_hf.patch(model, cfg) as handle:
        es = model._prhs_runtime.selector
        assert isinstance(es, EarlySelectSelector) and es.tap == tap and es.rank == rank
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        fid = es.fidelity()
    report = handle.telemetry()
    budget = sum(BUDGET.values())
    if "baseline" in selector:  # Quest: a full middle selection, every row scored every step
        assert report.retrieval_ratio == pytest.approx(1.0) and report.processed_kv_per_step == pytest.approx(budget)
    else:
        assert 0 < report.retrieval_ratio <= 1 and report.processed_kv_per_step <= budget + 2 * 5 + 1e-9
    assert report.oracle.rows == 5 * 4 * 2 * HQ and -1e-6 <= report.oracle.beta_emp <= 1
    assert [f["layer"] for f in fid] == [1, 2, 3] and all(f["rows"] == 5 * 2 * HQ for f in fid)
    assert all(0 <= f["topk_overlap"] <= 1 and 0 < f["retained"] <= 1 + 1e-6 for f in fid)
    # unpatching removes every tap: no hook is left and the model is the dense one again
    assert not any(layer._forward_pre_hooks or layer.post_attention_layernorm._forward_pre_hooks
                   for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), dense)


# ----------------------------------------------------------------------------- config and tables


@pytest.mark.parametrize("data, match", [
    ({"cis": {}, "early_select": {"tap": "late"}}, r"early_select.tap: 'late' is not allowed; allowed: early, mid"),
    ({"cis": {}, "early_select": {"rank": 0}}, r"early_select.rank: 0 is out of range; allowed \[1, 65536\]"),
    ({"cis": {}, "early_select": {"rank": 8.5}}, r"early_select.rank: expected an int"),
    ({"cis": {}, "early_select": {"applies_to": "quest"}}, r"early_select.applies_to: unknown key"),
    ({"baseline": {"name": "h2o"}, "early_select": {}}, r"early_select: applies to CIS .* or baseline.name: quest; "
                                                        r"this config has baseline.name: h2o"),
    ({"early_select": {}}, r"early_select: applies to .*this config has no selector \(cis is off\)"),
])
def test_config_errors_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


def test_config_section_is_off_unless_present():
    assert not load_config({"cis": {}}).early_select.enabled
    es = load_config({"cis": {}, "early_select": {}}).early_select
    assert (es.enabled, es.tap, es.rank) == (True, "mid", None)
    assert not load_config({"early_select": {"enabled": False}}).early_select.enabled  # off: no selector needed
    r = load_config({"baseline": {"name": "quest"}, "early_select": {"tap": "early", "rank": 4}}).resolve(4)
    sel = make_selector(r, 4)
    assert isinstance(sel, EarlySelectSelector) and isinstance(sel.base, QuestSelector)
    assert (sel.tap, sel.rank, sel.measure_fidelity) == ("early", 4, False)
    assert load_config(load_config({"cis": {}, "early_select": {"rank": 4}}).to_dict()).early_select.rank == 4


def test_accuracy_table_has_es_rows_at_the_cis_budget():
    from prhs_hf.evaluation.accuracy import configs as ac

    cis = ac.load_named_config(ac.named_config("cis-s16"))
    expected = {"es-quest": ("quest", "mid", None), "es-quest-r256": ("quest", "mid", 256),
                "es-cis": (None, "mid", None), "es-cis-early": (None, "early", None), "es-cis-r256": (None, "mid", 256)}
    for name, (baseline, tap, rank) in expected.items():
        cfg = ac.load_named_config(ac.named_config(name))
        assert name in ac.DEFAULT_CONFIGS
        assert (cfg.baseline.name, cfg.early_select.enabled, cfg.early_select.tap, cfg.early_select.rank) == \
            (baseline, True, tap, rank)
        assert cfg.budget == cis.budget and cfg.cis == cis.cis


@pytest.mark.parametrize("quick", [True, False])
def test_selection_quality_has_es_rows_and_a_fidelity_table(quick):
    from test_selection_quality import _load_script

    script = _load_script()
    seen = []

    def run(variant):
        seen.append(variant)
        return {"rho_hat": 0.25, "processed_kv": sum(BUDGET.values()), "variant": variant.label}

    args = argparse.Namespace(quick=quick, seed=0, page_size=16, es_rank=32)
    script.run_schedule(run, dict(BUDGET), args, 4, HQ)
    es = [v for v in seen if "early_select" in v.config]
    expected = ["ES-Quest mid", "ES-CIS mid"] if quick else \
        ["ES-Quest mid", "ES-Quest early", "ES-Quest mid r=32", "ES-CIS mid", "ES-CIS early", "ES-CIS mid r=32"]
    assert [v.label for v in es] == expected
    for v in es:
        cfg = load_config(v.config)  # a valid config
        assert cfg.budget.topk == BUDGET["topk"] and cfg.telemetry.oracle
        assert (cfg.baseline.name, cfg.cis.enabled) == (("quest", False) if v.label.startswith("ES-Quest") else (None, True))
    seen.clear()
    script.run_early_select_schedule(run, dict(BUDGET), args)
    assert [v.label for v in seen] == ["Quest", "CIS-main", *expected, "Oracle top-k"]
    rows = [{"variant": "ES-CIS mid", "fidelity": [{"layer": 1, "topk_overlap": 0.5, "retained": 0.9},
                                                   {"layer": 2, "topk_overlap": 0.7, "retained": 0.95}]},
            {"variant": "Quest"}]
    table = "\n".join(script.fidelity_lines(rows))
    assert "| layer | ES-CIS mid |" in table and "| 1 | 0.500 / 0.9000 |" in table
    assert "| mean | 0.600 / 0.9250 |" in table
    assert script.fidelity_lines([{"variant": "Quest"}]) == []
