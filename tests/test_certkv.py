"""CertKV (issue 15 item 1): SnapKV window scores, dispersion-allocated budgets, the tail slot."""

from __future__ import annotations

import pytest
import torch

import prhs_hf
from prhs_hf.config import ConfigError
from prhs_hf.decode import DecodeParams
from prhs_hf.geometry import SequenceGeometry
from prhs_hf.selectors import CertKVSelector, make_selector
from prhs_hf.selectors.set_steps import attend_with_tail
from prhs_hf.selectors.certkv import allocate_budget
from tiny_models import SelectionRecorder, tiny_model

SCALE = 0.5
B, HQ, HKV, D = 2, 4, 2, 8
PADS = [0, 5]
LQ = 40  # prefill slots; sequence 1 has 35 real prompt tokens


def _params(topk=6, sink=2, local=3):
    return DecodeParams(sink=sink, local=local, topk=topk, tau=0.8, dilation_topm=0, dilation_radius=0,
                        capacity=sink + local + topk, window_fraction=None)


# ----------------------------------------------------------------------------- allocation


@pytest.mark.parametrize("seed", range(6))
def test_budgets_sum_exactly_respect_floor_and_cap(seed):
    g = torch.Generator().manual_seed(seed)
    H = int(torch.randint(1, 9, (1,), generator=g))
    total = int(torch.randint(H, 40 * H, (1,), generator=g))
    disp = torch.rand(16, H, generator=g) ** 6  # skewed: the floor binds
    disp[0] = 0.0  # no dispersion at all: even
    disp[1, 0] = 1e6  # one head takes everything it may
    cap = torch.randint(1, 60, (16, H), generator=g)
    cap[2] = 1000  # no cap binds
    got = allocate_budget(disp, total, cap)
    floor = max(1, int(0.2 * total / H))
    assert (got.sum(-1) == torch.minimum(cap.sum(-1), torch.tensor(total))).all()
    assert (got >= torch.minimum(cap, torch.tensor(floor))).all() and (got <= cap).all()
    # row 2 (no cap): largest remainders of the proportional split of what the floors leave
    ideal = floor + (total - H * floor) * disp[2].double() / disp[2].double().sum()
    assert ((got[2] - ideal).abs() < 1).all()


def test_equal_dispersion_splits_evenly():
    disp = torch.full((3, 4), 0.7)
    cap = torch.full((3,), 100)
    assert allocate_budget(disp, 4 * 21, cap).tolist() == [[21] * 4] * 3
    # 86 = 4 * 21 + 2: the two spare slots go to the lower heads (deterministic repair)
    assert allocate_budget(disp, 86, cap)[0].tolist() == [22, 22, 21, 21]


def test_more_dispersion_gets_more_slots():
    got = allocate_budget(torch.tensor([[1.0, 2.0, 4.0, 8.0]]), 60, torch.tensor([100]))[0]
    assert got.tolist() == sorted(got.tolist()) and got[0] >= max(1, int(0.2 * 60 / 4))


# ----------------------------------------------------------------------------- a plan against naive SnapKV


def _data(seed=0, steps=1):
    g = torch.Generator().manual_seed(seed)
    S = LQ + steps
    k = torch.randn(B, HKV, S, D, generator=g) * 2
    v = torch.randn(B, HKV, S, D, generator=g)
    v[:, 1] *= 3  # head 1's values disperse more
    qp = torch.randn(B, HQ, LQ, D, generator=g) * 2
    qd = torch.randn(steps, B, HQ, D, generator=g)
    return k, v, qp, qd


def _prefill_geom():
    pad = torch.tensor(PADS, dtype=torch.int32)
    t = LQ - pad
    return SequenceGeometry(pad, t, t - LQ)


def _decode_geom(slots):
    pad = torch.tensor(PADS, dtype=torch.int32)
    t = slots - pad
    return SequenceGeometry(pad, t, t - 1)


def _naive_plan(k, v, qp, p, window, kernel, tail):
    """Per (b, KV head): (π, ranked candidates, hi0) by loops in float64, as SnapKV describes it."""
    out = {}
    for b in range(B):
        pad, t0 = PADS[b], LQ + 1 - PADS[b]
        P = t0 - 1
        hi0 = t0 - p.local
        rows = [r for r in range(P - window, P) if r >= 0]
        for h in range(HKV):
            kr = k[b, h, pad: pad + P].double()
            pi = torch.zeros(P, dtype=torch.float64)
            for qh in range(h * (HQ // HKV), (h + 1) * (HQ // HKV)):
                for r in rows:
                    s = kr[: r + 1] @ qp[b, qh, pad + r].double() * SCALE
                    pi[: r + 1] += torch.softmax(s, 0) / (HQ // HKV)
            pooled = torch.stack([pi[max(0, j - kernel // 2): j + kernel // 2 + 1].max() for j in range(P)])
            ranked = sorted(range(p.sink, hi0), key=lambda j: (-float(pooled[j]), j))
            out[b, h] = (pi, ranked, hi0, rows)
    return out


def _plan(window=8, kernel=3, tail=True, p=None, seed=0):
    p = p or _params()
    k, v, qp, qd = _data(seed)
    sel = CertKVSelector(window=window, pool_kernel=kernel, tail_slot=tail)
    sel.observe_prefill(0, qp, k[:, :, :LQ], _prefill_geom(), SCALE)
    s = sel.select(0, qd[0], k, v, _decode_geom(LQ + 1), p, SCALE)
    return sel, s, (k, v, qp, qd, p)


@pytest.mark.parametrize("tail", [True, False])
def test_kept_tokens_are_the_naive_snapkv_ranking_at_the_dispersion_budgets(tail):
    sel, s, (k, v, qp, _, p) = _plan(tail=tail)
    naive = _naive_plan(k, v, qp, p, 8, 3, tail)
    st = sel.state[0]
    total = HKV * (p.topk - (1 if tail else 0))
    disp = torch.zeros(B, HKV, dtype=torch.float64)
    for (b, h), (pi, ranked, hi0, _) in naive.items():
        even = min(len(ranked), total // HKV)
        tail_ix = ranked[even:]
        vr = v[b, h, PADS[b]:].double()
        w = pi[tail_ix]
        vstar = (w[:, None] * vr[tail_ix]).sum(0) / w.sum()
        disp[b, h] = (w * ((vr[tail_ix] - vstar) ** 2).sum(-1)).sum()
    budget = allocate_budget(disp, total, torch.tensor([len(naive[b, 0][1]) for b in range(B)]))
    assert st["budget"].tolist() == budget.tolist()
    assert budget.sum(-1).tolist() == [total] * B and budget[:, 1].gt(budget[:, 0]).all()  # head 1 disperses more
    assert s.idx.shape[1] == HKV and not s.retrieved.any()  # one set per KV head, ρ̂ = 0
    for (b, h), (_, ranked, hi0, _) in naive.items():
        got = [j for j in s.idx[b, h].tolist() if j >= 0]
        kept = sorted(ranked[: int(budget[b, h])])
        t = LQ + 1 - PADS[b]
        assert got == sorted(set(range(p.sink)) | set(kept) | set(range(hi0, t)))
        assert int(s.count[b, h]) == len(got) + (1 if tail else 0)  # the tail slot is charged


def test_tail_pair_is_the_window_weighted_tail():
    sel, s, (k, v, qp, qd, p) = _plan(tail=True)
    naive = _naive_plan(k, v, qp, p, 8, 3, True)
    tk, tv, lm = s.tail
    for (b, h), (pi, ranked, hi0, rows) in naive.items():
        omitted = ranked[int(sel.state[0]["budget"][b, h]):]
        kr, vr = k[b, h, PADS[b]:].double(), v[b, h, PADS[b]:].double()
        r = pi[omitted] / pi[omitted].sum()
        kstar = (r[:, None] * kr[omitted]).sum(0)
        torch.testing.assert_close(tk[b, h].double(), kstar, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(tv[b, h].double(), (r[:, None] * vr[omitted]).sum(0), rtol=1e-4, atol=1e-5)
        diffs = []
        for qh in range(h * (HQ // HKV), (h + 1) * (HQ // HKV)):
            for row in rows:
                qv = qp[b, qh, PADS[b] + row].double()
                seen = [j for j in omitted if j <= row]
                if seen:
                    diffs.append(torch.logsumexp(kr[seen] @ qv * SCALE, 0) - (kstar @ qv) * SCALE)
        assert float(lm[b, h]) == pytest.approx(float(sum(diffs) / len(diffs)), rel=1e-4, abs=1e-4)


def test_attention_with_the_tail_is_the_float64_softmax_over_kept_and_synthetic():
    sel, s, (k, v, _, qd, _) = _plan(tail=True)
    tk, tv, lm = s.tail
    lm = lm.clone()
    lm[1, 0] = float("-inf")  # no tail: the sparse attention alone
    out = attend_with_tail(qd[0], k, v, torch.tensor(PADS, dtype=torch.int32), s.idx, (tk, tv, lm), SCALE)
    for b in range(B):
        for qh in range(HQ):
            h = qh // (HQ // HKV)
            ix = [PADS[b] + j for j in s.idx[b, h].tolist() if j >= 0]
            keys = torch.cat([k[b, h, ix].double(), tk[b, h, None].double()])
            vals = torch.cat([v[b, h, ix].double(), tv[b, h, None].double()])
            logits = keys @ qd[0, b, qh].double() * SCALE
            logits[-1] += float(lm[b, h])
            ref = torch.softmax(logits, 0) @ vals
            torch.testing.assert_close(out[b, qh].double(), ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- on a tiny model


BUDGET = {"sink": 2, "local": 4, "topk": 16}


def _generate(model, ids, mask, config, steps):
    if config is not None:
        prhs_hf.patch(model, config)
        model._prhs_runtime.selector = SelectionRecorder(model._prhs_runtime.selector)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    rec = None
    if config is not None:
        rec = model._prhs_runtime.selector
        report = prhs_hf.telemetry(model)
        prhs_hf.unpatch(model)
        return out, rec, report
    return out, rec, None


@pytest.mark.parametrize("tail", [False, True])
def test_a_budget_covering_the_prompt_is_dense(tail):
    # prompts of 19 and 16 tokens: the compressible prompt [2, t0 - 4) holds <= 15 <= topk - 1 tokens
    # per KV head, so CertKV keeps it whole (its tail is empty) and keeps every generated token
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    dense, _, _ = _generate(model, ids, mask, None, 12)
    cfg = {"baseline": {"name": "certkv", "tail_slot": tail}, "budget": BUDGET, "telemetry": {"enabled": True}}
    sparse, rec, report = _generate(model, ids, mask, cfg, 12)
    assert report.sparse_sequence_steps > 0  # t = 20..30 crosses 2 + 4 + 16
    assert any(bool(sel.active.any()) for _, sel, _ in rec.calls)
    assert torch.equal(sparse.sequences, dense.sequences)
    for a, b in zip(sparse.scores, dense.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_generate_counts_gqa_left_padding_and_beams(monkeypatch):
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0
    cfg = {"baseline": {"name": "certkv", "window": 8}, "budget": BUDGET,
           "telemetry": {"enabled": True, "oracle": True}}
    calls = []
    monkeypatch.setattr(prhs_hf.layer, "attend_with_tail", lambda *a: calls.append(1) or attend_with_tail(*a))
    out, rec, report = _generate(model, ids, mask, cfg, 9)
    assert len(calls) == len(rec.calls) == 8 * 4  # the layer attends to the tail pair on every decode step
    assert out.sequences.shape == (2, 59)
    steps = {}
    for layer, sel, t in rec.calls:
        step = steps[layer] = steps.get(layer, -1) + 1
        assert sel.active.all() and sel.idx.shape[1] == 2  # [B, Hkv]: one set per KV head of the GQA model
        valid = sel.idx >= 0
        assert (torch.where(valid, sel.idx, 0) < t[:, None, None]).all()
        assert (sel.idx[..., 1:] > sel.idx[..., :-1])[valid[..., 1:]].all()  # sorted, unique
        # exact accounting: the layer's middle (kept tokens + tail slot) is Hkv * topk at every step,
        # plus the tokens aged out of the local window since the first step (never evicted)
        middle = sel.count - BUDGET["sink"] - BUDGET["local"] - step
        assert middle.sum(-1).tolist() == [2 * BUDGET["topk"]] * 2
        assert (sel.count == valid.sum(-1) + 1).all()  # the charged tail slot
    assert report.retrieval_ratio == 0.0
    expected = sum(BUDGET.values()) + sum(range(9 - 1)) / 8  # the mean over 8 decode steps of sink+local+topk+step
    assert report.processed_kv_per_step == pytest.approx(expected)
    assert 0 <= report.oracle.beta_emp <= 1
    # beam search reorders the plan with the cache
    prhs_hf.patch(model, {"baseline": {"name": "certkv"}, "budget": BUDGET})
    with torch.no_grad():
        beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False)
    prhs_hf.unpatch(model)
    assert beams.shape == (2, 54)


def test_config_keys_reach_the_selector_and_are_bounded():
    sel = make_selector(prhs_hf.load_config({"baseline": {"name": "certkv", "window": 16, "pool_kernel": 1,
                                                          "tail_slot": False}}).resolve(2), 4)
    assert isinstance(sel, CertKVSelector) and (sel.window, sel.pool_kernel, sel.tail_slot) == (16, 1, False)
    default = prhs_hf.load_config({"baseline": {"name": "certkv"}}).baseline
    assert (default.window, default.pool_kernel, default.tail_slot) == (32, 5, True)
    for bad, key in (({"window": 0}, "baseline.window"), ({"pool_kernel": 0}, "baseline.pool_kernel"),
                     ({"tail_slot": "yes"}, "baseline.tail_slot")):
        with pytest.raises(ConfigError, match=key):
            prhs_hf.load_config({"baseline": {"name": "certkv", **bad}})
    with pytest.raises(ConfigError, match="budget.topk"):
        prhs_hf.load_config({"baseline": {"name": "certkv"}, "budget": {"topk": 1}})
    prhs_hf.load_config({"baseline": {"name": "certkv", "tail_slot": False}, "budget": {"topk": 1}})
