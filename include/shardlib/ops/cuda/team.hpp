// shardlib/ops/cuda/team.hpp — Team: the lanes that compute one row together,
// so that the per-row math of the CUDA kernels is one function for host and device.
#pragma once
#include "shardlib/config.hpp"

#include <concepts>  // std::convertible_to

namespace shardlib::ops::cuda {

// A team of size() lanes works on one row: lane rank() handles elements
// rank(), rank() + size(), ... . sum(x) and max(x) combine the x of every lane
// and return the result to all of them, so every lane must make the same calls
// in the same order (on the device they synchronise the block).
//
// serial_team (one lane, here) runs the row functions on the host, which is how
// tests/unit/test_cuda_math.cpp checks them against the host layers with g++;
// block_team (ops/cuda/launch.cuh) runs them with one CUDA block per row.
template <class T>
concept Team = requires(const T& t, float x) {
  { t.rank() } -> std::convertible_to<int>;
  { t.size() } -> std::convertible_to<int>;
  { t.sum(x) } -> std::convertible_to<float>;
  { t.max(x) } -> std::convertible_to<float>;
};

struct serial_team {
  SHARDLIB_HD constexpr int rank() const { return 0; }
  SHARDLIB_HD constexpr int size() const { return 1; }
  SHARDLIB_HD constexpr float sum(float x) const { return x; }
  SHARDLIB_HD constexpr float max(float x) const { return x; }
};

static_assert(Team<serial_team>);

}  // namespace shardlib::ops::cuda
