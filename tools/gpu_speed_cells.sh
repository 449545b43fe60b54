#!/usr/bin/env bash
# On the GPU machine (a device `run`, from the repository root), after tools/pack_for_gpu.py's piece
# calls have staged the real model: the GPU tests, then `prhs-hf bench` cells of the real model, all
# within one call's budget, resumable by repeating the call.
#
#   bash tools/gpu_speed_cells.sh [tests] [CELL ...]
#
# tests: `pytest -m gpu` over every test file (scripts/gpu_issue12.sh's shards), once per machine.
# CELL:  MODE:B:L[:CONFIGS], e.g. static:32:30k or eager:1:30k:sdpa_gqa,cis/sparse; CONFIGS default
#        $BENCH_CONFIGS. Every cell goes into one JSON, /tmp/bench/real.json (kept while the machine
#        is warm; --resume skips rows already there), copied to $OUT with its table after each cell.
# The checkpoint is exported once (tools/gpu_join_and_eval.sh with PRHS_EXPORT_ONLY=1). A cell is
# started only while PRHS_CALL_BUDGET_S (default 560 s) leaves at least CELL_MIN_S (default 150 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/speed_out}
BUDGET=${PRHS_CALL_BUDGET_S:-560}
CELL_MIN_S=${CELL_MIN_S:-150}
BENCH_CONFIGS=${BENCH_CONFIGS:-sdpa_gqa,cis/sparse,cis-group-8k/sparse,cis-group-2k/sparse,cis_longbench}
NAME=${MODEL_NAME:-qwen2.5-coder-1.5b}
CKPT=/tmp/prhs_gpu/ckpt-$NAME
mkdir -p "$OUT" /tmp/bench
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

PRHS_EXPORT_ONLY=1 OUT=$OUT bash tools/gpu_join_and_eval.sh "$NAME" > "$OUT/export.log" 2>&1 || { tail -20 "$OUT/export.log"; exit 1; }
tail -2 "$OUT/export.log"

for step in "$@"; do
  left=$((BUDGET - SECONDS))
  if [ "$step" = tests ]; then
    [ -f /tmp/bench/.tests_done ] && continue
    STEPS=tests TEST_FILES=tests SHARD_TIMEOUT=$((left > 260 ? 240 : left - 20)) OUT=$OUT/gpu_tests \
      bash scripts/gpu_issue12.sh > "$OUT/gpu_tests.log" 2>&1
    grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -20
    touch /tmp/bench/.tests_done
    continue
  fi
  if [ "$left" -lt "$CELL_MIN_S" ]; then echo "not started (${left} s left): $step"; continue; fi
  IFS=: read -r mode batch length configs <<< "$step"
  chunk=()
  [ "$batch" -ge 8 ] && chunk=(--prefill-chunk 4096)
  echo "=== [$SECONDS s] $mode B$batch L$length"
  PYTHONPATH=$PWD:/tmp/prhs_gpu/site timeout -k 5 $((left - 10)) python3 -P -m prhs_hf bench --model "$CKPT" \
    --prompts /tmp/data/coqa_validation.jsonl.gz --modes "$mode" --batches "$batch" --lengths "$length" \
    --configs "${configs:-$BENCH_CONFIGS}" "${chunk[@]}" --deadline-s $((left - CELL_MIN_S)) \
    --out /tmp/bench/real.json --resume 2>&1 | grep -v "^speed map" | tail -40
  cp /tmp/bench/real.* "$OUT/" 2>/dev/null
done
echo "done in $SECONDS s"
