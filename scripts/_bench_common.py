"""What the benchmark scripts share: run metadata, timing, progress bars and the fair dense baselines.

Imported by ``scripts/bench_decode_attention.py``, ``scripts/bench_e2e_decode.py`` and
``scripts/bench_prefill.py`` as ``import _bench_common`` (a script's own folder is first on
``sys.path`` when it runs as ``python scripts/X.py``; tests put ``scripts/`` there themselves).
It is tooling, not library code, so it lives beside the scripts and not in ``prhs_hf``.

* :func:`run_metadata`: command, device, versions (python, torch, CUDA, triton, transformers,
  flashinfer), date and git commit of a run, one dict for the JSON of every benchmark.
* :func:`median_ms`: the median time of a call, ``triton.testing.do_bench`` on CUDA (optionally
  replaying a CUDA graph of the call), a ``perf_counter`` loop on the CPU; :func:`progress`: the
  progress bar of a long loop.
* The dense decode baselines that every decode benchmark compares against, side by side:
  :func:`transformers_sdpa_attention` (transformers' path as shipped: with a mask it copies K/V
  to every query head with ``repeat_kv``), :func:`fair_sdpa_attention` (the same SDPA call with
  ``enable_gqa=True`` and the mask; registered with transformers as :data:`FAIR_ATTENTION`),
  :func:`flashinfer_decode` (FlashInfer's dense paged decode, when it imports) and
  :func:`fastest` to pick the column speedups are quoted against.
* :func:`cis_decode_step`: the whole stateless CIS decode step (match, retrieval, composition,
  sparse attention) through a ``DecodeOps`` table, what the operator benchmark times and the kernel
  tests compare between backends; :func:`capture_graph`: a CUDA graph of one call.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Optional, TypeVar

import torch

from prhs_hf.attention import GQA_SDPA_NAME, gqa_sdpa_attention_forward
from prhs_hf.attention import register as register_attention

if TYPE_CHECKING:
    from prhs_hf.ops.decode_ops import DecodeOps

REPO = Path(__file__).resolve().parents[1]

#: the name :func:`register_fair_attention` registers :func:`fair_sdpa_attention` under
FAIR_ATTENTION = GQA_SDPA_NAME

#: column labels of the dense baselines (JSON ``dense_columns``, markdown headers)
DENSE_LABELS = {
    "transformers": "dense (transformers sdpa, repeat_kv)",
    "sdpa_gqa": "dense (SDPA enable_gqa + mask)",
    "flash_packed": "dense (SDPA flash, no mask, query heads packed)",
    "flashinfer": "dense (FlashInfer paged decode)",
}

T = TypeVar("T")


# ----------------------------------------------------------------------------- run metadata


def package_version(name: str) -> str:
    """``name.__version__``, or ``"not available: <error>"`` when it does not import."""
    try:
        return str(getattr(importlib.import_module(name), "__version__", "unknown"))
    except Exception as exc:  # noqa: BLE001 - optional packages (flashinfer, triton) may be absent or broken
        return f"not available: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def git_commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files).

    ``PRHS_GIT_COMMIT`` wins (a copy of the tree without ``.git``, e.g. on the GPU machine, gets it
    from the command line); ``"unknown (...)"`` when neither is there.
    """
    env = os.environ.get("PRHS_GIT_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return f"unknown ({head.stderr.strip()[:100] or 'git rev-parse failed'})"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's (with ``TRITON_INTERPRET=1`` noted)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    interp = ", Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores{interp})"


def run_metadata(device: torch.device, argv: Optional[list[str]] = None, **extra: Any) -> dict[str, Any]:
    """The fields every benchmark JSON starts with; ``extra`` is added after them.

    ``command`` (as typed: ``python scripts/X.py ARGS``), ``gpu`` (device name), ``versions``
    (python, torch, cuda, triton, transformers, flashinfer; a missing package reads
    ``"not available: <error>"``), ``date`` (UTC, ISO 8601), ``git_commit``.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    script = os.path.relpath(sys.argv[0], REPO) if sys.argv and sys.argv[0] else "?"
    meta: dict[str, Any] = {
        "command": " ".join(["python", script, *map(shlex.quote, args)]),
        "gpu": device_name(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": str(torch.version.cuda),
            **{name: package_version(name) for name in ("triton", "transformers", "flashinfer")},
        },
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }
    meta.update(extra)
    return meta


# ----------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """A median time and how it was taken (``graph``, ``eager``: do_bench; ``cpu``: perf_counter)."""

    ms: float
    method: str


def _cpu_median(fn: Callable[[], object], rep_ms: float, max_reps: int) -> float:
    """A warm-up call, then as many as fill ``rep_ms`` (at most ``max_reps``); a warm-up call that
    alone takes ``rep_ms`` or more is the measurement (a Triton kernel in the CPU interpreter takes
    seconds: a second call would double the run for a time that means nothing on a CPU anyway)."""
    t0 = time.perf_counter()
    fn()  # warm-up (and the estimate of one call)
    first = (time.perf_counter() - t0) * 1e3
    if first >= rep_ms:
        return first
    reps = int(max(1, min(max_reps, rep_ms // max(first, 1e-3))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def median_ms(
    fn: Callable[[], object],
    device: torch.device,
    *,
    cuda_graph: bool = False,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    max_reps: int = 50,
) -> Timing:
    """Median milliseconds of ``fn()``.

    CUDA: ``triton.testing.do_bench(..., return_mode="median")`` (``warmup_ms`` / ``rep_ms`` of
    calls after its own estimate); with ``cuda_graph=True`` of the replay of a CUDA graph of one
    call (Python launch overhead removed the same way for every column), falling back to eager
    timing, with a message, when the capture fails. CPU: one warm-up call, then as many calls as
    fill ``rep_ms`` (1 to ``max_reps``) timed with ``time.perf_counter``.
    """
    if device.type != "cuda":
        return Timing(_cpu_median(fn, rep_ms, max_reps), "cpu")
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if cuda_graph:
        try:
            graph, _ = capture_graph(fn)
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
            return Timing(ms, "graph")
        except Exception as exc:  # noqa: BLE001 - report and fall back
            print(f"    (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:200]}; timing eagerly)", flush=True)
            torch.cuda.synchronize()
    return Timing(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"), "eager")


def capture_graph(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of one call of ``fn`` and what that call returned (the graph's output tensors).
    ``fn`` runs once on a side stream first: a capture needs its lazy initialisation done."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def call_sync_free(fn: Callable[[], T]) -> T:
    """``fn()`` under ``torch.cuda.set_sync_debug_mode("error")``: a host synchronisation in it raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def time_calls(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median ms of ``reps`` calls after one warm-up, for calls of seconds (a whole-model prefill),
    where do_bench's own estimate and warm-up calls would multiply the run time."""
    times = []
    fn()
    for _ in range(max(1, reps)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def progress(items: Iterable[T], desc: str, total: Optional[int] = None) -> Iterator[T]:
    """A tqdm progress bar on stdout (the runner's log), plain iteration without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stdout, mininterval=1.0, dynamic_ncols=False, ncols=100)


# ----------------------------------------------------------------------------- dense baselines


class _HeadsStub(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, num_key_value_groups: int):
        super().__init__()
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = True


def attention_stub(num_q_heads: int, num_kv_heads: int) -> torch.nn.Module:
    """A stand-in attention module for calling the attention functions outside a model."""
    return _HeadsStub(num_q_heads // num_kv_heads)


def transformers_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward`` as shipped (with a mask and GQA it ``repeat_kv``-copies K/V)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


#: SDPA with ``enable_gqa=True`` also under a mask: the library's own dense path of sparse configs
fair_sdpa_attention = gqa_sdpa_attention_forward


def register_fair_attention() -> str:
    """Register :func:`fair_sdpa_attention` (and SDPA's mask builder) with transformers; returns its name.

    ``model.set_attn_implementation(register_fair_attention())`` then runs the model through it.
    """
    register_attention()
    return FAIR_ATTENTION


#: FA4's dense causal forward registered as a transformers attention function (prefill benchmarks)
FA4_DENSE_ATTENTION = "fa4_dense"


def fa4_dense_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """FlashAttention-4's dense causal forward as a transformers attention function: the fastest dense
    prefill a user could pick on an H200 (docs/results/probe_flash_attn4.md). For the benchmarks'
    unpadded prefills only: it refuses a mask (padding) and queries that are not the whole cache."""
    from prhs_hf.ops.prefill.flash_prefill import flash_causal_attention

    if attention_mask is not None or query.shape[2] != key.shape[2]:
        raise ValueError(f"{FA4_DENSE_ATTENTION}: unpadded prefill only (no mask, queries = keys); got a mask: "
                         f"{attention_mask is not None}, {query.shape[2]} queries over {key.shape[2]} keys")
    return flash_causal_attention(query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling), None


def register_fa4_dense_attention() -> str:
    """Register :func:`fa4_dense_attention` (with SDPA's mask builder: no mask without padding); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FA4_DENSE_ATTENTION, fa4_dense_attention)
    AttentionMaskInterface.register(FA4_DENSE_ATTENTION, sdpa_mask)
    return FA4_DENSE_ATTENTION


def flashinfer_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> Callable[[], torch.Tensor]:
    """FlashInfer's batch decode over whole caches: returns the call to time (its plan is done here).

    ``q [B, Hq, D]``, ``k_cache``/``v_cache [B, Hkv, S, D]`` (every row ``S`` tokens). Each row's
    cache is one page of ``S`` tokens in the ``HND`` layout, so the tensors are used as they are.
    The CUDA-core decode kernel first; for group sizes it does not take, the tensor-core one
    (FA2 backend). Raises when flashinfer does not import or neither kernel builds; the caller
    records the error.
    """
    import flashinfer

    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    i32 = dict(dtype=torch.int32, device=dev)
    indptr, indices = torch.arange(B + 1, **i32), torch.arange(B, **i32)
    last_len = torch.full((B,), S, **i32)
    errors = []
    for tensor_cores in (False, True):
        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
        kw = {"backend": "fa2"} if tensor_cores else {}
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=tensor_cores, **kw)
            wrapper.plan(indptr, indices, last_len, Hq, Hkv, D, S, pos_encoding_mode="NONE",
                         q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
            run = lambda w=wrapper: w.run(q, (k_cache, v_cache))  # noqa: E731
            run()
            return run
        except Exception as exc:  # noqa: BLE001 - try the other kernel, then give up with both errors
            errors.append(f"use_tensor_cores={tensor_cores}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    raise RuntimeError("; ".join(errors))


def fastest(columns: dict[str, Optional[float]]) -> tuple[Optional[str], Optional[float]]:
    """The (name, ms) of the smallest measured time; ``(None, None)`` when none was measured."""
    measured = {k: v for k, v in columns.items() if v is not None}
    if not measured:
        return None, None
    name = min(measured, key=measured.get)
    return name, measured[name]


# ----------------------------------------------------------------------------- the CIS decode step


class DecodeStepResult(NamedTuple):
    """Outputs of :func:`cis_decode_step`; ``H`` is ``Hq``, or ``Hkv`` with ``grouped=True``."""

    best: torch.Tensor  # [B, H] int32 matched anchor, -1 retrieve, -2 inactive
    new_idx: torch.Tensor  # [B, H, k] int32 fresh top-k of the retrieving rows
    idx: torch.Tensor  # [B, H, cap] int32 composed index lists
    count: torch.Tensor  # [B, H] int32
    out: torch.Tensor  # [B, Hq, D] attention output
    # [B, H, k + 2*r*min(m, k)] int32 dilated sets of the retrieving rows (what to store as
    # their anchors), only with ``anchor_sets=True``; else None
    new_set: Optional[torch.Tensor] = None


def cis_decode_step(ops: DecodeOps, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor,
                    t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, win_start: torch.Tensor,
                    anchor_q: torch.Tensor, anchor_count: torch.Tensor, anchor_idx: torch.Tensor,
                    active: torch.Tensor, *, anchor_sets: bool = False, grouped: bool = False,
                    **budget: Any) -> DecodeStepResult:
    """The four steps chained as in SPEC §4 (stateless: the anchors are given, not updated).

    Sharing rows take their anchor's indices with dilation, retrieving rows their fresh top-k
    without. ``budget``: ``tau, sink, k, dil_m, dil_r, cap, scale`` as in
    ``prhs_hf.ops.decode_ops.cis_select``; the model integration chains the same ops around its
    CIS state.

    ``anchor_sets=False``: ``anchor_idx [B, Hq, s, k]`` holds each anchor's top-k (best first)
    and every row's dilated set is sorted in ``compose_indices`` at every step.
    ``anchor_sets=True`` (the model's path): ``anchor_idx [B, Hq, s, dilated_set_size(k, dil_m,
    dil_r)]`` holds each anchor's dilated set (as made by ``ops.dilate_and_compose``); the retrieving
    rows' sets are built once (``result.new_set``, to be stored as their anchors) and every row is
    composed from a set without sorting (``cis_select``). Both give the same ``best``, ``new_idx``,
    ``idx``, ``count`` and ``out``.

    ``grouped=True`` (``cis.selection: group``, with ``anchor_sets=True`` only): the rows are the
    KV heads (``anchor_q [B, Hkv, s, G*D]``, ``anchor_idx [B, Hkv, s, n]``) and the attention loads
    each selected K/V row once for its group (``ops.sparse_decode_attention_grouped``); ``best``,
    ``idx`` and ``count`` are per KV head.
    """
    from prhs_hf.ops.decode_ops import cis_select  # the benchmarks that do not run the step do not load it

    if grouped and not anchor_sets:
        raise ValueError("cis_decode_step: grouped=True needs anchor_sets=True (group-shared CIS stores dilated sets)")
    scale = budget["scale"]
    if anchor_sets:
        sel = cis_select(ops, q, k_cache, pad, t, lo, hi, win_start, anchor_q, anchor_count, anchor_idx, active,
                         grouped=grouped, **budget)
        attention = ops.sparse_decode_attention_grouped if grouped else ops.sparse_decode_attention
        out = attention(q, k_cache, v_cache, pad, sel.idx, sel.count, scale)
        return DecodeStepResult(sel.best, sel.new_idx, sel.idx, sel.count, out, sel.new_set)
    best, retrieve = ops.cis_match(q, anchor_q, anchor_count, active, budget["tau"])
    new_idx = ops.topk_retrieval(q, k_cache, pad, lo, hi, retrieve, budget["k"], scale)
    B, H, s, kk = anchor_idx.shape
    shared = best >= 0
    pick = best.clamp_min(0).long().view(B, H, 1, 1).expand(B, H, 1, kk)
    shared_idx = torch.gather(anchor_idx, 2, pick).view(B, H, kk)
    sel_idx = torch.where(retrieve[..., None], new_idx, torch.where(shared[..., None], shared_idx, -1))
    idx, count = ops.compose_indices(t, lo, hi, win_start, sel_idx, shared, budget["sink"], budget["dil_m"],
                                     budget["dil_r"], budget["cap"])
    out = ops.sparse_decode_attention(q, k_cache, v_cache, pad, idx, count, scale)
    return DecodeStepResult(best, new_idx, idx, count, out)
