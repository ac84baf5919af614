#!/usr/bin/env bash
# tools/gpu_check.sh — everything in this repository that only a GPU can check, in one bounded run
# made for a bare, offline GPU node: check the prerequisites and that the GPU can be used (else stop
# at once), configure (Ninja, warnings not errors; on a GPU node, stop when NCCL was not found),
# build the CUDA programs with keep-going, and run whatever built, each under its own time limit:
# the device tests (test_nccl's [timeout] cases alone), train_fsdp_cuda (100 steps; under mpirun too
# when there are several GPUs and MPI), train_gpt_cuda (GPT-2 and LLaMA, 300 steps each; GPT-2 124M
# at sequence 1024 on llm.c-format tokens, 30 steps, its tokens/s to set beside llm.c's), bench_cuda
# (its encoder, GPT-2 and LLaMA steps with their MFU), the steps that bench_cuda's reserve kept back,
# then Nsight Compute's profile of the tensor-core attention's three kernels (head_dim 128, bf16)
# and its time of every kernel in one GPT-2 training step (bench_cuda's sizes, 2 layers; summed by
# kernel by tools/step-kernels) and, with the time left, compute-sanitizer's memcheck over
# test_cuda_ops. The steps before
# bench_cuda leave it 120 s of the deadline (its MFU figures are the run's goal). It stops itself at
# the deadline and leaves two files under --out (only the summary when it stopped before configure):
#   summary.txt   the versions (driver, nvcc, NCCL, compiler, CMake), the NCCL/CUDA environment,
#                 every step's result, time and first error, bench_cuda's JSON lines and the
#                 GPT-2 step's time by kernel
#   logs.tar.gz   configure and build logs, each program's output, train_fsdp_cuda's metrics
# Seeds are fixed: SHARDLIB_TEST_SEED (default 1) for the tests' random inputs, --seed 0 for training.
#
# Usage: tools/gpu_check.sh --out DIR [--deps DIR] [--nccl DIR] [--deadline SECONDS] [--build DIR] [--reuse] [--jobs N]
#   --deps DIR        a folder made by tools/bundle-deps, where Eigen, Catch2, nlohmann-json, xxHash
#                     and CLI11 are not installed
#   --nccl DIR        NCCL's folder (include/nccl.h, lib/libnccl.so.2) where it is not found (NCCL_ROOT)
#   --deadline S      stop everything after S seconds (default 570). The run ends by S + 5 s and the
#                     time to pack the logs: give the harness's limit less about 30 s (570 for 600)
#   --build DIR       build folder, emptied first unless --reuse (default build/gpu-check)
#   --reuse           keep a build folder that holds a CMakeCache.txt: only what changed is rebuilt
#   --jobs N          compile jobs (default: the number of cores)
# Exit status: 0 when everything ran and passed; 1 when something failed, did not build, did not run
# or skipped (on a GPU node a skip means CUDA does not work); 2 when a prerequisite is missing, the
# GPU cannot be used (nvidia-smi fails, or the driver is older than CUDA 13's R580 and the toolkit's
# compat libcuda does not initialise), configure failed, or NCCL is off on a GPU node; 130 or 143
# when interrupted by SIGINT or SIGTERM.
set -euo pipefail
export LC_ALL=C
((BASH_VERSINFO[0] >= 5)) || { echo "gpu_check: needs bash 5 or newer" >&2; exit 2; }
ulimit -c 0 # a crashing device program would dump its 100 GB of mappings

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() {
  sed -n 's/^# \{0,1\}//; /^Usage:/,/^Exit/p' "${BASH_SOURCE[0]}" | sed '$d' >&2
  exit 2
}
out="" deps="" nccl="" deadline=570 build=$root/build/gpu-check reuse=0 jobs=$(nproc)
while (($#)); do
  case $1 in
  --out | --deps | --nccl | --deadline | --build | --jobs) (($# >= 2)) || usage ;;&
  --out) out=$2 ;;
  --deps) deps=$(realpath -m "$2") ;;
  --nccl) nccl=$(realpath -m "$2") ;;
  --deadline) deadline=$2 ;;
  --build) build=$2 ;;
  --reuse) reuse=1; shift; continue ;;
  --jobs) jobs=$2 ;;
  *) usage ;;
  esac
  shift 2
done
[[ -n $out && $deadline =~ ^[0-9]+$ && $jobs =~ ^[1-9][0-9]*$ ]] || usage
mkdir -p "$out"
out=$(realpath "$out")
build=$(realpath -m "$build")
logs="" # $build/logs once the build folder is ready
summary=$out/summary.txt
end=$((EPOCHSECONDS + deadline))
begin=${EPOCHREALTIME/./}
export SHARDLIB_TEST_SEED=${SHARDLIB_TEST_SEED:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# --- the summary: the versions, one row per step, bench_cuda's JSON lines --------------------------
declare -A facts=()
fact_keys=(machine gpu nvcc nccl c++ cmake deps sanitizer profiler env seeds)
info() { facts[$1]+="${facts[$1]:+$'\n'}$2"; } # KEY VALUE (a key may hold several lines)
rows=() problems=0 bench_json="" step_kernels="" interrupted=""
# row STEP RESULT SECONDS DETAIL; results other than ok, passed, partial and omitted are problems.
row() {
  rows+=("$(printf '%-24s %-9s %7s  %s' "$1" "$2" "$3" "$4")")
  case $2 in ok | passed | partial | omitted) ;; *) problems=$((problems + 1)) ;; esac
  echo "${rows[-1]}"
  write_summary
}
write_summary() {
  local k line verdict="all passed"
  ((problems == 0)) || verdict="$problems problem(s), in the rows below"
  [[ -z $interrupted ]] || verdict="interrupted by SIG$interrupted; $verdict"
  {
    echo "shardlib tools/gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M UTC'):" \
      "$(((${EPOCHREALTIME/./} - begin) / 1000000)) s of a $deadline s deadline; $verdict"
    echo
    for k in "${fact_keys[@]}"; do
      [[ -n ${facts[$k]:-} ]] || continue
      while IFS= read -r line; do printf '%-10s %s\n' "$k" "$line"; done <<<"${facts[$k]}"
    done
    echo
    printf '%-24s %-9s %7s  %s\n' step result seconds detail
    printf '%s\n' "${rows[@]}"
    if [[ -s $bench_json ]]; then
      echo
      echo "bench_cuda --json (JSON lines):"
      awk 1 "$bench_json" # (the last line ends with a newline even when bench_cuda was cut)
    fi
    if [[ -s $step_kernels ]]; then
      echo
      echo "one GPT-2 training step (bench_cuda's sizes, 2 layers), GPU time by kernel (ncu, tools/step-kernels):"
      cat "$step_kernels"
    fi
  } >"$summary"
}
last_line() { grep . "$1" | tail -n1 || true; } # the last non-empty line of a file
since() { local t=$(((${EPOCHREALTIME/./} - $1) / 100000)); echo "$((t / 10)).$((t % 10))"; } # seconds, 1 decimal

# --- running programs: own session, own time limit, output to a log --------------------------------
child="" current="" current_log="" started=0
running() { # PID: alive and not a zombie (no fork: it is asked several times a second)
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}
# run_limited STEP LIMIT LOG COMMAND...: COMMAND in its own session (stdout line-buffered), for at
# most LIMIT seconds; then SIGTERM to its process group, SIGKILL 10 s later, and 10 s after that it is
# left behind, since a process stuck in the driver cannot be waited for. Sets rc (COMMAND's exit
# status; empty when left behind), stopped (empty, "limit" or "left behind") and took (seconds).
run_limited() {
  current=$1 current_log=$3 started=${EPOCHREALTIME/./}
  local until=$((started + $2 * 1000000)) now signal="" nap=0.05
  shift 3
  setsid -w stdbuf -oL -eL "$@" >"$current_log" 2>&1 </dev/null &
  child=$!
  rc="" stopped=""
  while running "$child"; do
    now=${EPOCHREALTIME/./}
    if [[ -z $signal ]] && ((now > until)); then
      signal=TERM stopped=limit
      kill -TERM -- "-$child" 2>/dev/null || true
    elif [[ $signal == TERM ]] && ((now > until + 10000000)); then
      signal=KILL
      kill -KILL -- "-$child" 2>/dev/null || true
    elif ((now > until + 20000000)); then
      stopped="left behind"
      break
    fi
    ((now - started < 2000000)) || nap=0.5 # short runs timed closely, long ones polled lightly
    sleep "$nap"
  done
  if [[ $stopped != "left behind" ]]; then
    rc=0
    wait "$child" || rc=$?
  fi
  child="" current=""
  took=$(since "$started")
}
# limit_for CAP: the seconds a step may take: CAP, or less so that 15 s remain for the summary and
# `reserve` for bench_cuda; fails when under 10 s remain. A step stopped at its limit ends at most
# 20 s later, so the run ends by the deadline + 5 s, and then packs the logs.
reserve=0
limit_for() {
  local left=$((end - EPOCHSECONDS - 15 - reserve))
  ((left >= 10)) || return 1
  echo $((left < $1 ? left : $1))
}

finish() {
  local status=$?
  trap '' INT TERM
  [[ -z $child ]] || kill -KILL -- "-$child" 2>/dev/null || true
  [[ -z $current ]] ||
    row "$current" INTERRUPTED "$(since "$started")" "${interrupted:+by SIG$interrupted; }last line: $(last_line "$current_log")"
  write_summary
  [[ -z $logs ]] || tar -czf "$out/logs.tar.gz" -C "$build" logs || echo "gpu_check: could not write $out/logs.tar.gz" >&2
  rm -rf "$tmp"
  echo
  cat "$summary"
  exit "$status"
}
tmp=$(mktemp -d)
trap finish EXIT
trap 'interrupted=INT; exit 130' INT
trap 'interrupted=TERM; exit 143' TERM

# --- prerequisites, all checked before anything runs -------------------------------------------------
missing=()
need() { command -v "$1" >/dev/null || missing+=("$1: $2"); }
need cmake "CMake 3.25 or newer"
need ninja "Ninja, the build tool"
need "${CXX:-c++}" "a C++20 compiler (or set CXX)"
need setsid "util-linux"
need awk "awk (gawk or mawk)"
need tar "tar and gzip, for logs.tar.gz"
need gzip "tar and gzip, for logs.tar.gz"
stdbuf -oL true 2>/dev/null || missing+=("stdbuf: coreutils' stdbuf and its libstdbuf.so")
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $nvcc ]] || missing+=("nvcc: the CUDA toolkit (on PATH, in CUDACXX, or under /usr/local/cuda)")
if command -v cmake >/dev/null; then
  cmake_version=$(cmake --version | sed -n '1s/[^0-9]*//p')
  [[ $(printf '%s\n' 3.25 "$cmake_version" | sort -V | head -n1) == 3.25 ]] ||
    missing+=("cmake: version $cmake_version, 3.25 or newer needed")
fi
[[ -z $deps || -f $deps/MANIFEST ]] || missing+=("--deps $deps: not a folder made by tools/bundle-deps")
[[ -z $nccl || -d $nccl ]] || missing+=("--nccl $nccl: not a folder")
[[ ! -d $build || -f $build/CMakeCache.txt || -z $(ls -A "$build") ]] ||
  missing+=("--build $build: a folder that is not a build folder (it would be emptied)")
[[ $out != "$build" && $out != "$build"/* ]] || missing+=("--out $out: inside the build folder, which is emptied")

memory=$(($(sed -n 's/^MemTotal: *\([0-9]*\).*/\1/p' /proc/meminfo) / 1048576))
os=$(sed -n 's/^PRETTY_NAME="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' /etc/os-release 2>/dev/null || true)
info machine "$HOSTNAME, $(nproc) cores, $memory GiB, ${os:-unknown OS}"

# --- the GPU: none (a build machine: the device programs report themselves skipped) or a usable one --
smi() { # nvidia-smi ARGS..., for at most 20 s where `timeout` exists: a wedged driver hangs it
  if command -v timeout >/dev/null; then timeout -k 5 20 nvidia-smi "$@"; else nvidia-smi "$@"; fi
}
gpus=0 arch=90 gpu_list="" unusable="" # arch: H100/H200 where there is no GPU to ask
models=$(sed -n 's/^Model:[[:space:]]*//p' /proc/driver/nvidia/gpus/*/information 2>/dev/null | paste -sd, - || true)
if ! command -v nvidia-smi >/dev/null; then
  info gpu "none: nvidia-smi is not installed${models:+ (/proc/driver/nvidia lists $models)}"
else
  smi_rc=0
  gpu_list=$(smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader 2>"$tmp/smi.err") ||
    smi_rc=$?
  if ((smi_rc == 0)) && [[ -n $gpu_list ]]; then
    gpus=$(wc -l <<<"$gpu_list")
    while read -r g; do info gpu "$g (name, memory, compute capability, driver)"; done <<<"$gpu_list"
    cc=$(sed -n '1s/.*, \([0-9]*\)\.\([0-9]*\), .*/\1\2/p' <<<"$gpu_list")
    arch=${cc:-$arch}
    driver=${gpu_list%%$'\n'*} driver=${driver##*, }
  else
    case $smi_rc in
    124 | 137) unusable="nvidia-smi gave no answer within 20 s" ;;
    *) unusable="nvidia-smi failed (status $smi_rc): $(cat - "$tmp/smi.err" <<<"$gpu_list" | grep -m1 . || true)" ;;
    esac
    info gpu "${models:-unknown (/proc/driver/nvidia lists none)}; nvidia-smi failed (below)"
  fi
fi
# CUDA 13 needs the R580 driver. With an older one, the toolkit's forward-compatibility libcuda
# (compat/, datacenter GPUs) is used if it initialises; else stop.
if [[ ${driver:-} =~ ^([0-9]+)\. ]] && ((BASH_REMATCH[1] < 580)); then
  compat=$(realpath -m "$(dirname "$nvcc")/../compat")
  if [[ -e $compat/libcuda.so.1 ]] && LD_LIBRARY_PATH=$compat${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL("libcuda.so.1").cuInit(0) != 0)' 2>/dev/null; then
    export LD_LIBRARY_PATH=$compat${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    info gpu "driver $driver is older than CUDA 13's R580: $compat/libcuda.so.1 used (forward compatibility)"
  elif [[ -e $compat/libcuda.so.1 ]]; then
    unusable="driver $driver is older than CUDA 13's R580, and $compat/libcuda.so.1 did not initialise"
  else
    unusable="driver $driver is older than CUDA 13's R580 (and there is no $compat/libcuda.so.1)"
  fi
fi
[[ ! -x $nvcc ]] || info nvcc "$("$nvcc" --version | sed -n 's/.*release [^,]*, V//p') ($nvcc)"
sanitizer=$(command -v compute-sanitizer || echo "$(dirname "$nvcc")/compute-sanitizer")
[[ -x $sanitizer ]] || sanitizer=""
info sanitizer "${sanitizer:-compute-sanitizer not found: memcheck is omitted}"
profiler=$(command -v ncu || ls -d "$(dirname "$nvcc")/ncu" /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V |
  tail -n1 || true)
[[ -n $profiler && -x $profiler ]] || profiler=""
info profiler "${profiler:-ncu (Nsight Compute) not found: no profile of the attention kernels}"
info cmake "${cmake_version:-none}, ninja $(ninja --version 2>/dev/null || echo none)"
if [[ -n $deps ]]; then
  info deps "$deps: $(grep -v '^#' "$deps/MANIFEST" 2>/dev/null | paste -sd, - | sed 's/,/, /g')"
else
  info deps "the installed packages"
fi
while IFS= read -r line; do info env "$line"; done < <(env | grep -E '^(NCCL|CUDA)_|^LD_LIBRARY_PATH=' | sort)
info seeds "SHARDLIB_TEST_SEED=$SHARDLIB_TEST_SEED (the tests' inputs), Catch's --rng-seed 0, train_fsdp_cuda --seed 0"

for m in "${missing[@]}"; do row prerequisites MISSING "" "$m" >&2; done
[[ -z $unusable ]] || row gpu UNUSABLE "" "$unusable" >&2
((problems == 0)) || exit 2
if ((reuse)) && [[ -f $build/CMakeCache.txt ]]; then
  rm -rf "$build/logs"
  kept="; the build folder kept (--reuse)"
else
  rm -rf "$build"
fi
logs=$build/logs
mkdir -p "$logs"
row prerequisites ok 0.0 "all found${kept:-}"

# --- configure --------------------------------------------------------------------------------------
# The programs built here run here: never CI's compile-only or quick build, whatever the
# environment says.
configure=(cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc"
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DSHARDLIB_WERROR=OFF -DSHARDLIB_CUDA_COMPILE_ONLY=OFF
  -DSHARDLIB_QUICK_BUILD=OFF)
[[ -z $deps ]] || configure+=(-DSHARDLIB_DEPS="$deps")
[[ -z $nccl ]] || configure+=(-DNCCL_ROOT="$nccl")
limit=$(limit_for 300) || { row configure "NOT RUN" "" "the deadline came first"; exit 1; }
run_limited configure "$limit" "$logs/configure.txt" "${configure[@]}"
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt" 2>/dev/null || true; }
cxx=$(cache CMAKE_CXX_COMPILER)
[[ -z $cxx ]] || info c++ "$("$cxx" --version | head -n1) ($cxx)"
nccl_h=$(cache NCCL_INCLUDE_DIR)/nccl.h
if [[ -f $nccl_h ]]; then
  nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$nccl_h" | paste -sd. -)
  info nccl "$nccl_version ($(cache NCCL_LIBRARY), $nccl_h)"
else
  info nccl "not found"
fi
backends=$(sed -n 's/.*backends on: //p' "$logs/configure.txt")
off=$(sed -n 's/.*backend off: \([a-z]*\).*/\1/p' "$logs/configure.txt" | paste -sd' ' -)
if [[ -n $stopped ]]; then
  row configure STOPPED "$took" "after $limit s; last line: $(last_line "$logs/configure.txt")"
  exit 2
elif ((rc != 0)); then
  row configure FAILED "$took" "$(grep -m1 -A3 'CMake Error' "$logs/configure.txt" | paste -sd' ' - | tr -s ' ' || true)"
  exit 2
fi
row configure ok "$took" "backends on: $backends${off:+ (off: $off)}; CUDA architectures $arch; warnings not errors"
# Without NCCL, test_nccl, test_cuda_engine, test_cuda_training, train_fsdp_cuda and bench_cuda are
# not built: on a GPU node, stop here rather than build for minutes without them.
if ((gpus > 0)) && [[ " $off " == *" nccl "* ]]; then
  searched=$(sed -n 's/.*NCCL not found.*searched: //p' "$logs/configure.txt")
  row nccl "NOT FOUND" "" "--nccl DIR names its folder; searched: $searched" >&2
  exit 2
fi

# --- build: every CUDA program configured, keep going past failures, until 90 s before the deadline --
declare -A program=([test_cuda_device]=tests/cuda/test_cuda_device [test_cuda_runtime]=tests/cuda/test_cuda_runtime
  [test_cuda_ops]=tests/cuda/test_cuda_ops [test_cuda_layers]=tests/cuda/test_cuda_layers
  [test_cuda_engine]=tests/cuda/test_cuda_engine [test_nccl]=tests/cuda/test_nccl
  [test_cuda_training]=tests/cuda/test_cuda_training [test_cuda_attention]=tests/cuda/test_cuda_attention
  [test_cuda_gemm]=tests/cuda/test_cuda_gemm [test_cuda_decoder]=tests/cuda/test_cuda_decoder
  [test_cuda_checkpoint]=tests/cuda/test_cuda_checkpoint [train_fsdp_cuda]=examples/train_fsdp_cuda
  [train_gpt_cuda]=examples/train_gpt_cuda [bench_cuda]=benchmarks/bench_cuda)
targets=()
for t in "${!program[@]}"; do
  if ninja -C "$build" -t query "$t" >/dev/null 2>&1; then targets+=("$t"); fi
done
if ((${#targets[@]} == 0)); then
  row build FAILED "" "no CUDA program configured (backends off: $off)"
  exit 1
fi
echo "gpu_check: building ${#targets[@]} programs (ninja -k 0 -j$jobs)"
cap=$((end - EPOCHSECONDS - 90))
limit=$(limit_for $((cap > 30 ? cap : 30))) || { row build "NOT RUN" "" "the deadline came first"; exit 1; }
# (With --reuse, relinked: a program whose build fails now must not be run from the last build.)
for t in "${targets[@]}"; do rm -f "$build/${program[$t]}"; done
run_limited build "$limit" "$logs/build.txt" ninja -C "$build" -k 0 -j "$jobs" "${targets[@]}"
built=0
for t in "${targets[@]}"; do
  if [[ -x $build/${program[$t]} ]]; then built=$((built + 1)); fi
done
if [[ -n $stopped ]]; then
  row build STOPPED "$took" "at the deadline: $built of ${#targets[@]} built"
elif ((rc == 0)); then
  row build ok "$took" "$built of ${#program[@]} programs built${off:+ (backends off: $off)}"
else
  row build FAILED "$took" "$built of ${#targets[@]} built; $(grep -c '^FAILED: ' "$logs/build.txt") compile or link steps failed"
fi
# The first compiler error of each failed step, as "output: message".
awk '/^FAILED: / {sub(/^FAILED: (\[code=[0-9]+\] )?/, ""); f = $1; getline; next}
     f && /error/ {print f ": " $0; f = ""}' "$logs/build.txt" >"$logs/build-errors.txt"

# --- runs: from the temporary folder, so that nothing lands in the repository -----------------------
cd "$tmp"
via=()      # what a step runs its program under (mpirun, compute-sanitizer)
deferred=() # the steps that bench_cuda's reserve kept back, as commands to run after it
# step NAME CAP TARGET [ARGS...]: runs TARGET's program for at most CAP seconds and adds its row.
step() {
  local name=$1 cap=$2 target=$3 limit log result detail
  local exe=$build/${program[$3]}
  shift 3
  if [[ ! -x $exe ]]; then
    if [[ " ${targets[*]} " != *" $target "* ]]; then
      detail="not configured (backends off: $off)"
    else
      detail=$(grep -m1 -E "(CMakeFiles/$target\.dir/[^ ]*|/$target): " "$logs/build-errors.txt" ||
        grep -m1 . "$logs/build-errors.txt" || echo "the build stopped before it")
    fi
    row "$name" "NOT BUILT" "" "${detail:0:200}"
    return
  fi
  if ! limit=$(limit_for "$cap"); then
    if ((reserve > 0)); then
      deferred+=("via=(${via[*]@Q}); step ${name@Q} $cap $target ${*@Q}")
      echo "gpu_check: $name waits until after bench_cuda"
    else
      row "$name" "NOT RUN" "" "the deadline came first"
    fi
    return
  fi
  log=$logs/$(tr -c 'A-Za-z0-9_.-' _ <<<"$name" | sed 's/_*$//').txt
  run_limited "$name" "$limit" "$log" "${via[@]}" "$exe" "$@"
  detail=$(grep -E -m1 'SKIPPED: no CUDA device|no usable GPU|needs a GPU' "$log" || true)
  if [[ -n $detail ]]; then
    result=skipped
  elif [[ $stopped == "left behind" ]]; then
    result=HUNG detail="still running 20 s after SIGTERM and SIGKILL; left behind"
  elif [[ -n $stopped && $name == memcheck* ]]; then # it runs until the deadline by design
    result=partial
    detail="cut at the deadline; $(grep -c '^========= [A-Z][a-z]' "$log" || true) sanitizer reports before that"
  elif [[ -n $stopped ]]; then
    result=TIMEOUT detail="stopped after $limit s; last line: $(last_line "$log")"
  elif ((rc == 0)) && [[ $name == "ncu gpt2 step" ]]; then # the step's time by kernel; none is a failure
    result=passed
    python3 "$root/tools/step-kernels" "$log" >"$logs/step-kernels.txt" 2>&1 || result=FAILED
    detail=$(head -n1 "$logs/step-kernels.txt")
    step_kernels=$logs/step-kernels.txt
  elif ((rc == 0)) && [[ $name == ncu* ]]; then # the profile's figures; no kernel profiled is a failure
    detail=$(awk 'function add(s) { out = out sep s; sep = "; " }
      /^    Duration / { add($NF " " $(NF - 1)) } /^    Registers Per Thread / { add($NF " registers") }
      /^    Achieved Occupancy / { add($NF "% occupancy") } /^    Issue Slots Busy / { add($NF "% issue slots busy") }
      END { print out }' "$log")
    result=passed
    [[ -n $detail ]] || result=FAILED detail="no kernel profiled; last line: $(last_line "$log")"
  elif ((rc == 0)); then
    result=passed
    detail=$(grep -E '^(All tests passed|test cases:)|Loss:|s per step|ms/step|ERROR SUMMARY' "$log" | tail -n2 | paste -sd';' - || true)
  elif ((rc > 128)) && { grep -q 'fatal error condition' "$log" || ! grep -q '^test cases:' "$log"; }; then
    # (Catch's status counts failed assertions, up to 255; on a signal it prints its totals too)
    result=CRASHED detail="signal $((rc - 128)); last line: $(last_line "$log")"
  else
    result=FAILED
    detail=$(grep -E '^test cases:|ERROR SUMMARY' "$log" | tail -n1 || true)
    detail=${detail:-$(last_line "$log")}
  fi
  row "$name" "$result" "$took" "${detail:0:200}"
}

# bench_cuda runs after the tests, which check the kernels it times (and which a slow bench_cuda
# cannot crowd out); 120 s are kept for it, and the steps that this kept back run after it.
catch=(--durations yes)
[[ ! -x $build/${program[bench_cuda]} ]] || reserve=120
step test_cuda_device 60 test_cuda_device "${catch[@]}"
step test_cuda_runtime 120 test_cuda_runtime "${catch[@]}"
step test_cuda_ops 150 test_cuda_ops "${catch[@]}"
step test_cuda_layers 180 test_cuda_layers "${catch[@]}"
step test_cuda_gemm 120 test_cuda_gemm "${catch[@]}"
step test_cuda_attention 150 test_cuda_attention "${catch[@]}"
step test_cuda_engine 180 test_cuda_engine "${catch[@]}"
# The cases tagged [timeout] may leave a half-initialised communicator or hang: alone, after the rest.
step test_nccl 150 test_nccl "${catch[@]}" '~[timeout]'
step 'test_nccl [timeout]' 75 test_nccl "${catch[@]}" '[timeout]'
step test_cuda_training 240 test_cuda_training "${catch[@]}"
step test_cuda_decoder 180 test_cuda_decoder "${catch[@]}"
step test_cuda_checkpoint 120 test_cuda_checkpoint "${catch[@]}"
# The article's script, 100 steps; the model goes to a temporary folder, not into the logs.
step train_fsdp_cuda 180 train_fsdp_cuda --seed 0 --out "$tmp/model.safetensors" --metrics "$logs/train_fsdp_cuda.jsonl"
# The decoder example, GPT-2 then LLaMA, on a text every Debian/Ubuntu has (else this repository's design notes).
text=/usr/share/common-licenses/GPL-3
[[ -r $text ]] || text=$root/docs/design.md
step train_gpt_cuda 120 train_gpt_cuda --seed 0 --data "$text"
step 'train_gpt_cuda llama' 120 train_gpt_cuda --seed 0 --data "$text" --model llama
# GPT-2 124M as llm.c trains it (12 layers of 768, 12 heads, sequence 1024, the vocabulary padded to
# 50304, batch 8) on llm.c's token format (this repository's fixture: 4800 tokens; the speed, not the loss).
tokens=$root/tests/golden/tokens
step 'train_gpt_cuda gpt2-124m tokens' 120 train_gpt_cuda --seed 0 --tokens "$tokens/gpt2_train.bin" \
  --val-tokens "$tokens/gpt2_val.bin" --tokenizer "$tokens/tokenizer.bin" --vocab 50304 --layers 12 --d-model 768 \
  --heads 12 --seq 1024 --batch 8 --steps 30 --every 10 --eval-every 30 --warmup 5 --sample 16
if ((gpus > 1)) && [[ $backends == *mpi* ]] && command -v mpirun >/dev/null; then
  via=(mpirun --allow-run-as-root -np "$gpus")
  step "train_fsdp_cuda np=$gpus" 180 train_fsdp_cuda --seed 0 --out "$tmp/model.safetensors" \
    --metrics "$logs/train_fsdp_cuda_np$gpus.jsonl"
  via=()
fi
# One process per GPU without MPI, as torchrun starts them: NCCL's id through the TCP store
# (tests/launch/device_processes.sh runs the same with NCCL emulated).
if ((gpus > 1)) && command -v python3 >/dev/null; then
  via=(python3 "$root/tools/launch" -n "$gpus" --)
  step "train_gpt_cuda np=$gpus (tools/launch)" 120 train_gpt_cuda --seed 0 --data "$text" --steps 100
  via=()
fi
bench_json=$logs/bench_cuda.jsonl
peak=() # the datasheet's dense bf16 rate, for GPUs whose name says which part they are: MFU as usually stated
case ${gpu_list%%,*} in
*H200 | *"H100 80GB HBM3" | *"H100 SXM"*) peak=(--peak-tflops 989) ;;
esac
reserve=0
step bench_cuda 300 bench_cuda --json "$bench_json" "${peak[@]}"
for call in "${deferred[@]}"; do eval "$call"; done
via=()
# profiled NAME CAP NCU_ARGS... -- ARGS...: bench_cuda ARGS under ncu NCU_ARGS for at most CAP
# seconds, or the row that says why not.
profiled() {
  local name=$1 cap=$2
  local -a options=()
  shift 2
  while [[ $1 != -- ]]; do options+=("$1"); shift; done
  shift
  if [[ -z $profiler ]]; then
    row "$name" omitted "" "ncu not found"
  elif [[ ! -x $build/${program[bench_cuda]} ]]; then
    row "$name" omitted "" "bench_cuda was not built"
  elif ((end - EPOCHSECONDS < cap + 15)); then # and the 15 s limit_for keeps
    row "$name" omitted "" "less than $((cap + 15)) s left"
  else
    via=("$profiler" "${options[@]}")
    step "$name" "$cap" bench_cuda "$@"
    via=()
  fi
}
# One launch of each tensor-core attention kernel at head_dim 128 (bench_cuda's: bf16, causal,
# L 2048): time, registers, occupancy, issue rate, stall reasons; the whole report in the logs.
for kernel in forward dq dkdv; do
  profiled "ncu $kernel" 60 --clock-control none --kernel-name-base demangled -c 1 \
    -k "regex:tensor::${kernel}_kernel<\\(int\\)128" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
    -- --model none
done
# Every kernel of one GPT-2 training step at bench_cuda's sizes but 2 layers (the step's other kernels
# are per layer or once per step), timed as it runs (clocks and caches left alone): where a step's
# time goes. bench_cuda brackets that step with cudaProfilerStart/Stop (--profile-step).
if [[ -n $profiler ]] && ! command -v python3 >/dev/null; then
  row "ncu gpt2 step" omitted "" "python3 not found (tools/step-kernels sums the profile)"
else
  profiled "ncu gpt2 step" 90 --profile-from-start off --clock-control none --cache-control none --csv \
    --metrics gpu__time_duration.sum -- --model gpt2 --layers 2 --profile-step
fi
# Without the 2^32-float sweep and the [large] cases, as the emulated twin test_emulated_ops.
if [[ -z $sanitizer ]]; then
  row "memcheck test_cuda_ops" omitted "" "compute-sanitizer not found"
elif ((end - EPOCHSECONDS < 60)); then
  row "memcheck test_cuda_ops" omitted "" "less than a minute left"
else
  via=("$sanitizer" --tool memcheck --error-exitcode 1)
  step "memcheck test_cuda_ops" "$deadline" test_cuda_ops '~[element]~[large]'
  via=()
fi
((problems == 0))
