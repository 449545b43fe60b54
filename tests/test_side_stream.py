"""ES-CIS's next-layer selection on a side CUDA stream (``early_select.side_stream``).

The fork/join pair (``prhs_hf/ops/side_stream.py``) against its reference, ``decode_ops.cis_select``;
``generate()`` with the side stream against without it (eager and compiled, one graph); the
config's errors. On the CPU the fork runs in order; the GPU tests run both streams.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import prhs_hf
from prhs_hf.config import ConfigError, load_config
from prhs_hf.ops import side_stream
from prhs_hf.ops.compose.dilated_set import dilated_set_size
from prhs_hf.ops.decode_ops import cis_select, get_decode_ops
from prhs_hf.ops.triton_support import HAS_TRITON, interpreting
from tiny_models import padded_batch, tiny_model

# tau 0.3 on the tiny model: some rows share their anchor's set, others retrieve
OVERRIDES = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4, "tau": 0.3},
             "telemetry": {"enabled": True}}


def _select_inputs(device, B=2, H=4, Hkv=2, D=16, S=120, s=4, k=16, grouped=False):
    g = torch.Generator().manual_seed(0)
    rows, dim = (Hkv, D * H // Hkv) if grouped else (H, D)
    q = torch.randn(B, H, D, generator=g).to(device)
    k_cache = torch.randn(B, Hkv, S, D, generator=g).to(device)
    pad = torch.tensor([0, 7], dtype=torch.int32, device=device)
    t = (S - pad).to(torch.int32)
    lo = torch.full_like(t, 4)
    hi = t - 8
    anchor_q = torch.nn.functional.normalize(torch.randn(B, rows, s, dim, generator=g), dim=-1).to(device)
    anchor_count = torch.tensor([[2] * rows, [0] * rows], dtype=torch.int32, device=device)
    n = dilated_set_size(k, k // 3, 1)
    anchor_set = (torch.randint(4, S - 20, (B, rows, s, n), generator=g).sort(-1).values * 2).to(torch.int32).to(device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    args = (q, k_cache, pad, t, lo, hi, hi, anchor_q, anchor_count, anchor_set, active)
    sizes = dict(tau=-1.0, sink=4, k=k, dil_m=k // 3, dil_r=1, cap=4 + 8 + n, scale=D ** -0.5, grouped=grouped)
    return args, sizes, rows


def _fork_join_equals_cis_select(backend, device, grouped):
    args, sizes, rows = _select_inputs(device, grouped=grouped)
    want = cis_select(get_decode_ops(backend), *args, **sizes)
    ticket, keep = side_stream.fork_cis_select(3, get_decode_ops(backend), *args, **sizes)
    assert side_stream.pending_selections() == 1
    got = side_stream.join_cis_select(ticket, keep, 3, rows=rows, k=sizes["k"], dil_m=sizes["dil_m"],
                                      dil_r=sizes["dil_r"], cap=sizes["cap"])
    assert side_stream.pending_selections() == 0
    for name, a, b in zip(("best", "new_idx", "new_set", "idx", "count"), got, want):
        assert torch.equal(a, b), name
    assert (want.best >= 0).any() and (want.best == -1).any()  # both paths of the step ran


@pytest.mark.parametrize("grouped", [False, True])
def test_fork_join_is_cis_select(grouped):
    _fork_join_equals_cis_select("torch", "cpu", grouped)


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1")
def test_fork_join_is_cis_select_on_the_triton_ops():
    _fork_join_equals_cis_select("triton", "cpu", False)


def test_join_without_fork_and_double_fork_are_errors():
    args, sizes, rows = _select_inputs("cpu")
    with pytest.raises(RuntimeError, match="no selection of layer 5 in flight"):
        side_stream.join_cis_select(torch.empty(0), (), 5, rows=rows, k=16, dil_m=5, dil_r=1, cap=40)
    side_stream.fork_cis_select(5, get_decode_ops("torch"), *args, **sizes)
    with pytest.raises(RuntimeError, match="forked twice"):
        side_stream.fork_cis_select(5, get_decode_ops("torch"), *args, **sizes)
    side_stream.drop_pending()
    assert side_stream.pending_selections() == 0


def _es_generate(side: bool, tap: str = "mid", backend: str = "torch", device: str = "cpu", compiled: bool = False,
                 compile_config: CompileConfig | None = None, count: dict | None = None):
    ids, mask = padded_batch([90, 70])
    model = tiny_model("llama", layers=3).to(device)
    prhs_hf.patch(model, "configs/cis.yaml", overrides={
        **OVERRIDES, "early_select": {"tap": tap, "side_stream": side}, "backend": {"decode": backend, "prefill": "torch"},
        "policy": {"decode": "sparse"}})
    kwargs = {}
    if compiled:
        kwargs = dict(cache_implementation="static", compile_config=compile_config)
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=7, do_sample=False,
                         disable_compile=not compiled, **kwargs)
    return out, prhs_hf.telemetry(model)


@pytest.fixture
def fork_count(monkeypatch):
    count = {"fork": 0, "ops": set()}
    real = side_stream._fork

    def counted(layer, ops, *args):
        count["fork"] += 1
        count["ops"].add(id(ops))
        return real(layer, ops, *args)

    monkeypatch.setattr(side_stream, "_fork", counted)
    return count


@pytest.mark.parametrize("tap, forks", [("mid", 6 * 2), ("early", 6 * 1)])
def test_generate_with_the_side_stream_gives_the_same_tokens(tap, forks, fork_count):
    """6 decode steps; forks for layers 1 and 2 (the early tap: layer 2 only, layer 1's selection
    would come before layer 0 opens the step)."""
    base, r_base = _es_generate(False, tap)
    assert fork_count["fork"] == 0
    side, r_side = _es_generate(True, tap)
    assert fork_count["fork"] == forks and side_stream.pending_selections() == 0
    assert torch.equal(side, base)
    assert 0 < r_side.retrieval_ratio == r_base.retrieval_ratio < 1
    assert r_side.processed_kv_per_step == r_base.processed_kv_per_step


def test_an_eager_fork_runs_on_the_table_the_runtime_picked(fork_count):
    """The tap hands the fork the runtime's ops table of the device itself (the object, no lookup by name)."""
    ids, mask = padded_batch([90, 70])
    model = tiny_model("llama", layers=3)
    prhs_hf.patch(model, "configs/cis.yaml", overrides={
        **OVERRIDES, "early_select": {"side_stream": True}, "backend": {"decode": "torch", "prefill": "torch"}})
    table = dataclasses.replace(get_decode_ops("torch"))  # equal to the reference table, but another object
    model._prhs_runtime._ops[torch.device("cpu")] = table
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    prhs_hf.unpatch(model)
    assert fork_count["fork"] > 0 and fork_count["ops"] == {id(table)}


def _cpu_compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    return config


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1")
def test_compiled_step_keeps_the_fork_and_join_in_one_graph(fork_count):
    torch._dynamo.reset()
    counters.clear()
    compiled, r_compiled = _es_generate(True, backend="triton", compiled=True, compile_config=_cpu_compile_config())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert fork_count["fork"] > 0  # the custom op ran the fork inside the compiled step
    eager, r_eager = _es_generate(False, backend="triton")
    assert torch.equal(compiled, eager)
    assert r_compiled.retrieval_ratio == r_eager.retrieval_ratio


@pytest.mark.parametrize("data, match", [
    ({"baseline": {"name": "quest"}, "early_select": {"side_stream": True}}, "early_select.side_stream: applies to ES-CIS"),
    ({"cis": {}, "budget": {"local": 0}, "early_select": {"side_stream": True}}, "budget.local: 0 with early_select.side_stream"),
    ({"cis": {}, "early_select": {"side_stream": "yes"}}, "early_select.side_stream"),
])
def test_config_errors_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
def test_fork_join_is_cis_select_on_the_gpu(grouped):
    _fork_join_equals_cis_select("triton", "cuda", grouped)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_generate_with_the_side_stream_on_the_gpu(compiled, fork_count):
    """Both streams on the GPU, eager and compiled with CUDA graphs (reduce-overhead): the same
    tokens and ρ̂ as the selection on the main stream."""
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    torch._dynamo.reset()
    base, r_base = _es_generate(False, backend="triton", device="cuda", compiled=compiled, compile_config=config)
    torch._dynamo.reset()
    side, r_side = _es_generate(True, backend="triton", device="cuda", compiled=compiled, compile_config=config)
    assert fork_count["fork"] > 0
    assert torch.equal(side, base)
    assert r_side.retrieval_ratio == r_base.retrieval_ratio
