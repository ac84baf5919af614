#!/usr/bin/env bash
# tool_stops_others.sh LAUNCH: rank 1 of 3 exits with status 3 while the others
# would sleep for a minute; tools/launch must stop them within seconds, say which
# rank failed, and exit with status 3.
set -u
start=$(date +%s)
output=$("$1" -n 3 --grace 2 -- sh -c 'if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 60' 2>&1)
status=$?
elapsed=$(($(date +%s) - start))
printf '%s\n' "$output"
((status == 3)) || { echo "FAILED: tools/launch exited with $status, expected 3"; exit 1; }
((elapsed < 15)) || { echo "FAILED: the others ran on for $elapsed s"; exit 1; }
grep -q 'rank 1 failed (exit status 3); stopping the others' <<<"$output" || { echo "FAILED: no line names rank 1"; exit 1; }
echo "tools/launch stopped the others after $elapsed s and exited with 3"
