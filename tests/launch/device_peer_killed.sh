#!/usr/bin/env bash
# device_peer_killed.sh SECONDS DEVICE_PROGRAM ARGS...
# A GPU program (train_gpt_cuda built against tests/emulated) as 2 processes started by
# hand (torchrun's variables; no launcher to stop the survivor), the emulated NCCL's ranks
# meeting through files, SHARDLIB_COMM_TIMEOUT=10. Once rank 1 has printed its step 1 it
# is killed (SIGKILL: no abort, no goodbye) while rank 0 still trains. Passes when rank 0
# then ends with status 1 within the timeout and 10 s, naming the collective it waited in
# and the limit (NcclComm's watchdog), where NCCL itself would wait for ever.
set -u
limit=$1 program=$2
shift 2
timeout_s=10
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(mktemp -d)
p0="" p1=""
# Whatever happens: no process left behind (timeout leads a process group of its own).
trap '[[ -z $p1 ]] || kill -9 "$p1" 2>/dev/null; [[ -z $p0 ]] || kill -9 -- -"$p0" 2>/dev/null; rm -rf "$out"' EXIT
export SHARDLIB_COMM_TIMEOUT=$timeout_s SHARDLIB_EMULATED_NCCL_DIR=$out/nccl MASTER_ADDR=127.0.0.1 \
  MASTER_PORT=$port WORLD_SIZE=2
RANK=0 LOCAL_RANK=0 timeout --kill-after=5 "$limit" "$program" "$@" >"$out/0" 2>&1 &
p0=$!
RANK=1 LOCAL_RANK=1 "$program" "$@" >"$out/1" 2>&1 &
p1=$!
until grep -q "Rank 1, Step 1," "$out/1" || ! kill -0 "$p1" 2>/dev/null || ((SECONDS > limit)); do sleep 0.05; done
if ! grep -q "Rank 1, Step 1," "$out/1"; then
  sed 's/^/[rank 1] /' "$out/1"
  echo "FAILED: rank 1 did not reach its step 1"
  exit 1
fi
kill -0 "$p0" 2>/dev/null || { sed 's/^/[rank 0] /' "$out/0"; echo "FAILED: rank 0 ended before rank 1 was killed"; exit 1; }
kill -9 "$p1"
wait "$p1" 2>/dev/null
p1=""
start=$(date +%s%N)
wait "$p0"
status=$?
p0=""
ms=$((($(date +%s%N) - start) / 1000000))
sed 's/^/[rank 0] /' "$out/0"
sed 's/^/[rank 1] /' "$out/1"
if ((status == 124 || status == 137)); then
  echo "FAILED: rank 0 was still running after $limit s"
  exit 1
elif ((status != 1)); then
  echo "FAILED: rank 0 exited with status $status, expected 1"
  exit 1
elif ((ms > (timeout_s + 10) * 1000)); then
  echo "FAILED: rank 0 raised $ms ms after rank 1 was killed, more than the ${timeout_s} s limit and 10 s"
  exit 1
fi
# The collective as the library names it: all_gather(6352 x BF16), all_reduce(1 x F32, avg), ...
pattern="rank 0/2: the NCCL communicator on device 0 was aborted: [a-z_]+\([0-9]+ x [A-Z0-9]+[^)]*\) (was not accepted|did not finish) within ${timeout_s}000 ms"
grep -Eq "$pattern" "$out/0" || { echo "FAILED: no line matches: $pattern"; exit 1; }
printf 'rank 0 raised %d.%d s after rank 1 was killed\n' $((ms / 1000)) $((ms % 1000 / 100))
