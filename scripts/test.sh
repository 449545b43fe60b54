#!/usr/bin/env bash
# Run the test suite on a CPU: Triton kernels through the interpreter, GPU tests skipped with
# their reason. Extra arguments go to pytest (e.g. `-m gpu` on a CUDA machine, `-k cis`).
#
# --fast (first argument): the front door only, the files in FAST_TESTS without their slow tests:
# configs, the policy, patching, generate(), the command line and the README's examples (compiled,
# not run). The README gives its time and the whole suite's, measured on a clean clone.
#
# On a CPU the tests run in one pytest-xdist worker per core (PRHS_TEST_WORKERS overrides, 1 runs
# them in this process): the interpreter runs Python single-threaded, so two cores take about
# half the time of one (the test tooling's interpreter speed-ups are in tests/triton_interpreter_speedups.py).
# Each worker gets one torch thread (OMP_NUM_THREADS, unless set) so that they do not contend.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST_TESTS=(tests/test_config.py tests/test_policy.py tests/test_patch.py tests/test_generate.py tests/test_cli.py
            tests/test_readme.py tests/test_bad_input.py)
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not slow and not gpu" "${FAST_TESTS[@]}" "$@"
fi
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec "$PY" -m pytest -q "$@"
fi
WORKERS=${PRHS_TEST_WORKERS:-$(nproc)}
if ! [[ "$WORKERS" =~ ^[1-9][0-9]*$ ]]; then
  echo "PRHS_TEST_WORKERS=$WORKERS: expected a positive integer (1 runs the tests in one process)" >&2
  exit 2
fi
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then
  if "$PY" -c "import xdist" 2>/dev/null; then
    PARALLEL=(-n "$WORKERS" --dist worksteal)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  else
    echo "pytest-xdist is not installed (pip install -e '.[test]'): running the tests in one process" >&2
  fi
fi
TRITON_INTERPRET=1 exec "$PY" -m pytest -q "${PARALLEL[@]}" "$@"
