#!/usr/bin/env python
"""Probe: how much of the exact top-k a key index's stage 1 keeps, with codes of the keys or of the keys
less a centre (``KeyIndex.center``), on a real model's keys and queries.

One prefill of ``--length`` tokens of calibration text (default: this Python's standard-library source,
text no evaluation uses). Every layer's post-RoPE keys and the queries of the prompt's last
``--queries`` positions are captured; each query (every query head) ranks the middle region (past
``--sink`` keys, before its last ``--local``) exactly and on fp8 / int4 codes of the same keys, plain
and centred on the mean key of each KV head (over the whole prompt, and over its first
``--center-tokens`` tokens, as a chunked prefill's first chunk sets it). ``overlap`` is the share of the
exact top-``k`` among stage 1's best ``k + margin``: what the exact re-rank then returns of it. It also
prints how large the shared part of the keys is: ``|mean key| / mean |key|`` per layer.

This is a proxy of the decode steps (prompt queries, no CIS sharing); ``scripts/selection_quality.py
--schedule key_index`` measures the selector itself on teacher-forced decode steps.

    python scripts/probe_key_index_center.py --model qwen2.5-coder-1.5b --length 8192 \\
        --out docs/results/probe_key_index_center_qwen1.5b
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path
from typing import Optional

import torch

import _bench_common as common  # beside this script (its folder is first on sys.path)
from prhs_hf.calibration.texts import calibration_texts, pack_prompts
from prhs_hf.hub import fetch
from prhs_hf.ops.key_index.key_index import allocate_key_index, dequantize_key_index, write_key_index_reference


def _captured_attention(model, queries: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make every attention layer record ``(query[:, :, -queries:], key)`` (post-RoPE) before running
    the model's SDPA; returns the list the records go to."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    records: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        records.append((query[:, :, -queries:].float(), key.float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("prhs_probe_capture", capture)
    model.set_attn_implementation("prhs_probe_capture")
    return records


def _dequantized(kind: str, keys: torch.Tensor, center: Optional[torch.Tensor]) -> torch.Tensor:
    """The keys ``[B, H, S, D]`` an fp8 / int4 index of ``keys`` stands for (centred on ``center [B, H, D]``)."""
    index = allocate_key_index(kind, *keys.shape, keys.dtype, keys.device)._replace(center=center)
    write_key_index_reference(index, keys, 0, keys.shape[2])
    return dequantize_key_index(index)


def overlaps(records, k: int, margins: list[int], sink: int, local: int, center_tokens: int) -> dict[str, float]:
    """``{"<kind>[ centred on ...] m<margin>": overlap}`` over every layer, query head and query."""
    hits: dict[str, list[float]] = {}
    for q, keys in records:  # q [1, Hq, n, D], keys [1, Hkv, L, D]
        n, length = q.shape[2], keys.shape[2]
        group = q.shape[1] // keys.shape[1]
        centers = {"": None, " centred on the prompt": keys.mean(2),
                   f" centred on its first {center_tokens}": keys[:, :, :center_tokens].mean(2)}
        variants = {f"{kind}{name}": _dequantized(kind, keys, c).repeat_interleave(group, 1)
                    for kind in ("fp8", "int4") for name, c in centers.items()}
        exact_keys = keys.repeat_interleave(group, 1)
        for j in range(n):
            t = length - n + j  # this query's position: it attends to keys [0, t]
            lo, hi = sink, t - local + 1
            if hi - lo <= k:
                continue
            qj = q[0, :, j]
            top = torch.einsum("hd,hsd->hs", qj, exact_keys[0, :, lo:hi]).topk(k, dim=-1).indices
            for name, approx_keys in variants.items():
                approx = torch.einsum("hd,hsd->hs", qj, approx_keys[0, :, lo:hi])
                for m in margins:
                    cand = approx.topk(min(k + m, hi - lo), dim=-1).indices
                    hit = (top.unsqueeze(-1) == cand.unsqueeze(-2)).any(-1).float().mean().item()
                    hits.setdefault(f"{name} m{m}", []).append(hit)
    return {name: sum(v) / len(v) for name, v in hits.items()}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="registry name, .gguf, checkpoint folder or hub id")
    ap.add_argument("--text", default=sysconfig.get_paths()["stdlib"], help="calibration text (a file or folder)")
    ap.add_argument("--length", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--queries", type=int, default=16, help="the prompt's last positions whose queries rank")
    ap.add_argument("--k", type=int, default=88, help="top-k (cis.yaml's budget: 88)")
    ap.add_argument("--sink", type=int, default=8)
    ap.add_argument("--local", type=int, default=32)
    ap.add_argument("--margins", type=lambda s: [int(m) for m in s.split(",")], default=[0, 32, 128])
    ap.add_argument("--center-tokens", type=int, default=512, help="the tokens a first prefill chunk would hold")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = fetch.load_model(args.model, dtype="float32")
    texts, text_name = calibration_texts(args.text, None)
    ids = pack_prompts(texts, tokenizer, args.length, 1)
    records = _captured_attention(model, args.queries)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids)
    prefill_s = time.perf_counter() - t0
    shared = [(keys.mean(2).norm(dim=-1) / keys.norm(dim=-1).mean(2)).mean().item() for _, keys in records]
    result = common.run_metadata(torch.device("cpu"), argv, model=args.model, text=text_name, length=args.length,
                                 queries=args.queries, k=args.k, sink=args.sink, local=args.local,
                                 prefill_s=round(prefill_s, 1), mean_key_share_by_layer=[round(x, 4) for x in shared])
    result["rows"] = [{"index": name, "overlap": round(value, 4)}
                      for name, value in overlaps(records, args.k, args.margins, args.sink, args.local,
                                                  args.center_tokens).items()]
    md = [f"# Key index stage 1 with and without a centre ({args.model})", "",
          f"Command: `{result['command']}`  ", f"Date {result['date']}, git {result['git_commit']}; "
          f"{args.length} tokens of {text_name}, the last {args.queries} prompt queries of every layer and query "
          f"head, k {args.k}, sink {args.sink}, local {args.local}. |mean key| / mean |key| per layer: "
          f"{min(shared):.3f} to {max(shared):.3f}.", "", "| index | overlap with the exact top-k |", "|---|---|"]
    md += [f"| {row['index']} | {row['overlap']:.4f} |" for row in result["rows"]]
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out.parent / f"{out.name}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
