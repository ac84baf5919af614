#!/usr/bin/env bash
# tools/gpu_check.sh — everything in this repository that only a GPU can check, in one run:
# configure a fresh build for sm_90, build the CUDA targets, run the device tests, run
# train_fsdp_cuda (100 steps on one GPU, and under mpirun on every GPU when there are
# several), run bench_cuda, and print a short table last. Any failure is non-zero; so is a device test
# that skips, since on a GPU machine a skip means CUDA did not work. Built to finish in
# well under 8 minutes on one H200 (most of it is nvcc).
#
# Usage: [JOBS=N] tools/gpu_check.sh [BUILD_DIR]   (default: build/gpu-check, emptied first)
# Needs what the CPU build needs (tools/install-deps) plus the CUDA toolkit and NCCL.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build/gpu-check}
logs=$build/logs
jobs=${JOBS:-$(nproc)}  # JOBS=1 on a shared machine
start=$SECONDS
export PATH="/usr/local/cuda/bin:$PATH"

step() { printf '\n== %s (at %ds)\n' "$*" $((SECONDS - start)); }
fail() {
  echo "gpu_check: FAILED: $*" >&2
  exit 1
}
# Prints the last lines of a log and fails with a message.
fail_with_log() {
  tail -n 60 "$1" >&2
  fail "$2 (full log: $1)"
}

rm -rf "$build"
mkdir -p "$logs"

step "GPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader ||
  echo "(nvidia-smi failed: the device tests below say whether CUDA works)"

step "configure ($build, CMAKE_CUDA_ARCHITECTURES=90)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  >"$logs/configure.txt" 2>&1 || fail_with_log "$logs/configure.txt" "configure"
grep -q "backends on: .*cuda nccl" "$logs/configure.txt" ||
  fail_with_log "$logs/configure.txt" "CMake did not enable the cuda and nccl backends"

tests=(test_cuda_device test_cuda_runtime test_cuda_ops test_cuda_layers test_cuda_engine test_nccl test_cuda_training)
step "build ${tests[*]} train_fsdp_cuda bench_cuda (-j$jobs)"
cmake --build "$build" -j "$jobs" --target "${tests[@]}" train_fsdp_cuda bench_cuda >"$logs/build.txt" 2>&1 ||
  fail_with_log "$logs/build.txt" "build"

failed=0
rows=()
for t in "${tests[@]}"; do
  step "$t"
  exe="$build/tests/cuda/$t"
  status=passed
  timeout 300 "$exe" --durations no >"$logs/$t.txt" 2>&1 || status=FAILED
  if grep -q "SKIPPED: no CUDA device" "$logs/$t.txt"; then status="SKIPPED ($(grep -m1 -o 'SKIPPED: .*' "$logs/$t.txt"))"; fi
  counts=$(grep -E "^(All tests passed|test cases:)" "$logs/$t.txt" | tail -n 1 || true)
  if [[ $status != passed ]]; then
    failed=1
    tail -n 80 "$logs/$t.txt"
  else
    echo "$counts"
  fi
  rows+=("$(printf '%-20s %-8s %s' "$t" "${status%% *}" "$counts")")
done

# The article's script on the GPU: 100 steps, the same printout as train_fsdp.
run_example() {  # name, command...
  local name=$1 status=passed
  shift
  step "$name"
  (cd "$logs" && timeout 300 "$@") >"$logs/$name.txt" 2>&1 || status=FAILED
  tail -n 4 "$logs/$name.txt"
  [[ $status == passed ]] || failed=1
  rows+=("$(printf '%-20s %-8s %s' "$name" "$status" "$(grep -o '[0-9.]* s per step' "$logs/$name.txt" | tail -n 1)")")
}
run_example train_fsdp_cuda "$build/examples/train_fsdp_cuda" --out "$logs/model.safetensors"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)
if ((gpus > 1)) && command -v mpirun >/dev/null; then
  run_example "train_fsdp_cuda_np$gpus" mpirun --allow-run-as-root --oversubscribe -np "$gpus" \
    "$build/examples/train_fsdp_cuda" --out "$logs/model_np$gpus.safetensors"
fi

step "bench_cuda"
bench_status=passed
timeout 420 "$build/benchmarks/bench_cuda" --json "$logs/bench_cuda.jsonl" 2>&1 | tee "$logs/bench_cuda.txt" ||
  bench_status=FAILED
[[ $bench_status == passed ]] || failed=1

printf '\n== gpu_check summary (%ds; logs in %s)\n' $((SECONDS - start)) "$logs"
for r in "${rows[@]}"; do echo "$r"; done
printf '%-20s %-8s\n' "bench_cuda" "$bench_status"
sed -n '/^== summary ==$/,$p' "$logs/bench_cuda.txt" | tail -n +2
if ((failed)); then
  fail "see the logs above"
fi
echo "gpu_check: all passed"
