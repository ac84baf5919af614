// shardlib/ops/cuda/elementwise.cuh — element-wise kernels: ReLU and GELU
// forward and backward, casts between floating types, dropout, and the fills
// and sums the device layers need. Each applies the host layers' own
// per-element function; 16-bit inputs compute in float.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"          // element_cast, FloatingElement
#include "shardlib/core/error.hpp"            // require, shape_error
#include "shardlib/core/random.hpp"           // counter_rng
#include "shardlib/nn/activation.hpp"         // relu, gelu and their backward
#include "shardlib/ops/cuda/elementwise.hpp"  // dropout_element, dropout_scale
#include "shardlib/ops/cuda/launch.cuh"       // map_elements

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t, std::uint64_t
#include <span>     // std::span

namespace shardlib::ops::cuda {

namespace detail {
inline void require_same_size(const char* op, std::size_t a, std::size_t b) {
  require<shape_error>(a == b, "ops::cuda::", op, ": input has ", a, " elements, output ", b);
}

// The per-element functions, as map_elements calls them: op(i, inputs at i...).
template <class T>
struct relu_of {
  __device__ T operator()(std::int64_t, T x) const { return T(nn::relu(float(x))); }
};
template <class T>
struct relu_backward_of {
  __device__ T operator()(std::int64_t, T x, T dy) const { return T(nn::relu_backward(float(x), float(dy))); }
};
template <class T>
struct gelu_of {
  nn::gelu_approx approx;
  __device__ T operator()(std::int64_t, T x) const { return T(nn::gelu(float(x), approx)); }
};
template <class T>
struct gelu_backward_of {
  nn::gelu_approx approx;
  __device__ T operator()(std::int64_t, T x, T dy) const {
    return T(nn::gelu_backward(float(x), float(dy), approx));
  }
};
template <class To, class From>
struct cast_of {
  __device__ To operator()(std::int64_t, From x) const { return element_cast<To>(x); }
};
template <class T>
struct dropout_of {
  counter_rng stream;
  std::uint64_t first;
  float p;
  T scale;
  __device__ T operator()(std::int64_t i, T x) const { return dropout_element(x, stream, first + i, p, scale); }
};
template <class T>
struct constant_of {
  T value;
  __device__ T operator()(std::int64_t) const { return value; }
};
template <class T>
struct sum_of {
  __device__ T operator()(std::int64_t, T a, T b) const { return T(float(a) + float(b)); }
};
template <class T>
struct repeated_row_of {
  const T* row;
  std::int64_t n;
  __device__ T operator()(std::int64_t i) const { return row[i % n]; }
};
}  // namespace detail

template <FloatingElement T>
void relu(std::span<const T> x, std::span<T> y, cudaStream_t stream) {
  detail::require_same_size("relu", x.size(), y.size());
  map_elements(std::int64_t(x.size()), detail::relu_of<T>{}, stream, "relu", y.data(), x.data());
}

template <FloatingElement T>
void relu_backward(std::span<const T> x, std::span<const T> dy, std::span<T> dx, cudaStream_t stream) {
  detail::require_same_size("relu_backward", x.size(), dy.size());
  detail::require_same_size("relu_backward", x.size(), dx.size());
  map_elements(std::int64_t(x.size()), detail::relu_backward_of<T>{}, stream, "relu_backward", dx.data(), x.data(),
               dy.data());
}

template <FloatingElement T>
void gelu(std::span<const T> x, std::span<T> y, nn::gelu_approx approx, cudaStream_t stream) {
  detail::require_same_size("gelu", x.size(), y.size());
  map_elements(std::int64_t(x.size()), detail::gelu_of<T>{approx}, stream, "gelu", y.data(), x.data());
}

template <FloatingElement T>
void gelu_backward(std::span<const T> x, std::span<const T> dy, std::span<T> dx, nn::gelu_approx approx,
                   cudaStream_t stream) {
  detail::require_same_size("gelu_backward", x.size(), dy.size());
  detail::require_same_size("gelu_backward", x.size(), dx.size());
  map_elements(std::int64_t(x.size()), detail::gelu_backward_of<T>{approx}, stream, "gelu_backward", dx.data(),
               x.data(), dy.data());
}

// out[i] = element_cast<To>(in[i]): round to nearest even, bit for bit the host's.
template <FloatingElement To, FloatingElement From>
void cast(std::span<const From> in, std::span<To> out, cudaStream_t stream) {
  detail::require_same_size("cast", in.size(), out.size());
  map_elements(std::int64_t(in.size()), detail::cast_of<To, From>{}, stream, "cast", out.data(), in.data());
}

// y = dropout(x) with nn::Dropout's mask: element i draws from `rng` at index
// first + i (the host layer draws element i of its input at i, so first = 0
// reproduces it). p in [0, 1].
template <FloatingElement T>
void dropout(std::span<const T> x, std::span<T> y, const counter_rng& rng, std::uint64_t first, double p,
             cudaStream_t stream) {
  detail::require_same_size("dropout", x.size(), y.size());
  require(p >= 0 && p <= 1, "ops::cuda::dropout: probability must be in [0, 1], got ", p);
  map_elements(std::int64_t(x.size()), detail::dropout_of<T>{rng, first, float(p), dropout_scale<T>(p)}, stream,
               "dropout", y.data(), x.data());
}

// y[i] = value.
template <class T>
void fill(std::span<T> y, T value, cudaStream_t stream) {
  map_elements(std::int64_t(y.size()), detail::constant_of<T>{value}, stream, "fill", y.data());
}

// y = a + b, in float for 16-bit types (one rounding); y may be a or b.
template <FloatingElement T>
void add(std::span<const T> a, std::span<const T> b, std::span<T> y, cudaStream_t stream) {
  detail::require_same_size("add", a.size(), b.size());
  detail::require_same_size("add", a.size(), y.size());
  map_elements(std::int64_t(y.size()), detail::sum_of<T>{}, stream, "add", y.data(), a.data(), b.data());
}

// y[r, :] = row for every row of y (y.size() a multiple of row.size()): a bias
// broadcast before a product adds to it.
template <class T>
void repeat_rows(std::span<const T> row, std::span<T> y, cudaStream_t stream) {
  require<shape_error>(!row.empty() && y.size() % row.size() == 0, "ops::cuda::repeat_rows: ", y.size(),
                       " elements are not whole rows of ", row.size());
  map_elements(std::int64_t(y.size()), detail::repeated_row_of<T>{row.data(), std::int64_t(row.size())}, stream,
               "repeat_rows", y.data());
}

}  // namespace shardlib::ops::cuda
