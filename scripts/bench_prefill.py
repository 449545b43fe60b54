#!/usr/bin/env python
"""Benchmark of the sparse PSAW/ETF prefill (SPEC §2-§3) on LLaMA-2-7B shapes.

(a) attention operator per layer depth ``u`` (0, 0.5, 1) at 4k/16k/32k tokens with PSAW, ETF and
    both (paper defaults: sink 8, phi 0.7, alpha 1, psi 0.5, gamma 1; 32 heads, d 128, bf16,
    batch 1): dense SDPA (flash backend), flash-attn (if importable), FlexAttention with the same
    BlockMask (compiled, mask construction not timed) and our Triton kernel; the visible fraction
    of query-key pairs, ``ours / (dense x visible)`` (target <= 1.15) and ``flex / ours``.
(b) whole-model prefill of a randomly initialised LLaMA-2-7B-shaped model (bf16, 32 layers,
    hidden 4096) at 8k/16k/32k: dense SDPA (the unpatched model), dense FA4 (registered as the
    model's attention, where FlashAttention-4 runs), and ``prhs_hf.patch(model, configs/cpe.yaml)``
    with ``backend.prefill: auto`` (FA4 where it runs, else Triton) and, beside it where auto is
    FA4, ``triton``; time, peak memory and speedups against SDPA and against the fastest dense row.
(c) the analytic bound dense FLOPs / CPE FLOPs of the whole model from the schedules (visible
    attention pairs per layer, plus the q_proj/o_proj/MLP rows that ETF skips).

Prints markdown tables and writes ``<out>.json`` and ``<out>.md`` (default
``docs/results/bench_prefill``). ``--quick`` runs tiny shapes: on a CPU with
``TRITON_INTERPRET=1`` it smoke-tests every code path (GPU-only columns are n/a).

    python scripts/bench_prefill.py            # on the GPU, about 3-4 minutes
    TRITON_INTERPRET=1 python scripts/bench_prefill.py --quick --out /tmp/bench_prefill
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import _bench_common as common

REPO = Path(__file__).resolve().parents[1]


try:  # an installed prhs_hf, else this checkout's
    import prhs_hf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))
from prhs_hf import schedules as sched  # noqa: E402
from prhs_hf.ops.prefill.prefill_attention import prefill_attention  # noqa: E402
from prhs_hf.ops.prefill.prefill_plan import PrefillPlan  # noqa: E402

SINK, PHI, ALPHA, PSI, GAMMA = 8, 0.7, 1.0, 0.5, 1.0  # paper defaults (configs/cpe.yaml)


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the benchmarked model (LLaMA-2-7B by default)."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    intermediate: int = 11008
    vocab: int = 32000


@dataclass(frozen=True)
class Schedule:
    """PSAW/ETF parameters (SPEC §1); ``start_layer`` None means floor(N / 2)."""

    sink: int = SINK
    phi: float = PHI
    alpha: float = ALPHA
    psi: float = PSI
    gamma: float = GAMMA
    psaw_start: int | None = None
    etf_start: int | None = None
    psaw_prefill: bool = True
    etf: bool = True

    def starts(self, n_layers: int) -> tuple[int, int]:
        d = sched.default_start_layer(n_layers)
        return (d if self.psaw_start is None else self.psaw_start, d if self.etf_start is None else self.etf_start)


@dataclass
class Report:
    """Everything the run measured, written as JSON and markdown."""

    command: str
    device: str
    versions: dict[str, str]
    date: str
    git_commit: str
    quick: bool
    dtype: str
    operator: list[dict[str, Any]] = field(default_factory=list)
    model: list[dict[str, Any]] = field(default_factory=list)
    bound: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- utilities


def time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median ms of one operator call (``_bench_common.median_ms``: do_bench on CUDA, perf_counter on the CPU)."""
    return common.median_ms(fn, device).ms


def _attempt(report: Report, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on failure note the error (and free GPU memory) and return None."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark keeps going
        msg = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        report.notes.append(msg)
        print(f"  [n/a] {msg}", flush=True)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _raise_dynamo_limits() -> None:
    """Each BlockMask carries a new mask_mod closure: allow the recompiles instead of falling back to eager."""
    try:
        import torch._dynamo as dynamo

        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(256, getattr(dynamo.config, name)))
    except Exception:  # noqa: BLE001
        pass


# ----------------------------------------------------------------------------- (a) operator


@dataclass(frozen=True)
class Pattern:
    """The prefill pattern of one layer depth and mode."""

    u: float
    mode: str  # "psaw", "etf", "both" ("dense-equivalent" at u = 0)
    w: float
    frozen_hi: int  # rows [sink, frozen_hi) are frozen; frozen_hi <= sink: none


def make_pattern(L: int, u: float, mode: str, s: Schedule) -> Pattern:
    """Window fraction and frozen rows at depth ``u`` (layer ``l_s + u (N - l_s)`` of any N)."""
    n, start = 32, 16  # only u matters: layer = start + u * (n - start)
    layer = start + round(u * (n - start))
    w = sched.psaw_window_fraction(layer, n, start, s.phi, s.alpha) if mode in ("psaw", "both") else 1.0
    e = sched.etf_frozen_count(L, layer, n, start, s.psi, s.gamma) if mode in ("etf", "both") else 0
    return Pattern(u, mode if u > 0 else "any (=dense)", w, max(e, s.sink))


def pattern_plan(L: int, p: Pattern, s: Schedule, device: torch.device) -> PrefillPlan:
    """The :class:`PrefillPlan` of pattern ``p`` for a batch-1 prefill of ``L`` tokens."""
    win = [sched.psaw_window_start(t, p.w, s.sink) for t in range(1, L + 1)]
    i32 = dict(dtype=torch.int32, device=device)
    return PrefillPlan(
        pad=torch.zeros(1, **i32),
        q_start=torch.zeros(1, **i32),
        win_lo=torch.tensor([win], **i32),
        sink=s.sink,
        frozen_lo=torch.tensor([s.sink], **i32),
        frozen_hi=torch.tensor([p.frozen_hi], **i32),
    )


def _dense_sdpa(q, k, v) -> Callable[[], Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def run():
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def _sdpa_default(q, k, v) -> Callable[[], Any]:
    """SDPA with the backend torch picks itself (what an unpatched model runs; on an H200 that need
    not be the flash backend :func:`_dense_sdpa` forces)."""
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fa4_dense(q, k, v, device: torch.device) -> Callable[[], Any] | None:
    """FA4's dense causal forward where it runs (the same function the model's dense FA4 row registers)."""
    from prhs_hf.backends import flash_usable

    if not flash_usable(device):
        return None
    from prhs_hf.ops.prefill.flash_prefill import flash_causal_attention

    return lambda: flash_causal_attention(q, k, v, q.shape[-1] ** -0.5)


def _flash_attn(q, k, v) -> Callable[[], Any] | None:
    try:
        from flash_attn import flash_attn_func
    except Exception:  # noqa: BLE001
        return None
    if not q.is_cuda:
        return None
    qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return lambda: flash_attn_func(qb, kb, vb, causal=True)


def bench_operator(report: Report, contexts: list[int], depths: list[float], shape: ModelShape, s: Schedule,
                   device: torch.device, dtype: torch.dtype, with_flex: bool) -> None:
    """Part (a): one row per (context, depth, mode)."""
    heads, d = shape.heads, shape.head_dim
    scale = d**-0.5
    if with_flex:
        _raise_dynamo_limits()
    for L in common.progress(contexts, "(a) operator"):
        print(f"(a) operator, L = {L}", flush=True)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, heads, L, d, device=device, dtype=dtype, generator=g) for _ in range(3))
        dense_ms = _attempt(report, f"dense SDPA L={L}", lambda: time_ms(_dense_sdpa(q, k, v), device))
        default_ms = _attempt(report, f"dense SDPA default L={L}", lambda: time_ms(_sdpa_default(q, k, v), device))
        fa4 = _fa4_dense(q, k, v, device)
        fa4_ms = _attempt(report, f"fa4 dense L={L}", lambda: time_ms(fa4, device)) if fa4 is not None else None
        fa = _flash_attn(q, k, v)
        fa_ms = _attempt(report, f"flash-attn L={L}", lambda: time_ms(fa, device)) if fa is not None else None
        _, fastest = common.fastest({"sdpa_flash": dense_ms, "sdpa_default": default_ms, "fa4": fa4_ms, "flash_attn": fa_ms})
        patterns = [make_pattern(L, 0.0, "both", s)] + [
            make_pattern(L, u, mode, s) for u in depths if u > 0 for mode in ("psaw", "etf", "both")
        ]
        for p in patterns:
            plan = pattern_plan(L, p, s, device)
            pairs = sched.visible_pairs(L, p.w, s.sink, s.sink, p.frozen_hi)
            visible = pairs / sched.causal_pairs(L)
            pair_flop = 4 * d * heads  # QK^T + PV per visible pair, all heads
            ours_ms = _attempt(report, f"ours L={L} u={p.u} {p.mode}", lambda: time_ms(lambda: prefill_attention(q, k, v, plan, scale), device))
            flex_ms = None
            if with_flex:
                flex_ms = _attempt(report, f"flex L={L} u={p.u} {p.mode}", lambda: _time_flex(q, k, v, plan, scale, device))
            ideal = None if dense_ms is None else dense_ms * visible
            row = dict(
                context=L, u=p.u, mode=p.mode, window_fraction=round(p.w, 6), frozen_rows=max(0, p.frozen_hi - s.sink),
                visible_fraction=round(visible, 6), dense_sdpa_ms=dense_ms, sdpa_default_ms=default_ms,
                fa4_dense_ms=fa4_ms, flash_attn_ms=fa_ms, flex_ms=flex_ms,
                ours_ms=ours_ms, ours_over_ideal=_ratio(ours_ms, ideal), flex_over_ours=_ratio(flex_ms, ours_ms),
                dense_over_ours=_ratio(dense_ms, ours_ms), fastest_dense_over_ours=_ratio(fastest, ours_ms),
                dense_tflops=_ratio(pair_flop * sched.causal_pairs(L) / 1e9, dense_ms),
                ours_tflops=_ratio(pair_flop * pairs / 1e9, ours_ms),
            )
            report.operator.append(row)
            print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        del q, k, v
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _time_flex(q, k, v, plan: PrefillPlan, scale: float, device) -> float:
    from prhs_hf.ops.prefill.flex_prefill import build_prefill_block_mask, flex_attention_with_mask

    block_mask = build_prefill_block_mask(plan, k.shape[2])  # not timed
    return time_ms(lambda: flex_attention_with_mask(q, k, v, block_mask, scale), device)


# ----------------------------------------------------------------------------- (b) whole model


def _build_model(shape: ModelShape, max_len: int, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=max(4096, max_len), head_dim=shape.head_dim,
    )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _prefill_once(model, ids: torch.Tensor) -> None:
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    del out


def _measure_prefill(model, L: int, device: torch.device, vocab: int) -> tuple[float, float | None]:
    ids = torch.randint(0, vocab, (1, L), device=device, generator=torch.Generator(device=device).manual_seed(L))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # one warm-up call (autotune, compiles), then the median of two timed calls
    ms = common.time_calls(lambda: _prefill_once(model, ids), device, reps=2)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return ms, peak


def bench_model(report: Report, contexts: list[int], shape: ModelShape, config_path: Path,
                device: torch.device, dtype: torch.dtype) -> None:
    """Part (b): dense SDPA vs the CPE patch, whole-model prefill."""
    try:
        import prhs_hf
    except ImportError as exc:
        report.notes.append(f"(b) skipped: cannot import prhs_hf ({exc})")
        return
    if not hasattr(prhs_hf, "patch") or not hasattr(prhs_hf, "unpatch"):
        report.notes.append("(b) skipped: prhs_hf.patch / prhs_hf.unpatch do not exist yet (the integration API is missing)")
        print("  [n/a] prhs_hf.patch is missing: whole-model rows skipped", flush=True)
        return
    print(f"(b) whole model: building {shape.layers} layers x hidden {shape.hidden} ({dtype}) on {device}", flush=True)
    t0 = time.perf_counter()
    model = _attempt(report, "(b) model init", lambda: _build_model(shape, max(contexts), device, dtype))
    if model is None:
        return
    weights_gb = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(f"  model ready in {time.perf_counter() - t0:.1f} s", flush=True)
    from prhs_hf.backends import prefill_choice

    # the PrHS variants: backend.prefill auto (the route it resolves to here), and the Triton kernel
    # beside it where auto is FA4 (so that both routes are in one table); FA4 also as a dense row
    auto_route = prefill_choice("auto", device, dtype, shape.head_dim)
    fa4 = auto_route == "flash"
    routes = ["auto"] + (["triton"] if fa4 else [])
    for L in common.progress(contexts, "(b) whole model"):
        results: list[tuple[str, tuple[float, float | None] | None, bool]] = []  # (variant, result, dense?)
        results.append(("dense (sdpa)", _attempt(report, f"(b) dense L={L}", lambda: _measure_prefill(model, L, device, shape.vocab)), True))
        if fa4:
            def dense_fa4():
                model.set_attn_implementation(common.register_fa4_dense_attention())
                try:
                    return _measure_prefill(model, L, device, shape.vocab)
                finally:
                    model.set_attn_implementation("sdpa")

            results.append(("dense (fa4, registered attention)", _attempt(report, f"(b) dense fa4 L={L}", dense_fa4), True))
        for route in routes:
            def cpe(route=route):
                prhs_hf.patch(model, str(config_path), overrides={"backend": {"prefill": route}})
                try:
                    return _measure_prefill(model, L, device, shape.vocab)
                finally:
                    prhs_hf.unpatch(model)

            label = f"cpe ({config_path.name}, prefill {route}" + (f" -> {auto_route})" if route == "auto" else ")")
            results.append((label, _attempt(report, f"(b) {label} L={L}", cpe), False))
        sdpa = results[0][1]
        _, fastest = common.fastest({name: res[0] for name, res, is_dense in results if is_dense and res is not None})
        for name, res, _ in results:
            row = dict(
                context=L, variant=name, ms=None if res is None else res[0], peak_gib=None if res is None else res[1],
                weights_gib=weights_gb, tokens_per_s=None if res is None else L / (res[0] / 1e3),
                speedup_vs_dense=None if res is None or sdpa is None else sdpa[0] / res[0],
                speedup_vs_fastest_dense=None if res is None or fastest is None else fastest / res[0],
                peak_vs_dense=None if res is None or sdpa is None or res[1] is None or sdpa[1] is None else res[1] / sdpa[1],
            )
            report.model.append(row)
            print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- (c) analytic bound


def layer_flops(L: int, layer: int, shape: ModelShape, s: Schedule, cpe: bool) -> tuple[float, float]:
    """(linear, attention) FLOPs of one decoder layer for an ``L``-token prefill (2 per multiply-add).

    Frozen ETF rows still compute k_proj/v_proj (their K/V are needed) but skip q_proj, attention,
    o_proj and the MLP. Norms, RoPE, softmax and the LM head (one row) are left out.
    """
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    kv_rows = 2 * 2 * h * kv  # k_proj + v_proj per row
    q_o_mlp = 2 * h * shape.heads * shape.head_dim + 2 * shape.heads * shape.head_dim * h + 3 * 2 * h * shape.intermediate
    pair = 2 * 2 * shape.head_dim * shape.heads  # QK^T and PV per visible (query, key) pair, all heads
    if not cpe:
        return L * (kv_rows + q_o_mlp), pair * sched.causal_pairs(L)
    psaw_start, etf_start = s.starts(shape.layers)
    w = sched.psaw_window_fraction(layer, shape.layers, psaw_start, s.phi, s.alpha) if s.psaw_prefill else 1.0
    e = sched.etf_frozen_count(L, layer, shape.layers, etf_start, s.psi, s.gamma) if s.etf else 0
    frozen = max(0, e - s.sink)
    visible = sched.causal_pairs(L) if w == 1.0 and frozen == 0 else sched.visible_pairs(L, w, s.sink, s.sink, max(e, s.sink))
    return L * kv_rows + (L - frozen) * q_o_mlp, pair * visible


def bench_bound(report: Report, contexts: list[int], shape: ModelShape, s: Schedule) -> None:
    """Part (c): dense / CPE FLOPs of the whole model, per context."""
    for L in contexts:
        dense_lin = dense_att = cpe_lin = cpe_att = 0.0
        for layer in range(shape.layers):
            a, b = layer_flops(L, layer, shape, s, cpe=False)
            c, d = layer_flops(L, layer, shape, s, cpe=True)
            dense_lin, dense_att, cpe_lin, cpe_att = dense_lin + a, dense_att + b, cpe_lin + c, cpe_att + d
        row = dict(
            context=L, dense_tflop=(dense_lin + dense_att) / 1e12, cpe_tflop=(cpe_lin + cpe_att) / 1e12,
            bound_speedup=(dense_lin + dense_att) / (cpe_lin + cpe_att), attention_only_speedup=dense_att / cpe_att,
            linear_only_speedup=dense_lin / cpe_lin, dense_attention_share=dense_att / (dense_lin + dense_att),
        )
        report.bound.append(row)
        print("(c) " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)


def schedule_from_config(path: Path) -> Schedule:
    """PSAW/ETF parameters of a PrHS YAML config (paper defaults where the file or a key is missing)."""
    try:
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
    except Exception:  # noqa: BLE001
        return Schedule()
    b, p, e = data.get("budget", {}) or {}, data.get("psaw", {}) or {}, data.get("etf", {}) or {}
    return Schedule(
        sink=int(b.get("sink", SINK)), phi=float(p.get("phi", PHI)), alpha=float(p.get("alpha", ALPHA)),
        psi=float(e.get("psi", PSI)), gamma=float(e.get("gamma", GAMMA)), psaw_start=p.get("start_layer"),
        etf_start=e.get("start_layer"),
        psaw_prefill=bool(p.get("enabled", True)) and "prefill" in (p.get("phases") or ["prefill"]),
        etf=bool(e.get("enabled", True)),
    )


# ----------------------------------------------------------------------------- output


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_markdown(r: Report) -> str:
    head = (
        f"# Prefill benchmark\n\n- command: `{r.command}`\n- device: {r.device}\n- date: {r.date}\n- commit: {r.git_commit}\n"
        f"- versions: {', '.join(f'{k} {v}' for k, v in r.versions.items())}\n- quick: {r.quick}\n\n"
    )
    parts = [
        head,
        f"## (a) Attention operator (batch 1, {r.dtype}; times in ms)\n\n"
        "`dense_sdpa_ms`: SDPA forced to its flash backend; `sdpa_default_ms`: SDPA with the backend torch "
        "picks (what the unpatched model runs); `fa4_dense_ms`: FlashAttention-4 where it runs; "
        "`fastest_dense_over_ours` > 1: ours is faster than every dense column. "
        "`ours_over_ideal` = ours / (dense SDPA x visible fraction), target <= 1.15; "
        "`flex_over_ours` > 1 means ours is faster than FlexAttention with the same BlockMask; "
        "TFLOP/s count only the visible pairs (dense: all causal pairs).\n\n",
        markdown_table(r.operator),
        "\n## (b) Whole-model prefill (random LLaMA-2-7B-shaped model)\n\n"
        "`speedup_vs_dense`: against the unpatched model (SDPA); `speedup_vs_fastest_dense`: against the "
        "fastest dense row (FA4 registered as the model's attention where it runs); `peak_vs_dense`: peak "
        "memory over SDPA dense's.\n\n",
        markdown_table(r.model),
        "\n## (c) Analytic bound: dense / CPE FLOPs of the whole model\n\n",
        markdown_table(r.bound),
    ]
    if r.notes:
        parts.append("\n## Notes\n\n" + "".join(f"- {n}\n" for n in r.notes))
    return "".join(parts)


def write_report(r: Report, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(asdict(r), indent=2) + "\n")
    out.with_suffix(".md").write_text(render_markdown(r))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", flush=True)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test under TRITON_INTERPRET=1; 4k only on a GPU)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "bench_prefill", help="output path without suffix")
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "cpe.yaml", help="PrHS config for (b) and (c)")
    ap.add_argument("--skip-flex", action="store_true", help="no FlexAttention column")
    ap.add_argument("--skip-model", action="store_true", help="no whole-model part (b)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: set TRITON_INTERPRET=1 to run the Triton kernel on the CPU (use --quick)", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    meta = common.run_metadata(device, argv)
    versions = {**meta["versions"], "flash_attn": common.package_version("flash_attn"),
                "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    report = Report(
        command=meta["command"], device=meta["gpu"], versions=versions, date=meta["date"],
        git_commit=meta["git_commit"], quick=args.quick, dtype="",
    )
    s = schedule_from_config(args.config)
    llama = ModelShape()
    gpu_full = device.type == "cuda" and not args.quick
    if device.type == "cuda":
        op_shape, op_ctx, depths = llama, ([4096, 16384, 32768] if gpu_full else [4096]), [0.0, 0.5, 1.0]
        model_shape, model_ctx, bound_ctx = llama, ([8192, 16384, 32768] if gpu_full else [4096]), [8192, 16384, 32768]
        dtype = torch.bfloat16
    else:  # CPU smoke test: tiny shapes, fp32 (the interpreter's bf16 dots are upcast anyway)
        op_shape = ModelShape(layers=4, hidden=128, heads=2, kv_heads=2, head_dim=64, intermediate=256, vocab=256)
        op_ctx, depths = [192], [0.0, 1.0]
        model_shape, model_ctx, bound_ctx = op_shape, [96], [8192]
        dtype = torch.float32
        report.notes.append("CPU smoke run: tiny shapes, timings are meaningless; GPU-only columns are n/a")
    report.dtype = str(dtype).replace("torch.", "")
    bench_operator(report, op_ctx, depths, op_shape, s, device, dtype, with_flex=not args.skip_flex)
    if not args.skip_model:
        bench_model(report, model_ctx, model_shape, args.config, device, dtype)
    bench_bound(report, bound_ctx, llama, s)
    report.notes.append(f"total wall time {time.perf_counter() - t_start:.0f} s")
    print("\n" + render_markdown(report))
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
