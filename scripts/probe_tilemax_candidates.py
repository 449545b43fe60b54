"""How many candidates the tilemax select collects on a real model's keys and queries.

``select="tilemax"`` (prhs_hf/ops/topk/topk_select.py) collects every key at or above a threshold theta:
the k-th largest of the row's sub-tile maxima, narrowed by radix passes over them. Its cost depends
on how many keys that is, which random scores do not show. This script captures a real model's
post-RoPE keys (every layer) and the last ``--queries`` prompt queries of one ``--length``-token
real-text prompt, then counts, for each (layer, head, query) row, the keys of the CIS middle region
``[sink, t - local)`` at or above theta, per sub-tile size and number of theta passes (``exact``:
the k-th largest maximum itself). It prints a table and writes
``docs/results/probe_tilemax_candidates.json``.

    python scripts/probe_tilemax_candidates.py --model qwen2.5-coder-1.5b \\
        --prompts .xfer/data/coqa_validation.jsonl.gz --capture /tmp/qwen15_16k.pt   # CPU: ~15 min

``--capture FILE`` keeps the capture (about 240 MB at 16k for the 1.5B model) and reuses it when
it exists, so another k or budget costs seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

import _bench_common as common
from prhs_hf.ops.triton_support import next_pow2

#: theta as the kernel computes it after 2 or 3 radix passes (the low end of the bucket), or exact
THETA_PASSES = (2, 3, "exact")


def orderable_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int64 keys in the kernel's order (its ``_orderable_key``; -0.0 as +0.0)."""
    x = torch.where(scores == 0, torch.zeros_like(scores), scores).contiguous()
    bits = x.view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()


def candidates(keys: torch.Tensor, k: int, sub: int, passes) -> int:
    """Keys of one row at or above the tilemax threshold (``keys``: the middle region's, in order)."""
    n = keys.numel()
    nt = -(-n // sub)
    if nt < k:
        return n
    padded = torch.full((nt * sub,), -(2 ** 31), dtype=torch.long)
    padded[:n] = keys
    theta = torch.topk(padded.view(nt, sub).amax(1), k).values[-1]
    if passes != "exact":
        drop = 32 - 8 * passes
        theta = (((theta + 2 ** 31) >> drop) << drop) - 2 ** 31
    return int((keys >= theta).sum())


def count_rows(K: dict, Q: dict, positions: list[int], k: int, sink: int, local: int, subs: list[int]) -> dict:
    """Per (sub-tile size, passes): the candidate count of every (layer, head, query) row.

    ``K[layer]``: ``[Hkv, S, D]`` post-RoPE keys of the prompt; ``Q[layer]``: ``[Hq, n_q, D]`` prompt
    queries, query ``r`` at position ``positions[r]`` (it sees the keys up to and including it)."""
    counts: dict = {(sub, p): [] for sub in subs for p in THETA_PASSES}
    for layer in sorted(K):
        kc, q = K[layer].float(), Q[layer].float()
        D = kc.shape[2]
        G = q.shape[0] // kc.shape[0]
        for r, pos in enumerate(positions):
            lo, hi = sink, pos + 1 - local
            for h in range(q.shape[0]):
                keys = orderable_keys((kc[h // G, lo:hi] @ q[h, r]) * D ** -0.5)
                for sub in subs:
                    for p in THETA_PASSES:
                        counts[(sub, p)].append(candidates(keys, k, sub, p))
    return counts


def summarize(counts: dict, k: int) -> list[dict]:
    first_tier = next_pow2(k, 16)  # the kernel's register-sort tier, as tilemax_select sizes it
    rows = []
    for (sub, passes), values in counts.items():
        v = torch.tensor(values, dtype=torch.float64)
        q = torch.quantile(v, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
        rows.append({"sub_tile": sub, "theta_passes": passes, "rows": len(values), "median": q[0], "p90": q[1],
                     "p99": q[2], "max": int(v.max()), f"share_over_{first_tier}": float((v > first_tier).double().mean()),
                     "share_over_4096": float((v > 4096).double().mean())})
    return rows


def capture(model_name: str, prompts: Path, length: int, n_queries: int) -> dict:
    """Post-RoPE keys of every layer and the last ``n_queries`` queries of one real-text prompt."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import bench_e2e_decode
    from prhs_hf.hub.fetch import load_model

    model, tokenizer = load_model(model_name, dtype=torch.float32, device="cpu")
    ids = bench_e2e_decode.TextPrompts(prompts, tokenizer).batch(1, length)
    K, Q = {}, {}

    def record(module, query, key, value, attention_mask, **kwargs):
        K[module.layer_idx] = key[0].to(torch.float16).clone()
        Q[module.layer_idx] = query[0, :, -n_queries:].to(torch.float16).clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("probe_capture", record)
    model.set_attn_implementation("probe_capture")
    with torch.no_grad():
        model(ids, logits_to_keep=1, use_cache=False)
    return {"K": K, "Q": Q, "model": model_name, "length": length}


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=Path, help="real text (.jsonl or .jsonl.gz), as bench_e2e_decode.py --prompts")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--queries", type=int, default=64, help="last prompt queries per layer")
    ap.add_argument("--query-stride", type=int, default=8, help="count every N-th of them")
    ap.add_argument("--capture", type=Path, default=None, help="keep / reuse the capture here")
    ap.add_argument("--k", type=int, default=88, help="top-k (cis.yaml: 88)")
    ap.add_argument("--sink", type=int, default=8)
    ap.add_argument("--local", type=int, default=32)
    ap.add_argument("--subs", default="8,16,32", help="sub-tile sizes")
    ap.add_argument("--out", default=str(common.REPO / "docs/results/probe_tilemax_candidates"))
    args = ap.parse_args(argv)
    if args.capture is not None and args.capture.exists():
        data = torch.load(args.capture)
    else:
        if args.prompts is None:
            ap.error("--prompts is needed to capture (or --capture FILE that exists)")
        data = capture(args.model, args.prompts, args.length, args.queries)
        if args.capture is not None:
            torch.save(data, args.capture)
    Q = {layer: q[:, ::args.query_stride] for layer, q in data["Q"].items()}
    S, n_q = data["K"][0].shape[1], data["Q"][0].shape[1]
    positions = list(range(S - n_q, S))[::args.query_stride]  # the captured queries are the last n_q
    subs = [int(s) for s in args.subs.split(",")]
    rows = summarize(count_rows(data["K"], Q, positions, args.k, args.sink, args.local, subs), args.k)
    meta = common.run_metadata(torch.device("cpu"), argv, model=data.get("model"), length=data.get("length"),
                               k=args.k, sink=args.sink, local=args.local)
    lines = [f"tilemax candidates per (layer, head, query) row: {data.get('model', '?')}, "
             f"{data.get('length', '?')} tokens, k {args.k}, middle [{args.sink}, t - {args.local}), "
             f"{meta['date']}, commit {meta['git_commit']}:", "", f"    {meta['command']}", "",
             "| sub-tile | theta passes | rows | median | p90 | p99 | max | over first tier | over 4096 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over = next(v for key, v in r.items() if key.startswith("share_over_") and key != "share_over_4096")
        lines.append(f"| {r['sub_tile']} | {r['theta_passes']} | {r['rows']} | {r['median']:.0f} | {r['p90']:.0f} | "
                     f"{r['p99']:.0f} | {r['max']} | {over:.3f} | {r['share_over_4096']:.4f} |")
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
