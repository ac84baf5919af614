// shard_layout and ShardedTensor: property tests over many sizes, and collectives on shards.
#include "shardlib/comm/launch.hpp"
#include "shardlib/shard/sharded_tensor.hpp"

#include <catch2/catch.hpp>

#include <numeric>
#include <vector>

namespace test_sharded_tensor {

using namespace shardlib;
using shard::shard_layout;
using shard::ShardedTensor;

TEST_CASE("shard_layout: equal padded shards cover every element exactly once", "[shard][layout]") {
  std::vector<std::size_t> sizes{0, 1, 2, 3, 5, 7, 8, 13, 64, 97, 100, 1000, 1009, 4096, 65537};
  for (std::size_t n : sizes)
    for (int w = 1; w <= 9; ++w) {
      INFO("N " << n << " W " << w);
      shard_layout l{n, w};
      CHECK(l.padded_size() % std::size_t(w) == 0);
      CHECK(l.padded_size() >= n);
      CHECK(l.padding() < std::size_t(w));  // never a whole shard of padding per rank
      std::size_t valid = 0;
      for (int r = 0; r < w; ++r) {
        CHECK(l.end(r) - l.begin(r) == l.shard_size());
        if (r > 0) CHECK(l.begin(r) == l.end(r - 1));
        valid += l.valid(r);
        CHECK(l.valid(r) <= l.shard_size());
        if (l.valid(r) < l.shard_size()) CHECK(l.begin(r) + l.valid(r) == std::max(n, l.begin(r)));
      }
      CHECK(valid == n);
      for (std::size_t g = 0; g < l.padded_size(); g += 1 + g / 7) {
        auto [r, local] = l.locate(g);
        CHECK(l.global(r, local) == g);
        CHECK(local < l.shard_size());
      }
    }
}

TEST_CASE("ShardedTensor gathers, assigns and scatters on the thread communicator", "[shard][tensor]") {
  for (int w : {1, 2, 3, 4}) {
    for (std::size_t n : {std::size_t(0), std::size_t(2), std::size_t(11), std::size_t(97)}) {
      DYNAMIC_SECTION("W " << w << " N " << n) {
        std::vector<float> full(n);
        std::iota(full.begin(), full.end(), 1.f);
        std::vector<int> ok(w, 0);
        comm::launch(w, [&](comm::ThreadComm& c) {
          ShardedTensor<float> a(n, c, category::parameters);
          a.assign_local(full);
          std::vector<float> gathered(a.layout().padded_size(), -1.f);
          a.gather(c, std::span<float>(gathered));
          bool good = std::equal(full.begin(), full.end(), gathered.begin()) &&
                      std::all_of(gathered.begin() + n, gathered.end(), [](float x) { return x == 0.f; });
          ShardedTensor<float> b(n, c, category::parameters);
          b.scatter(c, c.rank() == w - 1 ? std::span<const float>(full) : std::span<const float>(), w - 1);
          good = good && std::equal(b.local().begin(), b.local().end(), a.local().begin());
          auto v = b.local_valid();
          for (std::size_t i = 0; i < v.size(); ++i) good = good && v[i] == full[b.layout().global(c.rank(), i)];
          ok[c.rank()] = good;
        });
        CHECK(std::all_of(ok.begin(), ok.end(), [](int x) { return x == 1; }));
      }
    }
  }
}

TEST_CASE("ShardedTensor refuses a full buffer of the wrong size", "[shard][tensor]") {
  CHECK_THROWS_WITH(comm::launch(2,
                                 [](comm::ThreadComm& c) {
                                   ShardedTensor<float> a(5, c, category::parameters);
                                   std::vector<float> full(5);
                                   a.gather(c, std::span<float>(full));
                                 }),
                    Catch::Contains("needs a full buffer of 6 elements (5 padded to a multiple of 2), got 5"));
  CHECK_THROWS_AS(ShardedTensor<float>(5, 2, 2, category::parameters), shape_error);
}

}  // namespace test_sharded_tensor
