"""CIS + tail (``cis.tail_slot``): CertKV's tail-summary slot on top of CIS."""

from __future__ import annotations

import pytest
import torch

import prhs_hf
from prhs_hf.config import ConfigError
from prhs_hf.decode import DecodeParams
from prhs_hf.geometry import SequenceGeometry
from prhs_hf.ops.compose.dilated_set import dilated_set_size
from prhs_hf.selectors import CISSelector, make_selector
from prhs_hf.selectors.set_steps import attend_with_tail, tail_summary
from conftest import triton_available
from tiny_models import SelectionRecorder, tiny_model

SCALE = 0.5
B, HQ, HKV, D = 2, 4, 2, 8
PADS = [0, 3]


def _cache(S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HKV, S, D, generator=g) * 2, torch.randn(B, HKV, S, D, generator=g),
            torch.randn(B, HQ, D, generator=g))


def _naive_tail(q, k, v, t, lo, end, members, scale):
    """(key, value, log_mass) per row in float64 by loops: rows are query heads or KV heads."""
    H = members.shape[1]
    g = HQ // HKV
    key = torch.zeros(B, H, D, dtype=torch.float64)
    value = torch.zeros_like(key)
    mass = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        pad, tb = PADS[b], int(t[b])
        for h in range(H):
            omitted = [j for j in range(int(lo[b]), int(end[b])) if j not in set(members[b, h].tolist())]
            heads = [h] if H == HQ else list(range(h * g, (h + 1) * g))
            kv = h // g if H == HQ else h
            kr, vr = k[b, kv, pad: pad + tb].double(), v[b, kv, pad: pad + tb].double()
            pi = torch.zeros(tb, dtype=torch.float64)
            logits = {}
            for qh in heads:
                logits[qh] = kr @ q[b, qh].double() * scale
                pi += torch.softmax(logits[qh], 0) / len(heads)
            if not omitted:
                continue
            w = pi[omitted] / pi[omitted].sum()
            key[b, h] = (w[:, None] * kr[omitted]).sum(0)
            value[b, h] = (w[:, None] * vr[omitted]).sum(0)
            mass[b, h] = sum(torch.logsumexp(logits[qh][omitted], 0) - key[b, h] @ q[b, qh].double() * scale
                             for qh in heads) / len(heads)
    return key, value, mass


@pytest.mark.parametrize("rows", [HQ, HKV])
def test_tail_summary_is_the_float64_tail_of_what_the_set_leaves_out(rows):
    S = 30
    k, v, q = _cache(S)
    pad = torch.tensor(PADS, dtype=torch.int32)
    t = S - pad
    lo = torch.tensor([2, 5], dtype=torch.int32)
    end = torch.tensor([22, 19], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    members = torch.randint(-1, 26, (B, rows, 7), generator=g, dtype=torch.int32)
    members[1, 0] = torch.arange(5, 12)  # covers part of the middle
    if rows == HQ:
        members[0, 1, :] = -1  # nothing kept: the whole middle is the tail
        members[0, 2] = torch.tensor([2, 3, 4, 5, 6, 7, 8])
    got = tail_summary(q, k, v, pad, t, lo, end, members, SCALE)
    want = _naive_tail(q, k, v, t, lo, end, members, SCALE)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_tail_summary_of_an_empty_tail_has_no_mass():
    k, v, q = _cache(20)
    pad = torch.tensor(PADS, dtype=torch.int32)
    members = torch.arange(2, 12, dtype=torch.int32).expand(B, HQ, 10).contiguous()
    lm = tail_summary(q, k, v, pad, 20 - pad, torch.full((B,), 2, dtype=torch.int32),
                      torch.full((B,), 12, dtype=torch.int32), members, SCALE)[2]
    assert torch.isneginf(lm).all()


# ----------------------------------------------------------------------------- the selector


def _params(tau, topk=6, topm=2, radius=1):
    return DecodeParams(sink=2, local=3, topk=topk, tau=tau, dilation_topm=topm, dilation_radius=radius,
                        capacity=2 + 3 + topk + 2 * radius * topm, window_fraction=None)


def _selector(p, block, tail=True, grouped=False):
    sel = CISSelector(1, block, dilated_set_size(p.topk - tail, p.dilation_topm, p.dilation_radius), grouped=grouped,
                      tail_slot=tail)
    heads, dim = (HKV, D * HQ // HKV) if grouped else (HQ, D)
    sel.setup(B, heads, dim, torch.device("cpu"))
    return sel


def _geom(S):
    pad = torch.tensor(PADS, dtype=torch.int32)
    t = S - pad
    return SequenceGeometry(pad, t, t - 1)


def test_a_retrieving_step_with_the_tail_is_full_attention():
    """One query per row that retrieves: top k-1 plus the exact tail pair is full softmax attention."""
    p = _params(tau=1.5)  # never share
    sel = _selector(p, 4)
    for S in (30, 31, 32):
        k, v, q = _cache(S, seed=S)
        geom = _geom(S)
        s = sel.select(0, q, k, v, geom, p, SCALE)
        assert s.retrieved.all() and s.tail is not None
        real = s.idx >= 0
        assert (real.sum(-1) == p.sink + p.topk - 1 + p.local).all()  # k - 1 real middle tokens
        assert (s.count == p.sink + p.topk + p.local).all()  # + the charged tail slot: CIS's budget
        out = attend_with_tail(q, k, v, geom.pad, s.idx, s.tail, SCALE)
        full = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None].double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
            attn_mask=(torch.arange(S)[None, :] >= geom.pad[:, None])[:, None, None], scale=SCALE)[:, :, 0]
        torch.testing.assert_close(out.double(), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
def test_sharers_reuse_the_anchor_summary_of_what_its_dilated_set_leaves_out(grouped):
    p = _params(tau=-1.0)  # always share the block's first anchor
    block = 4
    sel = _selector(p, block, grouped=grouped)
    k, v, _ = _cache(40, seed=3)
    anchor = None
    for step in range(6):
        S = 34 + step
        _, _, q = _cache(S, seed=10 + step)
        geom = _geom(S)
        s = sel.select(0, q, k[:, :, :S], v[:, :, :S], geom, p, SCALE)
        t, hi = geom.t_last, geom.t_last - p.local
        H = s.idx.shape[1]
        assert H == (HKV if grouped else HQ)
        if step % block == 0:
            assert s.retrieved.all()
            # what the sharers will reuse: the middle minus the anchor's dilated set, under its query
            state_set = sel.state.anchor_idx[0, :, :, 0]
            members = torch.where(state_set != 2147483647, state_set // 2, -1)
            anchor = tail_summary(q, k[:, :, :S], v[:, :, :S], geom.pad, t, torch.full_like(t, p.sink), hi, members,
                                  SCALE)
            omitted = [[set(range(p.sink, int(hi[b]))) - set(members[b, h].tolist()) for h in range(H)]
                       for b in range(B)]
            own_rows = s.idx
            for b in range(B):
                for h in range(H):
                    top = set(own_rows[b, h].tolist()) & set(range(p.sink, int(hi[b])))
                    assert len(top) == p.topk - 1  # the retrieving row attends to its undilated top k-1
        else:
            assert not s.retrieved.any()
            for a, b_ in zip(s.tail, anchor):
                torch.testing.assert_close(a, b_)
            for b in range(B):
                for h in range(H):
                    attended = set(x for x in s.idx[b, h].tolist() if x >= 0)
                    assert not attended & omitted[b][h]  # never both attended and in the tail
        assert torch.isfinite(s.tail[2]).all() and (s.count == (s.idx >= 0).sum(-1) + 1).all()


def test_tail_buffers_follow_beam_reordering():
    p = _params(tau=-1.0)  # the second step shares the first step's anchor
    sel = _selector(p, 4)
    k, v, q = _cache(34)
    sel.select(0, q, k, v, _geom(34), p, SCALE)
    stored = [x[:, :, 0].clone() for x in sel.states[torch.device("cpu")].anchor_tails(0)]
    sel.reorder(torch.tensor([1, 0]))
    k2, v2, q2 = _cache(35, seed=5)
    second = sel.select(0, q2, k2, v2, _geom(35), p, SCALE)
    assert not second.retrieved.any()
    for got, old in zip(second.tail, stored):
        torch.testing.assert_close(got, old.flip(0))


# ----------------------------------------------------------------------------- on a tiny model

BUDGET = {"sink": 2, "local": 4, "topk": 16}


def _generate(model, ids, config, steps, beams=1):
    if config is not None:
        prhs_hf.patch(model, config)
        model._prhs_runtime.selector = SelectionRecorder(model._prhs_runtime.selector)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             num_beams=beams, output_scores=True, return_dict_in_generate=True)
    if config is None:
        return out, None, None
    rec, report = model._prhs_runtime.selector, prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    return out, rec, report


def _cfg(tail, **cis):
    return {"budget": BUDGET, "cis": {"block_size": 4, **cis, "tail_slot": tail}, "psaw": {"enabled": False},
            "etf": {"enabled": False}, "telemetry": {"enabled": True, "oracle": True}}


@pytest.mark.parametrize("selection", ["head", "group"])
def test_the_budget_is_cis_own_and_telemetry_counts_the_slot(selection):
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    runs = {}
    for tail in (False, True):
        _, rec, report = _generate(model, ids, _cfg(tail, dilation_radius=0, selection=selection), 10)
        runs[tail] = report
        for sel in rec.selections:
            assert sel.active.all() and (sel.tail is not None) == tail
            # processed KV per row: sink + topk + local, the tail slot one of the topk
            assert (sel.count == sum(BUDGET.values())).all()
            real = (sel.idx >= 0).sum(-1)
            assert (real == sum(BUDGET.values()) - (1 if tail else 0)).all()
    assert runs[True].processed_kv_per_step == runs[False].processed_kv_per_step == sum(BUDGET.values())
    assert runs[True].sparse_sequence_steps == runs[False].sparse_sequence_steps > 0
    assert 0 < runs[True].retrieval_ratio <= 1
    assert 0 <= runs[True].oracle.beta_emp <= 1 and 0 < runs[True].oracle.overlap_top50 <= 1


def test_a_budget_covering_everything_is_dense():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    dense, _, _ = _generate(model, ids, None, 8)  # t <= 2 + 4 + 16 at every step
    sparse, rec, _ = _generate(model, ids, _cfg(True), 8)
    assert rec.selections and not any(bool(sel.active.any()) for sel in rec.selections)
    assert torch.equal(sparse.sequences, dense.sequences)
    for a, b in zip(sparse.scores, dense.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_retrieving_every_step_with_the_tail_is_dense_beyond_the_budget():
    """τ > 1 (a fresh top-(k-1) at every step, per query head): each step's attention with the tail
    is exact, so generation follows the dense model although every step attends to sink+k+local."""
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    dense, _, _ = _generate(model, ids, None, 8)
    sparse, rec, report = _generate(model, ids, _cfg(True, tau=1.5), 8)
    plain, _, _ = _generate(model, ids, _cfg(False, tau=1.5), 8)
    assert report.retrieval_ratio == 1.0 and all(bool(sel.active.all()) for sel in rec.selections)
    assert torch.equal(sparse.sequences, dense.sequences)
    err = max(float((a - b).abs().max()) for a, b in zip(sparse.scores, dense.scores))
    err_plain = max(float((a - b).abs().max()) for a, b in zip(plain.scores, dense.scores))
    assert err < 1e-3 < err_plain


@pytest.mark.parametrize("options", [{"keep_anchor_local": True}, {"selection": "group"}, {"psaw": True}])
def test_variants_run_within_the_budget_and_with_beams(options):
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 56), generator=torch.Generator().manual_seed(5))
    cis = {k: v for k, v in options.items() if k != "psaw"}
    cfg = _cfg(True, tau=0.5, **cis)
    if options.get("psaw"):
        cfg["psaw"] = {"enabled": True, "phases": ["decode"], "start_layer": 1, "phi": 0.5}
    out, rec, report = _generate(model, ids, cfg, 10)
    capacity = sum(BUDGET.values()) + 2 * (BUDGET["topk"] // 3) + (3 if options.get("keep_anchor_local") else 0)
    for sel in rec.selections:
        assert (sel.count <= (sel.idx >= 0).sum(-1) + 1).all() and (sel.count <= capacity).all()
        assert torch.isfinite(sel.tail[0]).all() and torch.isfinite(sel.tail[1]).all()
    assert all(torch.isfinite(s).all() for s in out.scores)
    assert 0 < report.retrieval_ratio < 1
    beams, _, _ = _generate(model, ids, cfg, 4, beams=2)
    assert beams.sequences.shape == (2, 60)


@pytest.mark.skipif(not triton_available(), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
def test_triton_decode_ops_give_the_reference_selection_and_tail():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(6))
    runs = {}
    for backend in ("torch", "triton"):
        cfg = {**_cfg(True, tau=0.6), "backend": {"decode": backend, "prefill": "torch"}}
        runs[backend] = _generate(model, ids, cfg, 6)
    (a, ra, ta), (b, rb, tb) = runs["torch"], runs["triton"]
    assert torch.equal(a.sequences, b.sequences)
    assert ta.processed_kv_per_step == tb.processed_kv_per_step and ta.retrieval_ratio == tb.retrieval_ratio
    for x, y in zip(ra.selections, rb.selections):
        assert torch.equal(x.idx, y.idx) and torch.equal(x.count, y.count)
        for u, w in zip(x.tail, y.tail):
            torch.testing.assert_close(u, w, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- config


def test_the_key_reaches_the_selector_and_is_validated():
    assert prhs_hf.load_config({"cis": {}}).cis.tail_slot is False
    sel = make_selector(prhs_hf.load_config({"cis": {"tail_slot": True}}).resolve(2), 4)
    assert isinstance(sel, CISSelector) and sel.tail_slot
    assert not make_selector(prhs_hf.load_config({"cis": {}}).resolve(2), 4).tail_slot
    with pytest.raises(ConfigError, match="cis.tail_slot"):
        prhs_hf.load_config({"cis": {"tail_slot": "yes"}})
    with pytest.raises(ConfigError, match="cis.tail_slot"):
        prhs_hf.load_config({"cis": {"tail_slot": True}, "baseline": {"name": "quest"}})
    with pytest.raises(ConfigError, match="budget.topk"):
        prhs_hf.load_config({"cis": {"tail_slot": True}, "budget": {"topk": 1}})
    prhs_hf.load_config({"cis": {"tail_slot": False}, "budget": {"topk": 1}})
