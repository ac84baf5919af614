#!/usr/bin/env bash
# expect_failure.sh SECONDS LAUNCHER... -- PROGRAM ARGS... -- PATTERN...
# Runs PROGRAM under the MPI launcher and passes when the job failed as it must:
# it ended within SECONDS, the launcher and every process exited non-zero (each
# process reports its status through a shell around it; one killed by the
# launcher reports nothing), and every PATTERN (an extended regular expression)
# matches a line of the output.
set -u
limit=$1
shift
launcher=()
while [[ $# -gt 0 && $1 != -- ]]; do launcher+=("$1"); shift; done
shift
program=()
while [[ $# -gt 0 && $1 != -- ]]; do program+=("$1"); shift; done
shift

start=$(date +%s%N)
# shellcheck disable=SC2016  # expanded by the shell around each process
output=$(timeout --kill-after=10 "$limit" "${launcher[@]}" \
  sh -c '"$@"; s=$?; echo "rank ${OMPI_COMM_WORLD_RANK:-$PMI_RANK} exit status $s"; exit $s' sh "${program[@]}" 2>&1)
status=$?
ms=$((($(date +%s%N) - start) / 1000000))
printf '%s\n' "$output"

fail() {
  echo "FAILED: $*"
  exit 1
}
((status == 124 || status == 137)) && fail "the job was still running after $limit s"
((status == 0)) && fail "the launcher exited with status 0"
grep -q ' exit status 0$' <<<"$output" && fail "a process exited with status 0"
for pattern; do
  grep -Eq -- "$pattern" <<<"$output" || fail "no line matches: $pattern"
done
printf 'the job failed as expected: launcher status %d after %d.%d s\n' "$status" $((ms / 1000)) $((ms % 1000 / 100))
