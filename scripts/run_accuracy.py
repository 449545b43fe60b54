#!/usr/bin/env python
"""The PrHS accuracy table: GSM8K and CoQA for a list of PrHS configs on one model.

Tasks (``--tasks``, default ``gsm8k,coqa``): ``gsm8k`` (zero-shot chat prompt), ``gsm8k_cot``
(lm-eval's 8-shot ``gsm8k-cot`` prompt, 726–891 Qwen2.5 tokens: PrHS at a longer context) and ``coqa``;
the long-context suite ``ruler_<task>_<length>`` (files prepared by ``prhs-hf ruler prepare`` in
``--data-dir``; ``ruler`` = every prepared file there; docs/LONG_CONTEXT.md).

Two engines, one set of prompts and one scoring code (``prhs_hf.evaluation.lm_eval.prompts`` / ``.metrics``):

- ``--engine direct`` (default): no lm-eval, no ``datasets``; reads the converted JSONL and
  generates in left-padded batches (``prhs_hf.evaluation.accuracy.direct``). For the GPU machine.
- ``--engine lm-eval``: the same through lm-eval's ``simple_evaluate`` with the ``prhs`` model and
  the local tasks ``gsm8k_chat_local`` (chat template on), ``gsm8k_cot_local`` and ``coqa_local``.

Each config × task row gets the task's metrics (GSM8K strict-match / flexible-extract exact match,
CoQA EM / F1), ρ̂ and processed KV per decode step from the PrHS telemetry, examples and seconds
(and, direct engine only, the prefill seconds within them; lm-eval rows leave it empty).
The JSON (``--out``) and a Markdown table beside it are rewritten after every row, so a run cut
short keeps what it finished; ``--resume`` skips the rows already there and ``--max-seconds``
stops before a row that would not fit (for time-limited machines). A config whose selector is
not implemented yet is kept as a ``not implemented`` row.

Examples::

    python scripts/run_accuracy.py --model smollm2-135m --limit 2            # CPU smoke run
    python scripts/run_accuracy.py --model ckpt/ --device cuda --batch-size 128 --configs dense,cis-s16,cpe
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from tqdm.auto import tqdm

import prhs_hf
from prhs_hf.hub import fetch
from prhs_hf.evaluation.accuracy import configs as accuracy_configs
from prhs_hf.evaluation.accuracy import direct, report
from prhs_hf.evaluation.accuracy.configs import NamedConfig
from prhs_hf.evaluation.accuracy.direct import DirectTask
from prhs_hf.evaluation.accuracy.report import Row
from prhs_hf.evaluation.lm_eval.data import load_rows

import _bench_common as common  # beside this script (its folder is first on sys.path)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_OUT = "docs/results/accuracy.json"


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=fetch.DEFAULT_MODEL,
                   help=f"registered model ({', '.join(fetch.MODELS)}), a .gguf file or a checkpoint folder "
                        f"(default {fetch.DEFAULT_MODEL})")
    p.add_argument("--engine", choices=("direct", "lm-eval"), default="direct")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, else float32), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1…")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="direct engine: also at most this many padded prompt tokens per batch (long prompts get "
                        "smaller batches; default: no limit)")
    p.add_argument("--limit", type=int, default=None, help="first N examples of each task (default: all)")
    p.add_argument("--tasks", default="gsm8k,coqa",
                   help=f"comma list of {', '.join(direct.DIRECT_TASKS)}, ruler_<task>_<length> or ruler (every "
                        f"RULER file prepared in --data-dir)")
    p.add_argument("--configs", default=",".join(accuracy_configs.DEFAULT_CONFIGS),
                   help="comma list of named configs (" + ", ".join(accuracy_configs.ACCURACY_CONFIGS)
                        + ") or YAML paths; default all")
    p.add_argument("--policy", choices=accuracy_configs.ACCURACY_POLICIES, default="sparse",
                   help="policy.decode and policy.prefill of every config (default sparse: every forward of a sparse "
                        "config runs sparse, so a row measures the method whatever this machine's cost model would "
                        "pick; config: each config's own policy section)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="override every task's generation length (default: gsm8k 384, gsm8k_cot 256, coqa 256)")
    p.add_argument("--data-dir", default=None,
                   help="folder with gsm8k_test.jsonl[.gz] and coqa_validation.jsonl[.gz] "
                        "(default $PRHS_HF_DATA_DIR, else the prhs-hf cache)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON report; the .md table goes beside it (default {DEFAULT_OUT})")
    p.add_argument("--resume", action="store_true", help="keep the finished rows of an existing --out and skip them")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="do not start a row that would end after this many seconds from the start")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is far faster on a crowded CPU)")
    p.add_argument("--save-samples", action="store_true",
                   help="direct engine: also write every generation and its scores to <out>.samples.jsonl")
    return p


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


class Engine(Protocol):
    """Evaluates one config on one task."""

    def run(self, config: NamedConfig, task: DirectTask, limit: int | None, bar: tqdm) -> tuple[Row, list[dict]]:
        """The row, and the per-example samples (possibly none)."""


class DirectEngine:
    """Patch the model with the config, then generate and score with ``prhs_hf.evaluation.accuracy.direct``."""

    def __init__(self, model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", batch_size: int,
                 data_dir: str | None, max_new_tokens: int | None, batch_tokens: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.data_dir, self.max_new_tokens = batch_size, data_dir, max_new_tokens
        self.batch_tokens = batch_tokens
        self._docs: dict[tuple[str, int | None], list[dict[str, Any]]] = {}

    def _load(self, task: DirectTask, limit: int | None) -> list[dict[str, Any]]:
        key = (task.dataset, limit)
        if key not in self._docs:
            self._docs[key] = (task.load(self.data_dir, limit) if task.load is not None
                               else load_rows(task.dataset, self.data_dir, limit))
        return self._docs[key]

    def run(self, config: NamedConfig, task: DirectTask, limit: int | None, bar: tqdm) -> tuple[Row, list[dict]]:
        docs = self._load(task, limit)
        cfg = accuracy_configs.load_named_config(config)
        with prhs_hf.patch(self.model, cfg):
            prhs_hf.reset(self.model)
            bar.reset(total=len(docs))
            result = direct.evaluate(self.model, self.tokenizer, task, docs, self.batch_size, self.max_new_tokens,
                                     on_batch=bar.update, batch_tokens=self.batch_tokens)
            telemetry = prhs_hf.telemetry(self.model).as_dict()
        row = Row.from_telemetry(config.name, task.name, result.metrics, result.n, result.seconds, result.new_tokens,
                                 telemetry, cfg.to_dict(), prefill_seconds=result.prefill_seconds,
                                 prompt_tokens=result.prompt_tokens)
        samples = [{"config": config.name, "task": task.name, **s} for s in result.samples]
        return row, samples


class LmEvalEngine:
    """The same through lm-eval: ``PrHSLM`` around the loaded model, re-patched per config."""

    def __init__(self, model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", batch_size: int,
                 data_dir: str | None, max_new_tokens: int | None):
        import prhs_hf.evaluation.lm_eval as ple

        PrHSLM = ple.register()
        self.lm = PrHSLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                         prhs_config=accuracy_configs.ACCURACY_CONFIGS["dense"].base)
        self.task_manager = ple.task_manager(include_defaults=False,
                                             metadata={"data_dir": data_dir} if data_dir else None)
        self._task_managers: dict[str, Any] = {}  # per task with metadata of its own (a RULER length)
        self.data_dir = data_dir
        self.gen_kwargs = {"max_gen_toks": max_new_tokens} if max_new_tokens else None

    def run(self, config: NamedConfig, task: DirectTask, limit: int | None, bar: tqdm) -> tuple[Row, list[dict]]:
        import lm_eval

        cfg = self.lm.configure(config.base, config.overrides)
        start = time.perf_counter()
        manager = self.task_manager
        if task.lm_eval_metadata:
            import prhs_hf.evaluation.lm_eval as ple

            if task.name not in self._task_managers:
                meta = {**({"data_dir": self.data_dir} if self.data_dir else {}), **task.lm_eval_metadata}
                self._task_managers[task.name] = ple.task_manager(include_defaults=False, metadata=meta)
            manager = self._task_managers[task.name]
        res = lm_eval.simple_evaluate(model=self.lm, tasks=[task.lm_eval_task], task_manager=manager,
                                      limit=limit, apply_chat_template=task.chat,
                                      gen_kwargs=self.gen_kwargs, bootstrap_iters=0, verbosity="WARNING")
        seconds = time.perf_counter() - start
        metrics = _lm_eval_metrics(res["results"][task.lm_eval_task])
        if task.lm_eval_metadata:  # a RULER length: lm-eval's per-length metrics repeat the overall one
            metrics = {k: v for k, v in metrics.items() if not k.isdigit()}
        n = int(res["n-samples"][task.lm_eval_task]["effective"])
        telemetry = self.lm.prhs_telemetry.get(task.lm_eval_task, {}).get("generate_until", {})
        return Row.from_telemetry(config.name, task.name, metrics, n, seconds, 0, telemetry, cfg.to_dict()), []


def _lm_eval_metrics(task_results: dict[str, Any]) -> dict[str, float]:
    """``{"exact_match,strict-match": x, "em,none": y, …}`` → ``{"strict-match": x, "em": y}``."""
    out = {}
    for key, value in task_results.items():
        metric, sep, filt = key.partition(",")
        if not sep or metric.endswith("_stderr") or not isinstance(value, (int, float)):
            continue
        out[filt if filt != "none" else metric] = float(value)
    return out


def _status_for(exc: BaseException) -> str:
    return report.STATUS_NOT_IMPLEMENTED if isinstance(exc, NotImplementedError) else report.STATUS_ERROR


#: A row of a task not run yet is estimated from other tasks' rows; this covers what the estimate
#: misses (a 32k RULER row scaled from a 16k one measured 52 s against 46 s on the H200).
UNSEEN_MARGIN = 1.25


def _ruler_length(name: str) -> int | None:
    """The context length of a ``ruler_<task>_<length>`` name, None for other tasks."""
    head, _, length = name.rpartition("_")
    return int(length) if head.startswith("ruler_") and length.isdigit() else None


def estimate_seconds(task: str, longest: Mapping[str, float]) -> float:
    """The time the next row of ``task`` is expected to take, for ``--max-seconds``: the longest row of
    that task so far; for a task not run yet, the longest row of any task, scaled by the context length
    for RULER tasks (``ruler_<task>_<length>``: prefill and decode grow with the length), times
    :data:`UNSEEN_MARGIN`; 0 before the first row."""
    if task in longest:
        return longest[task]
    if not longest:
        return 0.0
    length = _ruler_length(task)
    scaled = [seconds * length / other for name, seconds in longest.items()
              if length is not None and (other := _ruler_length(name))]
    return UNSEEN_MARGIN * max(scaled or longest.values())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; returns the exit status (0 also when ``--max-seconds`` left rows for ``--resume``)."""
    args = build_parser().parse_args(argv)
    wall = time.perf_counter()
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    names = [n for t in names for n in (direct.ruler_task_names(args.data_dir) if t == "ruler" else [t])]
    tasks = [direct.task_named(t) for t in names]
    configs = [accuracy_configs.with_policy(accuracy_configs.named_config(c.strip()), args.policy)
               for c in args.configs.split(",") if c.strip()]
    device = _device(args.device)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    meta = {
        "command": shlex.join(["scripts/run_accuracy.py", *(sys.argv[1:] if argv is None else argv)]),
        "model": args.model, "engine": args.engine, "dtype": args.dtype, "device": device,
        "batch_size": args.batch_size, "batch_tokens": args.batch_tokens, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
        "policy": args.policy,
        "tasks": [t.name for t in tasks], "configs": [c.name for c in configs],
        "environment": report.environment(device),
        "commit": common.git_commit(),  # PRHS_GIT_COMMIT on the GPU machine (its copy has no .git)
    }
    rows: dict[tuple[str, str], Row] = {}
    if args.resume:
        rows = {(r.config, r.task): r for r in report.load_rows(args.out) if r.status == report.STATUS_OK}
        if rows:
            meta["earlier_runs"] = report.earlier_runs(args.out)
    plan = [(c, t) for c in configs for t in tasks if (c.name, t.name) not in rows]
    samples_path = Path(args.out).with_suffix(".samples.jsonl")

    load_start = time.perf_counter()
    model, tokenizer = fetch.load_model(args.model, dtype=args.dtype, device=device)
    meta["load_seconds"] = round(time.perf_counter() - load_start, 1)
    if args.engine == "direct":
        engine: Engine = DirectEngine(model, tokenizer, args.batch_size, args.data_dir, args.max_new_tokens,
                                      args.batch_tokens)
    else:
        if args.batch_tokens is not None:
            raise SystemExit("--batch-tokens: only the direct engine batches by tokens; lm-eval batches by --batch-size")
        engine = LmEvalEngine(model, tokenizer, args.batch_size, args.data_dir, args.max_new_tokens)

    longest: dict[str, float] = {}  # per task, the longest row so far (estimate_seconds)
    for r in rows.values():
        longest[r.task] = max(longest.get(r.task, 0.0), r.seconds)
    left = list(plan)
    outer = tqdm(plan, desc="config × task", unit="row", file=sys.stderr)
    inner = tqdm(total=0, desc="examples", unit="ex", file=sys.stderr, leave=False)
    for config, task in outer:
        elapsed = time.perf_counter() - wall
        if args.max_seconds is not None and elapsed + estimate_seconds(task.name, longest) > args.max_seconds:
            break
        outer.set_postfix_str(f"{config.name} / {task.name}")
        try:
            row, samples = engine.run(config, task, args.limit, inner)
        except Exception as exc:  # noqa: BLE001 - one failing config must not lose the table
            if not isinstance(exc, NotImplementedError):
                traceback.print_exc()
            row, samples = Row(config.name, task.name, _status_for(exc), message=f"{type(exc).__name__}: {exc}",
                               date=report.now()), []
        longest[task.name] = max(longest.get(task.name, 0.0), row.seconds)
        rows[(config.name, task.name)] = row
        left.remove((config, task))
        meta["remaining"] = [f"{c.name}/{t.name}" for c, t in left]
        report.write_report(args.out, meta, list(rows.values()))
        if samples and args.save_samples:
            _append_samples(samples_path, samples)
    inner.close()
    outer.close()
    meta["remaining"] = [f"{c.name}/{t.name}" for c, t in left]
    meta["wall_seconds"] = round(time.perf_counter() - wall, 1)
    json_path, md_path = report.write_report(args.out, meta, list(rows.values()))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}" + (f"; {len(left)} rows left, rerun with --resume" if left else ""),
          file=sys.stderr)
    return 0


def _append_samples(path: Path, samples: list[dict]) -> None:
    import json

    with path.open("a", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
