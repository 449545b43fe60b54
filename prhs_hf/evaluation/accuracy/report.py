"""The accuracy table: its rows, the run's environment, and the JSON + Markdown files.

A row is one config × one task: status (``ok``, ``not implemented``, ``error``), the task's metrics,
ρ̂ and processed KV per decode step from the PrHS telemetry, examples, seconds and, where the engine
measures it (the direct engine), the prefill seconds within them. The JSON holds
everything (the full telemetry too); the Markdown is the table with the command, GPU, versions and
date above it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["Row", "earlier_runs", "environment", "load_rows", "now", "render_markdown", "write_report"]

STATUS_OK = "ok"
STATUS_NOT_IMPLEMENTED = "not implemented"
STATUS_ERROR = "error"

_METRIC_ORDER = ("strict-match", "flexible-extract", "em", "f1")


@dataclass
class Row:
    """One config × task result.

    ``prefill_seconds``: the part of ``seconds`` spent prefilling the prompts (each batch from just
    before ``generate`` to its first logits, summed) and ``prompt_tokens`` the real prompt tokens
    prefilled; None where not measured (the lm-eval engine, failed rows, reports without the fields).
    """

    config: str
    task: str
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    n: int = 0
    seconds: float = 0.0
    new_tokens: int = 0
    rho_hat: float | None = None
    processed_kv_per_step: float | None = None
    dense_kv_per_step: float | None = None
    message: str = ""
    telemetry: dict[str, Any] = field(default_factory=dict)
    prhs_config: dict[str, Any] = field(default_factory=dict)
    date: str = ""  # when the row finished (UTC, ISO 8601); rows kept by --resume keep theirs
    prefill_seconds: float | None = None
    prompt_tokens: int | None = None

    @classmethod
    def from_telemetry(cls, config: str, task: str, metrics: Mapping[str, float], n: int, seconds: float,
                       new_tokens: int, telemetry: Mapping[str, Any], prhs_config: Mapping[str, Any],
                       prefill_seconds: float | None = None, prompt_tokens: int | None = None) -> "Row":
        """A successful row, ρ̂ and processed KV read from a telemetry report dict."""
        return cls(config, task, STATUS_OK, dict(metrics), n, seconds, new_tokens,
                   telemetry.get("retrieval_ratio"), telemetry.get("processed_kv_per_step"),
                   telemetry.get("dense_kv_per_step"), telemetry=dict(telemetry), prhs_config=dict(prhs_config),
                   date=now(), prefill_seconds=prefill_seconds, prompt_tokens=prompt_tokens)


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """Date, host, Python, package versions and the accelerator of this run."""
    import torch

    gpu = torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else None
    return {
        "date": now(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "cpu_threads": torch.get_num_threads(),
        "versions": {n: _version(n) for n in ("transformers", "prhs-hf", "lm_eval", "accelerate", "gguf", "triton")},
    }


def load_rows(path: str | os.PathLike[str]) -> list[Row]:
    """The rows of an existing JSON report (none if the file does not exist); fields a row of an older
    report lacks take their defaults (``prefill_seconds`` None)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [Row(**r) for r in json.loads(p.read_text()).get("rows", [])]


def earlier_runs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The runs an existing JSON report was built from (its own and those it resumed), oldest first.

    Each is ``{"command", "date", "gpu", "commit"}`` (commit None for a report that does not record
    it); ``--resume`` keeps them in ``meta["earlier_runs"]`` so a
    table assembled over several runs (or device sessions) says which commands made it.
    """
    p = Path(path)
    if not p.is_file():
        return []
    meta = json.loads(p.read_text()).get("meta", {})
    env = meta.get("environment", {})
    own = {"command": meta.get("command"), "date": env.get("date"), "gpu": env.get("gpu"), "commit": meta.get("commit")}
    return [*meta.get("earlier_runs", []), own]


def _fmt(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f} %" if percent else f"{value:.4f}"


def render_markdown(meta: Mapping[str, Any], rows: Sequence[Row]) -> str:
    """The Markdown page: a header with the run's facts, then one table row per config × task."""
    env = meta.get("environment", {})
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    lines = [
        "# PrHS accuracy",
        "",
        f"- command: `{meta.get('command', '')}`",
        f"- model: {meta.get('model')} ({meta.get('dtype')}, {meta.get('device')}), engine {meta.get('engine')}, "
        f"batch {meta.get('batch_size')}, limit {meta.get('limit')}",
        f"- GPU: {env.get('gpu') or 'none (CPU)'}; torch {env.get('torch')} (CUDA {env.get('cuda')}); {versions}",
        f"- date: {env.get('date')}" + (f"; commit {meta['commit']}" if meta.get("commit") else ""),
    ]
    for run in meta.get("earlier_runs", []):
        commit = f", commit {run['commit']}" if run.get("commit") else ""
        lines.append(f"- resumed from: `{run.get('command')}` ({run.get('date')}, {run.get('gpu') or 'CPU'}{commit})")
    lines.append("")
    metric_names = [m for m in _METRIC_ORDER if any(m in r.metrics for r in rows)]
    metric_names += sorted({m for r in rows for m in r.metrics} - set(metric_names))
    header = ["config", "task", *metric_names, "ρ̂", "KV/step (dense)", "n", "time (s)", "prefill (s)", "status"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        kv = "—" if r.processed_kv_per_step is None else f"{r.processed_kv_per_step:.1f} ({r.dense_kv_per_step or 0:.1f})"
        status = r.status if not r.message or r.status == STATUS_OK else f"{r.status}: {r.message.splitlines()[0][:80]}"
        prefill = "—" if r.prefill_seconds is None else f"{r.prefill_seconds:.2f}"
        cells = [r.config, r.task, *(_fmt(r.metrics.get(m)) for m in metric_names), _fmt(r.rho_hat, percent=True), kv,
                 str(r.n), f"{r.seconds:.1f}", prefill, status]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "ρ̂: share of (sparse step, layer, head) that ran a top-k retrieval (the rest reused an anchor's "
              "indices); KV/step: keys attended per layer, head and decode step, dense in brackets; prefill: the part of "
              "the time from each batch's generate call to its first logits (— where not measured).", ""]
    return "\n".join(lines)


def write_report(out: str | os.PathLike[str], meta: Mapping[str, Any], rows: Sequence[Row]) -> tuple[Path, Path]:
    """Write ``out`` (JSON) and the Markdown table beside it (same name, ``.md``); returns both paths.

    Each file is written whole (temporary file + rename), so a run stopped midway leaves the last
    complete version.
    """
    json_path = Path(out)
    md_path = json_path.with_suffix(".md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": dict(meta), "rows": [asdict(r) for r in rows]}
    for path, text in ((json_path, json.dumps(payload, indent=1, default=str) + "\n"),
                       (md_path, render_markdown(meta, rows))):
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return json_path, md_path
