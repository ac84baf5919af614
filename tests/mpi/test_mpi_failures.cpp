// Processes that diverge, fail or stop under mpirun. Each case must end the whole
// job within the communicator timeout, every process with a non-zero status, and
// say which rank did what; tests/mpi/expect_failure.sh checks that, with
// SHARDLIB_COMM_TIMEOUT set short. Usage: test_mpi_failures CASE, where CASE is
//   returns-early        rank 0 runs 3 steps and returns, the others run 4
//   unchecked-returns-early  the same with the check off: only the watchdog sees it
//   train-returns-early  the same with train_step of a sharded model
//   throws               rank 1 throws in step 2; main catches it and returns 1
//   train-throws-hybrid  HybridShard in groups of 2 (a shard and a replica communicator
//                        besides the world): rank 1's layer throws in step 2's forward
//   throws-uncaught      rank 1 throws in step 2 and nothing catches it
//   throws-under-own-mpi as throws, under an MPI that main starts and finalises itself, the
//                        others late to step 2's collective
//   throws-then-raw-mpi  as throws, then every rank calls MPI_Barrier itself: rank 1's leave
//                        must be over by then (the others waited for it already)
//   throws-holding-two   pairs of ranks gather in a split, then all ranks reduce in the world;
//                        rank 1 throws in step 2 between the two, where rank 0 waits in the
//                        world's collective and rank 1 leaves the pair's communicator first
//   stops                rank 1 stops itself (SIGSTOP) in step 2
//   pair-fails           pairs of ranks gather in a split; rank 1 throws between two of its
//                        collectives, rank 0 comes late to the next, every rank catches what it
//                        gets and the world goes on: the job must succeed, each rank having
//                        seen what it must
//   unwinds-beside-clean-leaver  rank 1 drops a communicator with a shared-memory window
//                        while unwinding, rank 0 drops it cleanly: neither may wait to free it
//   finishes             every rank runs 4 steps: the job must succeed, silently
#include "shardlib/mpi.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/shard_fixture.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
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
  if (s != 2) return;
  // The others reach step 2's collective after rank 1's grace (0.5 s here): its leave is
  // still going when it reaches MPI_Finalize.
  if (mode == "throws-under-own-mpi" && rank != 1) std::this_thread::sleep_for(std::chrono::seconds(1));
  if (rank != 1) return;
  if (mode.starts_with("throws")) throw std::runtime_error(cat("rank 1: injected failure in step ", s));
  if (mode == "stops") std::raise(SIGSTOP);
}

// Rank 1 leaves its pair unwinding; rank 0 reaches the pair's next collective only after
// rank 1's grace (its leave is still going then: rank 0 gathers every posting to name it),
// so rank 1's next call must move it on: an agreement in the world's collective, the
// creation of a communicator, a collective without the check, or (dropping, unwinding, an
// unchecked pair whose reduction made a shared-memory window) the meeting before
// MPI_Win_free; last, the others keep the pair and free that window before they use the
// pair again. Returns 0 when every rank saw what it must each time: rank 1 its own error,
// rank 0 comm_aborted naming rank 1, ranks 2 and 3 nothing.
int pair_fails(MpiComm& c) {
  MpiComm unchecked = MpiComm::world({.check = false});
  float wrong = 0;
  for (const std::string then : {"agreement", "creation", "unchecked", "window", "window, pair kept"}) {
    std::string seen;
    std::optional<MpiComm> kept;  // "window, pair kept": the ranks that do not fail keep the pair
    try {
      std::optional<MpiComm> unchecked_pair;  // dropped after pair
      if (then.starts_with("window")) {
        unchecked_pair = unchecked.split(c.rank() / 2, c.rank());
        float x = 1;
        unchecked_pair->all_reduce(std::span<float>(&x, 1), comm::reduce_op::sum);
      }
      MpiComm pair = c.split(c.rank() / 2, c.rank());
      std::vector<float> shard(8, 1.0f), full(16);
      pair.all_gather(std::span<const float>(shard), std::span<float>(full));
      if (c.rank() == 1) throw std::runtime_error("rank 1: injected failure");
      if (then == "window, pair kept") {
        kept = std::move(pair);  // rank 0 frees the unchecked pair's window first, then uses this
      } else {
        if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(1));  // the grace is 0.5 s here
        pair.reduce_scatter(std::span<const float>(full), std::span<float>(shard), comm::reduce_op::sum);
      }
    } catch (const comm_aborted& e) {
      seen = e.what();
    } catch (const std::runtime_error& e) {
      seen = e.what();
    }
    try {
      if (kept) {
        std::vector<float> full(16, 1.0f), shard(8);
        kept->reduce_scatter(std::span<const float>(full), std::span<float>(shard), comm::reduce_op::sum);
      }
    } catch (const comm_aborted& e) {
      seen = e.what();
    }
    const bool right = c.rank() == 0 ? seen.find("abandoned: rank 1 left the communicator while unwinding") !=
                                           std::string::npos
                       : c.rank() == 1 ? seen == "rank 1: injected failure"
                                       : seen.empty();
    if (!right) std::fprintf(stderr, "rank %d, %s: saw \"%s\"\n", c.rank(), then.c_str(), seen.c_str());
    if (then == "creation") MpiComm again = MpiComm::world();
    float failed = right ? 0 : 1;
    (then == "unchecked" ? unchecked : c).all_reduce(std::span<float>(&failed, 1), comm::reduce_op::sum);
    wrong += failed;
  }
  c.barrier();
  return wrong == 0 ? 0 : 1;
}

// A Linear whose forward throws once armed.
struct tripwire : nn::Linear<float> {
  using nn::Linear<float>::Linear;
  bool armed = false;
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    if (armed) throw std::runtime_error("rank 1: injected failure in a layer's forward");
    return nn::Linear<float>::forward(ctx, x);
  }
};

// Trains HybridShard over groups of 2 (rank 1 shards with rank 0, replicates rank 3), until
// rank 1's middle layer throws in step 2: rank 1 unwinds out of three communicators, its
// peers wait for it in one or another.
int train_throws_hybrid(MpiComm& c) {
  using Model = nn::Sequential<nn::Linear<float>, nn::Stack<tripwire>, nn::Linear<float>>;
  Model m{nn::Linear<float>(5, 8), nn::Stack<tripwire>(3, tripwire(8, 8)), nn::Linear<float>(8, 3)};
  auto model = shard::fully_shard(m, c, shard::HybridShard{.group_size = 2}, {.wrap = shard::wrap_types<tripwire>{}});
  optim::Adam adam;
  for (int s = 0; s < 4; ++s) {
    if (s == 2 && c.rank() == 1) m.get<1>()[1].armed = true;
    const int first = c.rank() * 3;
    model.train_step(adam, fixture::batch(s, 3, 5, 1, first), fixture::batch(s, 3, 3, 2, first), fixture::mse);
  }
  return 0;
}

// Rank 1 throws holding a split whose reductions made a shared-memory window, and catches;
// rank 0 drops the split cleanly. Rank 1 leaves the window to MPI_Finalize, so rank 0 must
// too (MPI_Win_free waits for every rank), and says the job failed.
int unwinds_beside_clean_leaver(MpiComm& c) {
  try {
    MpiComm pair = c.split(0, c.rank());
    float x = 1;
    pair.all_reduce(std::span<float>(&x, 1), comm::reduce_op::sum);
    if (c.rank() == 1) throw std::runtime_error("rank 1: injected failure");
  } catch (const std::runtime_error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

int run(const std::string& mode) {
  auto c = MpiComm::world({.check = !mode.starts_with("unchecked")});
  const int steps = mode.ends_with("returns-early") && c.rank() == 0 ? 3 : 4;
  if (mode == "throws-holding-two") {
    MpiComm pair = c.split(c.rank() / 2, c.rank());  // destroyed first
    for (int s = 0; s < steps; ++s) {
      std::vector<float> shard(8, float(s)), full(8 * std::size_t(pair.size()));
      pair.all_gather(std::span<const float>(shard), std::span<float>(full));
      pair.reduce_scatter(std::span<const float>(full), std::span<float>(shard), comm::reduce_op::sum);
      inject(mode, c.rank(), s);
      float loss = shard[0];
      c.all_reduce(std::span<float>(&loss, 1), comm::reduce_op::avg);
    }
    return 0;
  }
  if (mode == "pair-fails") return pair_fails(c);
  if (mode == "train-throws-hybrid") return train_throws_hybrid(c);
  if (mode == "unwinds-beside-clean-leaver") return unwinds_beside_clean_leaver(c);
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
  const std::string mode = argc == 2 ? argv[1] : "";
  const bool own_mpi = mode == "throws-under-own-mpi";  // MPI started and ended here, not by the session
  if (own_mpi) {
    int level = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &level);
  }
  int status = 1;
  {
    comm::mpi_session session(&argc, &argv);
    const std::string modes[] = {"returns-early",      "unchecked-returns-early", "train-returns-early",
                                 "throws",             "throws-uncaught",         "throws-holding-two",
                                 "throws-under-own-mpi", "stops",                 "pair-fails",
                                 "unwinds-beside-clean-leaver", "throws-then-raw-mpi", "train-throws-hybrid",
                                 "finishes"};
    if (std::find(std::begin(modes), std::end(modes), mode) == std::end(modes)) {
      std::fprintf(stderr, "usage: %s CASE (see the comment at the top of test_mpi_failures.cpp)\n", argv[0]);
      return 2;
    }
    if (mode == "throws-uncaught") return run(mode);
    try {
      status = run(mode);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      if (mode == "throws-then-raw-mpi") MPI_Barrier(MPI_COMM_WORLD);  // blocks without moving any leave on
    }
  }
  if (own_mpi) MPI_Finalize();  // finishes rank 1's leave, which nothing waited for
  return status;
}
