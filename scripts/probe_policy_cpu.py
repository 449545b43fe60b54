"""Decode ms/step of dense and of forced-sparse PrHS on this CPU, for the CPU cost model of
``policy: auto`` (prhs_hf/policy.py, :data:`~prhs_hf.policy.CPU`).

For each config and prompt length: a greedy generation of ``--new`` tokens with the unpatched model
(SDPA) and with the patched one, ``policy.decode: sparse`` forced, the prefill timed apart
(:func:`prhs_hf.evaluation.compare.timed_generate`). The prompt is the demo's (``prhs_hf.cli.DEFAULT_PROMPT``)
repeated and cut to the length. Writes a JSON of the rows and prints a Markdown table.

    OMP_NUM_THREADS=2 python scripts/probe_policy_cpu.py --model smollm2-135m --lengths 1024,4702 \
        --configs cis,cis_longbench --out docs/results/policy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import prhs_hf
from prhs_hf.cli import DEFAULT_PROMPT
from prhs_hf.evaluation.compare import timed_generate
from prhs_hf.hub.fetch import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,4702")
    parser.add_argument("--configs", default="cis,cis_longbench")
    parser.add_argument("--new", type=int, default=6, help="new tokens per generation (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    ids = tokenizer(DEFAULT_PROMPT * 8, return_tensors="pt")["input_ids"]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        inputs = {"input_ids": ids[:, :length], "attention_mask": torch.ones_like(ids[:, :length])}
        timed_generate(model, tokenizer, {k: v[:, :32] for k, v in inputs.items()}, 2)  # warm-up
        dense = timed_generate(model, tokenizer, inputs, args.new)
        rows.append({"config": "dense (unpatched sdpa)", "length": length,
                     "ms_per_step": 1e3 / dense.decode_tokens_per_second})
        for name in args.configs.split(","):
            with prhs_hf.patch(model, name, overrides={"policy": {"decode": "sparse"}}):
                sparse = timed_generate(model, tokenizer, inputs, args.new)
            rows.append({"config": f"{name} (sparse forced)", "length": length,
                         "ms_per_step": 1e3 / sparse.decode_tokens_per_second})
        for r in rows[-1 - len(args.configs.split(",")):]:
            print(f"| {r['config']} | {r['length']} | {r['ms_per_step']:.1f} |", flush=True)
        if args.out:  # after every length, so that a run cut short keeps its rows
            args.out.write_text(json.dumps({
                "model": args.model, "new_tokens": args.new, "torch_threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
