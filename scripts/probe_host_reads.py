"""Probe: every device->host read that ``generate()`` makes per decode step, with its call site.

A host read (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``.nonzero()`` ...)
makes the host wait for the device: on a GPU the host can then no longer queue the next step's
launches while the current one runs. This machine may have no GPU, so :class:`HostReadRecorder`
wraps those ``torch.Tensor`` methods (and ``torch.nonzero`` / ``torch.equal``) in Python and records
the file:line outside torch that called each one, tagged with the forward it follows: forward 1 is
the prefill, forwards 2..N the decode steps; a read between forward ``k`` and ``k + 1`` (the stop
check after step ``k`` included) belongs to step ``k``. Reads that torch makes in C++ (a tensor
passed where an int is expected, ``x[bool_mask]``) are not seen by the wrappers: ``--device cuda``
also counts the warnings of ``torch.cuda.set_sync_debug_mode("warn")``, which see every one.
On the CPU every tensor lives on the host, so a read of a tensor that would stay on the host on a
GPU too is counted as well; the call sites say which.

Paths probed, on a tiny random llama (``tests/tiny_models.py`` shape, longer prompt):

- ``eager``: ``model.generate()`` with a DynamicCache, unpatched (``sdpa``, ``sdpa_gqa``: transformers'
  own loop) and patched with the shipped ``dense`` (the model's SDPA in the patched loop),
  ``cis_longbench`` and ``cis`` (``policy`` as shipped: ``auto``), and ``cis_index_fp8`` (:data:`VARIANTS`:
  ``cis`` with an fp8 key index on a buffered cache, whose capacity is not its token count);
- ``static_compile``: ``cache_implementation="static"`` with transformers' compiled decode step
  (``aot_eager`` on the CPU, inductor on CUDA).

Each path runs with the patch's default ``generation.stop_check_every`` and with ``1`` (plain
transformers' stop check at every step).

    python scripts/probe_host_reads.py --out docs/results/probe_host_reads.json
    python scripts/probe_host_reads.py --device cuda --out /root/out/probe_host_reads_cuda.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

import prhs_hf

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_SITE_ROOTS = [os.path.dirname(os.path.dirname(transformers.__file__)), os.path.dirname(os.path.dirname(prhs_hf.__file__))]

#: ``torch.Tensor`` methods that read a tensor's data on the host
TENSOR_READS = ("item", "__bool__", "tolist", "cpu", "numpy", "__int__", "__float__", "__index__", "nonzero", "equal")
#: ``torch`` functions that do
TORCH_READS = ("nonzero", "equal")


def _call_site() -> str:
    """``path:line`` of the innermost frame outside torch and this script (path relative to site-packages
    or the repository)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
            for root in _SITE_ROOTS:
                if path.startswith(root + os.sep):
                    path = os.path.relpath(path, root)
                    break
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostReadRecorder:
    """Context manager: while active, each host read of a tensor (:data:`TENSOR_READS`,
    :data:`TORCH_READS`) on ``device_type`` (``None``: any) made by this thread is recorded as
    ``(step, method, call site)``; :meth:`mark_forward` (or :meth:`watch`, a forward pre-hook on a
    model) advances ``step``. Reads made while tracing for ``torch.compile`` are not host reads and
    are skipped."""

    def __init__(self, device_type: str | None = None):
        self.device_type = device_type
        self.step = 0
        self.reads: list[tuple[int, str, str]] = []
        self._saved: list[tuple[object, str, object]] = []
        self._thread = threading.get_ident()
        self._busy = False

    def mark_forward(self) -> None:
        self.step += 1

    @contextmanager
    def watch(self, model: torch.nn.Module):
        """Count ``model``'s forwards (the top-level module: one per generate() step)."""
        handle = model.register_forward_pre_hook(lambda module, args: self.mark_forward())
        try:
            yield self
        finally:
            handle.remove()

    def _wrap(self, owner, name: str) -> None:
        own = name in owner.__dict__  # else inherited (torch._C.TensorBase): deleted again on exit
        original = getattr(owner, name)
        recorder = self

        def wrapper(*args, **kwargs):
            if not recorder._busy and not torch.compiler.is_compiling() and threading.get_ident() == recorder._thread:
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if tensor is not None and (recorder.device_type is None or tensor.device.type == recorder.device_type):
                    recorder._busy = True  # a read inside the recording is not the caller's
                    try:
                        recorder.reads.append((recorder.step, name, _call_site()))
                    finally:
                        recorder._busy = False
            return original(*args, **kwargs)

        self._saved.append((owner, name, original if own else None))
        setattr(owner, name, wrapper)

    def __enter__(self) -> "HostReadRecorder":
        for name in TENSOR_READS:
            self._wrap(torch.Tensor, name)
        for name in TORCH_READS:
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def per_step(self, first: int = 2, last: int | None = None) -> dict[str, object]:
        """The reads of the decode steps ``first..last`` (default: the last full step, the one
        before the final forward, whose interval ends with generate()'s own wrap-up):
        ``{"steps", "reads", "reads_per_step", "sites": {site: count}}``."""
        last = self.step - 1 if last is None else last
        steps = max(0, last - first + 1)
        chosen = [(m, s) for k, m, s in self.reads if first <= k <= last]
        sites = collections.Counter(f"{s} ({m})" for m, s in chosen)
        return {"steps": steps, "reads": len(chosen), "reads_per_step": len(chosen) / steps if steps else None,
                "sites": dict(sites.most_common())}

    def phase(self, steps) -> dict[str, int]:
        """``{site (method): count}`` of the reads made in ``steps`` (a container of step numbers)."""
        return dict(collections.Counter(f"{s} ({m})" for k, m, s in self.reads if k in steps).most_common())


class SyncWarningCounter:
    """``torch.cuda.set_sync_debug_mode("warn")`` for the block; each synchronisation warning is
    recorded as ``(step, "file:line")`` with the step of a :class:`HostReadRecorder`."""

    def __init__(self, recorder: HostReadRecorder):
        self.recorder = recorder
        self.syncs: list[tuple[int, str]] = []

    def __enter__(self) -> "SyncWarningCounter":
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                self.syncs.append((self.recorder.step, f"{filename}:{lineno}"))
            else:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)

    def per_step(self, first: int, last: int) -> dict[str, object]:
        chosen = [s for k, s in self.syncs if first <= k <= last]
        steps = max(0, last - first + 1)
        return {"syncs": len(chosen), "syncs_per_step": len(chosen) / steps if steps else None,
                "sites": dict(collections.Counter(chosen).most_common())}


def tiny_llama(device: str, dtype: torch.dtype, layers: int = 2) -> torch.nn.Module:
    """A small random llama (the tests' tiny shape) in eval mode, SDPA attention."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(device, dtype)


def _compile_config():
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=False, backend="aot_eager" if not torch.cuda.is_available() else "inductor",
                           mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def probe_generate(model, ids, mask, new_tokens: int, path: str, device_type: str | None,
                   count_cuda_syncs: bool = False, **generate_kwargs) -> dict[str, object]:
    """Run one ``model.generate()`` under a :class:`HostReadRecorder` and return its counts: over the
    decode steps 2..N-1 (``reads``, ``reads_per_step``, ``sites``), over steps 3..N-1
    (``steady_reads``: without the first decode step's one-off reads, ``first_decode_sites``), and
    the prefill's and the last step's sites (which include generate()'s wrap-up)."""
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, **generate_kwargs)
    if path == "static_compile":
        kwargs.update(cache_implementation="static", compile_config=_compile_config())
        with torch.no_grad():  # warm up: the compilation and its recompilations are not the steady state
            model.generate(ids, **kwargs)
    recorder = HostReadRecorder(device_type)
    syncs = None
    with torch.no_grad(), recorder, recorder.watch(model):
        if count_cuda_syncs:
            with SyncWarningCounter(recorder) as syncs:
                out = model.generate(ids, **kwargs)
        else:
            out = model.generate(ids, **kwargs)
    assert out.shape[1] == ids.shape[1] + new_tokens, "the probe needs every step to run"
    last = recorder.step - 1
    row = {"forwards": recorder.step, **recorder.per_step(2, last), "steady_reads": recorder.per_step(3, last)["reads"],
           "first_decode_sites": recorder.phase({2}), "prefill_sites": recorder.phase({0, 1}),
           "end_sites": recorder.phase({recorder.step})}
    if syncs is not None:
        row["cuda_sync_warnings"] = {**syncs.per_step(2, last), "steady_syncs": syncs.per_step(3, last)["syncs"]}
    return row


#: unpatched baselines: config name -> attention implementation (transformers' own loop)
UNPATCHED = {"sdpa": "sdpa", "sdpa_gqa": "sdpa_gqa"}

#: patched configs that are no shipped one: name -> (shipped config, overrides)
VARIANTS = {
    "cis_index_fp8": ("cis", {"cis": {"index": "fp8"}, "backend": {"eager_step": "buffered"}}),
}


def select(model, config: str, stop_check_every: int | None):
    """Put ``model`` in ``config``: an unpatched attention implementation (:data:`UNPATCHED`), or
    ``prhs_hf.patch`` with a shipped config (``dense``: the model's own SDPA in the patched loop) or a
    :data:`VARIANTS` one and ``generation.stop_check_every`` (``None``: the config's). Returns the
    patch handle or ``None``."""
    prhs_hf.unpatch(model)
    prhs_hf.attention.register()
    model.set_attn_implementation(UNPATCHED.get(config, "sdpa"))
    if config in UNPATCHED:
        return None
    base, overrides = VARIANTS.get(config, (config, {}))
    if stop_check_every is not None:
        overrides = {**overrides, "generation": {"stop_check_every": stop_check_every}}
    return prhs_hf.patch(model, base, overrides=overrides)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--configs", default="sdpa,sdpa_gqa,dense,cis_longbench,cis,cis_index_fp8",
                        help="comma-separated: sdpa, sdpa_gqa (unpatched), shipped configs (dense: the patched loop "
                             f"alone) or {', '.join(VARIANTS)}")
    parser.add_argument("--paths", default="eager,static_compile")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=160, help="prompt tokens (left-padded batch: the rows differ by 8)")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--stop-check-every", default="default,1",
                        help="comma-separated: 'default' (the config's generation.stop_check_every) and/or ints")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = tiny_llama(args.device, dtype)
    lengths = [args.prompt - 8 * i for i in range(args.batch)]
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, args.prompt - n:] = torch.randint(1, 128, (n,), generator=g)
        mask[i, args.prompt - n:] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    device_type = None if args.device == "cpu" else args.device
    rows = []
    for path in args.paths.split(","):
        for config in args.configs.split(","):
            loops = [None] if config in UNPATCHED else args.stop_check_every.split(",")
            for every in loops:
                handle = select(model, config, None if every in (None, "default") else int(every))
                try:
                    row = probe_generate(model, ids, mask, args.new_tokens, path, device_type,
                                         count_cuda_syncs=args.device == "cuda")
                finally:
                    prhs_hf.unpatch(model)
                used = None if handle is None else handle.config.generation.stop_check_every
                rows.append({"path": path, "config": config, "stop_check_every": used, **row})
                print(f"{path:15s} {config:14s} stop_check_every={used!s:5s} "
                      f"reads/step={row['reads_per_step']:.3f}", flush=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
