// What the device tests share: the skip rule, fresh random inputs, device
// copies of host data, poisoned outputs and tolerance checks.
#pragma once
#include <shardlib/core/element.hpp>
#include <shardlib/core/ledger.hpp>
#include <shardlib/core/tensor.hpp>
#include <shardlib/cuda/caching_allocator.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/nn/context.hpp>

#include "support/compare.hpp"  // max_keeping_nan
#include "support/random_inputs.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace device_test {

namespace sl = shardlib;

// Without a usable GPU every test returns at once and the program prints the
// line ctest's SKIP_REGULAR_EXPRESSION turns into "skipped", with the reason.
inline bool have_device() {
  static const std::string problem = [] {
    std::string p = sl::cuda::device_problem();
    if (!p.empty()) std::cout << "SKIPPED: no CUDA device (" << p << ")\n";
    return p;
  }();
  return problem.empty();
}

using test_support::random_inputs;

using test_support::as;
using test_support::rounded;
template <class T>
std::vector<float> widened(const std::vector<T>& x) {
  std::vector<float> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = float(x[i]);
  return r;
}

template <class T>
sl::cuda::device_buffer<T> upload(const std::vector<T>& v, cudaStream_t s) {
  sl::cuda::device_buffer<T> d(v.size(), sl::category::activations, s);
  sl::cuda::copy_async(d.span(), std::span<const T>(v), s);
  return d;
}
// Every byte 0xFF: NaN in float, bf16 and fp16, so an element a kernel fails
// to write shows up in the comparison.
template <class T>
sl::cuda::device_buffer<T> poisoned(std::size_t n, cudaStream_t s) {
  sl::cuda::device_buffer<T> d(n, sl::category::activations, s);
  sl::cuda::fill_bytes_async(d.span(), 0xFF, s);
  return d;
}
template <class T>
std::vector<T> download(const sl::cuda::device_buffer<T>& d, cudaStream_t s) {
  std::vector<T> v(d.size());
  sl::cuda::copy_async(std::span<T>(v), std::span<const T>(d.span()), s);
  sl::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return v;
}
template <class T>
std::vector<float> download_float(const sl::cuda::device_buffer<T>& d, cudaStream_t s) {
  return widened(download(d, s));
}

// Relative error bounds of the issue: fp32 1e-5, bf16 and fp16 1e-2.
template <class T>
constexpr double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-2;

// |got - want| <= rtol |want| + atol everywhere (NaN fails: an unwritten or
// poisoned element); reports the worst element.
inline void require_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol) {
  REQUIRE(got.size() == want.size());
  std::size_t worst = 0;
  double excess = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - double(want[i])), bound = rtol * std::abs(double(want[i])) + atol;
    const double e = err <= bound ? -1 : std::isnan(err) ? INFINITY : err - bound;
    if (e > excess) {
      excess = e;
      worst = i;
    }
  }
  INFO("worst element " << worst << " of " << got.size() << ": got " << got[worst] << ", want " << want[worst]
                        << " (rtol " << rtol << ", atol " << atol << ")");
  REQUIRE(excess < 0);
}

// NaN if any element is NaN (std::max would drop it).
inline float max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = test_support::max_keeping_nan(m, std::abs(x));
  return float(m);
}

// A context whose forwards keep nothing for backward (eval mode, a checkpointed
// layer's first pass), as the sharded context says with grad_enabled(); a layer's
// children are run with it too.
struct no_grad_context : sl::nn::context {
  using sl::nn::context::context;
  bool grad_enabled() const { return false; }
  template <class L, class X>
  auto forward(L& layer, const X& x) {
    return layer.forward(*this, x);
  }
};

using test_support::host_tensor;
using test_support::values;

}  // namespace device_test
