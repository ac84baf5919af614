#!/usr/bin/env bash
# device_processes.sh [--encoder] N HOST_PROGRAM DEVICE_PROGRAM ARGS...
# A GPU program (train_gpt_cuda built against tests/emulated) as N processes started by
# tools/launch: NCCL's id through the TCP store, the emulated NCCL's ranks meeting through
# files (SHARDLIB_EMULATED_NCCL_DIR), one device each. It trains in fp32 with ARGS,
# checkpointing every 3 steps, and must print the losses the host program (train_gpt)
# prints with N rank threads, within 20 millionths (the products sum in another order;
# the runs printed the same digits when this was written). Then the host program, N
# threads, resumes from the processes' checkpoint of step 3: its losses from there must
# be its own whole run's, within the same bound.
# With --encoder the programs are train_fsdp and train_fsdp_cuda: the losses the same way,
# the model written (--out) and every rank's lines in the metrics file the processes share
# (--metrics: rank 0 empties it, each process appends), no checkpoints.
set -eu
encoder=false
[[ $1 != --encoder ]] || { encoder=true; shift; }
n=$1 host=$2 device=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
losses() { grep -Eo 'Rank [0-9]+, Step [0-9]+, Loss: .*' "$1" | sort; }
# Every line of $1 and $2 the same but for losses within 20 millionths; a loss that is
# not a finite number with six decimals fails.
close() {
  [[ $(wc -l <"$1") == $(wc -l <"$2") ]] || { echo "  $(wc -l <"$1") loss lines against $(wc -l <"$2")"; return 1; }
  paste -d '|' "$1" "$2" | awk -F '|' '
    function finite(s) { return s ~ /Loss: -?[0-9]+\.[0-9][0-9][0-9][0-9][0-9][0-9]$/ }
    function value(s) { sub(/.*Loss: /, "", s); return s + 0 }
    !finite($1) || !finite($2) { print "  not a finite loss: " $1 "  against  " $2; bad = 1; next }
    { a = $1; b = $2; pa = a; pb = b; sub(/Loss: .*/, "", pa); sub(/Loss: .*/, "", pb)
      d = value(a) - value(b); if (d < 0) d = -d
      if (pa != pb || d > 0.00002) { print "  " a "  against  " b; bad = 1 } }
    END { exit bad }'
}
# run NAME COMMAND...: COMMAND's output into $out/NAME.txt, shown when it fails.
run() {
  local name=$1
  shift
  local status=0
  "$@" >"$out/$name.txt" 2>&1 || status=$?
  ((status == 0)) || { cat "$out/$name.txt"; echo "FAILED: the $name run (status $status)"; exit 1; }
}

processes=(env SHARDLIB_EMULATED_NCCL_DIR="$out/nccl" "$here/../../tools/launch" -n "$n" -- "$device" --dtype fp32)
if $encoder; then
  run host "$host" --world "$n" --out "$out/host.safetensors" "$@"
  echo "an earlier run's line" >"$out/metrics.jsonl"  # rank 0 empties the file first
  run device "${processes[@]}" --out "$out/device.safetensors" --metrics "$out/metrics.jsonl" "$@"
else
  run host "$host" --world "$n" --save "$out/host_hf" "$@"
  run device "${processes[@]}" --checkpoint-dir "$out/ckpt" --checkpoint-every 3 --save "$out/device_hf" "$@"
fi
cat "$out/device.txt"
losses "$out/host.txt" >"$out/host.losses"
losses "$out/device.txt" >"$out/device.losses"
[[ -s $out/host.losses ]] || { echo "FAILED: the host run printed no losses"; exit 1; }
close "$out/host.losses" "$out/device.losses" || { echo "FAILED: the processes' losses are not the threads'"; exit 1; }
if $encoder; then
  [[ -s $out/device.safetensors ]] || { echo "FAILED: no model written"; exit 1; }
  ! grep -q "earlier run" "$out/metrics.jsonl" || { echo "FAILED: the metrics file was not emptied first"; exit 1; }
  for ((r = 0; r < n; ++r)); do
    grep -q "\"world\":$n,\"rank\":$r," "$out/metrics.jsonl" || { echo "FAILED: no metrics of rank $r of $n"; exit 1; }
  done
  echo "$n processes: $(wc -l <"$out/device.losses") loss lines as the $n threads'; the model and every rank's metrics written"
  exit 0
fi
grep -q "over $n GPU(s)" "$out/device.txt" || { echo "FAILED: the processes did not train as one world of $n"; exit 1; }
[[ -f $out/device_hf/model.safetensors ]] || { echo "FAILED: no model written"; exit 1; }

run resumed "$host" --world "$n" --save "$out/resumed_hf" --resume "$out/ckpt/step-00000003" "$@"
grep -q "resumed from .* at step 3$" "$out/resumed.txt" || { echo "FAILED: the host run did not resume at step 3"; exit 1; }
losses "$out/resumed.txt" >"$out/resumed.losses"
grep -E 'Step ([3-9]|[1-9][0-9]+),' "$out/host.losses" >"$out/host.after" || true
[[ -s $out/resumed.losses ]] || { echo "FAILED: the resumed run printed no losses"; exit 1; }
close "$out/host.after" "$out/resumed.losses" || { echo "FAILED: resumed from the processes' checkpoint, other losses"; exit 1; }
echo "$n processes: $(wc -l <"$out/device.losses") loss lines as the $n threads'; their checkpoint of step 3 resumed by $(basename "$host")"
