"""Probe: where an eager decode step of a patched model spends time that the unpatched one does not.

For each variant (unpatched sdpa / sdpa_gqa, patched configs), on the llama3-8b shape with random
weights cut to ``--layers`` layers: the decode ms/step of ``generate()`` (clock after new tokens
N1 and N2), then one decode step under ``torch.cuda.set_sync_debug_mode("warn")`` (each host
synchronisation it makes, with the line that made it) and a ``torch.profiler`` table of that step.

    python scripts/probe_decode_host.py --layers 8 --length 131072 --configs sdpa_gqa,cis,cis/dense
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from pathlib import Path

import torch
import transformers

import prhs_hf
from prhs_hf.evaluation import speed_map as sm


def _variant(model, name: str) -> None:
    sm._select(model, name, telemetry=False)


def _timed(model, ids, n1: int, n2: int) -> float:
    stamps = {}

    class Clock(transformers.LogitsProcessor):
        def __init__(self):
            self.n = 0

        def __call__(self, input_ids, scores):
            self.n += 1
            if self.n in (n1, n2):
                torch.cuda.synchronize()
                stamps[self.n] = time.perf_counter()
            return scores

    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n2, min_new_tokens=n2, do_sample=False,
                       pad_token_id=0, logits_processor=transformers.LogitsProcessorList([Clock()]))
    return 1000 * (stamps[n2] - stamps[n1]) / (n2 - n1)


def _syncs_of_one_step(model, ids) -> list[str]:
    """The host synchronisations of one eager decode forward (stack lines inside prhs_hf or transformers)."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        nxt = ids[:, -1:]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(nxt, past_key_values=cache, use_cache=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out = []
    for w in caught:
        out.append(str(w.message)[:120] + " @ " + f"{w.filename}:{w.lineno}")
    return out


def _profile_step(model, ids) -> str:
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        nxt = ids[:, -1:]
        model(nxt, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(nxt, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--configs", default="sdpa,sdpa_gqa,cis,cis/dense,cis/sparse")
    p.add_argument("--n1", type=int, default=8)
    p.add_argument("--n2", type=int, default=40)
    p.add_argument("--out", default="docs/results/probe_decode_host.json")
    args = p.parse_args()
    torch.manual_seed(0)
    shape = dict(sm.SHAPES[sm.RANDOM_SHAPE], num_hidden_layers=args.layers)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=args.length + 1024)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    ids = torch.randint(1, 1000, (args.batch, args.length), device="cuda")
    rows = []
    for name in args.configs.split(","):
        row = {"config": name}
        try:
            _variant(model, name)
            _timed(model, ids[:, :2048], 2, 4)  # warm-up: Triton and cuBLAS
            row["ms_per_step"] = round(_timed(model, ids, args.n1, args.n2), 3)
            row["syncs"] = _syncs_of_one_step(model, ids)
            row["profile"] = _profile_step(model, ids)
        except Exception:
            row["error"] = traceback.format_exc()[-1500:]
        prhs_hf.unpatch(model)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}, indent=1))
        print(row.get("profile", ""))
        rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "gpu": torch.cuda.get_device_name(0), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
