"""Probe: the host cost of one eager decode step of a patched model, on a model whose compute is negligible.

The llama3-8b layer count and head layout (32 layers, 32 query / 8 KV heads of 128) with a tiny
hidden size and a short prompt: what a decode step costs here is Python and the dispatch of each
PyTorch op (on a GPU: a launch), the part of an eager step that does not shrink with the context.
For each variant (the unpatched model with ``sdpa`` or ``sdpa_gqa``, PrHS configs with the policy
forced, ``NAME/dense`` or ``NAME/sparse`` as in the speed map):

- ``ms_per_step`` (median of ``--repeats`` runs of ``--steps`` forwards) and ``us_per_layer``;
- ``ops_per_step`` / ``ops_per_layer``: the PyTorch ops the profiler sees at the top level of one
  step (``launching``: those that are not views or metadata, which launch work on a GPU);
- ``host_us_by_part``: cProfile's own time per step, split by where it is spent (geometry, policy,
  hooks, the forward lock, the CallState swap, telemetry, the selector, PrHS's layer, kernels'
  launchers, PyTorch ops, transformers, other).

    python scripts/probe_eager_host.py --out docs/results/probe_eager_host.json
    python scripts/probe_eager_host.py --configs sdpa_gqa,cis/dense --extra '{"backend": {"eager_graphs": true}}'
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time
from pathlib import Path

import torch
import transformers

import prhs_hf
from prhs_hf.evaluation import speed_map as sm

DEFAULT_CONFIGS = "sdpa,sdpa_gqa,cis/dense,cis_longbench/dense,cis/sparse,cis/sparse+buffered"
#: ops that launch no work on a GPU (views, metadata, allocation)
NON_LAUNCHING = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::slice", "aten::select", "aten::transpose",
    "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::t", "aten::alias", "aten::permute",
    "aten::detach", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::unbind",
    "aten::split", "aten::chunk", "aten::narrow", "aten::flatten", "aten::view_as", "aten::expand_as",
    "aten::resolve_conj", "aten::resolve_neg", "aten::contiguous", "aten::to", "aten::result_type",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::numel", "aten::size", "aten::stride",
}

#: (part, test on (file, function)) in order: the first that matches names the part
PARTS = (
    ("geometry", lambda f, n: f.endswith("prhs_hf/geometry.py") or n in ("_store_geometry", "geometry_on")),
    ("policy", lambda f, n: f.endswith("prhs_hf/policy.py") or n == "_decide"),
    ("callstate_swap", lambda f, n: n in ("_bind", "export_call_state", "import_call_state", "_holders")
     or f.endswith("copy.py")),
    ("forward_lock", lambda f, n: n in ("acquire", "release") and "patching" in f),
    ("hooks", lambda f, n: f.endswith("prhs_hf/patching.py") or n in ("begin_forward", "_cached_tokens", "_check_room")),
    ("telemetry", lambda f, n: f.endswith("telemetry_counters.py") or n == "record_dense_decode"),
    ("selector", lambda f, n: "/prhs_hf/selectors/" in f or f.endswith("prhs_hf/decode.py")),
    ("kernels", lambda f, n: "/prhs_hf/ops/" in f),
    ("prhs_layer", lambda f, n: "/prhs_hf/" in f),
    ("pytorch_ops", lambda f, n: f == "~" and ("torch" in n or "Tensor" in n or "built-in" in n)),
    ("transformers", lambda f, n: "/transformers/" in f),
    ("torch_python", lambda f, n: "/torch/" in f),
)


def build_model(layers: int, hidden: int, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """The llama3-8b head layout with ``layers`` layers and a tiny hidden size, random weights, SDPA."""
    shape = dict(sm.SHAPES[sm.RANDOM_SHAPE], num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden,
                 vocab_size=256)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=65536, pad_token_id=0,
                                      eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def select(model, name: str, extra: dict | None) -> None:
    """The variant ``name`` (speed map syntax), with ``extra`` config overrides on PrHS variants."""
    sm._select(model, name, telemetry=False)
    if extra and prhs_hf.is_patched(model):
        from prhs_hf.evaluation.accuracy.configs import load_any_config

        prhs_hf.unpatch(model)
        prhs_hf.patch(model, prhs_hf.load_config(load_any_config(*sm.prhs_config(name)), extra))


def _prefill(model, batch: int, length: int):
    ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(0))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1), torch.ones(batch, length, dtype=torch.long)


def _steps(model, cache, token, mask, steps: int):
    with torch.no_grad():
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(token, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
    return token, mask


def time_steps(model, batch: int, length: int, steps: int, repeats: int) -> float:
    """Median ms per decode forward over ``repeats`` runs of ``steps`` (after a prefill and 2 warm-up steps)."""
    runs = []
    for _ in range(repeats):
        cache, token, mask = _prefill(model, batch, length)
        token, mask = _steps(model, cache, token, mask, 2)
        t0 = time.perf_counter()
        _steps(model, cache, token, mask, steps)
        runs.append(1000 * (time.perf_counter() - t0) / steps)
    return statistics.median(runs)


def count_ops(model, batch: int, length: int) -> dict:
    """Top-level PyTorch ops of one decode step (all, and those that launch work)."""
    cache, token, mask = _prefill(model, batch, length)
    token, mask = _steps(model, cache, token, mask, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _steps(model, cache, token, mask, 1)
    names: dict[str, int] = {}
    for event in prof.events():
        if event.cpu_parent is None and event.name.startswith("aten::"):
            names[event.name] = names.get(event.name, 0) + 1
    launching = {k: v for k, v in names.items() if k not in NON_LAUNCHING}
    return {"ops_per_step": sum(names.values()), "launching_ops_per_step": sum(launching.values()),
            "launching_ops": dict(sorted(launching.items(), key=lambda kv: -kv[1]))}


def attribute(model, batch: int, length: int, steps: int) -> dict:
    """cProfile's own time per decode step, by part (see :data:`PARTS`), and the top functions."""
    cache, token, mask = _prefill(model, batch, length)
    token, mask = _steps(model, cache, token, mask, 2)
    profiler = cProfile.Profile()
    profiler.enable()
    _steps(model, cache, token, mask, steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    parts: dict[str, float] = {}
    top = []
    for (file, _, func), (_, calls, own, _, _) in stats.items():
        part = next((p for p, test in PARTS if test(file, func)), "other")
        parts[part] = parts.get(part, 0.0) + own
        top.append((own, calls, f"{Path(file).name}:{func}"))
    top.sort(reverse=True)
    per_step = {p: round(1e6 * s / steps, 1) for p, s in sorted(parts.items(), key=lambda kv: -kv[1])}
    return {"host_us_by_part": per_step,
            "top_functions": [{"function": f, "calls_per_step": round(c / steps, 1), "own_us_per_step": round(1e6 * o / steps, 1)}
                              for o, c, f in top[:25]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=512, help="prompt tokens (short: the compute stays negligible)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--extra", default=None, help="JSON config overrides for every PrHS variant")
    p.add_argument("--before", default=None, help="a JSON of this probe at an earlier commit, kept under 'before'")
    p.add_argument("--out", default="docs/results/probe_eager_host.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.layers, args.hidden, torch.float32)
    extra = json.loads(args.extra) if args.extra else None
    rows = []
    for name in args.configs.split(","):
        select(model, name, extra)
        ms = time_steps(model, args.batch, args.length, args.steps, args.repeats)
        row = {"config": name, "ms_per_step": round(ms, 3), "us_per_layer": round(1000 * ms / args.layers, 1)}
        ops = count_ops(model, args.batch, args.length)
        row.update(ops_per_layer=round(ops["ops_per_step"] / args.layers, 2),
                   launching_ops_per_layer=round(ops["launching_ops_per_step"] / args.layers, 2), **ops)
        row.update(attribute(model, args.batch, args.length, args.steps))
        prhs_hf.unpatch(model)
        print(f"{name:<24} {row['ms_per_step']:8.3f} ms/step {row['us_per_layer']:7.1f} us/layer "
              f"{row['ops_per_step']:5d} ops/step ({row['launching_ops_per_step']} launching)", flush=True)
        rows.append(row)
    base = {r["config"]: r["ms_per_step"] for r in rows}
    ref = base.get("sdpa_gqa")
    for r in rows:
        if ref:
            r["extra_us_per_layer_vs_sdpa_gqa"] = round(1000 * (r["ms_per_step"] - ref) / args.layers, 1)
    result = {"args": vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
              "machine": platform.processor() or platform.machine(), "rows": rows}
    if args.before:
        result["before"] = json.loads(Path(args.before).read_text())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
