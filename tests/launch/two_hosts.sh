#!/usr/bin/env bash
# two_hosts.sh PROGRAM: the conformance suite over SocketComm with three processes
# on two "hosts", network namespaces joined by a veth pair (10.200.0.1 and
# 10.200.0.2). Ranks 0 and 1 share the first host and reach the store there
# through 127.0.0.1, as a MASTER_ADDR that the host's /etc/hosts maps to 127.0.1.1
# does; rank 2 reaches it across the link. So ranks 0 and 1 publish loopback
# addresses, and rank 2 must reach them at 10.200.0.1 instead. Needs root and
# iproute2's `ip netns`; prints SKIPPED (which ctest reads) where either is missing.
set -u
program=$1
skip() { echo "SKIPPED: $*"; exit 0; }
((EUID == 0)) || skip "two network namespaces need root"
command -v ip >/dev/null || skip "no ip command (Debian: apt-get install iproute2)"
a=shl$$a b=shl$$b
ip netns add "$a" 2>/dev/null || skip "ip netns add failed (no network namespaces here)"
trap 'ip netns del "$a"' EXIT
ip netns exec "$a" true 2>/dev/null || skip "ip netns exec failed (no /sys to mount here?)"
out=$(mktemp -d)
trap 'ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; rm -rf "$out"' EXIT
ip netns add "$b" && ip link add "$a" netns "$a" type veth peer name "$b" netns "$b" &&
  ip -n "$a" addr add 10.200.0.1/24 dev "$a" && ip -n "$b" addr add 10.200.0.2/24 dev "$b" &&
  ip -n "$a" link set lo up && ip -n "$a" link set "$a" up &&
  ip -n "$b" link set lo up && ip -n "$b" link set "$b" up || { echo "FAILED: cannot set up the two namespaces"; exit 1; }
host=("$a" "$a" "$b") master=(127.0.0.1 127.0.0.1 10.200.0.1)
pids=()
for r in 0 1 2; do
  ip netns exec "${host[$r]}" env RANK=$r WORLD_SIZE=3 MASTER_ADDR="${master[$r]}" MASTER_PORT=29500 \
    timeout --kill-after=5 40 "$program" conformance >"$out/$r" 2>&1 &
  pids+=($!)
done
fail=0
for r in 0 1 2; do
  wait "${pids[$r]}"
  status=$?
  sed "s/^/[rank $r] /" "$out/$r"
  ((status == 0)) || { echo "FAILED: rank $r exited with $status"; fail=1; }
done
((fail == 0)) && echo "three ranks on two hosts passed the conformance suite"
exit $fail
