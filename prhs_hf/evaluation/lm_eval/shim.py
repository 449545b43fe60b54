"""``python -m prhs_hf.evaluation.lm_eval ARGS``: lm-eval's own command line, with the ``prhs`` model registered
and the repository's ``tasks/`` folder included.

Everything in ``ARGS`` goes to lm-eval unchanged, except that ``--include_path <repo>/tasks`` is
added when no ``--include_path`` is given (lm-eval takes one folder; give your own to replace it)
and ``--model prhs`` when a ``run`` has no ``--model``. For example::

    python -m prhs_hf.evaluation.lm_eval --model prhs --tasks gsm8k_local \
        --model_args pretrained=smollm2-135m,prhs_config=cis
"""

from __future__ import annotations

import sys
from typing import Sequence

from . import TASKS_DIR, register

__all__ = ["SUBCOMMANDS", "PROJECT_SUBCOMMAND", "lm_eval_argv", "main", "forward"]

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's command line (``lm_eval.__main__.cli_evaluate``) on ``argv`` (default ``sys.argv[1:]``)."""
    register()
    from lm_eval.__main__ import cli_evaluate

    args = lm_eval_argv(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help and errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def forward(argv: Sequence[str] | None = None) -> int | None:
    """For the project CLI: run :func:`main` on the rest if ``argv`` (default ``sys.argv[1:]``) starts
    with ``lm-eval`` and return its exit status; otherwise return ``None`` and do nothing.

    It must run before the project's own argument parsing, which does not know lm-eval's options.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return main(args[1:]) if args[:1] == [PROJECT_SUBCOMMAND] else None
