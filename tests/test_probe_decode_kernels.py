"""scripts/probe_decode_kernels.py on the CPU: a quick run (Triton code generator only, 2 layers) that
writes rows for dense and cis, and a CIS layer whose launches name the custom ops and the glue
kernels between them, traced back to prhs_hf's source lines."""

from __future__ import annotations

import json

import pytest

from prhs_hf.ops.triton_support import HAS_TRITON, interpreting
from script_loader import load_script

probe = load_script("probe_decode_kernels")

# the anchor record runs in the composition's launch (dilate_compose_and_record)
CUSTOM_OPS = ("cis_match", "topk_retrieval", "dilate_compose_and_record", "sparse_decode_attention")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run (Triton code generator, 2 layers) for the tests below: its JSON and markdown."""
    if not (HAS_TRITON and interpreting()):
        pytest.skip("needs Triton with TRITON_INTERPRET=1")
    out = tmp_path_factory.mktemp("probe")
    assert probe.main(["--backends", "triton", "--layers", "2", "--out", str(out)]) == 0
    return json.loads((out / "probe_decode_kernels.json").read_text()), (out / "probe_decode_kernels.md").read_text()


@pytest.mark.slow
def test_quick_run_inventories_the_cis_layer(quick_run):
    data, md = quick_run
    for key in ("command", "gpu", "versions", "date", "git_commit", "caveat"):
        assert key in data
    rows = {(t["config"], t["backend"]): t for t in data["table"]}
    assert set(rows) == {("dense", "triton"), ("cis", "triton")}
    dense, cis = rows[("dense", "triton")], rows[("cis", "triton")]
    assert dense["per_layer"]["1"]["custom"] == 0 and dense["per_layer"]["1"]["inductor"] > 0
    # each CIS layer calls the four decode ops once, and needs more launches than a dense layer
    assert cis["per_layer"]["1"]["custom"] == len(CUSTOM_OPS)
    assert cis["per_layer_by_difference"]["all"] > dense["per_layer_by_difference"]["all"]

    layer = data["inventories"]["cis / triton"]
    assert layer, "the CIS layer's launch list is empty"
    names = [r["name"] for r in layer]
    for op in CUSTOM_OPS:
        assert f"torch.ops.prhs.{op}.default" in names, (op, names)
    glue = [r for r in layer if r["kind"] == "inductor"]
    assert glue and all(r["name"].startswith("triton_") for r in glue)
    assert "Caveat" in md and "torch.ops.prhs.topk_retrieval.default" in md


@pytest.mark.slow
def test_compiled_cis_step_writes_the_anchors_in_place(quick_run):
    """CISState.record writes each layer's new anchors into the [L, ...] buffers in place. Through
    views of a layer's slice it became select_scatters: two copies of the slice per layer and a
    copy of the whole state per step (88 + 100 MB per step on Qwen2.5-Coder-1.5B at B32)."""
    from prhs_hf.ops.compose.dilated_set import dilated_set_size

    data, _ = quick_run
    (cis,) = [r for r in data["runs"] if (r["config"], r["backend"]) == ("cis", "triton")]
    layers, batch, heads, dim, s = 2, 2, 4, 16, 16  # the quick run's tiny model and cis.yaml's block
    n = dilated_set_size(88, 88 // 3, 1)
    copies = {batch * heads * s * dim, batch * heads * s * n, layers * batch * heads * s * dim, layers * batch * heads * s * n}
    sizes = [(r["name"], r["numel"].get("xnumel")) for r in cis["launches"] if r["kind"] == "inductor"]
    assert not [x for x in sizes if x[1] in copies], sizes


@pytest.mark.slow
def test_compiled_cis_layer_adds_no_glue_kernels(quick_run):
    """A CIS layer's glue between the custom ops, counted as the launches a second layer adds: no
    inductor kernel more than a dense layer's. It was 3 more with the anchor record as three
    index_put_ kernels and the retrieving flags compared apart (now record_anchors and cis_match's
    second output), 6 with the constant middle start (C_sink, made by torch.full_like) filled again
    for each custom op that reads it, 7 with the anchor state copied through views (the test above);
    and a masked fill of the anchor counts before the first layer made inductor copy the count
    buffer and write it back at the end of the step (outside the layers: checked here too)."""
    data, _ = quick_run
    rows = {(t["config"], t["backend"]): t for t in data["table"]}
    cis, dense = (rows[(c, "triton")]["per_layer_by_difference"]["inductor"] for c in ("cis", "dense"))
    assert cis <= dense, (cis, dense)
    (run,) = [r for r in data["runs"] if (r["config"], r["backend"]) == ("cis", "triton")]
    writes_back = [r["name"] for r in run["launches"] if r["kind"] == "inductor" and r["name"].startswith("triton_poi_fused_copy_")]
    assert not writes_back, writes_back


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1")
def test_compiled_double_sparsity_step_writes_the_label_cache_in_place(tmp_path):
    """Double Sparsity writes the current token's label row into the [L, B, Hq, S, r] label cache in
    place: no kernel of its compiled step touches as much as one layer's label cache (through a view
    of the layer it was a copy of the whole label cache back into the buffer at every step)."""
    assert probe.main(["--configs", "ds", "--backends", "triton", "--layers", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "probe_decode_kernels.json").read_text())
    (ds,) = data["runs"]
    batch, heads, slots, rank = 2, 4, 160 + 3 + 2, 8  # the probe's tiny model, its StaticCache, DS_OVERRIDES
    sizes = [(r["name"], r["numel"].get("xnumel", 0)) for r in ds["launches"] if r["kind"] == "inductor"]
    assert max(n for _, n in sizes) < batch * heads * slots * rank, sizes


def test_bad_options_name_the_allowed_values(capsys):
    with pytest.raises(SystemExit):
        probe.main(["--backends", "cuda"])
    err = capsys.readouterr().err
    assert "--backends" in err and "allowed: triton, cpp" in err
    with pytest.raises(SystemExit):
        probe.main(["--layers", "1"])
    assert "--layers" in capsys.readouterr().err


def test_kind_of_launch_names():
    assert probe.kind_of("triton_poi_fused_add_0") == "inductor"
    assert probe.kind_of("cpp_fused_mul_1") == "inductor"
    assert probe.kind_of("torch.ops.prhs.cis_match.default") == "custom"
    assert probe.kind_of("extern_kernels.mm") == "extern"
