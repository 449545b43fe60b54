#!/usr/bin/env bash
# On the GPU machine (a device `run`, from the repository root), after tools/pack_for_gpu.py's
# piece calls:
#
#   bash tools/gpu_join_and_eval.sh MODEL_NAME [run_accuracy.py arguments...]
#
# A path carried by one device call is removed before the next call unless that call carries it
# again; /tmp stays while the machine is warm. So the piece calls stage what they carry in
# $PRHS_STAGE (default /tmp): data/, whl/ and pieces/MODEL_NAME/ (the pieces, MANIFEST.json and
# the .sha256). Each input is taken from .xfer/ when it is there, else from the stage; pieces
# carried into .xfer/models/MODEL_NAME without a manifest are added to the staged ones. So the
# same command, carrying nothing, resumes the evaluation.
#
# 1. installs the wheels (whl/*.whl: gguf) into $WORK/site, and makes prhs_hf importable from this
#    checkout (PYTHONPATH: the checkout's root, then $WORK/site);
# 2. joins the pieces into one GGUF, checking every sha256 (tools/gpu_transfer.py join);
# 3. exports it once as a plain HF checkpoint in bfloat16 (GGUF dequantisation takes minutes, the
#    checkpoint loads in seconds); with PRHS_CALIBRATE set, then calibrates PSAW/ETF once (3b below);
# 4. runs scripts/run_accuracy.py --engine direct on CUDA with the staged data, resuming
#    $WORK/results/accuracy.json and stopping before a row that would overrun this call
#    (PRHS_CALL_BUDGET_S, default 560 s of the device's 600 s);
#    (with PRHS_EXPORT_ONLY=1 it stops after step 3, printing the checkpoint's path);
# 5. copies the reports in $WORK/results (accuracy.json/.md and any other --out there), the gzipped
#    generations and the log to $OUT.
#
# Steps 1-3 are skipped when their results are already in $WORK (default /tmp/prhs_gpu, kept
# while the machine stays warm), so the same command can be repeated until no row is left.
#
# The inline Python and tools/gpu_transfer.py run as `python3 -P` (Python >= 3.11): sys.path is then
# PYTHONPATH's folders (the checkout's root, $WORK/site) and the interpreter's, not the working
# directory or the script's folder.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 MODEL_NAME [run_accuracy.py args...]" >&2; exit 2; }
NAME=$1; shift
REPO=$PWD
WORK=${PRHS_GPU_WORK:-/tmp/prhs_gpu}
STAGE=${PRHS_STAGE:-/tmp}
OUT=${OUT:-$WORK/out}
BUDGET=${PRHS_CALL_BUDGET_S:-560}
PY="python3 -P"
mkdir -p "$WORK" "$OUT" "$WORK/results"
LOG=$OUT/gpu_join_and_eval.log
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
$PY -c "import sys; assert sys.version_info >= (3, 11), 'python3 -P needs Python 3.11+'"

# 0. inputs: .xfer/ where carried in this call, else what earlier calls staged in $STAGE
pick_dir() {  # first of the given folders that holds a file matching $1's glob; empty if none
  local glob=$1; shift
  for d in "$@"; do compgen -G "$d/$glob" > /dev/null && { echo "$d"; return; }; done
  echo ""
}
DATA=$(pick_dir '*.jsonl*' .xfer/data "$STAGE/data")
WHL=$(pick_dir '*.whl' .xfer/whl "$STAGE/whl")
PIECES=$(pick_dir MANIFEST.json ".xfer/models/$NAME" "$STAGE/pieces/$NAME" "$STAGE/pieces")
if [ -n "$PIECES" ] && [ "$PIECES" != ".xfer/models/$NAME" ] && [ -d ".xfer/models/$NAME" ]; then
  for f in ".xfer/models/$NAME"/*.[0-9][0-9][0-9]; do
    if [ -f "$f" ] && [ ! -f "$PIECES/$(basename "$f")" ]; then cp "$f" "$PIECES/" && echo "staged $(basename "$f") in $PIECES"; fi
  done
fi
echo "data: ${DATA:-none} | wheels: ${WHL:-none} | pieces: ${PIECES:-none}"
[ -n "$DATA" ] || { echo "no data in .xfer/data or $STAGE/data: run the plan's first call again" >&2; exit 1; }

# 1. packages
if [ ! -f "$WORK/site/.done" ]; then
  [ -n "$WHL" ] || { echo "no wheels in .xfer/whl or $STAGE/whl: run the plan's first call again" >&2; exit 1; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$WHL"/*.whl
  touch "$WORK/site/.done"
fi
export PYTHONPATH=$REPO:$WORK/site${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import torch, transformers, gguf, prhs_hf, prhs_hf.ops; print('torch', torch.__version__, '| transformers', transformers.__version__, '| gguf', gguf.__version__ if hasattr(gguf, '__version__') else '?', '| cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

CKPT=$WORK/ckpt-$NAME
if [ ! -f "$CKPT/config.json" ]; then
  # 2. join and verify
  [ -n "$PIECES" ] || { echo "no MANIFEST.json in .xfer/models/$NAME or $STAGE/pieces[/$NAME]: run the piece calls again" >&2; exit 1; }
  GGUF_NAME=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['name'])" "$PIECES/MANIFEST.json")
  GGUF=$WORK/$GGUF_NAME
  if [ ! -f "$GGUF" ]; then
    start=$SECONDS
    $PY "$REPO/tools/gpu_transfer.py" join "$PIECES" "$GGUF"
    echo "joined $GGUF in $((SECONDS - start)) s"
  fi

  # 3. export once
  start=$SECONDS
  $PY -c "import sys; from prhs_hf.hub.fetch import export_checkpoint; print(export_checkpoint(sys.argv[1], sys.argv[2], dtype='bfloat16'))" "$GGUF" "$CKPT.partial"
  rm -rf "$CKPT" && mv "$CKPT.partial" "$CKPT"
  echo "exported $CKPT in $((SECONDS - start)) s"
fi

# 3b. calibrate once per target, when PRHS_CALIBRATE holds `prhs-hf calibrate` options (e.g. "--n 4
# --length 16384") and PRHS_CALIBRATE_TARGETS the dropped-mass targets (default "0.01"): PSAW/ETF
# schedules chosen on Python's own standard-library source (on every machine, and not any
# evaluation's text), written to $WORK/results/cpe_calibrated_${NAME}_t<target>${PRHS_CALIBRATE_TAG}.yaml
# (the tag names other options, e.g. "_row0.05" for "--row-target 0.05"); pass those paths in --configs.
if [ -n "${PRHS_CALIBRATE:-}" ]; then
  STDLIB=$($PY -c "import json, os; print(os.path.dirname(os.path.dirname(json.__file__)))")
  for target in ${PRHS_CALIBRATE_TARGETS:-0.01}; do
    CAL=$WORK/results/cpe_calibrated_${NAME}_t$target${PRHS_CALIBRATE_TAG:-}.yaml
    [ -f "$CAL" ] && continue
    start=$SECONDS
    # shellcheck disable=SC2086  # the options are meant to split
    $PY -m prhs_hf calibrate "$CKPT" --text "$STDLIB" $PRHS_CALIBRATE --target "$target" --out "$CAL.partial" \
      && mv "$CAL.partial" "$CAL" && echo "calibrated in $((SECONDS - start)) s: $CAL"
  done
fi

# PRHS_EXPORT_ONLY=1: stop here, the checkpoint ready for other commands (e.g. `prhs-hf bench --model $CKPT`)
if [ -n "${PRHS_EXPORT_ONLY:-}" ]; then echo "checkpoint: $CKPT"; exit 0; fi

# 4. evaluate (resumable; arguments given later win over these defaults). A script file puts its
# own folder (scripts/), not the working directory, first on sys.path, so no -P is needed here.
left=$((BUDGET - SECONDS))
python3 scripts/run_accuracy.py --engine direct --model "$CKPT" --device cuda --batch-size 256 --save-samples \
  --data-dir "$DATA" --out "$WORK/results/accuracy.json" --resume --max-seconds "$left" "$@" || status=$?

# 5. results back
# (every report in $WORK/results: a run given its own --out there comes back too)
cp "$WORK"/results/*.json "$WORK"/results/*.md "$WORK"/results/*.yaml "$OUT"/ 2>/dev/null || true
for f in "$WORK"/results/*.samples.jsonl; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
exit "${status:-0}"
