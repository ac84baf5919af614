// The fp16 loss scaler: its scale stays within [min_scale, max_scale], steps skipped in a
// row end in an error rather than NaN parameters, and a scaler that could not work is
// refused naming its field.
#include "shardlib/comm/launch.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/shard_fixture.hpp"
#include "support/raised.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace test_loss_scaler {

using namespace shardlib;
using namespace fixture;
using Catch::Contains;

TEST_CASE("inf/NaN gradients step after step: the scale stops at min_scale and the configured count raises",
          "[scaler]") {
  shard::loss_scaler s{.min_scale = 4.f, .max_skipped_in_row = 30};
  shard::check_scaler(s);
  int raised_at = 0;
  std::string message;
  for (int step = 1; step <= 200 && raised_at == 0; ++step) {
    try {
      s.update(true);
    } catch (const error& e) {
      raised_at = step;
      message = e.what();
    }
    REQUIRE(s.scale >= 4.f);
  }
  CHECK(raised_at == 30);
  CHECK(s.scale == 4.f);
  CHECK(s.skipped == 30);
  CHECK_THAT(message, Contains("30 steps in a row were skipped because their gradients held inf or NaN, and the "
                               "loss scale fell to 4 (min_scale 4): the model or the data produce inf/NaN"));
}

TEST_CASE("a good step resets the count of skipped steps, and growth stops at max_scale", "[scaler]") {
  shard::loss_scaler s{.scale = 1024.f, .growth_interval = 1, .max_scale = 4096.f, .max_skipped_in_row = 3};
  for (int round = 0; round < 10; ++round) {
    s.update(true);
    s.update(true);
    s.update(false);
  }
  CHECK(s.skipped == 20);
  CHECK(s.skipped_in_row == 0);
  for (int i = 0; i < 100; ++i) s.update(false);
  CHECK(s.scale == 4096.f);
}

TEST_CASE("200 steps of NaN input raise on every rank and leave the parameters finite", "[scaler][shard]") {
  const int w = 2;
  std::vector<std::string> errors(w);
  std::vector<int> steps_run(w, 0), finite(w, 0);
  comm::launch(w, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard<sgd>(m, c, shard::FullShard{},
                                    {.wrap = shard::wrap_types<Block>{},
                                     .precision = {.param = dtype::f16, .reduce = dtype::f16},
                                     .scaler = {.max_skipped_in_row = 40}});
    sgd opt;
    auto x = batch(0, 2, 5, 1, 2 * c.rank()), y = batch(0, 2, 3, 2, 2 * c.rank());
    x[0] = std::numeric_limits<float>::quiet_NaN();
    try {
      for (int step = 0; step < 200; ++step, ++steps_run[c.rank()]) model.train_step(opt, x, y, mse);
    } catch (const error& e) {
      errors[c.rank()] = e.what();
    }
    bool ok = model.scaler()->scale == 1.f;  // the default min_scale
    for (auto& [n, t] : model.full_state_dict(false))
      for (float v : t.span()) ok = ok && std::isfinite(v);
    finite[c.rank()] = ok;
  });
  for (int r = 0; r < w; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(steps_run[r] == 39);  // the 40th skipped step raised
    CHECK_THAT(errors[r], Contains("40 steps in a row were skipped"));
    CHECK(finite[r] == 1);
  }
}

TEST_CASE("a scaler that could not work is refused, naming the field", "[scaler]") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<shard::loss_scaler, std::string>> cases{
      {{.scale = 0.f}, "loss_scaler.scale must lie in [min_scale, max_scale] = [1, 1.67772e+07], got 0"},
      {{.scale = -2.f}, "loss_scaler.scale must lie in"},
      {{.scale = inf}, "loss_scaler.scale must lie in"},
      {{.scale = nan}, "loss_scaler.scale must lie in"},
      {{.growth_factor = 1.f}, "loss_scaler.growth_factor must be a finite number above 1, got 1"},
      {{.growth_factor = inf}, "loss_scaler.growth_factor"},
      {{.backoff_factor = 0.f}, "loss_scaler.backoff_factor must lie in (0, 1), got 0"},
      {{.backoff_factor = 1.f}, "loss_scaler.backoff_factor"},
      {{.backoff_factor = nan}, "loss_scaler.backoff_factor"},
      {{.growth_interval = 0}, "loss_scaler.growth_interval must be at least 1, got 0"},
      {{.min_scale = 0.f}, "loss_scaler.min_scale must be a positive finite number, got 0"},
      {{.min_scale = nan}, "loss_scaler.min_scale"},
      {{.min_scale = 2.f, .max_scale = 1.f}, "loss_scaler.max_scale must be finite and at least min_scale (2), got 1"},
      {{.max_scale = inf}, "loss_scaler.max_scale"},
      {{.max_skipped_in_row = 0}, "loss_scaler.max_skipped_in_row must be at least 1, got 0"},
      {{.good_steps = -1}, "loss_scaler.good_steps must lie in [0, growth_interval = 2000), got -1"},
      {{.skipped = -1}, "loss_scaler.skipped must not be negative"},
      {{.skipped_in_row = 51}, "loss_scaler.skipped_in_row must lie in [0, max_skipped_in_row = 50], got 51"},
  };
  for (const auto& [s, message] : cases) {
    INFO(message);
    CHECK_THROWS_WITH(shard::check_scaler(s), Contains(message));
  }
  CHECK_NOTHROW(shard::check_scaler({}));
}

TEST_CASE("the engine refuses an invalid initial scale at wrap time, naming the rank", "[scaler][shard]") {
  const std::vector<float> bad{0.f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::vector<std::string>> errors(2);  // [rank][bad scale]
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = make_model();
    for (float scale : bad)
      errors[std::size_t(c.rank())].push_back(test_support::raised([&] {
        shard::fully_shard<sgd>(m, c, shard::FullShard{},
                                {.precision = {.param = dtype::f16}, .scaler = {.scale = scale}});
      }));
  });
  for (int r = 0; r < 2; ++r) {
    REQUIRE(errors[std::size_t(r)].size() == bad.size());
    for (const auto& e : errors[std::size_t(r)])
      CHECK_THAT(e, Catch::Contains(cat("rank ", r, ": loss_scaler.scale must lie in")));
  }
}

}  // namespace test_loss_scaler
