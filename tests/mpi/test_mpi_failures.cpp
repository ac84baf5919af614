// Processes that diverge, fail or stop under mpirun. Each case must end the whole
// job within the communicator timeout, every process with a non-zero status, and
// say which rank did what; tests/mpi/expect_failure.sh checks that, with
// SHARDLIB_COMM_TIMEOUT set short. Usage: test_mpi_failures CASE, where CASE is
//   returns-early        rank 0 runs 3 steps and returns, the others run 4
//   unchecked-returns-early  the same with the check off: only the watchdog sees it
//   train-returns-early  the same with train_step of a sharded model
//   throws               rank 1 throws in step 2; main catches it and returns 1
//   throws-uncaught      rank 1 throws in step 2 and nothing catches it
//   stops                rank 1 stops itself (SIGSTOP) in step 2
//   finishes             every rank runs 4 steps: the job must succeed, silently
#include "shardlib/mpi.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/shard_fixture.hpp"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

using namespace shardlib;
using comm::MpiComm;

namespace {

// The collectives of a sharded training step, on plain buffers.
void step(MpiComm& c, int s) {
  std::vector<float> shard(8, float(s)), full(8 * std::size_t(c.size()));
  c.all_gather(std::span<const float>(shard), std::span<float>(full));
  c.reduce_scatter(std::span<const float>(full), std::span<float>(shard), comm::reduce_op::sum);
  float loss = shard[0];
  c.all_reduce(std::span<float>(&loss, 1), comm::reduce_op::avg);
}

void inject(const std::string& mode, int rank, int s) {
  if (rank != 1 || s != 2) return;
  if (mode == "throws" || mode == "throws-uncaught") throw std::runtime_error(cat("rank 1: injected failure in step ", s));
  if (mode == "stops") std::raise(SIGSTOP);
}

int run(const std::string& mode) {
  auto c = MpiComm::world({.check = !mode.starts_with("unchecked")});
  const int steps = mode.ends_with("returns-early") && c.rank() == 0 ? 3 : 4;
  if (mode == "train-returns-early") {
    fixture::Model m = fixture::make_model();
    auto model = shard::fully_shard(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<fixture::Block>{}});
    optim::Adam adam;
    for (int s = 0; s < steps; ++s) {
      const int first = c.rank() * 3;
      model.train_step(adam, fixture::batch(s, 3, 5, 1, first), fixture::batch(s, 3, 3, 2, first), fixture::mse);
    }
    return 0;
  }
  for (int s = 0; s < steps; ++s) {
    inject(mode, c.rank(), s);
    step(c, s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  comm::mpi_session session(&argc, &argv);
  const std::string mode = argc == 2 ? argv[1] : "";
  const std::string modes[] = {"returns-early", "unchecked-returns-early", "train-returns-early", "throws",
                               "throws-uncaught", "stops", "finishes"};
  if (std::find(std::begin(modes), std::end(modes), mode) == std::end(modes)) {
    std::fprintf(stderr, "usage: %s CASE (see the comment at the top of test_mpi_failures.cpp)\n", argv[0]);
    return 2;
  }
  if (mode == "throws-uncaught") return run(mode);
  try {
    return run(mode);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
