// tests/support/random_inputs.hpp — fresh random inputs for tests that compare two
// implementations (the CUDA math on the host, the device ops and layers), and host
// tensors made from and read back to values.
#pragma once
#include "shardlib/core/shape.hpp"
#include "shardlib/core/tensor.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace test_support {

// Fresh inputs on every run; the seed is printed with failures and
// SHARDLIB_TEST_SEED=<seed> replays it.
struct random_inputs {
  std::uint32_t seed = std::getenv("SHARDLIB_TEST_SEED") ? std::uint32_t(std::stoul(std::getenv("SHARDLIB_TEST_SEED")))
                                                         : std::random_device{}();
  std::mt19937 gen{seed};
  std::vector<float> normal(std::size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(gen);
    return v;
  }
  std::int64_t integer(std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen); }
};

// x rounded to T and back: the values a T input really holds.
template <class T>
std::vector<float> rounded(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = float(T(x[i]));
  return r;
}

// x as T values.
template <class T>
std::vector<T> as(const std::vector<float>& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = T(x[i]);
  return r;
}

// Host tensors from values, and their values back.
inline shardlib::Tensor<float> host_tensor(shardlib::Shape s, const std::vector<float>& v) {
  shardlib::Tensor<float> t(s);
  std::copy(v.begin(), v.end(), t.data());
  return t;
}
inline std::vector<float> values(const shardlib::Tensor<float>& t) { return {t.data(), t.data() + t.numel()}; }

}  // namespace test_support
