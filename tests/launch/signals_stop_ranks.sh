#!/usr/bin/env bash
# signals_stop_ranks.sh LAUNCH: for each of SIGHUP, SIGQUIT, SIGINT, SIGTERM and
# SIGKILL, the launcher of two ranks that would sleep for a minute gets the signal (a
# terminal's hangup, Ctrl-\, Ctrl-C, kill, kill -9 or the OOM killer); both ranks must be
# gone within seconds and the launcher must exit with 128 + the signal. The ranks run
# in sessions of their own, so only the launcher can pass the first four on; after
# SIGKILL only the ranks' parent-death signal stops them.
set -u
launch=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0
for sig in HUP QUIT INT TERM KILL; do
  rm -f "$dir"/pid.*
  "$launch" -n 2 --grace 2 -- sh -c "echo \$\$ > $dir/pid.\$RANK; exec sleep 60" >/dev/null 2>&1 &
  launcher=$!
  for _ in $(seq 100); do [[ -s $dir/pid.0 && -s $dir/pid.1 ]] && break; sleep 0.05; done
  [[ -s $dir/pid.0 && -s $dir/pid.1 ]] || { echo "FAILED ($sig): the ranks did not start"; fail=1; kill -9 $launcher; continue; }
  kill -s "$sig" $launcher
  wait $launcher
  status=$?
  want=$((128 + $(kill -l "$sig")))
  ((status == want)) || { echo "FAILED ($sig): the launcher exited with $status, expected $want"; fail=1; }
  for r in 0 1; do
    pid=$(cat "$dir/pid.$r")
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "FAILED ($sig): rank $r (pid $pid) still runs"
      kill -9 "$pid"
      fail=1
    fi
  done
  ((fail == 0)) && echo "SIG$sig: the launcher exited with $status and stopped both ranks"
done
exit $fail
