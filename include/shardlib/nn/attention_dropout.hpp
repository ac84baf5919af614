// shardlib/nn/attention_dropout.hpp — which attention weights dropout keeps: one
// Philox block decides eight weights, the eight a tensor-core lane holds.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/random.hpp"

#include <cstdint>  // std::int64_t, std::uint32_t, std::uint64_t

namespace shardlib::nn {

// The weights of head `head` (n * H + h of [B, H, Lq, Lk]) come in groups of
// eight: queries i and i ^ 8 against keys j, j ^ 1, j ^ 8 and j ^ 9 (i with bit
// 3 clear, j with bits 0 and 3 clear). A group is one Philox4x32-10 block drawn
// at the index of its first weight in [B, H, Lq, Lk], 16 bits per weight, so the
// fused attention's lanes, which hold exactly such groups in mma.sync's 16x16
// accumulators, draw a block for 8 weights (forward, dq) or for 4 (dk/dv, whose
// accumulators hold the weights transposed) where nn::Dropout draws one per
// element. Weight s of its group (slot) is kept iff its
// 16 bits v satisfy v / 2^16 >= p, that is v >= ceil(p 2^16): p resolves to 2^-16
// (nn::Dropout's 24 bits would need a block per 5 weights), so the kept weights'
// scale 1 / (1 - p) is off their mean by at most 2^-16 / (1 - p). Host (nn::sdpa,
// ops::flash's tiles) and device kernels all draw through this, so their masks
// agree bit for bit.
class attention_keep {
 public:
  SHARDLIB_HD constexpr attention_keep(const counter_rng& stream, float p) : stream_(stream), threshold_(threshold(p)) {}

  // The group's 8 decisions, bit s for its weight s: the group that holds weight
  // (i, j) of head `head` in a [queries, keys] matrix.
  SHARDLIB_HD constexpr std::uint32_t group(std::int64_t head, std::int64_t queries, std::int64_t keys, std::int64_t i,
                                           std::int64_t j) const {
    const auto b = stream_.bits(index(head, queries, keys, i, j));
    std::uint32_t kept = 0;
    for (int s = 0; s < 8; ++s) kept |= std::uint32_t(bits16(b, s) >= threshold_) << s;
    return kept;
  }
  // Weight (i, j) alone (one block, one comparison).
  SHARDLIB_HD constexpr bool operator()(std::int64_t head, std::int64_t queries, std::int64_t keys, std::int64_t i,
                                        std::int64_t j) const {
    return bits16(stream_.bits(index(head, queries, keys, i, j)), slot(i, j)) >= threshold_;
  }
  // The counter of the group that holds weight (i, j): its first weight's index.
  SHARDLIB_HD static constexpr std::uint64_t index(std::int64_t head, std::int64_t queries, std::int64_t keys,
                                                   std::int64_t i, std::int64_t j) {
    return std::uint64_t((head * queries + (i & ~std::int64_t(8))) * keys + (j & ~std::int64_t(9)));
  }
  // Weight (i, j)'s bit in its group's decisions.
  SHARDLIB_HD static constexpr int slot(std::int64_t i, std::int64_t j) {
    return int(((i >> 3) & 1) << 2 | ((j >> 3) & 1) << 1 | (j & 1));
  }

 private:
  // Weight s's 16 bits of its group's block (selected, not indexed: no local memory on a GPU).
  SHARDLIB_HD static constexpr std::uint32_t bits16(const philox4x32::block& b, int s) {
    const std::uint32_t word = s < 2 ? b[0] : s < 4 ? b[1] : s < 6 ? b[2] : b[3];
    return (word >> (16 * (s & 1))) & 0xffffu;
  }
  // ceil(p 2^16), exact in float for p in [0, 1]: 2^16 when p = 1, so nothing is kept.
  SHARDLIB_HD static constexpr std::uint32_t threshold(float p) {
    const float scaled = p * 65536.0f;
    const auto t = std::uint32_t(scaled);
    return float(t) < scaled ? t + 1 : t;
  }

  counter_rng stream_;
  std::uint32_t threshold_;
};

}  // namespace shardlib::nn
