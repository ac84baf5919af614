// shardlib/core/random.hpp — counter-based random numbers (Philox4x32-10) for
// initialisation and dropout that any rank, thread or GPU can reproduce by index.
#pragma once
#include "shardlib/config.hpp"

#include <array>    // std::array
#include <cmath>    // std::log, std::sqrt, std::cos
#include <cstdint>  // std::uint32_t, std::uint64_t
#include <string_view>

namespace shardlib {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): a bijection of a 128-bit counter under a 64-bit key. Element i of a
// parameter is drawn from counter i, so a rank that materialises only its shard
// draws exactly the values the whole-model initialisation draws there.
struct philox4x32 {
  using block = std::array<std::uint32_t, 4>;
  std::array<std::uint32_t, 2> key{};

  SHARDLIB_HD constexpr block operator()(block c) const {
    std::uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; ++round) {
      const std::uint64_t p0 = std::uint64_t(0xD2511F53u) * c[0];
      const std::uint64_t p1 = std::uint64_t(0xCD9E8D57u) * c[2];
      c = {std::uint32_t(p1 >> 32) ^ c[1] ^ k0, std::uint32_t(p1), std::uint32_t(p0 >> 32) ^ c[3] ^ k1,
           std::uint32_t(p0)};
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return c;
  }
};

// 64-bit FNV-1a: turns a parameter's dotted name into its random stream id.
constexpr std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : s) h = (h ^ std::uint8_t(ch)) * 0x100000001b3ull;
  return h;
}

// Random values indexed by (seed, stream, i): the same triple gives the same
// value on any rank, in any order, on host or device.
class counter_rng {
 public:
  SHARDLIB_HD constexpr counter_rng(std::uint64_t seed, std::uint64_t stream)
      : gen_{{std::uint32_t(seed), std::uint32_t(seed >> 32)}}, stream_(stream) {}

  SHARDLIB_HD constexpr philox4x32::block bits(std::uint64_t i) const {
    return gen_({std::uint32_t(i), std::uint32_t(i >> 32), std::uint32_t(stream_), std::uint32_t(stream_ >> 32)});
  }
  // Uniform in [0, 1): 24 random bits for float, 53 for double.
  SHARDLIB_HD constexpr float uniform_float(std::uint64_t i) const { return float(bits(i)[0] >> 8) * 0x1p-24f; }
  SHARDLIB_HD constexpr double uniform_double(std::uint64_t i) const {
    const auto b = bits(i);
    return double(top53(b[0], b[1])) * 0x1p-53;
  }
  // Standard normal by Box-Muller from two 53-bit uniforms of element i's block.
  double normal(std::uint64_t i) const {
    const auto b = bits(i);
    const double u1 = (double(top53(b[0], b[1])) + 1.0) * 0x1p-53;  // (0, 1]: the log is finite
    const double u2 = double(top53(b[2], b[3])) * 0x1p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  SHARDLIB_HD static constexpr std::uint64_t top53(std::uint32_t hi, std::uint32_t lo) {
    return (std::uint64_t(hi) << 21) ^ (lo >> 11);
  }
  philox4x32 gen_;
  std::uint64_t stream_;
};

}  // namespace shardlib
