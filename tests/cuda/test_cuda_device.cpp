// Device tests: the conversions and shard arithmetic compiled for the GPU agree with the host's.
// Without a GPU the test prints "SKIPPED: no CUDA device" (ctest reports it skipped).
#include <shardlib/core/element.hpp>
#include <shardlib/shard/sharded_tensor.hpp>

#include <catch2/catch.hpp>

#include <cstring>
#include <iostream>

#include "element_kernels.hpp"

namespace {
bool have_device() {
  static const std::string problem = [] {  // printed once: the line ctest's skip rule looks for
    std::string p = cuda_device_problem();
    if (!p.empty()) std::cout << "SKIPPED: no CUDA device (" << p << ")\n";
    return p;
  }();
  return problem.empty();
}
std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
}  // namespace

TEST_CASE("device 16-bit conversions match the host bit for bit", "[cuda][element]") {
  if (!have_device()) return;
  auto r = run_device_round_trip();
  int mismatches = 0;
  for (std::size_t i = 0; i < r.bits.size(); ++i) {
    float hb = float(shardlib::bfloat16::from_bits(r.bits[i]));
    float hh = float(shardlib::half::from_bits(r.bits[i]));
    mismatches += float_bits(hb) != float_bits(r.bf16_to_float[i]);
    mismatches += float_bits(hh) != float_bits(r.half_to_float[i]);
    mismatches += shardlib::bfloat16(hb).bits != r.bf16_back[i];
    mismatches += shardlib::half(hh).bits != r.half_back[i];
  }
  CHECK(mismatches == 0);
}

TEST_CASE("device shard_layout locates like the host", "[cuda][shard]") {
  if (!have_device()) return;
  for (int w : {1, 3, 8}) {
    shardlib::shard::shard_layout l{1009, w};
    auto ranks = run_device_locate(l.numel, w);
    for (std::size_t g = 0; g < ranks.size(); ++g) REQUIRE(ranks[g] == l.locate(g).rank);
  }
}
