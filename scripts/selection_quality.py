#!/usr/bin/env python
"""Selection quality of CIS and the comparison selectors at a matched budget (paper Table VI, Fig. 6/7).

For every selector (CIS at several block sizes s and thresholds τ, DirectReuse, RandomExpansion,
HShare, Quest, H2O, StreamingLLM, the top-k oracle), on real GSM8K / CoQA text, this runs
*teacher-forced decode*: the prompt is prefilled, then the reference continuation (or the dense
model's greedy continuation, ``--continuation greedy``) is fed one token per forward, so every
position is a real decode step and sparse and dense runs see the same tokens. Measured, with
``telemetry: {enabled: true, oracle: true}`` (SPEC §5):

- β_emp, dropped mass δ̄, oracle overlap (all and top-50 %-mass indices), ρ̂, processed KV per step;
- output relative error against dense: ``‖x_sparse - x_dense‖ / ‖x_dense‖`` of the final hidden
  state and of the logits at each decoded position (mean over positions), and top-1 agreement;
- the certificate ``g(δ̄) = 2[h_b(δ̄) + δ̄ ln L]`` against a measured routing-MI perturbation.

Routing-MI proxy (paper §VI-B, Fig. 7; App. VIII): for one (prompt, layer, head) cell, X is
uniform over the cell's M sparse decode steps and T | X=m ~ A_m (full attention over real
positions), T_S | X=m ~ Ã_m = A_m 1_S / τ_S (the renormalised sparse routing). The plug-in
``I(X;T) = H(mean_m A_m) − mean_m H(A_m)`` (nats) and ``I(X;T_S)`` likewise give
``ΔI_emp = |I(X;T) − I(X;T_S)|``, and ``B_MI = g(δ̄_cell)`` with the cell's mean dropped mass and
mean context length. Both are averaged over cells (layers × heads × prompts), as the paper's
``(ΔI_emp, B_MI)`` pair; the theory says ``ΔI_emp ≤ B_MI``.

Matching (paper §VI-A): CIS-main's measured ρ̂ sets the block size of DirectReuse and
RandomExpansion (``round(1/ρ̂)``) and HShare's three sharing ratios (the combination whose
``(n_h/H)(n_l/N)/P`` is nearest, preferring per-level keep fractions near 1/2); a second
DirectReuse row raises ``topk`` to match CIS's processed KV (the paper's "+~1/6").

EarlySelectKV (``early_select``): ES-Quest and ES-CIS rows (the tap, and a low-rank ``W_q`` of
``--es-rank``), and per layer the proxy's fidelity (the top-k overlap of the proxy's and the real
query's exact top-k sets, and the real query's attention mass on ``sink ∪ S ∪ local`` for the
proxy's ``S`` over that of the real query's; :meth:`EarlySelectSelector.fidelity`).
``--schedule early_select`` runs only Quest, CIS-main, the ES rows and the oracle.

CIS + tail (``cis.tail_slot``): CIS-main with CertKV's tail-summary slot, one of its top-k slots a
synthetic key/value for what the index set leaves out (same processed KV per step). Its β_emp and
overlaps compare its ``k - 1`` real middle tokens (the synthetic pair is no token) with the oracle
of the same size; the output errors show what the pair adds. ``--schedule cis_tail`` runs only
CIS-main, CIS + tail, both at s = 1 (every step retrieves: there the tail step is exact attention
for a query head) and the oracle. ``--schedule group`` runs CIS-main beside group-shared CIS
(``cis.selection: group``, ranked by the group's largest score, and ``group_mean``, by its mean),
each also at s = 1, and the oracle: which group ranking loses least against per-head selection.
``--schedule seeds`` runs the seed systems (CIS + tail, EarlySelectKV, Double Sparsity, CertKV)
beside CIS-main and the oracle at one budget.

Key index (``cis.index``, docs/notes/key_index.md): ``--schedule key_index`` runs CIS as
``configs/cis.yaml`` ships it (s 16, τ 0.8, the budget of ``--sink/--local/--topk``) with no index
and with each index kind at the rerank margins of ``--margins``, each row also with its retrieval
probed (:class:`RetrievalProbe`, the script's own ops table: every indexed retrieval runs the exact
one on the same queries beside it): the top-k overlap of the indexed retrieval with the exact one
(``retrieval_overlap``, over retrieving rows) and the bytes the retrieval reads, the index's over
the middle region plus the re-ranked candidates' keys, against the exact retrieval's keys (bf16
keys counted, whatever the run's dtype: ``retrieval_bytes_ratio``).

Shared prefill (``--share-prefill``): the rows differ only in their decode steps, and at long
prompts on a CPU one prefill costs more than a row's decode steps. With it the dense model
prefills all but each prompt's last ``SHARED_PREFILL_TAIL`` tokens once, and every row, the dense
pass too, starts from a copy of that cache and prefills only the tail: a multi-token forward over a
cache, which the runtime takes as a prompt (CIS starts over and writes its key index for every slot
of the cache). A row then differs from one that prefills the whole prompt patched only in the
prefix's keys and values coming from the unpatched dense attention.

Writes ``docs/results/<--name>.{json,md}`` (default ``selection_quality``) and PNG plots there. Example::

    python scripts/selection_quality.py --prompts 4 --max-new-tokens 64            # CPU, smollm2-135m
    python scripts/selection_quality.py --model qwen2.5-coder-1.5b --device cuda --dtype bfloat16 --prompts 32
    python scripts/selection_quality.py --schedule early_select --name selection_quality_early_select --prompts 2
    python scripts/selection_quality.py --schedule cis_tail --name selection_quality_cis_tail --prompts 2
    python scripts/selection_quality.py --schedule key_index --name selection_quality_key_index --prompts 4
    python scripts/selection_quality.py --model qwen2.5-coder-1.5b --text /usr/lib/python3.11 --length 4096 \
        --schedule key_index --share-prefill --name selection_quality_key_index_qwen1.5b
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import platform
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import transformers

import prhs_hf
from prhs_hf.hub import fetch
from prhs_hf.evaluation.lm_eval.data import load_rows
from prhs_hf.ops.decode_ops import REFERENCE_OPS, DecodeOps
from prhs_hf.ops.key_index.key_index import INDEX_KINDS, INT4_GROUP, candidate_count, index_bytes_per_slot
from prhs_hf.ops.topk.topk_retrieval import topk_retrieval_grouped_reference, topk_retrieval_reference
from prhs_hf.telemetry_counters import Telemetry, routing_certificate

ROOT = Path(__file__).resolve().parent.parent
GSM8K_SHOTS = 4
SHARED_PREFILL_TAIL = 16  # --share-prefill: the prompt tokens every row prefills itself, over the shared prefix


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One teacher-forced sample: prompt token ids and the continuation to force."""

    name: str
    prompt: torch.Tensor  # [1, Lp]
    continuation: torch.Tensor  # [1, T]


def gsm8k_texts(n: int, data_dir: str | None = None) -> list[tuple[str, str, str]]:
    """``(name, prompt, continuation)``: a 4-shot GSM8K prompt (exemplars: the first test rows) and the worked answer."""
    rows = load_rows("gsm8k", data_dir, GSM8K_SHOTS + n)
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:GSM8K_SHOTS])
    out = []
    for i, r in enumerate(rows[GSM8K_SHOTS:]):
        out.append((f"gsm8k/{GSM8K_SHOTS + i}", f"{shots}Question: {r['question']}\nAnswer:", " " + r["answer"]))
    return out


def coqa_texts(n: int, data_dir: str | None = None) -> list[tuple[str, str, str]]:
    """``(name, prompt, continuation)``: the story and its first question; the reference turns that follow."""
    from prhs_hf.evaluation.lm_eval.prompts import coqa_prompt

    out = []
    for row in load_rows("coqa", data_dir, n):
        qs, ans = row["questions"]["input_text"], row["answers"]["input_text"]
        first = {**row, "questions": {"input_text": qs[:1]}, "answers": {"input_text": ans[:1]}}
        cont = f" {ans[0]}\n\n" + "".join(f"Q: {q}\n\nA: {a}\n\n" for q, a in zip(qs[1:], ans[1:]))
        out.append((f"coqa/{row['id']}", coqa_prompt(first), cont))
    return out


def text_prompts(tokenizer, texts: Iterable[str], n: int, length: int, max_new: int) -> list[Prompt]:
    """``n`` prompts of ``length`` tokens from calibration text (``--text``, read by
    :func:`prhs_hf.calibration.texts.calibration_texts`), each forced on with the ``max_new`` tokens of the text that
    follow: text that is not an evaluation set's, for choosing configs without tuning on evaluation prompts."""
    from prhs_hf.calibration.texts import pack_prompts

    rows = pack_prompts(texts, tokenizer, length + max_new, n)
    return [Prompt(f"text/{i}", rows[i:i + 1, :length], rows[i:i + 1, length:]) for i in range(n)]


def build_prompts(tokenizer, n: int, datasets: list[str], max_new: int, data_dir: str | None = None) -> list[Prompt]:
    """``n`` prompts split over ``datasets`` (GSM8K first), each with ``max_new`` forced tokens.

    The text comes from ``data_dir`` (or ``$PRHS_HF_DATA_DIR``, else the prhs-hf cache, fetched on
    first use), as :func:`prhs_hf.evaluation.lm_eval.data.load_rows` finds it.
    """
    per = [n // len(datasets) + (i < n % len(datasets)) for i in range(len(datasets))]
    texts = []
    for name, count in zip(datasets, per):
        texts += (gsm8k_texts if name == "gsm8k" else coqa_texts)(count, data_dir)
    prompts = []
    for name, prompt, cont in texts:
        p = tokenizer(prompt, return_tensors="pt").input_ids
        c = tokenizer(cont, add_special_tokens=False, return_tensors="pt").input_ids[:, :max_new]
        prompts.append(Prompt(name, p, c))
    return prompts


# --------------------------------------------------------------------------------------------
# Teacher-forced decode
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def prefill_prefix(model, prompt: Prompt, device: str, tail: int = SHARED_PREFILL_TAIL):
    """The cache of all but the prompt's last ``tail`` tokens, prefilled by ``model`` as it is (``--share-prefill``:
    the unpatched model, once per prompt); None for a prompt of at most ``tail`` tokens (each row prefills it whole)."""
    from transformers import DynamicCache

    if prompt.prompt.shape[1] <= tail:
        return None
    cache = DynamicCache()
    model(prompt.prompt[:, :-tail].to(device), past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def teacher_forced(model, prompt: Prompt, device: str, prefix=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill the prompt, then one forward per continuation token: ``(hidden [T, H], logits [T, V])`` fp32.

    Position ``i`` is the output of the decode step that consumed continuation token ``i``. ``prefix``
    (:func:`prefill_prefix`): a cache of the prompt's first tokens, of which a copy is extended with the rest.
    """
    from transformers import DynamicCache

    cache = DynamicCache() if prefix is None else copy.deepcopy(prefix)
    out = model(prompt.prompt[:, cache.get_seq_length():].to(device), past_key_values=cache, use_cache=True)
    hidden, logits = [], []
    for i in range(prompt.continuation.shape[1]):
        out = model(prompt.continuation[:, i : i + 1].to(device), past_key_values=out.past_key_values,
                    use_cache=True, output_hidden_states=True)
        hidden.append(out.hidden_states[-1][0, -1].float().cpu())
        logits.append(out.logits[0, -1].float().cpu())
    return torch.stack(hidden), torch.stack(logits)


@torch.no_grad()
def greedy_continuation(model, prompt: Prompt, max_new: int, device: str) -> Prompt:
    """The dense model's greedy continuation of the prompt, as the tokens to force."""
    ids = prompt.prompt.to(device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return Prompt(prompt.name, prompt.prompt, out[:, ids.shape[1]:].cpu())


# --------------------------------------------------------------------------------------------
# Routing-MI proxy
# --------------------------------------------------------------------------------------------


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of the rows of ``p`` (0 log 0 = 0)."""
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


class RoutingTelemetry(Telemetry):
    """:class:`Telemetry` that also accumulates, per (layer, head), what the routing-MI proxy needs.

    It relies on the layer calling ``record_decode(layer, ...)`` just before ``record_oracle`` and
    on a batch of one sequence (the oracle rows are then the query heads in order).
    """

    def __init__(self, base: Telemetry):
        super().__init__(base.num_layers, base.num_heads, True, base.num_kv_heads)
        self._layer = 0
        self.cells: list[tuple[float, float]] = []  # (ΔI_emp, B_MI) of finished cells
        self._clear()

    def _clear(self) -> None:
        self._acc_mi: dict[int, dict[str, Any]] = {}

    def record_decode(self, layer, t, processed, retrieved, active) -> None:
        self._layer = layer
        super().record_decode(layer, t, processed, retrieved, active)

    def record_oracle(self, probs, selected, t) -> None:
        super().record_oracle(probs, selected, t)
        if probs.shape[0] == 0:
            return
        if probs.shape[0] != self.num_heads:
            raise RuntimeError("RoutingTelemetry needs a batch of one sequence")
        a = probs.double()
        tau = (a * selected).sum(-1, keepdim=True)
        at = torch.where(selected, a, torch.zeros_like(a)) / tau.clamp_min(1e-300)
        c = self._acc_mi.setdefault(self._layer, {"m": 0, "pa": None, "pt": None, "ha": 0.0, "ht": 0.0,
                                                   "delta": 0.0, "ctx": 0.0})
        for key, x in (("pa", a), ("pt", at)):
            old = c[key]
            if old is None:
                c[key] = x.clone()
            else:
                width = max(old.shape[-1], x.shape[-1])
                c[key] = torch.nn.functional.pad(old, (0, width - old.shape[-1])) + \
                    torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        c["m"] += 1
        c["ha"] = c["ha"] + _entropy(a)
        c["ht"] = c["ht"] + _entropy(at)
        c["delta"] = c["delta"] + (1 - tau.squeeze(-1))
        c["ctx"] = c["ctx"] + t.double()

    def finish_prompt(self) -> None:
        """Turn the accumulated prompt's cells into ``(ΔI_emp, B_MI)`` pairs and start over."""
        for c in self._acc_mi.values():
            m = c["m"]
            i_full = _entropy(c["pa"] / m) - c["ha"] / m
            i_sparse = _entropy(c["pt"] / m) - c["ht"] / m
            delta_i = (i_full - i_sparse).abs()
            for h in range(delta_i.shape[0]):
                bound = routing_certificate(float(c["delta"][h] / m), float(c["ctx"][h] / m))
                self.cells.append((float(delta_i[h]), bound))
        self._clear()


# --------------------------------------------------------------------------------------------
# Retrieval probe (the key index schedule)
# --------------------------------------------------------------------------------------------


class RetrievalProbe:
    """A decode ops table (the PyTorch references) whose retrievals also measure themselves.

    Every indexed retrieval (``topk_retrieval_indexed``) runs the exact retrieval on the same
    queries beside it and counts, over the rows that retrieve, the exact top-k indices it found;
    every retrieval, indexed or not, counts the bytes it reads: for each (sequence, KV head) with a
    retrieving row, the exact one reads the middle region's keys once, the indexed one the index
    over the region (``index_bytes_per_slot``) plus, per retrieving row, its candidates' keys
    (``k + margin`` tokens, pages: whole pages, at most the region). Keys count as ``itemsize``
    bytes per element (2: the bf16 cache of a GPU run).
    """

    def __init__(self, itemsize: int = 2):
        self.itemsize = itemsize
        self.found = 0  # exact top-k indices the indexed retrievals also returned
        self.wanted = 0  # exact top-k indices of the retrieving rows
        self.bytes = 0.0  # read by the retrievals as run
        self.exact_bytes = 0.0  # an exact retrieval of the same rows would read
        self.ops = dataclasses.replace(REFERENCE_OPS, topk_retrieval=self._exact(topk_retrieval_reference, False),
                                       topk_retrieval_grouped=self._exact(topk_retrieval_grouped_reference, True),
                                       topk_retrieval_indexed=self._indexed)

    def _region_bytes(self, q, k_cache, lo, hi, retrieve, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(region tokens [B, H], whether each (sequence, KV head) reads [B, Hkv])`` of a retrieval."""
        B, Hkv = k_cache.shape[:2]
        rows = retrieve if grouped else retrieve.view(B, Hkv, -1).any(-1)
        return (hi - lo).clamp_min(0).to(torch.float64).view(B, 1), rows

    def _count_exact(self, q, k_cache, lo, hi, retrieve, grouped: bool) -> float:
        width, reads = self._region_bytes(q, k_cache, lo, hi, retrieve, grouped)
        key_bytes = k_cache.shape[-1] * self.itemsize
        return float((width * reads * key_bytes).sum())

    def _exact(self, fn, grouped: bool):
        def retrieval(q, k_cache, pad, lo, hi, retrieve, k, scale):
            spent = self._count_exact(q, k_cache, lo, hi, retrieve, grouped)
            self.bytes += spent
            self.exact_bytes += spent
            return fn(q, k_cache, pad, lo, hi, retrieve, k, scale)

        return retrieval

    def _indexed(self, q, k_cache, index, pad, lo, hi, retrieve, k, margin, scale, grouped):
        got = REFERENCE_OPS.topk_retrieval_indexed(q, k_cache, index, pad, lo, hi, retrieve, k, margin, scale, grouped)
        exact_fn = topk_retrieval_grouped_reference if grouped else topk_retrieval_reference
        exact = exact_fn(q, k_cache, pad, lo, hi, retrieve, k, scale)
        hit = (got[..., :, None] == exact[..., None, :]) & (exact[..., None, :] >= 0)
        self.found += int(hit.any(-2).sum())
        self.wanted += int((exact >= 0).sum())
        width, reads = self._region_bytes(q, k_cache, lo, hi, retrieve, grouped)
        D = k_cache.shape[-1]
        per_slot = index_bytes_per_slot(index.kind, D, torch.bfloat16, index.page)
        candidates = torch.clamp(width, max=candidate_count(k, margin, index.page) * index.page)  # [B, 1]
        self.bytes += float((width * reads * per_slot).sum()) + float((candidates * retrieve * D * self.itemsize).sum())
        self.exact_bytes += self._count_exact(q, k_cache, lo, hi, retrieve, grouped)
        return got

    def results(self) -> dict[str, float | None]:
        """``retrieval_overlap`` (None: no indexed retrieval), ``retrieval_bytes_ratio`` (None: none read)."""
        return {"retrieval_overlap": self.found / self.wanted if self.wanted else None,
                "retrieval_bytes_ratio": self.bytes / self.exact_bytes if self.exact_bytes else None}


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One selector at one setting: a row of the table."""

    label: str
    family: str  # cis, oracle, hshare, ... (for plots)
    config: dict[str, Any]
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    probe: bool = False  # run on a RetrievalProbe's ops table (the key index schedule)


def base_config(budget: dict[str, int]) -> dict[str, Any]:
    """What every variant shares: the budget, decode selection only (no PSAW/ETF), oracle telemetry."""
    return {"budget": dict(budget), "psaw": {"enabled": False}, "etf": {"enabled": False},
            "telemetry": {"enabled": True, "oracle": True}}


def cis_variant(budget, s: int, tau: float, label: str | None = None, tail: bool = False,
                selection: str = "head") -> Variant:
    """CIS alone at block size ``s`` and threshold ``tau`` (``tail``: with ``cis.tail_slot``;
    ``selection``: ``cis.selection``, a group mode makes the family ``cis_group``)."""
    cfg = base_config(budget)
    cfg["cis"] = {"enabled": True, "block_size": s, "tau": tau, "tail_slot": tail, "selection": selection}
    extra = {"block_size": s, "tau": tau, **({"tail_slot": True} if tail else {}),
             **({"selection": selection} if selection != "head" else {})}
    family = "cis_tail" if tail else ("cis" if selection == "head" else "cis_group")
    return Variant(label or f"CIS s={s} τ={tau}" + (" + tail" if tail else ""), family, cfg, extra=extra)


def baseline_variant(budget, name: str, label: str, family: str | None = None, note: str = "", **baseline) -> Variant:
    """A ``baseline.name`` selector; ``baseline`` holds ``baseline.*`` config keys and block_size (and tags)."""
    keys = ("page_size", "share_ratio", "head_share_ratio", "layer_share_ratio", "seed")
    cfg = base_config(budget)
    cfg["baseline"] = {"name": name, **{k: v for k, v in baseline.items() if k in keys}}
    if "block_size" in baseline:
        cfg["cis"] = {"block_size": baseline["block_size"]}
    return Variant(label, family or name, cfg, note=note, extra=dict(baseline))


def es_variant(budget, base: str, tap: str, rank: int | None = None, page_size: int = 16) -> Variant:
    """EarlySelectKV on ``base`` (``"quest"`` or ``"cis"``: CIS-main's s = 16, τ = 0.8) with the proxy of ``tap``."""
    cfg = base_config(budget)
    if base == "quest":
        cfg["baseline"] = {"name": "quest", "page_size": page_size}
    else:
        cfg["cis"] = {"enabled": True, "block_size": 16, "tau": 0.8}
    cfg["early_select"] = {"tap": tap, "rank": rank}
    label = f"ES-{'Quest' if base == 'quest' else 'CIS'} {tap}" + ("" if rank is None else f" r={rank}")
    return Variant(label, f"es_{base}", cfg, extra={"tap": tap, "rank": rank or "exact W_q"})


def match_hshare(target: float, layers: int, heads: int) -> dict[str, float]:
    """HShare's ``baseline.share_ratio`` / ``head_share_ratio`` / ``layer_share_ratio`` whose ρ̂
    ``(n_h/H)(n_l/N)/P`` is nearest ``target``.

    Among near-ties (within 2 % of the target), the most balanced levels win (keep fractions
    closest to HShare's usual 1/2 per level).
    """
    best = None
    for period in range(1, 9):
        for n_h in range(1, heads + 1):
            for n_l in range(1, layers + 1):
                rho = n_h / heads * n_l / layers / period
                err = abs(rho - target) / target
                balance = sum(abs(math.log2(x)) for x in (n_h / heads / 0.5, n_l / layers / 0.5, 1 / period / 0.5))
                key = (round(err / 0.02), balance, err)
                if best is None or key < best[0]:
                    best = (key, period, n_h, n_l)
    _, period, n_h, n_l = best
    return {"share_ratio": 1 - 1 / period, "head_share_ratio": 1 - n_h / heads, "layer_share_ratio": 1 - n_l / layers}


# --------------------------------------------------------------------------------------------
# Running a variant
# --------------------------------------------------------------------------------------------


def run_variant(model, variant: Variant, prompts: list[Prompt], dense: list, device: str,
                prefixes: list | None = None) -> dict[str, Any]:
    """Patch, run every prompt teacher-forced (from its ``prefixes`` cache, :func:`prefill_prefix`, if given), unpatch;
    the row of measurements."""
    rt = prhs_hf.patch(model, variant.config).runtime
    rt.telemetry = RoutingTelemetry(rt.telemetry)
    probe = RetrievalProbe() if variant.probe else None
    if probe is not None:  # the table the runtime hands every layer's decode step on this device
        rt._ops[torch.device(device)] = probe.ops
    h_err, l_err, top1 = [], [], []
    start = time.perf_counter()
    try:
        for prompt, (h_dense, l_dense), prefix in zip(prompts, dense, prefixes or [None] * len(prompts)):
            h_sp, l_sp = teacher_forced(model, prompt, device, prefix)
            rt.telemetry.finish_prompt()
            h_err.append(((h_sp - h_dense).norm(dim=-1) / h_dense.norm(dim=-1)).mean().item())
            l_err.append(((l_sp - l_dense).norm(dim=-1) / l_dense.norm(dim=-1)).mean().item())
            top1.append((l_sp.argmax(-1) == l_dense.argmax(-1)).float().mean().item())
        report = rt.telemetry.report()
        cells = rt.telemetry.cells
        fidelity = getattr(rt.selector, "fidelity", None)
        fidelity = None if fidelity is None else fidelity()
    finally:
        prhs_hf.unpatch(model)
    o = report.oracle
    n = len(prompts)
    row = {
        "variant": variant.label,
        "family": variant.family,
        "settings": variant.extra,
        "note": variant.note,
        "rho_hat": report.retrieval_ratio,
        "kv_group_rho_hat": report.kv_group_retrieval_ratio,
        "processed_kv": report.processed_kv_per_step,
        "dense_kv": report.dense_kv_per_step,
        "beta_emp": o.beta_emp,
        "dropped_mass": o.dropped_mass,
        "overlap": o.overlap,
        "overlap_top50": o.overlap_top50,
        "certificate_g": o.certificate,
        "mean_context": o.mean_context,
        "delta_i_emp": sum(c[0] for c in cells) / len(cells),
        "b_mi": sum(c[1] for c in cells) / len(cells),
        "hidden_rel_err": sum(h_err) / n,
        "logit_rel_err": sum(l_err) / n,
        "top1_agree": sum(top1) / n,
        "oracle_rows": o.rows,
        "seconds": time.perf_counter() - start,
    }
    if fidelity is not None:
        row["fidelity"] = fidelity
    if probe is not None:
        row.update(probe.results())
    return row


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = [
    ("variant", "selector", "{}"),
    ("rho_hat", "ρ̂", "{:.3f}"),
    ("processed_kv", "KV/step", "{:.1f}"),
    ("beta_emp", "β_emp", "{:.4f}"),
    ("dropped_mass", "δ̄", "{:.4f}"),
    ("overlap", "overlap", "{:.3f}"),
    ("overlap_top50", "top-50% overlap", "{:.3f}"),
    ("hidden_rel_err", "hidden rel err", "{:.4f}"),
    ("logit_rel_err", "logit rel err", "{:.4f}"),
    ("top1_agree", "top-1 agree", "{:.3f}"),
    ("certificate_g", "g(δ̄)", "{:.3f}"),
    ("b_mi", "B_MI (cells)", "{:.3f}"),
    ("delta_i_emp", "ΔI_emp", "{:.4f}"),
]


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def targets(rows: list[dict]) -> list[str]:
    """The project's selection-quality targets, checked on the measured rows (no fudging).

    CIS-main: β_emp ≤ 0.02 and top-50 %-mass overlap ≥ 0.90; every CIS row with an HShare
    matched to its ρ̂: HShare's β_emp at least 3× CIS's.
    """
    by = {r["variant"]: r for r in rows}
    lines = []
    cis = by.get("CIS-main")
    if cis:
        lines.append(f"- CIS-main β_emp = {cis['beta_emp']:.4f} (target ≤ 0.02): "
                     f"{'met' if cis['beta_emp'] <= 0.02 else 'NOT met'}")
        lines.append(f"- CIS-main top-50%-mass oracle overlap = {cis['overlap_top50']:.3f} (target ≥ 0.90): "
                     f"{'met' if cis['overlap_top50'] >= 0.9 else 'NOT met'}")
    for hs in rows:
        ref = by.get(hs["settings"].get("matched_to", ""))
        if hs["family"] != "hshare" or ref is None:
            continue
        ratio = hs["beta_emp"] / max(ref["beta_emp"], 1e-12)
        lines.append(f"- {hs['variant']} β_emp / {ref['variant']} β_emp = {hs['beta_emp']:.4f} / {ref['beta_emp']:.4f}"
                     f" = {ratio:.2f} at ρ̂ {hs['rho_hat']:.3f} vs {ref['rho_hat']:.3f} (target ≥ 3): "
                     f"{'met' if ratio >= 3 else 'NOT met'}")
    return lines


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [
        "# Selection quality at a matched budget",
        "",
        f"Command: `{meta['command']}`  ",
        f"Model: {meta['model']} ({meta['dtype']}) on {meta['device']}; {meta['prompts']} prompts "
        f"({', '.join(meta['datasets'])}), {meta['continuation']} continuation, ≤ {meta['max_new_tokens']} "
        f"teacher-forced decode steps each; budget sink/local/topk = "
        f"{meta['budget']['sink']}/{meta['budget']['local']}/{meta['budget']['topk']}; "
        f"mean context {meta['mean_context']:.0f} tokens"
        + (f"; each prompt but its last {meta['shared_prefill_tail']} tokens prefilled once by the dense model, every "
           f"row from a copy of that cache (--share-prefill)" if meta.get("shared_prefill_tail") else "") + ".  ",
        f"Date {meta['date']}; torch {meta['versions']['torch']}, transformers {meta['versions']['transformers']}, "
        f"prhs_hf {meta['versions']['prhs_hf']} (git {meta['versions']['git']}).",
        "",
        "| " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[k], spec) for k, _, spec in COLUMNS) + " |")
    lines += ["", "Settings per row:", ""]
    for r in rows:
        settings = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["settings"].items())
        lines.append(f"- **{r['variant']}**: {settings or '—'}{'; ' + r['note'] if r['note'] else ''}")
    lines += fidelity_lines(rows)
    lines += key_index_lines(rows)
    met = targets(rows)
    lines += [*(["", "Targets:", "", *met] if met else []), "",
              "Definitions: ρ̂ retrievals per (head, layer, sparse step); KV/step keys attended per head and "
              "layer; β_emp = τ*_N − τ_S against the budget-matched top-N oracle of full attention (N = |S|); "
              "overlap with the oracle set and with the smallest set holding half the mass; relative errors "
              "‖x_sparse − x_dense‖/‖x_dense‖ of the last hidden state and the logits at the decoded positions; "
              "g(δ̄) the certificate of the global mean dropped mass and context; B_MI and ΔI_emp the per-cell "
              "certificate and the plug-in routing-MI perturbation (see the script's docstring).", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def key_index_lines(rows: list[dict]) -> list[str]:
    """The key index rows (``--schedule key_index``) as their own table, with the issue's targets
    against the row without an index: top-k overlap with the exact retrieval ≥ 0.99 and β_emp within
    5 % of the exact retrieval's (none: no lines)."""
    probed = [r for r in rows if "retrieval_bytes_ratio" in r]
    if not probed:
        return []
    lines = ["", "Key index: each retrieval against the exact retrieval of the same queries (top-k overlap over "
             "retrieving rows); retrieval bytes: the index over the middle region plus the re-ranked candidates' "
             "bf16 keys, over the exact retrieval's bf16 keys (per retrieving (sequence, KV head)).", "",
             "| " + " | ".join(c[1] for c in KEY_INDEX_COLUMNS) + " |", "|" + "|".join("---" for _ in KEY_INDEX_COLUMNS) + "|"]
    for r in probed:
        lines.append("| " + " | ".join(_fmt(r.get(k), spec) for k, _, spec in KEY_INDEX_COLUMNS) + " |")
    exact = next((r for r in probed if r["settings"].get("index") == "none"), None)
    if exact is None:
        return lines
    lines += ["", "Targets (top-k overlap ≥ 0.99 and β_emp within 5 % of no index's "
              f"{exact['beta_emp']:.4f}):", ""]
    for r in probed:
        if r is exact:
            continue
        close = abs(r["beta_emp"] - exact["beta_emp"]) <= 0.05 * abs(exact["beta_emp"])
        ok = r["retrieval_overlap"] is not None and r["retrieval_overlap"] >= 0.99 and close
        lines.append(f"- {r['variant']}: overlap {_fmt(r['retrieval_overlap'], '{:.4f}')}, β_emp "
                     f"{r['beta_emp']:.4f} ({(r['beta_emp'] / exact['beta_emp'] - 1) * 100:+.1f} %), bytes "
                     f"{_fmt(r['retrieval_bytes_ratio'], '{:.3f}')} of exact: {'met' if ok else 'NOT met'}")
    return lines


def fidelity_lines(rows: list[dict]) -> list[str]:
    """The per-layer proxy fidelity of the EarlySelectKV rows as a Markdown table (none: no lines)."""
    es = [r for r in rows if r.get("fidelity")]
    if not es:
        return []
    by_layer = [{f["layer"]: f for f in r["fidelity"]} for r in es]
    layers = sorted(set().union(*by_layer))
    lines = ["", "Proxy fidelity per layer (EarlySelectKV; layer 0 selects with its real query): top-k overlap "
             "|S_proxy ∩ S_real| / |S_real| of the exact top-k middle sets / retained mass (the real query's "
             "attention mass on sink ∪ S_proxy ∪ local over that on sink ∪ S_real ∪ local); mean over active "
             "(head, step) rows.", "",
             "| layer | " + " | ".join(r["variant"] for r in es) + " |", "|---|" + "---|" * len(es)]
    for layer in layers:
        cells = []
        for fid in by_layer:
            f = fid.get(layer)
            cells.append("n/a" if f is None else f"{f['topk_overlap']:.3f} / {_fmt(f['retained'], '{:.4f}')}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    means = []
    for fid in by_layer:
        fs = list(fid.values())
        ret = [f["retained"] for f in fs if f["retained"] is not None]
        means.append(f"{sum(f['topk_overlap'] for f in fs) / len(fs):.3f} / "
                     f"{sum(ret) / len(ret):.4f}" if ret else "n/a")
    lines.append("| mean | " + " | ".join(means) + " |")
    return lines


FAMILY_STYLE = {  # family -> (legend name, colour, marker)
    "cis": ("CIS", "tab:blue", "o"),
    "cis_tail": ("CIS + tail", "navy", "o"),
    "cis_group": ("CIS group-shared", "teal", "s"),
    "cis_index": ("CIS with a key index", "tab:blue", "x"),
    "hshare": ("HShare", "tab:red", "s"),
    "direct_reuse": ("DirectReuse", "tab:orange", "^"),
    "random_expansion": ("RandomExpansion", "tab:brown", "v"),
    "quest": ("Quest", "tab:purple", "D"),
    "es_quest": ("ES-Quest", "indigo", "d"),
    "es_cis": ("ES-CIS", "tab:cyan", "o"),
    "double_sparsity": ("Double Sparsity", "tab:olive", "h"),
    "h2o": ("H2O", "tab:green", "P"),
    "certkv": ("CertKV", "tab:pink", "p"),
    "streaming": ("StreamingLLM", "tab:gray", "X"),
    "oracle": ("Oracle top-k", "black", "*"),
}


def _short(row: dict) -> str:
    """A point label: CIS rows by (s, τ), the others by what distinguishes rows of one family."""
    st = row["settings"]
    if row["family"] == "cis_index":
        return row["variant"].removeprefix("CIS index ")
    if row["family"] in ("cis", "cis_tail", "cis_group"):
        return f"s{st['block_size']} τ{st['tau']}" + (f" {st['selection']}" if "selection" in st else "")
    if row["family"] in ("direct_reuse", "random_expansion"):
        return row["variant"].split(" ", 1)[1]
    if row["family"].startswith("es_"):
        return row["variant"].split(" ", 1)[1]
    if row["family"] == "hshare":
        return "matched" if "matched_to" in st else row["variant"].split(" ", 1)[-1]
    return ""


def _scatter(ax, rows: list[dict], x: str, y: str) -> None:
    seen = set()
    for r in rows:
        if r[x] is None or r[y] is None:
            continue
        name, color, marker = FAMILY_STYLE.get(r["family"], (r["family"], "k", "o"))
        ax.scatter(r[x], r[y], color=color, marker=marker, s=36, label=None if name in seen else name, zorder=3)
        seen.add(name)
        label = _short(r)
        if label:
            ax.annotate(label, (r[x], r[y]), fontsize=6, xytext=(4, 3), textcoords="offset points", color=color)


def write_plots(out_dir: Path, rows: list[dict], prefix: str = "selection_quality") -> list[str]:
    """β_emp vs ρ̂ (Fig. 6b), ΔI_emp vs B_MI (Fig. 7 left) and overlap bars as ``<prefix>_*.png``; the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []

    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    _scatter(ax, rows, "rho_hat", "beta_emp")
    ax.set_xscale("symlog", linthresh=0.05, linscale=0.3)
    ticks = [0, 0.05, 0.1, 0.2, 0.5, 1.0]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("retrieval ratio ρ̂ (StreamingLLM never retrieves: 0)")
    ax.set_ylabel("β_emp = τ*_N − τ_S")
    ax.set_title("Selection gap vs retrieval ratio at a matched budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    written.append(f"{prefix}_beta_rho.png")
    fig.savefig(out_dir / written[-1], dpi=150)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.0, 4.8))
    _scatter(ax, rows, "b_mi", "delta_i_emp")
    lo = min(min(r["delta_i_emp"] for r in rows), min(r["b_mi"] for r in rows)) * 0.7
    hi = max(max(r["delta_i_emp"] for r in rows), max(r["b_mi"] for r in rows)) * 1.4
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("certificate B_MI = g(δ̄) per (prompt, layer, head) cell, mean (nats)")
    ax.set_ylabel("routing-MI perturbation ΔI_emp, mean (nats)")
    ax.set_title("Certificate vs measured routing-MI perturbation")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    written.append(f"{prefix}_certificate.png")
    fig.savefig(out_dir / written[-1], dpi=150)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8.0, 4.4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["overlap"] for r in rows], width=0.4, label="oracle overlap")
    ax.bar([i + 0.2 for i in x], [r["overlap_top50"] for r in rows], width=0.4, label="top-50 %-mass overlap")
    ax.axhline(0.9, color="k", ls=":", lw=1)
    ax.set_xticks(list(x), [r["variant"] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Overlap with the budget-matched top-k oracle")
    fig.tight_layout()
    written.append(f"{prefix}_overlap.png")
    fig.savefig(out_dir / written[-1], dpi=150)
    plt.close(fig)
    return written


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _command() -> str:
    """The command line of this run, with the script path relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    name = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return " ".join(["python", name, *sys.argv[1:]])


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def run_matched(run, budget: dict[str, int], cis: dict, layers: int, heads: int, full: bool) -> None:
    """The controls matched to one CIS row (paper §VI-A): DirectReuse, RandomExpansion, HShare at its ρ̂.

    DirectReuse and RandomExpansion take the block size ``round(1/ρ̂)``; with ``full`` a second
    DirectReuse raises ``topk`` to CIS's processed KV. HShare takes the share ratios of
    :func:`match_hshare`.
    """
    rho, name = cis["rho_hat"], cis["variant"]
    block = max(1, round(1 / rho))
    tag = {"matched_to": name}
    run(baseline_variant(budget, "direct_reuse", f"DirectReuse s={block}", block_size=block, **tag,
                         note=f"block size matched to {name}'s ρ̂"))
    if full:
        k = budget["topk"] + max(0, round(cis["processed_kv"] - sum(budget.values())))
        run(baseline_variant({**budget, "topk": k}, "direct_reuse", f"DirectReuse s={block} k={k}", block_size=block,
                             **tag, note=f"topk raised to {name}'s processed KV (paper: +~1/6)"))
    run(baseline_variant(budget, "random_expansion", f"RandomExpansion s={block}", block_size=block, seed=cis["seed"],
                         **tag, note=f"block size matched to {name}'s ρ̂"))
    run(baseline_variant(budget, "hshare", f"HShare-matched@{name}", family="hshare", **tag,
                         **match_hshare(rho, layers, heads), note=f"share ratios chosen to match {name}'s ρ̂"))


def run_schedule(run, budget: dict[str, int], args: argparse.Namespace, layers: int, heads: int) -> None:
    """Every variant: the CIS rows first, whose ρ̂ and processed KV set the matched controls.

    Matched controls are run for CIS-main (s=16, τ=0.8, the paper's global setting) and, unless
    ``--quick``, for the CIS row of lowest ρ̂ (the aggressive operating point).
    """
    main_cis = run(cis_variant(budget, 16, 0.8, "CIS-main"))
    run(cis_variant(budget, 16, 0.8, "CIS + tail", tail=True))
    cis_rows = [main_cis]
    cis_grid = [(8, 0.8), (32, 0.8), (16, 0.6), (16, 0.7), (16, 0.9)] if not args.quick else [(8, 0.8)]
    for s, tau in cis_grid:
        cis_rows.append(run(cis_variant(budget, s, tau)))
    points = [main_cis]
    lowest = min(cis_rows, key=lambda r: r["rho_hat"])
    if not args.quick and lowest is not main_cis:
        points.append(lowest)
    for cis in points:
        run_matched(run, budget, {**cis, "seed": args.seed}, layers, heads, full=not args.quick)
    if not args.quick:
        run(baseline_variant(budget, "hshare", "HShare-2 (½,½,½)", family="hshare", note="the paper's HShare-2",
                             share_ratio=0.5, head_share_ratio=0.5, layer_share_ratio=0.5))
    run(baseline_variant(budget, "quest", "Quest", page_size=args.page_size))
    run_early_select(run, budget, args)
    run(baseline_variant(budget, "double_sparsity", "Double Sparsity"))  # r = 16, channels from each prompt
    run(baseline_variant(budget, "h2o", "H2O"))
    run(baseline_variant(budget, "certkv", "CertKV"))  # W = 32, max-pool 5, tail slot
    run(baseline_variant(budget, "streaming", "StreamingLLM"))
    run(baseline_variant(budget, "oracle", "Oracle top-k"))


def run_early_select(run, budget: dict[str, int], args: argparse.Namespace) -> None:
    """The EarlySelectKV rows: ES-Quest and ES-CIS at the mid tap (with ``--quick``, only those),
    else also at the early tap and with a rank ``--es-rank`` ``W_q``."""
    taps = [("mid", None)] if args.quick else [("mid", None), ("early", None), ("mid", args.es_rank)]
    for base in ("quest", "cis"):
        for tap, rank in taps:
            run(es_variant(budget, base, tap, rank, args.page_size))


def run_early_select_schedule(run, budget: dict[str, int], args: argparse.Namespace) -> None:
    """``--schedule early_select``: the ES rows beside their bases (Quest, CIS-main) and the oracle."""
    run(baseline_variant(budget, "quest", "Quest", page_size=args.page_size))
    run(cis_variant(budget, 16, 0.8, "CIS-main"))
    run_early_select(run, budget, args)
    run(baseline_variant(budget, "oracle", "Oracle top-k"))


def run_cis_tail_schedule(run, budget: dict[str, int], args: argparse.Namespace) -> None:
    """``--schedule cis_tail``: CIS-main and CIS + tail, both also at s = 1 (every step retrieves), and the oracle."""
    run(cis_variant(budget, 16, 0.8, "CIS-main"))
    run(cis_variant(budget, 16, 0.8, "CIS + tail", tail=True))
    run(cis_variant(budget, 1, 0.8, "CIS s=1"))
    run(cis_variant(budget, 1, 0.8, "CIS s=1 + tail", tail=True))
    run(baseline_variant(budget, "oracle", "Oracle top-k"))


def run_seeds_schedule(run, budget: dict[str, int], args: argparse.Namespace) -> None:
    """``--schedule seeds``: the seed systems at CIS-main's budget: CIS-main, CIS + tail, the
    EarlySelectKV rows, Double Sparsity (channels from each prompt), CertKV, and the oracle."""
    run(cis_variant(budget, 16, 0.8, "CIS-main"))
    run(cis_variant(budget, 16, 0.8, "CIS + tail", tail=True))
    run_early_select(run, budget, args)
    run(baseline_variant(budget, "double_sparsity", "Double Sparsity"))
    run(baseline_variant(budget, "certkv", "CertKV"))
    run(baseline_variant(budget, "oracle", "Oracle top-k"))


def run_group_schedule(run, budget: dict[str, int], args: argparse.Namespace) -> None:
    """``--schedule group``: per-head CIS-main against group-shared selection ranked by the group's
    max and by its mean score, each also at s = 1 (every step retrieves: the ranking alone), and the oracle."""
    for s in (16, 1):
        tag = "CIS-main" if s == 16 else "CIS s=1"
        run(cis_variant(budget, s, 0.8, tag))
        run(cis_variant(budget, s, 0.8, f"{tag} group max", selection="group"))
        run(cis_variant(budget, s, 0.8, f"{tag} group mean", selection="group_mean"))
    run(baseline_variant(budget, "oracle", "Oracle top-k"))


KEY_INDEX_COLUMNS = [
    ("variant", "CIS retrieval", "{}"),
    ("retrieval_overlap", "top-k overlap with exact", "{:.4f}"),
    ("dropped_mass", "δ̄", "{:.4f}"),
    ("beta_emp", "β_emp", "{:.4f}"),
    ("processed_kv", "KV/step", "{:.1f}"),
    ("rho_hat", "ρ̂", "{:.3f}"),
    ("retrieval_bytes_ratio", "retrieval bytes / exact", "{:.3f}"),
    ("top1_agree", "top-1 agree", "{:.3f}"),
]


def run_key_index_schedule(run, budget: dict[str, int], args: argparse.Namespace, head_dim: int) -> None:
    """``--schedule key_index``: shipped CIS (s 16, τ 0.8) with no index, then each index kind at
    each rerank margin of ``--margins`` (pages of ``--page-size`` tokens), all on the probe (int4
    only where ``head_dim`` splits into its scale groups)."""
    base = cis_variant(budget, 16, 0.8, "CIS index none")
    run(dataclasses.replace(base, family="cis_index", probe=True, extra={**base.extra, "index": "none"}))
    kinds = [k for k in INDEX_KINDS if k != "int4" or head_dim % INT4_GROUP == 0]
    if len(kinds) < len(INDEX_KINDS):
        print(f"key_index: int4 skipped (head size {head_dim} is not a multiple of {INT4_GROUP})", file=sys.stderr)
    for kind in kinds:
        for margin in args.margins:
            v = cis_variant(budget, 16, 0.8, f"CIS index {kind} m={margin}")
            v.config["cis"].update(index=kind, rerank_margin=margin, index_page=args.page_size)
            keys = {"index": kind, "rerank_margin": margin, **({"index_page": args.page_size} if kind == "pages" else {})}
            run(dataclasses.replace(v, family="cis_index", probe=True, extra={**v.extra, **keys}))


def run_low_rho_schedule(run, budget: dict[str, int], args: argparse.Namespace) -> None:
    """``--schedule low_rho`` (issue 13 item 4): CIS settings that retrieve at ρ̂ ≤ 10 % on the GPU
    GSM8K runs (τ 0.7, s 16) with what could close their gap: the aged-local tokens, a wider
    dilation, a larger block or a larger ``m``; the paper's τ 0.8 and the oracle for reference."""
    k = budget["topk"]
    run(cis_variant(budget, 16, 0.8, "CIS-main"))
    run(cis_variant(budget, 16, 0.7, "CIS τ=0.7"))
    variants = (("CIS τ=0.7 + local", {"keep_anchor_local": True}),
                ("CIS τ=0.7 + local, r=2", {"keep_anchor_local": True, "dilation_radius": 2}),
                ("CIS τ=0.7 + local, m=k/2", {"keep_anchor_local": True, "dilation_topm": k // 2}),
                ("CIS τ=0.75 + local", {"keep_anchor_local": True, "tau": 0.75}),
                ("CIS s=32 τ=0.8 + local", {"keep_anchor_local": True, "block_size": 32, "tau": 0.8}))
    for label, keys in variants:
        v = cis_variant(budget, keys.get("block_size", 16), keys.get("tau", 0.7), label)
        v.config["cis"].update(keys)
        v.extra.update(keys)
        run(v)
    run(baseline_variant(budget, "oracle", "Oracle top-k"))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=fetch.DEFAULT_MODEL, help="registry name, .gguf, checkpoint folder or hub id")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    ap.add_argument("--prompts", type=int, default=4, help="number of prompts, split over the datasets")
    ap.add_argument("--datasets", default="gsm8k,coqa")
    ap.add_argument("--text", default=None, metavar="PATH",
                    help="take the prompts from this calibration text instead of --datasets (a file or a folder, "
                         "as prhs-hf calibrate --text): --prompts of --length tokens, each forced on with the text "
                         "that follows")
    ap.add_argument("--length", type=int, default=1024, help="with --text: prompt tokens (default: 1024)")
    ap.add_argument("--data-dir", default=None,
                    help="folder with gsm8k_test.jsonl[.gz] / coqa_validation.jsonl[.gz] (default: $PRHS_HF_DATA_DIR, "
                         "else the prhs-hf cache)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="teacher-forced decode steps per prompt (at most)")
    ap.add_argument("--continuation", choices=("reference", "greedy"), default="reference",
                    help="force the dataset's reference text, or the dense model's greedy continuation")
    ap.add_argument("--sink", type=int, default=8)
    ap.add_argument("--local", type=int, default=32)
    ap.add_argument("--topk", type=int, default=88)
    ap.add_argument("--page-size", type=int, default=16, help="Quest page size")
    ap.add_argument("--seed", type=int, default=0, help="RandomExpansion seed")
    ap.add_argument("--es-rank", type=int, default=64, help="rank of the low-rank W_q of the EarlySelectKV rows")
    ap.add_argument("--margins", type=lambda text: [int(m) for m in text.split(",")], default=[0, 32, 128],
                    help="--schedule key_index: the cis.rerank_margin values of each index kind (default: 0,32,128)")
    ap.add_argument("--schedule", choices=("full", "early_select", "cis_tail", "group", "low_rho", "seeds",
                                           "key_index"),
                    default="full",
                    help="every selector; or only Quest, CIS-main, the EarlySelectKV rows and the oracle; or only "
                         "CIS-main, CIS + tail (s = 16 and s = 1) and the oracle; seeds: CIS-main, CIS + tail, "
                         "EarlySelectKV, Double Sparsity, CertKV and the oracle; key_index: CIS with each key "
                         "index kind at each --margins value, its retrieval compared with the exact one")
    ap.add_argument("--share-prefill", action="store_true",
                    help=f"prefill all but each prompt's last {SHARED_PREFILL_TAIL} tokens once with the dense model "
                         "and start every row from a copy of that cache (long prompts: the rows then cost their "
                         "decode steps, not a prefill each)")
    ap.add_argument("--name", default="selection_quality", help="file name (stem) of the report and its plots")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 24 steps, fewer CIS settings (a smoke run)")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="measure nothing: draw the plots of an existing report beside it (<its name>_*.png)")
    return ap.parse_args(argv)


def replot(path: Path) -> int:
    """Draw the plots of a saved report next to it, named after it, and record them in its JSON."""
    report = json.loads(path.read_text(encoding="utf-8"))
    report["meta"]["plots"] = write_plots(path.parent, report["rows"], prefix=path.stem)
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"wrote {len(report['meta']['plots'])} plots beside {path}", file=sys.stderr)
    return 0 if report["meta"]["plots"] else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(Path(args.replot))
    if args.quick:
        args.prompts, args.max_new_tokens = min(args.prompts, 2), min(args.max_new_tokens, 24)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = {"sink": args.sink, "local": args.local, "topk": args.topk}
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]

    texts = None
    if args.text is not None:  # checked before the model loads (read lazily after)
        from prhs_hf.calibration.options import CalibrationError
        from prhs_hf.calibration.texts import calibration_texts

        try:
            texts, _ = calibration_texts(args.text, None)
        except CalibrationError as exc:
            print(f"selection_quality.py: error: {exc}", file=sys.stderr)
            return 2
    model, tokenizer = fetch.load_model(args.model, dtype=args.dtype, device=args.device)
    if texts is not None:
        datasets = [f"text: {args.text}"]
        prompts = text_prompts(tokenizer, texts, args.prompts, args.length, args.max_new_tokens)
    else:
        prompts = build_prompts(tokenizer, args.prompts, datasets, args.max_new_tokens, args.data_dir)
    if args.continuation == "greedy":
        prompts = [greedy_continuation(model, p, args.max_new_tokens, args.device) for p in prompts]
    lengths = [p.prompt.shape[1] for p in prompts]
    print(f"{len(prompts)} prompts, {min(lengths)}-{max(lengths)} tokens, "
          f"{sum(p.continuation.shape[1] for p in prompts)} decode steps in all", file=sys.stderr)
    prefixes = [prefill_prefix(model, p, args.device) if args.share_prefill else None for p in prompts]
    dense = [teacher_forced(model, p, args.device, prefix) for p, prefix in zip(prompts, prefixes)]

    rows: list[dict] = []
    meta = {
        "command": _command(),
        "model": args.model,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": _device_name(args.device),
        "prompts": len(prompts),
        "prompt_names": [p.name for p in prompts],
        "prompt_tokens": lengths,
        "datasets": datasets,
        "continuation": args.continuation,
        "max_new_tokens": args.max_new_tokens,
        "budget": budget,
        "schedule": args.schedule,
        "es_rank": args.es_rank,
        "shared_prefill_tail": SHARED_PREFILL_TAIL if args.share_prefill else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "prhs_hf": prhs_hf.__version__, "python": platform.python_version(), "git": _git_commit()},
    }

    def save() -> None:
        meta["mean_context"] = rows[0]["mean_context"]
        (out_dir / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2),
                                                    encoding="utf-8")
        write_markdown(out_dir / f"{args.name}.md", meta, rows)

    def run(variant: Variant) -> dict:
        row = run_variant(model, variant, prompts, dense, args.device, prefixes)
        rows.append(row)
        save()  # after every row, so a long run that stops keeps what it measured
        rho = "n/a" if row["rho_hat"] is None else f"{row['rho_hat']:.3f}"
        print(f"{variant.label:34s} ρ̂={rho} KV={row['processed_kv']:.1f} β={row['beta_emp']:.4f} "
              f"top50={row['overlap_top50']:.3f} err={row['hidden_rel_err']:.4f} ({row['seconds']:.0f}s)",
              file=sys.stderr)
        return row

    if args.schedule == "early_select":
        run_early_select_schedule(run, budget, args)
    elif args.schedule == "cis_tail":
        run_cis_tail_schedule(run, budget, args)
    elif args.schedule == "group":
        run_group_schedule(run, budget, args)
    elif args.schedule == "low_rho":
        run_low_rho_schedule(run, budget, args)
    elif args.schedule == "seeds":
        run_seeds_schedule(run, budget, args)
    elif args.schedule == "key_index":
        text = model.config.get_text_config()
        run_key_index_schedule(run, budget, args,
                               getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    else:
        run_schedule(run, budget, args, model.config.num_hidden_layers, model.config.num_attention_heads)

    meta["plots"] = write_plots(out_dir, rows, prefix=args.name)
    save()
    print("\n".join(targets(rows)), file=sys.stderr)
    print(f"wrote {out_dir / (args.name + '.json')}, .md and {len(meta['plots'])} plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
