"""What every comparison selector shares: the step frame, top-k of a score, composition, set attention.

The budget accounting is CIS's (SPEC §4, steps 1-2 and 5) for every selector: a sequence with
``t <= sink + local + topk`` attends to every visible token and is not *active*; an active one
attends to ``[0, sink) ∪ middle selection ∪ [t - local, t)`` where the middle selection holds at
most ``topk`` tokens of ``M(t) = [lo, hi)`` (``lo = max(sink, W_l(t))`` with PSAW on for decode).
All indices are *real* indices (left padding excluded), as in docs/DECODE_PIPELINE.md.
"""

from __future__ import annotations

import torch

from ..decode import DecodeParams, DecodeSelection, StepFrame, step_frame
from ..geometry import SequenceGeometry
from ..ops.compose.compose_indices import compose_indices_reference
from ..ops.decode_ops import REFERENCE_OPS, DecodeOps
from ..ops.topk.topk_retrieval import topk_retrieval_reference
from ..ops.triton_support import gqa_group
from .base import StepMark

__all__ = [
    "StatelessSelector",
    "TopKSelector",
    "StepFrame",  # re-exported from prhs_hf.decode for the selectors
    "step_frame",
    "compose",
    "topk_of_scores",
    "retrieve_topk",
    "set_probabilities",
    "gather_rows",
    "attend_with_tail",
    "window_scores",
    "tail_moments",
    "tail_log_mass",
    "tail_summary",
    "tail_summaries",
    "visible_probabilities",
    "to_real",
    "grow_last",
    "LayerStates",
]


def compose(
    frame: StepFrame, middle: torch.Tensor, p: DecodeParams, retrieved: torch.Tensor | None = None,
    win_start: torch.Tensor | None = None,
) -> DecodeSelection:
    """``sink ∪ clip(middle) ∪ [win_start, t)`` as a :class:`DecodeSelection` (no dilation).

    Args:
        frame: the step's regions.
        middle: ``[B, Hq, n]`` int32 middle indices (any order, ``-1`` = none); clipped to
            ``[lo, hi)`` and deduplicated by :func:`compose_indices_reference`.
        p: the layer's decode parameters (``p.capacity`` is the output width).
        retrieved: ``[B, Hq]`` bool, rows that did a full retrieval (default: none).
        win_start: override of ``frame.win_start`` (StreamingLLM widens the window).
    """
    ws = frame.win_start if win_start is None else win_start
    idx, count = compose_indices_reference(frame.t, frame.lo, frame.hi, ws, middle, False, p.sink, 0, 0, p.capacity)
    if retrieved is None:
        retrieved = torch.zeros(idx.shape[:2], dtype=torch.bool, device=idx.device)
    return DecodeSelection(idx, count, retrieved & frame.active[:, None], frame.active)


def retrieve_topk(
    q: torch.Tensor, k_cache: torch.Tensor, geom: SequenceGeometry, frame: StepFrame, rows: torch.Tensor, k: int,
    scale: float,
) -> torch.Tensor:
    """Exact top-``k`` of the middle for ``rows [B, Hq]`` (best first, ``-1`` padded): the CIS retrieval."""
    return topk_retrieval_reference(q, k_cache, geom.pad, frame.lo, frame.hi, rows, k, scale)


def topk_of_scores(score: torch.Tensor, frame: StepFrame, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` real indices of a per-token score in ``[lo, hi)``, best first, ties to the lower index.

    ``score`` is ``[B, Hq, R]`` indexed by *real* position (``R`` at least every ``t``). This is
    :func:`topk_retrieval_reference` with the score as a one-dimensional key per query head and a
    unit query, so the ordering contract is the retrieval's. Rows not in ``rows`` get ``-1``.
    """
    B, H, R = score.shape
    ones = torch.ones(B, H, 1, dtype=torch.float32, device=score.device)
    zeros = torch.zeros(B, dtype=torch.int32, device=score.device)
    return topk_retrieval_reference(ones, score.float().unsqueeze(-1), zeros, frame.lo, frame.hi, rows, k, 1.0)


def to_real(x: torch.Tensor, pad: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Re-index the last (slot) axis of ``x [B, ..., S]`` to real positions: ``out[..., j] = x[..., pad + j]``.

    Positions past the last slot get ``fill``.
    """
    S = x.shape[-1]
    j = torch.arange(S, device=x.device)
    slots = pad.long().view(-1, *([1] * (x.dim() - 1))) + j
    inside = slots < S
    out = x.gather(-1, slots.clamp(max=S - 1).expand_as(x))
    return torch.where(inside, out, torch.full_like(out, fill))


def gather_rows(cache: torch.Tensor, pad: torch.Tensor, idx: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, heads, cap, D]`` fp32 rows of ``cache [B, Hkv, S, D]`` at the real indices ``idx``.

    ``idx`` is ``[B, heads, cap]`` or ``[B, Hkv, cap]`` (one set per KV head, repeated over its
    query heads); ``-1`` entries read slot ``pad`` (mask them).
    """
    B, Hkv, S = cache.shape[:3]
    if idx.shape[1] != heads:
        idx = idx.repeat_interleave(heads // idx.shape[1], dim=1)
    g = gqa_group(heads, Hkv)
    slots = (pad.long().view(B, 1, 1) + idx.long().clamp_min(0)).clamp(0, S - 1)
    b_ix = torch.arange(B, device=cache.device).view(B, 1, 1)
    h_ix = (torch.arange(heads, device=cache.device) // g).view(1, heads, 1)
    return cache[b_ix, h_ix, slots].float()


def set_probabilities(
    q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, sel: DecodeSelection, scale: float
) -> torch.Tensor:
    """``[B, Hq, cap]`` fp32 softmax of ``q`` over its selected keys (the sparse attention's weights; 0 after ``count``)."""
    keys = gather_rows(k_cache, pad, sel.idx, q.shape[1])  # [B, Hq, cap, D]
    scores = (keys * q.float().unsqueeze(2)).sum(-1) * scale
    valid = torch.arange(sel.idx.shape[-1], device=q.device) < sel.count.long().unsqueeze(-1)
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.where(valid, probs, torch.zeros_like(probs))


def attend_with_tail(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, idx: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
) -> torch.Tensor:
    """``[B, Hq, D]`` exact softmax attention of ``q`` over the keys ``idx`` plus one synthetic pair.

    The keys are the cache rows at the real indices ``idx [B, H, cap]`` (``H`` is ``Hq`` or
    ``Hkv``; ``-1`` = none); ``tail = (key [B, H, D], value [B, H, D], log_mass [B, H])`` adds a
    key whose logit is ``scale * q·key + log_mass`` (``-inf``: no tail). Computed in fp32, returned
    in ``q``'s dtype. This is the attention of a CertKV selection (its tail-summary slot) and of CIS
    with ``cis.tail_slot`` (:func:`tail_summary`).
    """
    heads = q.shape[1]
    tk, tv, lm = tail
    if tk.shape[1] != heads:
        g = heads // tk.shape[1]
        tk, tv, lm = (x.repeat_interleave(g, dim=1) for x in (tk, tv, lm))
    qf = q.float()
    keys = gather_rows(k_cache, pad, idx, heads)
    values = gather_rows(v_cache, pad, idx, heads)
    valid = idx >= 0
    if valid.shape[1] != heads:
        valid = valid.repeat_interleave(heads // valid.shape[1], dim=1)
    scores = ((keys * qf.unsqueeze(2)).sum(-1) * scale).masked_fill(~valid, float("-inf"))
    synthetic = (tk.float() * qf).sum(-1) * scale + lm.float()  # [B, Hq]
    probs = torch.softmax(torch.cat([scores, synthetic.unsqueeze(-1)], dim=-1), dim=-1)
    probs = torch.nan_to_num(probs)  # a row with no key at all (never on a decode step): 0, not NaN
    out = (probs[..., :-1, None] * values).sum(-2) + probs[..., -1:] * tv.float()
    return out.to(q.dtype)


def window_scores(
    q_win: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SnapKV's observation-window attention: ``(π [B, Hkv, S] by real index, logits [B, Hq, W, S] by cache slot)``.

    ``q_win [B, Hq, W, D]`` are window queries at real positions ``q_pos [B, W]`` (``< 0``: none);
    each sees the real keys ``0..q_pos``. ``π`` sums the causal softmax over the window rows and
    averages it over the query heads of each KV head (fp32, real-indexed: ``π[..., j]`` is real
    token ``j``); ``logits`` are the scaled scores by cache slot, ``-inf`` where not visible.
    """
    B, Hq, W, D = q_win.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    g = gqa_group(Hq, Hkv)
    kf = k_cache.float()[:, :, None]  # [B, Hkv, 1, S, D]
    qf = q_win.float().reshape(B, Hkv, g, W, D)
    logits = torch.matmul(qf, kf.transpose(-1, -2)).reshape(B, Hq, W, S) * scale
    real = torch.arange(S, device=k_cache.device)[None, :] - pad.long()[:, None]  # [B, S]
    visible = (real[:, None, :] >= 0) & (real[:, None, :] <= q_pos.long()[:, :, None]) & (q_pos[:, :, None] >= 0)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1))  # a padding row (no key): 0
    pi = probs.sum(2).reshape(B, Hkv, g, S).mean(2)
    return to_real(pi, pad), logits


def tail_moments(
    pi: torch.Tensor, x: torch.Tensor, omitted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, x*, m·M_2)`` of the omitted tokens: their mass ``Σ π``, the ``π``-weighted mean of
    ``x [B, H, S, D]`` and ``Σ π ‖x − x*‖²`` (all real-indexed; ``x* = 0`` where ``m = 0``)."""
    w = torch.where(omitted, pi, torch.zeros_like(pi))
    m = w.sum(-1)
    mean = (w[..., None] * x).sum(-2) / m.clamp_min(1e-30)[..., None]
    spread = (w * ((x - mean[..., None, :]) ** 2).sum(-1)).sum(-1)
    return m, mean, spread


def tail_log_mass(
    logits: torch.Tensor, omitted: torch.Tensor, q_win: torch.Tensor, q_pos: torch.Tensor, tail_k: torch.Tensor,
    pad: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``[B, Hkv]`` β: the mean over the window queries (and a KV head's query heads) of the
    omitted tokens' log-partition minus the synthetic key's logit; ``-inf`` where nothing is omitted.

    ``logits [B, Hq, W, S]`` by cache slot (``-inf`` where not visible), ``omitted [B, Hkv, S]`` by
    real index, ``q_win [B, Hq, W, D]`` at real positions ``q_pos [B, W]``, ``tail_k [B, Hkv, D]``.
    """
    B, Hq, W, S = logits.shape
    Hkv = omitted.shape[1]
    g = Hq // Hkv
    real_logits = to_real(logits, pad, fill=float("-inf"))
    om = omitted.repeat_interleave(g, dim=1)[:, :, None]  # [B, Hq, 1, S]
    lse = torch.logsumexp(real_logits.masked_fill(~om, float("-inf")), dim=-1)  # [B, Hq, W]
    syn = (q_win.float() * tail_k.repeat_interleave(g, dim=1)[:, :, None]).sum(-1) * scale  # [B, Hq, W]
    ok = torch.isfinite(lse) & (q_pos[:, None, :] >= 0)
    diff = torch.where(ok, lse - syn, torch.zeros_like(lse))
    n = ok.sum(-1).reshape(B, Hkv, g).sum(-1)
    beta = diff.sum(-1).reshape(B, Hkv, g).sum(-1) / n.clamp_min(1)
    return torch.where(n > 0, beta, torch.full_like(beta, float("-inf")))


def tail_summary(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, t: torch.Tensor,
    lo: torch.Tensor, end: torch.Tensor, members: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tail-summary pair of the middle tokens ``[lo, end)`` that ``members`` leaves out, under ``q``.

    CertKV's synthetic slot with the decode query as its one-row observation window (CIS + tail,
    ``cis.tail_slot``): with ``π`` the softmax of ``q [B, Hq, D]`` (real position ``t - 1``) over its
    visible keys and ``E = [lo, end) \\ members`` the omitted tokens, ``key = Σ_E π k / Σ_E π``,
    ``value`` likewise and ``log_mass = log Σ_E exp(scale q·k_j) − scale q·key``, so that the logit
    ``scale q·key + log_mass`` carries exactly ``E``'s softmax mass for ``q``
    (:func:`tail_moments`, :func:`tail_log_mass`).

    ``members [B, H, n]`` are real indices (``-1`` = none); ``H = Hq`` gives a pair per query head,
    ``H = Hkv`` one per KV head (its group's ``π`` averaged and ``log_mass`` the mean over the group,
    as CertKV's). ``lo``, ``end``, ``t`` are ``[B]``. Returns fp32 ``(key [B, H, D], value [B, H, D],
    log_mass [B, H])``; ``log_mass = -inf`` where ``E`` is empty.
    """
    return tail_summaries(q, k_cache, v_cache, pad, t, lo, end, [members], scale)[0]


def tail_summaries(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, t: torch.Tensor,
    lo: torch.Tensor, end: torch.Tensor, member_sets: list[torch.Tensor], scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`tail_summary` of each of ``member_sets`` (all ``[B, H, n_i]`` with the same ``H``),
    from one softmax of ``q`` over the cache: only the omitted set differs between them."""
    B, Hq, _ = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    H = member_sets[0].shape[1]
    kc, vc = k_cache, v_cache
    if H == Hq and Hq != Hkv:  # a pair per query head: each reads its KV head's rows
        kc, vc = (x.repeat_interleave(gqa_group(Hq, Hkv), dim=1) for x in (k_cache, v_cache))
    pos = (t.long() - 1)[:, None]
    q_win = q.float()[:, :, None]
    pi, logits = window_scores(q_win, pos, kc, pad, scale)  # [B, H, S] real; [B, Hq, 1, S] by slot
    real = torch.arange(S, device=q.device)
    middle = (real[None, :] >= lo.long()[:, None]) & (real[None, :] < end.long()[:, None])  # [B, S]
    kr, vr = (to_real(x.float().movedim(-1, -2), pad).movedim(-1, -2) for x in (kc, vc))
    out = []
    for members in member_sets:
        slots = torch.where((members >= 0) & (members < S), members.long(), S)
        kept = torch.zeros(B, H, S + 1, dtype=torch.bool, device=q.device).scatter_(-1, slots, True)[..., :S]
        omitted = middle[:, None] & ~kept
        _, key, _ = tail_moments(pi, kr, omitted)
        _, value, _ = tail_moments(pi, vr, omitted)
        out.append((key, value, tail_log_mass(logits, omitted, q_win, pos, key, pad, scale)))
    return out


def visible_probabilities(
    q: torch.Tensor, k_cache: torch.Tensor, pad: torch.Tensor, t: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[B, Hq, S]`` fp32 full softmax attention of the decode query ``q [B, Hq, D]`` over its
    visible keys, by cache slot: real tokens ``0 .. t - 1`` (slots ``pad .. pad + t - 1``), 0 elsewhere
    (the oracle of ``telemetry.oracle`` and EarlySelectKV's fidelity; :func:`to_real` re-indexes it)."""
    heads, slots = q.shape[1], k_cache.shape[-2]
    k = k_cache.repeat_interleave(heads // k_cache.shape[1], dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k.float()) * scale
    real = torch.arange(slots, device=q.device)[None, :] - pad[:, None]
    visible = (real >= 0) & (real < t[:, None])
    return torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)


def grow_last(x: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    """``x`` padded with ``fill`` along the last axis to at least ``size`` entries."""
    extra = size - x.shape[-1]
    if extra <= 0:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], extra), fill)], dim=-1)


def _copy_dicts(held: dict) -> dict:
    """``held`` and the dicts among its values, copied (the other values shared)."""
    return {key: dict(value) if isinstance(value, dict) else value for key, value in held.items()}


class StatelessSelector:
    """A selector that keeps nothing between steps: prefills, beam reorders and resets are no-ops.
    Subclasses define ``select`` only."""

    CALL_STATE: tuple[str, ...] = ()

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """Nothing to remember."""

    def reorder(self, index: torch.Tensor) -> None:
        """Stateless."""

    def reset(self) -> None:
        """Stateless."""

    undo_period = None

    def mark_step(self) -> StepMark:
        """Nothing to keep (:class:`~prhs_hf.selectors.base.UndoesSteps`)."""
        return StepMark(None)

    def undo_to(self, mark: StepMark) -> None:
        """Nothing to put back."""


class TopKSelector(StatelessSelector):
    """A stateless selector whose every active row keeps, at every step, the ``topk`` middle tokens
    that :meth:`middle` ranks best, so every active row counts as retrieving (ρ̂ = 1). Subclasses
    define :meth:`middle` only."""

    def select(
        self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        geom: SequenceGeometry, params: DecodeParams, scale: float, ops: DecodeOps = REFERENCE_OPS,
    ) -> DecodeSelection:
        """``sink ∪ middle ∪ local`` for every active row; everything for the others (``ops`` unused)."""
        frame = step_frame(geom, params)
        rows = frame.rows(q.shape[1])
        middle = self.middle(q, k_cache, geom, frame, rows, params.topk, scale)
        return compose(frame, middle, params, retrieved=rows)

    def middle(
        self, q: torch.Tensor, k_cache: torch.Tensor, geom: SequenceGeometry, frame: StepFrame, rows: torch.Tensor,
        k: int, scale: float,
    ) -> torch.Tensor:
        """``[B, Hq, k]`` middle indices of ``rows`` (best first, ``-1`` padded; other rows ``-1``)."""
        raise NotImplementedError


class LayerStates:
    """Per-layer selector state: named ``[B, ...]`` tensors and a decode-step counter per layer.

    ``reorder`` follows beam search on every tensor's batch axis; ``reset`` forgets everything.
    Selectors that keep state subclass it (``self.state[layer]`` is a dict of tensors). A step
    replaces a state tensor, never writes one in place, so that a mark of the state
    (:meth:`mark_step`) is a copy of the dicts that hold them, not of the tensors.
    """

    CALL_STATE: tuple[str, ...] = ("state", "steps")

    def __init__(self) -> None:
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        self.steps: dict[int, int] = {}

    def begin_prompt(self, layer: int) -> None:
        """A prefill of ``layer``: its state starts over and the next decode step is step 0."""
        self.state.pop(layer, None)
        self.steps[layer] = 0

    def observe_prefill(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, geom: SequenceGeometry, scale: float
    ) -> None:
        """A new prompt: the layer's state is dropped and its decode steps count from 0 again
        (:meth:`begin_prompt`); a selector that learns from the prompt overrides this."""
        self.begin_prompt(layer)

    def layer_state(self, layer: int, batch: int, make) -> dict[str, torch.Tensor]:
        """``layer``'s state, rebuilt by ``make()`` when missing or of another batch size."""
        st = self.state.get(layer)
        if st is None or next(iter(st.values())).shape[0] != batch:
            st = self.state[layer] = make()
        return st

    def advance(self, layer: int) -> int:
        """The step number of this decode step of ``layer`` (from 0 after a prefill), then count it."""
        step = self.steps.get(layer, 0)
        self.steps[layer] = step + 1
        return step

    def reorder(self, index: torch.Tensor) -> None:
        """Follow beam search: batch row ``i`` becomes old row ``index[i]`` in every layer's state."""
        for layer, st in self.state.items():
            self.state[layer] = {name: x.index_select(0, index.to(x.device)) for name, x in st.items()}

    undo_period = None

    def mark_step(self) -> StepMark:
        """Every ``CALL_STATE`` dict copied, and each dict it holds (a layer's tensors): the tensors
        themselves are shared, as a step replaces them (:class:`~prhs_hf.selectors.base.UndoesSteps`)."""
        return StepMark({name: _copy_dicts(getattr(self, name)) for name in self.CALL_STATE})

    def undo_to(self, mark: StepMark) -> None:
        """Put every ``CALL_STATE`` dict back to ``mark``'s, in place (the same dict objects)."""
        for name, kept in mark.state.items():
            held = getattr(self, name)
            held.clear()
            held.update(_copy_dicts(kept))

    def reset(self) -> None:
        """Forget every layer's state and step counter."""
        self.state.clear()
        self.steps.clear()
