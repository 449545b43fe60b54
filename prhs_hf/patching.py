"""``patch(model, config)`` / ``unpatch(model)``: switch a Hugging Face model to PrHS and back.

Patching selects the ``"prhs"`` attention implementation (registered with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``), attaches a :class:`~prhs_hf.layer.PrHSLayer`
to every attention module, adds one forward pre-hook per decoder layer (the PSAW/ETF prefill
plan), wraps ``q_proj``/``o_proj``/``mlp`` of ETF layers so frozen rows are not computed, registers
the hooks a selector asks for (``selector.attach(layers, runtime)``: EarlySelectKV's taps), and
wraps the model's ``generate()`` in the sync-free decode loop (:func:`generate_without_step_reads`);
the state of a generation lives on its cache and follows the cache's batch edits and crops
(:class:`~prhs_hf.runtime.CallState`). Unpatching removes all of it and restores the original
attention implementation; patching twice replaces the first patch, and leaving the `with` block of the
second puts the first back (nested blocks nest).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import threading
import warnings
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation import utils as generation_utils

from . import attention
from .compat import assistant_generate_kwargs, cache_argument
from .config import PrHSConfig, load_config
from .families import check_model, decoder_layers
from .geometry import DeferredLayoutCheck, deferred_layout_checks, raise_if_broken
from .layer import install_row_skip
from .runtime import DENSE_RUNTIMES, BufferedLayer, PrHSRuntime, SelectorRollback, buffer_cache
from .selectors.base import undoes_steps
from .telemetry_counters import TelemetryReport

__all__ = ["PatchHandle", "PeriodicStopCheck", "patch", "unpatch", "is_patched", "telemetry", "reset", "local_heads",
           "generate_without_step_reads", "RUNTIME_ATTRIBUTE"]

SUPPORTED_CACHES = (DynamicCache, StaticCache)
RUNTIME_ATTRIBUTE = "_prhs_runtime"
"""The model attribute that holds the runtime :func:`patch` attaches (absent when unpatched)."""


class PatchHandle:
    """What :func:`patch` returns: the runtime, and a context manager that undoes the patch on exit.

    Leaving the ``with`` block removes this patch and, where it had replaced another one (nested
    ``with patch(...)`` blocks), puts that one back. The last run's telemetry stays readable on
    the handle after the block: ``handle.telemetry()``.
    """

    def __init__(self, model: nn.Module, runtime: PrHSRuntime, previous: PrHSRuntime | None = None):
        self.model = model
        self.runtime = runtime
        self.previous = previous

    @property
    def config(self) -> PrHSConfig:
        return self.runtime.resolved.config

    def telemetry(self, reduce: bool = False) -> TelemetryReport:
        """The statistics of this patch's runs (also after the ``with`` block); ``reduce``: as
        :func:`telemetry`."""
        return _report(self.runtime, reduce)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self.model, RUNTIME_ATTRIBUTE, None) is not self.runtime:
            return  # already unpatched or replaced by hand: leave the model as it is
        _uninstall(self.model)
        if self.previous is not None:
            _install(self.model, self.previous)


def _check_cache(cache: Any) -> None:
    if cache is not None and not isinstance(cache, SUPPORTED_CACHES):
        names = ", ".join(c.__name__ for c in SUPPORTED_CACHES)
        raise TypeError(f"PrHS supports the caches {names}; got {type(cache).__name__}")


def _check_attention(decoder_layer: nn.Module, runtime: PrHSRuntime) -> None:
    """Refuse a forward whose attention is no longer PrHS's (``set_attn_implementation`` after ``patch``)."""
    implementation = decoder_layer.self_attn.config._attn_implementation
    if not runtime.passthrough and implementation != attention.ATTENTION_NAME:
        raise ValueError(
            f"PrHS: the model's attention implementation was set to {implementation!r} after prhs_hf.patch(), "
            f"which needs {attention.ATTENTION_NAME!r}: unpatch (prhs_hf.unpatch), set the implementation, then "
            "patch again (the patch keeps the model's own 'sdpa' or 'eager' where it attends densely)")


def _make_pre_hook(layer, first: bool):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if first:
            _check_cache(cache_argument(kwargs))
            if not torch.compiler.is_compiling():
                _check_attention(module, layer.runtime)
            context = layer.runtime.begin_forward(hidden, kwargs)  # this forward's, made here once
        else:
            context = layer.runtime.context
        if layer.plans_prefill:
            layer.plan_prefill(context, hidden, _execution_device(module, hidden))

    return hook


def _take_forward_lock(runtime: PrHSRuntime):
    """Pre-hook and always-called forward hook of the decoder that hold ``runtime.forward_lock``
    for one eager forward (a compiled step runs neither: it continues the eager forward's state)."""

    def acquire(module, args):
        if not torch.compiler.is_compiling():
            runtime.forward_lock.acquire()

    def release(module, args, output):
        if not torch.compiler.is_compiling():
            runtime.forward_lock.release()

    return acquire, release


def _deepcopy_patched(model: nn.Module):
    """``copy.deepcopy`` of a patched model: a copy of the unpatched model, patched anew with the
    same config (its own runtime, state and telemetry; hooks are closures over the original's)."""

    def deepcopy_model(memo: dict) -> nn.Module:
        runtime = _uninstall(model)
        try:
            twin = copy.deepcopy(model, memo)
        finally:
            _install(model, runtime)
        patch(twin, runtime.resolved.config)
        return twin

    return deepcopy_model


def _reduce_patched(model: nn.Module):
    """``__reduce_ex__`` of a patched model (pickle, ``torch.save(model)``): a copy of the unpatched
    model (made while pickling: the model's memory once more, for that time), which loads patched
    anew with the same config, as :func:`_deepcopy_patched`'s copy (the hooks, closures, do not pickle)."""

    def reduce_model(protocol: int):
        runtime = _uninstall(model)
        try:
            plain = copy.deepcopy(model)
        finally:
            _install(model, runtime)
        return (_patched_model, (plain, runtime.resolved.config))

    return reduce_model


def _patched_model(model: nn.Module, config: PrHSConfig) -> nn.Module:
    """``model`` patched with ``config`` (an unpickled patched model: :func:`_reduce_patched`)."""
    patch(model, config)
    return model


# ------------------------------------------------------------------------------------ the generate() loop


def _rng_state(device: torch.device) -> torch.Tensor | None:
    """The default generator's state of ``device`` (a host copy: no device read), or ``None``."""
    if device.type == "cpu":
        return torch.get_rng_state()
    module = getattr(torch, device.type, None)
    getter = getattr(module, "get_rng_state", None)
    return None if getter is None else getter(device)


def _set_rng_state(device: torch.device, state: torch.Tensor | None) -> None:
    if state is None:
        return
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        getattr(torch, device.type).set_rng_state(state, device)


def _rollback_supported(cache: Any, runtime: PrHSRuntime | None = None) -> bool:
    """Whether the steps of a generation on ``cache`` can be undone exactly: :func:`_roll_back` undoes
    the cache's (none, or every layer a plain ``DynamicLayer`` or ``BufferedLayer`` (cropped) or
    ``StaticLayer`` (its end moved back, the slots zeroed)), and ``runtime``'s selector, if any,
    undoes its own (:class:`~prhs_hf.selectors.base.UndoesSteps`; :class:`~prhs_hf.runtime.SelectorRollback`)."""
    if runtime is not None and runtime.selector is not None and not undoes_steps(runtime.selector):
        return False
    return cache is None or all(type(layer) in (DynamicLayer, BufferedLayer, StaticLayer)
                                for layer in getattr(cache, "layers", [None]))


def _roll_back(cache: Any, steps: int, cached: int) -> None:
    """Remove the last ``steps`` of the ``cached`` tokens of ``cache`` (host ints: no device read)."""
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            if layer.is_initialized:  # as the slots were before those steps: zero, past the end
                layer.cumulative_length.sub_(steps)
                layer.keys[:, :, cached - steps:cached].zero_()
                layer.values[:, :, cached - steps:cached].zero_()
        else:
            layer.crop(-steps)


class PeriodicStopCheck(generation_utils.StopCheck):
    """transformers' stop check of greedy and sampling ``generate()`` that reads the device's
    "all sequences finished" flag once every ``every`` steps instead of at each one.

    Each step's flag stays on the device (with a host copy of the RNG state after its draw where
    ``draws``: a sampling generation, or a model in train mode, whose dropout draws; and a mark of
    the selector's state, ``rollback``); every ``every``-th step, wherever the next forward would not
    fit in a ``StaticCache``, and where the selector could not undo a step past the next one exactly
    (:meth:`SelectorRollback.mark`: CIS reads at the latest after a block's last step), one host read
    takes the flags together with the deferred layout checks (:class:`DeferredLayoutCheck`, whose
    error it raises) and the selector's step counters. The loop stops at the first read that finds
    a finished step, or where the host knows it ends (``max_length``: never later). :meth:`finish`
    reads what is left and undoes the steps after the first finished one: transformers drops their
    tokens, scores, logits, attentions and hidden states, and this check removes their cache entries,
    puts the selector's per-generation state and the RNG state back, so ``generate()`` returns, and
    leaves on its cache for a continuation, what the check at every step does.
    """

    def __init__(self, every: int, input_ids: torch.Tensor, max_length: int | None, cache: Any,
                 layout: DeferredLayoutCheck, rollback: SelectorRollback | None = None, draws: bool = True):
        super().__init__(None)
        self.every = every
        self.max_length = max_length
        self.cache = cache
        room = cache.get_max_length() if isinstance(cache, StaticCache) else None
        self.room = room if isinstance(room, int) and room > 0 else None
        self.layout = layout
        layout.active = True  # the prefill has run (checked at once): the decode steps defer
        self.device = input_ids.device
        self.flags: list[torch.Tensor] = []  # this window's "all finished" flags, on the device
        self.draws = draws
        self.rng: list[torch.Tensor | None] = []  # the RNG state after each of those steps (where it draws)
        self.rollback = rollback
        self.length = input_ids.shape[1]
        self.undo = 0
        self.stopped = False

    def __call__(self, unfinished_sequences: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
        self.flags.append(unfinished_sequences.max() == 0)
        if self.draws:
            self.rng.append(_rng_state(self.device))
        urgent = self.rollback is not None and self.rollback.mark()
        self.length = length
        if self.max_length is not None and length >= self.max_length:
            return True  # the host knows the loop ends here; finish() reads the flags
        if len(self.flags) >= self.every or urgent or (self.room is not None and length > self.room):
            return self._read()  # (the next forward writes slot length - 1: past a StaticCache's room it raises)
        return False

    def _read(self) -> bool:
        """One host read of the window's flags, the selector's step counters and the pending layout
        checks; whether a step finished."""
        n = len(self.flags)
        broken = self.layout.pending()
        counters = None if self.rollback is None else self.rollback.counters()
        k = 0 if counters is None else counters.shape[0]
        parts = ([torch.stack(self.flags)] if n else []) + ([counters.to(self.device)] if k else []) + (
            [broken] if broken is not None else [])
        values = torch.cat(parts).tolist() if parts else []  # (bool flags with int64 counters: ints)
        raise_if_broken(values[n + k:])
        finished, states = [bool(v) for v in values[:n]], self.rng
        self.flags, self.rng = [], []
        first = finished.index(True) if True in finished else None
        if self.rollback is not None:
            self.rollback.read(values[n:n + k], first)
        if first is None:
            return False
        self.undo = n - 1 - first
        if self.undo and self.draws:
            _set_rng_state(self.device, states[first])
        self.stopped = True
        return True

    def finish(self) -> int:
        if not self.stopped:
            self._read()
        self.layout.active = False
        if self.undo and self.cache is not None:
            _roll_back(self.cache, self.undo, self.length - 1)
        if self.rollback is not None:
            self.rollback.undo()
            if self.undo:
                self.rollback.call.cut(self.length - 1 - self.undo)
        return self.undo


class _LoopPlan:
    """What one patched ``generate()`` offers transformers' ``_sample``: a :class:`PeriodicStopCheck`."""

    def __init__(self, every: int, layout: DeferredLayoutCheck, runtime: PrHSRuntime, draws: bool):
        self.every = every
        self.layout = layout
        self.runtime = runtime
        self.draws = draws  # the generation's steps draw from the RNG (sampling, dropout)
        self.offered = False
        self.claimed = False


_PLAN: ContextVar[_LoopPlan | None] = ContextVar("prhs_generate_loop", default=None)
_DEFERRED_STOP_CHECK = getattr(generation_utils, "DeferredStopCheck", None)


if _DEFERRED_STOP_CHECK is not None:

    class _StopCheckSwitch(_DEFERRED_STOP_CHECK):
        """Stands for transformers' ``DeferredStopCheck`` (the name ``_sample`` looks up) while a
        patched ``generate()`` runs: the first ``_sample`` of that call (not an assistant's) whose
        steps can be undone exactly (the cache's and the selector's: :func:`_rollback_supported`)
        gets a :class:`PeriodicStopCheck`; every other caller, in any thread, gets transformers' own."""

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant) -> bool:
            plan = _PLAN.get()
            if (plan is not None and not plan.claimed and not is_assistant
                    and _rollback_supported(cache, plan.runtime)):
                plan.offered = True
                return True
            return _DEFERRED_STOP_CHECK.is_supported(device, cache, cache_is_returned, is_assistant)

        def __new__(cls, input_ids, max_length, cache, cache_is_returned, streamer=None):
            plan = _PLAN.get()
            if plan is not None and plan.offered and not plan.claimed:
                plan.claimed = True
                # (input_ids: the prompt, which the loop's first forward put in the cache)
                rollback = SelectorRollback.of(plan.runtime, cache, input_ids.shape[1])
                return PeriodicStopCheck(plan.every, input_ids, max_length, cache, plan.layout, rollback, plan.draws)
            return _DEFERRED_STOP_CHECK(input_ids, max_length, cache, cache_is_returned, streamer)


_SWITCH_LOCK = threading.Lock()
_switch_users = 0


@contextlib.contextmanager
def _stop_check_switch() -> Iterator[None]:
    """Put :class:`_StopCheckSwitch` in transformers' place for the block (counted across threads:
    the last block to leave puts transformers' class back)."""
    global _switch_users
    with _SWITCH_LOCK:
        if _switch_users == 0:
            generation_utils.DeferredStopCheck = _StopCheckSwitch
        _switch_users += 1
    try:
        yield
    finally:
        with _SWITCH_LOCK:
            _switch_users -= 1
            if _switch_users == 0 and generation_utils.DeferredStopCheck is _StopCheckSwitch:
                generation_utils.DeferredStopCheck = _DEFERRED_STOP_CHECK


def _synced_gpus(model: nn.Module, synced_gpus: bool | None) -> bool:
    """``generate()``'s ``synced_gpus`` as it will resolve it (DeepSpeed ZeRO-3 / FSDP over several ranks)."""
    if synced_gpus is not None:
        return bool(synced_gpus)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and torch.distributed.get_world_size() > 1


def generate_without_step_reads(model: nn.Module, runtime: PrHSRuntime, generate: Callable) -> Callable:
    """``generate`` (the model's ``generate()``) in the decode loop of ``generation.stop_check_every``;
    when it returns, the runtime lets go of the cache it filled and of the state on it
    (:meth:`PrHSRuntime.generate_ends`).

    With ``stop_check_every`` 1 it is ``generate`` itself. Otherwise, for any decoding mode but a
    ``custom_generate``: the decode steps' attention masks read the batch's padding once
    (:func:`prhs_hf.attention.decode_padding_read_once`; the ``prhs`` and ``sdpa_gqa`` masks, so not
    a dense config's model that keeps transformers' ``sdpa``), and greedy and sampling read the
    stop flag every N steps (:class:`PeriodicStopCheck`), with the decode steps' layout checks
    deferred to that read. Greedy and sampling check every step instead with a ``streamer`` (it
    needs each token on the host), under ``synced_gpus``, for an assistant model's own loop, with a
    cache whose steps cannot be undone exactly (sliding-window, quantized or offloaded layers), and
    with a selector that cannot undo its own (one without
    :class:`~prhs_hf.selectors.base.UndoesSteps`); beam search and assisted generation keep
    transformers' stop checks. In assisted decoding (:func:`_assisted`) the model attends densely, with
    a warning (:data:`ASSISTED_DENSE`): its verification forwards are not decode steps.
    """
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def generate_with_loop(*args, **kwargs):
        kwargs = assistant_generate_kwargs(kwargs)  # (transformers >= 5.18 calls an assistant without its mask)
        runtime.generate_starts()
        token = None
        try:
            given = signature.bind_partial(*args, **kwargs).arguments
            config = _generation_config(model, given)
            if not runtime.passthrough and _assisted(given, config):
                warnings.warn(ASSISTED_DENSE, stacklevel=2)
                token = DENSE_RUNTIMES.set(DENSE_RUNTIMES.get() | {runtime})
            return _generate_in_loop(given, config, *args, **kwargs)
        finally:
            if token is not None:
                DENSE_RUNTIMES.reset(token)
            runtime.generate_ends()  # the returned cache, and the state on it, are the caller's alone

    def _generate_in_loop(given, config, *args, **kwargs):
        every = runtime.resolved.config.generation.stop_check_every
        if every == 1 or given.get("custom_generate") is not None:
            return generate(*args, **kwargs)
        periodic = (_DEFERRED_STOP_CHECK is not None and given.get("streamer") is None
                    and not _synced_gpus(model, given.get("synced_gpus")))
        with contextlib.ExitStack() as stack:
            stack.enter_context(attention.decode_padding_read_once(model))
            layout = stack.enter_context(deferred_layout_checks())
            if periodic:
                stack.enter_context(_stop_check_switch())
            plan = _LoopPlan(every, layout, runtime, _draws(model, config)) if periodic else None
            token = _PLAN.set(plan)
            try:
                return generate(*args, **kwargs)
            finally:
                _PLAN.reset(token)

    return generate_with_loop


ASSISTED_DENSE = (
    "PrHS: assisted decoding (assistant_model, prompt_lookup_num_tokens, assistant_early_exit, use_mtp) runs this "
    "model's attention densely: its verification forwards check several tokens at once, which PrHS's sparse decode "
    "step does not; the tokens are those of the dense model")


def _generation_config(model: nn.Module, given: dict[str, Any]) -> Any:
    """The generation config of ``model.generate()`` called with ``given`` (its bound arguments), as
    transformers resolves it from the call's arguments, its ``generation_config`` and the model's."""
    config, _ = model._prepare_generation_config(given.get("generation_config"), **given.get("kwargs", {}))
    return config


def _assisted(given: dict[str, Any], config: Any) -> bool:
    """Whether ``model.generate()`` called with ``given`` (its bound arguments; ``config``, its generation
    config) decodes assisted (an assistant model, prompt lookup, early exit or MTP drafts), whose
    verification forwards the patched model runs densely (``runtime.DENSE_RUNTIMES``)."""
    from transformers.generation.configuration_utils import GenerationMode

    return config.get_generation_mode(given.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION


def _draws(model: nn.Module, config: Any) -> bool:
    """Whether the decode steps of a ``model.generate()`` of generation config ``config`` draw from the
    RNG: a sampling generation, or a model in train mode (dropout)."""
    return bool(config.do_sample) or model.training


def prefill_for_patch(runtime: PrHSRuntime, prefill: Callable) -> Callable:
    """``prefill`` (transformers' ``GenerationMixin._prefill``, which every decoding mode of
    ``generate()`` runs first) as a patched model needs it:

    - with a buffered eager step (``backend.eager_step`` other than ``plain``), a ``DynamicCache``'s
      buffers are made for the call's ``max_length`` before the prompt is written
      (:func:`~prhs_hf.runtime.buffer_cache`'s ``reserve``) where that is no more than the growth rule
      would allocate for the prompt (``max_length <= kv_growth x prompt tokens``: a long prompt and a
      short answer, the case where the cache's memory matters): no buffer then grows or overshoots
      within the call. A ``max_length`` far past the prompt (a short chat prompt, a large
      ``max_new_tokens``) is not reserved up front: the buffers grow with the tokens, as dense's cache;
    - a chunked prefill (``prefill_chunk_size``) with a compilable cache runs eagerly. transformers
      runs the chunks through the compiled forward too; a PrHS prefill sets up what the decode steps
      read (the geometry buffers, the selector's state, CIS's key index), and made inside a
      CUDA-graphed forward (``mode="reduce-overhead"``, transformers' default) those tensors would
      live in the graph's pool, where the next replay overwrites them ("accessing tensor output of
      CUDAGraphs that has been overwritten"). An unchunked prefill is always eager; the decode steps
      stay compiled;
    - on CUDA, a new prompt whose prefill would not fit in the free GPU memory beside its cache is
      prefilled in chunks (:func:`prefill_chunk_that_fits`) unless the call sets
      ``prefill_chunk_size`` itself: a long batched prompt runs instead of running out of memory.
    """

    @functools.wraps(prefill)
    def prefill_patched(input_ids, generation_config, model_kwargs, *args, **kwargs):
        growth, length = runtime.kv_growth, generation_config.max_length
        if growth is not None and length and length <= growth * input_ids.shape[-1]:
            buffer_cache(cache_argument(model_kwargs), growth, reserve=length)
        model = getattr(prefill, "__self__", None)  # the model (None: a _prefill replaced by a plain function)
        chunk = generation_config.prefill_chunk_size
        if chunk is None and isinstance(model, nn.Module):
            chunk = prefill_chunk_that_fits(model, input_ids, generation_config, model_kwargs)
        if chunk is not None and (chunk != generation_config.prefill_chunk_size or not generation_config.disable_compile):
            generation_config = copy.copy(generation_config)
            generation_config.prefill_chunk_size, generation_config.disable_compile = chunk, True
        return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)

    return prefill_patched


#: Prefill chunks are a power of two of at least this many tokens.
MIN_PREFILL_CHUNK = 1024
#: Share of the free GPU memory (less the cache) a prefill's activations may take.
PREFILL_MEMORY_SHARE = 0.8


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take (CUDA's free memory plus what PyTorch's allocator
    holds unused); None off CUDA, where nothing is measured."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def prefill_bytes_per_token(cfg: Any, itemsize: int, keys: int, masked: bool) -> int:
    """Peak activation bytes of one prompt token in a decoder layer's prefill for a model of text config
    ``cfg``: the MLP's gate, up and product rows (``3 x intermediate_size``), a few hidden-size rows, and
    with an attention mask the boolean mask row over the ``keys`` the token attends to, counted whether or
    not the batch is padded (generate() keeps the logits of the last token only)."""
    inter = max(int(getattr(cfg, name, 0) or 0) for name in ("intermediate_size", "moe_intermediate_size"))
    return itemsize * (3 * inter + 6 * int(cfg.hidden_size)) + (keys if masked else 0)


def kv_cache_bytes(cfg: Any, batch: int, slots: int, itemsize: int) -> int:
    """Bytes of the keys and values of ``slots`` tokens of ``batch`` sequences in every layer of a model
    of text config ``cfg`` (full attention, ``itemsize`` bytes per element)."""
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return batch * slots * cfg.num_hidden_layers * 2 * kv_heads * head_dim * itemsize


def prefill_chunk_that_fits(model: nn.Module, input_ids: torch.Tensor, generation_config: Any,
                            model_kwargs: Mapping[str, Any]) -> int | None:
    """Tokens per chunk for a prefill of ``input_ids`` whose activations would not fit in the free GPU
    memory left beside its KV cache (a power of two, at least :data:`MIN_PREFILL_CHUNK`); None where
    the whole prompt fits, off CUDA, and where transformers' chunked prefill does not apply (a prompt
    after cached tokens, ``inputs_embeds``)."""
    cache = cache_argument(model_kwargs)
    if cache is None or model_kwargs.get("inputs_embeds") is not None or cache.get_seq_length() > 0:
        return None
    free = free_device_bytes(input_ids.device)
    batch, tokens = input_ids.shape
    if free is None or tokens <= MIN_PREFILL_CHUNK:
        return None
    cfg = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    masked = model_kwargs.get("attention_mask") is not None  # padded or not: reading it would sync the device
    if not isinstance(cache, StaticCache):  # a StaticCache's memory is taken already
        free -= kv_cache_bytes(cfg, batch, max(tokens, int(generation_config.max_length or 0)), dtype.itemsize)
    budget = PREFILL_MEMORY_SHARE * free
    per_token = batch * prefill_bytes_per_token(cfg, dtype.itemsize, tokens, masked)
    if per_token * tokens <= budget:
        return None
    chunk = MIN_PREFILL_CHUNK
    while chunk * 2 < tokens and per_token * chunk * 2 <= budget:
        chunk *= 2
    return chunk


def _execution_device(module: nn.Module, hidden: torch.Tensor) -> torch.device:
    """Where ``module`` runs: the execution device of accelerate's hook (a ``device_map``; it moves
    the inputs only after the forward pre-hooks), else where its input is."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", (hook,)):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return hidden.device


def patch(
    model: nn.Module,
    config: "str | Path | Mapping[str, Any] | PrHSConfig | None" = None,
    overrides: Mapping[str, Any] | None = None,
) -> PatchHandle:
    """Make ``model`` run PrHS as ``config`` (a shipped config's name such as ``"cis"``, a YAML
    path, a dict or a :class:`PrHSConfig`) says.

    Supported: the families in :data:`prhs_hf.families.SUPPORTED_FAMILIES`, fp16/bf16/fp32,
    ``DynamicCache`` and ``StaticCache``, left padding; a returned cache's ``reorder_cache``,
    ``batch_select_indices``, ``batch_repeat_interleave`` and ``crop`` (its PrHS state follows them:
    :class:`~prhs_hf.runtime.CallState`). Assisted decoding attends densely, with a warning;
    ``output_attentions=True`` under a config that changes attention, and ``set_attn_implementation``
    after patching, raise. Patching a patched model replaces its
    patch (and a ``with`` block around the new one restores it on exit). The model's ``generate()``
    then runs the decode loop of ``generation.stop_check_every`` (:func:`generate_without_step_reads`:
    the device read every N steps, not at each; the same output). Returns a :class:`PatchHandle`
    (a context manager).
    """
    cfg = load_config(config, overrides)
    check_model(model)
    layers = decoder_layers(model)
    resolved = cfg.resolve(len(layers), max_positions=getattr(model.config, "max_position_embeddings", None))
    heads, kv_heads = local_heads(layers[0].self_attn, model.config)
    runtime = PrHSRuntime(resolved, heads, layers[0].self_attn.head_dim, kv_heads,
                          reduce_group=_tensor_parallel_group(model))
    previous = _uninstall(model)  # only now: a patch() that raises leaves the patch in force as it was
    _install(model, runtime)
    return PatchHandle(model, runtime, previous)


def local_heads(attn: nn.Module, config) -> tuple[int, int]:
    """``(query heads, KV heads)`` that the attention module ``attn`` computes in this process.

    Without tensor parallelism these are the config's; under transformers' tensor parallelism
    (``tp_plan="auto"``: ``q_proj``/``k_proj`` sharded colwise, by heads) a rank holds the share of
    the rows its local tensors have. Raises ``ValueError`` where a rank would hold part of a head
    (the tp size must divide ``num_key_value_heads``, and so ``num_attention_heads``).
    """
    counts = []
    for proj, key in ((attn.q_proj, "num_attention_heads"), (getattr(attn, "k_proj", None), "num_key_value_heads")):
        total = getattr(config, key, None) or config.num_attention_heads
        weight = getattr(proj, "weight", None)
        local = weight.to_local() if hasattr(weight, "to_local") else weight  # a DTensor under tensor parallelism
        if local is None or local.shape[0] == weight.shape[0]:
            counts.append(total)
            continue
        shards = weight.shape[0] // local.shape[0]
        if total % shards or weight.shape[0] % local.shape[0]:
            raise ValueError(
                f"PrHS under tensor parallelism needs whole heads on every rank: {key}={total} is not divisible by "
                f"the tensor parallel size {shards} (use a tp size that divides num_key_value_heads)"
            )
        counts.append(total // shards)
    return counts[0], counts[1]


def _tensor_parallel_group(model: nn.Module):
    """The process group of the model's tensor parallel ranks (``None`` without tensor parallelism)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or (getattr(model, "_tp_size", None) or 1) <= 1:
        return None
    return (mesh["tp"] if mesh.ndim > 1 else mesh).get_group()


@dataclasses.dataclass
class Installation:
    """What :func:`_install` put on a model for one runtime, which :func:`_uninstall` takes off again
    (the runtime keeps it: :meth:`~prhs_hf.runtime.PrHSRuntime.attach`)."""

    #: the model's attention implementation before the patch, put back on unpatch
    original_attn_implementation: str
    #: the module hooks' handles (the forward lock, the decoder layers' pre-hooks, ETF's row skipping,
    #: a selector's own)
    hooks: list = dataclasses.field(default_factory=list)
    #: a ``generate`` / ``_prefill`` that was set on the model instance before the patch, put back on unpatch
    own_generate: Callable | None = None
    own_prefill: Callable | None = None


def _install(model: nn.Module, runtime: PrHSRuntime) -> None:
    """Attach ``runtime`` to ``model``: attention function, pre-hooks, ETF row skipping, the generate() loop.
    (Beam search reorders the state with the cache: the cache's own ``reorder_cache``,
    :class:`~prhs_hf.runtime.FollowBatchEdit`.)"""
    attention.register()
    installed = Installation(model.config._attn_implementation)
    hooks = installed.hooks
    decoder = getattr(model, "model", model)
    acquire, release = _take_forward_lock(runtime)
    hooks.append(decoder.register_forward_pre_hook(acquire))
    hooks.append(decoder.register_forward_hook(release, always_call=True))
    for index, (decoder_layer, prhs_layer) in enumerate(zip(decoder_layers(model), runtime.layers)):
        decoder_layer.self_attn._prhs_layer = prhs_layer
        if index == 0 or prhs_layer.plans_prefill:  # the others' hook would do nothing
            hooks.append(
                decoder_layer.register_forward_pre_hook(_make_pre_hook(prhs_layer, index == 0), with_kwargs=True)
            )
        if prhs_layer.etf:
            for module in (decoder_layer.self_attn.q_proj, decoder_layer.self_attn.o_proj, decoder_layer.mlp):
                hooks.extend(install_row_skip(module, prhs_layer.active_rows))
    attach = getattr(runtime.selector, "attach", None)  # a selector with hooks of its own (EarlySelectKV's taps)
    if attach is not None:
        hooks.extend(attach(decoder_layers(model), runtime))
    if not runtime.passthrough:  # a config that changes nothing keeps the model's own attention (eager, flex…)
        model.set_attn_implementation(attention.ATTENTION_NAME)

    model.__deepcopy__ = _deepcopy_patched(model)  # copy.deepcopy looks it up on the instance
    model.__reduce_ex__ = _reduce_patched(model)  # and pickle
    installed.own_generate = model.__dict__.get("generate")  # a generate() set on the instance, put back on unpatch
    if hasattr(model, "generate"):
        model.generate = generate_without_step_reads(model, runtime, model.generate)
    installed.own_prefill = model.__dict__.get("_prefill")
    if hasattr(model, "_prefill"):
        model._prefill = prefill_for_patch(runtime, model._prefill)
    runtime.attach(installed)
    setattr(model, RUNTIME_ATTRIBUTE, runtime)


def _uninstall(model: nn.Module) -> PrHSRuntime | None:
    """Detach the runtime in force (returned; ``None`` if the model is not patched)."""
    runtime: PrHSRuntime | None = model.__dict__.pop(RUNTIME_ATTRIBUTE, None)
    if runtime is None:
        return None
    installed: Installation = runtime.detach()
    for hook in installed.hooks:
        hook.remove()
    for decoder_layer in decoder_layers(model):
        decoder_layer.self_attn.__dict__.pop("_prhs_layer", None)
    model.__dict__.pop("__deepcopy__", None)
    model.__dict__.pop("__reduce_ex__", None)
    model.__dict__.pop("generate", None)
    if installed.own_generate is not None:
        model.generate = installed.own_generate
    model.__dict__.pop("_prefill", None)
    if installed.own_prefill is not None:
        model._prefill = installed.own_prefill
    original = installed.original_attn_implementation
    if model.config._attn_implementation == attention.ATTENTION_NAME != original:
        model.set_attn_implementation(original)  # (not one the user set since)
    return runtime


def unpatch(model: nn.Module) -> None:
    """Remove PrHS from ``model`` exactly (all of it, whatever was patched before); a model that is
    not patched is left as it is."""
    _uninstall(model)


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in force on ``model``."""
    return getattr(model, RUNTIME_ATTRIBUTE, None) is not None


def _runtime(model: nn.Module) -> PrHSRuntime:
    runtime = getattr(model, RUNTIME_ATTRIBUTE, None)
    if runtime is None:
        raise ValueError("the model is not patched with PrHS (call prhs_hf.patch first)")
    return runtime


def telemetry(model: nn.Module, reduce: bool = False) -> TelemetryReport:
    """The statistics of a patched model since patching or :func:`reset` (config ``telemetry.enabled``).

    Under tensor parallelism each rank counts only its own heads; ``reduce=True`` combines the
    ranks' counters (a collective: every rank of the model's tensor parallel group must call it)
    into the figures of the whole model. Without tensor parallelism ``reduce`` changes nothing.
    """
    return _report(_runtime(model), reduce)


def _report(runtime: PrHSRuntime, reduce: bool = False) -> TelemetryReport:
    if runtime.telemetry is None:
        raise ValueError("telemetry is off: patch with telemetry: {enabled: true}")
    return runtime.telemetry.report(group=runtime.reduce_group if reduce else None)


def reset(model: nn.Module) -> None:
    """Forget the CIS anchors and the telemetry of a patched model."""
    _runtime(model).reset()
