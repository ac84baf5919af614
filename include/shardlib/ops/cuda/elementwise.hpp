// shardlib/ops/cuda/elementwise.hpp — per-element math of the element-wise
// kernels that is not already a SHARDLIB_HD function of the host layers
// (nn::relu, nn::gelu and their backward live in nn/activation.hpp, casts are
// core/element.hpp's element_cast).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/random.hpp"  // counter_rng
#include "shardlib/nn/dropout.hpp"   // dropout_keep

#include <cstdint>  // std::uint64_t

namespace shardlib::ops::cuda {

// Inverted dropout of element i, with nn::Dropout's keep rule and scale, so
// a kernel given the same stream draws the host's mask bit for bit.
template <class T>
SHARDLIB_HD T dropout_element(T x, const counter_rng& stream, std::uint64_t i, float p, T scale) {
  return nn::dropout_keep(stream, i, p) ? T(x * scale) : T(0.0f);
}

// nn::Dropout's scale for probability p: 1 / (1 - p), and 0 when p == 1.
template <class T>
T dropout_scale(double p) {
  return p < 1 ? T(1 / (1 - p)) : T(0.0);
}

}  // namespace shardlib::ops::cuda
