#!/usr/bin/env bash
# peer_dies.sh SECONDS N PROGRAM ARGS... -- PATTERN...
# Starts N processes of PROGRAM by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
# no launcher that would kill the survivors), one of which dies. Passes when all
# have ended within SECONDS, rank 1 with status 3, every other rank with status 1,
# and every PATTERN (an extended regular expression) matches a line of the output.
set -u
limit=$1 n=$2
shift 2
program=()
while [[ $# -gt 0 && $1 != -- ]]; do program+=("$1"); shift; done
shift
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$(date +%s%N)
pids=()
for ((r = 0; r < n; ++r)); do
  RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout --kill-after=5 "$limit" "${program[@]}" >"$out/$r" 2>&1 &
  pids+=($!)
done
fail=0
for ((r = 0; r < n; ++r)); do
  wait "${pids[$r]}"
  status=$?
  sed "s/^/[rank $r] /" "$out/$r"
  want=1
  ((r == 1)) && want=3
  if ((status == 124 || status == 137)); then
    echo "FAILED: rank $r was still running after $limit s"
    fail=1
  elif ((status != want)); then
    echo "FAILED: rank $r exited with status $status, expected $want"
    fail=1
  fi
done
ms=$((($(date +%s%N) - start) / 1000000))
all=$(cat "$out"/*)
for pattern; do
  grep -Eq -- "$pattern" <<<"$all" || { echo "FAILED: no line matches: $pattern"; fail=1; }
done
((fail)) && exit 1
printf 'the survivors failed as expected after %d.%d s\n' $((ms / 1000)) $((ms % 1000 / 100))
