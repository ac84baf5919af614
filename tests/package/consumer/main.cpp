// Uses the host umbrella header the way a user's program does.
#include <shardlib/shardlib.hpp>

#include <cstdio>
#include <vector>

int main() {
  bool ok = true;
  shardlib::comm::launch(3, [&](shardlib::comm::ThreadComm& c) {
    std::vector<int> mine{c.rank()}, all(3);
    c.all_gather(std::span<const int>(mine), std::span<int>(all));
    if (all != std::vector<int>{0, 1, 2}) ok = false;  // each rank writes only on failure
  });
  std::puts(ok ? "consumer: all_gather ok" : "consumer: all_gather WRONG");
  return ok ? 0 : 1;
}
