"""Which kernels inductor makes of one compiled decode step, per layer: dense vs CIS (CPU probe).

The question (docs/results/bench_e2e_decode_real_profile.md): the compiled decode step of a
``configs/cis.yaml`` model launches ~1090 kernels per step on Qwen2.5-Coder-1.5B (28 layers) on
the H200 against 554 for the dense model, ~19 more per layer. Which glue ops between the custom
Triton ops (``torch.ops.prhs.*``, each op folder's custom_ops.py) become kernels of their own, and what
would fuse them away?

This probe answers it on the CPU. It builds a tiny random Qwen2 model (tests/tiny_models.py;
default 3 layers, 4 query / 2 KV heads of 16, B 2, a 160-token prompt), puts it in ``dense``
(SDPA with ``enable_gqa``, ``_bench_common.FAIR_ATTENTION``), ``cis`` (``configs/cis.yaml``, the
Triton decode ops, which run in the interpreter, ``TRITON_INTERPRET=1``) or, with ``--configs ds``,
Double Sparsity at the same budget (bench_e2e_decode's ``ds-s16``) and runs ``generate()``
with a StaticCache and ``CompileConfig(fullgraph=True, mode="reduce-overhead")``, as
scripts/bench_e2e_decode.py does, so transformers compiles the decode forward with inductor.
With inductor's provenance tracking on, every launch of the generated ``call()`` is matched to
the scheduler nodes it was made from; each node's FX origins carry the Python stack trace, so a
kernel is named by the prhs_hf / kernels / transformers source lines it fuses, and by the layer
(``nn_module_stack``) it belongs to.

Two inductor backends, reported side by side (``--backends``):

``triton``
    inductor's Triton scheduling and code generation (``cpu_backend="triton"``), the code
    generator CUDA uses, so kernel boundaries are what the GPU build draws, up to device
    details (below). There is no Triton CPU driver here: the code is generated and then the
    compilation stops (no kernel is compiled or run); inductor's Triton cache key, which asks
    the driver for its target, is replaced by a constant for that.
``cpp``
    inductor's default CPU backend, compiled and run (the decode steps produce tokens). It fuses
    much more than Triton does (one OpenMP kernel holds loops of different sizes, across
    layers), so its kernel counts say little about the GPU; it is the honest, executed CPU
    result. This run also counts the Triton launches inside each custom op (interpreter,
    per decode step), the GPU kernels the custom ops add besides inductor's.

Caveats (said in the JSON and the markdown too): it is not CUDA. GPU inductor runs in bf16 (more
dtype conversions, fused into the same kernels), lowers SDPA and matmuls to other extern kernels
(cuBLAS, efficient attention), sizes reductions by the SM count, and the custom ops take their
CUDA paths (other launch counts than the interpreter's). Kernel *boundaries* between pointwise
glue and opaque ops (extern and custom ops are never fused into) do not depend on that.

    TRITON_INTERPRET=1 python scripts/probe_decode_kernels.py            # docs/results/probe_decode_kernels.*
    TRITON_INTERPRET=1 python scripts/probe_decode_kernels.py --backends triton --layers 2 --out /tmp/p
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
import transformers
from transformers.generation.configuration_utils import CompileConfig

ROOT = Path(__file__).resolve().parent.parent
for _folder in (ROOT / "scripts", ROOT / "tests"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import _bench_common as common  # noqa: E402
import prhs_hf  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

CONFIGS = ("dense", "cis", "ds")
#: what a run without --configs compares
DEFAULT_CONFIGS = ("dense", "cis")
#: ds: bench_e2e_decode's ds-s16 (Double Sparsity at cis.yaml's budget, CIS off), rank 8 of the tiny heads' 16
DS_OVERRIDES = {"baseline": {"name": "double_sparsity", "label_rank": 8}, "psaw": {"enabled": False},
                "etf": {"enabled": False}}
BACKENDS = ("triton", "cpp")
#: the decode ops in the graph: the Triton launchers as torch.ops.prhs.* (the interpreter on the CPU)
CIS_OVERRIDES = {"backend": {"decode": "triton", "prefill": "torch"}, "telemetry": {"enabled": False}}
COMPILE_CONFIG = CompileConfig(fullgraph=True, mode="reduce-overhead")
COMPILE_CONFIG._compile_all_devices = True  # transformers compiles on CUDA only unless told
#: FX ops that only re-view memory: never what a kernel "computes"
VIEW_OPS = {"view", "reshape", "_unsafe_view", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",
            "select", "slice", "alias", "as_strided", "clone", "getitem", "_to_copy", "convert_element_type"}
#: files of this checkout that name a source line (before falling back to transformers)
OUR_FILES = ("prhs_hf/", "scripts/")
CAVEAT = ("CPU probe, not CUDA: the 'triton' backend is inductor's Triton code generator on a CPU device "
          "(cpu_backend='triton': the GPU build's kernel boundaries, code generated but not compiled or run); "
          "the 'cpp' backend is inductor's default CPU backend, compiled and run, which fuses across loops "
          "of different sizes and layers and so draws far fewer kernels than the GPU. GPU inductor runs in "
          "bf16, lowers SDPA / matmuls to other extern kernels, sizes reductions by the SM count, and the "
          "custom ops take their CUDA paths (other launch counts than the interpreter's).")

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+):(\d+)")
_LAYER = re.compile(r"layers(?:\[|\.)(\d+)")


class _CodegenDone(Exception):
    """Raised after the output code was captured, to stop a compilation that cannot run here."""


def _op_name(node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _source(node) -> dict[str, Any] | None:
    """The innermost frame of ``node``'s stack trace in this checkout (else the innermost one)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    ours = [f for f in frames if str(ROOT) in f[0] and any(p in f[0] for p in OUR_FILES)]
    path, line, func, code = (ours or frames)[-1]
    rel = os.path.relpath(path, ROOT) if str(ROOT) in path else path.split("site-packages/")[-1]
    return {"file": rel, "line": int(line), "function": func, "code": code.strip()}


def _layer(node) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():
        for text in (key, str(value[0]) if isinstance(value, tuple) else str(value)):
            m = _LAYER.search(text)
            if m:
                return int(m.group(1))
    return None


def _shape(node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" for v in val if isinstance(v, torch.Tensor))
    return ""


def _describe_origins(origins, main=None) -> list[dict[str, Any]]:
    """The FX origins of a buffer that compute something (views dropped), ``main`` first."""
    nodes = sorted((n for n in origins if _op_name(n) not in VIEW_OPS or n is main), key=lambda n: n.name)
    if main is not None:
        nodes = [main] + [n for n in nodes if n is not main]
    out = []
    for n in nodes:
        out.append({"node": n.name, "op": _op_name(n), "shape": _shape(n), "layer": _layer(n), "source": _source(n),
                    "main": n is main})
    return out


def _inner(ir) -> str:
    """The buffer's loop body in inductor's ops (loads, constants, arithmetic), compacted: what it stores."""
    try:
        text = str(ir.data.inner_fn_str())
    except Exception:  # noqa: BLE001 - templates, scatters and fallbacks have no plain inner function
        return ""
    text = re.sub(r"\s+", " ", text.replace("def inner_fn(index):", "")).strip()
    return text if len(text) <= 400 else text[:397] + "..."


def _sizes(buf) -> str:
    try:
        return f"{str(buf.get_dtype()).replace('torch.', '')}{[int(s) for s in buf.get_size()]}"
    except Exception:  # noqa: BLE001 - a multi-output or layout-less node has no single size
        return ""


class _Patched:
    """A context manager over ``self._patches`` (``mock.patch`` objects): started in order, stopped in reverse."""

    _patches: list

    def _start(self):
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in reversed(self._patches):
            p.stop()
        return False


class KernelRecorder(_Patched):
    """Patches inductor while active: every kernel launch codegen'd gets a record (its scheduler
    nodes' buffers, sizes and FX origins) keyed by its provenance handle, and the output code of
    each compiled graph is kept. ``stop_after_codegen``: the compilation is aborted once its code
    exists (for the Triton backend on a CPU, which cannot compile or run the kernels)."""

    def __init__(self, stop_after_codegen: bool):
        self.stop = stop_after_codegen
        self.records: dict[int, dict[str, Any]] = {}
        self.codes: list[str] = []
        self._patches: list = []

    def _record(self, original: Callable) -> Callable:
        def wrapped(node_schedule, kernel_name, is_extern=False):
            handle = original(node_schedule, kernel_name, is_extern)
            if handle is None:
                return handle
            try:
                self.records[handle] = self._describe(node_schedule, kernel_name, is_extern)
            except Exception as exc:  # noqa: BLE001 - a probe: record what failed, keep compiling
                self.records[handle] = {"name": kernel_name, "buffers": [], "error": f"{type(exc).__name__}: {exc}"}
            return handle
        return wrapped

    @staticmethod
    def _describe(node_schedule, kernel_name: str, is_extern: bool) -> dict[str, Any]:
        from torch._inductor.virtualized import V

        removed = set(getattr(V.graph, "removed_buffers", ()))
        buffers = []
        if is_extern:
            node = node_schedule
            buffers.append({"buffer": node.get_name(), "size": _sizes(node), "stored": True,
                            "origins": _describe_origins(node.origins, node.origin_node)})
        else:
            for snode in node_schedule:
                ir = getattr(snode, "node", None)
                if ir is None:
                    continue
                name = ir.get_name()
                reads = sorted({d.name for d in snode.read_writes.reads})
                feeds = sorted({_op_name(o) for o in ir.origins if str(o.target).startswith("prhs.")
                                and o is not getattr(ir, "origin_node", None)})
                buffers.append({"buffer": name, "size": _sizes(ir), "stored": name not in removed, "computes": _inner(ir),
                                "origins_include_op_args_of": feeds,
                                "mutates": list(ir.get_mutation_names()) if hasattr(ir, "get_mutation_names") else [],
                                "reads": reads, "origins": _describe_origins(ir.origins, getattr(ir, "origin_node", None))})
        return {"name": kernel_name, "buffers": buffers}

    def _save(self, code: str) -> None:
        self.codes.append(code)
        if self.stop:
            raise _CodegenDone()

    def __enter__(self):
        import torch._inductor.codegen.cpp as cpp_codegen
        import torch._inductor.codegen.triton as triton_codegen
        import torch._inductor.debug as inductor_debug
        from torch._inductor.graph import GraphLowering

        original = inductor_debug.set_kernel_post_grad_provenance_tracing
        wrapped = self._record(original)
        self._patches = [
            mock.patch.object(inductor_debug, "set_kernel_post_grad_provenance_tracing", wrapped),
            mock.patch.object(triton_codegen, "set_kernel_post_grad_provenance_tracing", wrapped),
            mock.patch.object(cpp_codegen, "set_kernel_post_grad_provenance_tracing", wrapped),
            mock.patch.object(GraphLowering, "save_output_code", staticmethod(self._save)),
            mock.patch.object(torch._inductor.config.trace, "provenance_tracking_level", 1),
            mock.patch.object(torch._inductor.config, "fx_graph_cache", False),
        ]
        return self._start()


class LaunchCounter(_Patched):
    """Counts the Triton launches (interpreter) of each custom op per decode step: the prhs ops
    run their launchers through the module globals of each op folder's ``custom_ops``, wrapped here."""

    OPS = ("cis_match", "topk_retrieval", "topk_retrieval_grouped", "dilate_and_compose", "dilate_compose_and_record",
           "compose_indices", "sparse_decode_attention", "sparse_decode_attention_grouped", "record_anchors")

    def __init__(self):
        self.current: str | None = None
        self.step = 0
        self.counts: dict[int, Counter] = defaultdict(Counter)
        self._patches: list = []

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        import prhs_hf.ops.decode_ops  # noqa: F401  (loads every op folder's custom_ops)

        counter = self
        original_run = InterpretedFunction.run

        def run(fn_self, *args, **kwargs):
            if not kwargs.get("warmup"):
                counter.counts[counter.step][f"{counter.current or 'outside an op'}: {fn_self.fn.__name__}"] += 1
            return original_run(fn_self, *args, **kwargs)

        def tag(name, launcher):
            def call(*args, **kwargs):
                counter.current = name
                try:
                    return launcher(*args, **kwargs)
                finally:
                    counter.current = None
            return call

        self._patches = [mock.patch.object(InterpretedFunction, "run", run)]
        modules = [m for n, m in sys.modules.items() if n.startswith("prhs_hf.ops.") and n.endswith(".custom_ops")]
        self._patches += [mock.patch.object(module, name, tag(name, getattr(module, name)))
                          for module in modules for name in self.OPS if hasattr(module, name)]
        return self._start()


class StepMarks(transformers.LogitsProcessor):
    """Advances ``counter.step`` after each forward (0: the prefill, then the decode steps)."""

    def __init__(self, counter: LaunchCounter):
        self.counter = counter

    def __call__(self, input_ids, scores):
        self.counter.step += 1
        return scores


def build(config: str, layers: int, heads: int, kv_heads: int):
    """The tiny Qwen2 model in ``config`` (dense: SDPA enable_gqa; cis: configs/cis.yaml, Triton ops; ds: Double
    Sparsity at the same budget)."""
    model = tiny_model("qwen2", layers=layers, heads=heads, kv_heads=kv_heads)
    if config == "dense":
        model.set_attn_implementation(common.register_fair_attention())
    elif config == "cis":
        prhs_hf.patch(model, ROOT / "configs" / "cis.yaml", overrides=CIS_OVERRIDES)
    elif config == "ds":
        prhs_hf.patch(model, ROOT / "configs" / "cpe.yaml", overrides={**CIS_OVERRIDES, **DS_OVERRIDES})
    else:
        raise ValueError(f"config {config!r}: allowed {', '.join(CONFIGS)}")
    return model


def compile_step(config: str, backend: str, layers: int, heads: int, kv_heads: int, batch: int, prompt: int,
                 new_tokens: int = 3) -> dict[str, Any]:
    """Compile (and with ``cpp`` run) the decode step of ``config``; its launches, in order."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: allowed {', '.join(BACKENDS)}")
    model = build(config, layers, heads, kv_heads)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    cache = transformers.StaticCache(config=model.config, max_cache_len=prompt + new_tokens + 2)
    torch._dynamo.reset()
    counter = LaunchCounter()
    patches = [mock.patch.object(torch._inductor.config, "cpu_backend", backend)]
    if backend == "triton":  # the Triton cache key asks the (absent) driver for its target
        import torch.utils._triton as torch_triton
        patches.append(mock.patch.object(torch_triton, "triton_hash_with_backend", lambda: "NO-TRITON-DRIVER-ON-CPU"))
    recorder = KernelRecorder(stop_after_codegen=backend == "triton")
    for p in patches:
        p.start()
    try:
        with recorder, counter, torch.no_grad():
            try:
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, past_key_values=cache,
                               compile_config=COMPILE_CONFIG,
                               logits_processor=transformers.LogitsProcessorList([StepMarks(counter)]))
            except Exception as exc:  # noqa: BLE001 - the Triton backend stops after codegen on purpose
                if not (backend == "triton" and _caused_by(exc, _CodegenDone)):
                    raise
    finally:
        for p in reversed(patches):
            p.stop()
        torch._dynamo.reset()
    if len(recorder.codes) != 1:
        raise RuntimeError(f"{config}/{backend}: expected one compiled graph (the decode step), got {len(recorder.codes)}")
    launches = parse_launches(recorder.codes[0], recorder.records)
    result = {"config": config, "backend": backend, "layers": layers, "launches": launches}
    if backend == "cpp":
        # the last decode step (the first compiled one also traced and compiled)
        last = max(counter.counts) if counter.counts else None
        result["custom_op_triton_launches_per_step"] = dict(sorted(counter.counts[last].items())) if last else {}
    return result


def _caused_by(exc: BaseException, kind: type) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind) or kind.__name__ in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def kind_of(name: str) -> str:
    """``inductor`` (a generated kernel), ``custom`` (torch.ops.prhs.*) or ``extern`` (aten / extern_kernels)."""
    if name.startswith(("triton_", "cpp_")):
        return "inductor"
    if name.startswith("torch.ops.prhs."):
        return "custom"
    return "extern"


def parse_launches(code: str, records: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The launches of ``call()`` in order (one provenance handle each), with their records."""
    body = code[code.index("def call("):] if "def call(" in code else code
    launches = []
    for name, handle in _HANDLE.findall(body):
        rec = records.get(int(handle), {"name": name, "buffers": []})
        layers = sorted({o["layer"] for b in rec["buffers"] for o in b["origins"] if o["main"] or o["op"] not in VIEW_OPS}
                        - {None})
        main_layers = sorted({o["layer"] for b in rec["buffers"] for o in b["origins"] if o["main"]} - {None})
        owner = main_layers or layers
        launches.append({
            "seq": len(launches), "name": name, "handle": int(handle), "kind": kind_of(name),
            "layer": owner[0] if len(owner) == 1 else (None if not owner else "shared"),
            "layers": owner, "numel": _numel(code, name), "buffers": rec["buffers"],
            **({"error": rec["error"]} if "error" in rec else {}),
        })
    return launches


def _numel(code: str, name: str) -> dict[str, int]:
    """``xnumel`` / ``r0_numel`` of a Triton kernel's definition (its iteration space)."""
    if not name.startswith("triton_"):
        return {}
    start = code.find(f"def {name}(")
    if start < 0:
        return {}
    body = code[start:code.find("'''", start)]
    return {k: int(v) for k, v in re.findall(r"\b(xnumel|ynumel|r0_numel)\s*=\s*(\d+)", body)}


# ----------------------------------------------------------------------------- analysis


def counts(launches: list[dict[str, Any]], layer=None) -> dict[str, int]:
    """Launches by kind, of one layer (``layer``) or of the whole step (None)."""
    c = Counter(l["kind"] for l in launches if layer is None or l["layer"] == layer)
    return {"inductor": c["inductor"], "custom": c["custom"], "extern": c["extern"], "all": sum(c.values())}


def summarize_sources(launch: dict[str, Any]) -> list[str]:
    """``file:line code`` of what a launch computes: its buffers' main origins (else all non-view ones)."""
    lines = []
    for b in launch["buffers"]:
        origins = [o for o in b["origins"] if o["main"]] or [o for o in b["origins"] if o["op"] not in VIEW_OPS]
        for o in origins:
            s = o["source"]
            text = f"{s['file']}:{s['line']} {s['code']}" if s else o["node"]
            if text not in lines:
                lines.append(text)
    return lines


def layer_inventory(launches: list[dict[str, Any]], layer: int) -> list[dict[str, Any]]:
    """One row per launch of ``layer``: name, kind, sizes, the source lines it fuses."""
    rows = []
    for l in launches:
        if l["layer"] != layer:
            continue
        ops = sorted({o["op"] for b in l["buffers"] for o in b["origins"] if o["op"] not in VIEW_OPS})
        rows.append({
            "seq": l["seq"], "kind": l["kind"], "name": l["name"], "numel": l["numel"],
            "buffers": [f"{b['buffer']} {b['size']}{'' if b.get('stored', True) else ' (not stored)'}"
                        + (f" mutates {','.join(b['mutates'])}" if b.get("mutates") else "") for b in l["buffers"]],
            "computes": [f"{b['buffer']}: {b['computes']}" for b in l["buffers"] if b.get("computes")],
            "feeds_op_args": sorted({f for b in l["buffers"] for f in b.get("origins_include_op_args_of", [])}),
            "aten_ops": ops, "sources": summarize_sources(l),
        })
    return rows


def analyse(results: list[dict[str, Any]], layer: int) -> dict[str, Any]:
    """Counts per step and per layer for every (config, backend), and the extra launches per layer."""
    table = []
    for r in results:
        table.append({"config": r["config"], "backend": r["backend"], "layers": r["layers"],
                      "per_step": counts(r["launches"]),
                      "per_layer": {str(i): counts(r["launches"], i) for i in range(r["layers"])},
                      "shared_or_outside_layers": {"shared": counts(r["launches"], "shared")["all"],
                                                   "outside": counts(r["launches"], None)["all"]
                                                   - sum(counts(r["launches"], i)["all"] for i in range(r["layers"]))
                                                   - counts(r["launches"], "shared")["all"]},
                      **({"custom_op_triton_launches_per_step": r["custom_op_triton_launches_per_step"]}
                         if "custom_op_triton_launches_per_step" in r else {})})
    extra = {}
    for backend in {r["backend"] for r in results}:
        rows = {t["config"]: t for t in table if t["backend"] == backend}
        if "dense" in rows and "cis" in rows:
            d, c = rows["dense"]["per_layer"][str(layer)], rows["cis"]["per_layer"][str(layer)]
            extra[backend] = {k: c[k] - d[k] for k in d}
    return {"table": table, "extra_per_layer_cis_vs_dense": extra}


# ----------------------------------------------------------------------------- output


def compact_run(run: dict[str, Any]) -> dict[str, Any]:
    """A run for the JSON: every launch, its buffers' FX origins reduced to ``file:line code``."""
    launches = []
    for l in run["launches"]:
        buffers = [{k: v for k, v in b.items() if k not in ("origins", "reads")} for b in l["buffers"]]
        launches.append({**{k: v for k, v in l.items() if k != "buffers"}, "buffers": buffers,
                         "sources": summarize_sources(l)})
    return {**run, "launches": launches}


def markdown(meta: dict[str, Any], summary: dict[str, Any], inventories: dict[str, list], layer: int) -> str:
    lines = [f"On {meta['gpu']}, {meta['date']}, commit {meta['git_commit']}:", "", f"    {meta['command']}", "",
             f"{meta['model']}.", "", f"**Caveat.** {CAVEAT}", "",
             "Launches of one compiled decode step (inductor = generated kernels, custom = torch.ops.prhs.*, "
             f"extern = aten / extern_kernels), per step and in layer {layer}:", "",
             "| config | backend | step: inductor | custom | extern | all | layer: inductor | custom | extern | all "
             "| shared by layers | outside layers | per layer by difference (L vs L-1): inductor / custom / extern / all |",
             "|" + "---|" * 13]
    for t in summary["table"]:
        s, p = t["per_step"], t["per_layer"][str(layer)]
        lines.append(f"| {t['config']} | {t['backend']} | {s['inductor']} | {s['custom']} | {s['extern']} | {s['all']} | "
                     f"{p['inductor']} | {p['custom']} | {p['extern']} | {p['all']} | "
                     f"{t['shared_or_outside_layers']['shared']} | {t['shared_or_outside_layers']['outside']} | "
                     + " / ".join(str(t["per_layer_by_difference"][k]) for k in ("inductor", "custom", "extern", "all")) + " |")
    diff = {b: {k: rows["cis"]["per_layer_by_difference"][k] - rows["dense"]["per_layer_by_difference"][k]
                for k in ("inductor", "custom", "extern", "all")}
            for b in {t["backend"] for t in summary["table"]}
            for rows in [{t["config"]: t for t in summary["table"] if t["backend"] == b}] if {"cis", "dense"} <= set(rows)}
    if diff:
        lines += ["", "Extra launches per layer by difference, cis - dense: " + "; ".join(
            f"{b}: " + ", ".join(f"{k} {v:+d}" for k, v in e.items()) for b, e in sorted(diff.items()))]
    if summary["extra_per_layer_cis_vs_dense"]:
        lines += ["", "Extra launches per layer, cis - dense: " + "; ".join(
            f"{b}: " + ", ".join(f"{k} {v:+d}" for k, v in e.items()) for b, e in sorted(summary["extra_per_layer_cis_vs_dense"].items()))]
    for t in summary["table"]:
        if t.get("custom_op_triton_launches_per_step"):
            lines += ["", f"Triton launches inside the custom ops, one decode step ({t['config']}, interpreter; "
                          "CUDA paths may launch other counts): "
                      + ", ".join(f"{k} x{v}" for k, v in t["custom_op_triton_launches_per_step"].items())]
    for key, rows in inventories.items():
        lines += ["", f"### {key}: the launches of layer {layer}, in order", "",
                  "| # | kind | kernel | numel | buffers (size) | loop body (inductor ops) | aten ops | source lines of its FX origins |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            name = r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..."
            numel = ", ".join(f"{k} {v}" for k, v in r["numel"].items())
            sources = "<br>".join(s.replace("|", "\\|") for s in r["sources"])
            body = "<br>".join((c if len(c) <= 160 else c[:157] + "...").replace("|", "\\|") for c in r["computes"])
            feeds = f"<br>(origins include the args of prhs.{', prhs.'.join(r['feeds_op_args'])})" if r["feeds_op_args"] else ""
            lines.append(f"| {r['seq']} | {r['kind']} | `{name}` | {numel} | {'<br>'.join(r['buffers'])} | {body} | "
                         f"{', '.join(r['aten_ops'])} | {sources}{feeds} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma list from {', '.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list from {', '.join(BACKENDS)}")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers of the tiny model (>= 2)")
    parser.add_argument("--layer", type=int, default=None, help="the layer to inventory (default: a middle one)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=160, help="prompt tokens (> 128, cis.yaml's budget: sparse steps)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args(argv)
    configs, backends = args.configs.split(","), args.backends.split(",")
    for key, given, allowed in (("--configs", configs, CONFIGS), ("--backends", backends, BACKENDS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            parser.error(f"{key}: unknown {bad}; allowed: {', '.join(allowed)}")
    if args.layers < 2:
        parser.error("--layers: at least 2 (a layer's own launches are told from the step's by the layer index)")
    layer = args.layers // 2 if args.layer is None else args.layer
    if not 0 <= layer < args.layers:
        parser.error(f"--layer: {layer} is not a layer of 0..{args.layers - 1}")
    if {"cis", "ds"} & set(configs) and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        parser.error("cis and ds on the CPU need TRITON_INTERPRET=1 (the Triton decode ops run in the interpreter)")

    results, smaller = [], {}
    for backend in backends:
        for config in configs:
            print(f"{config} / {backend} ...", flush=True)
            results.append(compile_step(config, backend, args.layers, args.heads, args.kv_heads, args.batch, args.prompt))
            # the same with one layer less: launches per layer by difference, kernels fused across
            # neighbouring layers included (the per-layer attribution leaves those out)
            print(f"{config} / {backend}, {args.layers - 1} layers ...", flush=True)
            fewer = compile_step(config, backend, args.layers - 1, args.heads, args.kv_heads, args.batch, args.prompt)
            smaller[(config, backend)] = counts(fewer["launches"])
    summary = analyse(results, layer)
    for t in summary["table"]:
        less = smaller[(t["config"], t["backend"])]
        t["per_layer_by_difference"] = {k: t["per_step"][k] - less[k] for k in less}
    inventories = {f"{r['config']} / {r['backend']}": layer_inventory(r["launches"], layer) for r in results}
    meta = common.run_metadata(
        torch.device("cpu"), argv,
        model=f"tiny random Qwen2 (tests/tiny_models.py): {args.layers} layers, {args.heads} query / {args.kv_heads} KV "
              f"heads of 16, hidden 64, B {args.batch}, prompt {args.prompt}, fp32; cis = configs/cis.yaml with "
              f"{CIS_OVERRIDES}; dense = SDPA enable_gqa ({common.FAIR_ATTENTION!r}); generate() with a StaticCache, "
              "CompileConfig(fullgraph=True, mode='reduce-overhead')",
        caveat=CAVEAT, inventory_layer=layer,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_decode_kernels.json").write_text(json.dumps(
        {**meta, **summary, "inventories": inventories, "runs": [compact_run(r) for r in results]}, indent=1, default=str))
    text = markdown(meta, summary, inventories, layer)
    (out / "probe_decode_kernels.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
