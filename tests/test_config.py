from pathlib import Path

import pytest

import prhs_hf
from prhs_hf.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["dense", "cis", "cpe", "cpe_longbench"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, prhs_hf.PrHSConfig)


def test_paper_defaults_resolve():
    cfg = load_config(CONFIGS / "cpe.yaml")
    r = cfg.resolve(32)
    assert (cfg.budget.sink, cfg.budget.local, cfg.budget.topk) == (8, 32, 88)
    assert (cfg.cis.block_size, cfg.cis.tau, cfg.cis.dilation_radius) == (16, 0.8, 1)
    assert r.dilation_topm == 88 // 3 and r.psaw_start == 16 and r.etf_start == 16
    assert (cfg.psaw.phi, cfg.psaw.alpha, cfg.etf.psi, cfg.etf.gamma) == (0.7, 1.0, 0.5, 1.0)
    assert r.psaw_prefill and r.psaw_decode
    assert r.index_capacity == 8 + 32 + 88 + 2 * 1 * 29
    lb = load_config(CONFIGS / "cpe_longbench.yaml")
    assert (lb.budget.sink, lb.budget.local, lb.budget.topk) == (64, 256, 4096)


def test_dense_config_switches_everything_off():
    cfg = load_config(CONFIGS / "dense.yaml")
    assert not (cfg.cis.enabled or cfg.psaw.enabled or cfg.etf.enabled or cfg.telemetry.enabled)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"cis": {"tauu": 0.8}}, "cis.tauu"),
        ({"budgets": {}}, "budgets"),
        ({"budget": {"topk": 0}}, "budget.topk"),
        ({"budget": {"sink": -1}}, "budget.sink"),
        ({"budget": {"topk": 1.5}}, "budget.topk"),
        ({"budget": {"topk": "88"}}, "budget.topk"),
        ({"cis": {"enabled": "yes"}}, "cis.enabled"),
        ({"cis": {"block_size": 0}}, "cis.block_size"),
        ({"psaw": {"phi": 0.0}}, "psaw.phi"),
        ({"psaw": {"phi": 1.5}}, "psaw.phi"),
        ({"psaw": {"phases": ["prefill", "train"]}}, "psaw.phases"),
        ({"etf": {"psi": 2}}, "etf.psi"),
        ({"etf": {"gamma": -1}}, "etf.gamma"),
        ({"backend": {"decode": "cuda"}}, "backend.decode"),
        ({"telemetry": {"oracle": 1}}, "telemetry.oracle"),
        ({"budget": {"topk": 9}, "cis": {"dilation_topm": 10}}, "cis.dilation_topm"),
        ({"budget": {"sink": None}}, "budget.sink"),
        ({"baseline": {"share_ratio": 1.0}}, "baseline.share_ratio"),
        ({"baseline": {"head_share_ratio": 1.0}}, "baseline.head_share_ratio"),
        ({"baseline": {"head_share_ratio": -0.25}}, "baseline.head_share_ratio"),
        ({"baseline": {"head_share_ratio": "1/4"}}, "baseline.head_share_ratio"),
        ({"baseline": {"layer_share_ratio": 1}}, "baseline.layer_share_ratio"),
        ({"baseline": {"layer_share_ratio": None}}, "baseline.layer_share_ratio"),
        ({"baseline": {"layer_share_ratio": float("nan")}}, "baseline.layer_share_ratio"),
    ],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert str(err.value).startswith(key + ":")


def test_range_errors_state_the_allowed_range():
    with pytest.raises(ConfigError, match=r"psaw.phi: 0.0 is out of range; allowed \(0.0, 1.0\]"):
        load_config({"psaw": {"phi": 0}})


def test_share_ratios_are_below_one():
    cfg = load_config(CONFIGS / "cis.yaml")
    assert (cfg.baseline.share_ratio, cfg.baseline.head_share_ratio, cfg.baseline.layer_share_ratio) == (0.875, 0.5, 0.5)
    cfg = load_config({"baseline": {"name": "hshare", "head_share_ratio": 0, "layer_share_ratio": 0.999}})
    assert (cfg.baseline.head_share_ratio, cfg.baseline.layer_share_ratio) == (0.0, 0.999)
    with pytest.raises(ConfigError, match=r"baseline.layer_share_ratio: 1.0 is out of range; allowed \[0.0, 1.0\)"):
        load_config({"baseline": {"layer_share_ratio": 1.0}})


def test_layer_ranges_checked_against_the_model():
    cfg = load_config({"psaw": {"start_layer": 12}})
    with pytest.raises(ConfigError, match=r"psaw.start_layer: 12 is out of range; allowed 0 <= psaw.start_layer < 12"):
        cfg.resolve(12)


def test_overrides_and_roundtrip(tmp_path):
    cfg = load_config(CONFIGS / "cis.yaml", overrides={"telemetry": {"enabled": True}, "cis": {"tau": 1.5}})
    assert cfg.telemetry.enabled and cfg.cis.tau == 1.5 and cfg.budget.topk == 88
    again = load_config(cfg)
    assert again == cfg
    assert load_config(cfg.to_dict()) == cfg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError):
        load_config(bad)
