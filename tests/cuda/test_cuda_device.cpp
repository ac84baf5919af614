// Device tests: the conversions and shard arithmetic compiled for the GPU agree with the host's.
// Without a GPU the test prints "SKIPPED: no CUDA device" (ctest reports it skipped).
#include <shardlib/core/element.hpp>
#include <shardlib/shard/sharded_tensor.hpp>

#include <catch2/catch.hpp>

#include <cmath>
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
bool is_nan_bits(std::uint16_t b, std::uint16_t exp_mask, std::uint16_t man_mask) {
  return (b & exp_mask) == exp_mask && (b & man_mask) != 0;
}
std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
}  // namespace

// Every 16-bit pattern widened to float and narrowed back in a kernel (the
// hardware's conversions) against the host's arithmetic: the same bits for
// every non-NaN. A NaN must stay a NaN; its payload may differ (the host
// widens an fp16 NaN to 0x7FFFFFFF, sm_90's cvt.f32.f16 may keep the payload),
// so those are counted and printed, not failed.
TEST_CASE("device 16-bit conversions match the host bit for bit", "[cuda][element]") {
  if (!have_device()) return;
  auto r = run_device_round_trip();
  int mismatches = 0, nan_lost = 0, nan_payloads = 0;
  for (std::size_t i = 0; i < r.bits.size(); ++i) {
    float hb = float(shardlib::bfloat16::from_bits(r.bits[i]));
    float hh = float(shardlib::half::from_bits(r.bits[i]));
    const std::uint16_t hb_back = shardlib::bfloat16(hb).bits, hh_back = shardlib::half(hh).bits;
    if (std::isnan(hb)) {
      nan_lost += !std::isnan(r.bf16_to_float[i]) + !is_nan_bits(r.bf16_back[i], 0x7F80, 0x7F);
      nan_payloads += (float_bits(hb) != float_bits(r.bf16_to_float[i])) + (hb_back != r.bf16_back[i]);
    } else {
      mismatches += float_bits(hb) != float_bits(r.bf16_to_float[i]);
      mismatches += hb_back != r.bf16_back[i];
    }
    if (std::isnan(hh)) {
      nan_lost += !std::isnan(r.half_to_float[i]) + !is_nan_bits(r.half_back[i], 0x7C00, 0x3FF);
      nan_payloads += (float_bits(hh) != float_bits(r.half_to_float[i])) + (hh_back != r.half_back[i]);
    } else {
      mismatches += float_bits(hh) != float_bits(r.half_to_float[i]);
      mismatches += hh_back != r.half_back[i];
    }
  }
  std::cout << "16-bit round trips on the device: " << mismatches << " mismatches, " << nan_payloads
            << " NaNs with another payload than the host's\n";
  CHECK(mismatches == 0);
  CHECK(nan_lost == 0);
}

TEST_CASE("device shard_layout locates like the host", "[cuda][shard]") {
  if (!have_device()) return;
  for (int w : {1, 3, 8}) {
    shardlib::shard::shard_layout l{1009, w};
    auto ranks = run_device_locate(l.numel, w);
    for (std::size_t g = 0; g < ranks.size(); ++g) REQUIRE(ranks[g] == l.locate(g).rank);
  }
}
