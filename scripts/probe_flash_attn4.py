#!/usr/bin/env python
"""Probe of flash-attn-4 (CuTe DSL) on this GPU: does it import, and how fast is it,
dense and block-sparse on the PSAW/ETF tiles of ``configs/cpe.yaml``.

Stages, each in its own ``try``/``except`` (a failure leaves the other stages' rows and its own
error text, with the full traceback, in the JSON):

1. ``import``: ``import flash_attn.cute`` (and ``cutlass``); versions of FA4 and its stack, the
   CUDA flavour of the CuTe DSL that was loaded (``_cutlass_ir.cu{N}``), the driver's CUDA.
2. ``dense``: causal forward, bf16, batch 1, 32 query heads (32 and 8 KV heads), d 128, at 4k,
   16k, 32k: FA4 ``flash_attn_func(causal=True)``, SDPA (flash backend; the reference), our Triton
   prefill kernel with a dense-equivalent pattern and FlexAttention (compiled); max error vs SDPA
   and median time (``_bench_common.median_ms``: ``triton.testing.do_bench``).
3. ``sparse``: the PSAW+ETF pattern of the config at depth ``--depth`` (1.0: the deepest layer's
   window and frozen rows, as the ``u = 1`` rows of ``bench_prefill``), run through FA4's
   block-sparse forward exactly as ``backend.prefill: flash`` runs it (``prhs_hf.ops.prefill.flash_prefill``:
   ``fa4_block_sparse`` turns the schedule into FA4's block-sparse tensors, 128 x 128 tiles on
   sm90: skipped, full, and partial tiles for which the CuTe ``prefill_mask_mod`` applies the
   exact SPEC §3 predicate; ``flash_block_sparse_attention`` calls FA4), checked against
   :func:`prefill_attention_reference` (up to ``--ref-max-len``; past it against our kernel) and
   timed next to our kernel and FlexAttention with the same pattern.

Writes ``<out>.json`` (rows with named fields, metadata, errors) and ``<out>.md`` (default
``docs/results/probe_flash_attn4``). FA4 compiles each variant on first use (about 4 variants);
``--fa4-cache`` keeps the compiled kernels on disk for a second run. ``--budget-s`` skips the
optional columns (FlexAttention, the fp32 reference) once the run is past it.

    PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages python scripts/probe_flash_attn4.py
    python scripts/probe_flash_attn4.py --contexts 4096 --skip-flex     # quick look

Exit status: 0 all stages ran, 1 some stage or column failed (see ``errors``), 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import _bench_common as common
import bench_prefill as bp  # the pattern of a depth, its prefill plan, the config reader, tables

from prhs_hf import schedules as sched  # noqa: E402  (bench_prefill put the checkout on sys.path if needed)
from prhs_hf.ops.prefill.flash_prefill import (  # noqa: E402  (the route's conversion, mask_mod and FA4 call)
    add_cutlass_dsl_path,
    fa4_block_size,
    fa4_block_sparse,
    flash_block_sparse_attention,
    flash_causal_attention,
    import_flash_attn,
    mask_aux_tensors,
    prefill_mask_mod,
)
from prhs_hf.ops.prefill.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402

REPO = common.REPO
#: distributions whose versions the import stage records (``importlib.metadata`` names)
FA4_DISTRIBUTIONS = (
    "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-cu12", "quack-kernels", "apache-tvm-ffi",
    "torch-c-dlpack-ext", "cuda-bindings", "cuda-pathfinder", "protobuf", "einops",
)


@dataclass
class Report:
    """Everything the probe measured: metadata, one row per measurement, the errors."""

    meta: dict[str, Any]
    fa4: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def error(self, where: str, exc: BaseException) -> str:
        """Record ``exc`` (message and full traceback) under ``where``; print both; return the one-line message."""
        msg = f"{type(exc).__name__}: {exc}".strip()
        tb = traceback.format_exc()
        self.errors.append({"where": where, "error": msg, "traceback": tb})
        print(f"  [error] {where}: {msg}\n{tb}", flush=True)
        return msg.splitlines()[0][:300] if msg else type(exc).__name__


# ----------------------------------------------------------------------------- tile mask -> FA4


def block_stats(kinds: torch.Tensor) -> dict[str, int]:
    """How many tiles of the ``M x N`` grid are partial, full and skipped (above the diagonal too)."""
    total = kinds.numel()
    return {
        "tiles": total,
        "tiles_partial": int((kinds == 1).sum()),
        "tiles_full": int((kinds == 2).sum()),
        "tiles_skipped": int((kinds == 0).sum()),
    }


# ----------------------------------------------------------------------------- FA4 import


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _driver_cuda() -> str:
    """The driver's CUDA version (``cuDriverGetVersion``), e.g. ``"13.0"``; the CuTe DSL picks its cu12/cu13 flavour by it."""
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{(v.value % 1000) // 10}"
        return "cuDriverGetVersion failed"
    except OSError as exc:
        return f"no libcuda.so.1 ({exc})"


def import_fa4(report: Report) -> Any:
    """Stage 1: import ``flash_attn.cute``; record versions, the DSL flavour, or the full traceback. Returns the module or None."""
    info: dict[str, Any] = {"driver_cuda": _driver_cuda(), "versions": {d: _dist_version(d) for d in FA4_DISTRIBUTIONS}}
    info["sys_path_added"] = add_cutlass_dsl_path()
    report.fa4 = info
    t0 = time.perf_counter()
    try:
        fa4 = import_flash_attn()  # the route's import: its error names the cause and the install
    except BaseException as exc:  # noqa: BLE001 - the RuntimeError of a failed import, SystemExit of a native lib...
        if isinstance(exc, KeyboardInterrupt):
            raise
        info["ok"] = False
        info["error"] = report.error("import flash_attn.cute", exc)
        cause = exc.__cause__
        if isinstance(cause, ModuleNotFoundError) and cause.name in ("cutlass", "cuda", "cuda.bindings", "google"):
            report.notes.append(f"{cause.name} is missing: the CuTe DSL needs nvidia-cutlass-dsl-libs-core (cutlass), "
                                "cuda-bindings (cuda) and protobuf (google) on the path; with pip --target also "
                                "<target>/nvidia_cutlass_dsl/dsl_packages (its .pth does not run)")
        report.rows.append(dict(stage="import", impl="fa4", ok=False, error=info["error"]))
        return None
    info["ok"] = True
    info["import_s"] = round(time.perf_counter() - t0, 2)
    info["flash_attn_cute_version"] = getattr(fa4, "__version__", "unknown")
    ir = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    info["cutlass_ir"] = os.path.basename(getattr(ir, "__file__", "") or "?")
    try:
        from cutlass.base_dsl.version_info import CUDA_VERSION

        info["cutlass_dsl_cuda"] = f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}"
    except Exception as exc:  # noqa: BLE001
        info["cutlass_dsl_cuda"] = f"unknown ({type(exc).__name__})"
    info["cute_dsl_libs"] = os.environ.get("CUTE_DSL_LIBS")
    report.rows.append(dict(stage="import", impl="fa4", ok=True, error=None))
    print(f"  flash_attn.cute imported in {info['import_s']} s: {json.dumps(info, default=str)}", flush=True)
    return fa4


# ----------------------------------------------------------------------------- runners


def _sdpa_flash(q, k, v, gqa: bool) -> Callable[[], torch.Tensor]:
    """SDPA causal, flash backend only, ``[B, L, H, D]`` out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def _fa4_dense(qb, kb, vb, scale: float) -> Callable[[], torch.Tensor]:
    """The route's dense causal FA4 call on ``[B, L, H, D]`` tensors (passed as HF-layout views)."""
    return lambda: flash_causal_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), scale)


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


class Probe:
    """The measuring loop's state: device, report, deadline of the optional columns, FA4 first-call times."""

    def __init__(self, report: Report, device: torch.device, budget_s: float, t_start: float):
        self.report, self.device, self.budget_s, self.t_start = report, device, budget_s, t_start
        self.fa4_variants_seen: set[str] = set()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t_start > self.budget_s

    def measure(self, base: dict[str, Any], impl: str, make: Callable[[], Callable[[], torch.Tensor]],
                ref: Optional[torch.Tensor], ref_name: Optional[str], check: Optional[Callable] = None,
                variant: Optional[str] = None) -> Optional[torch.Tensor]:
        """One row: build the call, run it once (timed as ``first_call_s``: FA4's compile), compare, time it."""
        row = dict(base, impl=impl, ms=None, max_abs_err=None, reference=ref_name, first_call_s=None, ok=False, error=None)
        out = None
        try:
            fn = make()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
            if variant is not None:
                row["fa4_variant"] = variant
                row["fa4_compiled_here"] = variant not in self.fa4_variants_seen
                self.fa4_variants_seen.add(variant)
            if ref is not None:
                row["max_abs_err"] = _max_err(out, ref)
            if check is not None:
                row.update(check(out))
            row["ms"] = common.median_ms(fn, self.device).ms
            row["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the row keeps the error, the probe goes on
            row["error"] = self.report.error(f"{base.get('stage')} {impl} L={base.get('context')} Hkv={base.get('kv_heads')}", exc)
            out = None
            try:  # a sticky CUDA error (an illegal address) raises here again: keep the first message
                torch.cuda.synchronize()
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as again:  # noqa: BLE001
                row["error"] += f" (then: {type(again).__name__}: {str(again)[:200]})"
        self.report.rows.append(row)
        print("  " + ", ".join(f"{k}={bp._fmt(v)}" for k, v in row.items() if k != "error"), flush=True)
        return out

    def skipped(self, base: dict[str, Any], impl: str, why: str) -> None:
        self.report.rows.append(dict(base, impl=impl, ms=None, max_abs_err=None, ok=False, error=f"skipped: {why}"))


def _inputs(L: int, hq: int, hkv: int, d: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed + L + 7 * hkv)
    q = torch.randn(1, hq, L, d, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, L, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, L, d, device=device, dtype=torch.bfloat16, generator=g)
    return q, k, v


def _flex(q, k, v, plan, scale):
    from prhs_hf.ops.prefill.flex_prefill import build_prefill_block_mask, flex_attention_with_mask

    block_mask = build_prefill_block_mask(plan, k.shape[2])  # not timed
    return lambda: flex_attention_with_mask(q, k, v, block_mask, scale)


def stage_dense(p: Probe, fa4: Any, contexts: list[int], heads: list[tuple[int, int]], d: int, s, with_flex: bool) -> None:
    """Stage 2: dense causal forward of every implementation at every length and head layout."""
    scale = d**-0.5
    for L in contexts:
        for hq, hkv in heads:
            print(f"(dense) L={L} Hq={hq} Hkv={hkv}", flush=True)
            base = dict(stage="dense", context=L, q_heads=hq, kv_heads=hkv, head_dim=d)
            q, k, v = _inputs(L, hq, hkv, d, p.device)
            ref_b = p.measure(base, "sdpa_flash", lambda: _sdpa_flash(q, k, v, hkv != hq), None, None)
            if ref_b is None and hkv != hq:  # flash SDPA without enable_gqa: K/V copied to every query head
                g = hq // hkv
                kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
                ref_b = p.measure(base, "sdpa_flash_repeat_kv", lambda: _sdpa_flash(q, kr, vr, False), None, None)
                del kr, vr
            ref = None if ref_b is None else ref_b.transpose(1, 2)  # [B, L, H, D]
            rname = None if ref is None else "sdpa_flash"
            if fa4 is not None:
                qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                p.measure(base, "fa4", lambda: _fa4_dense(qb, kb, vb, scale), ref, rname, variant=f"dense causal G={hq // hkv}")
                del qb, kb, vb
            else:
                p.skipped(base, "fa4", "flash_attn.cute did not import (see the import stage)")
            dense = bp.Pattern(0.0, "dense", 1.0, s.sink)
            plan = bp.pattern_plan(L, dense, s, p.device)
            p.measure(base, "ours_triton", lambda: (lambda: prefill_attention(q, k, v, plan, scale)), ref, rname)
            if with_flex and not p.over_budget():
                p.measure(base, "flex", lambda: _flex(q, k, v, plan, scale), ref, rname)
            elif with_flex:
                p.skipped(base, "flex", "over --budget-s")
            del q, k, v, ref, ref_b
            gc.collect()
            torch.cuda.empty_cache()


def stage_sparse(p: Probe, fa4: Any, contexts: list[int], heads: list[tuple[int, int]], d: int, s, depth: float,
                 with_flex: bool, ref_max_len: int) -> None:
    """Stage 3: the PSAW+ETF pattern at ``depth`` through FA4 block-sparse, our kernel and Flex."""
    scale = d**-0.5
    mask_mod = None
    if fa4 is not None:
        try:
            mask_mod = prefill_mask_mod()
        except Exception as exc:  # noqa: BLE001
            p.report.error("sparse: building the CuTe mask_mod", exc)
    block = fa4_block_size(torch.cuda.get_device_capability(p.device), d)
    for L in contexts:
        pat = bp.make_pattern(L, depth, "both", s)
        plan = bp.pattern_plan(L, pat, s, p.device)
        pairs = sched.visible_pairs(L, pat.w, s.sink, s.sink, pat.frozen_hi)
        blocks = fa4_block_sparse(plan, L, block)
        stats = block_stats(blocks.kinds)
        frozen = torch.zeros(L, dtype=torch.bool, device=p.device)
        frozen[s.sink:pat.frozen_hi] = True
        for hq, hkv in heads:
            print(f"(sparse) L={L} Hq={hq} Hkv={hkv} depth={depth} w={pat.w:.4f} frozen_hi={pat.frozen_hi} {stats}", flush=True)
            base = dict(stage="sparse", context=L, q_heads=hq, kv_heads=hkv, head_dim=d, depth=depth,
                        window_fraction=round(pat.w, 6), frozen_rows=max(0, pat.frozen_hi - s.sink),
                        visible_fraction=round(pairs / sched.causal_pairs(L), 6), **stats)
            q, k, v = _inputs(L, hq, hkv, d, p.device, seed=1)
            kargs = (q, k, v, plan, scale)
            ours = p.measure(base, "ours_triton", lambda: (lambda: prefill_attention(*kargs)), None, None)
            ref, rname = ours, "ours_triton"
            if L <= ref_max_len and not p.over_budget():
                try:
                    ref, rname = prefill_attention_reference(*kargs), "reference_fp32"
                    if ours is not None:
                        p.report.rows[-1]["max_abs_err"] = _max_err(ours, ref)
                        p.report.rows[-1]["reference"] = rname
                except Exception as exc:  # noqa: BLE001
                    p.report.error(f"sparse reference L={L}", exc)

            def check(out, ref=ref):
                if ref is None:
                    return {}
                err = (out.float() - ref.float()).abs().amax(dim=(0, 2, 3))  # per row
                return {"max_abs_err_active_rows": float(err[~frozen].max()),
                        "max_abs_frozen_rows": float(out[:, frozen].float().abs().max()) if bool(frozen.any()) else 0.0}

            if fa4 is not None and mask_mod is not None:
                qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, L, H, D], as FA4 was timed first
                aux = mask_aux_tensors(plan)

                def run(qb=qb, kb=kb, vb=vb, aux=aux):  # the route's FA4 call, on views in the HF layout
                    return flash_block_sparse_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), blocks, aux, scale)

                p.measure(base, "fa4_block_sparse", lambda: run, ref, rname, check=check,
                          variant=f"block-sparse mask_mod G={hq // hkv}")
                del qb, kb, vb
            else:
                p.skipped(base, "fa4_block_sparse", "flash_attn.cute or its mask_mod is not available (see errors)")
            if with_flex and not p.over_budget():
                p.measure(base, "flex", lambda: _flex(q, k, v, plan, scale), ref, rname, check=check)
            elif with_flex:
                p.skipped(base, "flex", "over --budget-s")
            del q, k, v, ref, ours
            gc.collect()
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- output


ROW_COLUMNS = ("stage", "context", "q_heads", "kv_heads", "impl", "ms", "max_abs_err", "reference", "first_call_s", "ok",
               "max_abs_err_active_rows", "max_abs_frozen_rows", "visible_fraction", "tiles_partial", "tiles_full",
               "tiles_skipped")


def render_markdown(r: Report) -> str:
    m = r.meta
    head = (
        f"# flash-attn-4 probe\n\n- command: `{m['command']}`\n- GPU: {m['gpu']}\n- date: {m['date']}\n"
        f"- commit: {m['git_commit']}\n- versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}\n"
        f"- FA4 stack: {', '.join(f'{k} {v}' for k, v in r.fa4.get('versions', {}).items())}\n"
        f"- driver CUDA {r.fa4.get('driver_cuda')}, CuTe DSL flavour {r.fa4.get('cutlass_ir', 'n/a')} "
        f"(CUDA {r.fa4.get('cutlass_dsl_cuda', 'n/a')}), flash_attn.cute imported: {r.fa4.get('ok')}\n\n"
        "Times are medians in ms (`triton.testing.do_bench`); `max_abs_err` against `reference`; "
        "`first_call_s` includes FA4's JIT compile where `fa4_compiled_here`.\n\n"
    )
    rows = [{**{c: row.get(c) for c in ROW_COLUMNS},
             "error": (row.get("error") or "").replace("|", "/").replace("\n", " ")[:100] or None}
            for row in r.rows if row.get("stage") != "import"]
    parts = [head, bp.markdown_table(rows) if rows else "(no measurement rows)\n"]
    if r.errors:
        parts.append("\n## Errors\n\n" + "".join(f"- {e['where']}: `{e['error'].splitlines()[0][:300] if e['error'] else ''}`\n"
                                               for e in r.errors))
        parts.append("\nFirst traceback:\n\n```\n" + r.errors[0]["traceback"][-4000:] + "```\n")
    if r.notes:
        parts.append("\n## Notes\n\n" + "".join(f"- {n}\n" for n in r.notes))
    return "".join(parts)


def write_report(r: Report, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(asdict(r), indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(render_markdown(r))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", flush=True)


# ----------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "probe_flash_attn4", help="output path without suffix")
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "cpe.yaml", help="PrHS config of the PSAW/ETF schedule")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8], help="KV heads of the 32 query heads (32: MHA, 8: GQA)")
    ap.add_argument("--depth", type=float, default=1.0, help="layer depth u in [0, 1] of the sparse pattern (1: deepest)")
    ap.add_argument("--ref-max-len", type=int, default=16384, help="longest context checked against the fp32 reference")
    ap.add_argument("--skip-flex", action="store_true", help="no FlexAttention column")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip optional columns (Flex, reference) past this")
    ap.add_argument("--fa4-cache", default="/tmp/fa4_cute_cache", help="FA4 disk cache of compiled kernels ('' for none)")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.fa4_cache:  # read by flash_attn.cute.cache_utils at import time
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", args.fa4_cache)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    meta = common.run_metadata(device, argv)
    report = Report(meta=meta)
    print("(import) flash_attn.cute", flush=True)
    fa4 = import_fa4(report)
    meta["versions"]["flash_attn_4"] = report.fa4["versions"]["flash-attn-4"]
    if not cuda:
        msg = "no CUDA device: this probe needs an NVIDIA GPU (FA4's SM90 path: H100/H200); only the import stage ran"
        print(msg, file=sys.stderr, flush=True)
        report.notes.append(msg)
        write_report(report, args.out)
        return 2
    s = bp.schedule_from_config(args.config)
    bp._raise_dynamo_limits()
    heads = [(32, h) for h in args.kv_heads]
    p = Probe(report, device, args.budget_s, t_start)
    for name, fn in (
        ("dense", lambda: stage_dense(p, fa4, args.contexts, heads, 128, s, not args.skip_flex)),
        ("sparse", lambda: stage_sparse(p, fa4, args.contexts, heads, 128, s, args.depth, not args.skip_flex, args.ref_max_len)),
    ):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the other stage still runs
            report.error(f"stage {name}", exc)
            gc.collect()
            torch.cuda.empty_cache()
    block = fa4_block_size(torch.cuda.get_device_capability(device), 128)
    report.notes.append(f"schedule from {args.config.name}: {asdict(s)}; FA4 sparse tiles {block}")
    report.notes.append(f"total wall time {time.perf_counter() - t_start:.0f} s")
    print("\n" + render_markdown(report))
    write_report(report, args.out)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
