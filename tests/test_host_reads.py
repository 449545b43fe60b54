"""Device->host reads per decode step of a patched ``generate()`` (scripts/probe_host_reads.py's
recorder as the counter): none between the periodic stop checks of ``generation.stop_check_every``,
eager (DynamicCache) and compiled (StaticCache); the decode-step layout error still raised; the
speed map's loop flag."""

from __future__ import annotations

import json

import pytest
import torch

import prhs_hf
from prhs_hf import cli
from prhs_hf.evaluation import speed_map as sm
from script_loader import load_script
from tiny_models import padded_batch, tiny_model

probe = load_script("probe_host_reads")
BACKENDS = {"backend": {"prefill": "torch", "decode": "torch"}}
NEW = 12


def _recorded_generate(model, new: int = NEW, **kw) -> "tuple[probe.HostReadRecorder, torch.Tensor]":
    """Record a greedy generate() of a left-padded batch (a padded batch: its masks are built each step):
    ``(the recorder, the tokens)``."""
    ids, mask = padded_batch([150, 141])
    recorder = probe.HostReadRecorder()
    with torch.no_grad(), recorder, recorder.watch(model):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, **kw)
    assert out.shape[1] == ids.shape[1] + new and recorder.step == new
    return recorder, out


def _reads(model, every: int, new: int = NEW, **kw) -> "probe.HostReadRecorder":
    return _recorded_generate(model, new, **kw)[0]


@pytest.mark.parametrize("config", ["cis_longbench", "cis", "dense"])
def test_a_patched_eager_decode_step_reads_the_device_zero_times(config):
    """Between stop checks (here: none before the end) an eager decode step reads nothing; the one read
    of the decode steps is the padding of their masks, at the first. The check at every step (the loop
    before) reads the stop flag, the mask's padding and, patched sparse, the layout check at each step."""
    model = tiny_model("llama", layers=2)
    if config == "dense":
        model.set_attn_implementation("sdpa_gqa")  # the fastest dense, in the patched loop
    prhs_hf.patch(model, config, overrides={**BACKENDS, "generation": {"stop_check_every": 1024}})
    loop = _reads(model, 1024)
    prhs_hf.patch(model, config, overrides={**BACKENDS, "generation": {"stop_check_every": 1}})
    plain = _reads(model, 1)
    prhs_hf.unpatch(model)
    assert loop.per_step(3, NEW - 1)["reads"] == 0, loop.per_step(3, NEW - 1)["sites"]
    first = loop.phase({2})
    assert sum(first.values()) == 1 and "prhs_hf/attention.py" in next(iter(first)), first
    before = plain.per_step(2, NEW - 1)
    sites = " ".join(before["sites"])
    assert before["reads_per_step"] >= 2 and "generation/utils.py" in sites and "masking_utils.py" in sites
    assert ("prhs_hf/geometry.py" in sites) == (config != "dense")


@pytest.mark.parametrize("index", ["fp8", "pages"])
def test_an_eager_step_with_a_key_index_on_buffers_reads_the_device_zero_times(index):
    """``cis.index`` on a buffered cache (whose buffers hold more slots than tokens): each step's index
    update takes the new key's slot from the runtime's host count of the cached tokens, so the decode
    steps between stop checks read nothing, as on a plain cache; the tokens are the plain cache's."""
    model = tiny_model("llama", layers=2)
    cis = {"index": index, "rerank_margin": 8}  # a margin below the middle: the index decides, a wrong slot shows
    tokens = {}
    for step in ("plain", "buffered"):
        prhs_hf.patch(model, "cis", overrides={
            "backend": {**BACKENDS["backend"], "eager_step": step}, "cis": cis, "policy": {"decode": "sparse"},
            "budget": {"sink": 4, "local": 8, "topk": 16}, "generation": {"stop_check_every": 1024}})
        reads, tokens[step] = _recorded_generate(model)
        prhs_hf.unpatch(model)
        assert reads.per_step(3, NEW - 1)["reads"] == 0, (step, reads.per_step(3, NEW - 1)["sites"])
    assert torch.equal(tokens["plain"], tokens["buffered"])


def test_the_stop_flag_is_read_once_every_n_steps():
    """stop_check_every 4, 12 new tokens: the flag is read after steps 4 and 8 (and the final read at
    the host-known end), each read one transfer; nothing else in between."""
    model = tiny_model("llama", layers=2)
    prhs_hf.patch(model, "cis", overrides={**BACKENDS, "generation": {"stop_check_every": 4}})
    rec = _reads(model, 4)
    prhs_hf.unpatch(model)
    stop_reads = [k for k, _, site in rec.reads if "prhs_hf/patching.py" in site]
    assert stop_reads == [4, 8, NEW]
    assert rec.per_step(2, NEW)["reads"] == len(stop_reads) + 1  # + the mask's padding, once


@pytest.mark.slow
def test_a_compiled_static_decode_step_reads_the_device_zero_times():
    """``cache_implementation="static"`` with transformers' compiled decode step: no read between stop checks."""
    model = tiny_model("llama", layers=1)
    prhs_hf.patch(model, "cis", overrides={**BACKENDS, "generation": {"stop_check_every": 1024}})
    ids, mask = padded_batch([150, 141])
    row = probe.probe_generate(model, ids, mask, 8, "static_compile", None)
    prhs_hf.patch(model, "cis", overrides={**BACKENDS, "generation": {"stop_check_every": 1}})
    plain = probe.probe_generate(model, ids, mask, 8, "static_compile", None)
    prhs_hf.unpatch(model)
    assert row["reads"] == 0, row["sites"]
    assert plain["reads_per_step"] == 1 and "generation/utils.py" in next(iter(plain["sites"]))


@pytest.mark.parametrize("every", [1, 8])
def test_a_decode_step_after_a_gap_inside_generate_still_raises(every):
    """A decode mask with a hole inside sequence 1 from step 3 on: the layout error names it, at once
    with the check at every step, at the next stop check (step 8 here) in the periodic loop."""
    model = tiny_model("llama", layers=2)
    prhs_hf.patch(model, "cis", overrides={**BACKENDS, "budget": {"sink": 4, "local": 8, "topk": 16},
                                           "generation": {"stop_check_every": every}})
    update = model._update_model_kwargs_for_generation
    steps = []

    def punch(outputs, model_kwargs, *args, **kwargs):
        kwargs_out = update(outputs, model_kwargs, *args, **kwargs)
        steps.append(1)
        if len(steps) >= 3:
            kwargs_out["attention_mask"][1, 20:30] = 0
        return kwargs_out

    model._update_model_kwargs_for_generation = punch
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    ids, mask = padded_batch([60, 52])
    with pytest.raises(ValueError, match=r"contiguous run.*sequence\(s\) \[1\]"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    prhs_hf.unpatch(model)
    assert len(forwards) == (4 if every == 1 else 8)


def test_the_probe_writes_its_json(tmp_path):
    out = tmp_path / "probe.json"
    probe.main(["--paths", "eager", "--configs", "sdpa,cis,cis_index_fp8", "--new-tokens", "5", "--prompt", "40",
                "--stop-check-every", "default,1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["path"], r["config"], r["stop_check_every"]) for r in rows] == [
        ("eager", "sdpa", None), ("eager", "cis", 8), ("eager", "cis", 1), ("eager", "cis_index_fp8", 8),
        ("eager", "cis_index_fp8", 1)]
    assert rows[0]["reads_per_step"] == 2 and rows[2]["reads_per_step"] == 3 and rows[1]["reads_per_step"] < 1
    assert rows[3]["reads_per_step"] == rows[1]["reads_per_step"] and rows[4]["reads_per_step"] == 3
    assert all({"sites", "prefill_sites", "end_sites", "forwards"} <= set(r) for r in rows)


def test_the_speed_map_runs_each_loop_with_its_dense_baselines_in_it(tmp_path, monkeypatch, capsys):
    """``--stop-check-every 1,8``: every cell in both loops; with 8 the dense baselines are the model
    patched dense (their own attention) in the same loop; speedups compare rows of one loop."""
    seen = []
    select = sm._select

    def spy(model, name, telemetry, stop_check_every=None):
        select(model, name, telemetry, stop_check_every)
        runtime = getattr(model, prhs_hf.patching.RUNTIME_ATTRIBUTE, None)
        seen.append((name, stop_check_every, model.config._attn_implementation,
                     None if runtime is None else runtime.resolved.config.generation.stop_check_every))

    monkeypatch.setattr(sm, "_select", spy)
    out = tmp_path / "speed_map.json"
    assert cli.main(["bench", "--quick", "--modes", "eager", "--batches", "1", "--lengths", "64",
                     "--configs", "sdpa,sdpa_gqa,cis", "--stop-check-every", "1,8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "--stop-check-every 1,8" in data["command"]
    rows = data["rows"]
    assert sorted((r["config"], r["stop_check_every"]) for r in rows) == sorted(
        (c, n) for c in ("sdpa", "sdpa_gqa", "cis") for n in (1, 8))
    assert set(seen) == {("sdpa", 1, "sdpa", None), ("sdpa_gqa", 1, "sdpa_gqa", None), ("cis", 1, "prhs", 1),
                         ("sdpa", 8, "sdpa", 8), ("sdpa_gqa", 8, "sdpa_gqa", 8), ("cis", 8, "prhs", 8)}
    for r in rows:
        ref = next(d for d in rows if d["config"] == r["fastest_dense"] and sm._key(d) == sm._key(r))
        assert ref["stop_check_every"] == r["stop_check_every"]
    assert cli.main(["bench", "--quick", "--stop-check-every", "0", "--out", str(out)]) == 1
    assert "--stop-check-every: '0'; allowed a comma list of ints in [1, 1024]" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_sync_debug_mode_sees_no_synchronisation_between_stop_checks(tmp_path):
    """On a GPU: ``torch.cuda.set_sync_debug_mode("warn")`` counts every synchronisation, also those
    made in C++ that the Python recorder cannot see. Patched eager and compiled decode steps make none
    between stop checks (stop_check_every above the steps); transformers' loop makes at least one."""
    out = tmp_path / "probe_cuda.json"
    probe.main(["--device", "cuda", "--configs", "sdpa,cis_longbench,cis", "--stop-check-every", "1024,1",
                "--new-tokens", "10", "--out", str(out)])
    for r in json.loads(out.read_text())["rows"]:
        syncs = r["cuda_sync_warnings"]
        if r["stop_check_every"] == 1024:  # the one read of the decode steps: their masks' padding, at the first
            assert syncs["steady_syncs"] == 0 and r["steady_reads"] == 0 and syncs["syncs"] <= 1, r
        else:
            assert syncs["syncs_per_step"] >= 1, r


def test_beam_search_reorders_the_cis_state_without_reading_the_device():
    """Beam search reorders the cache at every step, and the CIS state with it (the cache's own
    ``reorder_cache``: ``runtime.FollowBatchEdit``): the reordering reads nothing on the host."""
    model = tiny_model("llama", layers=2)
    prhs_hf.patch(model, "cis", overrides={**BACKENDS, "budget": {"sink": 4, "local": 8, "topk": 16},
                                           "policy": {"decode": "sparse"}})
    recorder, _ = _recorded_generate(model, num_beams=2)
    sites = recorder.per_step(2, NEW - 1)["sites"]
    assert not [site for site in sites if site.startswith("prhs_hf/runtime.py")], sites
