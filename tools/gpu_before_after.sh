#!/usr/bin/env bash
# On the GPU machine (a device `run`, from the repository root): the same `prhs-hf bench` cells on this
# checkout ("after") and on an older one ("before"), in one call, so that the two share a machine.
#
#   BEFORE=/tmp/old bash tools/gpu_before_after.sh CELL [CELL ...]
#
# BEFORE: an older checkout's root (its prhs_hf importable from there: before prhs_hf/ops, copy its
#         kernels/ to prhs_hf/kernels, as the build's package map did), e.g. made here with
#         `git archive <commit> prhs_hf kernels configs tasks pyproject.toml | tar -x -C .xfer/old`.
# CELL:   MODE:B:L:CONFIGS, e.g. static:32:16k:sdpa_gqa,cis/sparse or eager:1:16k:sdpa_gqa,cis/sparse.
# MODEL (default the checkpoint tools/gpu_join_and_eval.sh exports, else llama3-8b-shape), PROMPTS
# (default the staged CoQA stories where the checkpoint is used), LAYERS (llama3-8b-shape only).
# Each cell runs after, then before, then after again where BA_REPEAT=1 (a drift check); rows go to
# /tmp/ba/{after,before}.json (--resume: a repeated call skips the rows done) and come back in $OUT
# with the table of both (ms/step after / before per row) after every cell.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ba_out}
BEFORE=${BEFORE:?BEFORE: the older checkout}
BUDGET=${PRHS_CALL_BUDGET_S:-560}
CKPT=/tmp/prhs_gpu/ckpt-${MODEL_NAME:-qwen2.5-coder-1.5b}
if [ -z "${MODEL:-}" ]; then
  if [ -d "$CKPT" ]; then MODEL=$CKPT; PROMPTS=${PROMPTS:-/tmp/data/coqa_validation.jsonl.gz}; else MODEL=llama3-8b-shape; fi
fi
SITE=/tmp/prhs_gpu/site
mkdir -p "$OUT" /tmp/ba
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
extra=()
[ -n "${PROMPTS:-}" ] && extra+=(--prompts "$PROMPTS")
[ -n "${LAYERS:-}" ] && extra+=(--layers "$LAYERS")

bench() {  # bench TREE NAME MODE B L CONFIGS
  local tree=$1 name=$2 left=$((BUDGET - SECONDS))
  if [ "$left" -lt 60 ]; then echo "not started (${left} s left): $name $3:$4:$5"; return; fi
  shift 2
  echo "=== [$SECONDS s] $name $1 B$2 L$3 $4"
  (cd "$tree" && PYTHONPATH=$tree:$SITE timeout -k 5 $((left - 10)) python3 -P -m prhs_hf bench --model "$MODEL" \
    "${extra[@]}" --modes "$1" --batches "$2" --lengths "$3" --configs "$4" --out "/tmp/ba/$name.json" --resume 2>&1 \
    | grep -v "^speed map" | tail -12)
}

for cell in "$@"; do
  IFS=: read -r mode batch length configs <<< "$cell"
  bench "$PWD" after "$mode" "$batch" "$length" "$configs"
  bench "$BEFORE" before "$mode" "$batch" "$length" "$configs"
  python3 -P - /tmp/ba/after.json /tmp/ba/before.json > /tmp/ba/before_after.md <<'EOF'
import json, sys
def rows(path):
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return {(r["mode"], r["batch"], r["length"], r["config"], r.get("stop_check_every")): r for r in data["rows"]}
after, before = rows(sys.argv[1]), rows(sys.argv[2])
print("| mode | B | L | config | loop | after ms/step | before ms/step | after / before |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(set(after) | set(before), key=str):
    a, b = after.get(key, {}).get("ms_per_step"), before.get(key, {}).get("ms_per_step")
    ratio = f"{a / b:.3f}" if a and b else "-"
    fmt = lambda v: f"{v:.3f}" if v else "-"
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4] or 'default'} | {fmt(a)} | {fmt(b)} | {ratio} |")
EOF
  cat /tmp/ba/before_after.md
  cp /tmp/ba/* "$OUT/" 2>/dev/null
done
echo "done in $SECONDS s"
