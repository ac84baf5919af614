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
#include "shardlib/ops/cuda/launch.cuh"       // for_each_index

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t, std::uint64_t
#include <span>     // std::span

namespace shardlib::ops::cuda {

namespace detail {
inline void require_same_size(const char* op, std::size_t a, std::size_t b) {
  require<shape_error>(a == b, "ops::cuda::", op, ": input has ", a, " elements, output ", b);
}

template <class T>
struct relu_at {
  const T* x;
  T* y;
  __device__ void operator()(std::int64_t i) const { y[i] = T(nn::relu(float(x[i]))); }
};
template <class T>
struct relu_backward_at {
  const T *x, *dy;
  T* dx;
  __device__ void operator()(std::int64_t i) const { dx[i] = T(nn::relu_backward(float(x[i]), float(dy[i]))); }
};
template <class T>
struct gelu_at {
  const T* x;
  T* y;
  nn::gelu_approx approx;
  __device__ void operator()(std::int64_t i) const { y[i] = T(nn::gelu(float(x[i]), approx)); }
};
template <class T>
struct gelu_backward_at {
  const T *x, *dy;
  T* dx;
  nn::gelu_approx approx;
  __device__ void operator()(std::int64_t i) const { dx[i] = T(nn::gelu_backward(float(x[i]), float(dy[i]), approx)); }
};
template <class To, class From>
struct cast_at {
  const From* in;
  To* out;
  __device__ void operator()(std::int64_t i) const { out[i] = element_cast<To>(in[i]); }
};
template <class T>
struct dropout_at {
  const T* x;
  T* y;
  counter_rng stream;
  std::uint64_t first;
  float p;
  T scale;
  __device__ void operator()(std::int64_t i) const { y[i] = dropout_element(x[i], stream, first + i, p, scale); }
};
template <class T>
struct fill_at {
  T* y;
  T value;
  __device__ void operator()(std::int64_t i) const { y[i] = value; }
};
template <class T>
struct add_at {
  const T *a, *b;
  T* y;
  __device__ void operator()(std::int64_t i) const { y[i] = T(float(a[i]) + float(b[i])); }
};
template <class T>
struct repeat_row_at {
  const T* row;
  std::int64_t n;
  T* y;
  __device__ void operator()(std::int64_t i) const { y[i] = row[i % n]; }
};
}  // namespace detail

template <FloatingElement T>
void relu(std::span<const T> x, std::span<T> y, cudaStream_t stream) {
  detail::require_same_size("relu", x.size(), y.size());
  for_each_index(std::int64_t(x.size()), detail::relu_at<T>{x.data(), y.data()}, stream, "relu");
}

template <FloatingElement T>
void relu_backward(std::span<const T> x, std::span<const T> dy, std::span<T> dx, cudaStream_t stream) {
  detail::require_same_size("relu_backward", x.size(), dy.size());
  detail::require_same_size("relu_backward", x.size(), dx.size());
  for_each_index(std::int64_t(x.size()), detail::relu_backward_at<T>{x.data(), dy.data(), dx.data()}, stream,
                 "relu_backward");
}

template <FloatingElement T>
void gelu(std::span<const T> x, std::span<T> y, nn::gelu_approx approx, cudaStream_t stream) {
  detail::require_same_size("gelu", x.size(), y.size());
  for_each_index(std::int64_t(x.size()), detail::gelu_at<T>{x.data(), y.data(), approx}, stream, "gelu");
}

template <FloatingElement T>
void gelu_backward(std::span<const T> x, std::span<const T> dy, std::span<T> dx, nn::gelu_approx approx,
                   cudaStream_t stream) {
  detail::require_same_size("gelu_backward", x.size(), dy.size());
  detail::require_same_size("gelu_backward", x.size(), dx.size());
  for_each_index(std::int64_t(x.size()), detail::gelu_backward_at<T>{x.data(), dy.data(), dx.data(), approx}, stream,
                 "gelu_backward");
}

// out[i] = element_cast<To>(in[i]): round to nearest even, bit for bit the host's.
template <FloatingElement To, FloatingElement From>
void cast(std::span<const From> in, std::span<To> out, cudaStream_t stream) {
  detail::require_same_size("cast", in.size(), out.size());
  for_each_index(std::int64_t(in.size()), detail::cast_at<To, From>{in.data(), out.data()}, stream, "cast");
}

// y = dropout(x) with nn::Dropout's mask: element i draws from `rng` at index
// first + i (the host layer draws element i of its input at i, so first = 0
// reproduces it). p in [0, 1].
template <FloatingElement T>
void dropout(std::span<const T> x, std::span<T> y, const counter_rng& rng, std::uint64_t first, double p,
             cudaStream_t stream) {
  detail::require_same_size("dropout", x.size(), y.size());
  require(p >= 0 && p <= 1, "ops::cuda::dropout: probability must be in [0, 1], got ", p);
  for_each_index(std::int64_t(x.size()),
                 detail::dropout_at<T>{x.data(), y.data(), rng, first, float(p), dropout_scale<T>(p)}, stream,
                 "dropout");
}

// y[i] = value.
template <class T>
void fill(std::span<T> y, T value, cudaStream_t stream) {
  for_each_index(std::int64_t(y.size()), detail::fill_at<T>{y.data(), value}, stream, "fill");
}

// y = a + b, in float for 16-bit types (one rounding); y may be a or b.
template <FloatingElement T>
void add(std::span<const T> a, std::span<const T> b, std::span<T> y, cudaStream_t stream) {
  detail::require_same_size("add", a.size(), b.size());
  detail::require_same_size("add", a.size(), y.size());
  for_each_index(std::int64_t(y.size()), detail::add_at<T>{a.data(), b.data(), y.data()}, stream, "add");
}

// y[r, :] = row for every row of y (y.size() a multiple of row.size()): a bias
// broadcast before a product adds to it.
template <class T>
void repeat_rows(std::span<const T> row, std::span<T> y, cudaStream_t stream) {
  require<shape_error>(!row.empty() && y.size() % row.size() == 0, "ops::cuda::repeat_rows: ", y.size(),
                       " elements are not whole rows of ", row.size());
  for_each_index(std::int64_t(y.size()), detail::repeat_row_at<T>{row.data(), std::int64_t(row.size()), y.data()},
                 stream, "repeat_rows");
}

}  // namespace shardlib::ops::cuda
