#!/usr/bin/env bash
# Run the test suite on a CPU: Triton kernels through the interpreter, GPU tests skipped with
# their reason. Extra arguments go to pytest (e.g. `-m gpu` on a CUDA machine, `-k cis`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec "$PY" -m pytest -q "$@"
fi
TRITON_INTERPRET=1 exec "$PY" -m pytest -q "$@"
