#!/usr/bin/env bash
# tests/tools/step_kernels.sh TOOL DIR: tools/step-kernels reads both of Nsight Compute's CSV
# layouts (the details page in nanoseconds, the raw page in microseconds with thousands
# separators) in a log that mixes the program's lines in, and prints the same expected table
# for each; a log without a profile exits with status 1 and ncu's last error, one with a unit
# it does not know with status 1 and that unit.
set -euo pipefail
tool=$1 dir=$2
command -v python3 > /dev/null || { echo "SKIPPED: python3 not found"; exit 0; }
for log in ncu_details.log ncu_raw.log; do
  diff -u "$dir/step_kernels.expected" <("$tool" "$dir/$log") || { echo "FAILED: $log"; exit 1; }
done
# expect LOG STATUS TEXT: the tool's status and first line for LOG
expect() {
  local status=0 out
  out=$("$tool" "$1") || status=$?
  [[ $status == "$2" && ${out%%$'\n'*} == *"$3"* ]] ||
    { echo "FAILED: $1 gave status $status and '${out%%$'\n'*}', not $2 and '$3'"; exit 1; }
}
expect "$dir/ncu_none.log" 1 "nothing profiled); ==ERROR== ERR_NVGPUCTRPERM"
bad=$(mktemp)
trap 'rm -f "$bad"' EXIT
sed 's/"nsecond"/"furlong"/' "$dir/ncu_details.log" > "$bad"
expect "$bad" 1 "unknown unit 'furlong'"
echo "step-kernels: both layouts give the expected table; no profile and an unknown unit give status 1 and why"
