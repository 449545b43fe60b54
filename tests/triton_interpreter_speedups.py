"""Two speed-ups of the Triton interpreter (``TRITON_INTERPRET=1``) for the CPU test suite. Test
tooling only: the library never touches Triton; tests/conftest.py installs them in the test process,
and the ``subprocess_site`` folder's ``sitecustomize`` in the scripts the tests run as subprocesses.

Both leave every value a kernel computes unchanged (``tests/test_interpreter_speedups.py`` runs
kernels with and without them):

* ``xor_sum`` in numpy. The interpreter has numpy paths for sum, max and min and reduces anything
  else element by element in Python. ``tl.sort`` runs an ``xor_sum`` in every compare-and-swap of its
  bitonic network: one 2048-key row sort took ~22 s. XOR of integers is exact in any order.
* No re-patching of ``triton.language`` in nested calls. The interpreter patches the language
  (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.core``, ``tl.math`` and the tensor
  class) at the start of a kernel run and again, without undoing it, at every call of a
  ``@triton.jit`` helper inside the kernel; the nested patch finds the language already patched and
  changes nothing, but the scan cost ~0.5 ms per call, and a sort makes hundreds. Here a nested call
  patches only the language modules the enclosing run has not patched (none, for this project's
  kernels), and the enclosing run's ``restore`` still undoes everything.
"""

from __future__ import annotations

import inspect
import os


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Install both under ``TRITON_INTERPRET=1``; returns whether they are installed (idempotent)."""
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

    def langs_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang_once(fn):
        langs = langs_of(fn)
        if not patched:  # a kernel run (GridExecutor): patch, and forget when it restores
            scope = patch_lang(fn)
            patched.append(langs)
            return _RunScope(scope)
        if langs <= patched[-1]:  # a helper inside the run: already patched
            return _NothingToRestore()
        patched[-1] |= langs  # as the interpreter: patched until the enclosing run restores
        return patch_lang(fn)

    ops.apply_impl = apply_impl
    ops._prhs_generic_apply_impl = generic_reduce
    interpreter._patch_lang = patch_lang_once
    interpreter._prhs_patch_lang = patch_lang
    ops._prhs_speedups = True
    return True
