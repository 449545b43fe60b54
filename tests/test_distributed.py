"""PrHS when a model is split: transformers tensor parallelism (two gloo processes on the CPU,
two NCCL ranks on GPUs) and accelerate ``device_map`` (offload hooks on the CPU, two GPUs).

Under tensor parallelism each rank runs its own share of the heads (``tp_plan="auto"`` shards
q/k/v colwise by heads): its CIS state, anchors and telemetry are its own, and
``telemetry(model, reduce=True)`` (a collective) gives the single-process figures.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import transformers

import prhs_hf
from prhs_hf.geometry import SequenceGeometry
from tiny_models import padded_batch, tiny_model

HERE = Path(__file__).resolve().parent
# small budgets so that selection matters (a section left out is off: psaw/etf are spelt out)
BASE = {"budget": {"sink": 4, "local": 8, "topk": 16}, "cis": {"block_size": 4}, "telemetry": {"enabled": True}}
CONFIGS = {
    "cis": {**BASE, "psaw": {"enabled": False}, "etf": {"enabled": False}},
    "cpe": {**BASE, "psaw": {"enabled": True}, "etf": {"enabled": True}},
}
LENGTHS = [70, 45]
NEW_TOKENS = 10
TP = 2


def _backends(device: str) -> dict:
    kind = "torch" if device == "cpu" else "auto"
    return {"backend": {"prefill": kind, "decode": kind}}


def _generate(model, config: dict, device: str, reduce: bool = False) -> tuple[list, dict]:
    ids, mask = padded_batch(LENGTHS, device=device)
    with prhs_hf.patch(model, {**config, **_backends(device)}) as handle:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        report = prhs_hf.telemetry(model, reduce=reduce).as_dict()
    del handle
    return out[:, -NEW_TOKENS:].tolist(), report


def _save_tiny(folder: Path, **kwargs) -> str:
    if not (folder / "config.json").exists():
        tiny_model("llama", **kwargs).save_pretrained(folder)
    return str(folder)


def _load(path: str, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32, **kwargs).eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the ranks' work


def _tp_worker(rank: int, world: int, port: int, device: str, paths: dict, out_dir: str) -> None:
    """One tensor-parallel rank: generate with each config, report telemetry local and reduced;
    the results go to ``out_dir/rank{rank}.json`` (an exception's text too)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(HERE))
    result: dict = {}
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world)
        dist = transformers.distributed.DistributedConfig(tp_size=world, tp_plan="auto")
        model = _load(paths["gqa"], distributed_config=dist)
        dev = "cpu" if device == "cpu" else f"cuda:{rank}"
        result["local_q_rows"] = model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]
        for name, config in CONFIGS.items():
            tokens, reduced = _generate(model, config, dev, reduce=True)
            _, local = _generate(model, config, dev, reduce=False)
            result[name] = {"tokens": tokens, "reduced": reduced, "local": local}
        # the limit: the tp size must divide the KV heads (a rank cannot hold half a KV head)
        narrow = _load(paths["mqa"], distributed_config=dist)
        try:
            prhs_hf.patch(narrow, CONFIGS["cis"])
            result["mqa_error"] = None
        except ValueError as e:
            result["mqa_error"] = str(e)
    except Exception as e:  # reported to the test, which fails with it
        import traceback

        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_tp(device: str, tmp: Path) -> list[dict]:
    paths = {"gqa": _save_tiny(tmp / "gqa"), "mqa": _save_tiny(tmp / "mqa", kv_heads=1)}
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, TP, port, device, paths, str(tmp))) for r in range(TP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(TP):
        f = tmp / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
        results.append(json.loads(f.read_text()))
        assert "error" not in results[-1], f"rank {r}: {results[-1]['error']}"
    return results


def _single(device: str, tmp: Path) -> dict:
    model = _load(_save_tiny(tmp / "gqa")).to(device)
    return {name: dict(zip(("tokens", "report"), _generate(model, config, device))) for name, config in CONFIGS.items()}


def _check_tp(results: list[dict], single: dict) -> None:
    heads = 4  # tiny_model's query heads, 2 KV heads: each of the 2 ranks holds 2 and 1
    for rank, result in enumerate(results):
        assert result["local_q_rows"] == 64 // TP, "the model is not sharded"
        for name in CONFIGS:
            ref = single[name]
            got = result[name]
            assert got["tokens"] == ref["tokens"], f"rank {rank}, {name}: tokens differ from the single process"
            assert ref["report"]["sparse_sequence_steps"] > 0, f"{name}: the budget does not make selection matter"
            assert got["reduced"] == ref["report"], f"rank {rank}, {name}: reduced telemetry"
            local = got["local"]
            if ref["report"]["per_head_retrievals"]:  # each rank counts its own heads, in the global head order
                own = [row[rank * heads // TP : (rank + 1) * heads // TP] for row in ref["report"]["per_head_retrievals"]]
                assert local["per_head_retrievals"] == own
            assert local["decode_steps"] == ref["report"]["decode_steps"]
        assert result["mqa_error"] is not None and "num_key_value_heads" in result["mqa_error"]


@pytest.fixture(scope="module")
def cpu_tp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_cpu")
    return _run_tp("cpu", tmp), _single("cpu", tmp)


@pytest.mark.slow
def test_tensor_parallel_gloo_tokens_and_reduced_telemetry_equal_one_process(cpu_tp):
    """Two gloo ranks (tp_plan auto, 2 of 4 query heads and 1 of 2 KV heads each): cis and cpe give
    the single process's greedy tokens; telemetry reduced across the ranks equals its telemetry;
    unreduced, each rank reports its own heads; a model with fewer KV heads than ranks is refused."""
    _check_tp(*cpu_tp)


# ---------------------------------------------------------------------- device_map on the CPU


def _offload_map(layers: int) -> dict:
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    for i in range(layers):  # every other layer's weights live on disk, moved in by accelerate's hooks
        device_map[f"model.layers.{i}"] = "disk" if i % 2 else "cpu"
    return device_map


@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_map_with_disk_offload_equals_the_plain_model(name, tmp_path):
    """accelerate's AlignDevicesHook moving weights in per layer: same tokens and telemetry as the
    model without hooks (the pre-hooks and ETF's row skipping compose with accelerate's hooks)."""
    path = _save_tiny(tmp_path / "m")
    plain = _load(path)
    ref_tokens, ref_report = _generate(plain, CONFIGS[name], "cpu")
    split = _load(path, device_map=_offload_map(4), offload_folder=str(tmp_path / "offload"))
    assert hasattr(split.model.layers[1], "_hf_hook") and split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    tokens, report = _generate(split, CONFIGS[name], "cpu")
    assert ref_report["sparse_sequence_steps"] > 0
    assert tokens == ref_tokens
    assert report == ref_report
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # unpatched: the hooks still offload


def test_geometry_moves_only_to_a_different_device():
    """The forward's geometry lives on the first layer's device; a layer elsewhere gets a copy."""
    model = tiny_model("llama")
    with prhs_hf.patch(model, CONFIGS["cis"]):
        runtime = model._prhs_runtime
        ids, mask = padded_batch([20, 12])
        with torch.no_grad():
            model(ids, attention_mask=mask)
        here = runtime.context.geometry_on(torch.device("cpu"))
        assert here is runtime.context.geometry
        there = runtime.context.geometry_on(torch.device("meta"))
        assert isinstance(there, SequenceGeometry) and there.pad.device.type == "meta" and there.t_last.shape == (2,)


# ---------------------------------------------------------------------- two GPUs

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nvidia-h200-x2)")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.slow
@two_gpus
def test_tensor_parallel_nccl_two_gpus(tmp_path):
    """TP 2 over NCCL with the Triton backends: the single GPU's tokens and telemetry."""
    _check_tp(_run_tp("cuda", tmp_path), _single("cuda:0", tmp_path))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("name", list(CONFIGS))
@two_gpus
def test_device_map_across_two_gpus(name, tmp_path):
    """Layers 0-1 on cuda:0, 2-3 on cuda:1: each layer's state, backends and geometry follow its
    device, the telemetry gathers on the first one; the single GPU's tokens and telemetry."""
    path = _save_tiny(tmp_path / "m")
    ref_tokens, ref_report = _generate(_load(path).to("cuda:0"), CONFIGS[name], "cuda:0")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    split = _load(path, device_map=device_map)
    tokens, report = _generate(split, CONFIGS[name], "cuda:0")
    assert tokens == ref_tokens
    assert report == ref_report
