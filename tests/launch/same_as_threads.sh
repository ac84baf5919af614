#!/usr/bin/env bash
# same_as_threads.sh N TRAIN_FSDP ARGS...
# Trains with N rank threads in one process, then with N processes through
# tools/launch, and passes when both print the same losses (every rank, every
# printed step) and write byte-identical models: SocketComm reduces in rank order,
# as ThreadComm does, so the two runs must agree bit for bit.
set -eu
n=$1 program=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$program" --world "$n" --out "$out/threads.safetensors" "$@" >"$out/threads.txt"
"$here/../../tools/launch" -n "$n" -- "$program" --out "$out/processes.safetensors" "$@" >"$out/processes.txt"
losses() { grep -Eo 'Rank [0-9]+, Step [0-9]+, Loss: .*' "$1" | sort; }
losses "$out/threads.txt" >"$out/threads.losses"
losses "$out/processes.txt" >"$out/processes.losses"
cat "$out/processes.txt"
[[ -s $out/threads.losses ]] || { echo "FAILED: the thread run printed no losses"; exit 1; }
diff "$out/threads.losses" "$out/processes.losses" || { echo "FAILED: the losses differ"; exit 1; }
cmp "$out/threads.safetensors" "$out/processes.safetensors" || { echo "FAILED: the models differ"; exit 1; }
echo "$(wc -l <"$out/threads.losses") loss lines and the model equal the thread run's"
