"""Speed-ups of the Triton interpreter (``TRITON_INTERPRET=1``) for the CPU test suite. Test
tooling only: the library never touches Triton; tests/conftest.py installs them in the test process,
and the ``subprocess_site`` folder's ``sitecustomize`` in the scripts the tests run as subprocesses.

Each leaves every value a kernel computes unchanged (``tests/test_interpreter_speedups.py`` runs
kernels with and without them):

* ``xor_sum`` in numpy. The interpreter has numpy paths for sum, max and min and reduces anything
  else element by element in Python. ``tl.sort`` runs an ``xor_sum`` in every compare-and-swap of its
  bitonic network (of floats; integers sort in numpy, below): one 2048-key row sort took ~22 s. XOR
  of integers is exact in any order.
* No re-patching of ``triton.language`` in nested calls. The interpreter patches the language
  (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.core``, ``tl.math`` and the tensor
  class) at the start of a kernel run and again, without undoing it, at every call of a
  ``@triton.jit`` helper inside the kernel; the nested patch finds the language already patched and
  changes nothing, but the scan cost ~0.5 ms per call, and a sort makes hundreds. Here a nested call
  patches only the language modules the enclosing run has not patched (none, for this project's
  kernels), and the enclosing run's ``restore`` still undoes everything. Which language modules a
  function's globals hold is looked up once per function (the scan of its globals cost ~0.35 ms).
* No integer overflow check outside debug mode. Every ``+``, ``-`` and ``*`` of integers redoes the
  operation in int64 and compares it with the type's range (~30 % of a kernel's interpreted time),
  only to feed a ``device_assert``, which does nothing unless the interpreter's options set
  ``debug``; with ``debug`` set the check runs as before.
* ``tl.sort`` of integers in numpy. The interpreter runs the bitonic network of ``tl.sort`` op by
  op (a 256-key sort: ~0.1 s); integers sort to one result whatever the method, so inside a kernel
  run an integer ``tl.sort`` along the last axis is ``np.sort``. Floats (where -0.0, +0.0 and NaN
  order as the network leaves them) and any other axis go through the interpreter's own.
* ``_get_np_dtype`` without building its table of 19 types on every call (~8 % of a kernel's
  interpreted time): the numpy type of each scalar type is looked up once.
"""

from __future__ import annotations

import inspect
import os


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Install them under ``TRITON_INTERPRET=1``; returns whether they are installed (idempotent)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    if getattr(ops, "_prhs_speedups", False):
        return True

    generic_reduce = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is tl.standard._xor_combine:
            x = input[0]
            data = x.handle.data
            if self.axis is None:
                out = np.bitwise_xor.reduce(data.reshape(-1), axis=0)
                if self.keep_dims:
                    out = np.reshape(out, [1] * data.ndim)
            else:
                out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(out, x.dtype)
        return generic_reduce(self, input)

    patch_lang = interpreter._patch_lang
    patched: list[set[int]] = []  # the language modules an enclosing kernel run has patched

    class _RunScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            try:
                self.scope.restore()
            finally:
                patched.pop()

    langs_by_fn: dict = {}

    def langs_of(fn) -> frozenset[int]:
        langs = langs_by_fn.get(fn)
        if langs is None:
            langs = langs_by_fn[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs

    def sort(x, dim=None, descending=None):
        axis, desc = tl.core._unwrap_if_constexpr(dim), tl.core._unwrap_if_constexpr(descending)
        if (not isinstance(x, tl.tensor) or not x.dtype.is_int() or x.dtype.is_int1()
                or axis not in (None, len(x.shape) - 1)):
            given = {name: v for name, v in (("dim", dim), ("descending", descending)) if v is not None}
            return tl.standard.sort(x, **given)  # the network (tl.sort is this function during a run)
        data = np.sort(x.handle.data, axis=-1)
        if desc:
            data = np.ascontiguousarray(np.flip(data, axis=-1))
        return tl.tensor(interpreter.TensorHandle(data, x.handle.dtype), x.type)

    def patch_lang_once(fn):
        langs = langs_of(fn)
        if not patched:  # a kernel run (GridExecutor): patch, and forget when it restores
            scope = patch_lang(fn)
            if id(tl) in langs:
                scope.set_attr(tl, "sort", sort)
            patched.append(set(langs))
            return _RunScope(scope)
        if langs <= patched[-1]:  # a helper inside the run: already patched
            return _NothingToRestore()
        patched[-1] |= langs  # as the interpreter: patched until the enclosing run restores
        return patch_lang(fn)

    semantic = interpreter.interpreter_semantic
    sanitize_overflow = semantic.binary_op_sanitize_overflow_impl

    def sanitize_overflow_in_debug(lhs, rhs, binary_op):
        if semantic.builder.options.debug:
            sanitize_overflow(lhs, rhs, binary_op)
        # else: its device_assert would do nothing

    get_np_dtype = interpreter._get_np_dtype
    uint64 = np.dtype(np.uint64)
    np_dtype_of_scalar: dict = {}

    def get_np_dtype_once(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return uint64
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return uint64
            tt_dtype = tt_dtype.element_ty
        np_dtype = np_dtype_of_scalar.get(tt_dtype)
        if np_dtype is None:
            np_dtype = np_dtype_of_scalar[tt_dtype] = get_np_dtype(tt_dtype)
        return np_dtype

    ops.apply_impl = apply_impl
    ops._prhs_generic_apply_impl = generic_reduce
    interpreter._patch_lang = patch_lang_once
    interpreter._prhs_patch_lang = patch_lang
    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow_in_debug
    semantic._prhs_sanitize_overflow = sanitize_overflow
    interpreter._get_np_dtype = get_np_dtype_once
    interpreter._prhs_get_np_dtype = get_np_dtype
    interpreter._prhs_sort = sort
    ops._prhs_speedups = True
    return True
