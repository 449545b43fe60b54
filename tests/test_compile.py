"""The decode step under torch.compile: one whole graph (fullgraph), no recompilation, same tokens.

transformers compiles the decode forward itself when generate() runs with a StaticCache. These
tests make it do so on the CPU (``CompileConfig._compile_all_devices``) with ``fullgraph=True``,
so any graph break in the PrHS decode path fails them, and with the ``aot_eager`` backend (the
graph Dynamo captures, without inductor's minutes of C++ compilation). The Triton decode path
runs in the interpreter here: the launchers enter the graph as ``torch.ops.prhs.*`` custom ops.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import prhs_hf
from prhs_hf.ops.triton_support import HAS_TRITON, interpreting
from tiny_models import padded_batch, tiny_model

SMALL = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4}, "telemetry": {"enabled": True}}

def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def _generate(model, ids, mask, compiled: bool, new_tokens: int = 14):
    prhs_hf.reset(model)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
        compile_config=_compile_config(), disable_compile=not compiled,
    )
    return out, prhs_hf.telemetry(model)


def _compiled_dense_then_patched(config: str, layers: int, new_tokens: int, compile_config: CompileConfig, clear):
    """A static-cache generate() of a fresh tiny LLaMA, unpatched, then patched with ``config`` (PyTorch
    ops), each with a fresh Dynamo; ``clear()`` runs before each and the caller reads what it
    collected after each (this yields once per model)."""
    ids, mask = padded_batch([90, 70])
    for patched in (False, True):
        model = tiny_model("llama", layers=layers)
        if patched:
            prhs_hf.patch(model, f"configs/{config}", overrides={**SMALL, "backend": {"decode": "torch", "prefill": "torch"}})
        torch._dynamo.reset()
        clear()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                       cache_implementation="static", compile_config=compile_config)
        yield


@pytest.mark.parametrize("config", ["cis.yaml", "cpe.yaml"])
def test_compiled_static_decode_is_one_graph_with_eager_tokens(config):
    model = tiny_model("llama")
    ids, mask = padded_batch([150, 110])
    prhs_hf.patch(model, f"configs/{config}", overrides={**SMALL, "backend": {"decode": "torch", "prefill": "torch"}})
    torch._dynamo.reset()
    counters.clear()
    # compiled first, on a fresh patch: nothing was resolved or allocated by an eager decode step
    compiled, r_compiled = _generate(model, ids, mask, compiled=True)
    eager, r_eager = _generate(model, ids, mask, compiled=False)
    again, r_again = _generate(model, ids, mask, compiled=True)  # a second prompt reuses the graph
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(compiled, eager)
    assert torch.equal(again, eager)
    # the step did sparse work, and telemetry accumulated on the device inside the graph
    assert r_eager.sparse_sequence_steps > 0 and r_eager.retrieval_ratio < 1.0
    for report in (r_compiled, r_again):
        assert report.decode_steps == r_eager.decode_steps == 13
        assert report.retrieval_ratio == r_eager.retrieval_ratio
        assert report.processed_kv_per_step == r_eager.processed_kv_per_step


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1")
def test_compiled_triton_decode_is_one_graph_with_eager_tokens():
    """The Triton launchers enter the graph as torch.ops.prhs.* (the interpreter cannot be traced)."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([90, 70])
    prhs_hf.patch(model, "configs/cpe.yaml", overrides={**SMALL, "backend": {"decode": "triton", "prefill": "torch"}})
    torch._dynamo.reset()
    counters.clear()
    compiled, r_compiled = _generate(model, ids, mask, compiled=True, new_tokens=7)
    eager, r_eager = _generate(model, ids, mask, compiled=False, new_tokens=7)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(compiled, eager)
    assert r_eager.sparse_sequence_steps > 0
    assert r_compiled.retrieval_ratio == r_eager.retrieval_ratio


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1")
def test_compiled_union_attention_is_its_op_in_one_graph_with_eager_tokens():
    """backend.sparse_attention: group_union: the union launcher enters the static-cache decode graph as
    torch.ops.prhs.sparse_decode_attention_union, in place of the per-head op, with the eager tokens."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch([90, 70])
    prhs_hf.patch(model, "configs/cis.yaml", overrides={
        **SMALL, "backend": {"decode": "triton", "prefill": "torch", "sparse_attention": "group_union"}})
    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compiled in (True, False):
        prhs_hf.reset(model)
        runs[compiled] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                        cache_implementation="static", compile_config=config,
                                        disable_compile=not compiled)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert any("prhs.sparse_decode_attention_union" in t for t in targets)
    assert not any("prhs.sparse_decode_attention." in t for t in targets)
    assert torch.equal(runs[True], runs[False])
    assert prhs_hf.telemetry(model).sparse_sequence_steps > 0


@pytest.mark.parametrize("config, fullgraph", [("cis.yaml", True), ("cpe.yaml", False)])
def test_user_compiled_forward_with_static_cache(config, fullgraph):
    """The issue's other recipe: ``model.forward = torch.compile(model.forward, ...)`` by hand.

    The compiled forward then also runs the prefill. Without PSAW/ETF (cis.yaml) prefill and
    decode are one graph each (fullgraph). ETF's row skipping picks the prompt rows to compute
    with data-dependent shapes, so a CPE prefill breaks the graph there (fullgraph=False, as
    ``mode="reduce-overhead"`` users write it) and still gives the eager tokens.
    """
    model = tiny_model("llama")
    ids, mask = padded_batch([120, 90])
    prhs_hf.patch(model, f"configs/{config}", overrides={**SMALL, "backend": {"decode": "torch", "prefill": "torch"}})
    eager, r_eager = _generate(model, ids, mask, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, fullgraph=fullgraph, backend="aot_eager")
    try:
        compiled, r_compiled = _generate(model, ids, mask, compiled=False)  # generate's own compile off
    finally:
        del model.forward
    if fullgraph:
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # prefill shape, decode shape
    assert torch.equal(compiled, eager)
    assert r_compiled.retrieval_ratio == r_eager.retrieval_ratio and r_compiled.decode_steps == 13


def test_decode_graph_returns_only_the_logits():
    """The PrHS step adds no graph outputs to the dense one: state and counters change in place.

    ``x += y`` on an attribute or a dict item rebinds it; Dynamo then returns the tensor from the
    graph and replays the assignment in Python after every step (two per layer: a host cost that
    CUDA graphs cannot remove). ``add_()`` does not.
    """
    outputs = {}

    def backend(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        outputs[len(outputs)] = len(out.args[0])
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    counts = []
    for _ in _compiled_dense_then_patched("cpe.yaml", layers=2, new_tokens=4, compile_config=config,
                                          clear=outputs.clear):
        assert len(outputs) == 1, outputs  # the decode step, one graph
        counts.append(outputs[0])
    assert counts[1] == counts[0], f"dense decode graph has {counts[0]} outputs, PrHS {counts[1]}"


def test_decode_step_replays_no_attribute_writes(monkeypatch):
    """A CIS config's compiled decode step writes no Python attribute, as the dense one.

    Dynamo replays every attribute write of the traced code in Python after each compiled step,
    reaching the object through its source (for a PrHS layer: the decoder layer's hook closure);
    with one write per layer that was host time in every decode step that CUDA graphs cannot
    remove. Counted here: the writes Dynamo replays (``object_setattr_ignore_descriptor``) in the
    compiled steps of one generate() call.
    """
    import torch._dynamo.utils as dynamo_utils

    replayed = []
    setattr_ignore_descriptor = dynamo_utils.object_setattr_ignore_descriptor

    def counting(obj, name, value):
        replayed.append((type(obj).__name__, name))
        return setattr_ignore_descriptor(obj, name, value)

    monkeypatch.setattr(dynamo_utils, "object_setattr_ignore_descriptor", counting)
    writes = []
    for _ in _compiled_dense_then_patched("cis.yaml", layers=3, new_tokens=5, compile_config=_compile_config(),
                                          clear=replayed.clear):
        writes.append(list(replayed))
    assert writes[0], "the dense step replays transformers' own writes: the count sees them"
    assert writes[1] == writes[0], f"PrHS adds {sorted(set(writes[1]) - set(writes[0]))}"


def test_chunked_prefill_of_a_compiled_static_generate_runs_eagerly():
    """``generate(prefill_chunk_size=...)`` with a static cache: transformers runs the prompt chunks
    through the compiled forward too. A PrHS prefill allocates what the decode steps read (geometry
    buffers, CIS state); inside a CUDA-graphed forward those would live in the graph's pool and be
    overwritten by the next replay (on the GPU: "accessing tensor output of CUDAGraphs that has been
    overwritten"). So a patched model runs the chunks eagerly: one compiled graph (the decode step),
    and the tokens of the unchunked generate()."""
    model = tiny_model("llama")
    ids, mask = padded_batch([150, 110])
    prhs_hf.patch(model, "configs/cis.yaml", overrides={**SMALL, "backend": {"decode": "torch", "prefill": "torch"}})
    eager, _ = _generate(model, ids, mask, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    prhs_hf.reset(model)
    chunked = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, prefill_chunk_size=64,
                             cache_implementation="static", compile_config=_compile_config())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the decode step only
    assert torch.equal(chunked, eager)
    prhs_hf.unpatch(model)
    assert "_prefill" not in model.__dict__
