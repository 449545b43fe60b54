"""scripts/selection_quality.py end to end on a tiny random llama and local CoQA rows (``--quick``):
the rows, the matched controls, and the numbers that must hold for any model."""

from __future__ import annotations

import json

from lm_eval_fixtures import save_tiny_checkpoint, write_local_data
from script_loader import load_script


def _load_script():
    return load_script("selection_quality")


def test_quick_run_on_local_data(tmp_path) -> None:
    selection_quality = _load_script()
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    data_dir = write_local_data(tmp_path / "data")  # --data-dir: nothing is fetched
    out = tmp_path / "out"
    assert selection_quality.main(["--model", str(checkpoint), "--data-dir", str(data_dir), "--datasets", "coqa",
                                   "--quick", "--sink", "4", "--local", "8", "--topk", "16",
                                   "--out-dir", str(out)]) == 0
    report = json.loads((out / "selection_quality.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert report["meta"]["prompts"] == 2 and all(n.startswith("coqa/") for n in report["meta"]["prompt_names"])
    assert {"CIS-main", "Quest", "H2O", "StreamingLLM", "Oracle top-k"} <= set(rows)
    assert any(v.startswith("HShare-matched@CIS-main") for v in rows)
    oracle, cis = rows["Oracle top-k"], rows["CIS-main"]
    # β_emp is measured against the best key set of the same size, so it is never negative; among
    # selectors that keep as many keys, sink ∪ exact top-k ∪ local keeps the most attention mass
    assert all(r["beta_emp"] >= -1e-6 for r in rows.values())
    same_size = [r for r in rows.values() if abs(r["processed_kv"] - oracle["processed_kv"]) < 1e-6]
    assert {"Quest", "H2O", "StreamingLLM"} <= {r["variant"] for r in same_size}
    assert all(oracle["beta_emp"] <= r["beta_emp"] + 1e-6 for r in same_size)
    assert oracle["rho_hat"] == 1 and rows["StreamingLLM"]["rho_hat"] == 0
    assert 0 < cis["rho_hat"] <= 1 and 0 <= cis["overlap_top50"] <= 1
    assert "CIS-main β_emp" in (out / "selection_quality.md").read_text()
    tail = rows["CIS + tail"]  # cis.tail_slot beside CIS-main, within CIS's index capacity (4 + 8 + 16 + 2 * 5)
    assert tail["family"] == "cis_tail" and tail["settings"]["tail_slot"] is True
    assert 4 + 8 + 16 <= tail["processed_kv"] <= 4 + 8 + 16 + 10 and 0 < tail["rho_hat"] <= 1

    # --replot measures nothing: it draws the saved report's plots beside it, named after it
    import importlib.util as _util

    has_mpl = _util.find_spec("matplotlib") is not None
    saved = out / "selection_quality.json"
    assert selection_quality.main(["--replot", str(saved)]) == (0 if has_mpl else 1)
    plots = json.loads(saved.read_text())["meta"]["plots"]
    assert plots == ([f"selection_quality_{n}.png" for n in ("beta_rho", "certificate", "overlap")] if has_mpl else [])
    assert all((out / p).is_file() for p in plots)


def _run_schedule(tmp_path, schedule: str, *extra: str) -> dict[str, dict]:
    """``--quick --schedule SCHEDULE`` on the tiny GQA llama and local CoQA rows: its rows by variant."""
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    data_dir = write_local_data(tmp_path / "data")
    out = tmp_path / "out"
    assert _load_script().main(["--model", str(checkpoint), "--data-dir", str(data_dir), "--datasets", "coqa",
                                "--quick", "--sink", "4", "--local", "8", "--topk", "16", "--schedule", schedule,
                                "--name", f"sq_{schedule}", "--out-dir", str(out), *extra]) == 0
    return {r["variant"]: r for r in json.loads((out / f"sq_{schedule}.json").read_text())["rows"]}


def test_group_schedule_compares_the_group_rankings_with_per_head_cis(tmp_path) -> None:
    """``--schedule group`` on the tiny GQA llama (4 query / 2 KV heads): per-head CIS, group max and
    group mean at s = 16 and s = 1, and the oracle. At s = 1 every step retrieves, so per-head CIS is
    the oracle and a group set (one per KV head) keeps at most as much of each head's mass."""
    rows = _run_schedule(tmp_path, "group")
    groups = [f"{tag} group {score}" for tag in ("CIS-main", "CIS s=1") for score in ("max", "mean")]
    assert set(rows) == {"CIS-main", "CIS s=1", "Oracle top-k", *groups}
    for name, selection in zip(groups, ("group", "group_mean") * 2):
        assert rows[name]["family"] == "cis_group" and rows[name]["settings"]["selection"] == selection
    assert "selection" not in rows["CIS-main"]["settings"] and rows["CIS-main"]["family"] == "cis"
    exact = rows["CIS s=1"]
    assert exact["rho_hat"] == 1 and abs(exact["beta_emp"] - rows["Oracle top-k"]["beta_emp"]) < 1e-6
    for score in ("max", "mean"):
        assert rows[f"CIS s=1 group {score}"]["beta_emp"] >= exact["beta_emp"] - 1e-6


def test_low_rho_schedule_on_calibration_text(tmp_path) -> None:
    """``--text`` takes the prompts from text that is no evaluation set's (packed as prhs-hf calibrate
    packs it, each prompt forced on with the text that follows it); ``--schedule low_rho`` runs the
    CIS settings meant for ρ̂ ≤ 10 % with their keys, and the oracle."""
    selection_quality = _load_script()
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    text = tmp_path / "calib.txt"
    text.write_text("The keeper logs the wind, the sea and the boats every evening at the lighthouse. " * 60)
    out = tmp_path / "out"
    assert selection_quality.main(["--model", str(checkpoint), "--text", str(text), "--length", "96", "--prompts", "2",
                                   "--max-new-tokens", "12", "--sink", "4", "--local", "8", "--topk", "16",
                                   "--schedule", "low_rho", "--name", "sq_low", "--out-dir", str(out)]) == 0
    report = json.loads((out / "sq_low.json").read_text())
    assert report["meta"]["prompt_names"] == ["text/0", "text/1"] and report["meta"]["prompt_tokens"] == [96, 96]
    rows = {r["variant"]: r for r in report["rows"]}
    assert {"CIS-main", "CIS τ=0.7", "CIS τ=0.7 + local", "CIS τ=0.7 + local, r=2", "Oracle top-k"} <= set(rows)
    assert rows["CIS τ=0.7 + local, r=2"]["settings"]["dilation_radius"] == 2
    assert rows["CIS s=32 τ=0.8 + local"]["settings"]["block_size"] == 32
    assert all(96 < r["mean_context"] <= 96 + 12 for r in rows.values())  # 12 forced steps after 96 tokens


def test_a_missing_text_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys) -> None:
    selection_quality = _load_script()

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --text was checked")

    monkeypatch.setattr(selection_quality.fetch, "load_model", no_loading)
    assert selection_quality.main(["--text", str(tmp_path / "none.txt"), "--out-dir", str(tmp_path)]) == 2
    assert "--text: no such file or folder" in capsys.readouterr().err


def test_seeds_schedule_runs_the_seed_systems_beside_cis(tmp_path) -> None:
    """``--schedule seeds``: CIS-main, CIS + tail, the EarlySelectKV rows, Double Sparsity, CertKV and
    the oracle at one budget, each with its selection quality; the GQA model's CIS rows carry the
    share of KV groups that retrieve (between ρ̂ and 1)."""
    rows = _run_schedule(tmp_path, "seeds")
    assert {"CIS-main", "CIS + tail", "Double Sparsity", "CertKV", "Oracle top-k"} <= set(rows)
    assert {r["family"] for r in rows.values()} >= {"cis", "cis_tail", "double_sparsity", "certkv", "oracle"}
    assert {"es_quest", "es_cis"} <= {r["family"] for r in rows.values()}
    assert not {"Quest", "H2O", "StreamingLLM"} & set(rows)
    cis = rows["CIS-main"]
    assert cis["rho_hat"] <= cis["kv_group_rho_hat"] <= 1
    assert all(r["beta_emp"] >= -1e-6 for r in rows.values())


def test_key_index_schedule_compares_each_retrieval_with_the_exact_one(tmp_path) -> None:
    """``--schedule key_index``: CIS without an index, then fp8 and pages (int4 needs a head size of
    32k; the tiny llama's is 16) at each margin. A margin covering the middle retrieves exactly the
    exact top-k (overlap 1, the same β_emp); margin 0 reads fewer bytes than it; no index reads as many."""
    rows = _run_schedule(tmp_path, "key_index", "--margins", "0,4096", "--page-size", "4")
    assert set(rows) == {"CIS index none", *(f"CIS index {k} m={m}" for k in ("fp8", "pages") for m in (0, 4096))}
    none = rows["CIS index none"]
    assert none["retrieval_overlap"] is None and none["retrieval_bytes_ratio"] == 1
    for kind in ("fp8", "pages"):
        covering, tight = rows[f"CIS index {kind} m=4096"], rows[f"CIS index {kind} m=0"]
        assert covering["retrieval_overlap"] == 1 and covering["beta_emp"] == none["beta_emp"]
        assert covering["settings"]["rerank_margin"] == 4096 and covering["settings"]["index"] == kind
        assert 0 < tight["retrieval_overlap"] <= 1
        assert tight["retrieval_bytes_ratio"] < covering["retrieval_bytes_ratio"]
    assert rows["CIS index fp8 m=0"]["retrieval_overlap"] < 1  # the index decides something at margin 0
    report = (tmp_path / "out" / "sq_key_index.md").read_text()
    assert "top-k overlap with exact" in report and "CIS index fp8 m=0: overlap" in report


def test_share_prefill_prefills_each_prompt_once_and_measures_the_same(tmp_path, monkeypatch) -> None:
    """``--share-prefill``: the dense model prefills all but each prompt's last tokens once, and every
    row (the dense pass too) starts from a copy of that cache, prefilling only the prompt's tail; CIS
    starts over at that prefill and its key index covers the whole prompt (a covering margin gives
    the exact retrieval), and the rows are those of the run that prefills every prompt in each row."""
    selection_quality = _load_script()
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    text = tmp_path / "calib.txt"
    text.write_text("The keeper logs the wind, the sea and the boats every evening at the lighthouse. " * 60)
    loaded = selection_quality.fetch.load_model
    forwards: list[int] = []  # the query tokens of every forward

    def counted(*args, **kwargs):
        model, tokenizer = loaded(*args, **kwargs)
        model.model.embed_tokens.register_forward_hook(lambda mod, inputs, out: forwards.append(inputs[0].shape[1]))
        return model, tokenizer

    monkeypatch.setattr(selection_quality.fetch, "load_model", counted)
    reports = {}
    for share in (False, True):
        forwards.clear()
        name = f"sq_share_{share}"
        assert selection_quality.main(["--model", str(checkpoint), "--text", str(text), "--length", "96", "--prompts",
                                       "2", "--max-new-tokens", "8", "--sink", "4", "--local", "8", "--topk", "16",
                                       "--schedule", "key_index", "--margins", "0,4096", "--page-size", "4",
                                       "--name", name, "--out-dir", str(tmp_path / "out"),
                                       *(["--share-prefill"] if share else [])]) == 0
        reports[share] = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        rows = len(reports[share]["rows"])
        prefills = [n for n in forwards if n > 1]
        tail = selection_quality.SHARED_PREFILL_TAIL
        # each prompt's prefix once, then its tail in the dense pass and in every row; unshared: the whole prompt
        whole = [96] * 2 * (rows + 1)
        assert sorted(prefills) == (sorted([96 - tail] * 2 + [tail] * 2 * (rows + 1)) if share else whole)
    assert reports[True]["meta"]["shared_prefill_tail"] == selection_quality.SHARED_PREFILL_TAIL
    assert reports[False]["meta"]["shared_prefill_tail"] is None
    shared = {r["variant"]: r for r in reports[True]["rows"]}
    for row in reports[False]["rows"]:
        for key in ("rho_hat", "beta_emp", "overlap", "retrieval_overlap", "retrieval_bytes_ratio", "hidden_rel_err"):
            if row[key] is None:
                assert shared[row["variant"]][key] is None
            else:
                assert abs(shared[row["variant"]][key] - row[key]) <= 1e-4, (row["variant"], key)
    assert shared["CIS index fp8 m=4096"]["retrieval_overlap"] == 1
    assert "prefilled once by the dense model" in (tmp_path / "out" / "sq_share_True.md").read_text()
    assert "prefilled once" not in (tmp_path / "out" / "sq_share_False.md").read_text()
