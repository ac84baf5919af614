// Failures mid-step: a rank that throws — in a layer's forward or backward, in its
// optimizer's step, or while saving a checkpoint — leaves every other rank with an
// error naming it, for every strategy and prefetch depth, and no rank touches the
// buffers of a rank that has gone (run under the asan preset to see that). Misuse
// (backward twice) raises instead of crashing.
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/sgd.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/shard_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

namespace test_failures {

using namespace shardlib;

namespace {

enum class failure_point { forward, backward, step, checkpoint };
constexpr const char* point_names[] = {"forward", "backward", "step", "checkpoint"};

// A Linear that throws in forward or backward once armed (on the failing rank only).
struct tripwire : nn::Linear<float> {
  using nn::Linear<float>::Linear;
  std::optional<failure_point> armed;

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    if (armed == failure_point::forward) throw std::runtime_error("tripwire: forward");
    return nn::Linear<float>::forward(ctx, x);
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    if (armed == failure_point::backward) throw std::runtime_error("tripwire: backward");
    return nn::Linear<float>::backward(ctx, dy);
  }
};
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<tripwire>, nn::Linear<float>>;
Model make_model() {
  return Model{nn::Linear<float>(5, 8), nn::Stack<tripwire>(3, tripwire(8, 8)), nn::Linear<float>(8, 3)};
}

constexpr int world = 4;

template <class F>
void for_each_strategy(F&& f) {
  f(shard::FullShard{});
  f(shard::ShardGradOp{});
  f(shard::ShardOptimizer{});
  f(shard::NoShard{});
  f(shard::HybridShard{.group_size = 2});
}

// Trains 3 steps on `world` ranks; in step 1 rank `failing` fails at `where`, after a
// first step has recorded the order (so later gathers are prefetched). Returns each
// rank's error message.
template <class Strategy>
std::vector<std::string> fail_once(Strategy strategy, int prefetch, failure_point where, int failing) {
  const auto dir = std::filesystem::temp_directory_path() / cat("shardlib_test_failures_", ::getpid());
  std::vector<std::string> errors(world);
  try {
    comm::launch(world, [&](comm::ThreadComm& c) {
      Model m = make_model();
      auto model = shard::fully_shard<optim::SGD>(
          m, c, strategy, {.wrap = shard::wrap_types<tripwire>{}, .seed = 42, .prefetch = prefetch});
      optim::SGD opt{{.lr = 0.05}};
      const bool fails = c.rank() == failing;
      try {
        for (int s = 0; s < 3; ++s) {
          if (s == 1 && fails) {
            if (where == failure_point::step) opt.options.lr = -1;  // SGD::step refuses it
            if (where == failure_point::forward || where == failure_point::backward) m.get<1>()[1].armed = where;
          }
          auto x = fixture::batch(s, 2, 5, 1, 2 * c.rank()), y = fixture::batch(s, 2, 3, 2, 2 * c.rank());
          model.train_step(opt, x, y, fixture::mse);
          if (s == 1 && where == failure_point::checkpoint)
            io::save_checkpoint(dir, model, opt, {.write_hook = [&](const io::write_event& e) {
                                  return e.rank == failing ? ENOSPC : 0;
                                }});
        }
      } catch (const std::exception& e) {
        errors[std::size_t(c.rank())] = e.what();
        throw;
      }
    });
    FAIL("launch returned although rank " << failing << " failed");
  } catch (const comm::rank_failure& e) {
    // Checkpoint errors are raised on every rank alike; otherwise the others' are consequences.
    if (where != failure_point::checkpoint) CHECK(e.rank() == failing);
  }
  std::filesystem::remove_all(dir);
  return errors;
}

// Every strategy and prefetch depth, failing at `where`: the failing rank sees its
// own error, every other rank one that names it.
void check_failure(failure_point where) {
  for_each_strategy([&](auto s) {
    for (int prefetch : {0, 1, 2}) {
      const int failing = where == failure_point::checkpoint ? 0 : 2;  // rank 0 writes in every strategy
      INFO(decltype(s)::name << ", prefetch " << prefetch << ", rank " << failing << " fails in "
                             << point_names[int(where)]);
      const auto errors = fail_once(s, prefetch, where, failing);
      const char* own = where == failure_point::step         ? "SGD: invalid learning rate"
                        : where == failure_point::checkpoint ? "No space left"
                                                             : "tripwire";
      for (int r = 0; r < world; ++r) {
        INFO("rank " << r << ": " << errors[std::size_t(r)]);
        CHECK_THAT(errors[std::size_t(r)],
                   Catch::Contains(r == failing ? std::string(own) : cat("rank ", failing, " failed")));
      }
      if (where == failure_point::step)  // the optimizer's own error names where it stepped
        CHECK_THAT(errors[std::size_t(failing)], Catch::StartsWith(cat("rank ", failing, ", unit '")));
    }
  });
}

}  // namespace

TEST_CASE("a rank whose layer throws in forward is named in every other rank's error", "[failures]") {
  check_failure(failure_point::forward);
}
TEST_CASE("a rank whose layer throws in backward is named in every other rank's error", "[failures]") {
  check_failure(failure_point::backward);
}
TEST_CASE("a rank whose optimizer step throws is named in every other rank's error", "[failures]") {
  check_failure(failure_point::step);
}
TEST_CASE("a rank whose checkpoint write fails is named in every other rank's error", "[failures]") {
  check_failure(failure_point::checkpoint);
}

TEST_CASE("collectives queued when a rank fails all raise naming it and none completes without it",
          "[failures][comm]") {
  // The others' workers hold three all-gathers each; the first waits for rank 0,
  // which never posts. Each must end with an error naming rank 0: none may count a
  // withdrawn arrival and run with stale posts (rank 0's slots hold nothing).
  std::vector<std::vector<std::string>> errors(world);
  auto body = [&](comm::ThreadComm& c) {
    if (c.rank() == 0) throw std::runtime_error("rank 0 fails at once");
    std::vector<float> send(16, float(c.rank())), recv(16 * world);
    std::vector<comm::work> works;
    for (int i = 0; i < 3; ++i)
      works.push_back(c.all_gather_async(std::span<const float>(send), std::span<float>(recv)));
    for (auto& w : works) {
      try {
        w.wait();
        errors[std::size_t(c.rank())].push_back("completed");
      } catch (const comm_error& e) {
        errors[std::size_t(c.rank())].push_back(e.what());
      }
    }
  };
  CHECK_THROWS_AS(comm::launch(world, body), comm::rank_failure);
  for (int r = 1; r < world; ++r) {
    REQUIRE(errors[std::size_t(r)].size() == 3);
    for (const auto& e : errors[std::size_t(r)]) CHECK_THAT(e, Catch::Contains("abandoned: rank 0 failed"));
  }
}

namespace {
// ThreadComm whose asynchronous collectives count as open until waited; the n-th
// (1: the first) raises comm_error on its wait, as a collective that failed. The
// communicators split from it share the count.
struct tracking {
  std::atomic<int> open{0};
  int fail_at = 0;
};
struct tracked_work {
  comm::work inner;
  std::shared_ptr<tracking> t;  // null once waited
  bool fails = false;
  void wait() {
    if (auto o = std::exchange(t, nullptr)) --o->open;
    inner.wait();
    if (std::exchange(fails, false)) throw comm_error("tracked_comm: injected failure of a collective");
  }
  bool test() { return inner.test(); }
};

class tracked_comm {
 public:
  tracked_comm(comm::ThreadComm c, std::shared_ptr<tracking> t) : c_(std::move(c)), t_(std::move(t)) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  void barrier() { c_.barrier(); }
  tracked_comm split(int color, int key) { return tracked_comm(c_.split(color, key), t_); }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    c_.all_gather(in, out);
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    c_.reduce_scatter(in, out, op);
  }
  template <class T>
  void all_reduce(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    c_.all_reduce(in, out, op);
  }
  template <class T>
  void all_reduce(std::span<T> data, comm::reduce_op op) {
    c_.all_reduce(data, op);
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    c_.broadcast(data, root);
  }
  template <class T>
  tracked_work all_gather_async(std::span<const T> in, std::span<T> out) {
    return track(c_.all_gather_async(in, out));
  }
  template <class T>
  tracked_work reduce_scatter_async(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    return track(c_.reduce_scatter_async(in, out, op));
  }
  template <class T>
  tracked_work all_reduce_async(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    return track(c_.all_reduce_async(in, out, op));
  }
  template <class T>
  tracked_work broadcast_async(std::span<T> data, int root) {
    return track(c_.broadcast_async(data, root));
  }

 private:
  tracked_work track(comm::work w) {
    ++t_->open;
    return {std::move(w), t_, --t_->fail_at == 0};
  }
  comm::ThreadComm c_;
  std::shared_ptr<tracking> t_;
};
static_assert(comm::Communicator<tracked_comm>);
}  // namespace

// ZeRO-1 with bfloat16 parameters all-gathers every unit's values at once when it
// is built. When the first
// gather fails, the constructor must wait for the others before its buffers go.
TEST_CASE("a constructor whose gather fails waits for the others it issued", "[failures][comm]") {
  std::vector<std::string> errors(2);
  std::vector<int> open(2, -1);
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto t = std::make_shared<tracking>();
    t->fail_at = c.rank() == 0 ? 1 : 0;
    tracked_comm tc(c, t);
    Model m = make_model();
    try {
      auto model = shard::fully_shard<optim::SGD>(m, tc, shard::ShardOptimizer{},
                                                  {.wrap = shard::wrap_types<tripwire>{},
                                                   .seed = 42,
                                                   .precision = {.param = dtype::bf16}});
    } catch (const comm_error& e) {
      errors[std::size_t(c.rank())] = e.what();
    }
    open[std::size_t(c.rank())] = t->open;
  });
  CHECK_THAT(errors[0], Catch::Contains("injected failure"));
  CHECK(errors[1].empty());
  CHECK(open[0] == 0);
  CHECK(open[1] == 0);
}

// A layer that raises on every rank (a bad batch) and is caught: the model goes on.
// Its forward or backward leaves nothing gathered or in flight; the partial gradients
// of a failed backward are refused by clip_grad_norm() and step() until zero_grad();
// train_step's summed reduction ends with it; and the next steps train exactly as a
// run that never saw that batch, dropout masks included (the failed pass's draws are
// rewound).
TEST_CASE("a forward or backward that raises on every rank leaves a model that trains on", "[failures]") {
  for (failure_point where : {failure_point::forward, failure_point::backward})
    for_each_strategy([&](auto s) {
      for (int prefetch : {0, 2}) {
        INFO(decltype(s)::name << ", prefetch " << prefetch << ", every rank fails in " << point_names[int(where)]);
        auto train = [&](bool with_bad_batch) {
          std::vector<float> params;
          std::vector<std::string> errors(world);
          comm::launch(world, [&](comm::ThreadComm& c) {
            using Dropping = nn::Sequential<nn::Linear<float>, nn::Dropout<float>, nn::Stack<tripwire>,
                                            nn::Linear<float>>;
            Dropping m{nn::Linear<float>(5, 8), nn::Dropout<float>(0.5), nn::Stack<tripwire>(3, tripwire(8, 8)),
                       nn::Linear<float>(8, 3)};
            auto model = shard::fully_shard<optim::SGD>(
                m, c, s, {.wrap = shard::wrap_types<tripwire>{}, .seed = 42, .prefetch = prefetch});
            optim::SGD opt{{.lr = 0.05}};
            const auto r = std::size_t(c.rank());
            for (int step = 0; step < 4; ++step) {
              const auto x = fixture::batch(step, 2, 5, 1, 2 * c.rank()),
                         y = fixture::batch(step, 2, 3, 2, 2 * c.rank());
              if (step == 0) model.train_step(opt, x, y, fixture::mse);
              if (step >= 2) {  // by hand: the reduction is the model's own (averaging) again
                model.zero_grad();
                model.backward(fixture::mse(model.forward(x), y).grad);
                model.step(opt);
              }
              if (step != 1 || !with_bad_batch) continue;
              m.get<2>()[1].armed = where;
              try {  // a summed reduction for this step only
                model.train_step(opt, x, y, fixture::mse, {.reduction = shard::grad_reduction::sum});
              } catch (const std::runtime_error& e) {
                errors[r] = e.what();
              }
              m.get<2>()[1].armed.reset();
              if (where == failure_point::backward) {  // without zero_grad: refused after a failed backward
                try {
                  model.clip_grad_norm(1.f);
                } catch (const error& e) {
                  errors[r] += cat(" | ", e.what());
                }
                try {
                  model.step(opt);
                } catch (const error& e) {
                  errors[r] += cat(" | ", e.what());
                }
              }
            }
            for (auto& [name, t] : model.full_state_dict())
              if (r == 0) params.insert(params.end(), t.span().begin(), t.span().end());
          });
          return std::pair{params, errors};
        };
        const auto [skipped, none] = train(false);
        const auto [recovered, errors] = train(true);
        for (int r = 0; r < world; ++r) {
          INFO("rank " << r << ": " << errors[std::size_t(r)]);
          if (where == failure_point::forward)
            CHECK(errors[std::size_t(r)] == "tripwire: forward");
          else
            CHECK(errors[std::size_t(r)] ==
                  cat("tripwire: backward | rank ", r, ": grad_norm after a backward that raised: the gradients are "
                      "partial; call zero_grad() and run the step's micro-batches again | rank ", r, ": step after a "
                      "backward that raised: the gradients are partial; call zero_grad() and run the step's "
                      "micro-batches again"));
        }
        REQUIRE(skipped.size() == recovered.size());
        CHECK(recovered == skipped);  // bit for bit
      }
    });
}

TEST_CASE("backward twice without a forward raises on every rank and leaves the model usable", "[failures][misuse]") {
  for_each_strategy([](auto s) {
    INFO(decltype(s)::name);
    std::vector<std::string> errors(world), after_eval(world);
    auto run = [&] {
      comm::launch(world, [&](comm::ThreadComm& c) {
        fixture::Model m = fixture::make_model();  // every Linear a unit, the last one too
        auto model = shard::fully_shard<optim::SGD>(m, c, s, {.wrap = shard::wrap_types<fixture::Block>{}});
        optim::SGD opt{{.lr = 0.05}};
        auto x = fixture::batch(0, 2, 5, 1, 2 * c.rank()), y = fixture::batch(0, 2, 3, 2, 2 * c.rank());
        model.train_step(opt, x, y, fixture::mse);  // records the order: a later backward would prefetch
        auto l = fixture::mse(model.forward(x), y);
        model.backward(l.grad);
        try {
          model.backward(l.grad);
        } catch (const error& e) {
          errors[std::size_t(c.rank())] = e.what();
        }
        model.eval();  // an eval-mode forward keeps no activations: no backward may follow it
        const auto evaluated = fixture::mse(model.forward(x), y);
        model.train();
        try {
          model.backward(evaluated.grad);
          after_eval[std::size_t(c.rank())] = "a backward after an eval-mode forward ran";
        } catch (const error& e) {
          after_eval[std::size_t(c.rank())] = e.what();
        }
        model.step(opt);
        model.train_step(opt, x, y, fixture::mse);
        l = fixture::mse(model.forward(x), y);
        model.backward(l.grad);
        model.backward(l.grad);  // uncaught on every rank this time
      });
    };
    CHECK_THROWS_WITH(run(), Catch::Contains("backward without a forward"));
    for (int r = 0; r < world; ++r) {
      CHECK_THAT(errors[std::size_t(r)], Catch::Contains(cat("rank ", r, ": backward without a forward")));
      CHECK_THAT(after_eval[std::size_t(r)], Catch::StartsWith(cat("rank ", r, ": backward without a forward")) &&
                                                 Catch::Contains("in train mode"));
    }
  });
}

// Ranks that run different numbers of micro-batches (no_sync on all but the last)
// under a strategy that gathers parameters for each forward and backward call
// different collectives at some point: every rank raises the disagreement instead
// of waiting for the others. (ShardOptimizer and NoShard only reduce at the last
// micro-batch, as DDP's no_sync: their ranks accumulate their own counts, and the
// reduction averages those sums, as PyTorch does.)
TEST_CASE("ranks running different numbers of micro-batches raise on every rank under a gathering strategy",
          "[failures][misuse]") {
  const auto mismatched = [](auto strategy) {
    std::vector<std::string> errors(2);
    try {
      comm::launch(2, [&](comm::ThreadComm& c) {
        fixture::Model m = fixture::make_model();
        auto model = shard::fully_shard<optim::SGD>(m, c, strategy, {.wrap = shard::wrap_types<fixture::Block>{}});
        optim::SGD opt{{.lr = 0.05}};
        const auto x = fixture::batch(0, 2, 5, 1, 2 * c.rank()), y = fixture::batch(0, 2, 3, 2, 2 * c.rank());
        try {
          const int micro_batches = c.rank() == 0 ? 2 : 3;
          for (int k = 0; k < micro_batches; ++k) {
            model.set_sync(k + 1 == micro_batches);
            model.backward(fixture::mse(model.forward(x), y).grad);
          }
          model.step(opt);
        } catch (const std::exception& e) {
          errors[std::size_t(c.rank())] = e.what();
          throw;
        }
      });
    } catch (const comm::rank_failure&) {
    }
    return errors;
  };
  for (const auto& [name, errors] : {std::pair{"FullShard", mismatched(shard::FullShard{})},
                                     std::pair{"ShardGradOp", mismatched(shard::ShardGradOp{})}})
    for (int r = 0; r < 2; ++r) {
      INFO(name << ", rank " << r << ": " << errors[std::size_t(r)]);
      CHECK_THAT(errors[std::size_t(r)], Catch::Contains(cat("rank ", r, ": ranks disagree about a collective")));
    }
}

}  // namespace test_failures
