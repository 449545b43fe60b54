"""Double Sparsity (Yang et al., 2024, arXiv:2408.07092): top-k tokens by a label-channel score (SPEC §6).

Double Sparsity ("DS" in the paper's Tables IV and V) is token sparsity guided by channel
sparsity. Offline, each (layer, query head) gets its *label channels*: the ``r`` channels ``c`` of
the head dimension with the largest mean contribution ``|q[c] · k[c]|`` over calibration tokens
(each token's post-RoPE query with its own key; :func:`calibrate_label_channels`, saved with
:func:`save_label_channels` and named by the config's ``baseline.label_channels``). At decode the
selector keeps a *label cache*, the ``r`` label channels of every cached key for each query head
(``[B, Hq, S, r]``, built from the prompt's keys in :meth:`DoubleSparsitySelector.observe_prefill`
and extended by the new key at every step), scores every middle token with the query's label
channels only, ``scale · q[labels] · K[:, labels]``, and keeps the ``topk`` best: the set is the
shared ``sink ∪ top-k(middle) ∪ local`` of every selector (:func:`._common.compose`), the scoring
and ordering those of the exact retrieval (:func:`._common.retrieve_topk`). With ``r = head_dim``
the score is the exact one and DS selects what the top-k oracle selects.

Not reproduced: DS's 4-bit quantisation of the label cache and its offloading variant (the label
cache here has the key cache's dtype), and per-KV-head channel sharing (channels are per query
head; under GQA each query head reads its KV head's keys through its own channels).

Without a calibration file (``baseline.label_channels: null``) the channels are chosen at prefill
from the prompt itself, with the same statistic over the prompt's real tokens, per sequence (no
batch row influences another). That keeps ``baseline.name: double_sparsity`` usable on any model
without a per-model artefact, at the price of calibrating on the very text being processed (an
advantage the offline method does not have); :attr:`DoubleSparsitySelector.calibrated` says which
mode runs. A decode step of a layer whose prefill was never seen, without a file, is an error.

Retrieval ratio: every active row scores every middle token at every step (ρ̂ = 1), as Quest.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from ..config import ConfigError, ResolvedConfig
from ..decode import DecodeParams, DecodeSelection
from ..geometry import SequenceGeometry
from ..kernels._common import gqa_group
from ._common import LayerStates, compose, retrieve_topk, step_frame

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DoubleSparsitySelector",
    "qk_channel_contributions",
    "top_channels",
    "label_keys",
    "calibrate_label_channels",
    "save_label_channels",
    "load_label_channels",
]

_GROW = 256  # the label cache grows by whole chunks of slots, not one slot per step


def qk_channel_contributions(
    query: torch.Tensor, key_rows: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over the valid tokens of ``|q[c] · k[c]|`` per channel: ``([B, Hq, D] fp32, [B] token counts)``.

    ``query [B, Hq, L, D]`` and ``key_rows [B, Hkv, L, D]`` are the same ``L`` tokens (each
    query row with its own key); ``valid [B, L]`` marks the real ones. GQA: query head ``h`` pairs
    with KV head ``h // (Hq / Hkv)``.
    """
    B, Hq, L, D = query.shape
    Hkv = key_rows.shape[1]
    g = gqa_group(Hq, Hkv)
    prod = (query.float().view(B, Hkv, g, L, D) * key_rows.float()[:, :, None]).abs()
    prod = prod * valid.to(prod.dtype).view(B, 1, 1, L, 1)
    return prod.sum(dim=3).reshape(B, Hq, D), valid.sum(-1)


def top_channels(contribution: torch.Tensor, r: int) -> torch.Tensor:
    """The ``r`` channels of largest contribution (last axis), by descending contribution, int64."""
    if not 1 <= r <= contribution.shape[-1]:
        raise ConfigError(f"baseline.label_rank: {r} is out of range for head_dim {contribution.shape[-1]}; "
                          f"allowed [1, {contribution.shape[-1]}]")
    return torch.topk(contribution, r, dim=-1).indices


def label_keys(key: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``[B, Hq, S, r]``: each query head's label channels of the cache ``key [B, Hkv, S, D]``.

    ``channels [B, Hq, r]`` (int64); query head ``h`` reads KV head ``h // (Hq / Hkv)``.
    """
    B, Hkv, S, D = key.shape
    Hq, r = channels.shape[1], channels.shape[2]
    g = gqa_group(Hq, Hkv)
    src = key[:, :, None].expand(B, Hkv, g, S, D)
    index = channels.view(B, Hkv, g, 1, r).expand(B, Hkv, g, S, r)
    return src.gather(-1, index).reshape(B, Hq, S, r)


def _prompt_channels(query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, r: int) -> torch.Tensor:
    """``[B, Hq, r]`` label channels of each sequence from its prompt rows (the fallback calibration), ascending."""
    B, Hkv, Lk, D = key.shape
    real = geom.query_real_index(query.shape[2]).long()  # [B, Lq]
    slot = (geom.pad.long()[:, None] + real).clamp(0, Lk - 1)
    rows = key.gather(2, slot.view(B, 1, -1, 1).expand(B, Hkv, -1, D))
    contribution, _ = qk_channel_contributions(query, rows, real >= 0)
    return top_channels(contribution, r).sort(dim=-1).values  # channel order, as the calibrated ones


class DoubleSparsitySelector(LayerStates):
    """Top-k middle tokens by the label-channel score, from a label cache per layer.

    Args:
        rank: ``r``, label channels per head (``baseline.label_rank``).
        channels: ``[L, Hq, r_file]`` int64 calibrated label channels by descending contribution
            (the first ``rank`` are used), or ``None`` to choose them from each prompt at prefill.
        head_dim: the head dimension the file was calibrated for (checked at first use).
    """

    def __init__(self, rank: int, channels: torch.Tensor | None = None, head_dim: int | None = None):
        super().__init__()
        if rank < 1:
            raise ConfigError(f"baseline.label_rank: {rank} is out of range; allowed >= 1")
        if channels is not None:
            if channels.dim() != 3:
                raise ConfigError(f"baseline.label_channels: expected [layers, heads, r] channels, got shape "
                                  f"{tuple(channels.shape)}")
            if rank > channels.shape[-1]:
                raise ConfigError(f"baseline.label_rank: {rank} is more than the {channels.shape[-1]} channels per "
                                  f"head of baseline.label_channels; allowed [1, {channels.shape[-1]}]")
            channels = channels[..., :rank].long().sort(dim=-1).values
        self.rank = rank
        self.channels = channels
        self.head_dim = head_dim

    @property
    def calibrated(self) -> bool:
        """True when the label channels come from an offline calibration file."""
        return self.channels is not None

    @classmethod
    def from_config(cls, resolved: ResolvedConfig, num_heads: int) -> "DoubleSparsitySelector":
        """The selector of ``baseline.label_rank`` / ``baseline.label_channels``, checked against the model."""
        b = resolved.config.baseline
        if b.label_channels is None:
            return cls(b.label_rank)
        channels, head_dim = load_label_channels(b.label_channels)
        if tuple(channels.shape[:2]) != (resolved.num_layers, num_heads):
            raise ConfigError(
                f"baseline.label_channels: {b.label_channels} holds channels of {channels.shape[0]} layers x "
                f"{channels.shape[1]} heads; this model has {resolved.num_layers} x {num_heads}")
        return cls(b.label_rank, channels, head_dim)

    def _layer_channels(self, layer: int, batch: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """``[B, Hq, r]`` calibrated channels of ``layer`` (the file must match ``head_dim``)."""
        if self.head_dim is not None and self.head_dim != head_dim:
            raise ConfigError(f"baseline.label_channels: calibrated for head_dim {self.head_dim}; "
                              f"this model's is {head_dim}")
        ch = self.channels[layer].to(device)
        return ch[None].expand(batch, *ch.shape)

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """Build ``layer``'s label cache from the cache ``key`` (and, uncalibrated, choose the channels).

        A prompt from position 0 starts over; a continued prefill keeps the channels it has.
        """
        B, _, _, D = key.shape
        old = self.state.get(layer)
        fresh = bool((geom.q_start <= 0).all())
        if self.calibrated:
            channels = self._layer_channels(layer, B, D, key.device)
        elif fresh or old is None or old["channels"].shape[0] != B:
            channels = _prompt_channels(query, key, geom, self.rank)
        else:
            channels = old["channels"]
        self.state[layer] = {"channels": channels, "label": label_keys(key, channels)}
        self.steps[layer] = 0

    def _label_cache(self, layer: int, k_cache: torch.Tensor, geom: SequenceGeometry, heads: int) -> dict:
        """``layer``'s state with the current token's key written into the label cache (built if missing)."""
        B, Hkv, S, D = k_cache.shape
        st = self.state.get(layer)
        if st is None or st["channels"].shape[0] != B:
            if not self.calibrated:
                raise RuntimeError(
                    f"double_sparsity: layer {layer} decodes without label channels: baseline.label_channels "
                    "is null and no prefill of this prompt was seen (give a calibration file, or prefill first)")
            channels = self._layer_channels(layer, B, D, k_cache.device)
            st = self.state[layer] = {"channels": channels, "label": label_keys(k_cache, channels)}
            return st
        label = st["label"]
        if label.shape[2] < S:
            extra = -(-(S - label.shape[2]) // _GROW) * _GROW
            label = torch.cat([label, label.new_zeros(B, heads, extra, label.shape[3])], dim=2)
        slot = (geom.pad.long() + geom.t_last.long() - 1).clamp(0, S - 1)  # the current token's slot
        current = k_cache.gather(2, slot.view(B, 1, 1, 1).expand(B, Hkv, 1, D))
        new = label_keys(current, st["channels"])  # [B, Hq, 1, r]
        st["label"] = label.scatter(2, slot.view(B, 1, 1, 1).expand_as(new), new)
        return st

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float,
    ) -> DecodeSelection:
        """``sink ∪ top-k(scale · q[labels] · K[middle, labels]) ∪ local`` for every active row."""
        B, H, _ = q.shape
        st = self._label_cache(layer, k_cache, geom, H)
        self.advance(layer)
        frame = step_frame(geom, params)
        rows = frame.rows(H)
        q_label = q.gather(-1, st["channels"])  # [B, Hq, r]
        middle = retrieve_topk(q_label, st["label"][:, :, : k_cache.shape[2]], geom, frame, rows, params.topk, scale)
        return compose(frame, middle, params, retrieved=rows)


# --------------------------------------------------------------------------------------------
# Offline calibration
# --------------------------------------------------------------------------------------------


def calibrate_label_channels(
    model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", texts: Iterable[str], r: int,
    max_length: int = 4096,
) -> torch.Tensor:
    """``[L, Hq, r]`` int64 label channels of every layer and query head, by descending contribution.

    One dense forward per text (truncated to ``max_length`` tokens) of the *unpatched* model; each
    layer's post-RoPE query and key are read on the way (the attention function of
    :mod:`prhs_hf.calibrate`, which runs dense SDPA) and ``|q[c] · k[c]|`` is averaged over all
    tokens of all texts per (layer, head, channel).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from ..calibrate import _HOOK, _NAME, _calibration_attention
    from ..families import check_model, decoder_layers
    from ..patching import is_patched

    check_model(model)
    if is_patched(model):
        raise ValueError("the model is patched with PrHS; calibrate the unpatched model (prhs_hf.unpatch(model))")
    layers = decoder_layers(model)
    sums: list[torch.Tensor | None] = [None] * len(layers)
    tokens = 0

    def make_hook(index: int):
        def hook(query, key, scaling):
            L = query.shape[2]
            valid = torch.ones(query.shape[0], L, dtype=torch.bool, device=query.device)
            s, _ = qk_channel_contributions(query, key[:, :, :L], valid)
            sums[index] = s.sum(0) if sums[index] is None else sums[index] + s.sum(0)
        return hook

    AttentionInterface.register(_NAME, _calibration_attention)
    AttentionMaskInterface.register(_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    device = next(model.parameters()).device
    try:
        for i, layer in enumerate(layers):
            setattr(layer.self_attn, _HOOK, make_hook(i))
        model.set_attn_implementation(_NAME)
        with torch.inference_mode():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
                if ids.shape[1] == 0:
                    continue
                model(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
                tokens += ids.shape[1]
    finally:
        model.set_attn_implementation(previous)
        for layer in layers:
            if _HOOK in layer.self_attn.__dict__:
                delattr(layer.self_attn, _HOOK)
    if tokens == 0:
        raise ValueError("texts: no calibration tokens (give at least one non-empty text)")
    return top_channels(torch.stack(sums) / tokens, r).cpu()


def save_label_channels(path: str | Path, channels: torch.Tensor, head_dim: int) -> Path:
    """Write ``channels [L, Hq, r]`` (and the head dimension they index) to ``path`` (.pt)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"channels": channels.long().cpu(), "head_dim": int(head_dim)}, path)
    return path


def load_label_channels(path: str | Path) -> tuple[torch.Tensor, int]:
    """``(channels [L, Hq, r] int64, head_dim)`` from a file of :func:`save_label_channels`.

    Errors name ``baseline.label_channels``.
    """
    key = "baseline.label_channels"
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}: {path} does not exist; give a file written by save_label_channels (.pt)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ConfigError(f"{key}: {path} is not a label-channel file ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("channels"), torch.Tensor) or "head_dim" not in data:
        raise ConfigError(f"{key}: {path} is not a label-channel file (expected keys 'channels' and 'head_dim')")
    channels, head_dim = data["channels"].long(), int(data["head_dim"])
    if channels.dim() != 3 or channels.numel() == 0 or channels.min() < 0 or channels.max() >= head_dim:
        raise ConfigError(f"{key}: {path} holds channels of shape {tuple(channels.shape)} that are not "
                          f"[layers, heads, r] indices in [0, {head_dim})")
    return channels, head_dim
