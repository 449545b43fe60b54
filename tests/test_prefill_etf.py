"""PSAW and ETF in prefill (SPEC §2-§3) through a patched model."""

import pytest
import torch

import prhs_hf
from prhs_hf.schedules import etf_frozen_count, psaw_window_fraction, psaw_window_start
from tiny_models import padded_batch, tiny_model

N_LAYERS, SINK = 6, 4


def _cfg(psaw=True, etf=True):
    return {
        "budget": {"sink": SINK, "local": 8, "topk": 16},
        "cis": {"enabled": False},
        "psaw": {"enabled": psaw, "phases": ["prefill"], "phi": 0.5},
        "etf": {"enabled": etf, "psi": 0.4},
        "backend": {"prefill": "torch", "decode": "torch"},
    }


def _naive_attention(q, k, v, pad, scale, layer, frozen_hi):
    """Full L x L masked softmax from the SPEC §3 predicate, written without the library."""
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    w = psaw_window_fraction(layer, N_LAYERS, N_LAYERS // 2, 0.5, 1.0)
    out = torch.zeros(B, L, Hq, D, dtype=torch.float64)
    for b in range(B):
        p = int(pad[b])
        for r in range(p, L):
            i = r - p
            if SINK <= i < frozen_hi[b]:
                continue  # frozen row: zero output
            keys = [j for j in range(i + 1) if j < SINK or j >= psaw_window_start(i + 1, w, SINK)]
            slots = torch.tensor(keys) + p
            for h in range(Hq):
                s = (k[b, h // g, slots].double() @ q[b, h, r].double()) * scale
                out[b, r, h] = torch.softmax(s, 0) @ v[b, h // g, slots].double()
    return out


@pytest.mark.parametrize("psaw,etf", [(True, False), (False, True), (True, True)])
def test_sparse_prefill_equals_masked_reference_attention(psaw, etf):
    model = tiny_model("llama", layers=N_LAYERS)
    ids, mask = padded_batch([48, 37])
    prhs_hf.patch(model, _cfg(psaw, etf))
    runtime = model._prhs_runtime
    inner = runtime.prefill_function(torch.device("cpu"), torch.float32)
    calls = []

    def recording(q, k, v, plan, scale):
        out = inner(q, k, v, plan, scale)
        calls.append((q, k, v, plan.pad, scale, out))
        return out

    runtime._prefill[(torch.device("cpu"), torch.float32)] = recording
    with torch.no_grad():
        model(ids, attention_mask=mask)
    prhs_hf.unpatch(model)
    assert len(calls) == N_LAYERS - N_LAYERS // 2  # layers >= l_s only; the others are dense SDPA
    lengths = mask.sum(1)
    for layer, (q, k, v, pad, scale, out) in zip(range(N_LAYERS // 2, N_LAYERS), calls):
        assert pad.tolist() == [0, 11]
        frozen_hi = [etf_frozen_count(int(n), layer, N_LAYERS, N_LAYERS // 2, 0.4, 1.0) if etf else 0 for n in lengths]
        expected = _naive_attention(q, k, v, pad, scale, layer if psaw else -1, frozen_hi)
        real = mask.bool()
        torch.testing.assert_close(out.double()[real], expected[real], rtol=1e-5, atol=1e-5)


def test_frozen_rows_pass_through_and_their_work_is_skipped(monkeypatch):
    model = tiny_model("llama", layers=N_LAYERS)
    L = 64
    ids = torch.randint(1, 128, (1, L))
    rows = {}
    linear = torch.nn.functional.linear
    names = {}
    for i, layer in enumerate(model.model.layers):
        names[id(layer.self_attn.q_proj.weight)] = (i, "q_proj")
        names[id(layer.self_attn.o_proj.weight)] = (i, "o_proj")
        names[id(layer.mlp.gate_proj.weight)] = (i, "mlp")

    def counting_linear(x, weight, bias=None):
        if id(weight) in names:
            rows[names[id(weight)]] = x.shape[:-1].numel()
        return linear(x, weight, bias)

    io = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: io.__setitem__(i, (a[0].clone(), out.clone())))
    prhs_hf.patch(model, {**_cfg(psaw=False, etf=True), "telemetry": {"enabled": True}})
    monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)
    with torch.no_grad():
        model(ids)
    report = prhs_hf.telemetry(model)
    prhs_hf.unpatch(model)
    frozen_counts = []
    for layer in range(N_LAYERS):
        e = etf_frozen_count(L, layer, N_LAYERS, N_LAYERS // 2, 0.4, 1.0)
        n_frozen = max(e - SINK, 0)
        frozen_counts.append(n_frozen)
        for part in ("q_proj", "o_proj", "mlp"):
            assert rows[(layer, part)] == L - n_frozen, (layer, part)
        if n_frozen:
            # frozen rows come out of the layer exactly as they went in; active rows change
            x, y = io[layer]
            assert torch.equal(y[0, SINK:e], x[0, SINK:e])
            assert not torch.equal(y[0, e:], x[0, e:]) and not torch.equal(y[0, :SINK], x[0, :SINK])
    assert sum(frozen_counts) > 0 and frozen_counts == sorted(frozen_counts)
    assert report.prefill_rows_frozen == frozen_counts


def test_rows_are_skipped_by_hooks_and_unpatch_leaves_a_forward_set_since():
    """ETF skips rows through two module hooks, not a replaced ``forward``: a ``forward`` that the user
    sets on the module while patched is still theirs after ``unpatch`` (a replaced one was deleted)."""
    model = tiny_model("llama", layers=N_LAYERS)
    prhs_hf.patch(model, _cfg(psaw=False, etf=True))
    mlp = model.model.layers[-1].mlp
    assert "forward" not in mlp.__dict__ and len(mlp._forward_pre_hooks) == len(mlp._forward_hooks) == 1
    own = mlp.forward
    mlp.forward = lambda x: own(x)  # e.g. a wrapper of the user's, set on the instance
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 64)))
    prhs_hf.unpatch(model)
    assert "forward" in mlp.__dict__ and not mlp._forward_pre_hooks and not mlp._forward_hooks


def test_etf_freezes_nothing_in_decode_and_generation_runs():
    model = tiny_model("glm4", layers=N_LAYERS)
    ids, mask = padded_batch([50, 44])
    prhs_hf.patch(model, {**_cfg(), "cis": {"enabled": True, "block_size": 4}})
    layer = model._prhs_runtime.layers[-1]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        model(out[:, -1:], attention_mask=torch.ones_like(out[:, -1:]))  # a lone decode-shaped call
    assert layer.active_rows() is None
    prhs_hf.unpatch(model)
    assert out.shape == (2, 55)
