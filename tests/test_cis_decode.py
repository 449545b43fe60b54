"""CIS decode (SPEC §4): exact top-k when never sharing, anchor reuse with dilation, ρ̂ accounting."""

from pathlib import Path

import pytest
import torch

import prhs_hf
from prhs_hf.decode import DecodeParams
from prhs_hf.geometry import SequenceGeometry
from prhs_hf.ops.compose.dilated_set import dilated_set_reference, dilated_set_size
from prhs_hf.ops.decode_ops import REFERENCE_OPS
from prhs_hf.selectors import CISSelector
from prhs_hf.telemetry_counters import Telemetry
from conftest import triton_available
from tiny_models import tiny_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = {"budget": {"sink": 4, "local": 8, "topk": 16}}


def cis_layer(p, B, H, D, block, **options):
    """A one-layer CIS selector on the PyTorch reference ops, set up for this shape."""
    selector = CISSelector(1, block, dilated_set_size(p.topk, p.dilation_topm, p.dilation_radius), **options)
    selector.setup(B, H, D, torch.device("cpu"))
    return selector


def cis_step(selector, q, k, v, geom, p, scale):
    """One CIS decode step of layer 0: ``(out, selection)``, as the patched layer runs it."""
    sel = selector.select(0, q, k, v, geom, p, scale)
    return REFERENCE_OPS.sparse_decode_attention(q, k, v, geom.pad, sel.idx, sel.count, scale), sel


def _attend(q, k, v, keys, scale):
    """Exact softmax attention of one query over the given key positions."""
    s = (k[keys].double() @ q.double()) * scale
    return torch.softmax(s, 0) @ v[keys].double()


def _expected_exact(q, k_cache, v_cache, pad, t, sink, local, topk, scale):
    """sink ∪ exact top-k of the middle ∪ local, computed per row without the library."""
    B, Hq, D = q.shape
    g = Hq // k_cache.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        tb, pb = int(t[b]), int(pad[b])
        for h in range(Hq):
            k = k_cache[b, h // g, pb : pb + tb]
            v = v_cache[b, h // g, pb : pb + tb]
            if tb <= sink + local + topk:
                keys = torch.arange(tb)
            else:
                middle = torch.arange(sink, tb - local)
                scores = (k[middle].double() @ q[b, h].double()) * scale
                chosen = middle[scores.topk(min(topk, middle.numel())).indices]
                keys = torch.cat([torch.arange(sink), chosen, torch.arange(tb - local, tb)]).unique()
            out[b, h] = _attend(q[b, h], k, v, keys, scale)
    return out


class RecordingOps:
    """REFERENCE_OPS that keep the inputs and output of every sparse attention call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(REFERENCE_OPS, name)

    def sparse_decode_attention(self, q, k, v, pad, idx, count, scale):
        out = REFERENCE_OPS.sparse_decode_attention(q, k, v, pad, idx, count, scale)
        self.calls.append((q.clone(), k.clone(), v.clone(), pad.clone(), scale, out.clone()))
        return out


def test_tau_above_one_is_exact_topk_attention_in_a_model():
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids = torch.randint(1, 128, (2, 60))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # left padding: different t per sequence
    prhs_hf.patch(model, {**SMALL, "cis": {"tau": 1.5, "block_size": 4}, "psaw": {"enabled": False}, "etf": {"enabled": False},
                          "backend": {"eager_step": "plain"}})  # the recorded K/V are the cache's tokens (t from their length)
    rec = RecordingOps()
    model._prhs_runtime._ops[torch.device("cpu")] = rec
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    prhs_hf.unpatch(model)
    assert len(rec.calls) == 5 * 4  # 5 decode forwards x 4 layers
    for q, k, v, pad, scale, out in rec.calls:
        t = k.shape[-2] - pad
        expected = _expected_exact(q, k, v, pad, t, 4, 8, 16, scale)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def _params(tau, block=4, topm=2, radius=1, window=None):
    return DecodeParams(sink=2, local=3, topk=5, tau=tau, dilation_topm=topm, dilation_radius=radius,
                        capacity=2 + 3 + 5 + 2 * radius * topm, window_fraction=window)


def test_identical_queries_share_the_anchor_with_dilation():
    torch.manual_seed(1)
    B, H, D, L0, steps = 1, 2, 8, 40, 6
    p = _params(tau=0.9)
    k_all = torch.randn(B, H, L0 + steps, D)
    v_all = torch.randn(B, H, L0 + steps, D)
    q = torch.randn(B, H, D)
    cis = cis_layer(p, B, H, D, 4)
    anchor_top = None
    for step in range(steps):
        t = L0 + step + 1
        geom = SequenceGeometry(torch.zeros(B, dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                                torch.tensor([t - 1], dtype=torch.int32))
        k, v = k_all[:, :, :t], v_all[:, :, :t]
        out, sel = cis_step(cis, q, k, v, geom, p, 0.5)
        middle = torch.arange(p.sink, t - p.local)
        for h in range(H):
            got = sel.idx[0, h, : sel.count[0, h]].tolist()
            if step % 4 == 0:  # block start: retrieve the exact top-k
                assert bool(sel.retrieved[0, h])
                scores = (k[0, h, middle] @ q[0, h]) * 0.5
                top = middle[scores.topk(p.topk).indices]
                if h == 0:
                    anchor_top = top
                expected = set(range(p.sink)) | set(top.tolist()) | set(range(t - p.local, t))
            else:  # same query: share anchor 0 of this head, dilate the best m by ±r, clip to M(t)
                assert not bool(sel.retrieved[0, h])
                scores = (k[0, h, torch.arange(p.sink, L0 + 4 * (step // 4) + 1 - p.local)] @ q[0, h]) * 0.5
                base = torch.arange(p.sink, L0 + 4 * (step // 4) + 1 - p.local)
                top = base[scores.topk(p.topk).indices].tolist()
                dil = {x + j for x in top[: p.dilation_topm] for j in (-1, 0, 1)}
                mid = {x for x in set(top) | dil if p.sink <= x < t - p.local}
                expected = set(range(p.sink)) | mid | set(range(t - p.local, t))
            assert got == sorted(expected)
            exp_out = _attend(q[0, h], k[0, h], v[0, h], torch.tensor(sorted(expected)), 0.5)
            torch.testing.assert_close(out[0, h].double(), exp_out, rtol=1e-5, atol=1e-5)
    assert anchor_top is not None


def test_dilation_is_clipped_to_the_middle_region():
    # an anchor index at the middle's edge: its neighbours outside [lo, hi) are dropped
    B, H, D = 1, 1, 4
    p = _params(tau=-1.0, topm=5, radius=2)
    cis = cis_layer(p, B, H, D, 4)
    state = cis.state
    state.anchor_count.fill_(1)
    state.step.fill_(1)  # not a block start
    state.anchor_q[0, 0, 0, 0] = torch.tensor([1.0, 0, 0, 0])
    topk = torch.tensor([[[2, 30, 16, -1, -1]]], dtype=torch.int32)
    state.anchor_idx[0, 0, 0, 0] = dilated_set_reference(topk, True, p.dilation_topm, p.dilation_radius)[0, 0]
    t = 36  # middle = [2, 33)
    geom = SequenceGeometry(torch.zeros(1, dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                            torch.tensor([t - 1], dtype=torch.int32))
    k = torch.randn(1, 1, t, D)
    _, sel = cis_step(cis, torch.tensor([[[1.0, 0, 0, 0]]]), k, k, geom, p, 1.0)
    got = sel.idx[0, 0, : sel.count[0, 0]].tolist()
    assert got == [0, 1, 2, 3, 4, 14, 15, 16, 17, 18, 28, 29, 30, 31, 32, 33, 34, 35]


@pytest.mark.parametrize("tail_slot", [False, True])
def test_the_selection_records_its_anchors_in_its_composition_launch(tail_slot):
    """A plain CIS step records its anchors in the composition's launch
    (``ops.dilate_compose_and_record``), no ``record_anchors`` launch of its own; with tail pairs
    (recorded with the anchor) the separate record stays. The anchors are recorded either way."""
    import dataclasses

    calls = []

    def counted(name):
        fn = getattr(REFERENCE_OPS, name)
        return lambda *a, **kw: (calls.append(name), fn(*a, **kw))[1]

    ops = dataclasses.replace(REFERENCE_OPS, **{n: counted(n) for n in ("record_anchors", "dilate_compose_and_record",
                                                                         "dilate_and_compose")})
    p = _params(tau=2.0)  # every step retrieves: one anchor more per step
    B, H, D, T = 2, 2, 8, 40
    cis = CISSelector(1, 4, dilated_set_size(p.topk - int(tail_slot), p.dilation_topm, p.dilation_radius),
                      tail_slot=tail_slot)
    cis.setup(B, H, D, torch.device("cpu"))
    torch.manual_seed(3)
    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    geom = SequenceGeometry(torch.zeros(B, dtype=torch.int32), torch.full((B,), T, dtype=torch.int32),
                            torch.full((B,), T - 1, dtype=torch.int32))
    for step in range(3):
        q = torch.randn(B, H, D)
        cis.select(0, q, k, v, geom, p, 0.5, ops)
        assert (cis.state.anchor_count == step + 1).all()
        torch.testing.assert_close(cis.state.anchor_q[0, :, :, step], q / q.norm(dim=-1, keepdim=True))
    assert calls == (["dilate_and_compose", "record_anchors"] if tail_slot else ["dilate_compose_and_record"]) * 3


@pytest.mark.parametrize("block", [1, 4])
def test_retrieval_ratio_counts_block_starts(block):
    # tau = -1 shares whenever the block has an anchor: only each block's first step retrieves
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 50))
    prhs_hf.patch(model, {**SMALL, "cis": {"tau": -1.0, "block_size": block}, "psaw": {"enabled": False},
                          "etf": {"enabled": False}, "telemetry": {"enabled": True}})
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    steps = 19  # decode forwards after the prefill
    blocks = -(-steps // block)
    assert report.decode_steps == steps and report.sparse_sequence_steps == 2 * steps
    assert report.retrieval_ratio == pytest.approx(blocks / steps)
    assert report.per_head_retrievals == [[2 * blocks] * 4] * 4
    # every head retrieves at the same steps, so every KV group with one retrieving head has all of them
    assert report.kv_group_retrieval_ratio == pytest.approx(report.retrieval_ratio)
    assert report.processed_kv_per_step < report.dense_kv_per_step


def test_kv_group_retrieval_ratio_counts_kv_heads_with_a_retrieving_query_head():
    # 2 layers, 3 sequences (the third ran no sparse step), 4 query heads in 2 KV groups of 2
    t, processed, active = torch.tensor([100, 100, 9]), torch.full((3, 4), 10), torch.tensor([True, True, False])
    retrieved = [torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]),
                 torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])]
    gqa, mha = Telemetry(2, 4, oracle=False, num_kv_heads=2), Telemetry(2, 4, oracle=False)
    for tel in (gqa, mha):
        for layer in range(2):
            tel.record_decode(layer, t, processed, retrieved[layer].bool(), active)
    # query heads: 3 + 4 of 16 sparse rows; KV groups: layer 0 one per sequence, layer 1 both of the
    # second sequence: 4 of 8 (pairs); without GQA every head is its own group
    assert gqa.report().retrieval_ratio == pytest.approx(7 / 16)
    assert gqa.report().kv_group_retrieval_ratio == pytest.approx(4 / 8)
    assert mha.report().kv_group_retrieval_ratio == pytest.approx(7 / 16)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        Telemetry(2, 4, oracle=False, num_kv_heads=3)


def test_oracle_telemetry_is_consistent():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 80))
    prhs_hf.patch(model, {**SMALL, "cis": {"tau": 1.5}, "psaw": {"enabled": False}, "etf": {"enabled": False},
                          "telemetry": {"enabled": True, "oracle": True}})
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    o = prhs_hf.telemetry(model).oracle
    prhs_hf.unpatch(model)
    assert o.rows == 4 * 4 * 4
    assert 0 < o.retained_mass <= 1 and o.dropped_mass == pytest.approx(1 - o.retained_mass)
    assert -1e-6 <= o.beta_emp <= 0.2  # exact top-k of the middle is close to the oracle
    assert 0 < o.overlap <= 1 and 0 < o.overlap_top50 <= 1
    assert o.certificate > 0


def test_keep_anchor_local_keeps_the_tokens_that_aged_into_the_middle_since_the_block_began():
    torch.manual_seed(2)
    B, H, D, L0, block = 1, 2, 8, 40, 4
    p = _params(tau=-1.0)  # always share the block's first anchor
    p = DecodeParams(**{**p.__dict__, "capacity": p.capacity + block - 1})
    plain, keep = cis_layer(p, B, H, D, block), cis_layer(p, B, H, D, block, keep_anchor_local=True)
    k_all, v_all = torch.randn(B, H, L0 + 8, D), torch.randn(B, H, L0 + 8, D)
    for step in range(8):
        t = L0 + step + 1
        geom = SequenceGeometry(torch.zeros(B, dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                                torch.tensor([t - 1], dtype=torch.int32))
        q = torch.randn(B, H, D)
        k, v = k_all[:, :, :t], v_all[:, :, :t]
        _, a = cis_step(plain, q, k, v, geom, p, 0.5)
        _, b = cis_step(keep, q, k, v, geom, p, 0.5)
        hi, aged = t - p.local, step % block
        for h in range(H):
            got_plain = set(a.idx[0, h, : a.count[0, h]].tolist())
            got_keep = set(b.idx[0, h, : b.count[0, h]].tolist())
            assert got_keep == got_plain | set(range(hi - aged, hi))  # a superset by exactly the aged tokens
            if aged == 0:
                assert got_keep == got_plain  # a block start retrieves over the whole middle


@pytest.mark.skipif(not triton_available(), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
def test_keep_anchor_local_in_a_model_reference_equals_triton_and_processes_more():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 70))
    runs = {}
    for keep, backend in ((False, "torch"), (True, "torch"), (True, "triton")):
        prhs_hf.patch(model, {**SMALL, "cis": {"tau": -1.0, "block_size": 8, "keep_anchor_local": keep},
                              "backend": {"decode": backend, "prefill": "torch"}, "telemetry": {"enabled": True}})
        assert model._prhs_runtime.resolved.index_capacity == 4 + 8 + 16 + 2 * 5 + (7 if keep else 0)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        runs[keep, backend] = (out, prhs_hf.telemetry(model).processed_kv_per_step)
        prhs_hf.unpatch(model)
    assert torch.equal(runs[True, "torch"][0], runs[True, "triton"][0])
    assert runs[True, "torch"][1] == pytest.approx(runs[True, "triton"][1])
    assert runs[True, "torch"][1] > runs[False, "torch"][1]


def test_a_model_split_across_devices_gets_one_state_per_device():
    """device_map: each device's layers keep their anchors on that device (here the CPU and 'meta')."""
    p = _params(tau=-1.0)
    cis = CISSelector(4, 4, dilated_set_size(p.topk, p.dilation_topm, p.dilation_radius))
    B, H, D = 1, 2, 8
    for layer, device in enumerate(["cpu", "cpu", "meta", "meta"]):
        cis.observe_prefill(layer, torch.zeros(B, H, 3, D, device=device), torch.zeros(B, H, 3, D, device=device), None, 1.0)
    assert {str(d): s.anchor_q.shape[0] for d, s in cis.states.items()} == {"cpu": 2, "meta": 2}
    assert cis._slot[3] == (torch.device("meta"), 1)
    t = 40
    geom = SequenceGeometry(torch.zeros(B, dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                            torch.tensor([t - 1], dtype=torch.int32))
    k = torch.randn(B, H, t, D)
    for layer in (0, 1):  # the CPU layers decode on the CPU state; layer 0 opened its step
        cis_step_layer = cis.select(layer, torch.randn(B, H, D), k, k, geom, p, 1.0)
        assert bool(cis_step_layer.retrieved.all())
    assert int(cis.states[torch.device("cpu")].step) == 1 and int(cis.states[torch.device("cpu")].anchor_count.sum()) == 4
