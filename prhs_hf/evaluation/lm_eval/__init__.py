"""prhs-hf's lm-eval integration: the ``prhs`` model, the local task YAMLs and the shared scoring.

Importing this package does not import lm-eval (the scoring in :mod:`.metrics` and :mod:`.prompts`
also serves ``scripts/run_accuracy.py`` where lm-eval is absent). :func:`register` imports
:mod:`.plugin`, which registers the ``prhs`` model; :func:`task_manager` returns lm-eval's
``TaskManager`` with the repository's ``tasks/`` folder included. ``python -m prhs_hf.evaluation.lm_eval``
runs lm-eval's own command line with both done.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prhs_hf.config import shipped_dir

if TYPE_CHECKING:  # pragma: no cover - typing only
    from lm_eval.tasks import TaskManager

    from .plugin import PrHSLM

from .. import ruler as _ruler

__all__ = ["TASKS_DIR", "LOCAL_TASKS", "register", "task_manager"]

TASKS_DIR = shipped_dir("tasks")
"""The local task YAMLs: the repository's ``tasks/`` folder, installed as ``prhs_hf/tasks`` by a wheel."""

LOCAL_TASKS = ("gsm8k_local", "gsm8k_cot_local", "gsm8k_chat_local", "coqa_local", *_ruler.LOCAL_TASKS)
"""The task names defined in :data:`TASKS_DIR`."""


def register() -> "type[PrHSLM]":
    """Register the ``prhs`` model with lm-eval (idempotent) and return its class."""
    from .plugin import PrHSLM

    return PrHSLM


def task_manager(include_path: "str | Path | list[str | Path] | None" = None, include_defaults: bool = True,
                 **kwargs: Any) -> "TaskManager":
    """lm-eval's ``TaskManager`` over :data:`TASKS_DIR`, ``include_path`` and, if ``include_defaults``,
    lm-eval's own tasks (indexing those takes seconds; the local tasks alone, next to nothing).

    Other arguments go to ``TaskManager``; ``metadata={"data_dir": DIR}`` points the local tasks at
    a data folder (``simple_evaluate`` ignores its own ``metadata`` when given a task manager).
    """
    from lm_eval.tasks import TaskManager

    extra = [] if include_path is None else include_path if isinstance(include_path, list) else [include_path]
    return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra)], include_defaults=include_defaults, **kwargs)
