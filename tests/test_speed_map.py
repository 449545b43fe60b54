"""``prhs-hf bench`` (prhs_hf.evaluation.speed_map): the --quick map on the CPU, its
JSON and PNG, the memory skip, the deadline, --resume and the speedup arithmetic."""

from __future__ import annotations

import argparse

import importlib.util
import json
import math

import pytest
import torch
import transformers

from prhs_hf import cli
from prhs_hf.evaluation import speed_map as sm

GiB = 2**30


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls on a shared, loaded CPU run ~100x faster on one thread than on all of them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "speed_map.json"
    assert cli.main(["bench", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_quick_map_writes_the_json_the_table_and_the_png(tmp_path, capsys) -> None:
    data = _bench(tmp_path, "--quick")
    assert {"command", "gpu", "versions", "date", "rows"} <= set(data)
    assert data["command"].startswith("prhs-hf bench --model tiny-llama")
    assert {"torch", "transformers", "triton", "prhs_hf"} <= set(data["versions"])
    rows = data["rows"]
    # the dense baselines in transformers' loop (1) and in the PrHS configs' (8, as shipped)
    configs = [("sdpa", 1), ("sdpa_gqa", 1), ("sdpa", 8), ("sdpa_gqa", 8), (f"{cli.DEFAULT_CONFIG}/dense", 8),
               (cli.DEFAULT_CONFIG, 8), ("cis", 8)]
    assert len(rows) == 2 * 2 * 2 * len(configs)  # modes x B x L x (config, loop)
    assert {(r["mode"], r["batch"], r["length"], r["config"], r["stop_check_every"]) for r in rows} == {
        (m, b, n, c, e) for m in ("eager", "static") for b in (1, 2) for n in (64, 128) for c, e in configs}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ms_per_step"] > 0 and r["new_tokens"] == [2, 4] and r["prompt_len"] == r["length"]
        dense = sm.is_dense_baseline(r["config"])
        assert r["kind"] == ("dense" if dense else "prhs")
        # what the policy ran: sparse (the suite runs ``auto`` sparse on a CPU, tests/conftest.py); the dense
        # baselines have no such field
        assert r.get("decode_steps") == (None if dense else "sparse")
        assert sm.is_dense_baseline(r["fastest_dense"])
        ref = next(d for d in rows if d["config"] == r["fastest_dense"] and sm._key(d) == sm._key(r))
        assert r["speedup_vs_fastest_dense"] == pytest.approx(ref["ms_per_step"] / r["ms_per_step"])
        assert ref["stop_check_every"] == r["stop_check_every"]
        assert (r["loop_speedup"] is not None) == (r["config"] in sm.DENSE_CONFIGS and r["stop_check_every"] == 8)
    printed = capsys.readouterr().out
    assert "ms/step" in printed and "fastest dense" in printed
    png = tmp_path / "speed_map.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.is_file() and png.stat().st_size > 0
    else:
        assert not png.exists() and "matplotlib is not installed: speed_map.png not drawn" in printed


def test_speedup_is_against_the_faster_dense_of_the_same_cell_and_mode() -> None:
    def row(config, ms, mode="eager", batch=1, status="ok"):
        return {"model": "m", "prompts": "random ids", "mode": mode, "batch": batch, "length": 4096,
                "config": config, "status": status, **({"ms_per_step": ms} if status == "ok" else {})}

    rows = [row("sdpa", 20.0), row("sdpa_gqa", 10.0), row("cis", 4.0), row("cis_longbench", 12.5),
            row("sdpa", 8.0, mode="static"), row("sdpa_gqa", 16.0, mode="static"), row("cis", 4.0, mode="static"),
            row("cis", 1.0, batch=4), row("cis", None, batch=8, status="memory")]
    sm.add_speedups(rows)
    got = [(r["fastest_dense"], r["speedup_vs_fastest_dense"]) for r in rows]
    assert got == [("sdpa_gqa", 0.5), ("sdpa_gqa", 1.0), ("sdpa_gqa", 2.5), ("sdpa_gqa", 0.8),
                   ("sdpa", 1.0), ("sdpa", 0.5), ("sdpa", 2.0), (None, None), (None, None)]
    assert "2.50x" in sm.format_table(rows) and "memory" in sm.format_table(rows)


def test_a_config_forced_dense_is_a_dense_baseline() -> None:
    """PrHS's own dense path (a config forced dense, on the cache its eager step keeps) is a dense
    baseline a user can pick: where it is the fastest dense row, speedups are against it."""
    assert sm.is_dense_baseline("sdpa_gqa") and sm.is_dense_baseline("cis/dense+buffered")
    assert sm.is_dense_baseline("cis_longbench/dense")
    assert not any(sm.is_dense_baseline(c) for c in ("cis", "cis/sparse+graphs", "cis+buffered", "configs/x/dense.yaml"))
    rows = [{"model": "m", "prompts": "p", "mode": "eager", "batch": 1, "length": 4096, "config": c, "status": "ok",
             "ms_per_step": ms} for c, ms in (("sdpa_gqa", 30.0), ("cis/dense+buffered", 25.0), ("cis+graphs", 20.0))]
    sm.add_speedups(rows)
    assert [(r["fastest_dense"], r["speedup_vs_fastest_dense"]) for r in rows] == [
        ("cis/dense+buffered", 25.0 / 30.0), ("cis/dense+buffered", 1.0), ("cis/dense+buffered", 1.25)]
    assert [c for _, _, _, c, _ in sm.plan_cells([1], [4096], ["eager"], ["cis+graphs", "cis/dense+buffered", "sdpa"])] \
        == ["cis/dense+buffered", "sdpa", "cis+graphs"]


def test_a_prhs_row_is_against_the_dense_of_its_own_loop_and_the_loop_gain_is_a_column_apart() -> None:
    """Issue 52: the patched loop (the all-finished flag read every N steps) against transformers' (every
    step) is a gain of its own, not sparsity's. A PrHS row's speedup is against the fastest dense in its
    loop; each unpatched dense baseline runs in both loops, and its patched-loop row carries the loop's
    gain (``loop_speedup``)."""
    own = {"sdpa": 1, "sdpa_gqa": 1, "cis/dense": 8, "cis": 8, "cis_longbench": 4}
    assert sm.config_loops(list(own), own) == {"sdpa": [1, 4, 8], "sdpa_gqa": [1, 4, 8], "cis/dense": [4, 8],
                                               "cis": [8], "cis_longbench": [4]}
    assert sm.config_loops(["sdpa_gqa"], {"sdpa_gqa": 1}) == {"sdpa_gqa": [1]}  # no PrHS row: its own loop only
    assert sm.config_loops(["sdpa_gqa", "cis"], own, [8, 1]) == {"sdpa_gqa": [8, 1], "cis": [8, 1]}
    configs = ["cis", "sdpa_gqa", "cis/dense"]
    plan = sm.plan_cells([1], [4096], ["eager"], configs, sm.config_loops(configs, own))
    assert [(c, e) for *_, c, e in plan] == [("sdpa_gqa", 1), ("sdpa_gqa", 8), ("cis/dense", 8), ("cis", 8)]
    rows = [{"model": "m", "prompts": "p", "mode": "eager", "batch": 1, "length": 4096, "config": c,
             "stop_check_every": e, "status": "ok", "ms_per_step": ms}
            for c, e, ms in (("sdpa_gqa", 1, 10.0), ("sdpa_gqa", 8, 8.0), ("cis/dense", 8, 9.0), ("cis", 8, 4.0))]
    sm.add_speedups(rows)
    got = [(r["fastest_dense"], r["speedup_vs_fastest_dense"], r["loop_speedup"]) for r in rows]
    assert got == [("sdpa_gqa", 1.0, None), ("sdpa_gqa", 1.0, 1.25), ("sdpa_gqa", 8.0 / 9.0, None),
                   ("sdpa_gqa", 2.0, None)]  # cis: 2.0x in one loop, not 2.5x across two
    lines = sm.format_table(rows).splitlines()
    assert "loop gain" in lines[0] and "1.25x" in lines[3] and "2.00x" in lines[5]


def test_the_default_map_runs_the_dense_baselines_in_the_prhs_loop_too(tmp_path, monkeypatch) -> None:
    """By default the unpatched dense baseline runs as the unpatched model (transformers' loop) and,
    for the PrHS rows' loop, patched with a dense config: its own attention, the patched loop."""
    seen, select = [], sm._select

    def spy(model, name, telemetry, stop_check_every=None):
        select(model, name, telemetry, stop_check_every)
        runtime = getattr(model, "_prhs_runtime", None)
        seen.append((name, stop_check_every, model.config._attn_implementation,
                     None if runtime is None else runtime.resolved.config.generation.stop_check_every))

    monkeypatch.setattr(sm, "_select", spy)
    data = _bench(tmp_path, "--quick", "--modes", "eager", "--batches", "1", "--lengths", "64",
                  "--configs", "sdpa_gqa,cis")
    assert seen == [("sdpa_gqa", 1, "sdpa_gqa", None), ("sdpa_gqa", 8, "sdpa_gqa", 8), ("cis", 8, "prhs", 8)]
    cis = data["rows"][-1]
    assert (cis["config"], cis["fastest_dense"], cis["loop_speedup"]) == ("cis", "sdpa_gqa", None)
    assert cis["speedup_vs_fastest_dense"] == pytest.approx(data["rows"][1]["ms_per_step"] / cis["ms_per_step"])
    assert "transformers' loop (1)" in data["loops"] and "stop_check_every 1" in data["loop_speedup"]


def test_static_cells_leave_out_the_eager_step_entries_and_the_default_has_the_patched_dense() -> None:
    """A StaticCache has no eager step: NAME+buffered would repeat NAME's static row. The default
    --configs carries the patched dense path (NAME/dense: buffered K/V in eager cells), which a user
    can pick (an unpatched eager generate() copies the whole cache at every step)."""
    plan = sm.plan_cells([1], [4096], ["eager", "static"], ["sdpa_gqa", "cis/dense+buffered", "cis", "cis+graphs"])
    assert [(m, c) for m, _, _, c, _ in plan] == [
        ("eager", "sdpa_gqa"), ("eager", "cis/dense+buffered"), ("eager", "cis"), ("eager", "cis+graphs"),
        ("static", "sdpa_gqa"), ("static", "cis")]
    parser = argparse.ArgumentParser()
    sm.add_arguments(parser, "cis_longbench")
    configs = parser.parse_args([]).configs.split(",")
    assert "cis_longbench/dense" in configs and sm.is_dense_baseline("cis_longbench/dense")


def test_the_heat_map_is_named_after_its_json(tmp_path) -> None:
    """Each --out draws its own picture: a second map in the folder does not overwrite the first's."""
    rows = [{"model": "m", "prompts": "p", "mode": "eager", "batch": 1, "length": 64, "config": c, "status": "ok",
             "ms_per_step": ms, "stop_check_every": None} for c, ms in (("sdpa", 2.0), ("cis", 1.0))]
    sm.add_speedups(rows)
    for name in ("speed_map.json", "cells_h100.json"):
        (tmp_path / name).write_text(json.dumps({"rows": rows}))
        assert cli.main(["bench", "--replot", "--out", str(tmp_path / name)]) == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "speed_map.png").is_file() and (tmp_path / "cells_h100.png").is_file()


def test_memory_estimate_and_skip() -> None:
    cfg = transformers.LlamaConfig(**sm.SHAPES[sm.RANDOM_SHAPE])
    kw = dict(new_tokens=80, itemsize=2)
    need = sm.estimate_bytes(cfg, batch=4, length=4096, **kw)
    assert need == 2 * 32 * 8 * 128 * 4 * (4096 + 80) * 2 + 4 * 4096 * (3 * 14336 + 6 * 4096) * 2
    free = 123 * GiB  # an H200 with the 8B's weights loaded
    assert sm.fits(sm.estimate_bytes(cfg, batch=1, length=131072, **kw), free)
    assert sm.fits(sm.estimate_bytes(cfg, batch=16, length=16384, **kw), free)  # 65 GiB of 110.7
    assert not sm.fits(sm.estimate_bytes(cfg, batch=32, length=16384, **kw), free)  # 130 GiB
    assert not sm.fits(sm.estimate_bytes(cfg, batch=32, length=32768, **kw), free)
    assert not sm.fits(sm.estimate_bytes(cfg, batch=8, length=131072, **kw), free)
    assert sm.fits(int(0.9 * GiB), GiB) and not sm.fits(int(0.9 * GiB) + 1, GiB)
    assert sm.fits(10**15, None)  # free memory unknown (CPU): run


def test_cells_over_the_free_memory_are_skipped_not_run(tmp_path, capsys) -> None:
    rows = _bench(tmp_path, "--quick", "--modes", "eager", "--configs", "sdpa,cis", "--lengths", "64",
                  "--assume-free-gib", "1e-6")["rows"]
    assert [r["status"] for r in rows] == ["memory"] * 6  # sdpa in both loops, cis: 3 rows x 2 B
    assert all("ms_per_step" not in r and r["free_gib"] == 0.0 and r["estimate_gib"] >= 0 for r in rows)
    assert "mem" in capsys.readouterr().out or not importlib.util.find_spec("matplotlib")


def test_an_oom_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    measure = sm.measure

    def failing(target, mode, batch, length, config, args, *loop):
        if config == "cis":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return measure(target, mode, batch, length, config, args, *loop)

    monkeypatch.setattr(sm, "measure", failing)
    rows = _bench(tmp_path, "--quick", "--modes", "static", "--batches", "2", "--configs", "sdpa_gqa,cis")["rows"]
    assert [(r["length"], r["config"], r["stop_check_every"], r["status"]) for r in rows] == [
        (64, "sdpa_gqa", 1, "ok"), (64, "sdpa_gqa", 8, "ok"), (64, "cis", 8, "oom"),
        (128, "sdpa_gqa", 1, "ok"), (128, "sdpa_gqa", 8, "ok"), (128, "cis", 8, "oom")]
    assert "Tried to allocate" in rows[2]["error"] and rows[2]["speedup_vs_fastest_dense"] is None


def test_deadline_then_resume(tmp_path) -> None:
    ticks = iter([0.0, 5.0, 10.0])
    deadline = sm.Deadline(9.0, clock=lambda: next(ticks))
    assert not deadline.passed() and deadline.passed()
    assert not sm.Deadline(None).passed()

    first = _bench(tmp_path, "--quick", "--deadline-s", "0")
    # 2 modes x 7 (config, loop) x 2 B x 2 L: sdpa and sdpa_gqa in two loops
    assert len(first["rows"]) == 56 and {r["status"] for r in first["rows"]} == {"not run: deadline"}
    second = _bench(tmp_path, "--quick", "--resume", "--modes", "eager", "--batches", "1", "--lengths", "64",
                    "--configs", "sdpa,sdpa_gqa")
    ran = [r for r in second["rows"] if r["status"] != "not run: deadline"]
    assert [(r["mode"], r["batch"], r["length"], r["config"], r["status"]) for r in ran] == [
        ("eager", 1, 64, "sdpa", "ok"), ("eager", 1, 64, "sdpa_gqa", "ok")]
    assert len(second["rows"]) == 56  # the cells this run did not plan keep their "not run" rows
    assert len(second["commands"]) == 2 and "--deadline-s 0" in second["commands"][0]
    third = _bench(tmp_path, "--quick", "--resume", "--modes", "eager", "--batches", "1", "--lengths", "64",
                   "--configs", "sdpa,sdpa_gqa,cis")
    ran3 = {(r["config"], r["stop_check_every"]): r for r in third["rows"] if r["status"] == "ok"}
    assert sorted(ran3) == [("cis", 8), ("sdpa", 1), ("sdpa", 8), ("sdpa_gqa", 1), ("sdpa_gqa", 8)]
    assert len(third["rows"]) == 56
    assert ran3[("sdpa", 1)]["ms_per_step"] == ran[0]["ms_per_step"]  # kept, not measured again


def test_checkpoint_folder_and_its_position_limit(tmp_path) -> None:
    config = transformers.LlamaConfig(**{**sm.SHAPES[sm.QUICK_SHAPE_NAME], "max_position_embeddings": 100},
                                      pad_token_id=0, eos_token_id=None, bos_token_id=None)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    rows = _bench(tmp_path, "--model", str(tmp_path / "ckpt"), "--batches", "1", "--lengths", "64,98,128",
                  "--modes", "eager", "--configs", "sdpa_gqa", "--n1", "2", "--n2", "4")["rows"]
    assert [(r["length"], r["prompt_len"], r["status"]) for r in rows] == [(64, 64, "ok"), (98, 96, "ok"),
                                                                          (128, 0, "positions")]
    assert rows[0]["model"] == "ckpt" and rows[0]["weights"] == "real" and rows[0]["prompts"] == "random ids"


def test_checkpoint_with_real_text_prompts(tmp_path) -> None:
    from lm_eval_fixtures import save_tiny_checkpoint, write_local_data

    ckpt, data = save_tiny_checkpoint(tmp_path / "ckpt"), write_local_data(tmp_path / "data")
    argv = ["bench", "--model", str(ckpt), "--prompts", str(data / "coqa_validation.jsonl"), "--batches", "2",
            "--lengths", "96", "--modes", "eager", "--configs", "sdpa_gqa,cis", "--n1", "2", "--n2", "4"]
    args = cli.build_parser().parse_args(argv)
    sm._resolve(args)
    ids = sm.load_target(args, torch.device("cpu"), torch.float32).ids(2, 96)
    assert ids.shape == (2, 96) and not torch.equal(ids[0], ids[1])  # sequence b starts at record b
    rows = _bench(tmp_path, *argv[1:])["rows"]
    assert [(r["prompts"], r["weights"], r["config"], r["status"]) for r in rows] == [
        ("coqa_validation.jsonl", "real", c, "ok") for c in ("sdpa_gqa", "sdpa_gqa", "cis")]
    with pytest.raises(ValueError, match="--prompts"):
        sm._read_texts(data / "gsm8k_test.jsonl")  # question/answer records: no text field


def test_parse_and_help(capsys) -> None:
    assert sm.parse_lengths("4k, 8192,128k", "--lengths") == [4096, 8192, 131072]
    for bad in ("", "4x", "0", "-1"):
        with pytest.raises(ValueError, match="--lengths"):
            sm.parse_lengths(bad, "--lengths")
    assert cli.main(["bench", "--quick", "--n1", "4", "--n2", "4", "--out", "/nonexistent/x.json"]) == 1
    assert "1 <= N1 < N2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--help"])
    assert "prhs-hf bench --quick --out" in capsys.readouterr().out


def test_a_config_entry_can_force_the_policy() -> None:
    assert sm.prhs_config("cis/sparse") == ("cis", {"policy": {"decode": "sparse", "prefill": "sparse"}})
    assert sm.prhs_config("cis_longbench", telemetry=True) == ("cis_longbench", {"telemetry": {"enabled": True}})
    assert sm.prhs_config("configs/cis.yaml") == ("configs/cis.yaml", {})
    with pytest.raises(ValueError, match="the part after '/' is a policy"):
        sm.prhs_config("cis/fast")


def test_memory_estimate_covers_the_measured_dense_static_prefill() -> None:
    """The estimate counts the prefill's hidden-size rows besides the MLP's: the sdpa_gqa static cell
    B4 x 32k of the 32-layer 8B shape (bf16) peaked at 45.59 GiB allocated on an H100, of which 14.96
    GiB are the weights, so it needs 30.63 GiB beyond them (16.04 of KV cache); the MLP's three rows
    alone gave 26.54, under the need, and a cell at the edge of the free memory was run into an OOM."""
    cfg = transformers.LlamaConfig(**sm.SHAPES[sm.RANDOM_SHAPE])
    weights = sum(p.numel() for p in _meta_model(cfg).parameters()) * 2
    assert abs(weights / GiB - 14.96) < 0.01
    need = sm.estimate_bytes(cfg, batch=4, length=32768, new_tokens=80, itemsize=2)
    assert need >= 45.59 * GiB - weights


def _meta_model(cfg):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def test_a_chunked_prefill_needs_one_chunks_activation_and_runs(tmp_path) -> None:
    """--prefill-chunk: the estimate counts one chunk's MLP activation (B8/64k on the 8B fits), and the
    cells run through generate(prefill_chunk_size=...)."""
    cfg = transformers.LlamaConfig(**sm.SHAPES[sm.RANDOM_SHAPE])
    whole, chunked = (sm.estimate_bytes(cfg, batch=8, length=65536, new_tokens=80, itemsize=2, prefill_chunk=c)
                      for c in (None, 4096))
    per_token = (3 * 14336 + 6 * 4096) * 2
    assert whole - chunked == 8 * 65536 * per_token - 8 * 4096 * (per_token + 65536)  # a chunk's mask row: 64k bools
    data = _bench(tmp_path, "--quick", "--prefill-chunk", "32", "--modes", "eager", "--configs", "sdpa_gqa,cis")
    assert "--prefill-chunk 32" in data["command"]
    assert all(r["status"] == "ok" for r in data["rows"]) and len(data["rows"]) == 3 * 2 * 2


def test_a_cell_run_twice_shows_the_range_of_its_repeats() -> None:
    """Two runs of one cell write one text (their range) coloured by the median, not two texts over each other."""
    row = lambda s, status="ok": {"speedup_vs_fastest_dense": s, "status": status}  # noqa: E731
    value, text = sm.heat_cell([row(1.07), row(0.89)])
    assert text == "0.89–1.07" and value == pytest.approx(math.log2(0.98))
    assert sm.heat_cell([row(1.2)]) == (pytest.approx(math.log2(1.2)), "1.20")
    assert sm.heat_cell([row(1.201), row(1.199)])[1] == "1.20"
    assert sm.heat_cell([row(None, "oom")]) == (None, sm.SHORT["oom"])
    assert sm.heat_cell([row(None, "started: warm-up")]) == (None, "cut")  # a killed run's last row, not "?"


def test_repeats_time_a_row_several_times_and_keep_the_median(tmp_path, capsys) -> None:
    """--repeats R: R timed runs after one warm-up; ms/step is their median and every run is kept."""
    data = _bench(tmp_path, "--quick", "--batches", "1", "--lengths", "64", "--modes", "eager", "--configs", "sdpa_gqa,cis",
                  "--repeats", "3")
    assert "--repeats 3" in data["command"] and "median of 3" in data["timing"]
    for r in data["rows"]:
        assert len(r["ms_per_step_runs"]) == 3
        assert r["ms_per_step"] == pytest.approx(sorted(r["ms_per_step_runs"])[1], abs=1e-3)
    assert "ms_per_step_runs" not in _bench(tmp_path, "--quick", "--batches", "1", "--lengths", "64", "--modes", "eager",
                                            "--configs", "sdpa_gqa")["rows"][0]
    assert cli.main(["bench", "--quick", "--repeats", "0", "--out", str(tmp_path / "x.json")]) == 1
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_a_cell_in_progress_is_in_the_json(tmp_path, monkeypatch) -> None:
    """A run killed mid-cell (a device call's time limit) leaves its last row ``started: <phase>`` in --out."""
    out, seen = tmp_path / "map.json", []

    def fake_measure(target, mode, batch, length, config, args, every=None, phase=lambda name: None):
        for name in ("warm-up", "timing"):
            phase(name)
            seen.append(json.loads(out.read_text())["rows"][-1])
        return {"ms_per_step": 1.0}

    monkeypatch.setattr(sm, "measure", fake_measure)
    assert cli.main(["bench", "--quick", "--batches", "1", "--lengths", "64", "--modes", "eager", "--configs", "sdpa_gqa",
                     "--out", str(out)]) == 0
    assert [(r["config"], r["status"]) for r in seen] == [("sdpa_gqa", "started: warm-up"), ("sdpa_gqa", "started: timing")]
    assert all(r["elapsed_s"] >= 0 for r in seen)
    assert [r["status"] for r in json.loads(out.read_text())["rows"]] == ["ok"]
    assert "started: warm-up" not in sm.KEPT  # --resume runs such a row again


def test_table_shows_each_rows_warm_up_and_peak_and_full_config_names() -> None:
    """A static row's warm-up holds its compilation (the unpatched static baseline's took 392 s at B4/64k on
    the H100), so the table shows it, with the peak memory; configs such as ``cis_longbench/dense`` are
    not cut."""
    row = {"model": "m", "prompts": "random ids", "mode": "static", "batch": 4, "length": 65536,
           "config": "cis_longbench/dense", "status": "ok", "ms_per_step": 21.44, "warmup_s": 391.73,
           "peak_gib": 61.32, "fastest_dense": "cis_longbench/dense", "speedup_vs_fastest_dense": 1.0}
    head, _, line = sm.format_table([row]).splitlines()
    assert "warm-up s" in head and "peak GiB" in head
    assert line.count("cis_longbench/dense") == 2 and " 392 " in line and " 61.32 " in line


class _FakeAllocator:
    """torch.cuda's peak counters over a made-up allocation history."""

    def __init__(self):
        self.now = self.peak = self.reserved_peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)
        self.reserved_peak = max(self.reserved_peak, self.now + 1)

    def free(self, n: int) -> None:
        self.now -= n

    def max_memory_allocated(self, device):
        return self.peak

    def max_memory_reserved(self, device):
        return self.reserved_peak

    def reset_peak_memory_stats(self, device):
        self.peak = self.reserved_peak = self.now


def test_phase_peaks_split_each_run_at_its_first_token() -> None:
    """The prefill's peak and the decode steps' are read apart (the question behind a sparse row's peak
    above dense's: which phase), over every timed run, and neither run's decode leaks into the next
    run's prefill."""
    gib = 2**30
    fake = _FakeAllocator()
    fake.alloc(30 * gib), fake.free(30 * gib)  # the warm-up's peak, before the timed runs
    peaks = sm.PhasePeaks(fake, "cuda:0")
    fake.alloc(2 * gib)  # the weights and the cache
    for prefill, decode in ((10, 4), (8, 6)):
        peaks.run_starts()
        fake.alloc(prefill * gib), fake.free(prefill * gib)
        peaks.prefill_done()
        fake.alloc(decode * gib), fake.free(decode * gib)
    got = peaks.fields()
    assert got == {"peak_gib": 12.0, "peak_reserved_gib": 12.0, "prefill_peak_gib": 12.0, "decode_peak_gib": 8.0}
    assert sm.PhasePeaks(None, "cpu").fields() == {}
    whole = sm.PhasePeaks(fake, "cuda:0")  # --timing calls: no clock, no phases
    whole.run_starts()
    fake.alloc(gib), fake.free(gib)
    assert whole.fields() == {"peak_gib": 3.0, "peak_reserved_gib": 3.0}


def test_clock_marks_the_prefill_once_at_the_first_new_token() -> None:
    marks = []
    clock = sm._Clock((2, 4), lambda: None, lambda: marks.append(clock.calls))
    for _ in range(5):
        clock(None, "scores")
    assert marks == [1] and sorted(clock.stamps) == [2, 4]


def test_the_heat_map_marks_cells_with_no_row_not_run_and_says_which_steps_ran() -> None:
    """A panel per config over its group's (mode, B) rows and lengths; a cell no row measured reads
    "not run" (not an empty square); a measured one its speedup and the steps the policy ran."""
    def row(mode, batch, length, config, speedup, steps=None, status="ok"):
        return {"model": "m", "prompts": "random ids", "mode": mode, "batch": batch, "length": length, "config": config,
                "status": status, "speedup_vs_fastest_dense": speedup, "decode_steps": steps}
    rows = [row("static", 32, 16384, "cis", 1.58, "sparse"), row("static", 1, 30720, "cis", 1.17, "dense"),
            row("static", 1, 30720, "sdpa_gqa", 1.0), row("eager", 1, 30720, "cis", None, status="not run: the call ended")]
    title, panels = sm.heat_panels(rows, ["cis"])
    assert title == "m" and len(panels) == 1
    cis = panels[0]
    assert (cis.title, cis.row_labels, cis.column_labels) == ("cis", ["static · B32", "static · B1", "eager · B1"], ["16k", "30k"])
    assert cis.texts == [["1.58×\nsparse steps", "not run"], ["not run", "1.17×\ndense steps"], ["not run", "not run"]]
    assert cis.values[0][0] == pytest.approx(math.log2(1.58)) and cis.values[2] == [None, None]
    with pytest.raises(ValueError, match="no row of config cis_longbench"):
        sm.heat_panels(rows, ["cis_longbench"])


def test_the_heat_maps_colour_scale_is_fixed_around_one() -> None:
    """Two maps compare at a glance: the scale is 0.5x-2x whatever the data, centred on 1x."""
    assert sm.HEAT_RANGE == (0.5, 2.0)


def test_the_heat_maps_titles_do_not_overlap(tmp_path, monkeypatch) -> None:
    """Panel titles (a config each) and the figure's title (the model, once) never overlap."""
    plt = pytest.importorskip("matplotlib.pyplot")
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault("fig", fig))
    rows = [{"model": "qwen2.5-coder-1.5b", "prompts": "coqa_validation.jsonl.gz", "mode": mode, "batch": 1,
             "length": 30720, "config": config, "status": "ok", "speedup_vs_fastest_dense": 1.0}
            for mode in ("eager", "static") for config in ("sdpa_gqa", "cis_longbench/dense", "cis_longbench", "cis")]
    assert sm.draw_heatmap(rows, tmp_path / "map.png") is None
    fig = drawn["fig"]
    renderer = fig.canvas.get_renderer()
    boxes = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
    boxes.append(fig._suptitle.get_window_extent(renderer))
    assert len(boxes) == 5
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1:]), [str(b) for b in boxes]
