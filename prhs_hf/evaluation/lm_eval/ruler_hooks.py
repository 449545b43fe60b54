"""The functions that ``tasks/ruler_*_local.yaml`` name with ``!function``: loading the prepared
RULER files, scoring, and the per-length aggregation.

They adapt :mod:`prhs_hf.evaluation.ruler` to lm-eval and hold no logic of their own, so the lm-eval
tasks and the direct engine (``scripts/run_accuracy.py --tasks ruler_<task>_<length>``) read the
same rows, build the same prompt (``doc_to_text`` is ``input``, ``gen_prefix`` the row's, joined as
:func:`prhs_hf.evaluation.ruler.prompt_text` joins them) and score alike. The rows come from files
prepared by ``prhs-hf ruler prepare``: ``--metadata '{"data_dir": DIR}'`` (or ``$PRHS_HF_DATA_DIR``),
and ``"max_seq_lengths": [4096, ...]`` to run only some of the prepared lengths (lm-eval's own
RULER metadata key; default every prepared length).

Metrics: ``string_match_all`` over every row, and one per suite length (``"4096"`` ...
``"32768"``, lm-eval's RULER metric names) over the rows of that length (-1 when there are none,
as in lm-eval).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from prhs_hf.evaluation import ruler

if TYPE_CHECKING:  # pragma: no cover - typing only
    import datasets

__all__ = ["process_results", "aggregate_length", *(f"load_{name}" for name in ruler.RULER_TASKS)]

_ABSENT = -1.0


def _loader(task: ruler.RulerTask) -> Callable[..., "dict[str, datasets.Dataset]"]:
    def load(data_dir: str | None = None, max_seq_lengths: Sequence[int] | None = None,
             **_metadata: Any) -> "dict[str, datasets.Dataset]":
        import datasets

        rows = ruler.load_prepared(task, max_seq_lengths, data_dir)
        return {"test": datasets.Dataset.from_list(rows)}

    load.__name__ = f"load_{task.name}"
    load.__doc__ = (f"``custom_dataset`` of ``{task.lm_eval_task}``: ``{{\"test\": rows}}`` of the prepared "
                    f"{task.name} files. Other metadata keys (model arguments among them) are ignored.")
    return load


for _task in ruler.RULER_TASKS.values():
    globals()[f"load_{_task.name}"] = _loader(_task)


def process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """The row's metric (``string_match_all``) and the same value under its length's name, -1 under
    the other suite lengths (lm-eval's RULER convention, which :func:`aggregate_length` undoes)."""
    (metric, value), = ruler.score(doc, results[0]).items()
    out = {metric: value}
    out.update({str(n): value if int(doc["max_length"]) == n else _ABSENT for n in ruler.LENGTHS})
    return out


def aggregate_length(values: Sequence[float]) -> float:
    """lm-eval's RULER ``aggregate_metrics``: the mean over the rows of one length (-1 if it has none)."""
    kept = [v for v in values if v != _ABSENT]
    return sum(kept) / len(kept) if kept else _ABSENT
