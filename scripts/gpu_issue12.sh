#!/usr/bin/env bash
# Issue 12's GPU run in one device call (H200: python3 with torch 2.11, triton 3.6, transformers 5.17):
#
#   device run, carry [".whl"], timeout_s 600:
#     bash scripts/gpu_issue12.sh
#
# Steps, each bounded by `timeout` and independent of the others (one failing does not stop the
# rest; the summary at the end gives each one's exit status):
#   install  the carried wheels (.whl/*.whl: flashinfer-python, slimmed by
#            scripts/slim_flashinfer_wheel.py, and apache-tvm-ffi) into /tmp/site, and prhs_hf
#            from this checkout (PYTHONPATH: the checkout's root, then /tmp/site);
#            FlashInfer's JIT then compiles its dense decode kernels in the
#            background while the tests run (its cache stays in ~/.cache/flashinfer);
#   tests    pytest -m gpu: the decode and prefill kernels, the model path, the top-k select;
#   op       scripts/bench_decode_attention.py, all shapes (issue 12's first, JSON after each), then
#            scripts/probe_gqa_kernels.py --select-only on its three shapes and at the real model's
#            retrieval pattern (12/2 B32/16k, k 88, 19 % of the rows);
#   es       the GPU exactness test of scripts/probe_es_side_stream.py, then the probe (issue 15:
#            does a side stream hide ES-CIS's next-layer selection?), into $OUT/es;
#   fa4      (not in the default STEPS) flash-attn-4 from the wheels in $FA4_WHEELS, then the GPU
#            tests of the prefill routes and the model, and with FA4_PROBE=1
#            scripts/probe_flash_attn4.py (issue 15);
#   prefill  (not in the default STEPS) scripts/bench_prefill.py --skip-flex (after fa4: with FA4);
#   e2e      scripts/bench_e2e_decode.py, static mode, E2E_CASES x E2E_CONFIGS, E2E_TOKENS new
#            tokens (JSON after each cell), with the time left before DEADLINE_S;
#   real     (not in the default STEPS) the same on real weights and text: --model REAL_CKPT
#            --prompts REAL_PROMPTS, REAL_CASES x REAL_CONFIGS, --resume into $OUT/real (issue 12's
#            Qwen2.5-Coder-1.5B rows; the checkpoint is the one tools/gpu_join_and_eval.sh exports).
#
# Environment: STEPS (default "install tests op es e2e"), SHARD_TIMEOUT (240 s: each test shard), TEST_FILES (the tests step's files or test ids,
# default the decode, model and prefill GPU tests), E2E_CASES (default
# "llama2-7b:8:16384,llama3-8b:16:16384"), E2E_CONFIGS (default
# "dense,dense-gqa,cis-s16-share,cpe-s16-share"), E2E_TOKENS (256), E2E_EXTRA (more bench_e2e_decode.py
# arguments for the e2e and real steps, e.g. "--profile-steps 8": kernels per step and the launch gap, issue 12's item 3), DEADLINE_S (560: the e2e step
# stops there), PRHS_GIT_COMMIT (else the first line of .whl/COMMIT, written here with
# `git rev-parse HEAD > .whl/COMMIT`; the copy on the device has no .git).
#
# Back in $OUT (6 files): gpu_issue12.log (everything printed), pytest_gpu.tgz (JUnit XML and log per shard),
# op/bench_decode_attention.{json,md}, e2e/bench_e2e_decode.{json,md}.
#
# Time: a static e2e cell costs 40-90 s (its compilation) + ~10 s, so the 8 default cells do not
# all fit after the tests and the operator bench in one 600 s call; the cells done are in the
# JSON. Run the rest in a second call, e.g.
#   STEPS="install e2e" E2E_CASES=llama3-8b:16:16384 bash scripts/gpu_issue12.sh
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
OUT=${OUT:-/tmp/issue12_out}
mkdir -p "$OUT/op" "$OUT/e2e"
exec > >(tee -a "$OUT/gpu_issue12.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
STEPS=${STEPS:-"install tests op es e2e"}
E2E_CASES=${E2E_CASES:-llama2-7b:8:16384,llama3-8b:16:16384}
E2E_CONFIGS=${E2E_CONFIGS:-dense,dense-gqa,cis-s16-share,cpe-s16-share}
E2E_TOKENS=${E2E_TOKENS:-256}
DEADLINE_S=${DEADLINE_S:-560}
TEST_SHARDS=${TEST_SHARDS:-6}
REAL_CKPT=${REAL_CKPT:-/tmp/prhs_gpu/ckpt-qwen2.5-coder-1.5b}
REAL_PROMPTS=${REAL_PROMPTS:-/tmp/data/coqa_validation.jsonl.gz}
REAL_CASES=${REAL_CASES:-model:32:16384,model:32:32512}  # 32512 + 256 new tokens = the model's 32768 positions
REAL_CONFIGS=${REAL_CONFIGS:-dense-gqa,cis,dense}
if [ -z "${PRHS_GIT_COMMIT:-}" ] && [ -f .whl/COMMIT ]; then PRHS_GIT_COMMIT=$(head -n1 .whl/COMMIT); fi
export PRHS_GIT_COMMIT=${PRHS_GIT_COMMIT:-}
declare -A RC

want() { [[ " $STEPS " == *" $1 "* ]]; }
stamp() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }

# prhs_hf importable from this checkout in every step (also when the install step is left out)
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# `python3 -P` for -m / -c / stdin: sys.path is PYTHONPATH's folders and the interpreter's, not the
# working directory. A script run as python3 SCRIPT has its own folder first on sys.path, and needs
# that folder for `import _bench_common`: plain python3.
PY="python3 -P"

FI_PID=""
if want install; then
  stamp "install: wheels into /tmp/site"
  if compgen -G ".whl/*.whl" > /dev/null; then
    timeout -k 5 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    RC[install]=$?
  else
    echo "no .whl/*.whl carried: FlashInfer's column will read 'not available'"; RC[install]=missing
  fi
  $PY -c "import torch, triton, transformers, prhs_hf, prhs_hf.ops; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
  # FlashInfer's JIT build of its decode kernels (head dim 128, bf16; MHA, G = 4 and G = 6) in the
  # background, so that the operator bench finds them compiled
  ( timeout -k 5 240 $PY - > /tmp/flashinfer_warm.log 2>&1 <<'EOF'
import sys, time
sys.path.insert(0, "scripts")
import torch
import _bench_common as common
print("flashinfer", common.package_version("flashinfer"))
for hq, hkv in ((32, 32), (32, 8), (12, 2)):
    t0 = time.time()
    q = torch.randn(2, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, hkv, 512, 128, device="cuda", dtype=torch.bfloat16)
    try:
        common.flashinfer_decode(q, k, k, 128 ** -0.5)()
        torch.cuda.synchronize()
        print(f"flashinfer decode {hq}/{hkv}: built and ran in {time.time() - t0:.0f} s")
    except Exception as exc:
        print(f"flashinfer decode {hq}/{hkv}: {type(exc).__name__}: {exc}"[:600])
EOF
  ) &
  FI_PID=$!
fi

# pytest -m gpu over test files as $TEST_SHARDS processes side by side (serially the GPU tests take
# > 240 s, most of it Triton compiling), the collected test ids dealt round-robin; one JUnit file and
# log each, packed into $OUT/$1.tgz ($OUT returns only a few files). Sets RC[$1].
gpu_shards() {
  local name=$1; shift
  local dir=/tmp/shards_$name
  mkdir -p "$dir" && rm -f "$dir"/*
  $PY -m pytest -q --collect-only -m gpu -p no:cacheprovider "$@" 2>/dev/null | grep '::' \
    | awk -v n="$TEST_SHARDS" -v d="$dir" '{ print > (d "/ids." (NR % n)) }'
  local pids=() ids i pid log
  for ids in "$dir"/ids.*; do
    i=${ids##*.}
    timeout -k 10 "${SHARD_TIMEOUT:-240}" $PY -m pytest -q -rfs -m gpu -p no:cacheprovider --junitxml="$dir/$name.$i.xml" \
      $(cat "$ids") > "$dir/log.$i" 2>&1 &
    pids+=($!)
  done
  RC[$name]=0
  for pid in "${pids[@]}"; do wait "$pid" || RC[$name]=$?; done
  for log in "$dir"/log.*; do echo "--- $log"; grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" "$log" | tail -n 30; done
  tar -C "$dir" -czf "$OUT/$name.tgz" .
}

if want tests; then
  stamp "tests: pytest -m gpu in $TEST_SHARDS processes"
  # shellcheck disable=SC2086  # TEST_FILES: a list, word-split on purpose
  # (tests/test_topk_select.py has no `gpu` test: -m gpu collects none there, so it is not listed; the
  # every-path top-k tests of tests/test_kernels_decode_gpu.py run each select mode on the GPU)
  gpu_shards pytest_gpu ${TEST_FILES:-tests/test_kernels_decode_gpu.py tests/test_model_gpu.py \
    tests/test_kernels_prefill_gpu.py}
fi

if [ -n "$FI_PID" ]; then
  stamp "waiting for FlashInfer's JIT build"
  wait "$FI_PID"; RC[flashinfer_warm]=$?
  cat /tmp/flashinfer_warm.log
fi

if want fa4; then
  # flash-attn-4 (issue 15): the wheels staged in $FA4_WHEELS (default /tmp/fa4w: flash_attn_4 4.0.0b36,
  # nvidia_cutlass_dsl + libs-base/libs-core/libs-cu13 4.8.1, quack_kernels, torch_c_dlpack_ext, einops,
  # apache_tvm_ffi, and cuda_bindings/cuda_pathfinder/protobuf where the machine lacks them; the 92 MB
  # cu13 wheel travels split in two carries and is joined first), then the GPU tests of every route
  # that can now take FA4 (flash, the prefill kernels, the model path: backend.prefill auto picks FA4
  # where it runs) and, with FA4_PROBE=1, the operator probe. FA4 stays on PYTHONPATH for the later steps.
  stamp "fa4: install, GPU tests of the prefill routes and the model${FA4_PROBE:+, probe_flash_attn4.py}"
  W=${FA4_WHEELS:-/tmp/fa4w}
  timeout -k 5 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fa4site "$W"/*.whl
  RC[fa4_install]=$?
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  gpu_shards pytest_fa4 tests/test_flash_prefill_gpu.py tests/test_kernels_prefill_gpu.py tests/test_model_gpu.py
  if [ -n "${FA4_PROBE:-}" ]; then
    mkdir -p "$OUT/fa4"
    timeout -k 10 200 python3 scripts/probe_flash_attn4.py --out "$OUT/fa4/probe_flash_attn4"
    RC[fa4_probe]=$?
  fi
fi

if want prefill; then
  # whole-model prefill (issue 15): dense SDPA, dense FA4 (where the fa4 step installed it), cpe.yaml
  # with backend.prefill auto and triton
  stamp "prefill: bench_prefill.py --skip-flex"
  mkdir -p "$OUT/prefill"
  timeout -k 10 240 python3 scripts/bench_prefill.py --skip-flex --out "$OUT/prefill/bench_prefill"
  RC[prefill]=$?
fi

if want op; then
  stamp "op: bench_decode_attention.py (all shapes)"
  timeout -k 10 240 python3 scripts/bench_decode_attention.py --out "$OUT/op"
  RC[op]=$?
  stamp "op: probe_gqa_kernels.py --select-only (32/8 and 32/32 B16, 12/2 B32 at 16k; then the real model's pattern)"
  timeout -k 10 90 python3 scripts/probe_gqa_kernels.py --select-only
  RC[select_probe]=$?
  # Qwen2.5-Coder-1.5B's decode at B32 on a 16k prompt (16,640 cache slots), cis.yaml's k = 88, 19 % of
  # the rows retrieving as in the real e2e run (docs/results/probe_gqa_select_real.md)
  timeout -k 10 90 python3 scripts/probe_gqa_kernels.py --select-only --select-shape 32,16640,12,2 --topk 88 \
    --retrieve-frac 0.19 || RC[select_probe]=$?
fi

if want es; then
  # issue 15: does running ES-CIS's next-layer selection on a side stream hide its latency? The GPU
  # exactness test of the probe, then the probe (its .json and .md into $OUT/es)
  stamp "es: test_gpu_es_side_stream_probe_overlaps_exactly, then probe_es_side_stream.py"
  mkdir -p "$OUT/es"
  timeout -k 10 180 $PY -m pytest -q -rfs -m gpu -p no:cacheprovider \
    tests/test_kernels_decode_gpu.py::test_gpu_es_side_stream_probe_overlaps_exactly 2>&1 | tail -n 5
  RC[es_test]=${PIPESTATUS[0]}
  timeout -k 10 120 python3 scripts/probe_es_side_stream.py --out "$OUT/es"
  RC[es_probe]=$?
fi

# one bench_e2e_decode.py run as step $1 (what it measures: $2), with the time left before DEADLINE_S
run_e2e() {
  local step=$1 what=$2; shift 2
  local left=$((DEADLINE_S - (SECONDS - T0)))
  stamp "$step: $what, ${left} s left"
  if [ "$left" -gt 60 ]; then
    timeout -k 10 "$left" python3 scripts/bench_e2e_decode.py "$@"
    RC[$step]=$?
  else
    echo "skipped: under 60 s left"; RC[$step]=skipped
  fi
}

if want e2e; then
  # shellcheck disable=SC2086  # E2E_EXTRA: more arguments, word-split on purpose (e.g. "--profile-steps 8")
  run_e2e e2e "$E2E_CASES x $E2E_CONFIGS, static, $E2E_TOKENS tokens" --cases "$E2E_CASES" --modes static \
    --configs "$E2E_CONFIGS" --new-tokens "$E2E_TOKENS" --out "$OUT/e2e" ${E2E_EXTRA:-}
fi

if want real; then
  # the real Qwen2.5-Coder-1.5B rows (issue 12): the checkpoint tools/gpu_join_and_eval.sh exported
  # (REAL_CKPT) and CoQA stories as real-text prompts (REAL_PROMPTS), configs/cis.yaml as shipped
  if [ ! -f "$REAL_CKPT/config.json" ] || [ ! -f "$REAL_PROMPTS" ]; then
    stamp "real: skipped: no checkpoint at $REAL_CKPT or no prompts at $REAL_PROMPTS"; RC[real]=missing
  else
    mkdir -p "$OUT/real"
    # shellcheck disable=SC2086  # E2E_EXTRA as in the e2e step
    run_e2e real "$REAL_CASES x $REAL_CONFIGS on $REAL_CKPT" --model "$REAL_CKPT" --prompts "$REAL_PROMPTS" \
      --cases "$REAL_CASES" --modes static --configs "$REAL_CONFIGS" --new-tokens "$E2E_TOKENS" --out "$OUT/real" --resume ${E2E_EXTRA:-}
  fi
fi

stamp "done; exit status per step (124: its timeout):"
for step in "${!RC[@]}"; do echo "  $step: ${RC[$step]}"; done
ls -la "$OUT" "$OUT/op" "$OUT/e2e"
