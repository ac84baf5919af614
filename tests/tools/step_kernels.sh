#!/usr/bin/env bash
# tests/tools/step_kernels.sh TOOL DIR: tools/step-kernels reads both of Nsight Compute's CSV
# layouts (the details page in nanoseconds, the raw page in microseconds with thousands
# separators) in a log that mixes the program's lines in, and prints the same expected table
# for each; a log without a profile exits with status 1.
set -euo pipefail
tool=$1 dir=$2
for log in ncu_details.log ncu_raw.log; do
  diff -u "$dir/step_kernels.expected" <("$tool" "$dir/$log") || { echo "FAILED: $log"; exit 1; }
done
status=0
"$tool" "$dir/ncu_none.log" > /dev/null || status=$?
[[ $status == 1 ]] || { echo "FAILED: a log without a profile exited with $status, not 1"; exit 1; }
echo "step-kernels: both layouts give the expected table; no profile gives status 1"
