#!/usr/bin/env python
"""Probe: how much the per-head index sets of one KV group overlap, on a real model and text.

With per-head sets (``cis.selection: head``, every shipped config) the sparse attention reads, for
each query head, the keys and values of its own set: a KV group of G query heads reads the sum of
its heads' set sizes. An attention that loaded the union of the group's sets once and kept each
head to its own set would give the same output while reading the union. This probe measures what
that would save: per decode step, layer and KV group of the sparse rows, ``sum`` (keys the per-head
attention reads), ``union`` (distinct keys of the group) and ``union / sum`` (the share of the
per-head reads a union-loading attention would make; 1/G when every head of the group picked the
same keys, 1 when no two share a key). It runs ``generate()`` on the model patched with each
config (``policy`` forced sparse, CPU PyTorch path), teacher-free greedy, on prompts packed from
``--text`` (default: this Python's standard-library source, text no evaluation uses).

With ``--mass-k``, it also measures what one set per KV group (``cis.selection: group``: the top-k
by the largest score of the group's heads) costs each head in attention mass, against the head's
own top-k, at each k of the list: per (step, layer, sequence, query head) the dense attention
probabilities of the step's query, and the mass *outside* sink + local window + the k middle keys
chosen (the dropped mass δ: 0 when the set holds everything the head attends to), for the head's
own exact top-k and for its group's. The sink and window are the config's; no CIS sharing and no
dilation (the exact per-step sets, so the two selections differ only in whose scores rank the keys).

With ``--set-mass`` it measures the mass outside the sets the decode steps attended to (CIS sharing and
dilation included) for any config, and the K/V rows each KV group's attention reads per step: a group
set's size (``cis.selection: group``), or for per-head sets the sum of the heads' sizes (``per_head``) and
their union (``backend.sparse_attention: group_union``).

``--share-prefill``: the prompt but its last two tokens is prefilled once, by the unpatched model (dense),
and each config's ``generate()`` continues a copy of that cache: its patched prefill is the last two tokens
(a prefill over the cache, which sets up the selector's state and a context-relative k for the whole
prompt), then the decode steps. Every config here prefills densely anyway (CIS alone), so only the
prefill's rounding differs (transformers' SDPA against the patch's grouped SDPA); it saves a prefill per config.

    python scripts/probe_group_union.py --model qwen2.5-coder-0.5b --length 4096 --new-tokens 24 \\
        --out docs/results/probe_group_union
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional

import torch

import prhs_hf
from prhs_hf.calibration.texts import calibration_texts, pack_prompts
from prhs_hf.evaluation.accuracy.configs import load_any_config
from prhs_hf.hub.fetch import load_model

REPO = Path(__file__).resolve().parents[1]


class UnionRecorder:
    """Wraps a patched model's selector; for each decode selection of per-head sets, records per (layer,
    sequence, KV group) the summed set sizes of the group's heads and the size of their union, and with
    ``mass_k`` the dropped masses of :func:`dropped_mass` (``mass[(k, "head" | "group")]``: one value per
    (layer, sequence, query head))."""

    def __init__(self, inner: Any, kv_heads: int, mass_k: tuple[int, ...] = (), sink: int = 0, local: int = 0,
                 set_mass: bool = False):
        self.inner, self.kv_heads, self.rows = inner, kv_heads, []
        self.mass_k, self.sink, self.local = mass_k, sink, local
        self.mass: dict[tuple[int, str], list[float]] = {}
        self.set_mass = set_mass
        self.set_dropped: list[float] = []  # with set_mass: one per (layer, sequence, query head) of each step
        self.group_reads: list[int] = []  # with set_mass and group sets: one set size per (layer, sequence, KV group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @staticmethod
    def _scores(args: tuple, b: int, group: int) -> torch.Tensor:
        """``[Hq, t]`` fp32 scaled logits of sequence ``b``'s step queries over its ``t`` real keys, from the
        arguments of ``select(layer, q, k_cache, v_cache, geom, params, scale, ...)``."""
        q, k_cache, geom, scale = args[0], args[1], args[3], args[5]
        pad, t = int(geom.pad[b]), int(geom.t_last[b])
        keys = k_cache[b, :, pad:pad + t].float()  # [Hkv, t, D]: the sequence's real keys
        return torch.einsum("hd,htd->ht", q[b].float(), keys.repeat_interleave(group, dim=0)) * scale

    def select(self, layer: int, *args: Any) -> Any:
        sel = self.inner.select(layer, *args)
        idx, count, active = sel.idx, sel.count, sel.active
        B, H, _ = idx.shape
        heads = args[0].shape[1] if args else H
        group = heads // self.kv_heads
        per_head = H != self.kv_heads  # else group-shared sets (or one head per KV head): no union to take
        for b in range(B):
            if not bool(active[b]):
                continue
            mass_k = self.mass_k if per_head else ()
            scores = self._scores(args, b, group) if self.set_mass or mass_k else None
            if self.set_mass:  # the attention mass outside the sets the step attends to (real indices)
                probs = torch.softmax(scores, dim=-1)
                for h in range(heads):
                    row = h if per_head else h // group  # group sets: the head's KV group's set
                    chosen = idx[b, row, :int(count[b, row])].long()
                    self.set_dropped.append(max(0.0, 1.0 - float(probs[h, chosen].sum())))
            if not per_head:
                if self.set_mass:  # the K/V rows a group set's attention reads: the set, once per KV group
                    self.group_reads.extend(int(c) for c in count[b])
                continue
            if mass_k:
                for (k, who), value in dropped_mass(scores, group, mass_k, self.sink, self.local).items():
                    self.mass.setdefault((k, who), []).extend(value.tolist())
            for g in range(self.kv_heads):
                members = range(g * group, (g + 1) * group)
                sets = [idx[b, h][idx[b, h] >= 0] for h in members]
                total = int(sum(int(count[b, h]) for h in members))
                union = int(torch.unique(torch.cat(sets)).numel())
                self.rows.append((layer, total, union))
        return sel


def dropped_mass(scores: torch.Tensor, group: int, ks: tuple[int, ...], sink: int, local: int) -> dict:
    """Per query head, the attention mass outside sink + window + k middle keys, for each k of ``ks``.

    ``scores [Hq, t]`` are one sequence's fp32 logits (scaled) of the step's queries over its ``t`` real
    keys, heads ``g*group .. (g+1)*group - 1`` sharing KV head ``g``. The middle is ``[sink, t - local)``;
    ``"head"``: each head's own top-k of it by its score; ``"group"``: the top-k of its group by the
    largest score among the group's heads (``cis.selection: group``). Returns ``{(k, "head" | "group"):
    [Hq]}`` of 1 - the kept probability (all k where the middle has at most k keys: 0).
    """
    H, t = scores.shape
    probs = torch.softmax(scores, dim=-1)
    lo, hi = min(sink, t), max(min(sink, t), t - local)
    kept_fixed = probs[:, :lo].sum(-1) + probs[:, hi:].sum(-1)
    middle, p_mid = scores[:, lo:hi], probs[:, lo:hi]
    group_scores = middle.view(H // group, group, -1).amax(dim=1).repeat_interleave(group, dim=0)
    out = {}
    for k in ks:
        kk = min(int(k), hi - lo)
        for who, rank in (("head", middle), ("group", group_scores)):
            chosen = rank.topk(kk, dim=-1).indices
            out[(k, who)] = (1.0 - kept_fixed - p_mid.gather(-1, chosen).sum(-1)).clamp_min(0.0)
    return out


def measure(model: Any, prompts: torch.Tensor, config: str, new_tokens: int,
            mass_k: tuple[int, ...] = (), set_mass: bool = False, prefilled: Any = None) -> dict[str, Any]:
    """One config's row; ``prefilled``: a dense cache of all but the prompts' last tokens, which a copy of
    continues (``--share-prefill``)."""
    cfg = load_any_config(config, {"policy": {"decode": "sparse", "prefill": "sparse"},
                                   "backend": {"decode": "torch", "prefill": "torch"}})
    text_cfg = model.config.get_text_config()
    kv_heads, heads = text_cfg.num_key_value_heads, text_cfg.num_attention_heads
    t0 = time.time()
    with prhs_hf.patch(model, cfg) as handle, torch.no_grad():
        budget = handle.runtime.resolved.config.budget
        cache = {} if prefilled is None else {"past_key_values": copy.deepcopy(prefilled)}
        recorder = UnionRecorder(handle.runtime.selector, kv_heads, mass_k, budget.sink, budget.local, set_mass)
        handle.runtime.selector = recorder
        try:
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **cache)
        finally:
            handle.runtime.selector = recorder.inner
        topk = handle.runtime.context.step_config.config.budget.topk  # the generation's k (budget.topk_fraction)
    rows = recorder.rows
    set_mass = (dict(set_dropped_mass=dict(mean=statistics.fmean(recorder.set_dropped),
                                           p90=_quantile(recorder.set_dropped, 0.9), samples=len(recorder.set_dropped)))
                if recorder.set_dropped else {})
    set_mass["topk"] = topk
    if recorder.group_reads:
        set_mass["group_set_reads"] = statistics.fmean(recorder.group_reads)
    if not rows:
        return dict(config=config, status="no per-head sets (one per KV head, or none sparse)", **set_mass,
                    seconds=round(time.time() - t0, 1))
    ratios = [u / s for _, s, u in rows if s > 0]
    by_layer: dict[int, list[float]] = {}
    for layer, s, u in rows:
        by_layer.setdefault(layer, []).append(u / s if s else 1.0)
    mass = {f"{k}": {who: dict(mean=statistics.fmean(v), p90=_quantile(v, 0.9), samples=len(v))
                     for (kk, who), v in recorder.mass.items() if kk == k} for k in mass_k}
    return dict(config=config, status="ok", group=heads // kv_heads, samples=len(rows), dropped_mass=mass, **set_mass,
                mean_sum=statistics.fmean(s for _, s, _ in rows), mean_union=statistics.fmean(u for _, _, u in rows),
                union_over_sum=sum(u for _, _, u in rows) / sum(s for _, s, _ in rows),
                union_over_sum_p10=_quantile(ratios, 0.1), union_over_sum_p90=_quantile(ratios, 0.9),
                union_over_sum_by_layer={str(k): round(statistics.fmean(v), 4) for k, v in sorted(by_layer.items())},
                seconds=round(time.time() - t0, 1))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _table(intro: str, columns: list[str], body: list[str]) -> list[str]:
    """A markdown section: ``intro``, then the table of ``columns`` whose rows are ``body``."""
    return [intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *body]


def markdown(result: dict[str, Any]) -> str:
    union_rows = [f"| `{r['config']}` | – | – | – | – | {r['status']} |" if r["status"] != "ok" else
                  f"| `{r['config']}` | {r['group']} | {r['samples']} | {r['mean_sum']:.0f} | {r['mean_union']:.0f} | "
                  f"**{r['union_over_sum']:.3f}** ({r['union_over_sum_p10']:.3f}–{r['union_over_sum_p90']:.3f}) |"
                  for r in result["rows"]]
    lines = [f"# Overlap of the per-head index sets of a KV group ({result['date'][:10]})", "",
             f"    {result['command']}", ""]
    lines += _table(
        f"Model {result['model']} ({result['dtype']}, CPU), {result['prompts']} prompt(s) of {result['length']} "
        f"tokens from {result['text']}, {result['new_tokens']} greedy decode steps, policy forced sparse. "
        "Per (decode step, layer, sequence, KV group): `sum` = keys the per-head attention reads for the "
        "group's heads, `union` = distinct keys among them; `union / sum` = the share of those reads an "
        "attention loading each group's union once would make (1/G: all heads picked the same keys).",
        ["config", "G", "samples", "mean sum", "mean union", "union / sum (p10–p90)"], union_rows)
    mass_rows = [f"| `{r['config']}` | {k} | {m['head']['mean']:.4f} ({m['head']['p90']:.4f}) | "
                 f"{m['group']['mean']:.4f} ({m['group']['p90']:.4f}) | {m['group']['mean'] - m['head']['mean']:+.4f} |"
                 for r in result["rows"] for k, m in (r.get("dropped_mass") or {}).items()]
    if mass_rows:
        lines += [""] + _table(
            "Dropped attention mass δ per (decode step, layer, query head) at each middle top-k, with the "
            "config's sink and window, exact per-step sets (no sharing, no dilation): the head's own top-k "
            "against one set per KV group ranked by the group's largest score (`cis.selection: group`). Mean (p90).",
            ["config", "k", "own top-k", "group top-k", "group − own"], mass_rows)
    set_rows = [f"| `{r['config']}` | {r.get('topk', '–')} | {m['mean']:.4f} ({m['p90']:.4f}) | {_reads(r)} | "
                f"{m['samples']} |" for r in result["rows"] if (m := r.get("set_dropped_mass"))]
    if set_rows:
        lines += [""] + _table(
            "Dropped attention mass δ of the sets the decode steps attended to (`--set-mass`: CIS sharing, "
            "dilation, sink and window as configured; a group set counts for each of its heads), per (step, "
            "layer, query head), against the dense attention of the same query. Mean (p90). K/V rows read per "
            "KV group and step: a group set's size; per-head sets: their sum (`per_head`) / their union "
            "(`group_union`).",
            ["config", "k", "δ mean (p90)", "rows read per KV group", "samples"], set_rows)
    return "\n".join(lines) + "\n"


def _reads(row: dict[str, Any]) -> str:
    """The K/V rows per KV group and step of a row: the group set's, or per-head sum / union."""
    if "group_set_reads" in row:
        return f"{row['group_set_reads']:.0f}"
    if row.get("status") == "ok":
        return f"{row['mean_sum']:.0f} / {row['mean_union']:.0f}"
    return "–"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, .gguf, checkpoint folder or hub id")
    ap.add_argument("--configs", default="cis,cis_longbench", help="comma-separated config names (per-head sets)")
    ap.add_argument("--text", default=sysconfig.get_paths()["stdlib"],
                    help="file or folder the prompts are packed from (default: the Python standard library's source)")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--length", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--mass-k", default="", help="comma-separated middle top-k sizes: also measure the dropped "
                    "attention mass of each head's own top-k and of its KV group's (e.g. 88,512,1024,2048,4096)")
    ap.add_argument("--set-mass", action="store_true", help="also measure the attention mass outside the sets each "
                    "step attends to (CIS sharing and dilation included; any config, group selection too)")
    ap.add_argument("--share-prefill", action="store_true", help="prefill all but the prompts' last two tokens once "
                    "(unpatched, dense) and continue a copy of that cache under each config (module docstring)")
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "probe_group_union"), help="output stem (.json, .md)")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.length < 2 or args.new_tokens < 1:
        ap.error("--prompts and --new-tokens must be >= 1 and --length >= 2")
    try:
        mass_k = tuple(int(k) for k in args.mass_k.split(",") if k.strip())
    except ValueError:
        ap.error(f"--mass-k: {args.mass_k!r} is not a comma-separated list of integers")
    if any(k < 1 for k in mass_k):
        ap.error(f"--mass-k: every k must be >= 1, got {args.mass_k!r}")
    model, tokenizer = load_model(args.model)
    texts, text_name = calibration_texts(args.text, None)
    prompts = pack_prompts(texts, tokenizer, args.length, args.prompts)
    result: dict[str, Any] = dict(
        command="python scripts/probe_group_union.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), model=args.model,
        dtype=str(next(model.parameters()).dtype), text=text_name if args.text != ap.get_default("text")
        else "the Python standard library's source", prompts=args.prompts, length=args.length,
        new_tokens=args.new_tokens, torch=torch.__version__, machine=platform.machine(), rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefilled = None
    if args.share_prefill:
        t0 = time.time()
        with torch.no_grad():
            prefilled = model(prompts[:, :-2], use_cache=True).past_key_values
        result["shared_prefill_seconds"] = round(time.time() - t0, 1)
    for config in args.configs.split(","):
        result["rows"].append(measure(model, prompts, config, args.new_tokens, mass_k, args.set_mass, prefilled))
        (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result["rows"][-1].items() if k not in ("union_over_sum_by_layer", "dropped_mass")}),
              flush=True)
    md = markdown(result)
    (out.parent / f"{out.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
