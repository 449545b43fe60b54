#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the CPU build of PyTorch,
# Triton (its interpreter runs the kernels on a CPU) and prhs-hf with its test extras.
# On a machine with a GPU and a CUDA PyTorch already installed, `pip install -e .[test]` is enough.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q "triton==3.8.0"
# the lowest transformers that pyproject.toml admits, pinned so that every run tests the same one
# (.ci/run also runs the user-facing tests on the highest)
.venv/bin/python -m pip install -q "transformers==5.17.0"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, transformers, triton, prhs_hf; print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__, '| prhs_hf', prhs_hf.__version__)"
