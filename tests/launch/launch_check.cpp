// launch_check — what tests/launch runs as separate processes, through tools/launch
// or by hand: each process one rank, the communicator from run_from_environment.
//   launch_check conformance   the conformance suite; exit 1 on any failure
//   launch_check dies          rank 1 exits (status 3) inside a loop of collectives;
//                              every other rank must report the error and exit 1
#include "shardlib/comm/run.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "support/comm_conformance.hpp"

using namespace shardlib;

namespace {

template <class Comm>
int conformance_run(Comm& c) {
  conformance::report out;
  conformance::full_suite(c, out);
  conformance::split_suite(c, out);
  conformance::ordered_sum_suite(c, out);
  for (auto& f : out.failures) std::fprintf(stderr, "%s\n", f.c_str());
  std::printf("rank %d of %d: %d checks, %zu failures\n", c.rank(), c.size(), out.checks, out.failures.size());
  return out.failures.empty() && out.checks > 0 ? 0 : 1;
}

template <class Comm>
void dies(Comm& c) {
  std::vector<float> x(4096, 1.f);
  for (int step = 0; step < 1000; ++step) {
    if (c.rank() == 1 && step == 5) {
      std::fflush(stdout);
      std::_Exit(3);  // as a crash would: no unwinding, the kernel closes the sockets
    }
    c.all_reduce(std::span<float>(x), comm::reduce_op::avg);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "conformance" && mode != "dies") {
    std::fprintf(stderr, "usage: launch_check conformance|dies\n");
    return 2;
  }
  int status = 0;
  try {
    comm::run_from_environment([&](auto& c) {
      if (mode == "conformance") status = conformance_run(c);
      else dies(c);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return status;
}
