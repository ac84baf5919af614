#!/usr/bin/env bash
# same_as_threads.sh [--save-dir] [--mpirun MPIEXEC] N PROGRAM ARGS...
# Trains with N rank threads in one process, then with N processes through
# tools/launch (or MPIEXEC -np N: a program built with MPI), and passes when both print the same losses (every rank, every
# printed step) and write byte-identical models: SocketComm reduces in rank order,
# as ThreadComm does, so the two runs must agree bit for bit. The model is the file
# --out names (train_fsdp), or with --save-dir DIR/model.safetensors of --save DIR
# (train_gpt's Hugging Face checkpoint).
set -eu
save_dir=false mpirun=""
[[ $1 != --save-dir ]] || { save_dir=true; shift; }
[[ $1 != --mpirun ]] || { mpirun=$2; shift 2; }
n=$1 program=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# output RUN: sets `written` to the flag and path that make PROGRAM write its model for RUN;
# model RUN: that file.
output() { if $save_dir; then written=(--save "$out/$1"); else written=(--out "$out/$1.safetensors"); fi; }
model() { if $save_dir; then echo "$out/$1/model.safetensors"; else echo "$out/$1.safetensors"; fi; }
output threads
"$program" --world "$n" "${written[@]}" "$@" >"$out/threads.txt"
if [[ -n $mpirun ]]; then
  launcher=("$mpirun" -n "$n")  # oversubscribed through the environment (tests/mpi)
else
  launcher=("$here/../../tools/launch" -n "$n" --)
fi
output processes
"${launcher[@]}" "$program" "${written[@]}" "$@" >"$out/processes.txt"
losses() { grep -Eo 'Rank [0-9]+, Step [0-9]+, Loss: .*' "$1" | sort; }
losses "$out/threads.txt" >"$out/threads.losses"
losses "$out/processes.txt" >"$out/processes.losses"
cat "$out/processes.txt"
[[ -s $out/threads.losses ]] || { echo "FAILED: the thread run printed no losses"; exit 1; }
diff "$out/threads.losses" "$out/processes.losses" || { echo "FAILED: the losses differ"; exit 1; }
cmp "$(model threads)" "$(model processes)" || { echo "FAILED: the models differ"; exit 1; }
echo "$(wc -l <"$out/threads.losses") loss lines and the model equal the thread run's"
