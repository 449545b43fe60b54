"""The test suite's Triton interpreter speed-ups (tests/triton_interpreter_speedups.py): kernels
compute the same with and without them, the language is restored after a run, and the scripts the
tests run as subprocesses get them too. The kernels here also run on CUDA (no speed-up there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import INTERPRETER_SPEEDUPS, triton_available

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="the speed-ups exist under TRITON_INTERPRET=1 only")
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
TESTS = Path(__file__).resolve().parent


def test_installed_exactly_under_the_interpreter():
    assert INTERPRETER_SPEEDUPS == INTERPRET


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _xor_kernel(X, OUT_ROWS, OUT_COLS, OUT_ALL, OUT_KEEP, M: tl.constexpr, N: tl.constexpr):
        offs_m = tl.arange(0, M)
        offs_n = tl.arange(0, N)
        x = tl.load(X + offs_m[:, None] * N + offs_n[None, :])
        tl.store(OUT_ROWS + offs_m, tl.xor_sum(x, axis=1))
        tl.store(OUT_COLS + offs_n, tl.xor_sum(x, axis=0))
        tl.store(OUT_ALL, tl.xor_sum(tl.reshape(x, [M * N]), axis=0))
        keep = tl.xor_sum(x, axis=0, keep_dims=True)  # [1, N]
        tl.store(OUT_KEEP + offs_n[None, :], keep)

    @triton.jit
    def _wrapping_kernel(X, OUT, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(X + offs)
        tl.store(OUT + offs, x * 65537 + 2_000_000_000 - x)  # int32: wraps

    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def _sort_kernel(X, OUT, N: tl.constexpr, DESCENDING: tl.constexpr):
        offs = tl.arange(0, N)
        x = _twice(tl.load(X + offs))  # a nested helper, then the sort's own
        tl.store(OUT + offs, tl.sort(x, descending=DESCENDING))

    @triton.jit
    def _sort_rows_kernel(X, OUT, M: tl.constexpr, N: tl.constexpr, DESCENDING: tl.constexpr):
        offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(OUT + offs, tl.sort(tl.load(X + offs), descending=DESCENDING))


def _xor_run(x):
    M, N = x.shape
    outs = [torch.empty(M, dtype=x.dtype, device=DEV), torch.empty(N, dtype=x.dtype, device=DEV),
            torch.empty(1, dtype=x.dtype, device=DEV), torch.empty(N, dtype=x.dtype, device=DEV)]
    _xor_kernel[(1,)](x.to(DEV), *outs, M=M, N=N)
    return [o.cpu() for o in outs]


def _wrapping_run(x):
    out = torch.empty_like(x, device=DEV)
    _wrapping_kernel[(1,)](x.to(DEV), out, N=x.numel())
    return out.cpu()


def _sort_run(v, descending):
    out = torch.empty_like(v, device=DEV)
    _sort_kernel[(1,)](v.to(DEV), out, N=v.numel(), DESCENDING=descending)
    return out.cpu()


def _sort_rows_run(x, descending):
    out = torch.empty_like(x, device=DEV)
    _sort_rows_kernel[(1,)](x.to(DEV), out, M=x.shape[0], N=x.shape[1], DESCENDING=descending)
    return out.cpu()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_xor_sum_over_each_axis_equals_numpy(dtype):
    x = torch.randint(-(2**30), 2**30, (8, 16), dtype=dtype)
    rows, cols, whole, keep = _xor_run(x)
    a = x.numpy()
    assert np.array_equal(rows.numpy(), np.bitwise_xor.reduce(a, axis=1))
    assert np.array_equal(cols.numpy(), np.bitwise_xor.reduce(a, axis=0))
    assert whole.item() == int(np.bitwise_xor.reduce(a.reshape(-1)))
    assert np.array_equal(keep.numpy(), np.bitwise_xor.reduce(a, axis=0))


@needs_triton
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_sort_equals_torch_with_ties_and_negatives(dtype, descending):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-50, 50, (256,), generator=g).to(dtype)  # many ties, both signs
    if dtype.is_floating_point:
        x = x / 7
    assert torch.equal(_sort_run(x, descending), torch.sort(x * 2, descending=descending).values)


@needs_triton
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_sort_of_rows_equals_torch(dtype, descending):
    """Each row of a 2-D block sorted on its own; int64 keys packed as the top-k kernels pack them
    (``score << 32 | ~index``, both signs, ties in the score)."""
    g = torch.Generator().manual_seed(4)
    score = torch.randint(-3, 3, (4, 64), generator=g)
    x = (score << 32) | (2147483647 - torch.arange(64)) if dtype == torch.int64 else score.to(dtype) / 3
    assert torch.equal(_sort_rows_run(x, descending), torch.sort(x, dim=-1, descending=descending).values)


@interpreter_only
@pytest.mark.parametrize("dtype,numpy_sorts", [(torch.int64, True), (torch.int32, True), (torch.float32, False)])
def test_integer_sorts_run_in_numpy_and_floats_through_the_network(monkeypatch, dtype, numpy_sorts):
    calls = []
    np_sort = np.sort
    monkeypatch.setattr(np, "sort", lambda *a, **k: calls.append(1) or np_sort(*a, **k))
    x = torch.randint(-9, 9, (2, 16)).to(dtype)
    assert torch.equal(_sort_rows_run(x, True), torch.sort(x, dim=-1, descending=True).values)
    assert bool(calls) == numpy_sorts


@interpreter_only
def test_the_same_bits_as_the_interpreter_alone(monkeypatch):
    """The xor kernel, sorts (one with nested helpers, rows of int64 with ties) and int32 arithmetic
    that wraps, with the speed-ups and with the interpreter's own reduce, language patching (the
    numpy sort comes with it), overflow check and numpy types."""
    from triton.runtime import interpreter

    x = torch.randint(-(2**31), 2**31 - 1, (4, 8), dtype=torch.int32)
    v = torch.randint(-9, 9, (64,), dtype=torch.int32)
    w = torch.randint(-(2**31), 2**31 - 1, (16,), dtype=torch.int32)
    rows = torch.randint(-(2**62), 2**62, (4, 32), dtype=torch.int64)
    rows[:, ::3] = rows[:, :1]  # ties
    both = lambda: [*_xor_run(x), _sort_run(v, True), _wrapping_run(w), _sort_rows_run(rows, False),  # noqa: E731
                    _sort_rows_run(rows, True)]
    fast = both()
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", interpreter.ReduceOps._prhs_generic_apply_impl)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._prhs_patch_lang)
    monkeypatch.setattr(interpreter.interpreter_semantic, "binary_op_sanitize_overflow_impl",
                        interpreter.interpreter_semantic._prhs_sanitize_overflow)
    monkeypatch.setattr(interpreter, "_get_np_dtype", interpreter._prhs_get_np_dtype)
    slow = both()
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


@interpreter_only
def test_the_overflow_check_still_runs_in_debug_mode(monkeypatch):
    """The speed-up skips the integer overflow check only where its ``device_assert`` does nothing:
    with the interpreter's ``debug`` option set, a wrapping int32 product is still reported."""
    from triton.runtime import interpreter

    w = torch.full((16,), 2**30, dtype=torch.int32)
    _wrapping_run(w)  # no debug: wraps silently, as the interpreter alone does
    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True))
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _wrapping_run(w)
    _wrapping_run(torch.arange(16, dtype=torch.int32))  # no overflow: no report


@interpreter_only
def test_the_numpy_type_of_every_triton_type_is_the_interpreters():
    from triton.runtime import interpreter

    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = [*scalars, *(tl.pointer_type(t) for t in scalars), *(tl.block_type(t, [2, 4]) for t in scalars),
             *(tl.block_type(tl.pointer_type(t), [8]) for t in scalars)]
    for t in types * 2:  # the second time from the speed-up's table
        assert interpreter._get_np_dtype(t) == interpreter._prhs_get_np_dtype(t), t


@interpreter_only
def test_a_run_leaves_the_language_as_it_found_it():
    before = {name: getattr(tl, name) for name in ("reduce", "load", "sort", "xor_sum")}
    before_core = {name: getattr(tl.core, name) for name in ("reduce", "associative_scan")}
    _sort_run(torch.arange(16, dtype=torch.int32), False)
    assert {name: getattr(tl, name) for name in before} == before
    assert {name: getattr(tl.core, name) for name in before_core} == before_core


@interpreter_only
def test_a_script_run_as_a_subprocess_gets_them():
    """tests/conftest.py puts the ``subprocess_site`` folder first on the PYTHONPATH they inherit;
    the speed-ups come with ``import triton``, and a script that does not import it does not get it."""
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(TESTS / "subprocess_site")
    for code, expected in (
        ("import triton; from triton.runtime import interpreter; print(interpreter.ReduceOps._prhs_speedups)", "True"),
        ("import sys; print('triton' in sys.modules)", "False"),
    ):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == expected, (code, out.stderr[-2000:])
