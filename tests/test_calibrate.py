"""Tests of ``prhs-hf calibrate`` (prhs_hf/calibration/: texts, measurement, flops, search, report, command)
on tiny random models, CPU only."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

import prhs_hf
from prhs_hf import cli
from prhs_hf.calibration import measurement
from prhs_hf.calibration.command import calibrate
from prhs_hf.calibration.flops import FlopModel, VisiblePairs
from prhs_hf.calibration.measurement import LATE_FRACTION, TAIL_BINS, Grid, Measurement, measure
from prhs_hf.calibration.options import CalibrationError
from prhs_hf.calibration.search import OFF, Schedule, beta_emp, choose, evaluate, excess, layer_stats, nearest_miss
from prhs_hf.calibration.texts import pack_prompts, read_texts
from prhs_hf.schedules import causal_pairs, psaw_window_start, visible_pairs

from lm_eval_fixtures import save_tiny_checkpoint
from tiny_models import tiny_model

SINK = 4
STORY = ("The lighthouse keeper wrote the weather in a notebook every evening, and the boats left "
         "before dawn when the wind came from the west. ") * 12


def _reference(model, prompts: torch.Tensor) -> list[torch.Tensor]:
    """Full ``[n, H, L, L]`` eager attention per layer: the naive reference."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            outs = [model(input_ids=prompts[p:p + 1], output_attentions=True).attentions for p in range(len(prompts))]
    finally:
        model.set_attn_implementation(previous)
    return [torch.cat([o[layer] for o in outs]).double() for layer in range(len(outs[0]))]


def _tail(values: torch.Tensor) -> tuple[float, float]:
    """(99th percentile, max) of every (prompt, head, late row)'s dropped mass."""
    return torch.quantile(values.flatten(), 0.99, interpolation="higher").item(), values.max().item()


def _psaw_reference(att: torch.Tensor, w: float, sink: int) -> tuple[float, float, tuple[float, float]]:
    """(all-row mean, late-row mean, late-row tail) of the mass on ``[sink, W(t))``, from the full matrix."""
    length = att.shape[-1]
    hidden = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        hidden[i, sink:max(sink, min(psaw_window_start(i + 1, w, sink), i + 1))] = True
    per_row = (att * hidden).sum(-1)  # [n, H, L]
    late = per_row[..., length - length // LATE_FRACTION:]
    return per_row.mean().item(), late.mean().item(), _tail(late)


def _etf_reference(att: torch.Tensor, frozen_hi: int, sink: int) -> tuple[float, float, tuple[float, float]]:
    """(all-row mean, late-row mean, late-row tail) over the active rows ``i >= E`` of their mass on
    the frozen rows ``[sink, E)``."""
    length = att.shape[-1]
    per_row = att[..., frozen_hi:, sink:frozen_hi].sum(-1)
    late_from = max(frozen_hi, length - length // LATE_FRACTION)
    late = att[..., late_from:, sink:frozen_hi].sum(-1)
    return per_row.mean().item(), late.mean().item(), _tail(late)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A 6-layer GQA 4/2 llama (max 256 positions) and a byte-level tokenizer, also saved as a checkpoint folder."""
    from transformers import AutoTokenizer

    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-calibrate"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = tiny_model("llama", layers=6, vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(folder)  # replaces the 2-layer model, keeps the tokenizer
    return model, tokenizer, folder


@pytest.fixture()
def story_file(tmp_path) -> Path:
    path = tmp_path / "story.txt"
    path.write_text(STORY)
    return path


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def test_dropped_mass_matches_a_full_matrix_reference(monkeypatch) -> None:
    model = tiny_model("llama", layers=6)
    grid = Grid(6, (1, 2, 3, 4), (0.5, 0.7), (0.5, 0.8), 1.0, 1.0, SINK)
    length = 72
    prompts = torch.randint(1, 128, (2, length), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(measurement, "CHUNK_ELEMENTS", 4 * length * 5)  # chunks of 5 query rows: many chunks
    m = measure(model, prompts, grid, oracle_rows=4)
    att = _reference(model, prompts)
    checked = 0
    for layer in range(6):
        for w, stat in m.psaw[layer].items():
            rows, late, tail = _psaw_reference(att[layer], w, SINK)
            assert stat.rows == pytest.approx(rows, abs=1e-6) and stat.late == pytest.approx(late, abs=1e-6), (layer, w)
            assert (stat.late_q99, stat.late_max) == pytest.approx(tail, abs=2.0 / TAIL_BINS), (layer, w)
            checked += 1
        for e, stat in m.etf[layer].items():
            rows, late, tail = _etf_reference(att[layer], e, SINK)
            assert stat.rows == pytest.approx(rows, abs=1e-6) and stat.late == pytest.approx(late, abs=1e-6), (layer, e)
            assert (stat.late_q99, stat.late_max) == pytest.approx(tail, abs=2.0 / TAIL_BINS), (layer, e)
            checked += 1
    assert checked > 20 and max(s.rows for s in m.psaw[5].values()) > 0.01  # the comparison is not of zeros
    assert max(s.late_max for s in m.psaw[5].values()) > max(s.late for s in m.psaw[5].values()) > 0.01


def test_the_calibration_pass_gives_the_model_back_when_a_forward_raises() -> None:
    from prhs_hf.calibration.dense_pass import layer_qk_hooks

    model = tiny_model("llama", layers=3)
    before = model.config._attn_implementation
    seen: list[int] = []

    def make_hook(index: int):
        def hook(query, key, scaling):
            seen.append(index)
            if index == 1:
                raise RuntimeError("the forward failed")
        return hook

    with pytest.raises(RuntimeError, match="the forward failed"):
        with layer_qk_hooks(model, make_hook) as layers:
            assert len(layers) == 3 and model.config._attn_implementation != before
            assert all(callable(layer.self_attn.__dict__.get("_prhs_calibration")) for layer in layers)
            with torch.inference_mode():
                model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False)
    assert seen == [0, 1]  # the hooks ran, in layer order, until the failing one
    assert model.config._attn_implementation == before
    assert not any("_prhs_calibration" in layer.self_attn.__dict__ for layer in model.model.layers)


def test_measure_refuses_a_patched_model_with_a_calibration_error() -> None:
    model = tiny_model("llama", layers=4)
    grid = Grid(4, (1, 2), (0.5,), (0.5,), 1.0, 1.0, SINK)
    prompts = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with prhs_hf.patch(model, {"budget": {"sink": 2, "local": 4, "topk": 16}}):
        with pytest.raises(CalibrationError, match=r"calibrate the unpatched model \(prhs_hf.unpatch\(model\)\)"):
            measure(model, prompts, grid)
        assert prhs_hf.is_patched(model)
    with pytest.raises(CalibrationError, match="the grid is for 4 layers, the model has 3"):
        measure(tiny_model("llama", layers=3), prompts, grid)


def test_the_tail_histogram_gives_torch_quantile_within_a_bin_and_the_exact_maximum() -> None:
    g = torch.Generator().manual_seed(3)
    values = torch.rand(500, 3, generator=g) ** 4  # skewed toward 0, as dropped masses are
    keep = torch.rand(500, 3, generator=g) > 0.3
    tail = measurement._Tail(3)
    tail.add(values[:200], keep[:200])
    tail.add(values[200:], keep[200:])  # two chunks add up
    for k in range(3):
        kept = values[keep[:, k], k]
        for q in (0.5, 0.9, 0.99):
            exact = torch.quantile(kept.double(), q, interpolation="higher").item()
            assert exact <= tail.quantile(k, q) <= exact + 1 / TAIL_BINS, (k, q)
        assert float(tail.max[k]) == pytest.approx(kept.max().item())
    assert measurement._Tail(2).quantile(0, 0.99) == 0.0  # nothing added


def test_a_schedule_that_drops_nothing_measures_zero() -> None:
    model = tiny_model("llama", layers=4)
    grid = Grid(4, (1, 2), (0.99999,), (0.99999,), 1.0, 1.0, SINK)
    prompts = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    m = measure(model, prompts, grid, oracle_rows=2)
    measured = [s for layer in m.psaw for s in layer.values()]
    assert measured and all(s.rows == 0.0 and s.late == 0.0 and s.worst_head == 0.0 and s.late_max == 0.0
                            for s in measured)
    assert all(not layer for layer in m.etf)  # E = 0: nothing frozen, nothing to measure
    flops = FlopModel.from_config(model.config)
    c = evaluate(m, flops, Schedule(1, 0.99999), Schedule(1, 0.99999))
    assert c.psaw_worst == 0.0 and c.etf_worst == 0.0 and c.saving == 0.0
    assert all(b is None or abs(b) < 1e-6 for b in beta_emp(m, "psaw", c.psaw))


def test_visible_pairs_and_flops_follow_the_spec_predicate() -> None:
    pairs = VisiblePairs(50, SINK)
    for w, e in itertools.product((1.0, 0.9, 0.6, 0.31), (0, 3, SINK, 11, 30)):
        assert pairs(w, e) == visible_pairs(50, w, SINK, SINK, max(e, SINK)), (w, e)
    assert pairs(1.0, 0) == causal_pairs(50)
    model = tiny_model("llama", layers=4)
    f = FlopModel.from_config(model.config)
    assert (f.heads, f.kv_heads, f.head_dim, f.mlp_width) == (4, 2, 16, 96)
    assert f.dense(50) == 4 * (4 * 16 * 4 * causal_pairs(50) + 50 * (4 * 64 * 2 * 16 + 2 * (2 * 64 * 64 + 3 * 64 * 96)))


GRID = Grid(6, (1, 2, 3, 4, 5), (0.5, 0.7, 0.9), (0.5, 0.8), 1.0, 1.0, SINK)


def _measured(grid: Grid, prompts: int) -> tuple[Measurement, FlopModel]:
    """A 6-layer tiny llama measured on ``prompts`` random 64-token prompts, and its FLOP model."""
    model = tiny_model("llama", layers=6)
    ids = torch.randint(1, 128, (prompts, 64), generator=torch.Generator().manual_seed(3))
    return measure(model, ids, grid, oracle_rows=0), FlopModel.from_config(model.config)


def _all_pairs(grid: Grid) -> list[tuple[Schedule, Schedule]]:
    """Every (PSAW, ETF) pair of the grid, either one possibly off: what an exhaustive search tries."""
    options = lambda rates: [OFF] + [Schedule(s, r) for s in grid.start_layers for r in rates]  # noqa: E731
    return list(itertools.product(options(grid.phis), options(grid.psis)))


def test_choose_is_the_cheapest_pair_within_the_target() -> None:
    m, f = _measured(GRID, 1)
    target = 0.15
    chosen = choose(m, f, target)
    feasible = [c for p, e in _all_pairs(GRID)
                if (c := evaluate(m, f, p, e)).psaw_worst <= target and c.etf_worst <= target]
    assert chosen.flops == min(c.flops for c in feasible)
    assert chosen.psaw_worst <= target and chosen.etf_worst <= target and chosen.saving > 0


def test_a_row_target_bounds_the_single_row_tail_of_the_chosen_pair() -> None:
    """``row_target`` keeps, at every layer, the 99th percentile of a single (head, late row)'s dropped
    mass under it: the cheapest pair among those, which is not the pair the mean target alone picks."""
    m, f = _measured(GRID, 2)
    target = 0.15
    loose = choose(m, f, target)
    q99 = lambda c: max(st.late_q99 for kind, s in (("psaw", c.psaw), ("etf", c.etf))  # noqa: E731
                        for st in layer_stats(m, kind, s))
    row_target = q99(loose) * 0.75  # strictly below what the mean target alone allows
    chosen = choose(m, f, target, row_target=row_target)
    assert q99(chosen) <= row_target < q99(loose)
    feasible = [c for p, e in _all_pairs(GRID)
                if (c := evaluate(m, f, p, e)).psaw_worst <= target and c.etf_worst <= target
                and all(st.late_q99 <= row_target for st in layer_stats(m, "psaw", p) + layer_stats(m, "etf", e))]
    assert chosen.flops == min(c.flops for c in feasible)
    with pytest.raises(CalibrationError, match=r"--row-target: 0 is out of range; allowed a dropped mass in \(0, 1\)"):
        choose(m, f, target, row_target=0)


def test_when_no_candidate_passes_the_nearest_one_is_named() -> None:
    """A calibration that turns PSAW or ETF off because nothing passes says which candidate came
    closest and by how much, so the user sees how far the bound is."""
    grid = Grid(6, (1, 2, 3), (0.5, 0.6), (0.5,), 1.0, 1.0, SINK)  # candidates that all drop mass
    m, f = _measured(grid, 2)
    target, row_target = 0.15, 1e-4
    assert not choose(m, f, target, row_target=row_target).psaw.enabled
    miss = nearest_miss(m, "psaw", target, row_target)
    brute = min(((s, p) for s in grid.start_layers for p in grid.phis),
                key=lambda sp: excess(layer_stats(m, "psaw", Schedule(*sp)), target, row_target, None))
    assert (miss.schedule.start_layer, miss.schedule.rate) == brute and miss.excess > 1.0
    stats = layer_stats(m, "psaw", miss.schedule)
    assert miss.excess == pytest.approx(max(max(st.worst / target, st.late_q99 / row_target) for st in stats))
    assert miss.late_q99 == max(st.late_q99 for st in stats)
    assert nearest_miss(m, "psaw", 0.99) is None  # a loose bound: a candidate passes


# --------------------------------------------------------------------------------------------
# The whole calibration
# --------------------------------------------------------------------------------------------


def test_the_chosen_config_loads_and_keeps_the_target_on_the_calibration_prompts(tiny_with_tokenizer, tmp_path) -> None:
    model, tokenizer, _ = tiny_with_tokenizer
    target, length, n = 0.2, 64, 2
    result = calibrate(model, tokenizer, [STORY], n=n, length=length, target=target, start_layers="1:6",
                           phis="0.5,0.7,0.9", psis="0.5,0.8", oracle_rows=4)
    path = tmp_path / "calibrated.yaml"
    path.write_text(result.yaml_text())
    config = prhs_hf.load_config(path)
    c = result.chosen
    assert c.psaw.enabled and c.etf.enabled and c.saving > 0  # the check below is not vacuous
    assert (config.psaw.enabled, config.psaw.start_layer, config.psaw.phi) == (True, c.psaw.start_layer, c.psaw.rate)
    assert (config.etf.enabled, config.etf.start_layer, config.etf.psi) == (True, c.etf.start_layer, c.etf.rate)
    assert config.cis.enabled and config.budget == prhs_hf.load_config("cpe").budget  # the rest is the base config
    # every section spelled out (a section left out is off), the early_select section that joined the schema included
    assert set(yaml.safe_load(path.read_text())) == set(prhs_hf.load_config("cpe").to_dict()) >= {"early_select"}
    resolved = config.resolve(6)
    assert (resolved.psaw_start, resolved.etf_start) == (c.psaw.start_layer, c.etf.start_layer)
    # an independent check on the same prompts: the full matrices, the schedules of the loaded config
    prompts = pack_prompts([STORY], tokenizer, length, n)
    att = _reference(model, prompts)
    sink = config.budget.sink
    g = result.measurement.grid
    for layer in range(6):
        w = g.window(layer, config.psaw.start_layer, config.psaw.phi)
        e = g.frozen(length, layer, config.etf.start_layer, config.etf.psi)
        assert max(_psaw_reference(att[layer], w, sink)[:2]) <= target + 1e-6, layer  # the means: what the target bounds
        if e > sink:
            assert max(_etf_reference(att[layer], e, sink)[:2]) <= target + 1e-6, layer
    assert all(b is None or b >= -1e-6 for b in result.beta["psaw"] + result.beta["etf"])
    assert any(b is not None for b in result.beta["psaw"])
    text = path.read_text()
    assert "# layer |" in text and text.count("\n#     ") == 6  # one comment row per layer
    assert "predicted prefill FLOP saving" in result.summary()
    assert "nearest" not in result.summary()  # both mechanisms chosen: nothing missed


def test_a_calibration_that_turns_both_off_names_the_nearest_candidates(tiny_with_tokenizer, tmp_path) -> None:
    model, tokenizer, _ = tiny_with_tokenizer
    result = calibrate(model, tokenizer, [STORY], n=2, length=64, target=0.2, row_target=1e-4, start_layers="1:4",
                           phis="0.5,0.6", psis="0.5", oracle_rows=0)
    assert not result.chosen.psaw.enabled and not result.chosen.etf.enabled
    for label in ("PSAW", "ETF"):
        assert f"no {label} candidate passes; nearest: from layer" in result.summary()
        assert f"# No {label} candidate passes; nearest: from layer" in result.yaml_text()
    path = tmp_path / "off.yaml"
    path.write_text(result.yaml_text())
    assert not prhs_hf.load_config(path).psaw.enabled


def test_pack_prompts_reads_text_jsonl_and_folders(tiny_with_tokenizer, tmp_path) -> None:
    _, tokenizer, _ = tiny_with_tokenizer
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "alpha " * 30}) + "\n\n" + json.dumps({"text": "beta " * 30}) + "\n")
    (tmp_path / "b.txt").write_text("gamma " * 30)
    (tmp_path / "skip.bin").write_text("never read")
    texts = list(read_texts(tmp_path))
    assert texts == ["alpha " * 30, "beta " * 30, "gamma " * 30]
    prompts = pack_prompts(texts, tokenizer, 100, 5)
    assert prompts.shape == (5, 100)
    with pytest.raises(CalibrationError, match=r"--n 6 prompts of --length 100 need"):
        pack_prompts(texts, tokenizer, 100, 6)
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl:1: expected a JSON object with a \"text\""):
        list(read_texts(tmp_path / "bad.jsonl"))


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def test_cli_writes_the_yaml_and_prints_the_saving(tiny_with_tokenizer, story_file, tmp_path, capsys) -> None:
    _, _, folder = tiny_with_tokenizer
    out = tmp_path / "out" / "tiny.yaml"
    rc = cli.main(["calibrate", str(folder), "--text", str(story_file), "--n", "2", "--length", "64", "--target", "0.2",
                   "--start-layers", "1:6", "--phi", "0.5,0.7", "--psi", "0.5,0.8", "--out", str(out), "--device", "cpu"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "predicted prefill FLOP saving" in captured.out and f"wrote {out}" in captured.out
    assert "calibrating" in captured.err  # the progress bar
    config = prhs_hf.load_config(out)
    assert config.psaw.enabled or config.etf.enabled


@pytest.mark.parametrize("argv, message", [
    (["--text", "/no/such/calibration.txt"], "--text: no such file or folder: /no/such/calibration.txt"),
    ([], "give the calibration text with --text PATH"),
    (["--target", "0"], "--target: 0.0 is out of range; allowed a dropped mass in (0, 1)"),
    (["--target", "1.5"], "--target: 1.5 is out of range; allowed a dropped mass in (0, 1)"),
    (["--dataset", "wikitext"], "--dataset: 'wikitext' is not allowed; allowed: coqa, gsm8k"),
    (["--text", "/usr", "--row-target", "1"], "--row-target: 1.0 is out of range; allowed a dropped mass in (0, 1)"),
])
def test_cli_errors_before_loading_the_model(argv, message, capsys, monkeypatch) -> None:
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("prhs_hf.hub.fetch.load_model", no_loading)
    assert cli.main(["calibrate", "smollm2-135m", *argv]) == 1
    assert message in capsys.readouterr().err


def test_cli_refuses_a_length_beyond_the_models_positions(tiny_with_tokenizer, story_file, capsys) -> None:
    _, _, folder = tiny_with_tokenizer
    assert cli.main(["calibrate", str(folder), "--text", str(story_file), "--length", "512", "--device", "cpu"]) == 1
    assert "--length: 512 is out of range for this model; allowed [10, 256]" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(story_file, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["calibrate", "smollm2-135m", "--text", str(story_file), "--plot", "x.png"]) == 1
    assert "pip install 'prhs-hf[plots]'" in capsys.readouterr().err


def test_help_lists_calibrate() -> None:
    assert "calibrate" in cli.build_parser().format_help()
