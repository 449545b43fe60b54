"""The speed map (``prhs-hf bench``): decode ms/step of plain ``model.generate()`` over a B × L grid.

Per cell (batch B, prompt length L), mode (``eager``: DynamicCache; ``static``:
``cache_implementation="static"``, whose decode step transformers compiles) and config: the dense
baselines, the unpatched model with ``attn_implementation="sdpa"`` or ``"sdpa_gqa"``
(:mod:`prhs_hf.attention`), and PrHS configs via ``prhs_hf.patch(model, config)``. A warm-up
``generate()`` of the cell's shapes, then the timed one of N2 new tokens (``min_new_tokens =
max_new_tokens``): ms/step = (t(N2) - t(N1)) / (N2 - N1), the clock read (after a synchronise) by a
logits processor after new tokens N1 and N2 (``--timing stamps``), or around two whole calls
(``--timing calls``); with ``--repeats R``, R timed runs after the one warm-up, ms/step their median
(``ms_per_step_runs``: each run's). ``speedup_vs_fastest_dense``: against the fastest dense row of the same cell and
mode (``fastest_dense``): ``sdpa``, ``sdpa_gqa`` or a PrHS config forced dense (``cis/dense+buffered``),
whichever ran; ``decode_steps`` (PrHS rows): whether the policy's last decision ran the decode steps
``sparse`` or ``dense`` (``policy: auto`` sends a step dense where its cost model says the sets lose,
so a PrHS row can time the patched dense path). On CUDA ``peak_gib`` is the timed runs' peak allocation,
``prefill_peak_gib`` / ``decode_peak_gib`` its two phases (split at the first new token). Cells whose KV cache + prefill activation would exceed 90 % of the free GPU
memory are skipped (``memory``), OOMs recorded (``oom``); ``--deadline-s`` stops starting cells. The
JSON is rewritten after every cell and as each cell's warm-up and timing start (a last row ``started:
warm-up`` or ``started: timing`` shows where a killed run stopped), the heat map PNG drawn at the end. (``scripts/_bench_common.py``
is not importable from an installed package: the little it would give here is re-implemented.)

The decode loop (``generation.stop_check_every``, :mod:`prhs_hf.patching`) is part of every row
(``stop_check_every``) and of its cell: a speedup compares rows of one loop. By default each PrHS
config runs in its own loop (the patched ``generate()``, which reads "all finished?" every N steps,
N = 8 as shipped), and each unpatched dense baseline (``sdpa``, ``sdpa_gqa``) twice: in its own loop
(transformers', a device read at every step: ``stop_check_every`` 1) and in the PrHS rows' loop,
the model patched with a dense config (``{generation: {stop_check_every: N}}``), which keeps its own
``sdpa`` / ``sdpa_gqa`` attention and adds only the loop, the fastest dense ``generate()`` a user can
have (``sdpa`` keeps transformers' mask builder, which reads the padding at every step; ``sdpa_gqa``'s
reads it once). A config forced dense (``NAME/dense``) runs in its own loop and in the PrHS rows'.
The headline ``speedup_vs_fastest_dense`` of a PrHS row is then against the fastest dense of ITS loop,
and the loop's own gain is a column of the dense rows: ``loop_speedup``, the same config's ms/step in
transformers' loop over the row's (a transformers ``StoppingCriteria`` cannot give an unpatched model
the patched loop: transformers reads the all-finished flag at every step whatever the criteria say).
``--stop-check-every N[,M]`` runs every row, PrHS and dense, in each loop given instead (``1``:
transformers' loop for all).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["DENSE_CONFIGS", "Deadline", "HEAT_RANGE", "HeatPanel", "add_arguments", "add_speedups",
           "available_host_bytes", "config_loops", "draw_heatmap", "estimate_bytes", "fits", "format_table",
           "heat_cell", "heat_panels", "is_dense_baseline", "main",
           "parse_lengths", "plan_cells"]

#: dense config name -> the attention implementation the unpatched model runs with
#: (``"sdpa_gqa"`` is :data:`prhs_hf.attention.GQA_SDPA_NAME`, registered by ``prhs_hf.attention.register``)
DENSE_CONFIGS = {"sdpa": "sdpa", "sdpa_gqa": "sdpa_gqa"}
RANDOM_SHAPE = "llama3-8b-shape"
QUICK_SHAPE_NAME = "tiny-llama"
SHAPES = {
    RANDOM_SHAPE: dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    QUICK_SHAPE_NAME: dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=128, rope_theta=10000.0),
}
BATCHES, LENGTHS, MODES, N1, N2 = "1,4,8,32", "4k,8k,16k,32k,64k,128k", "eager,static", 16, 80
QUICK = dict(batches="1,2", lengths="64,128", n1=2, n2=4)
MEMORY_FRACTION = 0.9
TEXT_FIELDS = ("story", "text", "context", "input")
#: statuses ``--resume`` keeps (the others, ``error``, ``not run: deadline`` and the ``started: <phase>`` of a
#: killed run, run again)
KEPT = ("ok", "memory", "positions", "oom")
#: the heat map's colour scale, the speedups at its two ends (fixed, so that maps compare at a glance)
HEAT_RANGE = (0.5, 2.0)
NOT_RUN = "not run"
SHORT = {"memory": "mem", "oom": "oom", "positions": "pos", "error": "err",
         "started: warm-up": "cut", "started: timing": "cut"}  # started: the last row of a run killed in it
EXAMPLES = """examples:
  prhs-hf bench --quick --out /tmp/sm/speed_map.json            # tiny random llama, any device, seconds
  prhs-hf bench --modes eager --deadline-s 480                  # llama3-8b shape, random weights
  prhs-hf bench --model ./my-checkpoint --prompts text.jsonl.gz --lengths 4k,8k,16k,32k --resume
  prhs-hf bench --replot --out docs/results/speed_map.json      # redraw the PNG and the table from the JSON"""


def parse_lengths(text: str, option: str) -> list[int]:
    """``"4k,8192"`` -> ``[4096, 8192]`` (``k`` = 1024); raises ``ValueError`` naming ``option``."""
    out = []
    for token in filter(None, (t.strip().lower() for t in text.split(","))):
        number = token[:-1] if token.endswith("k") else token
        if not number.isdigit() or int(number) < 1:
            raise ValueError(f"{option}: {token!r} is not a positive count (e.g. 4096 or 4k)")
        out.append(int(number) * (1024 if token.endswith("k") else 1))
    if not out:
        raise ValueError(f"{option}: empty list")
    return out


def estimate_bytes(cfg: Any, *, batch: int, length: int, new_tokens: int, itemsize: int,
                   prefill_chunk: Optional[int] = None) -> int:
    """What a cell of a model of text config ``cfg`` needs beyond the weights: its KV cache
    (:func:`prhs_hf.patching.kv_cache_bytes`) and the prefill's peak activation of one chunk of
    ``prefill_chunk`` tokens (the whole prompt without), as the patch's own chunk choice counts it
    (:func:`prhs_hf.patching.prefill_bytes_per_token`: the MLP's gate, up and product rows and a few
    hidden-size rows, the residual and the normed input among them). The bench's prompts have no
    padding, so an unchunked prefill runs without a mask (SDPA's causal flag); the chunks after the
    first of a chunked one attend under a boolean mask over the keys so far, counted at the prompt's."""
    from prhs_hf.patching import kv_cache_bytes, prefill_bytes_per_token

    rows = length if prefill_chunk is None else min(length, prefill_chunk)
    per_token = prefill_bytes_per_token(cfg, itemsize, length, masked=rows < length)
    return kv_cache_bytes(cfg, batch, length + new_tokens, itemsize) + batch * rows * per_token


def fits(estimate: int, free: Optional[int], fraction: float = MEMORY_FRACTION) -> bool:
    """Whether ``estimate`` bytes are at most ``fraction`` of ``free`` (unknown free memory: yes)."""
    return free is None or estimate <= fraction * free


class Deadline:
    """``passed()`` once ``seconds`` of ``clock`` have gone by since creation (never for ``None``)."""

    def __init__(self, seconds: Optional[float], clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock, self.start = seconds, clock, clock()

    def passed(self) -> bool:
        return self.seconds is not None and self.clock() - self.start >= self.seconds


def config_loops(configs: list[str], own: dict[str, int],
                 given: Optional[list[int]] = None) -> dict[str, list[int]]:
    """The decode loops (``stop_check_every``) each ``--configs`` entry runs in: every loop of
    ``given`` (``--stop-check-every``) for every entry; else (``None``) each entry's own
    (``own[config]``: 1, transformers' loop, for the unpatched dense baselines, else the config's
    ``generation.stop_check_every``) and, for a dense baseline (:func:`is_dense_baseline`), every loop
    of the PrHS entries too, so each PrHS row has its dense baselines in its own loop (see the module
    docstring)."""
    if given is not None:
        return {c: list(given) for c in configs}
    prhs = {own[c] for c in configs if not is_dense_baseline(c)}
    return {c: sorted({own[c]} | prhs) if is_dense_baseline(c) else [own[c]] for c in configs}


def plan_cells(batches: list[int], lengths: list[int], modes: list[str], configs: list[str],
               loops: Optional[dict[str, list[int]]] = None) -> list[tuple[str, int, int, str, Optional[int]]]:
    """(mode, B, L, config, stop_check_every) in run order: cheapest B·L first, both modes, each loop
    (``loops``: :func:`config_loops`; ``None``: each config once, loop ``None``), dense baselines first
    in a cell and loop. A static cell leaves out the entries that set ``backend.eager_step``
    (``NAME+buffered``): a ``StaticCache`` has no eager step, so such a row would repeat ``NAME``'s."""
    loops = loops or {c: [None] for c in configs}
    cells = sorted(((b, n) for b in batches for n in lengths), key=lambda c: (c[0] * c[1], c[1]))
    ordered = [c for c in configs if is_dense_baseline(c)] + [c for c in configs if not is_dense_baseline(c)]
    every = list(dict.fromkeys(e for c in ordered for e in loops[c]))
    every = sorted(every, key=lambda e: -1 if e is None else e)
    return [(m, b, n, c, e) for b, n in cells for m in modes for e in every for c in ordered if e in loops[c]
            if m != "static" or "eager_step" not in prhs_config(c)[1].get("backend", {})]


def is_dense_baseline(config: str) -> bool:
    """Whether ``--configs`` entry ``config`` is a dense baseline: the unpatched model (``sdpa``,
    ``sdpa_gqa``) or a PrHS config forced dense (``cis/dense``, ``cis/dense+buffered``: every forward on
    the fair dense path, on the cache its eager step keeps), which a user can pick as well."""
    if config in DENSE_CONFIGS:
        return True
    return prhs_config(config)[1].get("policy", {}).get("decode") == "dense"


def _key(row: dict[str, Any]) -> tuple:
    return row["model"], row["prompts"], row["mode"], row["batch"], row["length"], row.get("stop_check_every")


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Set on every measured row ``fastest_dense`` and ``speedup_vs_fastest_dense`` (its ms/step over
    the row's), against the dense row (:func:`is_dense_baseline`) with the fewest ms/step of the same
    model, prompts, mode, B, L and decode loop (``stop_check_every``), and ``loop_speedup``: the same
    config's ms/step in transformers' loop (``stop_check_every`` 1) over the row's (``None`` where the
    row is in that loop or its config did not run there)."""
    best: dict[tuple, dict[str, Any]] = {}
    every_step: dict[tuple, float] = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        if is_dense_baseline(r["config"]) and (_key(r) not in best or r["ms_per_step"] < best[_key(r)]["ms_per_step"]):
            best[_key(r)] = r
        if r.get("stop_check_every") == 1:
            every_step[_key(r)[:-1] + (r["config"],)] = r["ms_per_step"]
    for r in rows:
        ok = r["status"] == "ok"
        ref = best.get(_key(r)) if ok else None
        own = every_step.get(_key(r)[:-1] + (r["config"],)) if ok and r.get("stop_check_every") not in (None, 1) else None
        r["fastest_dense"] = ref["config"] if ref else None
        r["speedup_vs_fastest_dense"] = ref["ms_per_step"] / r["ms_per_step"] if ref else None
        r["loop_speedup"] = own / r["ms_per_step"] if own else None


class _Clock:
    """A logits processor: synchronise and read the clock after new tokens ``at`` (1 = the prefill's);
    ``after_prefill()`` runs once, at new token 1 (the bench reads and resets the peak memory there)."""

    def __init__(self, at: tuple[int, ...], sync: Callable[[], None],
                 after_prefill: Callable[[], None] = lambda: None):
        self.at, self.sync, self.after_prefill, self.calls, self.stamps = at, sync, after_prefill, 0, {}

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            self.after_prefill()
        if self.calls in self.at:
            self.sync()
            self.stamps[self.calls] = time.perf_counter()
        return scores


class PhasePeaks:
    """The peak memory of the timed runs and, with ``--timing stamps``, of their two phases: the prefill
    (a run's start to its first new token) and the decode steps (the rest of the run). Call
    :meth:`run_starts` before each run; the clock calls :meth:`prefill_done`. ``cuda`` is ``torch.cuda``
    (``None`` off CUDA: no fields). The allocator's counters are the host's view of every allocation
    asked for, so reading them at the first new token needs no synchronisation."""

    def __init__(self, cuda: Any, device: Any):
        self.cuda, self.device, self.phase = cuda, device, "prefill"
        self.peak, self.reserved = {"prefill": 0, "decode": 0}, 0
        if cuda is not None:  # the counters start here: the warm-up's peak is not the timed runs'
            cuda.reset_peak_memory_stats(device)

    def _next(self, phase: str) -> None:
        """Fold the counters into the phase that ends, and start them again for ``phase``."""
        if self.cuda is not None:
            self.peak[self.phase] = max(self.peak[self.phase], self.cuda.max_memory_allocated(self.device))
            self.reserved = max(self.reserved, self.cuda.max_memory_reserved(self.device))
            self.cuda.reset_peak_memory_stats(self.device)
        self.phase = phase

    def run_starts(self) -> None:
        self._next("prefill")

    def prefill_done(self) -> None:
        self._next("decode")

    def fields(self) -> dict[str, float]:
        """``peak_gib`` (the runs' largest allocation total), ``peak_reserved_gib`` (what the allocator
        held at most, CUDA graphs' private pools included: an OOM with much memory in use but little
        allocated points there) and, where the clock marked the prefill's end, ``prefill_peak_gib`` and
        ``decode_peak_gib``."""
        if self.cuda is None:
            return {}
        self._next(self.phase)
        gib = lambda n: round(n / 2**30, 2)  # noqa: E731
        out = {"peak_gib": gib(max(self.peak.values())), "peak_reserved_gib": gib(self.reserved)}
        if self.peak["decode"]:
            out.update(prefill_peak_gib=gib(self.peak["prefill"]), decode_peak_gib=gib(self.peak["decode"]))
        return out


def _read_texts(path: Path) -> list[str]:
    """The texts of a .jsonl/.jsonl.gz file: each record's first string field of :data:`TEXT_FIELDS`."""
    from prhs_hf.hub.jsonl import read_jsonl

    if not path.name.endswith((".jsonl", ".jsonl.gz")) or not path.is_file():
        raise ValueError(f"--prompts: {path} is not a .jsonl or .jsonl.gz file")
    texts = [next((rec[f] for f in TEXT_FIELDS if isinstance(rec.get(f), str)), "") if isinstance(rec, dict) else ""
             for _, rec in read_jsonl(path)]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"--prompts: {path} holds no record with text in one of {', '.join(TEXT_FIELDS)}")
    return texts


@dataclass
class Target:
    """The model under test and how its prompts are made (``ids(B, L)``: ``[B, L]`` token ids)."""

    name: str
    weights: str
    prompts: str
    model: Any
    ids: Callable[[int, int], Any]
    max_positions: Optional[int]


def load_target(args: argparse.Namespace, device: Any, dtype: Any) -> Target:
    """A random-weight shape (:data:`SHAPES`) or a checkpoint folder, on ``device``, SDPA attention."""
    import torch
    import transformers

    gen = torch.Generator().manual_seed(0)
    if args.model in SHAPES:
        shape = {**SHAPES[args.model], **({"num_hidden_layers": args.layers} if args.layers else {})}
        config = transformers.LlamaConfig(**shape, max_position_embeddings=max(8192, max(args.length_list) + args.n2),
                                          eos_token_id=None, bos_token_id=None, pad_token_id=0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        ids = lambda b, n: torch.randint(1, shape["vocab_size"], (b, n), generator=gen).to(device)  # noqa: E731
        return Target(*_identity(args), model.eval(), ids, None)
    folder = Path(args.model).expanduser()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    vocab = model.config.get_text_config().vocab_size
    if not args.prompts:
        ids = lambda b, n: torch.randint(1, vocab, (b, n), generator=gen).to(device)  # noqa: E731
        return Target(*_identity(args), model, ids, model.config.max_position_embeddings)
    from prhs_hf.calibration.texts import special_prefix

    texts, tok = _read_texts(Path(args.prompts).expanduser()), transformers.AutoTokenizer.from_pretrained(folder)
    prefix, sep = special_prefix(tok), tok("\n\n", add_special_tokens=False)["input_ids"]
    cache: dict[int, list[int]] = {}

    def text_ids(batch: int, length: int) -> Any:
        """Sequence b: the prefix, then the records from b mod n on, blank lines between, cut at L."""
        rows = []
        for b in range(batch):
            row, rec = list(prefix), b % len(texts)
            while len(row) < length:
                row += (sep if len(row) > len(prefix) else []) + cache.setdefault(
                    rec, tok(texts[rec], add_special_tokens=False)["input_ids"])
                rec = (rec + 1) % len(texts)
            rows.append(row[:length])
        return torch.tensor(rows, dtype=torch.long, device=device)

    return Target(*_identity(args), model, text_ids, model.config.max_position_embeddings)


def prhs_config(name: str, telemetry: bool = False) -> tuple[str, dict[str, Any]]:
    """``(config, overrides)`` of a PrHS entry of ``--configs``: a shipped name, a named config of the
    result tables (:func:`~prhs_hf.evaluation.accuracy.configs.load_any_config`) or a YAML path, with
    ``/sparse``, ``/dense`` or ``/auto`` appended to force ``policy.decode`` and ``policy.prefill``
    (``cis/sparse``: the shipped ``cis`` on every forward, the measurement the policy is fitted to), and
    ``+plain``, ``+buffered``, ``+graphs`` or ``+auto`` last to set ``backend.eager_step`` (``cis/sparse+graphs``)."""
    name, _, step = name.partition("+")
    base, _, policy = name.partition("/") if not Path(name).suffix else (name, "", "")
    overrides: dict[str, Any] = {"telemetry": {"enabled": True}} if telemetry else {}
    if step:
        if step not in ("auto", "plain", "buffered", "graphs"):
            raise ValueError(f"--configs: {name}+{step}: the part after '+' is backend.eager_step: auto, plain, "
                             f"buffered or graphs")
        overrides["backend"] = {"eager_step": step}
    if policy:
        if policy not in ("auto", "sparse", "dense"):
            raise ValueError(f"--configs: {name!r}: the part after '/' is a policy: auto, sparse or dense")
        overrides["policy"] = {"decode": policy, "prefill": policy}
    return base, overrides


def _select(model: Any, name: str, telemetry: bool, stop_check_every: Optional[int] = None) -> None:
    """Put the model in config ``name`` and decode loop ``stop_check_every`` (see the module
    docstring; ``None``: the unpatched dense baselines, the PrHS config's own loop)."""
    import prhs_hf
    from prhs_hf import attention
    from prhs_hf.evaluation.accuracy.configs import load_any_config

    prhs_hf.unpatch(model)
    attention.register()
    model.set_attn_implementation(DENSE_CONFIGS.get(name, "sdpa"))
    loop = {} if stop_check_every is None else {"generation": {"stop_check_every": stop_check_every}}
    if name not in DENSE_CONFIGS:
        config = load_any_config(*prhs_config(name, telemetry))
        prhs_hf.patch(model, config, overrides=loop)
    elif stop_check_every not in (None, 1):
        prhs_hf.patch(model, loop)  # dense: the model's own attention, in the patched loop


def _fresh_compile(model: Any) -> None:
    """Forget compiled graphs, CUDA graphs and the static cache size of earlier cells."""
    import torch

    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
        model.__dict__.pop(attr, None)


def measure(target: Target, mode: str, batch: int, length: int, config: str, args: argparse.Namespace,
            stop_check_every: Optional[int] = None, phase: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """One row's measurements: warm-up, then the timed ``generate()`` (see the module docstring);
    ``phase("warm-up")`` and ``phase("timing")`` are called as each starts."""
    import torch
    import transformers

    import prhs_hf

    model, dev = target.model, target.model.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)  # noqa: E731
    ids = target.ids(batch, length)
    pad = model.generation_config.pad_token_id
    base = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0 if pad is None else pad)
    if mode == "static":
        base.update(cache_implementation="static", max_cache_len=length + args.n2)  # one cache size: one graph
    if args.prefill_chunk:
        base.update(prefill_chunk_size=args.prefill_chunk)  # transformers' chunked prefill: long batches fit

    def generate(n: int, clock: Optional[_Clock] = None) -> None:
        extra = {"logits_processor": transformers.LogitsProcessorList([clock])} if clock else {}
        if prhs_hf.is_patched(model):
            prhs_hf.reset(model)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **base, **extra)

    _select(model, config, args.telemetry, stop_check_every)
    if mode == "static":
        _fresh_compile(model)
    phase("warm-up")
    start = time.perf_counter()
    generate(args.n2)
    sync()
    row: dict[str, Any] = {"warmup_s": round(time.perf_counter() - start, 2)}
    phase("timing")
    peaks = PhasePeaks(torch.cuda if dev.type == "cuda" else None, dev)

    def timed_ms() -> float:
        """One timing of the decode steps N1 to N2: ms per step."""
        peaks.run_starts()
        if args.timing == "stamps":
            clock = _Clock((args.n1, args.n2), sync, peaks.prefill_done)
            generate(args.n2, clock)
            seconds = clock.stamps[args.n2] - clock.stamps[args.n1]
        else:
            took = {}
            for n in (args.n1, args.n2):
                sync()
                t0 = time.perf_counter()
                generate(n)
                sync()
                took[n] = time.perf_counter() - t0
            seconds = took[args.n2] - took[args.n1]
        return 1000.0 * seconds / (args.n2 - args.n1)

    runs = [timed_ms() for _ in range(args.repeats)]
    ms = statistics.median(runs)
    row.update(ms_per_step=ms, decode_tok_s=1000.0 * batch / ms if ms > 0 else None)
    if args.repeats > 1:
        row["ms_per_step_runs"] = [round(t, 3) for t in runs]
    row.update(peaks.fields())
    runtime = getattr(model, "_prhs_runtime", None)
    if runtime is not None and not is_dense_baseline(config):  # what the policy ran (its last decision)
        row["decode_steps"] = "sparse" if runtime.decodes_sparse() else "dense"
    if args.telemetry and prhs_hf.is_patched(model):
        row["rho_hat"] = prhs_hf.telemetry(model).retrieval_ratio
    return row


def available_host_bytes() -> Optional[int]:
    """The memory a new process could take without swapping (``MemAvailable`` of ``/proc/meminfo``);
    ``None`` where that file is not there."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _free_bytes(device: Any) -> Optional[int]:
    """Free GPU memory plus what torch's allocator holds unused, after a collection
    (:func:`prhs_hf.patching.free_device_bytes`); off CUDA the host's available memory
    (:func:`available_host_bytes`), so a cell that cannot fit is refused there too."""
    import torch

    from prhs_hf.patching import free_device_bytes

    gc.collect()
    if device.type != "cuda":
        return available_host_bytes()
    torch.cuda.empty_cache()
    return free_device_bytes(device)


def _cell(target: Target, mode: str, batch: int, length: int, config: str, args: argparse.Namespace,
          free: Optional[int], stop_check_every: Optional[int] = None,
          started: Callable[[dict[str, Any]], None] = lambda row: None) -> dict[str, Any]:
    """One row: the positions and memory checks, then :func:`measure` (an OOM is caught and recorded).
    ``started(row)`` gets the row so far, its status ``started: <phase>``, as each phase begins."""
    import torch

    import prhs_hf

    cfg = target.model.config.get_text_config()
    prompt_len = length
    if target.max_positions is not None and length + args.n2 > target.max_positions:
        prompt_len = target.max_positions - args.n2 if length <= target.max_positions else 0
    row: dict[str, Any] = {"model": target.name, "weights": target.weights, "prompts": target.prompts,
                           "layers": cfg.num_hidden_layers, "mode": mode, "batch": batch, "length": length,
                           "prompt_len": prompt_len, "config": config, "stop_check_every": stop_check_every,
                           "kind": "dense" if is_dense_baseline(config) else "prhs", "new_tokens": [args.n1, args.n2]}
    if prompt_len <= 0:
        return {**row, "status": "positions", "error": f"L + {args.n2} > max_position_embeddings {target.max_positions}"}
    need = estimate_bytes(cfg, batch=batch, length=prompt_len, new_tokens=args.n2, prefill_chunk=args.prefill_chunk,
                          itemsize=target.model.dtype.itemsize)
    row["estimate_gib"] = round(need / 2**30, 2)
    if free is not None:
        row["free_gib"] = round(free / 2**30, 2)
    if not fits(need, free):
        return {**row, "status": "memory"}
    error = None
    clock = time.perf_counter()

    def phase(name: str) -> None:
        started({**row, "status": f"started: {name}", "elapsed_s": round(time.perf_counter() - clock, 1)})

    try:
        row.update(measure(target, mode, batch, prompt_len, config, args, stop_check_every, phase), status="ok")
    except Exception as exc:  # noqa: BLE001 - a failing cell is recorded, the map goes on
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
        error = ("oom" if oom else "error", f"{type(exc).__name__}: {exc}"[:1200])  # an OOM's allocator summary
    if error is not None:  # outside the except block: its traceback (and the tensors it holds) is gone
        row.update(status=error[0], error=error[1])
    prhs_hf.unpatch(target.model)  # the patch's buffers would count as used in the next cell's free memory
    if mode == "static" or error is not None:
        _fresh_compile(target.model)
    if target.model.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table. ``N`` is the row's decode loop (``stop_check_every``; 1:
    transformers' loop), ``speedup`` against the fastest dense of the same loop, ``loop gain`` the
    config's ms/step in transformers' loop over the row's (``loop_speedup``). ``warm-up s`` is the
    row's untimed first ``generate()`` (a static cell's compilation is in it); ``peak GiB`` the memory
    PyTorch allocated at most."""
    head = (f"{'model':<22} {'mode':<6} {'N':>4} {'B':>3} {'L':>7} {'config':<20} {'ms/step':>9} {'speedup':>8} "
            f"{'fastest dense':<20} {'loop gain':>9} {'rho_hat':>7} {'steps':<6} {'warm-up s':>9} {'peak GiB':>8}  status")
    lines = [head, "-" * len(head)]
    times = lambda x: "" if x is None else f"{x:.2f}x"  # noqa: E731
    for r in rows:
        ms, rho = r.get("ms_per_step"), r.get("rho_hat")
        every, warm, peak = r.get("stop_check_every"), r.get("warmup_s"), r.get("peak_gib")
        lines.append(f"{r['model'][:22]:<22} {r['mode']:<6} {'' if every is None else every:>4} {r['batch']:>3} "
                     f"{r['length']:>7} {r['config'][:20]:<20} "
                     f"{'' if ms is None else f'{ms:.2f}':>9} {times(r.get('speedup_vs_fastest_dense')):>8} "
                     f"{(r.get('fastest_dense') or '')[:20]:<20} {times(r.get('loop_speedup')):>9} "
                     f"{'' if rho is None else f'{100 * rho:.1f}%':>7} "
                     f"{r.get('decode_steps') or '':<6} {'' if warm is None else f'{warm:.0f}':>9} "
                     f"{'' if peak is None else f'{peak:.2f}':>8}  {r['status']}")
    return "\n".join(lines)


def heat_cell(repeats: list[dict[str, Any]]) -> tuple[Optional[float], str]:
    """One heat-map cell from the rows of its (mode, B, L, config), a cell run more than once giving
    several: its colour, log2 of the median speedup (None: no row has one), and its text, the speedup
    or the range of the repeats' (``0.89–1.07``), else why there is none (the last row's status;
    ``not run`` for every status that starts so)."""
    speeds = sorted(r["speedup_vs_fastest_dense"] for r in repeats if r.get("speedup_vs_fastest_dense"))
    if not speeds:
        status = repeats[-1]["status"]
        return None, SHORT.get(status, NOT_RUN if status.startswith(NOT_RUN) else "n/a" if status == "ok" else "?")
    low, high = f"{speeds[0]:.2f}", f"{speeds[-1]:.2f}"
    return math.log2(statistics.median(speeds)), low if low == high else f"{low}–{high}"


@dataclass
class HeatPanel:
    """One panel of the heat map: a config's cells, a row per (mode, B) and a column per prompt length.
    ``values``: log2 of the speedup vs the fastest dense (None: no ratio, drawn grey); ``texts``: what
    each cell says (the speedup, then the steps the policy ran; or why there is none, ``not run`` for a
    cell with no row)."""

    title: str
    row_labels: list[str]
    column_labels: list[str]
    values: list[list[Optional[float]]]
    texts: list[list[str]]


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def heat_panels(rows: list[dict[str, Any]], configs: Optional[list[str]] = None) -> tuple[str, list[HeatPanel]]:
    """The heat map's title and panels: one panel per (model, prompts, N) group and config (``configs``,
    in that order; default: every config of the rows), each over the (mode, B) rows and lengths of its
    group, so every panel of a group has the same grid. Raises ``ValueError`` for a config with no row."""
    configs = configs or list(dict.fromkeys(r["config"] for r in rows))
    missing = [c for c in configs if not any(r["config"] == c for r in rows)]
    if missing:
        known = ", ".join(dict.fromkeys(r["config"] for r in rows))
        raise ValueError(f"no row of config {', '.join(missing)} to draw; the rows have {known}")
    group_of = lambda r: (r["model"], r["prompts"], r.get("stop_check_every"))  # noqa: E731
    groups = list(dict.fromkeys(group_of(r) for r in rows))
    names = [model + ("" if prompts == "random ids" else f" ({prompts})") + ("" if every is None else f", N {every}")
             for model, prompts, every in groups]
    panels = []
    for group, name in zip(groups, names):
        mine = [r for r in rows if group_of(r) == group]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        lines = [(m, b) for m in modes for b in sorted({r["batch"] for r in mine if r["mode"] == m}, reverse=True)]
        lengths = sorted({r["length"] for r in mine})
        for config in configs:
            values = [[None] * len(lengths) for _ in lines]
            texts = [[NOT_RUN] * len(lengths) for _ in lines]
            for y, (mode, batch) in enumerate(lines):
                for x, length in enumerate(lengths):
                    cell = (mode, batch, length, config)
                    repeats = [r for r in mine if (r["mode"], r["batch"], r["length"], r["config"]) == cell]
                    if not repeats:
                        continue
                    value, text = heat_cell(repeats)
                    steps = {r.get("decode_steps") for r in repeats} - {None}
                    values[y][x] = value
                    texts[y][x] = (f"{text}×" if value is not None else text) + (
                        f"\n{'/'.join(sorted(steps))} steps" if value is not None and steps else "")
            title = config if len(groups) == 1 else f"{name}\n{config}"
            panels.append(HeatPanel(title, [f"{m} · B{b}" for m, b in lines], [_length_label(n) for n in lengths],
                                    values, texts))
    return (names[0] if len(groups) == 1 else ""), panels


def draw_heatmap(rows: list[dict[str, Any]], png: Path, configs: Optional[list[str]] = None,
                 title: Optional[str] = None) -> Optional[str]:
    """The speed map as a PNG (:func:`heat_panels`: a panel per config, ``configs`` only where given):
    each cell coloured by its speedup vs the fastest dense of its mode, B and L on a fixed diverging
    scale, :data:`HEAT_RANGE` around 1× (a cell beyond it takes the end colour; its text gives the
    value), with the speedup and the steps the policy ran written in; a cell with no ratio is grey and
    says why (``not run``, ``oom``, ...). ``title``: the figure's (default: the model and prompts).
    Returns a one-line note instead when matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return f"matplotlib is not installed: {png.name} not drawn (pip install matplotlib; then prhs-hf bench --replot)"
    group, panels = heat_panels(rows, configs)
    title = title or group
    span = math.log2(HEAT_RANGE[1])
    cmap = plt.get_cmap("RdBu").with_extremes(bad="#e4e4e4")  # red: slower than the fastest dense, blue: faster
    n_rows, n_columns = max(len(p.row_labels) for p in panels), max(len(p.column_labels) for p in panels)
    columns = min(len(panels), 4)
    lines = -(-len(panels) // columns)
    size = (1.6 + (1.0 * n_columns + 1.2) * columns, 0.9 + (0.55 * n_rows + 0.9) * lines)
    fig, axes = plt.subplots(lines, columns, squeeze=False, layout="constrained", figsize=size)
    image = None
    for ax, panel in zip(axes.flat, panels):
        grid = np.array([[np.nan if v is None else v for v in line] for line in panel.values], dtype=float)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=-span, vmax=span, aspect="auto")
        for y, line in enumerate(panel.texts):
            for x, text in enumerate(line):
                value = panel.values[y][x]
                dark = value is not None and abs(value) > 0.6 * span
                ax.text(x, y, text, ha="center", va="center", fontsize=7.5,
                        color="white" if dark else ("black" if value is not None else "#707070"))
        ax.set_xticks(range(len(panel.column_labels)), panel.column_labels, fontsize=8)
        ax.set_yticks(range(len(panel.row_labels)), panel.row_labels, fontsize=8)
        ax.set_xlabel("prompt length", fontsize=8)
        ax.set_title(panel.title, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    ticks = [-1.0, -0.5, 0.0, 0.5, 1.0]
    bar = fig.colorbar(image, ax=axes, shrink=0.9, ticks=[t * span for t in ticks])
    bar.set_ticklabels([f"{2.0 ** (t * span):.2g}×" for t in ticks])
    bar.set_label("decode speed vs the fastest dense", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def add_arguments(parser: argparse.ArgumentParser, default_config: str) -> None:
    """The options of ``prhs-hf bench`` (no torch import: ``--help`` stays instant)."""
    a = parser.add_argument
    a("--model", default=None, help=f"{RANDOM_SHAPE} (random weights, bf16; default) or a checkpoint folder")
    a("--layers", type=int, default=None, help=f"cut the random {RANDOM_SHAPE} to N layers (quick runs)")
    a("--prompts", default=None, help=f"with a checkpoint: real text, .jsonl/.jsonl.gz ({'/'.join(TEXT_FIELDS)} field; "
                                      "default: random token ids)")
    a("--batches", default=None, help=f"comma list of B (default {BATCHES})")
    a("--lengths", default=None, help=f"comma list of L, 4096 or 4k (default {LENGTHS})")
    a("--modes", default=MODES, help="eager (DynamicCache) and/or static (StaticCache, compiled) (default %(default)s)")
    a("--configs", default=f"sdpa,sdpa_gqa,{default_config}/dense,{default_config},cis",
      help="comma list: sdpa, sdpa_gqa (dense baselines) and PrHS configs (shipped names, named configs of the "
           "result tables such as cis-s16, or YAML paths; "
           "NAME/sparse or NAME/dense forces the policy, a forced-dense one counting as a dense baseline "
           "(NAME/dense: the patched model's dense path, which a user can pick too: in eager cells on its "
           "buffered KV cache, no copy of the whole cache per step; its prefill without a [Lq, Lk] mask); "
           "NAME+plain|buffered|graphs sets backend.eager_step, default auto, eager cells only) (default %(default)s)")
    a("--n1", type=int, default=None, help=f"timing starts after this many new tokens (default {N1})")
    a("--n2", type=int, default=None, help=f"... and ends after this many (default {N2}); ms/step = Δt / (N2 - N1)")
    a("--repeats", type=int, default=1,
      help="time each row this many times after its warm-up; ms/step is their median, the runs go in "
           "ms_per_step_runs (an eager step is host-bound: single runs spread by about 8 %%) (default %(default)s)")
    a("--timing", choices=("stamps", "calls"), default="stamps",
      help="stamps: clock read after new tokens N1 and N2 of one generate(); calls: two generate() calls "
           "(default %(default)s)")
    a("--stop-check-every", default=None,
      help="comma list of N: every row runs in each of these decode loops, which read the all-finished flag every "
           "N steps (generation.stop_check_every; 1: every step, transformers' loop) (default: each PrHS config in "
           "its own loop, the dense baselines sdpa/sdpa_gqa in transformers' loop and in the PrHS configs' loops)")
    a("--prefill-chunk", type=int, default=None,
      help="prefill in chunks of this many tokens (generate's prefill_chunk_size): long batched prompts fit")
    a("--deadline-s", type=float, default=None, help="start no cell after this many seconds (rest: 'not run: deadline')")
    a("--out", default="docs/results/speed_map.json", help="JSON to write; the PNG goes beside it, named as it (default %(default)s)")
    a("--resume", action="store_true", help="keep the rows of --out (but error / deadline ones) and run only the others")
    a("--telemetry", action="store_true", help="PrHS telemetry on in the timed run (rho_hat column; adds work per step)")
    a("--assume-free-gib", type=float, default=None, help="plan with this much free GPU memory instead of measuring it")
    a("--quick", action="store_true", help=f"tiny random llama, 1 layer, B {QUICK['batches']}, L {QUICK['lengths']}, "
                                           f"{QUICK['n2']} new tokens, on whatever device is here")
    a("--replot", action="store_true", help="only redraw the PNG and print the table of an existing --out")


def _resolve(args: argparse.Namespace) -> None:
    quick = QUICK if args.quick else {}
    args.model = args.model or (QUICK_SHAPE_NAME if args.quick else RANDOM_SHAPE)
    args.batch_list = parse_lengths(args.batches or quick.get("batches", BATCHES), "--batches")
    args.length_list = parse_lengths(args.lengths or quick.get("lengths", LENGTHS), "--lengths")
    args.n1, args.n2 = args.n1 or quick.get("n1", N1), args.n2 or quick.get("n2", N2)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.loop_list = None
    if args.stop_check_every is not None:
        from prhs_hf.config import MAX_STOP_CHECK_EVERY

        tokens = [t.strip() for t in args.stop_check_every.split(",") if t.strip()]
        if not tokens or any(not t.isdigit() or not 1 <= int(t) <= MAX_STOP_CHECK_EVERY for t in tokens):
            raise ValueError(f"--stop-check-every: {args.stop_check_every!r}; allowed a comma list of ints in "
                             f"[1, {MAX_STOP_CHECK_EVERY}]")
        args.loop_list = list(dict.fromkeys(int(t) for t in tokens))
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if not 1 <= args.n1 < args.n2:
        raise ValueError(f"--n1/--n2: need 1 <= N1 < N2, got {args.n1}, {args.n2}")
    if not args.mode_list or set(args.mode_list) - set(MODES.split(",")):
        raise ValueError(f"--modes: {args.modes!r}; allowed: eager, static")
    if args.model not in SHAPES and not (Path(args.model).expanduser() / "config.json").is_file():
        raise ValueError(f"--model: {args.model!r} is neither {RANDOM_SHAPE} nor a checkpoint folder with a config.json")
    if args.model in SHAPES and args.prompts:
        raise ValueError("--prompts needs a checkpoint folder as --model (random shapes run on random ids)")
    if args.model not in SHAPES and args.layers:
        raise ValueError(f"--layers cuts a random shape ({RANDOM_SHAPE}) only, not a checkpoint")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be at least 1, got {args.layers}")


def _identity(args: argparse.Namespace) -> tuple[str, str, str]:
    """(model, weights, prompts) of this run's rows, known before the model loads."""
    if args.model in SHAPES:
        return args.model + (f"-{args.layers}L" if args.layers else ""), "random", "random ids"
    return Path(args.model).expanduser().resolve().name, "real", Path(args.prompts).name if args.prompts else "random ids"


def _command(args: argparse.Namespace) -> str:
    parts = ["prhs-hf bench", f"--model {args.model}", *([f"--layers {args.layers}"] if args.layers else []),
             *([f"--prompts {args.prompts}"] if args.prompts else []), f"--batches {','.join(map(str, args.batch_list))}",
             f"--lengths {','.join(map(str, args.length_list))}", f"--modes {','.join(args.mode_list)}",
             f"--configs {','.join(args.config_list)}", f"--n1 {args.n1} --n2 {args.n2} --timing {args.timing}",
             *([f"--repeats {args.repeats}"] if args.repeats > 1 else []),
             *([f"--stop-check-every {','.join(map(str, args.loop_list))}"] if args.loop_list else []),
             *([f"--deadline-s {args.deadline_s:g}"] if args.deadline_s is not None else []),
             *([f"--prefill-chunk {args.prefill_chunk}"] if args.prefill_chunk else []),
             f"--out {args.out}", *(f"--{f}" for f in ("resume", "telemetry") if getattr(args, f))]
    return " ".join(parts)


def _planned_key(row: dict[str, Any]) -> tuple:
    """A row's place in a run's plan: (model, prompts, mode, B, L, config, stop_check_every) as
    :func:`main` builds it from :func:`plan_cells`."""
    model, prompts, mode, batch, length, every = _key(row)
    return model, prompts, mode, batch, length, row["config"], every


def _write(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    rows.sort(key=lambda r: (r["model"], r["prompts"], r["mode"], r["batch"], r["length"]))  # stable: configs keep order
    add_speedups(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    tmp.replace(out)  # a run killed mid-write keeps the previous file


def _meta(args: argparse.Namespace, device: Any, earlier: dict[str, Any]) -> dict[str, Any]:
    import torch

    def version(name: str) -> str:
        try:
            return str(getattr(importlib.import_module(name), "__version__", "unknown"))
        except Exception as exc:  # noqa: BLE001 - optional (triton) or broken packages
            return f"not available: {type(exc).__name__}"

    gpu = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    return {"command": _command(args), "commands": [*earlier.get("commands", []), _command(args)], "gpu": gpu,
            "versions": {"torch": torch.__version__, "cuda": str(torch.version.cuda),
                         **{n: version(n) for n in ("transformers", "triton", "prhs_hf")}},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": os.environ.get("PRHS_GIT_COMMIT"),
            "timing": f"{args.timing}: ms/step = (t(N2) - t(N1)) / (N2 - N1), N1 {args.n1}, N2 {args.n2}"
                      + (f"; the median of {args.repeats} timed runs" if args.repeats > 1 else ""),
            "speedup": "fastest_dense's ms/step / the row's; fastest of the dense rows (sdpa, sdpa_gqa, a config "
                       "forced dense) of the same model, "
                       "prompts, mode, B, L and stop_check_every (the decode loop)",
            "loop_speedup": "the same config's ms/step in transformers' loop (stop_check_every 1) / the row's: "
                            "the patched loop's own gain, apart from sparsity",
            "loops": "each PrHS config in its own loop (generation.stop_check_every), the unpatched dense "
                     "baselines in transformers' loop (1) and in the PrHS configs' loops"
                     if args.loop_list is None else f"every config in each loop of {args.loop_list}"}


def main(args: argparse.Namespace) -> int:
    """Run ``prhs-hf bench``: the grid, the table, ``--out`` and the PNG beside it."""
    out = Path(args.out)
    png = out.with_suffix(".png")  # the JSON's own name: another --out in the folder keeps its picture
    if args.replot:
        rows = json.loads(out.read_text())["rows"]
        print(format_table(rows))
        print((draw_heatmap(rows, png) or f"wrote {png}") if rows else f"{out} has no rows: nothing to draw")
        return 0
    _resolve(args)
    import torch
    from tqdm import tqdm

    import prhs_hf
    from prhs_hf.evaluation.accuracy.configs import load_any_config

    own = {name: 1 if name in DENSE_CONFIGS  # a wrong name fails now, not after the first cells
           else load_any_config(*prhs_config(name)).generation.stop_check_every for name in args.config_list}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, weights, prompts = _identity(args)
    loops = config_loops(args.config_list, own, args.loop_list)
    plan = plan_cells(args.batch_list, args.length_list, args.mode_list, args.config_list, loops)
    planned = {(model, prompts, *cell) for cell in plan}
    earlier = json.loads(out.read_text()) if args.resume and out.is_file() else {}
    rows = [r for r in earlier.get("rows", []) if r["status"] in KEPT or _planned_key(r) not in planned]
    done = {_planned_key(r) for r in rows}
    meta, deadline, target = _meta(args, device, earlier), Deadline(args.deadline_s), None
    bar = tqdm([c for c in plan if (model, prompts, *c) not in done], desc="speed map", unit="cell",
               file=sys.stderr, mininterval=1.0)

    def started(partial: dict[str, Any]) -> None:
        """A row in progress goes into --out too: a run killed mid-cell shows where it stopped."""
        _write(out, meta, rows + [partial])
        bar.write(f"{partial['mode']} B{partial['batch']} L{partial['length']} {partial['config']}: "
                  f"{partial['status']} ({partial['elapsed_s']:.0f} s into the cell)")

    for mode, batch, length, config, every in bar:
        if deadline.passed():
            row = {"model": model, "weights": weights, "prompts": prompts, "mode": mode, "batch": batch,
                   "length": length, "config": config, "stop_check_every": every, "status": "not run: deadline"}
        else:
            if target is None:
                target = load_target(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
            free = int(args.assume_free_gib * 2**30) if args.assume_free_gib is not None else _free_bytes(device)
            row = _cell(target, mode, batch, length, config, args, free, every, started)
        rows.append(row)
        _write(out, meta, rows)
        ms = row.get("ms_per_step")
        bar.write(f"{mode}{'' if every is None else f' N{every}'} B{batch} L{length} {config}: " + (f"{ms:.2f} ms/step" if ms is not None else row["status"])
                  + (f" ({row['error'][:160]})" if row.get("error") else ""))
    if target is not None:
        prhs_hf.unpatch(target.model)
    _write(out, meta, rows)
    print(format_table(rows))
    print(f"wrote {out}")
    print(draw_heatmap(rows, png) or f"wrote {png}")
    return 0
