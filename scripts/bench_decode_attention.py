#!/usr/bin/env python
"""Decode attention operator latency: PrHS's CIS step against the fastest fair dense decode.

Shapes (bf16, head size 128), in this order: the issue's B16/16k MHA 32/32 and GQA 32/8 (budget
ctx/8, see :func:`budget`), the Qwen2.5-1.5B layer (12 query / 2 KV heads) at B16/16k, B32/16k
and B8/32k with the budget of ``configs/cis.yaml`` (sink 8, local 32, top-k 88, m = k/3), then
the rest of the paper's Table IV (MHA at B8/B16, 2k/4k/16k). ``--quick`` on a GPU: the first
three; without CUDA a tiny shape through the Triton interpreter (the CPU smoke test).

Dense columns, measured side by side in the same run (median of ``triton.testing.do_bench``,
each call captured in a CUDA graph and replayed, so Python launch overhead is removed the same
way for every column), with a boolean mask over the cache where the column takes one:

* ``dense_transformers``: transformers' ``sdpa_attention_forward`` as shipped; with a mask and
  GQA it ``repeat_kv``-copies K/V to every query head ("dense (transformers sdpa, repeat_kv)");
* ``dense_sdpa_gqa``: the same SDPA call with ``enable_gqa=True`` and the mask
  (``_bench_common.fair_sdpa_attention``, the attention function of bench_e2e_decode's dense-gqa);
* ``dense_flash_packed``: SDPA's flash backend, no mask, the G query heads of a KV head packed as
  G queries of one attention;
* ``dense_flashinfer``: FlashInfer's paged batch decode (each row's cache one page, HND layout)
  when ``flashinfer`` imports; else ``dense_flashinfer_status`` says why.

Every speedup is quoted against the fastest of these in the row (``fastest_dense`` names it).

PrHS columns: ``flex`` (FlexAttention with a BlockMask of the step's token pattern, mask
construction excluded); ``sparse`` (our sparse-attention kernel alone, on the step's index
lists); ``sparse_union`` (:func:`sparse_decode_attention_union` on the same lists: the union of each
KV group's per-head sets built by the Triton map builder, then read once per group with every head masked to its own set;
``union_fraction``: union entries / summed counts, the share of ``sparse``'s K/V reads it makes;
``sparse_union_max_abs_diff`` vs ``sparse``); ``cis8`` / ``cis16`` (the whole CIS decode step, s = 8 / 16: match + top-k retrieval for
exactly ceil(B*Hq/s) rows, the steady-state share rate, or with ``--retrieve-share P`` (a ρ̂
measured on a real model, e.g. 0.19 for Qwen2.5-Coder-1.5B on 16k CoQA stories) ceil(B*Hq*P) rows,
+ composition + attention; anchor-set path); ``cis16_topk`` (top-k anchors); ``cis16_group`` (the whole step of group-shared CIS,
``cis.selection: group``: one index set per KV head, matched on the group's queries, exactly
ceil(B*Hkv/16) (or ceil(B*Hkv*P)) KV heads retrieving, one K/V read per group in the attention;
``cis16_group_max_abs_diff`` vs the same step on the PyTorch ops); ``ref16`` (PyTorch reference ops). The group-aware
launchers ``topk_retrieval_grouped`` and ``sparse_decode_attention_grouped`` are timed on the
same inputs when ``prhs_hf.ops`` has them (``grouped_*_status`` otherwise; an error calling
them is recorded as ``grouped_*_error``).

``ds`` (Double Sparsity, the paper's Table IV/V baseline, ``scripts/_ds_decode.py``): every row
scores every step, nothing shared: the query's r label channels (``--ds-rank``, default 16, the
paper's label rank; one set per KV head, from the step's |q| x |k| channel statistic, which the
timing does not depend on) against a label cache ``[B, Hkv, S, r]`` kept beside the KV cache
(``topk_retrieval`` with every row flagged: label scoring + exact top-k), then ``compose_indices``
(sink + top-k + local, no dilation) and the same ``sparse_decode_attention`` as CIS. DS gets
CIS's per-row capacity: top-k = cap - sink - local (``ds_k``). Its stages (``ds_stage_*``): query
gather, label scoring (with the row compaction), select, compose, attention; ``ds_topk_recall``:
the share of the exact top-``ds_k`` it selects; ``ds_max_abs_diff``: vs the dense PyTorch DS step
(``ds_decode_step_reference``). The label-cache append of the new token is not timed (nor is the
KV append of any column).

Stage breakdown of the CIS-16 step (each stage replayed alone on the step's own inputs): match,
retrieval (compact / score / select), dilated set, compose, attention, glue; gap = step - sum.
``stage16_dilated_ms_by_collect``: the dilated set on its map path with each collect
(``dilated_set.MAP_COLLECTS``: ``serial``, one program per row; ``parallel``, programs per
(row, chunk)), at every shape, whichever method ``"auto"`` takes there (``MAP_COLLECT`` picks the
model's); ``stage16_map_collects_equal_to_step``: both give the step's sets.
The radix8 select (``tuned(topk_retrieval, select="radix8")`` at every shape: the step's own select above k = 256,
``stage16_select_kernel`` names it) by stage, each replayed alone through its stop points:
``stage16_select_ms_by_part`` (``passes``, ``collect``, ``block_sort``, ``merge``, with the merge
finish ``topk_select.MERGE_RANK``, ``stage16_merge_rank``) and ``stage16_merge_ms_by_rank`` (the
merge launches of each finish of ``topk_select.MERGE_RANKS``: ``search``, a binary search per
block pair, ``count``, pair counts added atomically then a scatter; each as the whole radix8 select
minus its stop after the block sort); ``stage16_merge_ranks_equal_to_step``: both give the step's
top-k.
Each row states the target (CIS-16 >= 5x the fastest dense for MHA, >= 3x for GQA)
and, when it is missed, the largest stage.

Keys are Gaussian with "hot spans" (runs of 64 tokens aligned with a per-head direction that
the queries share), so that top-k sets are clustered as in real attention.

Key index (``--index``, prhs_hf/ops/key_index/key_index.py; writes ``bench_key_index.json`` only): the GQA
shape B16/16k 32/8 alone (without CUDA the tiny shape), tau and s of ``configs/cis.yaml``, a
``--retrieve-share`` of the rows retrieving (default 0.5) through the real match. Times (CUDA graph
replay, like every column here) the retrieval alone, exact (``topk_retrieval``) against the
two-stage ``topk_retrieval_indexed`` of each index kind and ``--index-margins`` at the budget's k
and at k = ctx/8, with each one's recall of the exact top-k; the grouped retrieval at the middle
margin; the index update of one layer; and the whole CIS-16 step (match + retrieval + composition
+ attention; the indexed steps with their update) against the dense columns. The keys are the
hot-span keys of :func:`make_inputs`, not a model's: the recalls say how the index ranks those.

Usage: ``python scripts/bench_decode_attention.py [--quick] [--ds-rank R] [--out DIR]``;
``python scripts/bench_decode_attention.py --index [--index-margins 256,512,1024] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

if not torch.cuda.is_available():  # CPU smoke test: kernels through the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import yaml  # noqa: E402

import _bench_common as common  # noqa: E402
from _ds_decode import ds_decode_step, ds_decode_step_reference, ds_query_labels  # noqa: E402
from prhs_hf.ops.cis_match.cis_match import cis_match  # noqa: E402
from prhs_hf.ops.compose.compose_indices import compose_from_sets, compose_indices, dilate_and_compose  # noqa: E402
from prhs_hf.ops.compose.dilated_set import MAP_COLLECTS, dilated_set  # noqa: E402
from prhs_hf.ops.decode_ops import REFERENCE_OPS, TRITON_OPS, group_query  # noqa: E402
from prhs_hf.ops.key_index.key_index import (  # noqa: E402
    INDEX_KINDS,
    allocate_key_index,
    index_bytes_per_slot,
    topk_retrieval_indexed,
    update_key_index,
    write_key_index,
)
from prhs_hf.ops.sparse_attention.group_union import group_union  # noqa: E402
from prhs_hf.ops.sparse_attention.sparse_decode_attention import (  # noqa: E402
    sparse_decode_attention,
    sparse_decode_attention_union,
)
from prhs_hf.ops.topk.topk_retrieval import default_select, topk_retrieval, topk_retrieval_grouped, tuned  # noqa: E402
from prhs_hf.ops.topk.topk_select import MERGE_RANK, MERGE_RANKS  # noqa: E402
from prhs_hf.selectors.double_sparsity import label_keys, top_channels  # noqa: E402

TAU = 0.8
SPAN = 64  # hot-span length (tokens)
TARGET_MHA = 5.0  # the target: CIS-16 step at least this many times faster than the fastest dense (MHA)
TARGET_GQA = 3.0  # ... and for GQA shapes
STAGES = ("match", "retrieval", "dilate_compose", "attention")  # the step; the record (state update) apart
DENSE = tuple(common.DENSE_LABELS)  # transformers, sdpa_gqa, flash_packed, flashinfer
PRHS_COLUMNS = ("flex", "sparse", "sparse_union", "cis8", "cis16", "cis16_topk", "cis16_group", "ref16", "ds")
DS_RANK = 16  # Double Sparsity's label channels per head (the paper's r)
DS_STAGES = ("gather", "label_score", "select", "compose", "attention")
CIS_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cis.yaml"

#: the group-aware launchers: (module, name) in prhs_hf.ops
GROUPED = {
    "grouped_retrieval": ("topk_retrieval", "topk_retrieval_grouped"),
    "grouped_sparse": ("sparse_decode_attention", "sparse_decode_attention_grouped"),
}


@dataclass
class Shape:
    B: int
    Hq: int
    Hkv: int
    D: int
    ctx: int
    budget: str = "ctx/8"  # or a config's budget: "cis.yaml", "cis_longbench.yaml" (configs/)


@dataclass
class Budget:
    sink: int
    local: int
    k: int
    dil_m: int
    dil_r: int
    cap: int


def budget(ctx: int) -> Budget:
    """1/8 of the context, split sink : local : top-k(+dilation) like the paper at 16k.

    N = ctx/8; sink = max(8, N/32); local = N/8; the rest R holds k selected tokens and up to
    2*r*m dilation neighbours with m = k/3, r = 1 (the paper's defaults), so k = 3R/5 and
    cap = sink + local + k + 2m <= N. At 16k: 64 / 256 / k = 1036, m = 345, cap = 2046.
    """
    n = ctx // 8
    sink = max(8, n // 32)
    local = n // 8
    k = 3 * (n - sink - local) // 5
    m, r = k // 3, 1
    return Budget(sink, local, k, m, r, sink + local + k + 2 * r * m)


def config_budget(path: Path = CIS_CONFIG) -> Budget:
    """The budget of a PrHS config file (``budget`` and ``cis.dilation_*``; m = floor(k/3) when null)."""
    data = yaml.safe_load(path.read_text())
    b, cis = data["budget"], data.get("cis", {})
    k = int(b["topk"])
    m = cis.get("dilation_topm")
    m = k // 3 if m is None else int(m)
    r = int(cis.get("dilation_radius", 1))
    return Budget(int(b["sink"]), int(b["local"]), k, m, r, int(b["sink"]) + int(b["local"]) + k + 2 * r * m)


def shape_budget(sh: Shape) -> Budget:
    if sh.budget == "ctx/8":
        return budget(sh.ctx)
    path = CIS_CONFIG.parent / sh.budget
    if sh.budget.endswith(".yaml") and path.is_file():
        return config_budget(path)
    raise ValueError(f"Shape.budget {sh.budget!r}: expected 'ctx/8' or a file of configs/ ('cis.yaml')")


def parse_shapes(text: str) -> list[Shape]:
    """``--shapes``: ``B:ctx:Hq:Hkv[:BUDGET]`` entries, comma-separated (head size 128; BUDGET ``ctx/8``, the
    default, or a config file of configs/ such as ``cis_longbench.yaml``)."""
    plan = []
    for entry in text.split(","):
        parts = entry.strip().split(":")
        try:
            if len(parts) not in (4, 5):
                raise ValueError
            B, ctx, hq, hkv = (int(x) for x in parts[:4])
        except ValueError:
            raise ValueError(f"--shapes {entry!r}: expected B:ctx:Hq:Hkv[:BUDGET], e.g. 1:131072:32:8:cis_longbench.yaml")
        if min(B, ctx, hq, hkv) < 1 or hq % hkv:
            raise ValueError(f"--shapes {entry!r}: B, ctx, Hq, Hkv must be >= 1 and Hq a multiple of Hkv")
        sh = Shape(B, hq, hkv, 128, ctx, parts[4] if len(parts) == 5 else "ctx/8")
        shape_budget(sh)  # a bad BUDGET fails here, before any GPU work
        plan.append(sh)
    return plan


#: the target's shapes, first: MHA and GQA at B16/16k (budget ctx/8), the Qwen2.5-1.5B layer
ISSUE_SHAPES = [Shape(16, 32, 32, 128, 16384), Shape(16, 32, 8, 128, 16384)]
QWEN_SHAPES = [Shape(16, 12, 2, 128, 16384, "cis.yaml"), Shape(32, 12, 2, 128, 16384, "cis.yaml"),
               Shape(8, 12, 2, 128, 32768, "cis.yaml")]
TABLE_IV = [Shape(b, 32, 32, 128, c) for b in (8, 16) for c in (2048, 4096, 16384) if (b, c) != (16, 16384)]


def shapes(quick: bool, cuda: bool) -> list[Shape]:
    if not cuda:
        return [Shape(2, 4, 2, 32, 512)]
    if quick:
        return ISSUE_SHAPES + QWEN_SHAPES[:1]
    return ISSUE_SHAPES + QWEN_SHAPES + TABLE_IV


# ----------------------------------------------------------------------------- helpers


def copy_bandwidth(dev: torch.device) -> float:
    """GB/s of a large device-to-device copy (read + write bytes)."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = common.median_ms(lambda: dst.copy_(src), dev).ms
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def grouped_launchers() -> dict[str, tuple[Optional[Callable], str]]:
    """Feature detection of the group-aware launchers: name -> (launcher or None, status)."""
    found = {}
    for key, (module, name) in GROUPED.items():
        try:
            mod = importlib.import_module(f"prhs_hf.ops.{module}")
        except Exception as exc:  # noqa: BLE001
            found[key] = (None, f"not importable: prhs_hf.ops.{module}: {type(exc).__name__}: {exc}")
            continue
        fn = getattr(mod, name, None)
        found[key] = (fn, "available" if fn is not None else f"not importable: prhs_hf.ops.{module} has no {name} yet")
    return found


def make_inputs(sh: Shape, bud: Budget, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Cache with hot spans, one decode query per head, no padding, t = ctx for every row."""
    g = torch.Generator(device=dev).manual_seed(seed)
    B, Hq, Hkv, D, S = sh.B, sh.Hq, sh.Hkv, sh.D, sh.ctx
    group = Hq // Hkv
    u = torch.randn(B, Hkv, D, generator=g, device=dev)
    u = u / u.norm(dim=-1, keepdim=True)
    lo, hi = bud.sink, S - bud.local
    n_spans = max(1, math.ceil(1.25 * bud.k / SPAN))
    starts = torch.randint(lo, max(lo + 1, hi - SPAN), (B, Hkv, n_spans), generator=g, device=dev)
    pos = torch.arange(S, device=dev)
    hot = ((pos >= starts[..., None]) & (pos < starts[..., None] + SPAN)).any(dim=2)  # [B, Hkv, S]
    k_cache = torch.randn(B, Hkv, S, D, generator=g, device=dev)
    # hot keys score ~4 standard deviations above the others for these queries
    k_cache += (4.0 / 1.5) * math.sqrt(D) * hot[..., None].float() * u[:, :, None, :]
    v_cache = torch.randn(B, Hkv, S, D, generator=g, device=dev).to(dtype)
    k_cache = k_cache.to(dtype)
    q = torch.randn(B, Hq, D, generator=g, device=dev) + 1.5 * u.repeat_interleave(group, dim=1)
    q = q.to(dtype)
    i32 = torch.int32
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        pad=torch.zeros(B, dtype=i32, device=dev),
        t=torch.full((B,), S, dtype=i32, device=dev),
        lo=torch.full((B,), lo, dtype=i32, device=dev),
        hi=torch.full((B,), hi, dtype=i32, device=dev),
        active=torch.ones(B, dtype=torch.bool, device=dev),
        scale=1.0 / math.sqrt(D),
    )


def make_anchors(x: dict, sh: Shape, bud: Budget, s: int, g: torch.Generator, grouped: bool = False,
                 share: Optional[float] = None) -> tuple:
    """Block state mid-way: s-1 anchors per row; exactly ceil(B*rows/s) rows match none, or with
    ``share`` (``--retrieve-share``: a ρ̂ measured on a real model) ceil(B*rows*share).

    Every anchor slot a holds the true top-k of a query near the current one (cosine ~0.97);
    a sharing row's anchor vector at one random slot is that query's direction, the other
    anchor vectors (and all of a retrieving row's) are random directions (cosine ~0.1).
    The rows are the query heads, or with ``grouped`` (``cis.selection: group``) the KV heads:
    anchor vectors ``group_query`` of the group's queries, top-k by the group's largest score.
    """
    B, D = sh.B, sh.D
    H = sh.Hkv if grouped else sh.Hq
    dev = x["q"].device
    n_anchor = max(1, s - 1)
    qf = x["q"].float()
    everyone = torch.ones(B, H, dtype=torch.bool, device=dev)
    if dev.type == "cpu":  # set-up, not timed: the reference's top-k, not the kernels' through Triton's interpreter
        retrieval = REFERENCE_OPS.topk_retrieval_grouped if grouped else REFERENCE_OPS.topk_retrieval
    else:
        retrieval = topk_retrieval_grouped if grouped else topk_retrieval
    near_q, near_idx = [], []
    for _ in range(s):
        noise = torch.randn(B, sh.Hq, D, generator=g, device=dev)
        near = (qf + 0.25 * qf.norm(dim=-1, keepdim=True) / math.sqrt(D) * noise).to(x["q"].dtype)
        near_q.append(group_query(near, sh.Hkv) if grouped else near.float())
        near_idx.append(retrieval(near, x["k_cache"], x["pad"], x["lo"], x["hi"], everyone, bud.k, x["scale"]))
    anchor_idx = torch.stack(near_idx, dim=2)
    n_retrieve = math.ceil(B * H / s) if share is None else math.ceil(B * H * share)
    perm = torch.randperm(B * H, generator=g, device=dev)
    retrieve = torch.zeros(B * H, dtype=torch.bool, device=dev)
    retrieve[perm[:n_retrieve]] = True
    slot = torch.randint(0, n_anchor, (B, H), generator=g, device=dev)
    planted = torch.zeros(B, H, s, dtype=torch.bool, device=dev)
    planted.scatter_(2, slot[..., None], True)
    planted &= ~retrieve.view(B, H, 1)
    near_q = torch.stack(near_q, dim=2)
    anchor_q = torch.where(planted[..., None], near_q, torch.randn(near_q.shape, generator=g, device=dev))
    anchor_q = anchor_q / anchor_q.norm(dim=-1, keepdim=True)
    anchor_count = torch.full((B, H), n_anchor, dtype=torch.int32, device=dev)
    return anchor_q, anchor_count, anchor_idx, n_retrieve


def flex_pattern(idx: torch.Tensor, count: torch.Tensor, S: int) -> torch.Tensor:
    """[B, Hq, S] bool membership of the step's index lists (pad = 0)."""
    B, H, cap = idx.shape
    member = torch.zeros(B, H, S + 1, dtype=torch.bool, device=idx.device)
    valid = torch.arange(cap, device=idx.device) < count[..., None]
    member.scatter_(2, torch.where(valid, idx.long(), S), True)
    return member[..., :S]


# ----------------------------------------------------------------------------- one shape


def dense_columns(x: dict, sh: Shape, dev: torch.device, time_it: Callable, row: dict) -> None:
    """The dense baselines of one shape, into ``row`` (``dense_<name>_ms``, ``..._timing``, status)."""
    q, kc, vc, scale = x["q"], x["k_cache"], x["v_cache"], x["scale"]
    B, Hq, Hkv, D = sh.B, sh.Hq, sh.Hkv, sh.D
    q4 = q[:, :, None, :]
    # what transformers passes at a decode step with a StaticCache or padding: a [B, 1, 1, S] mask
    pos = torch.arange(sh.ctx, device=dev)
    mask = (pos[None, :] >= x["pad"][:, None].long()) & (pos[None, :] < x["t"][:, None].long())
    mask = mask[:, None, None, :]
    stub = common.attention_stub(Hq, Hkv)
    ref = None
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "transformers": lambda: common.transformers_sdpa_attention(stub, q4, kc, vc, mask, scaling=scale)[0],
        "sdpa_gqa": lambda: common.fair_sdpa_attention(stub, q4, kc, vc, mask, scaling=scale)[0],
    }
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # the G query heads of a KV head are G queries of one attention (the maths of enable_gqa
        # without a mask; the flash backend takes it as plain MHA)
        q_packed = q.view(B, Hkv, Hq // Hkv, D)

        def flash_packed():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q_packed, kc, vc, scale=scale).reshape(B, 1, Hq, D)

        calls["flash_packed"] = flash_packed
    else:
        row["dense_flash_packed_status"] = "n/a: needs CUDA (SDPA flash backend)"
    if dev.type == "cuda":
        try:
            fi = common.flashinfer_decode(q, kc, vc, scale)
            calls["flashinfer"] = lambda: fi()[:, None]
            row["dense_flashinfer_status"] = "measured"
        except Exception as exc:  # noqa: BLE001 - optional: say what happened
            row["dense_flashinfer_status"] = f"not available: {type(exc).__name__}: {str(exc)[:300]}"
    else:
        row["dense_flashinfer_status"] = "not available: needs CUDA"
    for name in DENSE:
        row[f"dense_{name}_ms"], row[f"dense_{name}_timing"] = None, "n/a"
        if name not in calls:
            continue
        try:
            out = calls[name]().reshape(B, Hq, D).float()
            ref = out if ref is None else ref
            row[f"dense_{name}_max_abs_diff"] = (out - ref).abs().max().item()  # vs dense_transformers
            row[f"dense_{name}_ms"], row[f"dense_{name}_timing"] = time_it(calls[name])
        except Exception as exc:  # noqa: BLE001 - a failing column is reported, the others go on
            row[f"dense_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"    dense {name} failed: {row[f'dense_{name}_error']}", flush=True)
    name, ms = common.fastest({n: row[f"dense_{n}_ms"] for n in DENSE})
    row["fastest_dense"], row["fastest_dense_label"], row["fastest_dense_ms"] = name, common.DENSE_LABELS.get(name), ms


def grouped_columns(x: dict, sh: Shape, res, bud: Budget, s: int, time_it: Callable, launchers: dict, row: dict) -> None:
    """The group-aware launchers, where they exist, on the CIS-16 step's inputs.

    Group-shared selection: one index list per KV head. Retrieval runs for exactly
    ceil(B*Hkv/s) KV groups (the steady-state share rate with matching per KV head) and is
    checked against ``topk_retrieval_grouped_reference``; the grouped attention takes the first
    head's composed list of each group and is checked against :func:`sparse_decode_attention`
    given that list for every head of the group (same keys per head as the ``sparse`` column).
    """
    q, kc, vc, pad, scale = x["q"], x["k_cache"], x["v_cache"], x["pad"], x["scale"]
    B, Hkv, G = sh.B, sh.Hkv, sh.Hq // sh.Hkv
    n_groups = math.ceil(B * Hkv / s)
    perm = torch.randperm(B * Hkv, generator=torch.Generator().manual_seed(2)).to(q.device)
    retrieve_kv = torch.zeros(B * Hkv, dtype=torch.bool, device=q.device)
    retrieve_kv[perm[:n_groups]] = True
    retrieve_kv = retrieve_kv.view(B, Hkv)
    idx_kv, count_kv = res.idx[:, ::G].contiguous(), res.count[:, ::G].contiguous()
    lo, hi = x["lo"], x["hi"]

    def check_retrieval(fn):
        from prhs_hf.ops.topk.topk_retrieval import topk_retrieval_grouped_reference

        got = fn(q, kc, pad, lo, hi, retrieve_kv, bud.k, scale)
        want = topk_retrieval_grouped_reference(q, kc, pad, lo, hi, retrieve_kv, bud.k, scale)
        # the same index set per retrieving group (order among exact score ties may differ)
        rows = retrieve_kv[..., None].expand_as(want)
        return {"equal_to_reference": bool(torch.equal(got.sort(-1).values[rows], want.sort(-1).values[rows]))}

    def check_sparse(fn):
        got = fn(q, kc, vc, pad, idx_kv, count_kv, scale)
        want = sparse_decode_attention(q, kc, vc, pad, idx_kv.repeat_interleave(G, 1), count_kv.repeat_interleave(G, 1), scale)
        return {"max_abs_diff": (got.float() - want.float()).abs().max().item()}

    calls = {
        "grouped_retrieval": (check_retrieval, lambda fn: fn(q, kc, pad, lo, hi, retrieve_kv, bud.k, scale)),
        "grouped_sparse": (check_sparse, lambda fn: fn(q, kc, vc, pad, idx_kv, count_kv, scale)),
    }
    row["grouped_retrieval_groups"] = n_groups
    for key, (fn, status) in launchers.items():
        row[f"{key}_status"], row[f"{key}_ms"] = status, None
        if fn is None:
            continue
        check, call = calls[key]
        try:
            row.update({f"{key}_{k}": v for k, v in check(fn).items()})
            row[f"{key}_ms"], row[f"{key}_timing"] = time_it(lambda: call(fn))
        except Exception as exc:  # noqa: BLE001 - recorded as an error (the test fails on it), not a skip
            row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"    {key} failed: {row[f'{key}_error']}", flush=True)


def ds_label_channels(x: dict, sh: Shape, r: int) -> torch.Tensor:
    """``[Hkv, r]`` int64 label channels per KV head, ascending: the largest mean |q_c| x mean |k_c|
    (the group's queries of the step, the cache's keys). A stand-in for DS's offline calibration:
    which channels are chosen changes the selection, not the time of the step."""
    G = sh.Hq // sh.Hkv
    q_abs = x["q"].float().abs().view(sh.B, sh.Hkv, G, sh.D).mean(dim=(0, 2))
    k_abs = x["k_cache"].float().abs().mean(dim=(0, 2))  # [Hkv, D]
    return top_channels(q_abs * k_abs, r).sort(dim=-1).values


def ds_columns(x: dict, sh: Shape, bud: Budget, r: int, time_it: Callable, row: dict) -> None:
    """The Double Sparsity step (``ds_*``) and its stages, into ``row``.

    Label cache ``[B, Hkv, S, r]`` (one set of channels per KV head, DS's layout), every row
    scoring and selecting at every step, top-k = cap - sink - local, the CIS attention kernel.
    """
    q, kc, vc, pad, lo, hi, t, scale = (x[n] for n in ("q", "k_cache", "v_cache", "pad", "lo", "hi", "t", "scale"))
    B, Hq, Hkv = sh.B, sh.Hq, sh.Hkv
    ds_k = bud.cap - bud.sink - bud.local
    channels = ds_label_channels(x, sh, r)
    label = label_keys(kc, channels[None].expand(B, Hkv, r)).contiguous()  # [B, Hkv, S, r]
    q_channels = channels.repeat_interleave(Hq // Hkv, dim=0).contiguous()  # [Hq, r]
    geo = (label, q_channels, pad, t, lo, hi, hi, x["active"])
    kw = dict(sink=bud.sink, k=ds_k, scale=scale)

    def step():
        return ds_decode_step(q, kc, vc, *geo, cap=bud.cap, **kw)

    res = step()
    row.update(ds_rank=r, ds_k=ds_k, ds_label_heads=Hkv, ds_avg_kv_per_head=float(res.count.float().mean()))
    row["ds_label_cache_bytes"] = label.numel() * label.element_size()
    _, want = ds_decode_step_reference(q, kc, vc, *geo, **kw)
    row["ds_max_abs_diff"] = (res.out.float() - want).abs().max().item()
    del want
    everyone = x["active"].view(B, 1).expand(B, Hq)
    exact = topk_retrieval(q, kc, pad, lo, hi, everyone, ds_k, scale)
    picked = flex_pattern(res.sel, (res.sel >= 0).sum(-1), sh.ctx)  # [B, Hq, S] membership
    exact_valid = exact >= 0
    hit = picked.gather(2, exact.long().clamp_min(0)) & exact_valid
    row["ds_topk_recall"] = float(hit.sum()) / max(1, int(exact_valid.sum()))
    row["ds_ms"], row["ds_timing"] = time_it(step)
    q_label = ds_query_labels(q, q_channels)

    def retrieval(stop="select"):
        return tuned(topk_retrieval, stop_after=stop)(q_label, label, pad, lo, hi, everyone, ds_k, scale)

    row["ds_stage_gather_ms"] = time_it(lambda: ds_query_labels(q, q_channels))[0]
    row["ds_stage_label_score_ms"] = time_it(lambda: retrieval("score"))[0]  # compaction + label scores
    row["ds_stage_retrieval_ms"] = time_it(retrieval)[0]  # label scoring + select
    row["ds_stage_select_ms"] = row["ds_stage_retrieval_ms"] - row["ds_stage_label_score_ms"]
    row["ds_stage_compose_ms"] = time_it(
        lambda: compose_indices(t, lo, hi, hi, res.sel, False, bud.sink, 0, 0, bud.cap))[0]
    row["ds_stage_attention_ms"] = time_it(lambda: sparse_decode_attention(q, kc, vc, pad, res.idx, res.count, scale))[0]
    row["ds_stage_sum_ms"] = sum(row[f"ds_stage_{st}_ms"] for st in DS_STAGES)


def run_shape(sh: Shape, dev: torch.device, dtype: torch.dtype, flex_fn, launchers: dict, ds_rank: int = DS_RANK,
              retrieve_share: Optional[float] = None) -> dict:
    cuda = dev.type == "cuda"
    bud = shape_budget(sh)
    x = make_inputs(sh, bud, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    row: dict = dict(asdict(sh), **asdict(bud), dtype=str(dtype).replace("torch.", ""))
    q, kc, vc, scale = x["q"], x["k_cache"], x["v_cache"], x["scale"]
    common_kw = dict(sink=bud.sink, k=bud.k, dil_m=bud.dil_m, dil_r=bud.dil_r, cap=bud.cap, scale=scale, tau=TAU)
    geo = (x["pad"], x["t"], x["lo"], x["hi"], x["hi"])

    def time_it(fn) -> tuple[float, str]:
        t = common.median_ms(fn, dev, cuda_graph=True)
        return t.ms, t.method

    steps = {}
    for s in (8, 16):
        aq, ac, ai, n_ret = make_anchors(x, sh, bud, s, g, share=retrieve_share)
        # the anchors' dilated sets (what the integration stores with anchor_sets=True)
        sets = dilated_set(ai.view(sh.B, sh.Hq * s, -1), True, bud.dil_m, bud.dil_r).view(sh.B, sh.Hq, s, -1)

        def step(ops=TRITON_OPS, aq=aq, ac=ac, sets=sets):
            return common.cis_decode_step(ops, q, kc, vc, *geo, aq, ac, sets, x["active"], **common_kw, anchor_sets=True)

        def step_topk(ops=TRITON_OPS, aq=aq, ac=ac, ai=ai):
            return common.cis_decode_step(ops, q, kc, vc, *geo, aq, ac, ai, x["active"], **common_kw)

        res = step()
        res_topk = step_topk()
        if not (torch.equal(res.idx, res_topk.idx) and torch.equal(res.count, res_topk.count)):
            print(f"    WARNING: s={s}: anchor-set and top-k paths compose different index lists", flush=True)
        got_ret = int((res.best == -1).sum())
        if got_ret != n_ret:
            print(f"    note: s={s}: {got_ret} rows retrieve (planned {n_ret})", flush=True)
        steps[s] = (step, res, got_ret, step_topk, aq, ac, ai, sets)
    step16, res16 = steps[16][0], steps[16][1]
    idx, count = res16.idx, res16.count
    total_keys = int(count.sum())
    row["avg_kv_per_head"] = total_keys / (sh.B * sh.Hq)
    row["retrieving_rows_s8"] = steps[8][2]
    row["retrieving_rows_s16"] = steps[16][2]

    dense_columns(x, sh, dev, time_it, row)

    # FlexAttention with the same token pattern (mask construction excluded)
    row["flex_ms"], row["flex_timing"], row["flex_block_fraction"] = None, "n/a", None
    if flex_fn is not None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask

            member = flex_pattern(idx, count, sh.ctx)

            def mask_mod(b, h, q_idx, kv_idx):
                return member[b, h, kv_idx]

            bm = create_block_mask(mask_mod, sh.B, sh.Hq, 1, sh.ctx, device=dev, BLOCK_SIZE=128)
            n_blocks = triton.cdiv(sh.ctx, 128)
            visited = bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0)
            row["flex_block_fraction"] = float(visited) / (sh.B * sh.Hq * n_blocks)
            q4 = q[:, :, None, :]

            def flex():
                return flex_fn(q4, kc, vc, block_mask=bm, scale=scale, enable_gqa=sh.Hq != sh.Hkv)

            out_flex = flex()[:, :, 0]
            row["flex_max_abs_diff"] = (out_flex.float() - res16.out.float()).abs().max().item()
            row["flex_ms"], row["flex_timing"] = time_it(flex)
        except Exception as exc:  # noqa: BLE001
            row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"    flex failed: {row['flex_error']}", flush=True)

    # our sparse kernel alone, the whole steps, the reference step
    row["sparse_ms"], row["sparse_timing"] = time_it(lambda: sparse_decode_attention(q, kc, vc, x["pad"], idx, count, scale))
    if cuda:  # split-K sweep of the sparse kernel, for tuning (auto = the heuristic above)
        row["sparse_ms_by_splits"] = {
            str(n): time_it(lambda n=n: sparse_decode_attention(q, kc, vc, x["pad"], idx, count, scale, num_splits=n))[0]
            for n in (1, 2, 4, 8)
        }
    union_count = group_union(idx, count, sh.Hkv, kc.shape[2])[2]
    row["union_fraction"] = int(union_count.sum()) / max(total_keys, 1)

    def sparse_union():
        return sparse_decode_attention_union(q, kc, vc, x["pad"], idx, count, scale)

    per_head_out = sparse_decode_attention(q, kc, vc, x["pad"], idx, count, scale)
    row["sparse_union_max_abs_diff"] = (sparse_union().float() - per_head_out.float()).abs().max().item()
    row["sparse_union_ms"], row["sparse_union_timing"] = time_it(sparse_union)
    row["cis8_ms"], row["cis8_timing"] = time_it(steps[8][0])
    row["cis16_ms"], row["cis16_timing"] = time_it(step16)
    row["cis16_topk_ms"], row["cis16_topk_timing"] = time_it(steps[16][3])
    row["ref16_ms"], row["ref16_timing"] = time_it(lambda: step16(REFERENCE_OPS))
    group_step_columns(x, sh, bud, g, geo, common_kw, time_it, row, retrieve_share)
    grouped_columns(x, sh, res16, bud, 16, time_it, launchers, row)
    ds_columns(x, sh, bud, ds_rank, time_it, row)
    row.update(stage_breakdown(x, bud, steps[16], row["sparse_ms"], time_it))

    elem = kc.element_size()
    gathered = total_keys * sh.D * elem * 2 + 2 * sh.B * sh.Hq * sh.D * elem
    row["sparse_bytes"] = gathered
    row["sparse_GBps"] = gathered / (row["sparse_ms"] * 1e-3) / 1e9
    best = row["fastest_dense_ms"]
    for col in PRHS_COLUMNS:
        v = row[f"{col}_ms"]
        row[f"{col}_speedup_vs_fastest_dense"] = (best / v) if (best and v) else None
    # the group-aware launchers against the stage they replace
    for col, base in (("grouped_retrieval", "stage16_retrieval_ms"), ("grouped_sparse", "sparse_ms")):
        v = row[f"{col}_ms"]
        row[f"{col}_speedup_vs_{base.removesuffix('_ms')}"] = (row[base] / v) if v else None
    if row["flex_ms"]:
        row["cis16_speedup_vs_flex"] = row["flex_ms"] / row["cis16_ms"]
    row["cis16_speedup_vs_ds"] = row["ds_ms"] / row["cis16_ms"]
    want = TARGET_GQA if sh.Hq != sh.Hkv else TARGET_MHA
    row["cis16_target_speedup"] = want
    row["cis16_target_ms"] = best / want if best else None
    row["cis16_target_met"] = (row["cis16_ms"] <= row["cis16_target_ms"]) if best else None
    big = max(STAGES, key=lambda st: row[f"stage16_{st}_ms"])
    row["cis16_largest_stage"] = big
    if row["cis16_target_met"] is False:
        row["cis16_limited_by"] = (
            f"{big} {row[f'stage16_{big}_ms']:.3f} ms of {row['cis16_ms']:.3f} "
            f"(target {row['cis16_target_ms']:.3f} vs {row['fastest_dense']}; "
            f"non-attention {row['cis16_ms'] - row['stage16_attention_ms']:.3f})"
        )
    return row


def group_step_columns(x: dict, sh: Shape, bud: Budget, g: torch.Generator, geo: tuple, step_kw: dict,
                       time_it: Callable, row: dict, share: Optional[float] = None) -> None:
    """``cis16_group``: the whole CIS-16 step with group-shared selection (one set per KV head), on
    the per-head steps' geometry ``geo`` and keywords ``step_kw``."""
    q, kc, vc = x["q"], x["k_cache"], x["v_cache"]
    aq, ac, ai, _ = make_anchors(x, sh, bud, 16, g, grouped=True, share=share)
    sets = dilated_set(ai.view(sh.B, sh.Hkv * 16, -1), True, bud.dil_m, bud.dil_r).view(sh.B, sh.Hkv, 16, -1)

    def step(ops=TRITON_OPS):
        return common.cis_decode_step(ops, q, kc, vc, *geo, aq, ac, sets, x["active"], **step_kw, anchor_sets=True, grouped=True)

    res = step()
    row["retrieving_groups_s16"] = int((res.best == -1).sum())
    row["cis16_group_avg_kv_per_kv_head"] = int(res.count.sum()) / (sh.B * sh.Hkv)
    row["cis16_group_max_abs_diff"] = (res.out.float() - step(REFERENCE_OPS).out.float()).abs().max().item()
    row["cis16_group_ms"], row["cis16_group_timing"] = time_it(step)


def stage_breakdown(x: dict, bud: Budget, st16: tuple, attention_ms: float, time_it: Callable) -> dict:
    """Each stage of the CIS-16 step alone (graph replay) on the step's own inputs."""
    _, res, n_ret, _, aq, ac, ai, sets = st16
    q, kc, pad, lo, hi, t, scale = x["q"], x["k_cache"], x["pad"], x["lo"], x["hi"], x["t"], x["scale"]
    best = res.best
    retrieve = best == -1
    B, H, s, kk = ai.shape
    span = x["k_cache"].shape[2]
    state = (torch.zeros(1, B, H, s, q.shape[-1], device=q.device), sets.unsqueeze(0).clone(),
             torch.zeros(1, B, H, dtype=torch.int32, device=q.device), torch.ones((), dtype=torch.int64, device=q.device))
    new_idx, new_set = res.new_idx, res.new_set

    def retrieval(stop="select", **switches):  # switches: topk_retrieval.RetrievalTuning's fields
        return tuned(topk_retrieval, stop_after=stop, **switches)(q, kc, pad, lo, hi, retrieve, bud.k, scale)

    def topk_glue():  # the gather / where of the top-k anchor path (decode_ops)
        shared = best >= 0
        pick = best.clamp_min(0).long().view(B, H, 1, 1).expand(B, H, 1, kk)
        shared_idx = torch.gather(ai, 2, pick).view(B, H, kk)
        return torch.where(retrieve[..., None], new_idx, torch.where(shared[..., None], shared_idx, -1)), shared

    sel, shared = topk_glue()
    out = {"stage16_retrieving_rows": n_ret}
    fns = {
        "match": lambda: cis_match(q, aq, ac, x["active"], TAU),
        "retrieval": retrieval,
        # the group score kernel compacts the rows itself: "compact" then launches nothing
        "retrieval_compact": lambda: retrieval("compact"),
        "retrieval_score": lambda: retrieval("score"),  # compact + score
        # as cis_select: one launch (the two below it replaces, for comparison)
        "dilate_compose": lambda: dilate_and_compose(t, lo, hi, hi, best, sets, new_idx, bud.sink, bud.cap,
                                                     bud.dil_m, bud.dil_r, span),
        "dilated_set": lambda: dilated_set(new_idx, retrieve, bud.dil_m, bud.dil_r, span),
        "compose": lambda: compose_from_sets(t, lo, hi, hi, best, sets, new_set, bud.sink, bud.cap),
        # CISState.record's op (its clear at a block's end is a where: the same time at every step)
        "record": lambda: TRITON_OPS.record_anchors(*state[:3], 0, q, new_set, best, state[3]),
        "topk_compose": lambda: compose_indices(t, lo, hi, hi, sel, shared, bud.sink, bud.dil_m, bud.dil_r, bud.cap),
        "topk_glue": topk_glue,
    }
    for name, fn in fns.items():
        out[f"stage16_{name}_ms"] = time_it(fn)[0]
    # the dilated set on the map path with each of its collects, whatever "auto" takes at this size
    by_collect = {collect: (lambda method=method: dilated_set(new_idx, retrieve, bud.dil_m, bud.dil_r, span,
                                                              _method=method))
                  for collect, method in MAP_COLLECTS.items()}
    out["stage16_dilated_ms_by_collect"] = {collect: time_it(fn)[0] for collect, fn in by_collect.items()}
    out["stage16_map_collects_equal_to_step"] = all(torch.equal(fn(), new_set) for fn in by_collect.values())
    out.update(radix8_breakdown(retrieval, time_it))
    out["stage16_attention_ms"] = attention_ms
    out["stage16_retrieval_select_ms"] = out["stage16_retrieval_ms"] - out["stage16_retrieval_score_ms"]
    out["stage16_retrieval_score_ms"] -= out["stage16_retrieval_compact_ms"]
    out["stage16_sum_ms"] = sum(out[f"stage16_{st}_ms"] for st in STAGES)
    return out


def radix8_breakdown(retrieval: Callable, time_it: Callable) -> dict:
    """The radix8 select of the step's retrieval by stage, and with each merge finish (module
    docstring): ``retrieval(stop, **switches)`` runs the step's ``topk_retrieval`` to a stop point.
    Each stage is the time to its stop point minus the time to the one before; the merge of a
    finish is its whole select minus its stop after the block sort (which zeroes the "count"
    finish's ranks)."""
    def radix8(stop, merge_rank=None):
        return retrieval(stop, select="radix8", merge_rank=merge_rank)

    to_stop = {stop: time_it(lambda stop=stop: radix8(stop))[0] for stop in ("score", "passes", "collect")}
    sorted_ms = {rank: time_it(lambda rank=rank: radix8("block_sort", rank))[0] for rank in MERGE_RANKS}
    whole_ms = {rank: time_it(lambda rank=rank: radix8("select", rank))[0] for rank in MERGE_RANKS}
    step_topk = retrieval()
    return {
        "stage16_select_kernel": default_select(int(step_topk.shape[-1])),
        "stage16_merge_rank": MERGE_RANK,
        "stage16_select_ms_by_part": {
            "passes": to_stop["passes"] - to_stop["score"],
            "collect": to_stop["collect"] - to_stop["passes"],
            "block_sort": sorted_ms[MERGE_RANK] - to_stop["collect"],
            "merge": whole_ms[MERGE_RANK] - sorted_ms[MERGE_RANK],
        },
        "stage16_merge_ms_by_rank": {rank: whole_ms[rank] - sorted_ms[rank] for rank in MERGE_RANKS},
        "stage16_merge_ranks_equal_to_step": all(torch.equal(radix8("select", rank), step_topk) for rank in MERGE_RANKS),
    }


# ----------------------------------------------------------------------------- report


# ----------------------------------------------------------------------------- the key index


def _recall(idx: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor, S: int) -> float:
    """Mean share of each retrieving row's exact top-k (``exact``, -1 padded) that ``idx`` holds."""
    got = torch.zeros(*idx.shape[:2], S + 1, dtype=torch.bool, device=idx.device)
    got.scatter_(2, torch.where(idx >= 0, idx.long(), S), True)
    hit = torch.gather(got, 2, torch.where(exact >= 0, exact.long(), S)) & (exact >= 0)
    share = hit.sum(-1).float() / (exact >= 0).sum(-1).clamp_min(1).float()
    return float(share[rows].mean()) if bool(rows.any()) else float("nan")


def index_row(sh: Shape, dev: torch.device, dtype: torch.dtype, share: float, margins: tuple[int, ...],
              page: int = 16) -> dict:
    """The key-index table of one shape (module docstring, ``--index``)."""
    cfg = yaml.safe_load(CIS_CONFIG.read_text())["cis"]
    tau, s = float(cfg["tau"]), int(cfg["block_size"])
    bud = shape_budget(sh)
    x = make_inputs(sh, bud, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    q, kc, vc, scale = x["q"], x["k_cache"], x["v_cache"], x["scale"]
    kw = dict(sink=bud.sink, k=bud.k, dil_m=bud.dil_m, dil_r=bud.dil_r, cap=bud.cap, scale=scale, tau=tau)
    geo = (x["pad"], x["t"], x["lo"], x["hi"], x["hi"])
    aq, ac, ai, _ = make_anchors(x, sh, bud, s, g, share=share)
    sets = dilated_set(ai.view(sh.B, sh.Hq * s, -1), True, bud.dil_m, bud.dil_r).view(sh.B, sh.Hq, s, -1)
    row: dict = dict(asdict(sh), **asdict(bud), tau=tau, block_size=s, page=page, margins=list(margins),
                     dtype=str(dtype).replace("torch.", ""))

    def time_it(fn) -> tuple[float, str]:
        t = common.median_ms(fn, dev, cuda_graph=True, rep_ms=50.0)
        return t.ms, t.method

    def step(key_index=None, margin=0):
        return common.cis_decode_step(TRITON_OPS, q, kc, vc, *geo, aq, ac, sets, x["active"], **kw, anchor_sets=True,
                                      key_index=key_index, margin=margin)

    retrieve = step().best == -1  # the rows the match sends to the retrieval (tau of cis.yaml)
    retrieve_g = retrieve.view(sh.B, sh.Hkv, -1).any(-1)
    row["retrieving_rows"], row["retrieving_share"] = int(retrieve.sum()), float(retrieve.float().mean())
    dense_columns(x, sh, dev, time_it, row)
    base = (q, kc, x["pad"], x["lo"], x["hi"])
    indexes = {}
    for kind in INDEX_KINDS:
        index = allocate_key_index(kind, sh.B, sh.Hkv, sh.ctx, sh.D, dtype, dev, page=page)
        write_key_index(index, kc, 0, sh.ctx)
        indexes[kind] = index
        row[f"index_{kind}_bytes_per_slot"] = index_bytes_per_slot(kind, sh.D, dtype, page)
        slot = x["t"] - 1
        row[f"update_{kind}_ms"] = time_it(lambda index=index, slot=slot: update_key_index(index, kc, slot))[0]
    mid_margin = margins[len(margins) // 2]
    for k in sorted({bud.k, sh.ctx // 8}) if dev.type == "cuda" else [bud.k]:
        exact = topk_retrieval(*base, retrieve, k, scale)
        row[f"retrieval_k{k}_exact_ms"] = time_it(lambda k=k: topk_retrieval(*base, retrieve, k, scale))[0]
        for kind, index in indexes.items():
            for m in margins:
                fn = (lambda k=k, m=m, index=index:
                      topk_retrieval_indexed(q, kc, index, x["pad"], x["lo"], x["hi"], retrieve, k, m, scale, False))
                row[f"retrieval_k{k}_{kind}_m{m}_ms"] = time_it(fn)[0]
                row[f"retrieval_k{k}_{kind}_m{m}_recall"] = _recall(fn(), exact, retrieve, sh.ctx)
    k = bud.k
    exact_g = topk_retrieval_grouped(*base, retrieve_g, k, scale)
    row[f"grouped_k{k}_exact_ms"] = time_it(lambda: topk_retrieval_grouped(*base, retrieve_g, k, scale))[0]
    for kind, index in indexes.items():
        fn = (lambda index=index:
              topk_retrieval_indexed(q, kc, index, x["pad"], x["lo"], x["hi"], retrieve_g, k, mid_margin, scale, True))
        row[f"grouped_k{k}_{kind}_m{mid_margin}_ms"] = time_it(fn)[0]
        row[f"grouped_k{k}_{kind}_m{mid_margin}_recall"] = _recall(fn(), exact_g, retrieve_g, sh.ctx)
    row["step_exact_ms"] = time_it(step)[0]
    for kind, index in indexes.items():
        def indexed_step(index=index):
            update_key_index(index, kc, x["t"] - 1)
            return step(index, mid_margin)

        row[f"step_{kind}_m{mid_margin}_ms"] = time_it(indexed_step)[0]
    fastest = row["fastest_dense_ms"]
    for key in [k_ for k_ in row if k_.startswith("step_") and k_.endswith("_ms")]:
        row[key[:-3] + "_speedup_vs_fastest_dense"] = fastest / row[key] if fastest and row[key] else None
    return row


def index_main(args: argparse.Namespace, argv: Optional[list[str]], plan: Optional[list[Shape]] = None) -> int:
    """``--index``: the key-index table (module docstring) to ``bench_key_index.json``, a row per shape of
    ``plan`` (``--shapes``; default the GQA B16/16k shape, without CUDA a tiny one)."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    share = 0.5 if args.retrieve_share is None else args.retrieve_share
    margins = tuple(int(m) for m in args.index_margins.split(",") if m)
    if not margins or min(margins) < 0:
        raise SystemExit(f"--index-margins {args.index_margins!r}: expected integers >= 0, comma separated")
    if plan is None:
        plan = [Shape(16, 32, 8, 128, 16384) if cuda else Shape(2, 4, 2, 32, 512)]
    if not cuda:
        margins = margins[:1]
        print("no CUDA: smoke test through TRITON_INTERPRET=1 (timings mean nothing)", flush=True)
    t0 = time.time()
    meta = common.run_metadata(dev, argv, retrieve_share=share, timing="CUDA graph replay, median (do_bench)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name or 'bench_key_index'}.json"
    rows: list[dict] = []
    for sh in plan:
        print(f"B={sh.B} ctx={sh.ctx} Hq/Hkv={sh.Hq}/{sh.Hkv} budget {sh.budget}", flush=True)
        row = index_row(sh, dev, torch.bfloat16, share, margins)
        rows.append(row)
        meta["wall_s"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(dict(meta, rows=rows), indent=2))  # a run cut short keeps its rows
        for key, value in row.items():
            if key.endswith(("_ms", "_recall", "_speedup_vs_fastest_dense", "_bytes_per_slot")) or key.startswith("retriev"):
                print(f"  {key:44s} {fmt(value, '.4f') if isinstance(value, float) else value}")
        if cuda:
            torch.cuda.empty_cache()
    print(f"wrote {path} ({meta['wall_s']} s)")
    return 0


def fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    v = meta["versions"]
    head = (
        "| B | ctx | Hq/Hkv | budget sink/local/k/m | avg KV/head | transformers sdpa (repeat_kv) | SDPA gqa+mask "
        "| SDPA flash packed | FlashInfer | fastest dense | flex ms (blocks) | sparse ms | sparse union ms (union / sum) | CIS-8 step | CIS-16 step "
        "| ref step | DS step (r, top-k) | CIS-16 vs fastest dense | DS vs fastest dense | CIS-16 vs DS | CIS-16 vs flex "
        "| CIS-16 group step (vs fastest dense) | grouped retrieval / sparse ms | sparse GB/s (% copy) |"
    )
    lines = [
        f"Decode attention latency (median ms), {meta['gpu']}, torch {v['torch']}, triton {v['triton']}, "
        f"flashinfer {v['flashinfer']}, {meta['date']}, commit {meta['git_commit']}. Copy bandwidth "
        f"{meta['copy_GBps']:.0f} GB/s. Retrieving rows per step: {meta['retrieval']}. Speedups against the fastest "
        "dense column of the row (named).",
        "",
        f"    {meta['command']}",
        "",
        head,
        "|" + "|".join(["---"] * (head.count("|") - 1)) + "|",
    ]
    for r in rows:
        blocks = "" if r["flex_block_fraction"] is None else f" ({100 * r['flex_block_fraction']:.0f}%)"
        bw_pct = 100 * r["sparse_GBps"] / meta["copy_GBps"] if meta["copy_GBps"] else None
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['Hq']}/{r['Hkv']} | {r['budget']} {r['sink']}/{r['local']}/{r['k']}/{r['dil_m']} "
            f"| {r['avg_kv_per_head']:.0f} | " + " | ".join(fmt(r[f"dense_{n}_ms"]) for n in DENSE)
            + f" | {r['fastest_dense'] or 'n/a'} | {fmt(r['flex_ms'])}{blocks} "
            f"| {fmt(r['sparse_ms'])} | {fmt(r['sparse_union_ms'])} ({r['union_fraction']:.2f}) | {fmt(r['cis8_ms'])} | {fmt(r['cis16_ms'])} | {fmt(r['ref16_ms'])} "
            f"| {fmt(r['ds_ms'])} (r={r['ds_rank']}, k={r['ds_k']}) "
            f"| {fmt(r['cis16_speedup_vs_fastest_dense'], '.2f')} | {fmt(r['ds_speedup_vs_fastest_dense'], '.2f')} "
            f"| {fmt(r['cis16_speedup_vs_ds'], '.2f')} | {fmt(r.get('cis16_speedup_vs_flex'), '.2f')} "
            f"| {fmt(r['cis16_group_ms'])} ({fmt(r['cis16_group_speedup_vs_fastest_dense'], '.2f')}x) "
            f"| {fmt(r['grouped_retrieval_ms'])} / {fmt(r['grouped_sparse_ms'])} "
            f"| {r['sparse_GBps']:.0f} ({fmt(bw_pct, '.0f')}%) |"
        )
    head2 = (
        "| B | ctx | Hq/Hkv | retrieving rows | match | retrieval (compact/score/select) "
        "| radix8 select by stage (passes / collect / block sort / merge) "
        f"| radix8 merge by finish ({' / '.join(MERGE_RANKS)}) "
        "| dilated set + compose, one launch (the two apart) | dilated set by map collect (serial / parallel) "
        "| attention | sum | CIS-16 step | gap "
        "| record (the model's state update, not in the step) "
        "| top-k-anchor step (its compose, glue) "
        "| target vs fastest dense | largest stage |"
    )
    lines += [
        "",
        "Stage breakdown of the CIS-16 step (median ms, each stage replayed alone; gap = step - sum). "
        "The radix8 select by stage is timed at every shape (the step's select where k > 256, else tilemax; "
        f"its merge: {MERGE_RANK}, the default finish); merge by finish: each finish's merge launches.",
        "",
        head2,
        "|" + "|".join(["---"] * (head2.count("|") - 1)) + "|",
    ]
    for r in rows:
        tgt = "n/a" if r.get("cis16_target_met") is None else (
            f"{'met' if r['cis16_target_met'] else 'MISSED'} ({r['cis16_target_speedup']:.0f}x: <= {r['cis16_target_ms']:.3f})"
        )
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['Hq']}/{r['Hkv']} | {r['stage16_retrieving_rows']} "
            f"| {fmt(r['stage16_match_ms'])} | {fmt(r['stage16_retrieval_ms'])} "
            f"({fmt(r['stage16_retrieval_compact_ms'])}/{fmt(r['stage16_retrieval_score_ms'])}/{fmt(r['stage16_retrieval_select_ms'])}) "
            f"| {' / '.join(fmt(v) for v in r['stage16_select_ms_by_part'].values())}"
            f"{'' if r['stage16_select_kernel'] == 'radix8' else ' (step: ' + r['stage16_select_kernel'] + ')'} "
            f"| {' / '.join(fmt(r['stage16_merge_ms_by_rank'][m]) for m in MERGE_RANKS)} "
            f"| {fmt(r['stage16_dilate_compose_ms'])} ({fmt(r['stage16_dilated_set_ms'])} + {fmt(r['stage16_compose_ms'])}) "
            f"| {' / '.join(fmt(r['stage16_dilated_ms_by_collect'][c]) for c in MAP_COLLECTS)} "
            f"| {fmt(r['stage16_attention_ms'])} | {fmt(r['stage16_sum_ms'])} | {fmt(r['cis16_ms'])} "
            f"| {fmt(r['cis16_ms'] - r['stage16_sum_ms'])} | {fmt(r['stage16_record_ms'])} | {fmt(r['cis16_topk_ms'])} "
            f"({fmt(r['stage16_topk_compose_ms'])}, {fmt(r['stage16_topk_glue_ms'])}) | {tgt} "
            f"| {r['cis16_largest_stage']} |"
        )
    head3 = (
        "| B | ctx | Hq/Hkv | r | top-k | avg KV/head | label cache MB | query gather | label scoring | select "
        "| compose | attention | sum | DS step | gap | top-k recall | max abs diff vs PyTorch DS |"
    )
    lines += [
        "",
        "Double Sparsity step (median ms; every row scores and selects every step; label cache [B, Hkv, S, r]; "
        "top-k = cap - sink - local; each stage replayed alone; recall: share of the exact top-k selected).",
        "",
        head3,
        "|" + "|".join(["---"] * (head3.count("|") - 1)) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['ctx']} | {r['Hq']}/{r['Hkv']} | {r['ds_rank']} | {r['ds_k']} | {r['ds_avg_kv_per_head']:.0f} "
            f"| {r['ds_label_cache_bytes'] / 2**20:.1f} | "
            + " | ".join(fmt(r[f"ds_stage_{st}_ms"]) for st in DS_STAGES)
            + f" | {fmt(r['ds_stage_sum_ms'])} | {fmt(r['ds_ms'])} | {fmt(r['ds_ms'] - r['ds_stage_sum_ms'])} "
            f"| {r['ds_topk_recall']:.3f} | {r['ds_max_abs_diff']:.2e} |"
        )
    notes = sorted({f"{k}: {r[k]}" for r in rows for k in r if k.endswith(("_status", "_error")) and r[k] not in ("measured", "available")})
    if notes:
        lines += ["", "Columns not measured, and errors:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the issue's shapes only (GPU); without CUDA always a tiny shape")
    ap.add_argument("--ds-rank", type=int, default=DS_RANK,
                    help=f"Double Sparsity's label channels per head, 1 to the head size (default {DS_RANK})")
    ap.add_argument("--retrieve-share", type=float, default=None,
                    help="rows that retrieve per step as a share of all rows, in (0, 1], e.g. a model's measured "
                         "rho-hat (default: 1/s, every row retrieving once per block)")
    ap.add_argument("--out", default="docs/results", help="output folder (NAME.json + .md)")
    ap.add_argument("--name", default=None,
                    help="file stem of the table (default bench_decode_attention; with --index bench_key_index)")
    ap.add_argument("--shapes", default=None, metavar="B:ctx:Hq:Hkv[:BUDGET],...",
                    help="these shapes instead of the built-in list (BUDGET: ctx/8, the default, or a file of configs/, "
                         "e.g. 1:131072:32:8:cis_longbench.yaml)")
    ap.add_argument("--index", action="store_true",
                    help="the key-index table only (GQA B16/16k, or --shapes; --retrieve-share default 0.5): "
                         "bench_key_index.json")
    ap.add_argument("--index-margins", default="256,512,1024", metavar="M,...",
                    help="--index: the re-rank margins timed (the middle one for the grouped retrieval and the step)")
    args = ap.parse_args(argv)
    if args.retrieve_share is not None and not 0 < args.retrieve_share <= 1:
        ap.error(f"--retrieve-share {args.retrieve_share}: allowed (0, 1]")
    plan = None
    if args.shapes is not None:
        try:
            plan = parse_shapes(args.shapes)
        except ValueError as err:
            ap.error(str(err))
    if args.index:
        return index_main(args, argv, plan)
    if plan is None:
        plan = shapes(args.quick or not torch.cuda.is_available(), torch.cuda.is_available())
    if not all(1 <= args.ds_rank <= sh.D for sh in plan):
        ap.error(f"--ds-rank {args.ds_rank}: allowed 1 to the head size ({min(sh.D for sh in plan)} in this run)")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    t_start = time.time()
    launchers = grouped_launchers()
    meta = common.run_metadata(
        dev, argv,
        tau=TAU, hot_span=SPAN,
        retrieval=("exactly ceil(B*Hq/s) rows retrieve per step, the rest share an anchor" if args.retrieve_share is None
                   else f"exactly ceil(B*Hq*{args.retrieve_share:g}) rows retrieve per step (--retrieve-share), "
                        "the rest share an anchor"),
        retrieve_share=args.retrieve_share,
        dense_columns={f"dense_{n}": label for n, label in common.DENSE_LABELS.items()},
        speedups="against the fastest dense column measured in the same row (fastest_dense)",
        targets={"mha": TARGET_MHA, "gqa": TARGET_GQA},
        grouped_launchers={k: status for k, (_, status) in launchers.items()},
        ds=dict(rank=args.ds_rank, label_heads="Hkv", k="cap - sink - local",
                step="label gather, topk_retrieval on the label cache (every row), compose_indices, sparse_decode_attention"),
    )
    if not cuda:
        print("no CUDA: smoke test through TRITON_INTERPRET=1 (flash, flex and FlashInfer columns n/a)", flush=True)
    meta["copy_GBps"] = copy_bandwidth(dev)
    print(f"device copy bandwidth: {meta['copy_GBps']:.0f} GB/s; flashinfer {meta['versions']['flashinfer']}", flush=True)
    flex_fn = None
    if cuda:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False)
            # one compilation per shape: the default limit (8) left the last two of the ten shapes on
            # flex's unfused fallback (8.7 and 10.1 ms on the H200, 2026-12-03)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        except Exception as exc:  # noqa: BLE001
            print(f"FlexAttention unavailable: {exc}", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or "bench_decode_attention"
    json_path = out_dir / f"{name}.json"
    rows: list[dict] = []
    for sh in common.progress(plan, "decode operator"):
        b = shape_budget(sh)
        print(
            f"\n[{time.time() - t_start:6.1f}s] B={sh.B} ctx={sh.ctx} Hq/Hkv={sh.Hq}/{sh.Hkv} D={sh.D}: budget {sh.budget} "
            f"sink {b.sink}, local {b.local}, k {b.k}, dilation m {b.dil_m} r {b.dil_r}, cap {b.cap}",
            flush=True,
        )
        try:
            rows.append(run_shape(sh, dev, dtype, flex_fn, launchers, args.ds_rank, args.retrieve_share))
        except torch.cuda.OutOfMemoryError as exc:  # keep the other shapes
            print(f"    out of memory: {exc}", flush=True)
            continue
        r = rows[-1]
        print(
            "    dense " + "  ".join(f"{n} {fmt(r[f'dense_{n}_ms'])}" for n in DENSE)
            + f" -> fastest {r['fastest_dense']}\n    flex {fmt(r['flex_ms'])}  sparse {fmt(r['sparse_ms'])}  "
            f"sparse union {fmt(r['sparse_union_ms'])} (union {r['union_fraction']:.2f} of the summed sets)  "
            f"cis8 {fmt(r['cis8_ms'])}  cis16 {fmt(r['cis16_ms'])}  ref16 {fmt(r['ref16_ms'])} ms; "
            f"CIS-16 {fmt(r['cis16_speedup_vs_fastest_dense'], '.2f')}x the fastest dense; "
            f"group step {fmt(r['cis16_group_ms'])} ({fmt(r['cis16_group_speedup_vs_fastest_dense'], '.2f')}x); "
            f"grouped retrieval {fmt(r['grouped_retrieval_ms'])} sparse {fmt(r['grouped_sparse_ms'])}",
            flush=True,
        )
        print(
            "    CIS-16 stages: " + "  ".join(f"{st} {fmt(r[f'stage16_{st}_ms'])}" for st in STAGES)
            + f"  (sum {fmt(r['stage16_sum_ms'])}; retrieval compact/score/select "
            f"{fmt(r['stage16_retrieval_compact_ms'])}/{fmt(r['stage16_retrieval_score_ms'])}/"
            f"{fmt(r['stage16_retrieval_select_ms'])}; top-k-anchor step {fmt(r['cis16_topk_ms'])})\n"
            "    radix8 select by stage: " + "  ".join(f"{p} {fmt(v)}" for p, v in r["stage16_select_ms_by_part"].items())
            + "; merge by finish: " + "  ".join(f"{m} {fmt(v)}" for m, v in r["stage16_merge_ms_by_rank"].items())
            + f" (step's select {r['stage16_select_kernel']}; equal {r['stage16_merge_ranks_equal_to_step']})",
            flush=True,
        )
        print(
            f"    DS step (r={r['ds_rank']}, k={r['ds_k']}) {fmt(r['ds_ms'])} ms, "
            f"{fmt(r['ds_speedup_vs_fastest_dense'], '.2f')}x the fastest dense; stages "
            + "  ".join(f"{st} {fmt(r[f'ds_stage_{st}_ms'])}" for st in DS_STAGES)
            + f"; top-k recall {r['ds_topk_recall']:.3f}",
            flush=True,
        )
        if r.get("cis16_limited_by"):
            print(f"    target missed, limited by: {r['cis16_limited_by']}", flush=True)
        # a run cut short keeps its rows
        json_path.write_text(json.dumps(dict(meta, rows=rows), indent=2))
        (out_dir / f"{name}.md").write_text(markdown(rows, meta))
        if cuda:
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t_start, 1)
    md = markdown(rows, meta)
    json_path.write_text(json.dumps(dict(meta, rows=rows), indent=2))
    (out_dir / f"{name}.md").write_text(md)
    print()
    print(md)
    print(f"wrote {json_path} and .md ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
