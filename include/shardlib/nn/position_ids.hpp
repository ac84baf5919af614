// shardlib/nn/position_ids.hpp — the check that every layer reading the context's
// position ids (nn::context::position_ids) makes of them.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"

#include <algorithm>    // std::max
#include <cstdint>      // std::int64_t
#include <string_view>  // std::string_view

namespace shardlib::nn::detail {

// ids must be [batch, seq] with every id in [0, limit); returns the largest.
inline std::int64_t check_position_ids(const Tensor<std::int64_t>& ids, std::int64_t batch, std::int64_t seq,
                                       std::int64_t limit, std::string_view who) {
  require<shape_error>(ids.shape() == Shape{batch, seq}, who, ": position_ids must be [batch, sequence] = ",
                       Shape{batch, seq}, ", got ", ids.shape());
  std::int64_t largest = -1;
  for (std::int64_t i = 0; i < ids.numel(); ++i) {
    const std::int64_t p = ids[i];
    require<shape_error>(p >= 0 && p < limit, who, ": position id ", p, " (row ", i / seq, ", token ", i % seq,
                         ") is outside [0, ", limit, ")");
    largest = std::max(largest, p);
  }
  return largest;
}

}  // namespace shardlib::nn::detail
