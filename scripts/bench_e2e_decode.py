"""End-to-end decode throughput with generate(): fair dense vs PrHS, eager vs static cache + compile.

Built-in shapes: random-weight models in bf16 (LLaMA-2-7B shape, MHA; one GQA shape) and random
token ids. ``--model PATH --prompts FILE``: a real HF checkpoint folder (bf16 on CUDA, fp32 on the
CPU) and real text, tokenized by the checkpoint's own tokenizer: each of the B sequences is
exactly L tokens of the records of FILE (a .jsonl or .jsonl.gz; the text of a record is its first
field of :data:`TEXT_FIELDS`) joined by blank lines, sequence b starting at record b mod n and
wrapping around, so the sequences differ. Every row says ``weights`` (random / real) and
``prompts`` (the file's name, or random ids). Then ``--new-tokens`` greedy tokens through
``model.generate``. Decode tokens/s is measured between the first and the last decode step by a
logits processor that synchronises and reads the clock (so prefill is excluded and reported apart).
Static + compiled runs use ``cache_implementation="static"`` (transformers 5.17 then compiles the
decode forward by itself); a warm-up generate() call of the same shape runs first so compilation is
not timed.

Two dense configs, run side by side: ``dense`` is transformers' SDPA path as shipped (with the
mask a static cache needs and GQA it ``repeat_kv``-copies K/V to every query head in every
layer: "dense (transformers sdpa, repeat_kv)"); ``dense-gqa`` runs the same model through
``_bench_common.fair_sdpa_attention`` (registered with transformers' AttentionInterface as
``sdpa_gqa``: SDPA with ``enable_gqa=True`` and the mask). Every row's ``speedup_vs_fastest_dense``
is against the faster of the dense rows of its case and mode, named in ``fastest_dense``.
PrHS configs (:data:`CONFIGS`) are a shipped YAML plus overrides: the ``cis-*``/``cpe-*`` ones
and ``ds-s16`` (Double Sparsity, 16 label channels, at cis-s16's budget) ``configs/cpe.yaml``
with overrides, ``cis`` ``configs/cis.yaml`` and ``cpe-calibrated``
``configs/cpe_qwen2.5-coder-1.5b.yaml`` as shipped (tau 0.8). The timed run has telemetry off, as
every shipped config has it (it adds work to each compiled step); ρ̂ and the processed KV come from a
second, eager generate() of the same prompts with telemetry on (``rho_hat_run`` in the JSON), or
from the timed run itself with ``--timed-telemetry`` (the behaviour before 2026-12-01).
FlashInfer is not an end-to-end config (its decode plans on the host, outside a compiled graph);
bench_decode_attention.py times it per layer.

    python scripts/bench_e2e_decode.py                   # the full table (H200: several minutes)
    python scripts/bench_e2e_decode.py --quick           # a tiny model on whatever device is here
    python scripts/bench_e2e_decode.py --model /tmp/prhs_gpu/ckpt-qwen2.5-coder-1.5b \\
        --prompts /tmp/data/coqa_validation.jsonl.gz --cases model:32:16384,model:32:32768 \\
        --modes static --configs dense-gqa,dense,cis  # real weights, real text

``--repeats N`` times each cell N times after its warm-up (the median run is the row; every run's
ms/step is kept): two runs of the real model a session apart moved the same config by up to 4 %.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import pstats
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import transformers
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

import _bench_common as common
import prhs_hf
from prhs_hf.calibration.texts import special_prefix
from prhs_hf.hub.jsonl import JSONLError, read_jsonl

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    # Qwen2.5-1.5B's attention and MLP sizes (12 q / 2 KV heads of 128) as a LLaMA: the real model's
    # decode kernels, shapes and launches without its checkpoint (no q/k/v biases, random weights)
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}

# (shape, batch, prompt length)
CASES = [("llama2-7b", 8, 16384), ("llama2-7b", 16, 4096), ("llama2-7b", 16, 8192), ("llama3-8b", 16, 16384)]
QUICK_CASES = [("tiny", 2, 512)]
#: --model's (batch, prompt length) cases: the issue's targets, and --quick's
MODEL_CASES = [(32, 16384), (32, 32768)]
QUICK_MODEL_CASES = [(2, 512)]

#: dense configs: the attention implementation the unpatched model runs with
DENSE_CONFIGS = {"dense": "sdpa", "dense-gqa": common.FAIR_ATTENTION}

class PatchConfig(NamedTuple):
    """A PrHS config of the table: a shipped YAML (``base``) and the overrides put on it."""

    base: Path
    overrides: dict


CPE = ROOT / "configs" / "cpe.yaml"
_CIS_ALONE = {"psaw": {"enabled": False}, "etf": {"enabled": False}}

#: config name -> None (a dense config, :data:`DENSE_CONFIGS`) or the PrHS patch it runs
CONFIGS: dict[str, PatchConfig | None] = {
    "dense": None,
    "dense-gqa": None,
    "cis-s8": PatchConfig(CPE, {"cis": {"block_size": 8}, **_CIS_ALONE}),
    "cis-s16": PatchConfig(CPE, {"cis": {"block_size": 16}, **_CIS_ALONE}),
    # Double Sparsity at cis-s16's budget: top-k by 16 label channels, its label cache in place
    "ds-s16": PatchConfig(CPE, {"baseline": {"name": "double_sparsity", "label_rank": 16}, **_CIS_ALONE}),
    "cpe-s16": PatchConfig(CPE, {"cis": {"block_size": 16}}),
    # Random weights give unrelated consecutive queries, so tau = 0.8 almost never shares
    # (rho-hat near 100 %). tau = -1 shares whenever the block has an anchor: rho-hat = 1/s,
    # the regime of real models (paper: 6-17 % at s = 16). Reported apart, and labelled.
    "cis-s8-share": PatchConfig(CPE, {"cis": {"block_size": 8, "tau": -1.0}, **_CIS_ALONE}),
    "cis-s16-share": PatchConfig(CPE, {"cis": {"block_size": 16, "tau": -1.0}, **_CIS_ALONE}),
    "cpe-s16-share": PatchConfig(CPE, {"cis": {"block_size": 16, "tau": -1.0}}),
    # group-shared selection (one index set per KV head, ranked by the group's max): the GQA option
    "cis-group-s16-share": PatchConfig(CPE, {"cis": {"block_size": 16, "tau": -1.0, "selection": "group"}, **_CIS_ALONE}),
    # as shipped (tau 0.8): real sharing, for real weights and real text (--model, --prompts)
    "cis": PatchConfig(ROOT / "configs" / "cis.yaml", {}),
    # the same with group-shared selection (one set per KV head): its real rho-hat and speed
    "cis-group": PatchConfig(ROOT / "configs" / "cis.yaml", {"cis": {"selection": "group"}}),
    # the same retrieving through the fp8 key index (cis.index; issue 38), for its per-stage profile
    "cis-fp8": PatchConfig(ROOT / "configs" / "cis.yaml", {"cis": {"index": "fp8"}}),
    # tau 0.7 + keep_anchor_local + dilation +-2: about half cis's retrievals (GSM8K 8-shot rho-hat 9.7 %)
    "cis-low-rho": PatchConfig(ROOT / "configs" / "cis_low_rho.yaml", {}),
    "cpe-calibrated": PatchConfig(ROOT / "configs" / "cpe_qwen2.5-coder-1.5b.yaml", {}),
    # EarlySelectKV on CIS (mid tap, exact W_q), its next layer's selection on the main stream, and
    # forked at the tap onto a side CUDA stream (issue 15: does the side stream hide it in the step?)
    "es-cis": PatchConfig(ROOT / "configs" / "cis.yaml", {"early_select": {"tap": "mid"}}),
    "es-cis-side": PatchConfig(ROOT / "configs" / "cis.yaml", {"early_select": {"tap": "mid", "side_stream": True}}),
    "es-cis-s16-share": PatchConfig(CPE, {"cis": {"block_size": 16, "tau": -1.0}, "early_select": {"tap": "mid"},
                                          **_CIS_ALONE}),
    "es-cis-side-s16-share": PatchConfig(CPE, {"cis": {"block_size": 16, "tau": -1.0},
                                               "early_select": {"tap": "mid", "side_stream": True}, **_CIS_ALONE}),
}

#: the fields a --prompts record may carry its text in, the first present wins
TEXT_FIELDS = ("story", "text", "context", "input")
#: the ``prompts`` of a row of random token ids
RANDOM_IDS = "random ids"


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
    """Runs a profiler over decode steps ``1 .. steps`` of a generate() call (prefill left out):
    ``start()`` at the first logits, ``stop()`` after step ``steps``, timing the window between."""

    def __init__(self, start: Callable[[], None], stop: Callable[[], None], steps: int, device: torch.device):
        self.start, self.stop, self.steps, self.device = start, stop, steps, device
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, input_ids, scores):
        if self.calls in (0, self.steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.calls == 0:
                self.start()
                self.seconds = -time.perf_counter()
            else:
                self.seconds += time.perf_counter()
                self.stop()
        self.calls += 1
        return scores


def build_model(shape: str, device: torch.device, dtype: torch.dtype, max_positions: int = 32768):
    """The random-weight llama of ``shape``, with room for ``max_positions`` tokens (at least 32,768): a
    case's prompt plus its new tokens (the rotary tables and StaticCache are sized from it)."""
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=max(32768, max_positions),
                                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load_checkpoint(folder: Path, device: torch.device, dtype: torch.dtype):
    """A local HF checkpoint folder's model (SDPA attention, eval mode, on ``device``) and tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model.to(device).eval(), tokenizer


def read_prompt_texts(path: Path) -> list[str]:
    """The texts of a ``--prompts`` file: one per JSON record of a .jsonl or .jsonl.gz file, its first
    field of :data:`TEXT_FIELDS` that holds a string. Raises ``ValueError`` naming --prompts."""
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        raise ValueError(f"--prompts: {path} is not a .jsonl or .jsonl.gz file")
    if not path.is_file():
        raise ValueError(f"--prompts: no such file: {path}")
    texts = []
    try:
        for number, record in read_jsonl(path):
            field = next((f for f in TEXT_FIELDS if isinstance(record, dict) and isinstance(record.get(f), str)), None)
            if field is None:
                raise ValueError(f"--prompts: {path.name}:{number}: no text field; a record needs a string in "
                                 f"one of the fields {', '.join(TEXT_FIELDS)}")
            if record[field].strip():
                texts.append(record[field])
    except JSONLError as exc:
        raise ValueError(f"--prompts: {exc}") from None
    if not texts:
        raise ValueError(f"--prompts: {path} holds no record with text")
    return texts


class TextPrompts:
    """Prompts of real text: ``batch(B, L)`` is ``[B, L]`` token ids of ``tokenizer``.

    Sequence ``b`` is the tokenizer's prefix (its BOS token, if it adds one), then the records
    from record ``b mod n`` on, each tokenized alone and joined by the tokens of a blank line
    (``"\\n\\n"``), wrapping around to the first record, cut at exactly ``L`` tokens.
    """

    def __init__(self, path: Path, tokenizer, texts: list[str] | None = None):
        self.name = path.name
        self.texts = read_prompt_texts(path) if texts is None else texts
        self.tokenizer = tokenizer
        self.prefix = special_prefix(tokenizer)
        self.sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        self._ids: dict[int, list[int]] = {}  # record -> its tokens, each record tokenized once

    def _tokens(self, record: int) -> list[int]:
        if record not in self._ids:
            self._ids[record] = self.tokenizer(self.texts[record], add_special_tokens=False)["input_ids"]
        return self._ids[record]

    def batch(self, batch: int, length: int) -> torch.Tensor:
        rows = []
        for b in range(batch):
            record = b % len(self.texts)
            row = list(self.prefix) + self._tokens(record)
            while len(row) < length:
                record = (record + 1) % len(self.texts)
                row += self.sep + self._tokens(record)
            rows.append(row[:length])
        return torch.tensor(rows, dtype=torch.long)


def parse_cases(text: str, model: Path | None) -> list[tuple[str, int, int]]:
    """``--cases``: ``shape:B:L`` entries (a shape of :data:`SHAPES`) or, with ``--model``, ``model:B:L``
    (the case's shape then is the checkpoint folder's name). Raises ``ValueError`` naming --cases."""
    form = "model:B:L (the word 'model', with --model)" if model else f"shape:B:L with a shape of {', '.join(SHAPES)}"
    cases = []
    for entry in text.split(","):
        parts = entry.split(":")
        ok = len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts[1:])
        if ok and model is not None:
            ok = parts[0] == "model"
        elif ok:
            ok = parts[0] in SHAPES
        if not ok:
            raise ValueError(f"--cases: {entry!r} is not of the form {form}, e.g. "
                             f"{'model:32:16384' if model else 'llama2-7b:8:16384'}")
        cases.append((model.name if model else parts[0], int(parts[1]), int(parts[2])))
    return cases


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


def select_config(model, name: str, telemetry: bool = False) -> None:
    """Put ``model`` in config ``name``: a dense attention implementation or a PrHS patch (with
    ``telemetry`` on or off, whatever the config file says)."""
    prhs_hf.unpatch(model)
    if name in DENSE_CONFIGS:
        impl = DENSE_CONFIGS[name]
        model.set_attn_implementation(common.register_fair_attention() if impl == common.FAIR_ATTENTION else impl)
        return
    entry = CONFIGS[name]
    model.set_attn_implementation("sdpa")
    prhs_hf.patch(model, entry.base, overrides={**entry.overrides, "telemetry": {"enabled": telemetry}})


def telemetry_row(model) -> dict:
    """The patched model's last-run statistics, as row fields: ρ̂, its share of KV groups (the keys an
    exact retrieval reads) and processed / dense KV per step."""
    report = prhs_hf.telemetry(model)
    return {"rho_hat": report.retrieval_ratio, "kv_group_rho_hat": report.kv_group_retrieval_ratio,
            "processed_kv": report.processed_kv_per_step, "dense_kv": report.dense_kv_per_step}


def run_generate(model, ids, new_tokens: int, static_cache=None, extra_processor=None, compiled: bool = True):
    """One generate() call; ``static_cache`` (reset here) makes it a static-cache run, compiled
    unless ``compiled`` is False (the same cache, eager: no second KV cache beside it)."""
    clock = StepClock(ids.device, new_tokens)
    processors = [clock] if extra_processor is None else [clock, extra_processor]
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  logits_processor=transformers.LogitsProcessorList(processors), attention_mask=torch.ones_like(ids))
    if static_cache is not None:
        static_cache.reset()
        kwargs["past_key_values"] = static_cache
        kwargs["compile_config"] = COMPILE_CONFIG
        kwargs["disable_compile"] = not compiled
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


def timed_runs(model, ids, new_tokens: int, static_cache, repeats: int) -> dict:
    """``repeats`` timed generate() calls (PrHS state reset before each): the median one by ms/step,
    plus ``ms_per_step_runs`` (all of them, in order) when there are several."""
    runs = []
    for _ in range(repeats):
        if prhs_hf.is_patched(model):
            prhs_hf.reset(model)
        runs.append(run_generate(model, ids, new_tokens, static_cache))
    row = dict(sorted(runs, key=lambda r: r["ms_per_step"])[(len(runs) - 1) // 2])
    if repeats > 1:
        row["ms_per_step_runs"] = [r["ms_per_step"] for r in runs]
    return row


#: kernel-name patterns -> family, first match wins (our Triton kernels, then cuBLAS/attention/rest)
KERNEL_FAMILIES = (
    ("cis match", ("_cis_match_kernel",)),
    ("retrieval", ("_compact_kernel", "_group_score_kernel", "_tilemax_select_kernel", "_radix_pass_kernel",
                   "_radix_collect_kernel", "_block_sort_kernel", "_merge_rank_kernel", "_merge_count_kernel",
                   "_rank_scatter_kernel", "_rerank_kernel")),
    ("key index write", ("_index_write_kernel",)),
    ("composition", ("_dilate_compose_kernel", "_dilated_set_kernel", "_dilated_mark_kernel", "_dilated_collect_kernel",
                     "_dilated_count_kernel", "_dilated_write_kernel", "_compose_sets_kernel", "_compose_kernel")),
    ("sparse attention", ("_sparse_attn_kernel", "_combine_kernel", "_union_mark_kernel", "_union_count_kernel",
                          "_union_write_kernel")),
    ("anchor record", ("_record_anchors_kernel",)),
    ("dense attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("linear (proj, MLP, head)", ("gemm", "gemv", "nvjet", "sm90_", "sm80_", "cutlass", "xmma", "cublas", "splitk")),
    # what torch.compile generated around them (norms, rotary, the cache write, the selectors' glue)
    ("inductor (fused glue)", ("triton_",)),
    ("aten (copy, index, reduce)", ("elementwise", "index", "scatter", "gather", "reduce", "copy", "memcpy", "memset",
                                    "fill", "cat", "sort", "topk")),
)


def _family(kernel: str) -> str:
    name = kernel.lower()
    for family, patterns in KERNEL_FAMILIES:
        if any(p.lower() in name for p in patterns):
            return family
    return "other kernels"


def step_breakdown(model, ids, steps: int, static_cache=None, trace: Path | None = None) -> tuple[dict, dict]:
    """Per decode step: GPU kernel time by family (torch.profiler, kernels of CUDA graphs included)
    and the rest of the step's wall time (launches, Python, idle GPU); and the pipeline's own
    kernels one by one (see :func:`kernel_breakdown`).

    The profiler runs over decode steps 1..``steps`` only (a logits processor starts and stops it),
    so the prefill's kernels are not in the window. Profiling slows the host side a little.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    prof = profile(activities=activities)
    window = ProfileWindow(prof.start, prof.stop, steps, ids.device)
    run_generate(model, ids, steps + 2, static_cache, extra_processor=window)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    kernels = [(evt.name, evt.device_time_total, evt.time_range.start, evt.time_range.end) for evt in prof.events()
               if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0]
    return kernel_breakdown(kernels, steps, 1000.0 * window.seconds / steps)


def host_profile(model, ids, steps: int, static_cache, top: int = 25) -> dict:
    """Where a compiled decode step's host time goes (static mode only).

    Two measurements in one generate() call of ``steps + 2`` tokens and after it:

    - ``cProfile`` over decode steps 1..``steps``: the step's wall time and the functions with the
      most own time per step (``top``; the time a step waits for the GPU shows in the function that
      synchronises: transformers' stop check reads the device every step);
    - the compiled decode call alone, ``steps`` times back to back with the last step's inputs (no
      synchronisation in between): ``compiled_step_ms`` is the larger of its GPU time and its host
      time, ``host_call_ms`` the host time of one call. A step's wall time minus
      ``compiled_step_ms`` is then the host work of the generate() loop that the GPU waits for.
      For a CIS config it is a lower bound: the repeated step's queries equal the anchors it just
      took, so every row shares (no retrieval).
    """
    if static_cache is None:
        raise ValueError("host_profile needs the static mode (a StaticCache and the compiled step)")
    room = static_cache.get_max_length()  # (as the runtime reads it: 5.23's StaticCache has no max_cache_len)
    if room < ids.shape[1] + 2 * steps + 2:
        raise ValueError(f"host_profile: {steps} profiled steps and as many back-to-back calls need "
                         f"{2 * steps + 2} new tokens of room in the cache, it has {room - ids.shape[1]}")
    profiler = cProfile.Profile()
    window = ProfileWindow(profiler.enable, profiler.disable, steps, ids.device)
    # the decode call generate() makes: the compiled one its warm-up made (transformers' get_compiled_call),
    # or the model's own __call__ where transformers skipped compilation (e.g. on a CPU)
    attr = "_compiled_call" if "_compiled_call" in model.__dict__ else "__call__"
    compiled = getattr(model, attr)
    seen = {}

    def recording(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return compiled(*args, **kwargs)

    setattr(model, attr, recording)
    try:
        run_generate(model, ids, steps + 2, static_cache, extra_processor=window)
    finally:
        if attr == "__call__":
            del model.__call__
        else:
            model._compiled_call = compiled
    stats = pstats.Stats(profiler).stats
    functions = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = {
        "steps": steps,
        "decode_call": "compiled" if attr == "_compiled_call" else "eager (transformers skipped compilation)",
        "step_ms": round(1000.0 * window.seconds / steps, 3),
        "top_functions": [{"function": f"{Path(file).name}:{line}({name})", "own_us": round(1e6 * tt / steps, 1),
                           "calls": round(nc / steps, 1)} for (file, line, name), (_, nc, tt, _, _) in functions],
    }
    if attr == "__call__":
        out["compiled_step_ms"] = out["host_call_ms"] = out["loop_host_ms"] = None
        return out
    host = 0.0
    graphs = counters["stats"].get("unique_graphs", 0)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            tick = time.perf_counter()
            result = compiled(*seen["args"], **seen["kwargs"])
            host += time.perf_counter() - tick
            del result
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    out["compiled_step_ms"] = round(1000.0 * (time.perf_counter() - start) / steps, 3)
    out["host_call_ms"] = round(1000.0 * host / steps, 3)
    out["loop_host_ms"] = round(out["step_ms"] - out["compiled_step_ms"], 3)
    if counters["stats"].get("unique_graphs", 0) != graphs:
        out["recompiled"] = "the back-to-back calls compiled a new graph: compiled_step_ms includes it"
    return out


PIPELINE_FAMILIES = ("cis match", "retrieval", "composition", "sparse attention", "anchor record")


def kernel_breakdown(kernels: list[tuple[str, float, float, float]], steps: int, step_ms: float) -> tuple[dict, dict]:
    """``kernels``: (name, GPU µs, start µs, end µs) of every kernel in ``steps`` profiled steps of
    ``step_ms`` wall time each.

    Returns the GPU time per step by family (ms), with all kernels, the step's wall time and the part
    of it not in kernels, the GPU's idle time inside the span of the kernels and the kernels per
    step; and the decode pipeline's own kernels one by one
    (``{name: {"ms": per step, "launches": per step}}``, slowest first), which says which stage of
    a family (e.g. the retrieval's score or its select passes) takes the time."""
    fam: dict[str, float] = {}
    own: dict[str, list[float]] = {}
    first, last = float("inf"), 0.0
    for name, us, start, end in kernels:
        family = _family(name)
        fam[family] = fam.get(family, 0.0) + us / 1000.0 / steps
        if family in PIPELINE_FAMILIES:
            own.setdefault(name, []).append(us)
        first, last = min(first, start), max(last, end)
    out = {k: round(v, 3) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])}
    gpu = sum(out.values())
    out["all kernels"] = round(gpu, 3)
    out["step (profiled)"] = round(step_ms, 3)
    out["not kernels (launch, Python, idle)"] = round(max(step_ms - gpu, 0.0), 3)
    # the GPU's idle time between its first and last kernel: gaps between kernels and between steps
    out["idle inside the kernel span"] = round(max((last - first) / 1000.0 / steps - gpu, 0.0), 3) if kernels else 0.0
    out["kernels per step"] = round(len(kernels) / steps, 1)
    # per step, and per launch (median and largest: a data-dependent slow path shows in the tail)
    own_out = {name: {"ms": round(sum(us) / 1000.0 / steps, 3), "launches": round(len(us) / steps, 1),
                      "median_us": round(sorted(us)[len(us) // 2], 1), "max_us": round(max(us), 1)}
               for name, us in sorted(own.items(), key=lambda kv: -sum(kv[1]))}
    return out, own_out


def _cudagraphs(row: dict) -> str:
    if "cudagraph_skips" not in row:
        return "not checked"
    return "skipped" if row["cudagraph_skips"] else "on"


def _case(row: dict) -> tuple:
    """A row's case: shape, batch, prompt length and prompt source (rows of before --prompts: random ids)."""
    return row["shape"], row["batch"], row["prompt"], row.get("prompts", RANDOM_IDS)


def add_speedups(rows: list[dict]) -> None:
    """Each measured row against the fastest dense row (most decode tok/s) of its case and mode.

    Sets ``fastest_dense`` (its config name), ``speedup_vs_fastest_dense``, ``peak_vs_fastest_dense``
    and, for the record, ``speedup_vs_dense_transformers`` (against ``dense``, transformers' path).
    """
    for row in rows:
        for key in ("fastest_dense", "speedup_vs_fastest_dense", "peak_vs_fastest_dense", "speedup_vs_dense_transformers"):
            row.pop(key, None)
        if "decode_tok_s" not in row:
            continue
        dense = {r["config"]: r for r in rows if r["config"] in DENSE_CONFIGS and _case(r) == _case(row)
                 and r["mode"] == row["mode"] and "decode_tok_s" in r}
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
        runs = r.get("ms_per_step_runs")
        ms = f"{r['ms_per_step']:.2f}" + (f" ({min(runs):.2f}–{max(runs):.2f}, {len(runs)} runs)" if runs else "")
        lines.append(f"| {r['shape']} | {r['batch']} | {r['prompt']} | {r['mode']} | {r['config']} | {r['decode_tok_s']:.1f} | "
                     f"{ms} | {sp} | {spt} | {r['prefill_s']:.2f} | {r['peak_gib']:.1f} | {rho} | {kv} |")
    breakdowns = [r for r in rows if "breakdown_ms_per_step" in r]
    if breakdowns:
        families = list(dict.fromkeys(k for r in breakdowns for k in r["breakdown_ms_per_step"]))
        lines += ["", "Per decode step, ms (torch.profiler; GPU time by kernel family, then the rest):", "",
                  "| shape | B | prompt | mode | config | " + " | ".join(families) + " |", "|" + "---|" * (5 + len(families))]
        for r in breakdowns:
            b = r["breakdown_ms_per_step"]
            lines.append(f"| {r['shape']} | {r['batch']} | {r['prompt']} | {r['mode']} | {r['config']} | "
                         + " | ".join(f"{b[k]:.2f}" if k in b else "–" for k in families) + " |")
    own = [r for r in rows if r.get("pipeline_kernels_per_step")]
    if own:
        lines += ["", "The decode pipeline's own kernels per step, ms (launches; median/largest launch), slowest first:", ""]
        lines += [f"- {r['config']} B{r['batch']} L{r['prompt']}: " + ", ".join(
            f"`{name}` {v['ms']:.2f} ({v['launches']:g}" + (f"; {v['median_us']:.0f}/{v['max_us']:.0f} µs" if "max_us" in v else "")
            + ")" for name, v in r["pipeline_kernels_per_step"].items())
            for r in own]
    hosts = [r for r in rows if "host_profile" in r]
    if hosts:
        lines += ["", "Host side of a decode step, ms (cProfile over the steps; then the compiled step alone, "
                      "back to back: the larger of its GPU and host time, and its host time per call; for CIS a lower "
                      "bound, the repeated query shares its own anchor):", "",
                  "| config | B | prompt | step (profiled) | compiled step alone | host per compiled call "
                  "| generate() loop host | most own time per step (µs) |", "|" + "---|" * 8]
        for r in hosts:
            h = r["host_profile"]
            top = ", ".join(f"`{f['function']}` {f['own_us']:.0f}" for f in h["top_functions"][:6])
            ms = [("–" if h[k] is None else f"{h[k]:.2f}") for k in ("compiled_step_ms", "host_call_ms", "loop_host_ms")]
            lines.append(f"| {r['config']} | {r['batch']} | {r['prompt']} | {h['step_ms']:.2f} | " + " | ".join(ms) + f" | {top} |")
    compiled = [r for r in rows if "compiled_graphs" in r]
    if compiled:
        lines += ["", "Static mode, what was compiled (fullgraph=True, reduce-overhead): "
                  + "; ".join(f"{r['config']} B{r['batch']} L{r['prompt']}: {r['compiled_graphs']} graph(s), "
                              f"{r['graph_breaks']} break(s), CUDA graphs "
                              f"{_cudagraphs(r)}, warm-up {r['warmup_s']:.0f} s"
                              for r in compiled)]
    runs = sorted({r["rho_hat_run"] for r in rows if "rho_hat_run" in r})
    if runs:
        lines += ["", f"ρ̂ and processed KV: from the {' / '.join(runs)} (the timed runs have telemetry "
                      f"{'on' if runs == ['timed run'] else 'off, as the shipped configs'})."]
    table = "\n".join(lines)
    sources = dict.fromkeys(f"{r['shape']}: {r.get('weights', 'random')} weights, prompts {r.get('prompts', RANDOM_IDS)}"
                            for r in rows)
    meta = common.run_metadata(
        device, argv,
        commands=None,  # every command whose rows are here (--resume), filled in below
        new_tokens=new_tokens,
        dense_configs={"dense": common.DENSE_LABELS["transformers"], "dense-gqa": common.DENSE_LABELS["sdpa_gqa"]
                       + f" (attention function {common.FAIR_ATTENTION!r})"},
        speedups="against the fastest dense config of the same case (prompt source included) and mode (fastest_dense)",
        model=args.model,
        prompts=Path(args.prompts).name if args.prompts else RANDOM_IDS,
        configs={name: None if entry is None else {"base": str(entry.base.relative_to(ROOT)), "overrides": entry.overrides}
                 for name, entry in CONFIGS.items()},
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
        f"On {meta['gpu']}, {meta['date']}, commit {meta['git_commit']}:\n\n{commands}\n\n"
        f"{'; '.join(sources)}.\n\n{table}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, a few tokens")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--cases", default=None,
                        help="comma list of shape:batch:prompt, e.g. llama2-7b:8:16384; with --model: model:batch:prompt")
    parser.add_argument("--model", default=None,
                        help="a local HF checkpoint folder (config.json, weights, tokenizer): real weights instead of a shape")
    parser.add_argument("--prompts", default=None,
                        help=f"with --model: real text, a .jsonl or .jsonl.gz file whose records carry it in one of "
                             f"{', '.join(TEXT_FIELDS)} (without --model the prompts are random ids)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {list(CONFIGS)}")
    parser.add_argument("--modes", default="eager,static", help="eager (DynamicCache) and/or static (StaticCache + compile)")
    parser.add_argument("--timed-telemetry", action="store_true",
                        help="keep PrHS telemetry on in the timed run and read ρ̂ from it (default: off there, "
                             "and ρ̂ from a second, eager run with it on)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="also profile this many decode steps per cell: GPU time by kernel family, and overhead")
    parser.add_argument("--host-profile-steps", type=int, default=0,
                        help="static mode: also cProfile this many decode steps per cell and time the compiled "
                             "step alone, back to back (host_profile in the JSON: where the host time goes)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--trace-dir", default=None, help="with --profile-steps: write each cell's Chrome trace here")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of an existing OUT/bench_e2e_decode.json and run only the missing cells")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed generate() runs per cell after the warm-up (default 1); the row is the median "
                             "run by ms/step, with every run's ms/step beside it (ms_per_step_runs): the spread "
                             "says how far apart two configs must be to differ")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = Path(args.model).expanduser() if args.model else None
    if model_dir is not None and not (model_dir / "config.json").is_file():
        parser.error(f"--model: {model_dir} is not a checkpoint folder with a config.json")
    if model_dir is not None and not args.prompts:
        parser.error("--model needs --prompts FILE (real text: a .jsonl or .jsonl.gz file)")
    if args.prompts and model_dir is None:
        parser.error("--prompts needs --model PATH (the built-in shapes run on random ids)")
    if model_dir is None:
        cases = QUICK_CASES if args.quick else CASES
    else:
        cases = [(model_dir.name, b, l) for b, l in (QUICK_MODEL_CASES if args.quick else MODEL_CASES)]
    try:
        if args.cases:
            cases = parse_cases(args.cases, model_dir)
        texts = read_prompt_texts(Path(args.prompts).expanduser()) if args.prompts else None
    except ValueError as exc:
        parser.error(str(exc))
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
    source = Path(args.prompts).name if args.prompts else RANDOM_IDS
    done = {(*_case(r)[:3], r["mode"], r["config"]) for r in rows if _case(r)[3] == source}
    plan = [(c, m, cfg) for c in cases for m in modes for cfg in configs if (*c, m, cfg) not in done]
    skips = CudagraphSkips()
    model_key, model, prompts = None, None, None
    for (shape, batch, length), mode, name in common.progress(plan, "e2e decode"):
        print(f"\n{shape} B{batch} L{length} {mode} {name}", flush=True)
        if model_key != shape:
            model = None
            torch.cuda.empty_cache() if device.type == "cuda" else None
            if model_dir is None:
                longest = max(length for s, _, length in cases if s == shape) + args.new_tokens
                model, model_key = build_model(shape, device, dtype, longest), shape
            else:
                model, tokenizer = load_checkpoint(model_dir, device, dtype)
                model_key, prompts = shape, TextPrompts(Path(args.prompts).expanduser(), tokenizer, texts)
        select_config(model, name, telemetry=args.timed_telemetry)
        if prompts is None:
            ids = torch.randint(1, SHAPES[shape]["vocab_size"], (batch, length), device=device)
        else:
            ids = prompts.batch(batch, length).to(device)
        row = {"shape": shape, "weights": "random" if model_dir is None else "real", "prompts": source,
               "batch": batch, "prompt": length, "mode": mode, "config": name}
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
            # warm-up: compile, autotune, allocator. Eager runs as many steps as the timed run: its
            # kernels meet each step's cache length, and a Triton variant first met later compiles
            # inside the timed steps (H200, llama2-7b B8/16k eager: 167 ms/step after a 16-token
            # warm-up, 57 with every variant compiled); the compiled step is one graph.
            warm_tokens = min(new_tokens, 16) if mode == "static" else new_tokens
            run_generate(model, ids, warm_tokens, cache)
            row["warmup_s"] = time.perf_counter() - start
            row.update(timed_runs(model, ids, new_tokens, cache, args.repeats))
            if mode == "static":
                # what was compiled: graphs captured, graph breaks, and whether the timed run recompiled
                row["compiled_graphs"] = counters["stats"].get("unique_graphs", 0)
                row["graph_breaks"] = sum(counters["graph_break"].values())
                row["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0)
                if skips.messages:
                    row["cudagraph_skip_reasons"] = sorted(set(skips.messages))
            if prhs_hf.is_patched(model) and args.timed_telemetry:
                row.update(telemetry_row(model), rho_hat_run="timed run")
            if args.profile_steps:  # after the timed run's telemetry was read
                if prhs_hf.is_patched(model):
                    prhs_hf.reset(model)
                trace = Path(args.trace_dir) / f"{shape}-B{batch}-L{length}-{mode}-{name}.json" if args.trace_dir else None
                row["breakdown_ms_per_step"], row["pipeline_kernels_per_step"] = step_breakdown(
                    model, ids, args.profile_steps, cache, trace)
            if args.host_profile_steps and mode == "static":
                if prhs_hf.is_patched(model):
                    prhs_hf.reset(model)
                row["host_profile"] = host_profile(model, ids, args.host_profile_steps, cache)
            if prhs_hf.is_patched(model) and not args.timed_telemetry:
                # ρ̂ of the same prompts and tokens, from an untimed eager run with telemetry on; in
                # static mode in the cell's own cache (a second cache of a 7B model at B8/16k does
                # not fit beside it on a 141 GB GPU)
                select_config(model, name, telemetry=True)
                run_generate(model, ids, new_tokens, cache, compiled=False)
                row.update(telemetry_row(model), rho_hat_run="eager, telemetry on")
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
