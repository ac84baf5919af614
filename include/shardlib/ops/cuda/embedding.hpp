// shardlib/ops/cuda/embedding.hpp — the per-row math of embedding lookup and of
// its gradient (nn::Embedding's arithmetic), for host and device.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/team.hpp"  // Team

#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

// out = weight[id], one row of dim elements.
template <Team Tm, class T>
SHARDLIB_HD void embedding_row(const Tm& team, const T* weight, std::int64_t id, int dim, T* out) {
  const T* w = weight + id * dim;
  for (int j = team.rank(); j < dim; j += team.size()) out[j] = w[j];
}

// grad_row += dy[positions[0]] + dy[positions[1]] + ... in that order: the
// gradient of one table row from the `count` positions that looked it up.
// Positions ascending (a stable sort of the ids) add the uses in the order
// nn::Embedding does, so float gradients match it bit for bit with no atomics.
// Accumulates in float (for 16-bit T, one rounding instead of one per use).
template <Team Tm, class T>
SHARDLIB_HD void embedding_accumulate_run(const Tm& team, T* grad_row, const T* dy, const std::int64_t* positions,
                                          int count, int dim) {
  for (int j = team.rank(); j < dim; j += team.size()) {
    float acc = float(grad_row[j]);
    for (int k = 0; k < count; ++k) acc += float(dy[positions[k] * dim + j]);
    grad_row[j] = T(acc);
  }
}

}  // namespace shardlib::ops::cuda
