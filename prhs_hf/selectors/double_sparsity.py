"""Double Sparsity (Yang et al., 2024, arXiv:2408.07092): top-k tokens by a label-channel score (SPEC §6).

Double Sparsity ("DS" in the paper's Tables IV and V) is token sparsity guided by channel
sparsity. Offline, each (layer, query head) gets its *label channels*: the ``r`` channels ``c`` of
the head dimension with the largest mean contribution ``|q[c] · k[c]|`` over calibration tokens
(each token's post-RoPE query with its own key). ``prhs-hf calibrate-ds``
(:mod:`prhs_hf.calibration.ds_channels`) measures them and writes the file that the config's
``baseline.label_channels`` names; this module only loads it (:func:`load_label_channels`). At decode the
selector keeps a *label cache*, the ``r`` label channels of every cached key for each query head
(:class:`LabelCache`, one ``[L, B, Hq, S, r]`` buffer for all layers, built from the prompt's keys
in :meth:`DoubleSparsitySelector.observe_prefill` and given the new key's row at every step, in
place, so that the step runs inside a compiled, CUDA-graph-captured decode forward), scores
every middle token with the query's label channels only, ``scale · q[labels] · K[:, labels]``, and
keeps the ``topk`` best: the set is the shared ``sink ∪ top-k(middle) ∪ local`` of every selector
(:func:`._common.compose`), the scoring and ordering those of the exact retrieval
(:func:`._common.retrieve_topk`). With ``r = head_dim`` the score is the exact one and DS selects
what the top-k oracle selects.

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

import torch

from ..config import ConfigError, ResolvedConfig
from ..decode import DecodeParams, DecodeSelection, layer_rows
from ..geometry import SequenceGeometry
from ..ops.triton_support import gqa_group
from .base import StepMark
from .set_steps import compose, retrieve_topk, step_frame

__all__ = [
    "DoubleSparsitySelector",
    "LabelCache",
    "qk_channel_contributions",
    "top_channels",
    "label_keys",
    "load_label_channels",
]

_GROW = 256  # a DynamicCache's label cache grows by whole chunks of slots, not one slot per step (eager)


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


class LabelCache:
    """The label cache of every layer in one buffer of fixed address, mutated only in place.

    Attributes:
        label: ``[L, B, Hq, S, r]`` (the key cache's dtype) each layer's label channels of every
            cache slot; rows past a layer's cache are unused.
        channels: ``[L, B, Hq, r]`` int64 each layer's label channels (ascending).
        ready: per layer, whether its rows hold the current prompt (Python, set by eager code only:
            at a prefill, or a calibrated layer's first decode step without one).

    Allocated at a prefill (which ``generate()`` runs eagerly) and marked with
    ``torch._dynamo.mark_static_address``, as :class:`~prhs_hf.selectors.cis_state.CISState`: a compiled,
    CUDA-graph-captured decode step writes the current token's row into it in place and rebinds
    nothing. ``S`` is the KV cache's slot count at the prefill (a ``StaticCache``'s maximum
    length), so under a static cache it never grows.
    """

    def __init__(self, layers: int, batch: int, heads: int, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.label = torch.zeros(layers, batch, heads, slots, rank, dtype=dtype, device=device)
        self.channels = torch.zeros(layers, batch, heads, rank, dtype=torch.int64, device=device)
        self.ready = [False] * layers
        for buffer in (self.label, self.channels):
            # fixed addresses: a compiled, CUDA-graph-captured decode step mutates them in place
            torch._dynamo.mark_static_address(buffer)

    @property
    def slots(self) -> int:
        """``S``, the cache slots each layer's label rows cover."""
        return self.label.shape[3]

    def write(self, layer: int, slot: torch.Tensor, rows: torch.Tensor) -> None:
        """Put ``rows [B, Hq, r]`` at cache slot ``slot [B]`` of ``layer``, in place: through the
        ``[L, ...]`` buffer (:func:`~prhs_hf.decode.layer_rows`), not a view of the layer, which a
        compiled step would turn into a copy of the whole label cache at every step."""
        B, H, _ = rows.shape
        self.label.index_put_((*layer_rows(layer, B, H, self.label.device), slot.view(B, 1)), rows)

    def fits(self, layers: int, batch: int, heads: int, rank: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the buffers hold layers ``[0, layers)`` of decode steps of this shape."""
        _, b, h, _, r = self.label.shape
        return (len(self.ready) >= layers and (b, h, r) == (batch, heads, rank) and self.label.dtype == dtype
                and self.label.device == device)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow the cache's batch: sequence ``i`` becomes old sequence ``index[i]`` in every layer (in
        place for a beam reordering; new buffers where ``index`` changes the batch size)."""
        index = index.to(self.label.device)
        if index.numel() != self.label.shape[1]:
            with torch.inference_mode(False):
                self.label, self.channels = self.label.index_select(1, index), self.channels.index_select(1, index)
            for buffer in (self.label, self.channels):
                torch._dynamo.mark_static_address(buffer)
            return
        for buffer in (self.label, self.channels):
            buffer.copy_(buffer.index_select(1, index))  # in place: addresses stay fixed


class DoubleSparsitySelector:
    """Top-k middle tokens by the label-channel score, from the label cache of every layer (:class:`LabelCache`).

    Args:
        rank: ``r``, label channels per head (``baseline.label_rank``).
        channels: ``[L, Hq, r_file]`` int64 calibrated label channels by descending contribution
            (the first ``rank`` are used), or ``None`` to choose them from each prompt at prefill.
        head_dim: the head dimension the file was calibrated for (checked at first use).
        num_layers: the model's layers, for which the label cache is allocated at once (default:
            the file's layers, else as many as the layers seen so far).

    The label cache is allocated (or reused in place, when the shape and the slot count fit) at
    a prefill. A decode step writes the current token's label row at its slot in place, so it can
    run inside a compiled, CUDA-graph-captured step (``generate()`` with a ``StaticCache``). With a
    ``DynamicCache`` the cache outgrows the allocation as tokens are appended: the step then
    reallocates the label cache eagerly, ``_GROW`` slots more at a time, copying what it holds
    (eager only: a compiled step whose cache grows recompiles for every length anyway).
    """

    CALL_STATE = ("cache",)

    def __init__(self, rank: int, channels: torch.Tensor | None = None, head_dim: int | None = None,
                 num_layers: int | None = None):
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
        self.num_layers = num_layers if num_layers is not None else (None if channels is None else channels.shape[0])
        self.cache: LabelCache | None = None

    @property
    def calibrated(self) -> bool:
        """True when the label channels come from an offline calibration file."""
        return self.channels is not None

    @property
    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Views of each layer's label cache that holds the current prompt: ``{"channels": [B, Hq, r],
        "label": [B, Hq, S, r]}`` by layer (for inspection; the step reads :attr:`cache`)."""
        c = self.cache
        if c is None:
            return {}
        return {i: {"channels": c.channels[i], "label": c.label[i]} for i, ready in enumerate(c.ready) if ready}

    @classmethod
    def from_config(cls, resolved: ResolvedConfig, num_heads: int) -> "DoubleSparsitySelector":
        """The selector of ``baseline.label_rank`` / ``baseline.label_channels``, checked against the model."""
        b = resolved.config.baseline
        if b.label_channels is None:
            return cls(b.label_rank, num_layers=resolved.num_layers)
        channels, head_dim = load_label_channels(b.label_channels)
        if tuple(channels.shape[:2]) != (resolved.num_layers, num_heads):
            raise ConfigError(
                f"baseline.label_channels: {b.label_channels} holds channels of {channels.shape[0]} layers x "
                f"{channels.shape[1]} heads; this model has {resolved.num_layers} x {num_heads}")
        return cls(b.label_rank, channels, head_dim, resolved.num_layers)

    def _layer_channels(self, layer: int, batch: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """``[B, Hq, r]`` calibrated channels of ``layer`` (the file must match ``head_dim``)."""
        if self.head_dim is not None and self.head_dim != head_dim:
            raise ConfigError(f"baseline.label_channels: calibrated for head_dim {self.head_dim}; "
                              f"this model's is {head_dim}")
        ch = self.channels[layer].to(device)
        return ch[None].expand(batch, *ch.shape)

    def _ready(self, layer: int, batch: int, heads: int) -> bool:
        """Whether ``layer``'s label cache holds the current prompt for ``batch`` x ``heads`` rows."""
        c = self.cache
        return c is not None and layer < len(c.ready) and c.ready[layer] and c.label.shape[1:3] == (batch, heads)

    @torch.compiler.disable
    def _fit(
        self, layer: int, batch: int, heads: int, slots: int, dtype: torch.dtype, device: torch.device
    ) -> LabelCache:
        """The label cache, made to hold ``layer`` and ``slots`` slots for this shape (eager even
        inside a compiled forward: the buffers must live outside any CUDA graph pool). A cache of
        the same shape that is too short (fewer layers or slots) is reallocated with its contents;
        one of another shape is replaced, every layer unready."""
        old = self.cache
        layers = max(layer + 1, self.num_layers or 0)
        if old is not None and old.fits(layers, batch, heads, self.rank, dtype, device) and old.slots >= slots:
            return old
        if old is not None and old.fits(0, batch, heads, self.rank, dtype, device):
            new = LabelCache(max(layers, len(old.ready)), batch, heads, max(slots, old.slots), self.rank, dtype, device)
            new.label[: len(old.ready), :, :, : old.slots].copy_(old.label)
            new.channels[: len(old.ready)].copy_(old.channels)
            new.ready[: len(old.ready)] = old.ready
        else:
            new = LabelCache(layers, batch, heads, slots, self.rank, dtype, device)
        self.cache = new
        return new

    def _store(self, layer: int, channels: torch.Tensor, key: torch.Tensor) -> None:
        """Write ``layer``'s channels and the label rows of the whole cache ``key`` (in place)."""
        B, Hq, _ = channels.shape
        S = key.shape[2]
        cache = self._fit(layer, B, Hq, S, key.dtype, key.device)
        cache.channels[layer].copy_(channels)
        cache.label[layer, :, :, :S].copy_(label_keys(key, channels))
        cache.ready[layer] = True

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """Build ``layer``'s label cache from the cache ``key`` (and, uncalibrated, choose the channels).

        A prompt from position 0 starts over; a continued prefill keeps the channels it has.
        """
        B, _, _, D = key.shape
        Hq = query.shape[1]
        fresh = bool((geom.q_start <= 0).all())
        if self.calibrated:
            channels = self._layer_channels(layer, B, D, key.device)
        elif fresh or not self._ready(layer, B, Hq):
            channels = _prompt_channels(query, key, geom, self.rank)
        else:
            channels = self.cache.channels[layer].clone()
        self._store(layer, channels, key)

    def _label_cache(self, layer: int, k_cache: torch.Tensor, geom: SequenceGeometry, heads: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s ``(channels [B, Hq, r], label cache [B, Hq, S, r])``, the current token's key
        written into the label cache in place (built from the whole cache if this prompt's prefill
        was not seen; a DynamicCache that outgrew the allocation grows it first, eagerly)."""
        B, Hkv, S, D = k_cache.shape
        if not self._ready(layer, B, heads):
            if not self.calibrated:
                raise RuntimeError(
                    f"double_sparsity: layer {layer} decodes without label channels: baseline.label_channels "
                    "is null and no prefill of this prompt was seen (give a calibration file, or prefill first)")
            self._store(layer, self._layer_channels(layer, B, D, k_cache.device), k_cache)
        elif self.cache.slots < S:
            self._fit(layer, B, heads, -(-S // _GROW) * _GROW, k_cache.dtype, k_cache.device)
        channels = self.cache.channels[layer]
        slot = (geom.pad.long() + geom.t_last.long() - 1).clamp(0, S - 1)  # the current token's slot
        current = k_cache.gather(2, slot.view(B, 1, 1, 1).expand(B, Hkv, 1, D))
        self.cache.write(layer, slot, label_keys(current, channels)[:, :, 0])  # [B, Hq, r]
        return channels, self.cache.label[layer, :, :, :S]

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: object = None,
    ) -> DecodeSelection:
        """``sink ∪ top-k(scale · q[labels] · K[middle, labels]) ∪ local`` for every active row."""
        B, H, _ = q.shape
        channels, label = self._label_cache(layer, k_cache, geom, H)
        frame = step_frame(geom, params)
        rows = frame.rows(H)
        q_label = q.gather(-1, channels)  # [B, Hq, r]
        middle = retrieve_topk(q_label, label, geom, frame, rows, params.topk, scale)
        return compose(frame, middle, params, retrieved=rows)

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search: the label cache's batch rows, in place."""
        if self.cache is not None:
            self.cache.reorder(index)

    undo_period = None

    def mark_step(self) -> StepMark:
        """Nothing to keep (:class:`~prhs_hf.selectors.base.UndoesSteps`): a decode step writes only
        its own token's label row, from that token's key, which the step after an undo writes again;
        rows past the cache's end are never read."""
        return StepMark(None)

    def undo_to(self, mark: StepMark) -> None:
        """Nothing to put back (see :meth:`mark_step`)."""

    def reset(self) -> None:
        """Forget every layer's prompt (the buffers stay, so a compiled step keeps their addresses)."""
        if self.cache is not None:
            self.cache.ready = [False] * len(self.cache.ready)


def load_label_channels(path: str | Path) -> tuple[torch.Tensor, int]:
    """``(channels [L, Hq, r] int64, head_dim)`` from a label-channel file: a ``torch.save`` of
    ``{"channels": [L, Hq, r] int64, "head_dim": int}``, as ``prhs-hf calibrate-ds`` writes it
    (:func:`prhs_hf.calibration.ds_channels.save_label_channels`).

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
