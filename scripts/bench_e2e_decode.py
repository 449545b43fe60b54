"""End-to-end decode throughput with generate(): fair dense vs PrHS, eager vs static cache + compile.

Random-weight models in bf16 (LLaMA-2-7B shape, MHA; one GQA shape), a random prompt, then
``--new-tokens`` greedy tokens through ``model.generate``. Decode tokens/s is measured between
the first and the last decode step by a logits processor that synchronises and reads the clock
(so prefill is excluded and reported apart). Static + compiled runs use
``cache_implementation="static"`` (transformers 5.17 then compiles the decode forward by itself);
a warm-up generate() call of the same shape runs first so compilation is not timed.

Two dense configs, run side by side: ``dense`` is transformers' SDPA path as shipped (with the
mask a static cache needs and GQA it ``repeat_kv``-copies K/V to every query head in every
layer: "dense (transformers sdpa, repeat_kv)"); ``dense-gqa`` runs the same model through
``_bench_common.fair_sdpa_attention`` (registered with transformers' AttentionInterface as
``sdpa_gqa``: SDPA with ``enable_gqa=True`` and the mask). Every row's ``speedup_vs_fastest_dense``
is against the faster of the dense rows of its case and mode, named in ``fastest_dense``.
FlashInfer is not an end-to-end config (its decode plans on the host, outside a compiled graph);
bench_decode_attention.py times it per layer.

    python scripts/bench_e2e_decode.py                   # the full table (H200: several minutes)
    python scripts/bench_e2e_decode.py --quick           # a tiny model on whatever device is here
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch
import transformers
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import _bench_common as common
import prhs_hf

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}

# (shape, batch, prompt length)
CASES = [("llama2-7b", 8, 16384), ("llama2-7b", 16, 4096), ("llama2-7b", 16, 8192), ("llama3-8b", 16, 16384)]
QUICK_CASES = [("tiny", 2, 512)]

#: dense configs: the attention implementation the unpatched model runs with
DENSE_CONFIGS = {"dense": "sdpa", "dense-gqa": common.FAIR_ATTENTION}

CONFIGS = {
    "dense": None,
    "dense-gqa": None,
    "cis-s8": {"cis": {"block_size": 8}, "psaw": {"enabled": False}, "etf": {"enabled": False}},
    "cis-s16": {"cis": {"block_size": 16}, "psaw": {"enabled": False}, "etf": {"enabled": False}},
    "cpe-s16": {"cis": {"block_size": 16}},
    # Random weights give unrelated consecutive queries, so tau = 0.8 almost never shares
    # (rho-hat near 100 %). tau = -1 shares whenever the block has an anchor: rho-hat = 1/s,
    # the regime of real models (paper: 6-17 % at s = 16). Reported apart, and labelled.
    "cis-s8-share": {"cis": {"block_size": 8, "tau": -1.0}, "psaw": {"enabled": False}, "etf": {"enabled": False}},
    "cis-s16-share": {"cis": {"block_size": 16, "tau": -1.0}, "psaw": {"enabled": False}, "etf": {"enabled": False}},
    "cpe-s16-share": {"cis": {"block_size": 16, "tau": -1.0}},
}
BASE = ROOT / "configs" / "cpe.yaml"


class StepClock(transformers.LogitsProcessor):
    """Times the decode steps of one generate() call of ``new_tokens`` tokens.

    Called once per generated token, after that token's forward. It synchronises only at the
    first call (the prefill's token) and at the last, so the host may run ahead of the GPU in
    between as it does without the clock; the decode time is the span between the two.
    """

    def __init__(self, device: torch.device, new_tokens: int):
        self.device = device
        self.last = new_tokens - 1
        self.calls = 0
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if self.calls in (0, self.last):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stamps.append(time.perf_counter())
        self.calls += 1
        return scores


class ProfileWindow(transformers.LogitsProcessor):
    """Runs ``profiler`` over decode steps ``1 .. steps`` of a generate() call (prefill left out)."""

    def __init__(self, profiler, steps: int, device: torch.device):
        self.profiler, self.steps, self.device = profiler, steps, device
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, input_ids, scores):
        if self.calls in (0, self.steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.calls == 0:
                self.profiler.start()
                self.seconds = -time.perf_counter()
            else:
                self.seconds += time.perf_counter()
                self.profiler.stop()
        self.calls += 1
        return scores


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=32768, eos_token_id=None,
                                      bos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


#: how the static mode compiles: transformers' default (inductor, CUDA graphs) with fullgraph=True,
#: so a graph break in the decode step fails the cell instead of silently running at eager speed
COMPILE_CONFIG = CompileConfig(fullgraph=True, mode="reduce-overhead")


class CudagraphSkips(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." messages (the cudagraphs log artifact):
    a compiled step that skipped CUDA graphs launches every kernel from Python, at near-eager speed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        torch._logging.set_logs(cudagraphs=True)
        logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "skipping cudagraphs" in record.getMessage():
            self.messages.append(record.getMessage()[:300])


def select_config(model, name: str) -> None:
    """Put ``model`` in config ``name``: a dense attention implementation or a PrHS patch."""
    prhs_hf.unpatch(model)
    if name in DENSE_CONFIGS:
        impl = DENSE_CONFIGS[name]
        model.set_attn_implementation(common.register_fair_attention() if impl == common.FAIR_ATTENTION else impl)
        return
    model.set_attn_implementation("sdpa")
    prhs_hf.patch(model, BASE, overrides={**CONFIGS[name], "telemetry": {"enabled": True}})


def run_generate(model, ids, new_tokens: int, static_cache=None, extra_processor=None):
    """One generate() call; ``static_cache`` (reset here) makes it a static-cache, compiled run."""
    clock = StepClock(ids.device, new_tokens)
    processors = [clock] if extra_processor is None else [clock, extra_processor]
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  logits_processor=transformers.LogitsProcessorList(processors), attention_mask=torch.ones_like(ids))
    if static_cache is not None:
        static_cache.reset()
        kwargs["past_key_values"] = static_cache
        kwargs["compile_config"] = COMPILE_CONFIG
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    end = time.perf_counter()
    stamps = clock.stamps
    steps = new_tokens - 1  # decode forwards between the first and the last logits
    decode_s = stamps[-1] - stamps[0]
    peak = torch.cuda.max_memory_allocated() / 2**30 if ids.device.type == "cuda" else float("nan")
    return {
        "tokens": int(out.shape[1] - ids.shape[1]),
        "prefill_s": stamps[0] - start,
        "decode_s": decode_s,
        "decode_tok_s": ids.shape[0] * steps / decode_s,
        "ms_per_step": 1000 * decode_s / steps,
        "total_s": end - start,
        "peak_gib": peak,
    }


#: kernel-name patterns -> family, first match wins (our Triton kernels, then cuBLAS/attention/rest)
KERNEL_FAMILIES = (
    ("cis match", ("_cis_match_kernel",)),
    ("retrieval", ("_compact_rows_kernel", "_score_kernel", "_select_kernel")),
    ("composition", ("_dilated_set_kernel", "_compose_sets_kernel", "_compose_kernel")),
    ("sparse attention", ("_sparse_attn_kernel", "_combine_kernel")),
    ("dense attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("linear (proj, MLP, head)", ("gemm", "gemv", "nvjet", "sm90_", "sm80_", "cutlass", "xmma", "cublas", "splitk")),
)


def _family(kernel: str) -> str:
    name = kernel.lower()
    for family, patterns in KERNEL_FAMILIES:
        if any(p.lower() in name for p in patterns):
            return family
    return "other kernels"


def step_breakdown(model, ids, steps: int, static_cache=None, trace: Path | None = None) -> dict:
    """Per decode step: GPU kernel time by family (torch.profiler, kernels of CUDA graphs included)
    and the rest of the step's wall time (launches, Python, idle GPU).

    The profiler runs over decode steps 1..``steps`` only (a logits processor starts and stops it),
    so the prefill's kernels are not in the window. Profiling slows the host side a little.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    prof = profile(activities=activities)
    window = ProfileWindow(prof, steps, ids.device)
    run_generate(model, ids, steps + 2, static_cache, extra_processor=window)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    fam: dict[str, float] = {}
    kernels, first, last = 0, float("inf"), 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0:
            fam[_family(evt.name)] = fam.get(_family(evt.name), 0.0) + evt.device_time_total / 1000.0 / steps
            kernels += 1
            first, last = min(first, evt.time_range.start), max(last, evt.time_range.end)
    out = {k: round(v, 3) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])}
    gpu = sum(out.values())
    step_ms = 1000.0 * window.seconds / steps
    out["all kernels"] = round(gpu, 3)
    out["step (profiled)"] = round(step_ms, 3)
    out["not kernels (launch, Python, idle)"] = round(max(step_ms - gpu, 0.0), 3)
    # the GPU's idle time between its first and last kernel: gaps between kernels and between steps
    out["idle inside the kernel span"] = round(max((last - first) / 1000.0 / steps - gpu, 0.0), 3) if kernels else 0.0
    out["kernels per step"] = round(kernels / steps, 1)
    return out


def _cudagraphs(row: dict) -> str:
    if "cudagraph_skips" not in row:
        return "not checked"
    return "skipped" if row["cudagraph_skips"] else "on"


def add_speedups(rows: list[dict]) -> None:
    """Each measured row against the fastest dense row (most decode tok/s) of its case and mode.

    Sets ``fastest_dense`` (its config name), ``speedup_vs_fastest_dense``, ``peak_vs_fastest_dense``
    and, for the record, ``speedup_vs_dense_transformers`` (against ``dense``, transformers' path).
    """
    def case(r):
        return r["shape"], r["batch"], r["prompt"], r["mode"]

    for row in rows:
        for key in ("fastest_dense", "speedup_vs_fastest_dense", "peak_vs_fastest_dense", "speedup_vs_dense_transformers"):
            row.pop(key, None)
        if "decode_tok_s" not in row:
            continue
        dense = {r["config"]: r for r in rows if r["config"] in DENSE_CONFIGS and case(r) == case(row) and "decode_tok_s" in r}
        if not dense:
            continue
        name = max(dense, key=lambda c: dense[c]["decode_tok_s"])
        ref = dense[name]
        row["fastest_dense"] = name
        row["speedup_vs_fastest_dense"] = row["decode_tok_s"] / ref["decode_tok_s"]
        row["peak_vs_fastest_dense"] = row["peak_gib"] / ref["peak_gib"] if ref["peak_gib"] == ref["peak_gib"] else None
        if "dense" in dense:
            row["speedup_vs_dense_transformers"] = row["decode_tok_s"] / dense["dense"]["decode_tok_s"]


def write_results(rows, args, argv, device, new_tokens) -> None:
    """Speedups against the fastest dense row of the same case and mode, then the table and the JSON (after every row)."""
    add_speedups(rows)
    header = ("| shape | B | prompt | mode | config | decode tok/s | ms/step | speedup vs fastest dense (which) "
              "| vs dense (transformers) | prefill s | peak GiB | ρ̂ | processed KV / dense KV |")
    lines = [header, "|" + "---|" * 13]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['prompt']} | {r['mode']} | {r['config']} | error: {r['error'][:80]} ||||||||")
            continue
        rho = f"{100 * r['rho_hat']:.1f}%" if r.get("rho_hat") is not None else "–"
        kv = f"{r['processed_kv']:.0f} / {r['dense_kv']:.0f}" if "processed_kv" in r else "–"
        sp = f"{r['speedup_vs_fastest_dense']:.2f}× ({r['fastest_dense']})" if "speedup_vs_fastest_dense" in r else "–"
        spt = f"{r['speedup_vs_dense_transformers']:.2f}×" if "speedup_vs_dense_transformers" in r else "–"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['prompt']} | {r['mode']} | {r['config']} | {r['decode_tok_s']:.1f} | "
                     f"{r['ms_per_step']:.2f} | {sp} | {spt} | {r['prefill_s']:.2f} | {r['peak_gib']:.1f} | {rho} | {kv} |")
    breakdowns = [r for r in rows if "breakdown_ms_per_step" in r]
    if breakdowns:
        families = list(dict.fromkeys(k for r in breakdowns for k in r["breakdown_ms_per_step"]))
        lines += ["", "Per decode step, ms (torch.profiler; GPU time by kernel family, then the rest):", "",
                  "| shape | B | prompt | mode | config | " + " | ".join(families) + " |", "|" + "---|" * (5 + len(families))]
        for r in breakdowns:
            b = r["breakdown_ms_per_step"]
            lines.append(f"| {r['shape']} | {r['batch']} | {r['prompt']} | {r['mode']} | {r['config']} | "
                         + " | ".join(f"{b[k]:.2f}" if k in b else "–" for k in families) + " |")
    compiled = [r for r in rows if "compiled_graphs" in r]
    if compiled:
        lines += ["", "Static mode, what was compiled (fullgraph=True, reduce-overhead): "
                  + "; ".join(f"{r['config']} B{r['batch']} L{r['prompt']}: {r['compiled_graphs']} graph(s), "
                              f"{r['graph_breaks']} break(s), CUDA graphs "
                              f"{_cudagraphs(r)}, warm-up {r['warmup_s']:.0f} s"
                              for r in compiled)]
    table = "\n".join(lines)
    meta = common.run_metadata(
        device, argv,
        commands=None,  # every command whose rows are here (--resume), filled in below
        new_tokens=new_tokens,
        dense_configs={"dense": common.DENSE_LABELS["transformers"], "dense-gqa": common.DENSE_LABELS["sdpa_gqa"]
                       + f" (attention function {common.FAIR_ATTENTION!r})"},
        speedups="against the fastest dense config of the same case and mode (fastest_dense)",
        flashinfer_e2e="not an end-to-end config: its decode plans on the host, outside the compiled graph; "
                       "see bench_decode_attention.py",
        compiled="static mode: transformers' generate() compiles the decode forward itself (StaticCache), "
                 "here with CompileConfig(fullgraph=True, mode='reduce-overhead'): inductor + CUDA graphs; "
                 "a fresh compilation per cell, in its warm-up generate() (warmup_s)",
    )
    meta["commands"] = [*getattr(args, "earlier_commands", []), meta["command"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_e2e_decode.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    commands = "\n".join(f"    {c}" for c in meta["commands"])
    (out / "bench_e2e_decode.md").write_text(
        f"On {meta['gpu']}, {meta['date']}, commit {meta['git_commit']}:\n\n{commands}\n\n{table}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, a few tokens")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--cases", default=None, help="comma list of shape:batch:prompt, e.g. llama2-7b:8:16384")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {list(CONFIGS)}")
    parser.add_argument("--modes", default="eager,static", help="eager (DynamicCache) and/or static (StaticCache + compile)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="also profile this many decode steps per cell: GPU time by kernel family, and overhead")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--trace-dir", default=None, help="with --profile-steps: write each cell's Chrome trace here")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of an existing OUT/bench_e2e_decode.json and run only the missing cells")
    args = parser.parse_args(argv)
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = [(s, int(b), int(l)) for s, b, l in (c.split(":") for c in args.cases.split(","))]
    new_tokens = 8 if args.quick and args.new_tokens == 256 else args.new_tokens
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; allowed: {', '.join(CONFIGS)}")
    modes = args.modes.split(",")
    rows = []
    previous = Path(args.out) / "bench_e2e_decode.json"
    if args.resume and previous.is_file():
        earlier = json.loads(previous.read_text())
        rows = [r for r in earlier["rows"] if "error" not in r]
        args.earlier_commands = earlier.get("commands", [earlier["command"]])
    done = {(r["shape"], r["batch"], r["prompt"], r["mode"], r["config"]) for r in rows}
    plan = [(c, m, cfg) for c in cases for m in modes for cfg in configs if (*c, m, cfg) not in done]
    skips = CudagraphSkips()
    model_key, model = None, None
    for (shape, batch, length), mode, name in common.progress(plan, "e2e decode"):
        print(f"\n{shape} B{batch} L{length} {mode} {name}", flush=True)
        if model_key != shape:
            model = None
            torch.cuda.empty_cache() if device.type == "cuda" else None
            model, model_key = build_model(shape, device, dtype), shape
        select_config(model, name)
        ids = torch.randint(1, SHAPES[shape]["vocab_size"], (batch, length), device=device)
        row = {"shape": shape, "batch": batch, "prompt": length, "mode": mode, "config": name}
        cache = None
        try:
            if mode == "static":
                # one cache for the warm-up and the timed run: the same shapes, so nothing recompiles;
                # a fresh compilation per cell (the compiled forward is cached on the model)
                cache = transformers.StaticCache(config=model.config, max_cache_len=length + new_tokens)
                torch._dynamo.reset()
                model.__dict__.pop("_compiled_call", None)
            counters.clear()
            skips.messages.clear()
            start = time.perf_counter()
            run_generate(model, ids, min(new_tokens, 16), cache)  # warm-up: compile, autotune, allocator
            row["warmup_s"] = time.perf_counter() - start
            if prhs_hf.is_patched(model):
                prhs_hf.reset(model)
            row.update(run_generate(model, ids, new_tokens, cache))
            if mode == "static":
                # what was compiled: graphs captured, graph breaks, and whether the timed run recompiled
                row["compiled_graphs"] = counters["stats"].get("unique_graphs", 0)
                row["graph_breaks"] = sum(counters["graph_break"].values())
                row["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0)
                if skips.messages:
                    row["cudagraph_skip_reasons"] = sorted(set(skips.messages))
            if prhs_hf.is_patched(model):
                report = prhs_hf.telemetry(model)
                row["rho_hat"] = report.retrieval_ratio
                row["processed_kv"] = report.processed_kv_per_step
                row["dense_kv"] = report.dense_kv_per_step
            if args.profile_steps:  # after the timed run's telemetry was read
                if prhs_hf.is_patched(model):
                    prhs_hf.reset(model)
                trace = Path(args.trace_dir) / f"{shape}-B{batch}-L{length}-{mode}-{name}.json" if args.trace_dir else None
                row["breakdown_ms_per_step"] = step_breakdown(model, ids, args.profile_steps, cache, trace)
        except Exception as exc:  # a failing cell is reported, the table goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        write_results(rows, args, argv, device, new_tokens)  # a run cut short still leaves its rows
        del ids, cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    prhs_hf.unpatch(model)

    write_results(rows, args, argv, device, new_tokens)
    print((Path(args.out) / "bench_e2e_decode.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
