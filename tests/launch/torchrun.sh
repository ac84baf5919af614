#!/usr/bin/env bash
# torchrun.sh PROGRAM: the conformance suite with one rank per process under PyTorch's
# own torchrun, whose agent serves its TCPStore at MASTER_PORT (the library's store
# then listens on a free port that rank 0 announces there):
#   1. one node, 3 processes (--standalone: a free port);
#   2. two nodes of 2 processes, static rendezvous: two network namespaces joined by a
#      veth pair where root and `ip netns` allow (both agents given node 0's 10.200.1.1:
#      torch 2.3 hands node 0's --master_addr to every node's workers), else two agents
#      on this host;
#   3. a rank that dies, with one restart allowed, on one agent (--standalone) and on two
#      (c10d rendezvous, where only the failed rank's agent counts the restart): the
#      second attempt must meet afresh, past the first one's announcement.
# torchrun is taken from SHARDLIB_TORCHRUN or PATH; where there is none (pip install
# torch) this prints SKIPPED, which ctest reads.
set -u
program=$1
torchrun=${SHARDLIB_TORCHRUN:-$(command -v torchrun)}
[[ -n $torchrun && -x $torchrun ]] || { echo "SKIPPED: no torchrun (pip install torch, or set SHARDLIB_TORCHRUN)"; exit 0; }
# A torchrun that cannot start a worker at all (Debian 12's torch 1.13 under Python 3.11)
# tests nothing of the library's. Flags in underscores: torch 1.x has no dashed forms.
if ! smoke=$(timeout 60 "$torchrun" --standalone --nproc_per_node 1 --no_python true 2>&1); then
  echo "SKIPPED: $torchrun cannot start a worker here: $(tail -n 1 <<<"$smoke")"
  exit 0
fi
out=$(mktemp -d)
cleanup=(rm -rf "$out")
trap '"${cleanup[@]}"' EXIT
fail=0
expect_passed() {  # log ranks: every rank reported 0 failures
  local r
  for ((r = 0; r < $2; r++)); do
    grep -q "^rank $r of $2: [1-9][0-9]* checks, 0 failures" "$1" || { echo "FAILED: rank $r of $2 in $1"; fail=1; }
  done
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

timeout --kill-after=5 90 "$torchrun" --standalone --nproc_per_node 3 --no_python "$program" conformance \
  >"$out/one_node" 2>&1
echo "[one node] exit $?"; grep "checks" "$out/one_node"
expect_passed "$out/one_node" 3

port=$(free_port)
node() {  # node node_rank master_addr [netns]
  local run=()
  [[ -n ${3:-} ]] && run=(ip netns exec "$3")
  "${run[@]}" timeout --kill-after=5 90 "$torchrun" --nnodes 2 --node_rank "$1" --nproc_per_node 2 \
    --master_addr "$2" --master_port "$port" --no_python "$program" conformance >"$out/node$1" 2>&1
}
a=shlt$$a b=shlt$$b
if ((EUID == 0)) && command -v ip >/dev/null && ip netns add "$a" 2>/dev/null; then
  cleanup=(sh -c "ip netns del $a 2>/dev/null; ip netns del $b 2>/dev/null; rm -rf $out")
  ip netns add "$b" && ip link add "$a" netns "$a" type veth peer name "$b" netns "$b" &&
    ip -n "$a" addr add 10.200.1.1/24 dev "$a" && ip -n "$b" addr add 10.200.1.2/24 dev "$b" &&
    ip -n "$a" link set lo up && ip -n "$a" link set "$a" up &&
    ip -n "$b" link set lo up && ip -n "$b" link set "$b" up || { echo "FAILED: cannot set up the two namespaces"; exit 1; }
  echo "[two nodes] network namespaces $a (10.200.1.1) and $b (10.200.1.2)"
  node 0 10.200.1.1 "$a" & first=$!
  node 1 10.200.1.1 "$b"
else
  echo "[two nodes] on this host (no network namespaces here)"
  node 0 127.0.0.1 & first=$!
  node 1 127.0.0.1
fi
wait $first
cat "$out/node0" "$out/node1" | grep "checks"
cat "$out/node0" "$out/node1" >"$out/two_nodes"
expect_passed "$out/two_nodes" 4

# Rank 1 exits (status 3) in a loop of collectives; torchrun restarts the group once.
# Both attempts must reach the collectives (the second through a fresh announcement)
# and their survivors name rank 1.
timeout --kill-after=5 90 "$torchrun" --standalone --nproc_per_node 3 --max_restarts 1 --no_python "$program" dies \
  >"$out/dies" 2>&1
status=$?
named=$(grep -c "^rank [02]: all_reduce(4096 x F32, avg), collective [0-9]* on a communicator of 3 ranks: the connection to rank 1 .* closed" "$out/dies")
echo "[dies] exit $status, $named survivors named rank 1 over two attempts"
((status != 0 && named >= 2)) || { echo "FAILED: a dying rank under torchrun"; sed 's/^/  /' "$out/dies"; fail=1; }

port=$(free_port)
agent() {  # agent log: one of two agents of a c10d rendezvous, one process each
  timeout --kill-after=5 90 "$torchrun" --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d \
    --rdzv_endpoint "127.0.0.1:$port" --rdzv_id "shardlib$$" --max_restarts 1 --no_python "$program" dies >"$1" 2>&1
}
agent "$out/dies_a" & first=$!
agent "$out/dies_b"
wait $first
# (torch 2.3 closes the rendezvous after the first failure instead: one attempt.) A rank
# that cannot find the store names it ("torchrun's store ...", "the store: cannot connect").
named=$(cat "$out/dies_a" "$out/dies_b" |
  grep -c "^rank 0: all_reduce(4096 x F32, avg), collective [0-9]* on a communicator of 2 ranks: the connection to rank 1 .* closed")
lost=$(cat "$out/dies_a" "$out/dies_b" | grep -c "^rank [0-9]*: .*store")
echo "[dies, two agents] rank 0 named rank 1 in $named attempts; $lost ranks did not find the store"
((named >= 1 && lost == 0)) || { echo "FAILED: a dying rank under two agents"; cat "$out/dies_a" "$out/dies_b" | sed 's/^/  /'; fail=1; }
((fail == 0)) && echo "every check under $torchrun passed"
exit $fail
