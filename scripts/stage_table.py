#!/usr/bin/env python
"""A decode step, stage by stage, against its memory-bandwidth bound (issue 52, item 4).

Per cell (model, mode, batch, context, config): the measured ms per step of each stage (torch.profiler
over ``--steps`` decode steps, kernels grouped by ``bench_e2e_decode.py``'s families, the retrieval
split into its score and its select), the bytes the stage must move (from the shapes and the config,
through the policy's byte model, :meth:`prhs_hf.policy.CostModel.decode_bytes`, at the measured
retrieval share), the bound (those bytes at ``--bandwidth-gbs``, by default the GPU's: H100 3.35 TB/s,
H200 4.8 TB/s) and the fraction of it reached (bound / measured), per stage and for the whole step.

Stages (all layers of one decode step):

- ``linear layers``: the projections, MLP and LM head; must move every weight once;
- ``dense attention``: must move every key and value of the cache (a step the policy ran dense);
- ``score (K read)``: the retrieval's score kernels; the keys (or key index entries) of the
  retrieving KV groups (``kv_group_rho_hat`` of a telemetry run);
- ``top-k select``: the select's kernels; must write only the selected indices (latency-bound:
  its fraction says how far from a memory-bound stage it is);
- ``key index``: the index's write and its exact re-read of the candidates' keys;
- ``sparse attention + match + compose``: match, composition, anchor record and the sparse attention;
  the selected keys and values (the telemetry's processed KV per query head);
- ``glue``: inductor's fused kernels, aten copies and the rest; the new token's key and value;
- ``host gap``: the timed step minus all kernels (launches, Python, the loop's waits); nothing to move.

The timed ms/step (a run without the profiler) is the step's measure and the host gap's base; the
bound of the step is its bytes at the bandwidth. The context is the prompt plus half the profiled
steps. Every config runs in one decode loop (``--stop-check-every``, default the patched loop's
8; dense baselines patched with a dense config for it, as ``prhs-hf bench`` does). Writes
``<out-dir>/stage_table_<name>.json`` and ``.md``.

On the GPU (the real model, B32 × 30k, static)::

    python scripts/stage_table.py --model /tmp/prhs_gpu/ckpt-qwen2.5-coder-1.5b \\
        --prompts /tmp/data/coqa_validation.jsonl.gz --mode static --batch 32 --length 30k \\
        --configs sdpa_gqa,cis,cis-fp8 --prefill-chunk 4096 --name qwen1.5b_b32_30k

(``--prefill-chunk``: the unpatched model's whole-prompt prefill of B32 × 30k would hold about 53 GB
of MLP activation beside the 28 GB cache, past an H100's memory; the decode steps are the same.)

On a CPU (a tiny random llama; the numbers mean nothing, the code path is the GPU's)::

    python scripts/stage_table.py --model tiny-llama --mode eager --batch 2 --length 600 \\
        --configs sdpa_gqa,cis --bandwidth-gbs 50 --name cpu --out-dir /tmp/stage
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import transformers

import _bench_common as common
import bench_e2e_decode as e2e
import prhs_hf
from decode_bound import SCORE_KERNELS
from prhs_hf.config import MAX_STOP_CHECK_EVERY, GenerationLoopConfig
from prhs_hf.evaluation import speed_map as sm
from prhs_hf.policy import H200, DecodeShape

ROOT = Path(__file__).resolve().parents[1]
#: GPU name pattern -> memory bandwidth in GB/s (first match wins: the H100 variants before "H100")
BANDWIDTH_GBS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))
#: the retrieval's kernels that are its exact re-read (key index), not its select
RERANK_KERNELS = ("_rerank_kernel",)
#: the retrieval's kernels counted with the score: the compaction of the retrieving rows it reads
COMPACT_KERNELS = ("_compact_kernel",)
#: stage -> the kernel families of ``bench_e2e_decode.KERNEL_FAMILIES`` it sums (score, select and
#: key index take their share of the "retrieval" family by kernel name, in :func:`stage_ms`)
STAGE_FAMILIES = {
    "linear layers": ("linear (proj, MLP, head)",),
    "dense attention": ("dense attention",),
    "score (K read)": (),
    "top-k select": (),
    "key index": ("key index write",),
    "sparse attention + match + compose": ("sparse attention", "cis match", "composition", "anchor record"),
    "glue": ("inductor (fused glue)", "aten (copy, index, reduce)", "other kernels"),
}
STAGES = (*STAGE_FAMILIES, "host gap")


def bandwidth_gbs(device_name: str, given: Optional[float]) -> float:
    """``given``, else the bandwidth of the GPU called ``device_name`` (:data:`BANDWIDTH_GBS`)."""
    if given is not None:
        return given
    found = next((gbs for pattern, gbs in BANDWIDTH_GBS if pattern in device_name), None)
    if found is None:
        raise ValueError(f"--bandwidth-gbs: no bandwidth known for {device_name!r} (known: "
                         f"{', '.join(p for p, _ in BANDWIDTH_GBS)}); give it in GB/s")
    return found


def stage_ms(families: dict[str, float], kernels: dict[str, dict], ms_per_step: float) -> dict[str, float]:
    """Measured ms per step of each stage from ``bench_e2e_decode.step_breakdown``'s two dicts (GPU
    time by family; the pipeline's kernels one by one) and the timed step."""
    own = lambda names: sum(v["ms"] for k, v in kernels.items() if k.startswith(names))  # noqa: E731
    score, rerank = own(SCORE_KERNELS + COMPACT_KERNELS), own(RERANK_KERNELS)
    out = {stage: sum(families.get(f, 0.0) for f in names) for stage, names in STAGE_FAMILIES.items()}
    out["score (K read)"] = score
    out["top-k select"] = max(families.get("retrieval", 0.0) - score - rerank, 0.0)
    out["key index"] += rerank
    out["host gap"] = max(ms_per_step - families.get("all kernels", 0.0), 0.0)
    return out


def stage_bytes(shape: DecodeShape, layers: int, weight_bytes: int, sparse: bool,
                retrieval_share: Optional[float]) -> dict[str, float]:
    """The bytes each stage of one decode step must move: ``shape`` one layer's (the patch's
    :meth:`~prhs_hf.runtime.PrHSRuntime.decode_shape`, or the model's for a dense row), ``layers`` of
    them, ``weight_bytes`` of linear weights; ``sparse``: the step ran PrHS's path, its retrieval
    reading ``retrieval_share`` of the KV groups' keys."""
    moved = H200.decode_bytes(shape, retrieval_rate=retrieval_share or 0.0)
    kv_write = shape.batch * shape.kv_heads * 2 * shape.head_dim * shape.itemsize
    index_write = shape.batch * shape.kv_heads * (shape.scored_key_bytes or 0.0)
    per_layer = {
        "dense attention": 0.0 if sparse else moved.dense,
        "score (K read)": moved.scored if sparse else 0.0,
        "top-k select": (retrieval_share or 0.0) * shape.batch * shape.rows * shape.topk * 4 if sparse else 0.0,
        "key index": moved.reranked + index_write if sparse else 0.0,
        "sparse attention + match + compose": moved.gathered if sparse else 0.0,
        "glue": kv_write,
    }
    return {"linear layers": float(weight_bytes), **{k: layers * v for k, v in per_layer.items()}, "host gap": 0.0}


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of every ``nn.Linear`` weight and bias (the LM head's once, tied or not)."""
    seen = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in (module.weight, module.bias):
                if p is not None:
                    seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def table_rows(ms: dict[str, float], moved: dict[str, float], step_ms: float, gbs: float) -> dict[str, Any]:
    """Per stage and for the whole step: ms, bytes, bound ms at ``gbs`` GB/s and the fraction reached."""
    def entry(measured: float, nbytes: float) -> dict[str, Any]:
        bound = nbytes / (gbs * 1e6)  # GB/s = 1e6 bytes per ms
        return {"ms": round(measured, 4), "bytes": nbytes, "bound_ms": round(bound, 4),
                "fraction": round(bound / measured, 4) if measured > 0 else None}

    return {"stages": {s: entry(ms[s], moved[s]) for s in STAGES}, "step": entry(step_ms, sum(moved.values()))}


def measure(target: sm.Target, mode: str, batch: int, length: int, config: str, args: argparse.Namespace,
            gbs: float) -> dict[str, Any]:
    """One cell: warm-up, the timed run, the profiled steps and (a sparse step) a telemetry run."""
    model = target.model
    cfg = model.config.get_text_config()
    ids = target.ids(batch, length)
    sm._select(model, config, False, args.stop_check_every)
    cache = None
    if mode == "static":  # one cache for every run of the cell: one graph
        cache = transformers.StaticCache(config=model.config, max_cache_len=length + args.new_tokens)
        sm._fresh_compile(model)
    e2e.run_generate(model, ids, args.new_tokens, cache)  # warm-up: compilation, autotuning
    row = e2e.timed_runs(model, ids, args.new_tokens, cache, repeats=1)
    if prhs_hf.is_patched(model):
        prhs_hf.reset(model)
    families, kernels = e2e.step_breakdown(model, ids, args.steps, cache)
    runtime = getattr(model, prhs_hf.patching.RUNTIME_ATTRIBUTE, None)
    context = length + args.steps // 2
    sparse = runtime is not None and runtime.decodes_sparse()
    if runtime is not None:
        shape = runtime.decode_shape(batch, context, model.dtype)
    else:
        heads = cfg.num_attention_heads
        shape = DecodeShape(batch=batch, context=context, kv_heads=cfg.num_key_value_heads or heads, rows=heads,
                            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                            itemsize=model.dtype.itemsize, index_set=context)
    stats: dict[str, Any] = {}
    if sparse:  # the retrieval share and the sets' sizes of the same prompts, telemetry on, eager
        sm._select(model, config, True, args.stop_check_every)
        e2e.run_generate(model, ids, args.new_tokens, cache, compiled=False)
        stats = e2e.telemetry_row(model)
        if stats.get("processed_kv") is not None:
            shape = dataclasses.replace(shape, index_set=round(stats["processed_kv"]))
    moved = stage_bytes(shape, cfg.num_hidden_layers, linear_weight_bytes(model), sparse,
                        stats.get("kv_group_rho_hat") or stats.get("rho_hat"))
    return {"ms_per_step": row["ms_per_step"], "decode_steps": "sparse" if sparse else "dense", **stats,
            **table_rows(stage_ms(families, kernels, row["ms_per_step"]), moved, row["ms_per_step"], gbs),
            "breakdown_ms_per_step": families, "pipeline_kernels_per_step": kernels}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A table per cell: each config's stages, then its whole step."""
    lines = [f"On {meta['gpu']} ({meta['bandwidth_gbs']:g} GB/s), {meta['date']}, commit {meta['git_commit']}:", "",
             f"    {meta['command']}", "",
             "ms: measured per decode step (torch.profiler; host gap and step: the timed run); MB: what the stage "
             "must move; bound: MB at the bandwidth; reached: bound / ms.", ""]
    cells = list(dict.fromkeys((r["model"], r["mode"], r["batch"], r["length"]) for r in rows))
    for model, mode, batch, length in cells:
        lines += [f"{model}, {mode}, B{batch} × {length}, loop {meta['stop_check_every']}:", "",
                  "| config | stage | ms | MB | bound ms | reached |", "|---|---|---|---|---|---|"]
        for r in (r for r in rows if (r["model"], r["mode"], r["batch"], r["length"]) == (model, mode, batch, length)):
            if "error" in r:
                lines.append(f"| {r['config']} | error: {r['error'][:120]} | | | | |")
                continue
            for stage, e in [*r["stages"].items(), (f"**step** ({r['decode_steps']})", r["step"])]:
                reached = "–" if e["fraction"] is None else f"{100 * e['fraction']:.0f} %"
                lines.append(f"| {r['config']} | {stage} | {e['ms']:.3f} | {e['bytes'] / 1e6:.4g} | "
                             f"{e['bound_ms']:.3f} | {reached} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=f"a checkpoint folder or a random shape ({', '.join(sm.SHAPES)})")
    ap.add_argument("--prompts", default=None,
                    help="with a checkpoint: real text, .jsonl/.jsonl.gz (default: random ids)")
    ap.add_argument("--layers", type=int, default=None, help="cut a random shape to N layers")
    ap.add_argument("--mode", default="static", help="comma list: eager and/or static (default %(default)s)")
    ap.add_argument("--batch", default="32", help="comma list of B (default %(default)s)")
    ap.add_argument("--length", default="30k", help="comma list of prompt lengths, 4096 or 4k (default %(default)s)")
    ap.add_argument("--configs", default="sdpa_gqa,cis", help="comma list, as prhs-hf bench's (default %(default)s)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens of the timed run (default %(default)s)")
    ap.add_argument("--stop-check-every", type=int, default=GenerationLoopConfig.stop_check_every,
                    help="the decode loop of every config (default %(default)s, the patched loop's)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill in chunks of this many tokens (generate's prefill_chunk_size): long prompts fit")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help=f"memory bandwidth in GB/s (default: the GPU's, {dict(BANDWIDTH_GBS)})")
    ap.add_argument("--name", required=True, help="the files are <out-dir>/stage_table_<name>.json and .md")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args(argv)
    try:
        args.batch_list = sm.parse_lengths(args.batch, "--batch")
        args.length_list = sm.parse_lengths(args.length, "--length")
    except ValueError as exc:
        ap.error(str(exc))
    modes = [m for m in args.mode.split(",") if m]
    if not modes or set(modes) - {"eager", "static"}:
        ap.error(f"--mode: {args.mode!r}; allowed: eager, static")
    if not 1 <= args.steps <= args.new_tokens - 2:
        ap.error(f"--steps must be in [1, --new-tokens - 2 = {args.new_tokens - 2}], got {args.steps}")
    if args.model not in sm.SHAPES and not (Path(args.model).expanduser() / "config.json").is_file():
        ap.error(f"--model: {args.model!r} is neither a shape of {', '.join(sm.SHAPES)} nor a checkpoint folder")
    if args.model in sm.SHAPES and args.prompts:
        ap.error("--prompts needs a checkpoint folder as --model (random shapes run on random ids)")
    if not 1 <= args.stop_check_every <= MAX_STOP_CHECK_EVERY:
        ap.error(f"--stop-check-every must be in [1, {MAX_STOP_CHECK_EVERY}], got {args.stop_check_every}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        ap.error(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    configs = [c for c in args.configs.split(",") if c]
    from prhs_hf.evaluation.accuracy.configs import load_any_config

    for name in configs:
        if name not in sm.DENSE_CONFIGS:
            load_any_config(*sm.prhs_config(name))  # a wrong name fails now, not after the first cells
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        gbs = bandwidth_gbs(common.device_name(device), args.bandwidth_gbs)
    except ValueError as exc:
        ap.error(str(exc))
    args.n2 = args.new_tokens  # what speed_map.load_target sizes the positions by
    target = sm.load_target(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    target.model.generation_config.prefill_chunk_size = args.prefill_chunk  # every generate() of the cells
    meta = common.run_metadata(device, argv, bandwidth_gbs=gbs, stop_check_every=args.stop_check_every,
                               steps=args.steps, new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                               stages=list(STAGES))
    out = args.out_dir / f"stage_table_{args.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for mode, batch, length, config, _ in sm.plan_cells(args.batch_list, args.length_list, modes, configs):
        row: dict[str, Any] = {"model": target.name, "weights": target.weights, "prompts": target.prompts,
                               "mode": mode, "batch": batch, "length": length, "config": config}
        print(f"{mode} B{batch} L{length} {config}", flush=True)
        try:
            row.update(measure(target, mode, batch, length, config, args, gbs))
        except Exception as exc:  # noqa: BLE001 - a failing cell is recorded, the table goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        prhs_hf.unpatch(target.model)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    text = markdown(meta, rows)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"wrote {out}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
