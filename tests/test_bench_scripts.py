"""The benchmark scripts on the CPU: their --quick runs, the JSON they write, the fair dense baseline.

The decode benchmarks compare PrHS against the fastest of several dense baselines measured in
the same run; ``dense-gqa`` runs the model through ``_bench_common.fair_sdpa_attention`` (SDPA
with ``enable_gqa=True`` and the mask) and must stay one graph under ``torch.compile(fullgraph)``.
Run metadata and timing live in ``scripts/_bench_common.py`` only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig

from script_loader import load_script
from tiny_models import padded_batch, tiny_model

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _bench_common as common  # noqa: E402

META_FIELDS = ("command", "gpu", "versions", "date", "git_commit")
VERSION_FIELDS = ("python", "torch", "triton", "transformers", "flashinfer")
DENSE = ("transformers", "sdpa_gqa", "flash_packed", "flashinfer")


def _run_script(name: str, *args: str, timeout: int = 600) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PRHS_GIT_COMMIT": "test-commit"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _check_meta(meta: dict, script: str) -> None:
    for key in META_FIELDS:
        assert key in meta, key
    assert meta["command"].startswith(f"python scripts/{script}")
    assert meta["git_commit"] == "test-commit"
    for key in VERSION_FIELDS:
        assert meta["versions"].get(key), key
    assert meta["versions"]["torch"] == torch.__version__


# ----------------------------------------------------------------------------- the shared module


def test_metadata_and_timing_live_in_the_shared_module_only():
    """No benchmark keeps its own copy of the metadata or timing code."""
    for name in ("bench_decode_attention.py", "bench_e2e_decode.py", "bench_prefill.py"):
        src = (SCRIPTS / name).read_text()
        assert "import _bench_common as common" in src, name
        for copy in ("do_bench(", "get_device_name(", "datetime", "platform.", "statistics."):
            assert copy not in src, f"{name} still has its own {copy!r}"


def test_shared_timing_and_fastest():
    t = common.median_ms(lambda: torch.ones(64).sum(), torch.device("cpu"))
    assert t.method == "cpu" and t.ms > 0
    calls = []
    slow = common.median_ms(lambda: (calls.append(1), time.sleep(0.03)), torch.device("cpu"), rep_ms=20)
    assert len(calls) == 1 and slow.ms >= 30  # a call longer than rep_ms is timed once: its warm-up
    calls.clear()
    common.median_ms(lambda: calls.append(1), torch.device("cpu"), rep_ms=20, max_reps=5)
    assert len(calls) == 6  # fast calls: the warm-up, then max_reps
    assert common.time_calls(lambda: None, torch.device("cpu"), reps=2) >= 0
    assert common.fastest({"a": 2.0, "b": None, "c": 1.5}) == ("c", 1.5)
    assert common.fastest({"a": None}) == (None, None)
    assert common.package_version("no_such_module_xyz").startswith("not available: ModuleNotFoundError")


def test_run_metadata_fields(monkeypatch):
    monkeypatch.setenv("PRHS_GIT_COMMIT", "abc123")
    meta = common.run_metadata(torch.device("cpu"), ["--quick"], extra_field=1)
    for key in META_FIELDS:
        assert key in meta
    assert meta["git_commit"] == "abc123" and meta["extra_field"] == 1
    assert meta["command"].endswith("--quick")
    assert set(VERSION_FIELDS) <= set(meta["versions"])


def _gqa_inputs(B=2, Hq=4, Hkv=2, S=24, D=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., :5] = False  # left padding of row 0
    mask[1, ..., 20:] = False  # unfilled static-cache slots of row 1
    return q, k, v, mask, common.attention_stub(Hq, Hkv)


def test_fair_attention_equals_transformers_sdpa_without_repeat_kv(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_mod

    q, k, v, mask, stub = _gqa_inputs()
    want, _ = common.transformers_sdpa_attention(stub, q, k, v, mask, scaling=0.25)
    calls = []
    real = sdpa_mod.repeat_kv
    monkeypatch.setattr(sdpa_mod, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    got, _ = common.fair_sdpa_attention(stub, q, k, v, mask, scaling=0.25)
    assert not calls, "the fair baseline must not copy K/V per query head"
    common.transformers_sdpa_attention(stub, q, k, v, mask, scaling=0.25)
    # one query token: transformers 5.23 packs the query heads of a KV head (pack_gqa) instead of copying K/V;
    # 5.17 copies them (repeat_kv), which the fair baseline avoids
    assert bool(calls) != hasattr(sdpa_mod, "pack_gqa"), "repeat_kv at one query token exactly where there is no pack_gqa"
    assert got.shape == want.shape == (2, 1, 4, 16)
    torch.testing.assert_close(got, want)
    # several query tokens under a mask (a chunked prefill, a verification): every version copies K/V
    q2 = torch.randn(2, 4, 3, 16, generator=torch.Generator().manual_seed(1))
    calls.clear()
    want2, _ = common.transformers_sdpa_attention(stub, q2, k, v, mask, scaling=0.25)
    assert calls, "transformers' shipped path with a mask and several query tokens does repeat_kv"
    calls.clear()
    got2, _ = common.fair_sdpa_attention(stub, q2, k, v, mask, scaling=0.25)
    assert not calls
    torch.testing.assert_close(got2, want2)


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def test_dense_gqa_static_compiled_decode_is_one_graph_with_dense_tokens(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_mod

    model = tiny_model("llama")  # 4 query / 2 KV heads
    ids, mask = padded_batch([60, 44])

    def generate(compiled: bool):
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              compile_config=_compile_config(), disable_compile=not compiled)

    dense = generate(False)  # transformers' sdpa path
    model.set_attn_implementation(common.register_fair_attention())
    assert model.config._attn_implementation == common.FAIR_ATTENTION
    monkeypatch.setattr(sdpa_mod, "repeat_kv", lambda *a: pytest.fail("dense-gqa took the repeat_kv route"))
    eager = generate(False)
    torch._dynamo.reset()
    counters.clear()
    compiled = generate(True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(eager, dense)
    assert torch.equal(compiled, dense)


# ----------------------------------------------------------------------------- the scripts' --quick runs


@pytest.mark.slow
def test_bench_decode_attention_quick_cpu_json(tmp_path):
    _run_script("bench_decode_attention.py", "--quick", "--out", str(tmp_path))
    data = json.loads((tmp_path / "bench_decode_attention.json").read_text())
    assert (tmp_path / "bench_decode_attention.md").is_file()
    _check_meta(data, "bench_decode_attention.py")
    assert set(data["dense_columns"]) == {f"dense_{n}" for n in DENSE}
    assert data["dense_columns"]["dense_transformers"] == "dense (transformers sdpa, repeat_kv)"
    assert data["rows"], "no rows"
    for r in data["rows"]:
        errors = {k: v for k, v in r.items() if k.endswith("_error")}
        assert not errors, errors
        for key in ("B", "Hq", "Hkv", "D", "ctx", "budget", "sink", "local", "k", "cap", "cis16_ms", "cis8_ms",
                    "sparse_ms", "ref16_ms", "stage16_retrieval_ms", "cis16_target_met"):
            assert key in r, key
        times = {n: r[f"dense_{n}_ms"] for n in DENSE}
        assert times["transformers"] > 0 and times["sdpa_gqa"] > 0  # measured on the CPU too
        assert r["dense_flashinfer_status"].startswith(("measured", "not available"))
        name, ms = common.fastest(times)
        assert (r["fastest_dense"], r["fastest_dense_ms"]) == (name, ms)
        assert r["fastest_dense_label"] == common.DENSE_LABELS[name]
        assert math.isclose(r["cis16_speedup_vs_fastest_dense"], ms / r["cis16_ms"])
        assert math.isclose(r["cis16_target_ms"], ms / r["cis16_target_speedup"])
        assert r["dense_sdpa_gqa_max_abs_diff"] < 0.05  # bf16: the same attention as transformers'
        # the union attention: timed on the step's sets, the per-head output, and fewer K/V rows with GQA
        assert r["sparse_union_ms"] > 0 and r["sparse_union_max_abs_diff"] < 0.05
        assert 0 < r["union_fraction"] <= 1 and (r["union_fraction"] < 1 or r["Hq"] == r["Hkv"])
        for key in ("grouped_retrieval", "grouped_sparse"):
            status = r[f"{key}_status"]
            if status == "available":  # then it ran, gave the reference's answer, and was timed
                assert r[f"{key}_ms"] > 0
            else:
                assert status.startswith("not importable") and r[f"{key}_ms"] is None
        if r["grouped_retrieval_status"] == "available":
            assert r["grouped_retrieval_equal_to_reference"] is True
        # Double Sparsity: the step, its stages and its speedup, like the CIS columns
        assert r["ds_rank"] == 16 and r["ds_k"] == r["cap"] - r["sink"] - r["local"]
        assert r["ds_ms"] > 0 and r["ds_timing"] == "cpu"
        assert math.isclose(r["ds_speedup_vs_fastest_dense"], ms / r["ds_ms"])
        assert math.isclose(r["cis16_speedup_vs_ds"], r["ds_ms"] / r["cis16_ms"])
        for st in ("gather", "label_score", "select", "compose", "attention"):
            assert r[f"ds_stage_{st}_ms"] is not None, st
        assert r["ds_max_abs_diff"] < 0.05  # bf16: the dense PyTorch DS step's output
        assert 0.0 <= r["ds_topk_recall"] <= 1.0
        assert r["ds_avg_kv_per_head"] == r["cap"]  # every row fills its budget (sink + top-k + local)
        if r["grouped_sparse_status"] == "available":
            assert r["grouped_sparse_max_abs_diff"] < 0.05
        # the whole group-shared CIS step: ceil(B*Hkv/16) KV heads retrieve, the PyTorch ops' output
        assert r["retrieving_groups_s16"] == math.ceil(r["B"] * r["Hkv"] / 16)
        assert r["cis16_group_ms"] > 0 and r["cis16_group_max_abs_diff"] < 0.05
        assert math.isclose(r["cis16_group_speedup_vs_fastest_dense"], ms / r["cis16_group_ms"])
        # the fused dilated set + compose as the model path runs it, the two launches beside it, the record
        assert r["stage16_dilate_compose_ms"] > 0 and r["stage16_dilated_set_ms"] > 0 and r["stage16_compose_ms"] > 0
        assert r["stage16_record_ms"] > 0
        # the dilated set with each collect of the map path (MAP_COLLECT picks the model's)
        by_collect = r["stage16_dilated_ms_by_collect"]
        assert set(by_collect) == {"serial", "parallel"} and all(v > 0 for v in by_collect.values())
        assert r["stage16_map_collects_equal_to_step"] is True
        # the radix8 select by stage (its stop points) and by merge finish, at every shape; both give the step's top-k
        assert r["stage16_select_kernel"] == "tilemax" and r["stage16_merge_rank"] == "search"  # k 28 here
        assert list(r["stage16_select_ms_by_part"]) == ["passes", "collect", "block_sort", "merge"]
        assert set(r["stage16_merge_ms_by_rank"]) == {"search", "count"}
        assert r["stage16_merge_ms_by_rank"]["search"] == r["stage16_select_ms_by_part"]["merge"]
        assert r["stage16_merge_ranks_equal_to_step"] is True
    md = (tmp_path / "bench_decode_attention.md").read_text()
    assert "sparse union ms (union / sum)" in md and "DS step (r, top-k)" in md and "Double Sparsity step" in md and "CIS-16 group step" in md
    assert "dilated set by map collect (serial / parallel)" in md
    assert "radix8 select by stage (passes / collect / block sort / merge)" in md
    assert "radix8 merge by finish (search / count)" in md


def test_bench_decode_attention_retrieve_share(capsys):
    """--retrieve-share: the rows retrieving per step are that share of all rows (a real model's ρ̂),
    for the per-head and the group-shared anchors alike; outside (0, 1] it is refused, naming the option."""
    bench = load_script("bench_decode_attention")
    sh = bench.Shape(2, 4, 2, 32, 512)
    bud = bench.shape_budget(sh)
    x = bench.make_inputs(sh, bud, torch.device("cpu"), torch.float32)
    for grouped, rows in ((False, sh.B * sh.Hq), (True, sh.B * sh.Hkv)):
        for share, want in ((None, math.ceil(rows / 3)), (0.75, math.ceil(rows * 0.75))):  # s = 3
            aq, ac, ai, n_retrieve = bench.make_anchors(x, sh, bud, 3, torch.Generator().manual_seed(1),
                                                        grouped=grouped, share=share)
            assert n_retrieve == want, (grouped, share)
    with pytest.raises(SystemExit) as exc:  # in this process: the refusal comes before any kernel runs
        bench.main(["--retrieve-share", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--retrieve-share" in err and "(0, 1]" in err


def test_bench_decode_attention_shapes_take_a_config_budget(capsys):
    """--shapes B:ctx:Hq:Hkv[:BUDGET]: the budget of a config file (cis_longbench's 64/256/4096, m = k/3) or
    ctx/8; a malformed entry or an unknown budget is refused before any GPU work, naming the option."""
    bench = load_script("bench_decode_attention")
    lb, eighth = bench.parse_shapes("1:131072:32:8:cis_longbench.yaml, 4:65536:32:8")
    assert (lb.B, lb.ctx, lb.Hq, lb.Hkv, lb.D) == (1, 131072, 32, 8, 128)
    b = bench.shape_budget(lb)
    assert (b.sink, b.local, b.k, b.dil_m, b.cap) == (64, 256, 4096, 1365, 64 + 256 + 4096 + 2 * 1365)
    assert bench.shape_budget(eighth) == bench.budget(65536)
    for bad in ("1:1024:32", "1:1024:32:6", "1:x:32:8", "1:1024:32:8:nope.yaml"):
        with pytest.raises(ValueError, match="--shapes|Shape.budget"):
            bench.parse_shapes(bad)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "1:1024:32:6"])
    assert exc.value.code == 2 and "--shapes" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_e2e_decode_quick_cpu_json(tmp_path):
    _run_script("bench_e2e_decode.py", "--quick", "--modes", "eager", "--configs", "dense,dense-gqa,cis-s16",
                "--new-tokens", "6", "--profile-steps", "2", "--out", str(tmp_path))
    data = json.loads((tmp_path / "bench_e2e_decode.json").read_text())
    _check_meta(data, "bench_e2e_decode.py")
    assert set(data["dense_configs"]) == {"dense", "dense-gqa"}
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"dense", "dense-gqa", "cis-s16"}
    for r in rows.values():
        assert "error" not in r, r
        for key in ("shape", "batch", "prompt", "mode", "decode_tok_s", "ms_per_step", "prefill_s", "tokens",
                    "fastest_dense", "speedup_vs_fastest_dense", "speedup_vs_dense_transformers"):
            assert key in r, key
        assert r["tokens"] == 6
    fastest = max(("dense", "dense-gqa"), key=lambda c: rows[c]["decode_tok_s"])
    for r in rows.values():
        assert r["fastest_dense"] == fastest
        assert math.isclose(r["speedup_vs_fastest_dense"], r["decode_tok_s"] / rows[fastest]["decode_tok_s"])
    assert rows["cis-s16"]["rho_hat"] is not None and rows["cis-s16"]["rho_hat_run"] == "eager, telemetry on"
    # a KV group reads its keys when any of its query heads retrieves: at least ρ̂ of the groups, at most all
    assert rows["cis-s16"]["rho_hat"] <= rows["cis-s16"]["kv_group_rho_hat"] <= 1
    # the profiled steps (a CPU has no CUDA kernel events: the wall time is all "not kernels")
    b = rows["cis-s16"]["breakdown_ms_per_step"]
    assert b["all kernels"] == 0 and b["step (profiled)"] > 0 and rows["cis-s16"]["pipeline_kernels_per_step"] == {}
    assert "ρ̂ and processed KV: from the eager, telemetry on" in (tmp_path / "bench_e2e_decode.md").read_text()


def _profiled(config: str, ms: float, breakdown: dict, **extra) -> dict:
    return {"shape": "m", "batch": 2, "prompt": 100, "mode": "static", "config": config, "ms_per_step": ms,
            "fastest_dense": "dense-gqa", "breakdown_ms_per_step": breakdown, **extra}


def test_decode_bound_floor_from_the_dense_rows_parts(tmp_path, capsys):
    bound = load_script("decode_bound")
    dense = _profiled("dense-gqa", 10.0, {"dense attention": 6.0, "all kernels": 8.0,
                                          "linear (proj, MLP, head)": 1.5, "aten (copy, index, reduce)": 0.5})
    sparse = _profiled("cis", 8.0, {"all kernels": 5.0}, rho_hat=0.2, processed_kv=10.0, dense_kv=100.0,
                       pipeline_kernels_per_step={"_group_score_kernel": {"ms": 1.5}})
    report = {"dense_configs": ["dense-gqa"], "rows": [dense, sparse, _profiled("cis-x", 9.0, {})]}
    # host gap 2 + linear and aten 2 + K reads 0.2 × 6 / 2 + keys and values 10 / 100 × 6 = 4.6 + 0.6
    (row,) = bound.bounds([("r.json", report)])
    assert row["kv_group_share_from"] == "ρ̂ (lower bound)" and row["host_gap_ms"] == pytest.approx(2.0)
    assert row["floor_ms"] == pytest.approx(5.2) and row["bound"] == pytest.approx(10 / 5.2)
    assert row["bound_without_host_gap"] == pytest.approx(8 / 3.2) and row["score_k_share"] == pytest.approx(0.5)
    assert row["measured"] == pytest.approx(1.25)
    # the flag's share where the telemetry has none; the telemetry's where it has one
    assert bound.bounds([("r.json", report)], 0.5)[0]["floor_ms"] == pytest.approx(5.2 + 0.3 * 3)
    sparse["kv_group_rho_hat"] = 0.4
    assert bound.bounds([("r.json", report)], 0.5)[0]["kv_group_share_from"] == "telemetry"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert bound.main(["--results", str(path), "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["kv_group_share"] == 0.4
    assert "| r.json | m B2/100 | cis vs dense-gqa |" in (tmp_path / "b.md").read_text()
    path.write_text(json.dumps({"rows": [dense]}))
    with pytest.raises(SystemExit):
        bound.main(["--results", str(path), "--out", str(tmp_path / "b")])
    assert "no case has both a profiled dense row and a profiled sparse row" in capsys.readouterr().err
    del sparse["rho_hat"]  # a sparse row without telemetry: named, not a traceback
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit):
        bound.main(["--results", str(path), "--out", str(tmp_path / "b")])
    assert "r.json: cis has no ρ̂" in capsys.readouterr().err


def test_probe_kv_group_share_counts_groups_between_rho_and_independent_heads():
    probe = load_script("probe_kv_group_share")
    model = tiny_model("llama")  # 4 query / 2 KV heads
    ids = torch.randint(1, 128, (2, 120))
    row = probe.measure(model, ids, "cis", 12)
    assert row["heads_per_kv_head"] == 2 and row["decode_steps"] == 11
    assert 0 < row["rho_hat"] <= row["kv_group_share"] <= min(1.0, 2 * row["rho_hat"])
    assert row["independent_heads_share"] == pytest.approx(1 - (1 - row["rho_hat"]) ** 2)
    assert not hasattr(model, "_prhs_runtime")  # unpatched again


def test_bench_e2e_decode_repeats_report_the_median_run_and_every_run(tmp_path):
    """--repeats 3: three timed runs per cell, the row is the median one by ms/step, all three beside it
    (in the JSON and as a range in the table)."""
    _run_script("bench_e2e_decode.py", "--quick", "--modes", "eager", "--configs", "dense-gqa",
                "--new-tokens", "4", "--repeats", "3", "--out", str(tmp_path))
    row, = json.loads((tmp_path / "bench_e2e_decode.json").read_text())["rows"]
    runs = row["ms_per_step_runs"]
    assert len(runs) == 3 and row["ms_per_step"] == sorted(runs)[1]
    assert f"({min(runs):.2f}–{max(runs):.2f}, 3 runs)" in (tmp_path / "bench_e2e_decode.md").read_text()


def test_bench_e2e_decode_model_has_room_for_its_longest_case():
    """The random-weight model was made with 32,768 positions whatever the cases, so a 128k case needed a
    hand edit (issue 37); it is made for the longest prompt plus its new tokens."""
    bench = load_script("bench_e2e_decode")
    assert bench.build_model("tiny", torch.device("cpu"), torch.float32).config.max_position_embeddings == 32768
    model = bench.build_model("tiny", torch.device("cpu"), torch.float32, 131072 + 48)
    assert model.config.max_position_embeddings == 131072 + 48


def test_bench_e2e_decode_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        load_script("bench_e2e_decode").main(["--quick", "--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_bench_e2e_decode_names_allowed_configs(capsys):
    err = _e2e_error(capsys, "--configs", "dense,nope")  # exit status 2
    assert "nope" in err and "dense-gqa" in err


def test_bench_e2e_decode_profile_names_a_family_for_every_decode_kernel():
    """--profile-steps sums GPU time by kernel family: every Triton kernel of the decode pipeline
    belongs to its stage, none falls into "other kernels"."""
    import re

    bench = load_script("bench_e2e_decode")
    stages = {"cis_match.py": "cis match", "topk_retrieval.py": "retrieval", "topk_select.py": "retrieval",
              "compose_indices.py": "composition", "dilated_set.py": "composition",
              "sparse_decode_attention.py": "sparse attention", "group_union.py": "sparse attention",
              "record_anchors.py": "anchor record"}
    for file, family in stages.items():
        source = next((REPO / "prhs_hf" / "ops").rglob(file)).read_text()
        kernels = re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", source)
        assert kernels, file
        for name in kernels:
            assert bench._family(f"{name}_0d1d2d") == family, (file, name)
    assert bench._family("_rerank_kernel_0d1d") == "retrieval"  # the key index's second stage (cis.index)
    assert bench._family("_index_write_kernel_0d1d") == "key index write"
    assert bench._family("triton_poi_fused_add_0") == "inductor (fused glue)"
    assert bench._family("nvjet_tst_128x64") == "linear (proj, MLP, head)"


@pytest.mark.slow
def test_bench_prefill_quick_cpu_metadata(tmp_path):
    _run_script("bench_prefill.py", "--quick", "--skip-flex", "--out", str(tmp_path / "bench_prefill"))
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    for key in ("command", "device", "versions", "date", "git_commit"):
        assert key in data, key
    assert data["git_commit"] == "test-commit"
    assert data["versions"]["flashinfer"] and data["versions"]["torch"] == torch.__version__
    assert data["operator"] and all(r["ours_ms"] is not None and r["dense_sdpa_ms"] is not None for r in data["operator"])
    assert data["model"], data["notes"]
    variants = [r["variant"] for r in data["model"]]
    assert "dense (sdpa)" in variants and any(v.startswith("cpe (") and "prefill auto" in v for v in variants)
    for r in data["model"]:
        assert r["ms"] is not None and r["speedup_vs_fastest_dense"] is not None and r["peak_vs_dense"] is None  # CPU: no peak


def test_probe_es_side_stream_quick_cpu(tmp_path, monkeypatch):
    """The side-stream probe's CPU smoke run: every piece timed, no stream columns without CUDA.

    In process, imported as the GPU test imports it (a script with dataclasses: it once failed
    there with an AttributeError inside ``dataclasses``, the module not being in ``sys.modules``)."""
    monkeypatch.setenv("PRHS_GIT_COMMIT", "test-commit")
    assert load_script("probe_es_side_stream").main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "probe_es_side_stream.json").read_text())
    assert data["git_commit"] == "test-commit" and len(data["rows"]) == 1
    row = data["rows"][0]
    for key in ("select_ms", "rest_ms", "attention_ms", "sequential_ms", "bound_ms"):
        assert row[key] > 0, key
    assert row["overlapped_ms"] is None and row["hidden"] is None and row["same_output"] is None
    assert "| select_ms |" in (tmp_path / "probe_es_side_stream.md").read_text()


def test_gpu_runner_names_what_exists():
    """scripts/gpu_issue12.sh parses, and its default e2e cases, configs and test files exist."""
    import re

    import bench_e2e_decode

    runner = SCRIPTS / "gpu_issue12.sh"
    subprocess.run(["bash", "-n", str(runner)], check=True)
    src = runner.read_text()
    cases = re.search(r"E2E_CASES=\$\{E2E_CASES:-([^}]*)\}", src).group(1)
    configs = re.search(r"E2E_CONFIGS=\$\{E2E_CONFIGS:-([^}]*)\}", src).group(1)
    assert {"dense", "dense-gqa"} <= set(configs.split(","))
    assert set(configs.split(",")) <= set(bench_e2e_decode.CONFIGS)
    for case in cases.split(","):
        shape, batch, prompt = case.split(":")
        assert shape in bench_e2e_decode.SHAPES and int(batch) > 0 and int(prompt) > 0
    for test_file in re.findall(r"tests/\S+\.py", src):
        assert (REPO / test_file).is_file(), test_file
    for script in re.findall(r"scripts/(\w+\.py)", src):
        assert (SCRIPTS / script).is_file(), script
    for step_timeout in re.findall(r"timeout -k \d+ (\d+) ", src):
        assert int(step_timeout) <= 240


# ----------------------------------------------------------------------------- e2e: real weights, real text


@pytest.fixture(scope="module")
def e2e_checkpoint(tmp_path_factory) -> Path:
    """A tiny random 2-layer llama (GQA 4/2, hidden 64) with its byte-level tokenizer, as a checkpoint folder."""
    from lm_eval_fixtures import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "tiny-ckpt")


def _write_jsonl_gz(path: Path, records: list[dict]) -> Path:
    import gzip

    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture()
def stories(tmp_path) -> Path:
    """CoQA-like records: the text in ``story``."""
    from lm_eval_fixtures import COQA_ROWS

    return _write_jsonl_gz(tmp_path / "stories.jsonl.gz", COQA_ROWS)


def _e2e_error(capsys, *argv: str) -> str:
    import bench_e2e_decode as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bench_e2e_decode_real_weights_and_text(e2e_checkpoint, stories, tmp_path, monkeypatch):
    """--model/--prompts: rows on the checkpoint's weights and real text, each sequence exactly L tokens
    and different from the others; cis (configs/cis.yaml as shipped) reports rho-hat; speedups filled."""
    import bench_e2e_decode as bench

    seen = []
    real_run = bench.run_generate

    def recording_run(model, ids, *args, **kwargs):
        seen.append(ids.clone())
        return real_run(model, ids, *args, **kwargs)

    monkeypatch.setattr(bench, "run_generate", recording_run)
    out = tmp_path / "out"
    # L = 160 > cis.yaml's budget of 128 tokens (8 + 32 + 88), so decode is sparse and rho-hat measured
    assert bench.main(["--model", str(e2e_checkpoint), "--prompts", str(stories), "--cases", "model:2:160",
                       "--modes", "eager", "--configs", "dense,dense-gqa,cis", "--new-tokens", "4",
                       "--out", str(out)]) == 0
    data = json.loads((out / "bench_e2e_decode.json").read_text())
    assert data["prompts"] == "stories.jsonl.gz" and data["model"] == str(e2e_checkpoint)
    assert data["configs"]["cis"] == {"base": "configs/cis.yaml", "overrides": {}}
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"dense", "dense-gqa", "cis"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["shape"] == "tiny-ckpt" and r["weights"] == "real" and r["prompts"] == "stories.jsonl.gz"
        assert r["batch"] == 2 and r["prompt"] == 160 and r["tokens"] == 4
        assert r["fastest_dense"] in ("dense", "dense-gqa") and r["speedup_vs_fastest_dense"] > 0
    fastest = rows[rows["cis"]["fastest_dense"]]
    assert math.isclose(rows["cis"]["speedup_vs_fastest_dense"], rows["cis"]["decode_tok_s"] / fastest["decode_tok_s"])
    assert 0.0 < rows["cis"]["rho_hat"] <= 1.0
    assert seen and all(tuple(ids.shape) == (2, 160) for ids in seen)
    assert not torch.equal(seen[0][0], seen[0][1])  # the sequences start at different records
    from transformers import AutoTokenizer

    from lm_eval_fixtures import COQA_ROWS

    tokenizer = AutoTokenizer.from_pretrained(e2e_checkpoint)
    story = [r["story"] for r in COQA_ROWS]
    for b in range(2):  # byte-level tokens: sequence b is the stories from story b on, 160 bytes of them
        assert tokenizer.decode(seen[-1][b]) == "\n\n".join(story[b:] + story)[:160], b
    md = (out / "bench_e2e_decode.md").read_text()
    assert "tiny-ckpt: real weights, prompts stories.jsonl.gz" in md


def test_bench_e2e_text_prompts_start_at_record_b_mod_n(e2e_checkpoint, tmp_path):
    import bench_e2e_decode as bench
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(e2e_checkpoint)
    records = [{"id": 0, "text": "alpha " * 5}, {"context": "bravo " * 7, "input": "unused"}, {"input": "charlie " * 3}]
    prompts = bench.TextPrompts(_write_jsonl_gz(tmp_path / "r.jsonl.gz", records), tokenizer)
    ids = prompts.batch(4, 64)
    assert tuple(ids.shape) == (4, 64)
    texts = ["alpha " * 5, "bravo " * 7, "charlie " * 3]
    for b in range(4):
        order = [texts[(b + k) % 3] for k in range(12)]
        want = tokenizer("\n\n".join(order), add_special_tokens=False)["input_ids"][:64]
        assert ids[b].tolist() == want, b
    assert torch.equal(ids[3], ids[0]) and not torch.equal(ids[0], ids[1])


def test_bench_e2e_decode_configs_name_their_base_file():
    """cis and cpe-calibrated are the shipped YAMLs as they are; the others cpe.yaml + overrides. Telemetry
    is off unless asked for (the timed run is the config as shipped; ρ̂ comes from a separate run)."""
    import bench_e2e_decode as bench
    import prhs_hf

    prhs_hf_load = prhs_hf.load_config
    model = tiny_model("llama", layers=2)
    on = {"telemetry": {"enabled": True}}
    want = {
        "cis": prhs_hf_load(REPO / "configs" / "cis.yaml", on),
        "cpe-calibrated": prhs_hf_load(REPO / "configs" / "cpe_qwen2.5-coder-1.5b.yaml", on),
        "cis-group": prhs_hf_load(REPO / "configs" / "cis.yaml", {"cis": {"selection": "group"}, **on}),
        "cis-low-rho": prhs_hf_load(REPO / "configs" / "cis_low_rho.yaml", on),
        "cis-fp8": prhs_hf_load(REPO / "configs" / "cis.yaml", {"cis": {"index": "fp8"}, **on}),
        "cis-s16-share": prhs_hf_load(REPO / "configs" / "cpe.yaml", {"cis": {"block_size": 16, "tau": -1.0},
                                                                      "psaw": {"enabled": False},
                                                                      "etf": {"enabled": False}, **on}),
    }
    for name, config in want.items():
        bench.select_config(model, name, telemetry=True)
        assert model._prhs_runtime.resolved.config == config, name
        bench.select_config(model, name)
        assert not model._prhs_runtime.resolved.config.telemetry.enabled, name
    assert want["cis"].cis.tau == 0.8
    bench.select_config(model, "dense-gqa")
    assert not prhs_hf.is_patched(model)


def test_bench_e2e_decode_model_needs_prompts(e2e_checkpoint, stories, capsys):
    err = _e2e_error(capsys, "--model", str(e2e_checkpoint), "--cases", "model:2:64")
    assert "--model needs --prompts" in err
    err = _e2e_error(capsys, "--prompts", str(stories), "--cases", "tiny:2:64")
    assert "--prompts needs --model" in err
    err = _e2e_error(capsys, "--model", str(stories.parent), "--prompts", str(stories))
    assert "--model" in err and "config.json" in err


def test_bench_e2e_decode_names_the_cases_form(e2e_checkpoint, stories, capsys):
    err = _e2e_error(capsys, "--model", str(e2e_checkpoint), "--prompts", str(stories), "--cases", "llama2-7b:2:64")
    assert "--cases" in err and "'llama2-7b:2:64'" in err and "model:B:L" in err
    err = _e2e_error(capsys, "--model", str(e2e_checkpoint), "--prompts", str(stories), "--cases", "model:2")
    assert "--cases" in err and "model:B:L" in err
    err = _e2e_error(capsys, "--cases", "model:2:64")
    assert "--cases" in err and "llama2-7b" in err


def test_bench_e2e_decode_names_the_text_fields(e2e_checkpoint, tmp_path, capsys):
    bad = _write_jsonl_gz(tmp_path / "no_text.jsonl.gz", [{"story": "fine"}, {"id": 1, "question": "no text here"}])
    err = _e2e_error(capsys, "--model", str(e2e_checkpoint), "--prompts", str(bad), "--cases", "model:2:64")
    assert "--prompts" in err and "no_text.jsonl.gz:2" in err
    assert all(field in err for field in ("story", "text", "context", "input"))
    plain = tmp_path / "plain.txt"
    plain.write_text("some text")
    err = _e2e_error(capsys, "--model", str(e2e_checkpoint), "--prompts", str(plain), "--cases", "model:2:64")
    assert "--prompts" in err and ".jsonl.gz" in err


def test_bench_e2e_decode_kernel_breakdown_sums_families_and_lists_the_pipelines_kernels():
    """The profile's per-family sums, and the pipeline's own kernels one by one (which stage of a
    family takes the time), from (name, GPU µs, start, end) per kernel over 2 steps."""
    bench = load_script("bench_e2e_decode")
    kernels = [("_group_score_kernel", 300.0, 0.0, 300.0), ("_radix_pass_kernel", 100.0, 300.0, 400.0),
               ("_radix_pass_kernel", 60.0, 400.0, 460.0), ("triton_poi_fused_add_0", 40.0, 500.0, 540.0),
               ("nvjet_tst_128x64", 200.0, 600.0, 800.0)]
    fam, own = bench.kernel_breakdown(kernels, steps=2, step_ms=0.6)
    assert fam["retrieval"] == 0.23 and fam["inductor (fused glue)"] == 0.02 and fam["linear (proj, MLP, head)"] == 0.1
    assert fam["all kernels"] == 0.35 and fam["kernels per step"] == 2.5
    assert fam["step (profiled)"] == 0.6 and fam["not kernels (launch, Python, idle)"] == 0.25
    assert fam["idle inside the kernel span"] == pytest.approx(0.05)  # 800 µs span over 2 steps, 0.35 ms busy
    assert list(own) == ["_group_score_kernel", "_radix_pass_kernel"]  # slowest first, ours only
    # per step, and per launch: the median (upper of two) and the largest
    assert own["_radix_pass_kernel"] == {"ms": 0.08, "launches": 1.0, "median_us": 100.0, "max_us": 100.0}
    assert own["_group_score_kernel"]["median_us"] == own["_group_score_kernel"]["max_us"] == 300.0


def test_bench_e2e_decode_host_profile_on_a_cpu(tmp_path):
    """--host-profile-steps in the static mode: cProfile's step time and its functions with the most own
    time per step; on a CPU transformers skips compilation, so the back-to-back timing of the compiled
    call is left out (None) and the row says which call it profiled; too few new tokens for the profiled
    steps and as many back-to-back calls are an error of the cell, naming the room needed."""
    _run_script("bench_e2e_decode.py", "--quick", "--modes", "static", "--configs", "dense-gqa,cis-s16",
                "--new-tokens", "12", "--host-profile-steps", "4", "--out", str(tmp_path))
    rows = {r["config"]: r for r in json.loads((tmp_path / "bench_e2e_decode.json").read_text())["rows"]}
    for row in rows.values():
        h = row["host_profile"]
        assert h["steps"] == 4 and h["step_ms"] > 0 and h["decode_call"].startswith("eager")
        assert h["compiled_step_ms"] is None and h["loop_host_ms"] is None
        assert len(h["top_functions"]) == 25 and all(f["own_us"] >= 0 for f in h["top_functions"])
        assert h["top_functions"][0]["own_us"] >= h["top_functions"][-1]["own_us"]
    assert any("sparse_decode_attention" in f["function"] for f in rows["cis-s16"]["host_profile"]["top_functions"])
    assert "Host side of a decode step" in (tmp_path / "bench_e2e_decode.md").read_text()
    _run_script("bench_e2e_decode.py", "--quick", "--modes", "static", "--configs", "dense-gqa",
                "--new-tokens", "8", "--host-profile-steps", "4", "--out", str(tmp_path / "short"))
    row, = json.loads((tmp_path / "short" / "bench_e2e_decode.json").read_text())["rows"]
    assert "host_profile" in row["error"] and "10 new tokens" in row["error"]


def test_probe_tilemax_candidates_captures_and_counts(e2e_checkpoint, stories, tmp_path):
    """The capture on a tiny checkpoint (every layer's keys, the last queries), reused from --capture,
    and the counts: at least k candidates per row (theta is a lower bound of the k-th key), fewer or
    equal with more theta passes, the exact threshold's count equal to a naive one."""
    import probe_tilemax_candidates as probe

    cap = tmp_path / "cap.pt"
    argv = ["--model", str(e2e_checkpoint), "--prompts", str(stories), "--length", "300", "--queries", "8",
            "--query-stride", "1", "--k", "5", "--sink", "4", "--local", "8", "--subs", "4,8", "--capture", str(cap),
            "--out", str(tmp_path / "probe")]
    rows = probe.main(argv)
    data = torch.load(cap)
    assert sorted(data["K"]) == [0, 1] and tuple(data["K"][0].shape) == (2, 300, 16)
    assert tuple(data["Q"][0].shape) == (4, 8, 16)
    assert json.loads((tmp_path / "probe.json").read_text())["rows"] == rows
    by = {(r["sub_tile"], r["theta_passes"]): r for r in rows}
    assert by[(8, 2)]["max"] >= by[(8, 3)]["max"] >= by[(8, "exact")]["max"] and by[(4, "exact")]["median"] >= 5
    assert probe.main(argv[:2] + ["--prompts", str(tmp_path / "missing.jsonl")] + argv[4:]) == rows  # reused
    keys = probe.orderable_keys(torch.tensor([3.0, -1.0, 2.0, 5.0, 0.0, 4.0, 1.0, -2.0, 6.0]))
    # sub-tiles of 2: maxima 3, 5, 4, 1, 6; k 2: theta 5 (keys 5, 6); k 3: theta 4; k 6 > 5 sub-tiles: all
    assert [probe.candidates(keys, k, 2, "exact") for k in (2, 3, 6)] == [2, 3, 9]


def test_bench_e2e_decode_warm_up_and_rho_run_shapes(tmp_path, monkeypatch):
    """Eager: the warm-up runs as many tokens as the timed run (a Triton variant first met later would
    compile inside the timed steps). Static: every generate() of the cell uses the cell's one static
    cache, the untimed ρ̂ run too (eagerly), so no second KV cache is allocated beside it."""
    import bench_e2e_decode as bench

    calls = []
    real_run = bench.run_generate

    def recording_run(model, ids, new_tokens, static_cache=None, *args, **kwargs):
        calls.append((new_tokens, static_cache, kwargs.get("compiled", True)))
        return real_run(model, ids, new_tokens, static_cache, *args, **kwargs)

    monkeypatch.setattr(bench, "run_generate", recording_run)
    for mode in ("eager", "static"):
        calls.clear()
        assert bench.main(["--quick", "--modes", mode, "--configs", "cis-s16", "--new-tokens", "20",
                           "--out", str(tmp_path / mode)]) == 0
        row, = json.loads((tmp_path / mode / "bench_e2e_decode.json").read_text())["rows"]
        assert "error" not in row, row
        warm, timed, rho = calls
        assert timed[0] == rho[0] == 20
        if mode == "eager":
            assert warm[0] == 20 and all(c[1] is None for c in calls)
        else:
            assert warm[0] == 16 and warm[1] is not None
            assert timed[1] is warm[1] and rho[1] is warm[1] and rho[2] is False


def test_frontier_reads_the_measured_results_and_leaves_unmeasured_cells_empty(tmp_path):
    """scripts/frontier.py on the committed results: every candidate's operator speed at each shape of its
    budget, the policy's decision there, and RULER points only where a RULER run exists (cis-group has
    none: "not run", never a guess), from every --ruler file; the Pareto set keeps a point that no other
    beats on both axes."""
    frontier = load_script("frontier")
    assert frontier.main(["--out", str(tmp_path / "f_1.5b")]) == 0  # a dot in the stem is kept
    rows = {r["name"]: r for r in json.loads((tmp_path / "f_1.5b.json").read_text())["rows"]}
    assert rows["cis-group"]["ruler"] is None and "not run" in (tmp_path / "f_1.5b.md").read_text()
    # the group-set candidates' rows come from the second RULER file (ruler_qwen1.5b_frontier_table.json)
    assert rows["cis-group-lb"]["ruler"]["cells"] == rows["cis-group-8k"]["ruler"]["cells"] == 24
    assert rows["cis-group-8k"]["operator"] == []  # no operator row at k 8,192: nothing borrowed from k 4,096
    assert {m["k"] for m in rows["cis-group-8k"]["dropped_mass"]} == {8192}
    assert rows["dense"]["ruler"]["delta_points"] == 0.0
    assert rows["cis"]["ruler"]["cells"] >= 24 and rows["cis"]["ruler"]["delta_points"] < -1
    lb = {o["shape"]: o for o in rows["cis_longbench"]["operator"]}
    assert lb["B1/128k 32/8"]["policy_auto"] == "dense" and lb["B1/128k 32/8"]["speedup"] < 1
    # the dropped-mass proxy: each budgeted candidate's row of the probes at its own top-k and selection
    mass = {name: {m["file"]: m for m in rows[name]["dropped_mass"]} for name in rows}
    assert mass["dense"] == {} and set(mass["cis_longbench"]) == set(mass["cis-group-lb"]) == {
        "probe_group_mass_qwen1.5b.json", "probe_group_mass_qwen1.5b_16k.json", "probe_group_set_mass_qwen1.5b_16k.json"}
    assert {m["k"] for m in rows["cis-group-lb"]["dropped_mass"]} == {4096}
    assert mass["cis-group-lb"]["probe_group_set_mass_qwen1.5b_16k.json"]["sets"] == "as run"
    assert mass["cis-group-lb"]["probe_group_mass_qwen1.5b_16k.json"]["sets"] == "exact top-k"
    assert all(mass["cis-group-lb"][f]["mean"] > mass["cis_longbench"][f]["mean"] for f in mass["cis_longbench"])
    assert set(mass["cis"]) == {"probe_group_mass_qwen1.5b_cis.json"} and mass["cis"]["probe_group_mass_qwen1.5b_cis.json"]["k"] == 88
    assert "dropped mass (CPU proxy)" in (tmp_path / "f_1.5b.md").read_text()
    # end to end: a cell the policy ran dense says so; a cell whose dense baseline did not run has no ratio
    e2e = {(e["file"], e["mode"], e["cell"], e["config"]): e for e in rows["cis_longbench"]["end_to_end"]}
    assert e2e[("speed_map_h100_af76502.json", "eager", "B4/64k", "cis_longbench")]["decode_steps"] == "dense"
    assert "`cis_longbench` 2.18× (dense steps)" in (tmp_path / "f_1.5b.md").read_text()
    assert ("speed_map_h100_af76502.json", "static", "B4/64k", "cis_longbench/sparse") not in e2e
    assert frontier.main(["--masses", "", "--out", str(tmp_path / "f_none")]) == 0  # no probes: an empty column
    assert all(r["dropped_mass"] == [] for r in json.loads((tmp_path / "f_none.json").read_text())["rows"])
    fake = [dict(name=n, ruler=dict(delta_points=a), operator=[dict(shape="s", speedup=v)])
            for n, v, a in (("fast", 2.0, -5.0), ("exact", 1.0, 0.0), ("worse", 0.9, -1.0))]
    assert frontier.pareto(fake, "s") == ["fast", "exact"]
    proc = subprocess.run([sys.executable, str(SCRIPTS / "frontier.py"), "--ruler", str(tmp_path / "none.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing result files" in proc.stderr


def test_probe_group_union_counts_the_distinct_keys_of_each_kv_group():
    """scripts/probe_group_union.py: per KV group, the summed set sizes of its heads and their union (a key
    two heads share counts once); a generate() on a tiny model gives a ratio between 1/G and 1."""
    from types import SimpleNamespace

    from tiny_models import tiny_model

    probe = load_script("probe_group_union")
    # 1 sequence, 4 query heads in 2 KV groups; group 0's heads share keys 1 and 2, group 1's share none
    idx = torch.tensor([[[0, 1, 2, -1], [1, 2, 3, -1], [5, 6, -1, -1], [7, -1, -1, -1]]])
    sel = SimpleNamespace(idx=idx, count=(idx >= 0).sum(-1), active=torch.tensor([True]))
    recorder = probe.UnionRecorder(SimpleNamespace(select=lambda layer, *a: sel), kv_heads=2)
    assert recorder.select(3) is sel
    assert recorder.rows == [(3, 6, 4), (3, 3, 3)]
    model = tiny_model("llama", layers=2)
    prompts = torch.randint(1, 100, (1, 200), generator=torch.Generator().manual_seed(0))  # past cis's 128 keys
    row = probe.measure(model, prompts, "cis", 3)
    group = row["group"]
    assert row["status"] == "ok" and row["samples"] > 0 and 1 / group <= row["union_over_sum"] <= 1


def test_probe_group_union_dropped_mass_of_own_and_group_top_k():
    """scripts/probe_group_union.py --mass-k: per query head, the attention mass outside sink + window + the k
    middle keys, ranked by the head's own scores or by its KV group's largest; a generate() records one
    value per (layer, head) and k, in [0, 1], the group's never below the head's own."""
    from tiny_models import tiny_model

    probe = load_script("probe_group_union")
    # 2 heads of one KV group over 6 keys; sink 1, window 1: the middle is keys 1..4
    scores = torch.tensor([[0.0, 4.0, 0.0, 0.0, 0.0, 0.0],    # head 0 attends to key 1
                           [0.0, 0.0, 0.0, 3.0, 0.0, 0.0]])  # head 1 to key 3
    got = probe.dropped_mass(scores, 2, (1, 4, 9), sink=1, local=1)
    p = torch.softmax(scores, -1)
    assert torch.allclose(got[(1, "head")], torch.stack([p[0, 2:5].sum(), p[1, [1, 2, 4]].sum()]))
    # the group's top-1 is key 1 (score 4 > 3): head 1 drops its key 3
    assert torch.allclose(got[(1, "group")], torch.stack([p[0, 2:5].sum(), p[1, [2, 3, 4]].sum()]))
    for k in (4, 9):  # the whole middle: nothing dropped
        assert torch.allclose(got[(k, "head")], torch.zeros(2), atol=1e-6)
        assert torch.allclose(got[(k, "group")], torch.zeros(2), atol=1e-6)
    model = tiny_model("llama", layers=2)
    prompts = torch.randint(1, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    row = probe.measure(model, prompts, "cis", 3, mass_k=(8, 64))
    mass = row["dropped_mass"]
    assert set(mass) == {"8", "64"}
    for k in ("8", "64"):
        head, group = mass[k]["head"], mass[k]["group"]
        assert head["samples"] == group["samples"] > 0
        assert 0.0 <= head["mean"] <= group["mean"] + 1e-6 <= 1.0 + 1e-6
    assert mass["64"]["head"]["mean"] <= mass["8"]["head"]["mean"] + 1e-6
    assert "group top-k" in probe.markdown(dict(date="2026-01-01", command="x", model="m", dtype="f", prompts=1,
                                                 length=200, text="t", new_tokens=3, rows=[row]))


def test_probe_group_union_set_mass_of_the_sets_the_steps_attended():
    """scripts/probe_group_union.py --set-mass: per query head, the attention mass outside the set the step
    attended to (a group set counts for each of its heads); a per-head config and a group-selection one
    both give values in [0, 1] from a generate(), the group one without union rows."""
    from types import SimpleNamespace

    from tiny_models import tiny_model

    probe = load_script("probe_group_union")
    # 1 sequence, 2 query heads sharing 1 KV head, 4 keys; q . k picks key 0 for head 0 and key 3 for head 1
    keys = torch.zeros(1, 1, 4, 2)
    keys[0, 0, 0], keys[0, 0, 3] = torch.tensor([5.0, 0.0]), torch.tensor([0.0, 5.0])
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    geom = SimpleNamespace(pad=torch.tensor([0]), t_last=torch.tensor([4]))
    args = (q, keys, keys, geom, None, 1.0)
    probs = torch.softmax(torch.einsum("hd,td->ht", q[0], keys[0, 0]), -1)
    for idx, count, want in (
        (torch.tensor([[[0, 1], [3, -1]]]), torch.tensor([[2, 1]]), [1 - probs[0, [0, 1]].sum(), 1 - probs[1, 3]]),
        (torch.tensor([[[0, 3]]]), torch.tensor([[2]]), [1 - probs[0, [0, 3]].sum(), 1 - probs[1, [0, 3]].sum()]),
    ):
        sel = SimpleNamespace(idx=idx, count=count, active=torch.tensor([True]))
        recorder = probe.UnionRecorder(SimpleNamespace(select=lambda layer, *a, sel=sel: sel), kv_heads=1, set_mass=True)
        recorder.select(0, *args)
        assert torch.allclose(torch.tensor(recorder.set_dropped), torch.stack(want).float(), atol=1e-6)
        assert len(recorder.rows) == (1 if idx.shape[1] == 2 else 0)
    model = tiny_model("llama", layers=2)
    prompts = torch.randint(1, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    for config in ("cis", "cis-group"):
        row = probe.measure(model, prompts, config, 3, set_mass=True)
        mass = row["set_dropped_mass"]
        assert mass["samples"] > 0 and 0.0 <= mass["mean"] <= 1.0
        assert (row["status"] == "ok") == (config == "cis")
    assert "attended to" in probe.markdown(dict(date="2026-01-01", command="x", model="m", dtype="f", prompts=1,
                                                 length=200, text="t", new_tokens=3, rows=[row]))


def test_probe_group_union_shared_prefill_rows_read_and_the_generations_k(tmp_path):
    """scripts/probe_group_union.py --share-prefill: a config continuing a dense cache of all but the prompt's
    last two tokens measures what a whole patched prefill does (same samples, masses to rounding) and takes
    its context-relative k from the whole prompt; --set-mass records the rows a group set reads per KV group."""
    import yaml

    from tiny_models import tiny_model

    probe = load_script("probe_group_union")
    model = tiny_model("llama", layers=2)
    prompts = torch.randint(1, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefilled = model(prompts[:, :-2], use_cache=True).past_key_values
    relative = tmp_path / "relative.yaml"
    relative.write_text(yaml.safe_dump({"budget": {"sink": 8, "local": 32, "topk": 8, "topk_fraction": 0.25},
                                        "cis": {"selection": "group"}}))
    for config, k in (("cis-group", 88), (str(relative), 50)):
        whole = probe.measure(model, prompts, config, 3, set_mass=True)
        shared = probe.measure(model, prompts, config, 3, set_mass=True, prefilled=prefilled)
        assert whole["topk"] == shared["topk"] == k
        assert whole["set_dropped_mass"]["samples"] == shared["set_dropped_mass"]["samples"] > 0
        assert shared["set_dropped_mass"]["mean"] == pytest.approx(whole["set_dropped_mass"]["mean"], abs=1e-4)
        assert 8 + 32 + k <= shared["group_set_reads"] <= 8 + 32 + k + 2 * (k // 3)
    per_head = probe.measure(model, prompts, "cis", 3, set_mass=True, prefilled=prefilled)
    assert "group_set_reads" not in per_head and per_head["mean_union"] <= per_head["mean_sum"]
    table = probe.markdown(dict(date="2026-01-01", command="x", model="m", dtype="f", prompts=1, length=200, text="t",
                                new_tokens=3, rows=[shared, per_head]))
    assert f"| {shared['group_set_reads']:.0f} |" in table
    assert f"| {per_head['mean_sum']:.0f} / {per_head['mean_union']:.0f} |" in table


def test_probe_key_index_center_scores_centred_codes_of_keys_with_a_shared_part(tmp_path):
    """scripts/probe_key_index_center.py: on keys that share a large component, the centred codes keep the
    exact top-k at a small margin where the plain ones lose some; a margin past the region keeps all of
    it; the command writes its JSON and table (a tiny checkpoint with heads of 32, the int4 index's group, and
    a short prompt: loading the default model's GGUF, which test_fetch.py and the CLI's demo test cover,
    took most of this test's time)."""
    from lm_eval_fixtures import save_tiny_checkpoint

    probe = load_script("probe_key_index_center")
    g = torch.Generator().manual_seed(3)
    shared = torch.zeros(1, 2, 1, 64)
    shared[..., :4] = 40.0
    keys = torch.randn(1, 2, 300, 64, generator=g) + shared
    queries = torch.randn(1, 4, 3, 64, generator=g)
    got = probe.overlaps([(queries, keys)], k=16, margins=[4, 400], sink=4, local=8, center_tokens=100)
    assert got["fp8 centred on the prompt m4"] > got["fp8 m4"] + 0.02
    assert got["int4 centred on the prompt m4"] > got["int4 m4"] + 0.02
    assert all(value == 1.0 for name, value in got.items() if name.endswith("m400"))
    out = tmp_path / "probe"
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny-ckpt", head_dim=32)
    assert probe.main(["--model", str(checkpoint), "--length", "160", "--queries", "2", "--k", "16",
                       "--margins", "0,8", "--center-tokens", "64", "--out", str(out)]) == 0
    result = json.loads((tmp_path / "probe.json").read_text())
    assert len(result["rows"]) == 2 * 3 * 2 and all(0 <= row["overlap"] <= 1 for row in result["rows"])
    assert len(result["mean_key_share_by_layer"]) == 2 and (tmp_path / "probe.md").exists()


# ----------------------------------------------------------------------------- the stage table (issue 52, item 4)


def test_stage_table_splits_the_retrieval_and_bounds_each_stage():
    """The retrieval family splits by kernel into its score (K read), its select and the key index's
    exact re-read; the host gap is the timed step minus every kernel; each stage's bound is its bytes
    at the bandwidth, its fraction bound / measured; the bandwidth is the GPU's unless given."""
    table = load_script("stage_table")
    families = {"retrieval": 1.0, "linear (proj, MLP, head)": 2.0, "sparse attention": 0.25, "cis match": 0.05,
                "key index write": 0.01, "inductor (fused glue)": 0.3, "aten (copy, index, reduce)": 0.1,
                "all kernels": 3.71}
    kernels = {"_group_score_kernel": {"ms": 0.5}, "_compact_kernel": {"ms": 0.02}, "_rerank_kernel": {"ms": 0.08},
               "_tilemax_select_kernel": {"ms": 0.4}, "_sparse_attn_kernel": {"ms": 0.25}}
    ms = table.stage_ms(families, kernels, ms_per_step=5.0)
    assert ms["score (K read)"] == pytest.approx(0.52) and ms["top-k select"] == pytest.approx(0.40)
    assert ms["key index"] == pytest.approx(0.09) and ms["sparse attention + match + compose"] == pytest.approx(0.3)
    assert ms["glue"] == pytest.approx(0.4) and ms["host gap"] == pytest.approx(1.29) and ms["dense attention"] == 0
    assert sum(ms.values()) == pytest.approx(5.0) and list(ms) == list(table.STAGES)
    moved = {s: 0.0 for s in table.STAGES} | {"linear layers": 3.0e9, "score (K read)": 1.0e9}
    got = table.table_rows(ms, moved, 5.0, gbs=4000.0)
    assert got["stages"]["linear layers"] == {"ms": 2.0, "bytes": 3.0e9, "bound_ms": 0.75, "fraction": 0.375}
    assert got["stages"]["score (K read)"]["fraction"] == pytest.approx(0.25 / 0.52, abs=1e-4)
    assert got["step"] == {"ms": 5.0, "bytes": 4.0e9, "bound_ms": 1.0, "fraction": 0.2}
    assert got["stages"]["dense attention"]["fraction"] is None  # nothing measured: no fraction
    assert table.bandwidth_gbs("NVIDIA H100 80GB HBM3", None) == 3350.0
    assert table.bandwidth_gbs("NVIDIA H200", None) == 4800.0 and table.bandwidth_gbs("NVIDIA H100 PCIe", None) == 2000.0
    assert table.bandwidth_gbs("cpu (x86_64)", 50.0) == 50.0
    with pytest.raises(ValueError, match="--bandwidth-gbs"):
        table.bandwidth_gbs("cpu (x86_64)", None)


def test_stage_table_on_a_cpu(tmp_path):
    """The GPU's code path on a tiny random llama: a dense and a CIS row, each stage's bytes from the
    policy's byte model (one home: CostModel.decode_bytes), the JSON and the markdown."""
    from prhs_hf.evaluation import speed_map as sm
    from prhs_hf.policy import H200, DecodeShape

    table = load_script("stage_table")
    assert table.main(["--model", "tiny-llama", "--mode", "eager", "--batch", "2", "--length", "600", "--configs",
                       "sdpa_gqa,cis", "--steps", "2", "--new-tokens", "6", "--bandwidth-gbs", "50", "--prefill-chunk", "256",
                       "--name", "cpu", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "stage_table_cpu.json").read_text())
    assert set(META_FIELDS) <= set(data) and "--configs sdpa_gqa,cis" in data["command"]
    assert data["bandwidth_gbs"] == 50.0 and data["stop_check_every"] == 8 and data["stages"] == list(table.STAGES)
    dense, cis = data["rows"]
    shape = sm.SHAPES["tiny-llama"]
    assert (dense["config"], dense["decode_steps"], cis["config"], cis["decode_steps"]) == (
        "sdpa_gqa", "dense", "cis", "sparse")
    context, kv, d = 600 + 1, shape["num_key_value_heads"], shape["head_dim"]
    assert dense["stages"]["dense attention"]["bytes"] == 2 * kv * context * d * 2 * 4  # B2, K and V, fp32
    assert dense["stages"]["score (K read)"]["bytes"] == 0
    one_layer = DecodeShape(batch=2, context=context, kv_heads=kv, rows=shape["num_attention_heads"], head_dim=d,
                            itemsize=4, index_set=round(cis["processed_kv"]), topk=88)
    moved = H200.decode_bytes(one_layer, retrieval_rate=cis["kv_group_rho_hat"])
    assert cis["stages"]["score (K read)"]["bytes"] == pytest.approx(moved.scored) and moved.scored > 0
    assert cis["stages"]["sparse attention + match + compose"]["bytes"] == pytest.approx(moved.gathered)
    assert cis["stages"]["dense attention"]["bytes"] == 0
    for r in (dense, cis):
        assert r["step"]["bytes"] == pytest.approx(sum(e["bytes"] for e in r["stages"].values()))
        assert r["stages"]["linear layers"]["bytes"] == dense["stages"]["linear layers"]["bytes"] > 0
        assert r["stages"]["host gap"]["ms"] == pytest.approx(r["ms_per_step"], abs=1e-3)  # a CPU: no CUDA kernels
    md = (tmp_path / "stage_table_cpu.md").read_text()
    assert "| cis | score (K read) |" in md and "| sdpa_gqa | **step** (dense) |" in md and "50 GB/s" in md
