"""``backend.prefill: flash`` on the CPU: the schedule -> FA4 block-sparse conversion
against a dense mask of the SPEC §3 predicate (padded and chunked batches too), an emulation of
FA4's block-sparse execution (skipped / full / masked tiles) against the reference, the error
paths (no CUDA, no flash_attn, an unsupported GPU, fp32), config validation and the dispatch.
The FA4 kernel itself runs in tests/test_flash_prefill_gpu.py."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import prhs_hf
from prhs_hf import schedules as sched
from prhs_hf.backends import dense_prefill_function, prefill_function
from prhs_hf.config import ConfigError, load_config
from prhs_hf.ops.prefill import flash_prefill as fp
from prhs_hf.ops.prefill import prefill_attention as pa
from prhs_hf.ops.prefill.prefill_attention import prefill_attention_reference
from prhs_hf.ops.prefill.prefill_plan import PrefillPlan, prefill_visibility
from conftest import triton_available
from test_kernels_prefill import Case
from tiny_models import padded_batch, tiny_model


def _schedule(L: int, w: float, sink: int) -> torch.Tensor:
    return sched.psaw_window_start_tensor(torch.arange(1, L + 1), w, sink)


def _dense_visibility(plan: PrefillPlan, kv_len: int) -> torch.Tensor:
    """``[B, Lq, Lk]`` bool: may query row ``r`` see cache slot ``s``, straight from the predicate."""
    B, L = plan.win_lo.shape
    i = plan.q_start[:, None, None] + torch.arange(L)[None, :, None]
    j = torch.arange(kv_len)[None, None, :] - plan.pad[:, None, None]
    flo, fhi = plan.frozen_lo[:, None, None], plan.frozen_hi[:, None, None]
    return prefill_visibility(i, j, plan.win_lo[:, :, None], plan.sink, flo, fhi)


def _dense_kinds(vis: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """Tile kinds of a dense ``[B, Lq, Lk]`` mask (0 skipped, 1 partial, 2 full)."""
    B, L, kv_len = vis.shape
    M, N = -(-L // bm), -(-kv_len // bn)
    kinds = torch.zeros(B, M, N, dtype=torch.int8)
    for b in range(B):
        for m in range(M):
            for n in range(N):
                tile = vis[b, m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
                if tile.any():
                    kinds[b, m, n] = 2 if tile.all() and tile.shape == (bm, bn) else 1
    return kinds


def _unpadded(L: int, w: float, sink: int, flo: int, fhi: int) -> PrefillPlan:
    t = lambda x: torch.tensor([x], dtype=torch.int32)  # noqa: E731
    return PrefillPlan(t(0), t(0), _schedule(L, w, sink)[None], sink, t(flo), t(fhi))


CASES = [
    # L, kv_len, w, sink, frozen_lo, frozen_hi, block
    (256, 256, 0.7, 8, 8, 8, (32, 32)),  # PSAW only
    (300, 300, 0.7, 8, 8, 150, (32, 16)),  # PSAW + ETF, ragged last tiles
    (256, 256, 1.0, 8, 8, 8, (64, 32)),  # dense-equivalent: causal tiles only
    (200, 200, 0.5, 40, 40, 120, (16, 16)),  # a sink wider than a tile, frozen rows across tiles
    (130, 130, 0.9, 0, 0, 0, (32, 32)),  # no sink
]

#: batched cases of the prefill contract (test_kernels_prefill.Case): padding, chunked prefill, GQA
BATCHED = [
    Case("left_padding", B=3, Lq=71, pads=(0, 3, 19), w=0.7, frozen=((4, 30), (4, 9), (4, 4))),
    Case("chunked_prefill", B=2, Lq=41, prefix=30, pads=(0, 6), w=0.5),
    Case("padding_rows_whole_tiles", B=2, Lq=96, pads=(0, 40), sink=8, w=0.6, frozen=((8, 50), (8, 20))),
    Case("gqa_psaw_etf", Hq=6, Hkv=2, Lq=90, w=0.5, frozen=((4, 40),)),
    Case("all_rows_frozen", sink=0, Lq=33, frozen=((0, 33),)),
    Case("dense_pattern_padded", B=2, Lq=50, pads=(0, 13), sink=0),
]


def _check_blocks(got: fp.FlashBlockSparse, want: torch.Tensor, block) -> None:
    assert torch.equal(got.kinds, want)
    assert got.block_size == block
    B, M, N = want.shape
    for name, kind in (("mask", 1), ("full", 2)):
        cnt, idx = getattr(got, f"{name}_block_cnt"), getattr(got, f"{name}_block_idx")
        assert cnt.dtype == idx.dtype == torch.int32 and cnt.is_contiguous() and idx.is_contiguous()
        assert tuple(cnt.shape) == (B, 1, M) and tuple(idx.shape) == (B, 1, M, N)
        for b in range(B):
            for m in range(M):
                cols = (want[b, m] == kind).nonzero().flatten().to(torch.int32)
                assert int(cnt[b, 0, m]) == cols.numel()
                assert torch.equal(idx[b, 0, m, : cols.numel()], cols)  # ascending, packed left


@pytest.mark.parametrize("L,kv_len,w,sink,flo,fhi,block", CASES)
def test_block_sparse_tensors_match_the_dense_mask(L, kv_len, w, sink, flo, fhi, block):
    plan = _unpadded(L, w, sink, flo, fhi)
    got = fp.fa4_block_sparse(plan, kv_len, block)
    _check_blocks(got, _dense_kinds(_dense_visibility(plan, kv_len), *block), block)


@pytest.mark.parametrize("block", [(32, 32), (16, 32), (64, 16)])
@pytest.mark.parametrize("case", BATCHED, ids=lambda c: c.name)
def test_block_sparse_tensors_of_padded_batches_match_the_dense_mask(case, block):
    _, k, _, plan, _ = case.tensors()
    got = fp.fa4_block_sparse(plan, k.shape[2], block)
    _check_blocks(got, _dense_kinds(_dense_visibility(plan, k.shape[2]), *block), block)


def test_padding_slots_and_rows_are_skipped():
    case = BATCHED[2]  # pads (0, 40): sequence 1's slots 0..39 and rows 0..39 are padding
    _, k, _, plan, _ = case.tensors()
    kinds = fp.fa4_block_sparse(plan, k.shape[2], (16, 16)).kinds
    assert bool((kinds[1, :, :2] == 0).all()) and bool((kinds[1, :2] == 0).all())
    assert bool((kinds[0, :, 0] > 0).any())  # the unpadded sequence's sinks
    assert int(kinds[1, 2, 2]) == 1  # the tile holding the first real row and slot (40): partial


@pytest.mark.parametrize("L,w,sink,fhi", [(257, 0.7, 8, 100), (512, 0.6, 4, 4)])
def test_visible_pairs_per_tile_sum_to_the_schedule(L, w, sink, fhi):
    pairs, capacity = fp.visible_per_block(_unpadded(L, w, sink, sink, fhi), L, 64, 32)
    assert int(pairs.sum()) == sched.visible_pairs(L, w, sink, sink, fhi)
    assert bool((pairs <= capacity).all())


def _emulate_block_sparse(q, k, v, blocks: fp.FlashBlockSparse, plan: PrefillPlan, scale):
    """FA4's block-sparse forward in PyTorch: only the listed tiles are computed, full tiles
    without a mask, partial tiles with the mask_mod's predicate (in slot coordinates, as the CuTe
    mask_mod evaluates it); a row that sees nothing is zero."""
    B, Hq, Lq, D = q.shape
    G = Hq // k.shape[1]
    Lk = k.shape[2]
    bm, bn = blocks.block_size
    kk, vv = k.repeat_interleave(G, 1).double(), v.repeat_interleave(G, 1).double()
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * scale
    keep = torch.zeros(B, Lq, Lk, dtype=torch.bool)
    vis = _dense_visibility(plan, Lk)
    for b in range(B):
        for m in range(blocks.kinds.shape[1]):
            rows = slice(m * bm, (m + 1) * bm)
            for name, masked in (("full", False), ("mask", True)):
                cnt = int(getattr(blocks, f"{name}_block_cnt")[b, 0, m])
                for n in getattr(blocks, f"{name}_block_idx")[b, 0, m, :cnt].tolist():
                    cols = slice(n * bn, (n + 1) * bn)
                    keep[b, rows, cols] = vis[b, rows, cols] if masked else True
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", probs, vv).float()


@pytest.mark.parametrize("case", BATCHED, ids=lambda c: c.name)
def test_emulated_block_sparse_execution_equals_the_reference(case):
    """Full tiles run unmasked, skipped tiles not at all: the result is still exact."""
    q, k, v, plan, scale = case.tensors(seed=3)
    blocks = fp.fa4_block_sparse(plan, k.shape[2], (16, 16))
    assert bool((blocks.kinds != 1).any())  # skipped or full tiles: not everything goes through the mask
    out = _emulate_block_sparse(q, k, v, blocks, plan, scale)
    torch.testing.assert_close(out, prefill_attention_reference(q, k, v, plan, scale), atol=1e-5, rtol=1e-5)


def _fa4_emulated(q, k, v, blocks: fp.FlashBlockSparse, aux: list[torch.Tensor], scale: float) -> torch.Tensor:
    """:func:`_emulate_block_sparse` called as the route calls FA4: the plan rebuilt from the aux
    tensors, as the CuTe mask_mod reads it (``win_lo`` padded to whole query tiles)."""
    win, geo = aux
    Lq = q.shape[2]
    assert win.shape[1] == blocks.kinds.shape[1] * blocks.block_size[0] >= Lq
    plan = PrefillPlan(geo[:, 0], geo[:, 1], win[:, :Lq], int(geo[0, 4]), geo[:, 2], geo[:, 3])
    return _emulate_block_sparse(q, k, v, blocks, plan, scale).to(q.dtype)


@pytest.mark.parametrize("case", BATCHED, ids=lambda c: c.name)
def test_the_route_hands_fa4_the_plan_as_tiles_and_aux_tensors(case, monkeypatch):
    """``flash_prefill_attention`` and the padded dense route on the CPU, FA4 emulated: the plan
    reaches FA4 as its tiles and aux tensors, and the result is the reference's."""
    monkeypatch.setattr(fp, "require_flash_attn", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp, "flash_block_sparse_attention", _fa4_emulated)
    q, k, v, plan, scale = case.tensors(torch.bfloat16, seed=4)
    out = fp.flash_prefill_attention(q, k, v, plan, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (case.B, case.Lq, case.Hq, case.D)
    torch.testing.assert_close(out.float(), prefill_attention_reference(q, k, v, plan, scale).float(), atol=1e-2, rtol=1e-2)
    dense = PrefillPlan.dense_causal(plan.pad, plan.q_start, case.Lq)
    out = fp.flash_dense_prefill_attention(q, k, v, plan.pad, plan.q_start, scale, no_mask=False)
    torch.testing.assert_close(out.float(), prefill_attention_reference(q, k, v, dense, scale).float(), atol=1e-2, rtol=1e-2)


def test_the_route_checks_the_plan_then_refuses_the_cpu():
    q, k, v, plan, scale = BATCHED[0].tensors(torch.bfloat16)
    with pytest.raises(ValueError, match="win_lo"):
        fp.flash_prefill_attention(q, k, v, dataclasses.replace(plan, win_lo=plan.win_lo[:, 1:]), scale)
    with pytest.raises(RuntimeError, match=r"backend.prefill: flash.*NVIDIA GPU"):
        fp.flash_prefill_attention(q, k, v, plan, scale)
    with pytest.raises(RuntimeError, match=r"backend.prefill: flash.*NVIDIA GPU"):
        fp.flash_dense_prefill_attention(q, k, v, plan.pad, plan.q_start, scale, no_mask=False)


def test_mask_aux_tensors_carry_the_geometry():
    plan = BATCHED[0].tensors()[3]
    win, geo = fp.mask_aux_tensors(plan)
    assert win.dtype == geo.dtype == torch.int32 and win.is_contiguous() and geo.is_contiguous()
    assert torch.equal(win, plan.win_lo)
    want = torch.stack([plan.pad, plan.q_start, plan.frozen_lo, plan.frozen_hi, torch.full_like(plan.pad, plan.sink)], dim=1)
    assert torch.equal(geo, want)
    padded, _ = fp.mask_aux_tensors(plan, rows=96)  # whole 32-row tiles
    assert padded.shape == (3, 96) and padded.is_contiguous() and torch.equal(padded[:, :71], plan.win_lo)
    assert bool((padded[:, 71:] == plan.win_lo[:, -1:]).all())


@pytest.mark.parametrize("cap,d,want", [((9, 0), 128, (128, 128)), ((9, 0), 64, (128, 128)), ((9, 0), 256, (128, 64)),
                                        ((10, 0), 128, (256, 128))])
def test_block_size_per_gpu(cap, d, want):
    assert fp.fa4_block_size(cap, d) == want


# ----------------------------------------------------------------------------- errors


def test_no_cuda_device_is_refused_with_the_key_and_the_alternatives():
    with pytest.raises(RuntimeError, match=r"backend.prefill: flash.*NVIDIA GPU.*triton, flex, torch or auto"):
        fp.require_flash_attn(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="backend.prefill: flash"):
        prefill_function("flash", torch.device("cpu"), torch.bfloat16, 64)
    with pytest.raises(RuntimeError, match="backend.prefill: flash"):
        dense_prefill_function("flash", torch.device("cpu"), torch.bfloat16, 64)


def test_missing_flash_attn_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn.cute -> ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(RuntimeError) as info:
        fp.import_flash_attn()
    msg = str(info.value)
    for text in ("backend.prefill: flash", "flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl==4.8.1",
                 "nvidia-cutlass-dsl-libs-cu13", "CUDA 13 driver", "dsl_packages", "triton, flex, torch or auto"):
        assert text in msg, text


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (12, 0)])
def test_an_unsupported_gpu_is_refused(cap):
    with pytest.raises(RuntimeError, match=r"backend.prefill: flash.*sm90/sm100.*%d\.%d" % cap):
        fp.check_flash_capability(cap)


@pytest.mark.parametrize("cap", [(9, 0), (10, 0), (10, 3)])
def test_sm90_and_sm100_are_accepted(cap):
    fp.check_flash_capability(cap)


def test_fp32_and_odd_head_sizes_are_refused_not_cast():
    with pytest.raises(ValueError, match=r"backend.prefill: flash.*fp16/bf16.*float32"):
        fp.check_flash_inputs(torch.zeros(1, 2, 3, 64))
    with pytest.raises(ValueError, match=r"backend.prefill: flash.*head sizes"):
        fp.check_flash_inputs(torch.zeros(1, 2, 3, 20, dtype=torch.bfloat16))
    fp.check_flash_inputs(torch.zeros(1, 2, 3, 128, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- config and dispatch


def test_config_accepts_flash_and_lists_it_in_the_error():
    assert load_config(None, {"backend": {"prefill": "flash"}}).backend.prefill == "flash"
    with pytest.raises(ConfigError, match=r"backend.prefill: 'flash4' is not allowed; allowed: .*flex, flash"):
        load_config(None, {"backend": {"prefill": "flash4"}})


def test_prefill_routes_per_backend_name_on_the_cpu():
    """Without CUDA, ``auto`` is the PyTorch reference, and the dense layers keep the model's own
    attention (SDPA) for every name but ``flash``."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert prefill_function("auto", cpu, bf16, 64) is pa.prefill_attention_reference
    for name in ("auto", "torch", "flex", "triton"):
        if name != "triton" or triton_available():
            assert dense_prefill_function(name, cpu, bf16, 64) is None


def test_auto_takes_flash_where_it_runs_for_what_fa4_takes(monkeypatch):
    """``auto`` on a GPU where FA4 runs: FA4 for fp16/bf16 attention with a head size it has; else the
    Triton kernel for the PSAW/ETF layers and SDPA (None) for the dense ones, which ran faster than
    our Triton kernel on the dense pattern (docs/results/bench_prefill.md)."""
    import prhs_hf.backends as backends

    monkeypatch.setattr(backends, "flash_usable", lambda device: True)
    monkeypatch.setattr(fp, "require_flash_attn", lambda device: None)
    gpu = torch.device("cuda", 0)
    for dtype in (torch.bfloat16, torch.float16):
        assert backends.prefill_function("auto", gpu, dtype, 128) is fp.flash_prefill_attention
        assert backends.dense_prefill_function("auto", gpu, dtype, 128) is fp.flash_dense_prefill_attention
    monkeypatch.setattr(backends, "triton_usable", lambda device: True)
    for dtype, head_dim in ((torch.float32, 128), (torch.bfloat16, 20)):
        assert backends.prefill_function("auto", gpu, dtype, head_dim) is pa.prefill_attention
        assert backends.dense_prefill_function("auto", gpu, dtype, head_dim) is None
    # asked for by name, flash stays flash (its own errors name what FA4 refuses at the call)
    assert backends.prefill_function("flash", gpu, torch.float32, 128) is fp.flash_prefill_attention
    assert backends.dense_prefill_function("flash", gpu, torch.float32, 128) is fp.flash_dense_prefill_attention
    assert backends.dense_prefill_function("triton", gpu, torch.bfloat16, 128) is None
    # where FA4 cannot run, auto is the Triton kernel for the sparse layers, SDPA for the dense ones
    monkeypatch.setattr(backends, "flash_usable", lambda device: False)
    assert backends.prefill_function("auto", gpu, torch.bfloat16, 128) is pa.prefill_attention
    assert backends.dense_prefill_function("auto", gpu, torch.bfloat16, 128) is None


def test_flash_usable_is_false_off_cuda_and_without_fa4(monkeypatch):
    import prhs_hf.backends as backends

    assert backends.flash_usable(torch.device("cpu")) is False
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    fp._require.cache_clear()
    assert backends.flash_usable(torch.device("cuda", 0)) is False


CPE = {"budget": {"sink": 4, "local": 8, "topk": 8}, "psaw": {"enabled": True}, "etf": {"enabled": True}}


@pytest.mark.parametrize("config", [CPE, {"budget": {"sink": 4, "local": 8, "topk": 8}, "cis": {"block_size": 4}}],
                         ids=["psaw_etf_layers", "dense_prefill_layers_only"])
def test_the_first_prefill_on_the_cpu_raises_naming_the_key(config):
    model = tiny_model("llama")
    ids, mask = padded_batch([20, 13])
    prhs_hf.patch(model, config, overrides={"backend": {"prefill": "flash"}})
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="backend.prefill: flash"):
            model(ids, attention_mask=mask)
    finally:
        prhs_hf.unpatch(model)


def test_dense_config_with_flash_keeps_the_unpatched_path():
    """A config that changes nothing never reaches FA4 (so it runs anywhere, bit-equal)."""
    model = tiny_model("llama")
    ids, mask = padded_batch([20, 13])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        prhs_hf.patch(model, "dense", overrides={"backend": {"prefill": "flash"}})
        try:
            got = model(ids, attention_mask=mask).logits
        finally:
            prhs_hf.unpatch(model)
    assert torch.equal(got, want)
