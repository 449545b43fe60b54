import dataclasses
import re
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
        ({"cis": {"tail_slot": 1}}, "cis.tail_slot"),
        ({"cis": {"tail_slot": True}, "baseline": {"name": "h2o"}}, "cis.tail_slot"),
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
        ({"cis": {}, "early_select": {"tap": "late"}}, "early_select.tap"),
        ({"cis": {}, "early_select": {"rank": 0}}, "early_select.rank"),
        ({"cis": {}, "early_select": {"rank": 2**16 + 1}}, "early_select.rank"),
        ({"cis": {}, "early_select": {"enabled": 1}}, "early_select.enabled"),
        ({"baseline": {"name": "streaming"}, "early_select": {}}, "early_select"),
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


# --------------------------------------------------------------------------- sections left out are off

SHIPPED_MEANING = {
    # the sections each shipped file switches on, and its budget: the files spell out every section
    "dense": ((False, False, False), (8, 32, 88)),
    "cis": ((True, False, False), (8, 32, 88)),
    "cpe": ((True, True, True), (8, 32, 88)),
    "cpe_longbench": ((True, True, True), (64, 256, 4096)),
    "cis_low_rho": ((True, False, False), (8, 32, 88)),
}


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "0\n", "false\n", "[]\n", "''\n", "---\n"])
def test_empty_or_scalar_yaml_is_an_error_naming_the_file(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml: a PrHS config must be a YAML mapping of sections"):
        load_config(path)


def test_a_section_left_out_is_off():
    cfg = load_config({"cis": {"block_size": 8}})
    assert cfg.cis.enabled and cfg.cis.block_size == 8
    assert not cfg.psaw.enabled and not cfg.etf.enabled and cfg.baseline.name is None
    assert not load_config({"psaw": {"phi": 0.6}}).cis.enabled
    assert load_config({"psaw": {"phi": 0.6}}).psaw.enabled  # a section written is on unless enabled: false
    for cfg in (load_config({}), load_config(None), prhs_hf.PrHSConfig()):
        assert not (cfg.cis.enabled or cfg.psaw.enabled or cfg.etf.enabled or cfg.telemetry.enabled)
        assert cfg.baseline.name is None
        assert (cfg.budget.sink, cfg.budget.local, cfg.budget.topk) == (8, 32, 88)  # neutral defaults kept
        assert (cfg.backend.prefill, cfg.backend.decode) == ("auto", "auto")


@pytest.mark.parametrize("name", sorted(SHIPPED_MEANING))
def test_shipped_configs_keep_their_meaning(name):
    (on, budget) = SHIPPED_MEANING[name]
    for source in (name, CONFIGS / f"{name}.yaml"):
        cfg = load_config(source)
        assert (cfg.cis.enabled, cfg.psaw.enabled, cfg.etf.enabled) == on
        assert (cfg.budget.sink, cfg.budget.local, cfg.budget.topk) == budget
        assert not cfg.telemetry.enabled and cfg.baseline.name is None


def test_shipped_configs_spell_out_every_section():
    import yaml

    for path in sorted(CONFIGS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        for section in ("cis", "psaw", "etf"):
            assert "enabled" in (data.get(section) or {}), f"{path.name}: {section}.enabled is not spelled out"


def test_accuracy_configs_keep_their_meaning(tmp_path, monkeypatch):
    from prhs_hf.evaluation.accuracy import configs as ac

    monkeypatch.chdir(tmp_path)  # they name shipped configs, found from any working directory

    on = {name: (c.cis.enabled, c.psaw.enabled, c.etf.enabled)
          for name, c in ((n, ac.load_named_config(ac.ACCURACY_CONFIGS[n])) for n in ac.ACCURACY_CONFIGS)}
    assert on["dense"] == (False, False, False)
    assert on["cpe"] == (True, True, True)
    assert on["cpe-no-etf"] == (True, True, False) and on["cpe-no-psaw"] == (True, False, True)
    for name in ("cis-s8", "cis-s16", "cis-s20", "cis*", "cis-t0.6", "cis-t0.7", "cis-t0.7-local", "cis-group",
                 "cis-group-mean", "cis-tail",
                 "cis-group-t0.7-local", "hshare-1", "hshare-2", "quest", "h2o", "es-quest", "es-quest-r256", "es-cis",
                 "es-cis-early", "es-cis-r256"):
        assert on[name] == (True, False, False), name
    local, group = (ac.load_named_config(ac.ACCURACY_CONFIGS[n]).cis for n in ("cis-t0.7-local", "cis-group-t0.7-local"))
    assert (local.tau, local.keep_anchor_local, local.selection) == (0.7, True, "head")
    assert (group.tau, group.keep_anchor_local, group.selection) == (0.7, True, "group")
    assert ac.load_named_config(ac.ACCURACY_CONFIGS["cis-group-mean"]).cis.selection == "group_mean"
    # the low-rho-hat row is the shipped cis_low_rho.yaml: cis with tau 0.7, keep_anchor_local, dilation +-2
    low = ac.load_named_config(ac.ACCURACY_CONFIGS["cis-t0.7-local-r2"])
    want = load_config("cis", {"cis": {"block_size": 16, "tau": 0.7, "keep_anchor_local": True, "dilation_radius": 2},
                               "telemetry": {"enabled": True}})
    assert on["cis-t0.7-local-r2"] == (True, False, False) and low == want
    tail, s16 = (ac.load_named_config(ac.ACCURACY_CONFIGS[n]) for n in ("cis-tail", "cis-s16"))
    assert tail.cis.tail_slot and not s16.cis.tail_slot
    assert tail == dataclasses.replace(s16, cis=dataclasses.replace(s16.cis, tail_slot=True))
    # CIS alone at the paper's long-context (LongBench) budget, taken from the shipped cpe_longbench.yaml
    lb, longbench = ac.load_named_config(ac.ACCURACY_CONFIGS["cis-lb"]), load_config("cpe_longbench")
    assert on["cis-lb"] == (True, False, False)
    assert (lb.budget.sink, lb.budget.local, lb.budget.topk) == (64, 256, 4096) and lb.budget == longbench.budget
    assert lb.cis == longbench.cis == s16.cis


def test_only_a_bare_name_resolves_to_a_shipped_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("dense") == load_config(CONFIGS / "dense.yaml")
    assert load_config("cpe_longbench").budget.topk == 4096
    for source in ("experiments/dense.yaml", "dense.yaml", "configs/dense.yaml", "./dense", "experiments/dense"):
        with pytest.raises(ConfigError, match="no such file"):
            load_config(source)
    with pytest.raises(ConfigError, match=r"nope: no such file.*shipped configs: .*cpe.*dense"):
        load_config("nope")
    (tmp_path / "dense.yaml").write_text("cis: {enabled: true}\n")  # a real file wins over the shipped name
    assert load_config("dense.yaml").cis.enabled


@pytest.mark.parametrize(
    "data, key, allowed",
    [
        ({"budget": {"sink": 2**31}}, "budget.sink", "[0, 1048576]"),
        ({"budget": {"local": 2**31}}, "budget.local", "[0, 1048576]"),
        ({"budget": {"topk": 2**40}}, "budget.topk", "[1, 1048576]"),
        ({"cis": {"block_size": 1e9}}, "cis.block_size", "[1, 1048576]"),
        ({"cis": {"dilation_radius": 2**31}}, "cis.dilation_radius", "[0, 1048576]"),
        ({"cis": {"dilation_topm": 2**21}}, "cis.dilation_topm", "[0, 1048576]"),
        ({"baseline": {"page_size": 2**31}}, "baseline.page_size", "[1, 1048576]"),
        ({"baseline": {"seed": 2**64}}, "baseline.seed", "[0, 4294967295]"),
        ({"psaw": {"start_layer": 2**31}}, "psaw.start_layer", "[0, 65536)"),
        ({"etf": {"start_layer": 2**31}}, "etf.start_layer", "[0, 65536)"),
        ({"psaw": {"alpha": 1e300}}, "psaw.alpha", "[0.0, 1000.0]"),
        ({"etf": {"gamma": 1e300}}, "etf.gamma", "[0.0, 1000.0]"),
        ({"cis": {"tau": 1e300}}, "cis.tau", "[-1.0, 2.0]"),
        ({"cis": {"rerank_margin": 2**21}}, "cis.rerank_margin", "[0, 1048576]"),
        ({"cis": {"index_page": 256}}, "cis.index_page", "[4, 128]"),
    ],
)
def test_every_numeric_key_has_an_upper_bound(data, key, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert str(err.value).startswith(f"{key}: ") and f"allowed {allowed}" in str(err.value)


def test_derived_sizes_are_bounded():
    with pytest.raises(ConfigError, match=r"index set .* is 2097152; allowed up to 1048576"):
        load_config({"budget": {"sink": 2**19, "local": 2**19, "topk": 2**20}, "cis": {"dilation_radius": 0}})
    with pytest.raises(ConfigError, match=r"cis.block_size: .*block_size × index set .* allowed up to 16777216"):
        load_config({"budget": {"topk": 2**16}, "cis": {"block_size": 2**10}})
    load_config({"budget": {"topk": 2**16}, "cis": {"enabled": False, "block_size": 2**10}})  # CIS off: no state


def test_resolve_bounds_sizes_by_the_models_positions():
    cfg = load_config("cpe_longbench")
    assert cfg.resolve(32, max_positions=32768).budget_total == 64 + 256 + 4096
    with pytest.raises(ConfigError, match=r"budget.topk: 4096 is out of range for this model; allowed \[1, 2048\] "
                                          r"\(its max_position_embeddings\)"):
        cfg.resolve(32, max_positions=2048)
    with pytest.raises(ConfigError, match=r"cis.block_size: 600 is out of range for this model; allowed \[1, 512\]"):
        load_config({"budget": {"sink": 4, "local": 4, "topk": 4}, "cis": {"block_size": 600}}).resolve(2, max_positions=512)
    # keys nothing uses are not held against the model: dense on a 64-position model
    load_config("dense").resolve(2, max_positions=64)
    with pytest.raises(ConfigError, match="max_positions"):
        cfg.resolve(32, max_positions=0)


@pytest.mark.parametrize("overrides", ["cis.tau=0.7", "{cis: {tau: 0.7}}", ["cis"], 3])
def test_overrides_must_be_a_mapping(overrides):
    with pytest.raises(ConfigError, match=r"overrides must be a mapping of sections.*\{'cis': \{'tau': 0.7\}\}"):
        load_config("cis", overrides=overrides)


def test_yaml_syntax_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("budget: {sink: 8}\ncis: {tau: 0.8\npsaw: {enabled: false}\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+: invalid YAML") as err:
        load_config(bad)
    assert isinstance(err.value.__cause__, Exception)
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("budget:\n\tsink: 8\n")
    with pytest.raises(ConfigError, match=r"tabs\.yaml:2: invalid YAML"):
        load_config(tabs)


@pytest.mark.parametrize(
    "data, text",
    [
        ({"budget": {"topk": "88"}}, "expected an int, got '88'"),
        ({"cis": {"tau": "x"}}, "expected a float, got 'x'"),
        ({"cis": {"dilation_topm": "x"}}, "expected an int or null, got 'x'"),
        ({"budget": {"sink": None}}, "null is not allowed; expected an int in"),
    ],
)
def test_type_messages_use_the_right_article(data, text):
    with pytest.raises(ConfigError, match=re.escape(text)):
        load_config(data)


@pytest.mark.parametrize("name", ["cpe_qwen2.5-coder-1.5b", "cpe_qwen2.5-coder-0.5b"])
def test_calibrated_qwen_config_is_cis_alone(name):
    """What calibration at a 1 % target found for both Qwen2.5-Coder models (no PSAW/ETF schedule
    passes at every layer), so the 1.5B's RULER rows are cis-s16's; a change to a file shows here."""
    assert load_config(name) == load_config("cis")


# --------------------------------------------------------------------------- unreadable files and numpy scalars


def test_a_non_utf8_file_is_a_config_error_naming_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("budget: {sink: 8}\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml:2: not UTF-8 text .*must be UTF-8") as err:
        load_config(bad)
    assert isinstance(err.value.__cause__, UnicodeDecodeError)
    ok = tmp_path / "utf8.yaml"
    ok.write_text("# café\ncis: {tau: 0.7}\n", encoding="utf-8")
    assert load_config(ok).cis.tau == 0.7


def test_a_directory_is_not_reported_as_missing(tmp_path, monkeypatch):
    (tmp_path / "experiments").mkdir()
    monkeypatch.chdir(tmp_path)
    for source in (tmp_path / "experiments", str(tmp_path / "experiments"), "experiments", "."):
        with pytest.raises(ConfigError, match=r"is a directory; a PrHS config is a YAML file or a shipped config "
                                              r"name; shipped configs: .*cpe.*dense") as err:
            load_config(source)
        assert "no such file" not in str(err.value) and not isinstance(err.value, FileNotFoundError)
    assert load_config("dense") == load_config(CONFIGS / "dense.yaml")  # a shipped name still wins


@pytest.mark.parametrize(
    "key, dtype, value, want",
    [
        ("budget.topk", "int64", 4, 4),
        ("budget.sink", "int32", 0, 0),
        ("cis.block_size", "float64", 8.0, 8),  # an integral float is an int, as in Python
        ("psaw.phi", "float32", 0.7, 0.7),
        ("cis.tau", "int64", 1, 1.0),  # an int is a float, as in Python
        ("telemetry.enabled", "bool_", True, True),
        ("cis.keep_anchor_local", "bool_", False, False),
    ],
)
def test_numpy_scalars_are_python_scalars_in_overrides(key, dtype, value, want):
    np = pytest.importorskip("numpy")
    section, name = key.split(".")
    got = getattr(getattr(load_config("cpe", overrides={section: {name: getattr(np, dtype)(value)}}), section), name)
    assert type(got) is type(want) and got == (pytest.approx(want) if isinstance(want, float) else want)


@pytest.mark.parametrize(
    "overrides, text",
    [
        ({"budget": {"topk": ("bool_", True)}}, "budget.topk: expected an int, got True"),
        ({"cis": {"tau": ("bool_", False)}}, "cis.tau: expected a float, got False"),
        ({"cis": {"enabled": ("int64", 1)}}, "cis.enabled: expected true or false, got 1"),
        ({"budget": {"topk": ("float32", 1.5)}}, "budget.topk: expected an int, got 1.5"),
        ({"budget": {"topk": ("int64", 0)}}, "budget.topk: 0 is out of range; allowed [1, 1048576]"),
        ({"psaw": {"phi": ("float64", 1.5)}}, "psaw.phi: 1.5 is out of range; allowed (0.0, 1.0]"),
        ({"etf": {"psi": ("float32", "nan")}}, "etf.psi: expected a finite number, got nan"),
    ],
)
def test_numpy_scalars_follow_the_python_rules(overrides, text):
    np = pytest.importorskip("numpy")
    ((section, keys),) = overrides.items()
    ((key, (dtype, value)),) = keys.items()
    with pytest.raises(ConfigError, match=re.escape(text)):
        load_config("cpe", overrides={section: {key: getattr(np, dtype)(value)}})


@pytest.mark.parametrize(
    "text, key, line",
    [
        ("cis: {tau: 0.7}\npsaw: {phi: 0.6}\ncis: {tau: 0.9}\n", "cis", 3),
        ("cis:\n  tau: 0.7\n  block_size: 8\n  tau: 0.9\n", "tau", 4),
        ("budget: {sink: 8, topk: 88, sink: 4}\n", "sink", 1),
    ],
)
def test_duplicate_yaml_keys_name_the_key_file_and_line(tmp_path, text, key, line):
    dup = tmp_path / "dup.yaml"
    dup.write_text(text)
    with pytest.raises(ConfigError, match=rf"dup\.yaml:{line}: invalid YAML: duplicate key '{key}'"):
        load_config(dup)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text("etf: {<<: {psi: 0.5, gamma: 2.0}, gamma: 3.0}\n")
    assert (load_config(merged).etf.psi, load_config(merged).etf.gamma) == (0.5, 3.0)


@pytest.mark.parametrize("phases", [[], ()])
def test_empty_psaw_phases_is_an_error(phases):
    with pytest.raises(ConfigError, match=r"psaw\.phases: expected a non-empty list drawn from \['prefill', 'decode'\]"
                                          r".*psaw\.enabled: false.*got (\[\]|\(\))"):
        load_config({"psaw": {"phases": phases}})
    assert load_config({"psaw": {"phases": "decode"}}).psaw.phases == ("decode",)


def test_key_index_keys_default_to_no_index_and_name_the_allowed_values():
    cis = load_config("cis").cis
    assert (cis.index, cis.index_page) == ("none", 16) and cis.rerank_margin >= 0
    assert load_config({"cis": {"index": "pages", "index_page": 64, "rerank_margin": 0}}).cis.index_page == 64
    with pytest.raises(ConfigError, match=r"^cis\.index: 'fp4' is not allowed; allowed: none, fp8, int4, pages$"):
        load_config({"cis": {"index": "fp4"}})
    for page in (2, 24, 256):
        with pytest.raises(ConfigError, match=r"^cis\.index_page: .*(power of two|out of range)"):
            load_config({"cis": {"index_page": page}})
    with pytest.raises(ConfigError, match=r"^cis\.rerank_margin: -1 is out of range; allowed \[0, 1048576\]"):
        load_config({"cis": {"rerank_margin": -1}})
    with pytest.raises(ConfigError, match=r"^cis\.rerank_margin: expected an int"):
        load_config({"cis": {"rerank_margin": 1.5}})


def test_sparse_attention_defaults_to_per_head_and_names_the_allowed_values():
    assert load_config("cis_longbench").backend.sparse_attention == "per_head"
    assert load_config({}).backend.sparse_attention == "per_head"
    union = load_config("cis_longbench", {"backend": {"sparse_attention": "group_union"}}).backend
    assert (union.sparse_attention, union.decode) == ("group_union", "auto")
    for bad in ("union", None, 1):
        with pytest.raises(ConfigError, match=r"^backend\.sparse_attention: .* is not allowed; allowed: per_head, "
                                              r"group_union$"):
            load_config({"backend": {"sparse_attention": bad}})


def test_config_index_kinds_are_the_kernels_kinds():
    from prhs_hf.config import CIS_INDEXES
    from prhs_hf.ops.key_index.key_index import INDEX_KINDS

    assert CIS_INDEXES == ("none", *INDEX_KINDS)


@pytest.mark.parametrize(
    "data, text",
    [
        ({"cis": {"index": "fp8"}, "baseline": {"name": "quest"}}, r"applies to CIS .*baseline\.name: quest"),
        ({"cis": {"index": "int4", "enabled": False}}, r"applies to CIS; this config has cis\.enabled: false"),
        ({"cis": {"index": "pages"}, "early_select": {"side_stream": True}}, r"pages cannot run with early_select\.side_stream"),
        ({"cis": {"index": "fp8"}, "backend": {"eager_step": "graphs"}}, r"fp8 cannot run with backend\.eager_step: graphs"),
    ],
)
def test_key_index_is_refused_where_cis_does_not_retrieve_with_it(data, text):
    with pytest.raises(ConfigError, match=r"^cis\.index: " + text):
        load_config(data)
    load_config({**data, "cis": {**data["cis"], "index": "none"}})  # the same config without the index loads
