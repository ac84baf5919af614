// The sharding engine over MPI: every process is one rank; sharded training equals
// unsharded training on the global batch for every strategy (run at 2 and 4 processes).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "shardlib/mpi.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/shard_fixture.hpp"

using namespace shardlib;
using namespace fixture;

namespace {

template <class Strategy>
trace sharded(comm::MpiComm& c, int per_rank, int steps, Strategy strategy, shard::mixed_precision p = {}) {
  Model m = make_model();
  auto model = shard::fully_shard<sgd>(m, c, strategy, {.wrap = shard::wrap_types<Block>{}, .seed = 42, .precision = p});
  sgd opt;
  trace t;
  for (int s = 0; s < steps; ++s) {
    auto x = batch(s, per_rank, 5, 1, c.rank() * per_rank), y = batch(s, per_rank, 3, 2, c.rank() * per_rank);
    float loss = model.train_step(opt, x, y, mse);
    std::vector<float> all(c.size());
    c.all_gather(std::span<const float>(&loss, 1), std::span<float>(all));
    float mean = 0;
    for (float v : all) mean += v / float(c.size());
    t.losses.push_back(mean);
  }
  for (auto& [name, v] : model.full_state_dict(false)) t.params.insert(t.params.end(), v.span().begin(), v.span().end());
  return t;
}

}  // namespace

// fp32: the same sums in another order (per-rank partial gradients, then the average
// over ranks), so 1e-5 relative covers float rounding with a wide margin.
TEMPLATE_TEST_CASE("sharded training over MPI equals unsharded training", "[mpi][shard][equivalence]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard) {
  auto world = comm::MpiComm::world();
  const int steps = 20, per_rank = 3;
  auto want = unsharded(world.size(), per_rank, steps);
  auto got = sharded(world, per_rank, steps, TestType{});
  INFO("rank " << world.rank() << " of " << world.size() << ": worst " << worst_difference(got, want));
  CHECK(worst_difference(got, want) <= 1e-5);
  CHECK(want.losses.back() < want.losses.front());
}

TEST_CASE("hybrid sharding over MPI equals unsharded training", "[mpi][shard][hybrid]") {
  auto world = comm::MpiComm::world();
  auto want = unsharded(world.size(), 3, 20);
  const int group = world.size() % 2 == 0 ? 2 : 1;
  auto got = sharded(world, 3, 20, shard::HybridShard{.group_size = group});
  CHECK(worst_difference(got, want) <= 1e-5);
}

TEST_CASE("bf16 gathers and reductions over MPI give the same result as on threads", "[mpi][shard][precision]") {
  // MPI reduces 16-bit values in rank order with fp32 accumulation, exactly as
  // ThreadComm does; compared with fp32-master training on bf16-rounded parameters
  // within the bound tests/unit/test_shard.cpp derives for bf16 reductions (3e-2).
  auto world = comm::MpiComm::world();
  auto want = unsharded<bfloat16>(world.size(), 3, 20);
  auto got = sharded(world, 3, 20, shard::FullShard{}, {.param = dtype::bf16, .reduce = dtype::bf16});
  INFO("worst " << worst_difference(got, want));
  CHECK(worst_difference(got, want) <= 3e-2);
}

// policy::reshard_to over MPI: backward all-gathers within communicators split from the
// world (pairs at 4 processes; at 2, R = 1 keeps units whole). The gathers move the same
// values, so training is FullShard's bit for bit, with fp32 and with bf16 gathers.
TEST_CASE("FullShard resharded to pairs after forward over MPI trains as FullShard", "[mpi][shard][reshard]") {
  auto world = comm::MpiComm::world();
  const int R = world.size() % 2 == 0 && world.size() > 2 ? 2 : 1;
  for (const shard::mixed_precision p : {shard::mixed_precision{}, {.param = dtype::bf16, .reduce = dtype::bf16}}) {
    const auto want = sharded(world, 3, 10, shard::FullShard{}, p);
    const auto got = sharded(world, 3, 10, shard::FullShard{.reshard_to = R}, p);
    INFO("rank " << world.rank() << " of " << world.size() << ", reshard_to " << R << ", param " << name(p.param));
    CHECK(got.losses == want.losses);
    CHECK(got.params == want.params);
  }
}

// train_step over two micro-batches of two rows per process (gradient accumulation), each
// reduced, reduced once (no_sync) and kept gathered between them: the mean of the two halves'
// mean losses is the mean over the four rows, so the step follows the gradient of unsharded
// training on the global batch; 1e-5 relative, as above.
TEST_CASE("train_step over micro-batches over MPI equals unsharded training", "[mpi][shard][accumulation]") {
  auto world = comm::MpiComm::world();
  const int per_rank = 4, steps = 10;
  const auto want = unsharded(world.size(), per_rank, steps);
  for (const shard::step_options so : {shard::step_options{.loss = shard::loss_report::local},
                                       shard::step_options{.loss = shard::loss_report::local, .no_sync = true},
                                       shard::step_options{.loss = shard::loss_report::local, .no_sync = true,
                                                           .reshard_after_backward = false}}) {
    Model m = make_model();
    auto model = shard::fully_shard<sgd>(m, world, shard::FullShard{}, {.wrap = shard::wrap_types<Block>{}, .seed = 42});
    sgd opt;
    trace got;
    for (int s = 0; s < steps; ++s) {
      std::vector<Tensor<float>> xs, ys;
      for (int k = 0; k < 2; ++k) {
        const int first = world.rank() * per_rank + k * per_rank / 2;
        xs.push_back(batch(s, per_rank / 2, 5, 1, first));
        ys.push_back(batch(s, per_rank / 2, 3, 2, first));
      }
      float loss = model.train_step(opt, xs, ys, mse, so);
      std::vector<float> all(world.size());
      world.all_gather(std::span<const float>(&loss, 1), std::span<float>(all));
      float mean = 0;
      for (float v : all) mean += v / float(world.size());
      got.losses.push_back(mean);
    }
    for (auto& [name, v] : model.full_state_dict(false)) got.params.insert(got.params.end(), v.span().begin(), v.span().end());
    INFO("rank " << world.rank() << " of " << world.size() << ", no_sync " << so.no_sync << ", reshard_after_backward "
                 << so.reshard_after_backward << ": worst " << worst_difference(got, want));
    CHECK(worst_difference(got, want) <= 1e-5);
  }
}

int main(int argc, char** argv) {
  shardlib::comm::mpi_session mpi(&argc, &argv);
  return Catch::Session().run(argc, argv);
}
