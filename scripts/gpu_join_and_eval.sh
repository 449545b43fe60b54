#!/usr/bin/env bash
# On the GPU machine (a device `run`, from the repository root), after scripts/pack_for_gpu.py's
# piece calls:
#
#   bash scripts/gpu_join_and_eval.sh MODEL_NAME [run_accuracy.py arguments...]
#
# 1. installs the carried wheels (.xfer/whl/*.whl: gguf) into $WORK/site, and makes prhs_hf
#    importable from this checkout (kernels/ as prhs_hf.kernels, as the editable install does);
# 2. joins .xfer/models/MODEL_NAME/*.NNN into one GGUF, checking every sha256 (prhs_hf.fetch.join_pieces);
# 3. exports it once as a plain HF checkpoint in bfloat16 (GGUF dequantisation takes minutes, the
#    checkpoint loads in seconds);
# 4. runs scripts/run_accuracy.py --engine direct on CUDA with the data in .xfer/data, resuming
#    $WORK/results/accuracy.json and stopping before a row that would overrun this call
#    (PRHS_CALL_BUDGET_S, default 560 s of the device's 600 s);
# 5. copies accuracy.json, accuracy.md and the log to $OUT.
#
# Steps 1-3 are skipped when their results are already in $WORK (default /tmp/prhs_gpu, kept
# while the machine stays warm), so the same command can be repeated until no row is left.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 MODEL_NAME [run_accuracy.py args...]" >&2; exit 2; }
NAME=$1; shift
REPO=$PWD
WORK=${PRHS_GPU_WORK:-/tmp/prhs_gpu}
OUT=${OUT:-$WORK/out}
BUDGET=${PRHS_CALL_BUDGET_S:-560}
PIECES=.xfer/models/$NAME
mkdir -p "$WORK" "$OUT" "$WORK/results"
LOG=$OUT/gpu_join_and_eval.log
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

# 1. packages
if [ ! -f "$WORK/site/.done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .xfer/whl/*.whl
  touch "$WORK/site/.done"
fi
rm -rf "$WORK/pkg" && mkdir -p "$WORK/pkg/prhs_hf"
for entry in "$REPO"/prhs_hf/*; do ln -s "$entry" "$WORK/pkg/prhs_hf/"; done
ln -sfn "$REPO/kernels" "$WORK/pkg/prhs_hf/kernels"
export PYTHONPATH=$WORK/pkg:$WORK/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, transformers, gguf, prhs_hf, prhs_hf.kernels; print('torch', torch.__version__, '| transformers', transformers.__version__, '| gguf', gguf.__version__ if hasattr(gguf, '__version__') else '?', '| cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

# 2. join and verify
GGUF_NAME=$(python3 -c "import json; print(json.load(open('$PIECES/MANIFEST.json'))['name'])")
GGUF=$WORK/$GGUF_NAME
if [ ! -f "$GGUF" ]; then
  python3 -c "from prhs_hf.fetch import join_pieces; print(join_pieces('$PIECES', '$GGUF'))"
fi

# 3. export once
CKPT=$WORK/ckpt-$NAME
if [ ! -f "$CKPT/config.json" ]; then
  start=$SECONDS
  python3 -c "from prhs_hf.fetch import export_checkpoint; print(export_checkpoint('$GGUF', '$CKPT.partial', dtype='bfloat16'))"
  rm -rf "$CKPT" && mv "$CKPT.partial" "$CKPT"
  echo "exported $CKPT in $((SECONDS - start)) s"
fi

# 4. evaluate (resumable; arguments given later win over these defaults)
left=$((BUDGET - SECONDS))
python3 scripts/run_accuracy.py --engine direct --model "$CKPT" --device cuda --batch-size 128 \
  --data-dir .xfer/data --out "$WORK/results/accuracy.json" --resume --max-seconds "$left" "$@" || status=$?

# 5. results back
cp "$WORK"/results/accuracy.json "$WORK"/results/accuracy.md "$OUT"/ 2>/dev/null || true
[ -f "$WORK/results/accuracy.samples.jsonl" ] && gzip -c "$WORK/results/accuracy.samples.jsonl" > "$OUT/accuracy.samples.jsonl.gz"
exit "${status:-0}"
