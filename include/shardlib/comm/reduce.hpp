// shardlib/comm/reduce.hpp — reduce_into: the element-wise reduction every host collective uses.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>    // std::min
#include <cstddef>      // std::size_t
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::conditional_t

namespace shardlib::comm {

// 16-bit floats are reduced in float and rounded once at the end, so a sum over
// W ranks carries one rounding, not W - 1 (fp32 reductions, as NCCL does for bf16).
template <class T>
using accumulator_t = std::conditional_t<std::is_same_v<T, bfloat16> || std::is_same_v<T, half>, float, T>;

// The error names the rank and its call where given.
inline void check_reducible(reduce_op op, dtype t, int rank = -1, std::string_view call = "reduce") {
  const bool floating = t == dtype::f64 || t == dtype::f32 || t == dtype::f16 || t == dtype::bf16;
  if (t != dtype::boolean && (op != reduce_op::avg || floating)) return;  // no message built on the common path
  const std::string who = rank >= 0 ? cat("rank ", rank, ": ", call) : std::string(call);
  if (t == dtype::boolean) throw comm_error(cat(who, ": ", name(op), " is not defined for BOOL"));
  throw comm_error(cat(who, ": avg needs a floating element type, got ", name(t)));
}

// dst[i] = op(srcs[0][i], srcs[1][i], ..., srcs[W-1][i]), combining the sources in
// index order, so every rank that reduces the same inputs gets the same bits and
// runs repeat exactly. dst may be one of the sources (in-place collectives): each
// block is read completely before it is written.
template <Element T>
void reduce_into(T* dst, std::span<const T* const> srcs, std::size_t n, reduce_op op) {
  using A = accumulator_t<T>;
  check_reducible(op, dtype_of<T>);
  constexpr std::size_t block = 1024;
  const std::size_t w = srcs.size();
  A acc[block];
  for (std::size_t lo = 0; lo < n; lo += block) {
    const std::size_t len = std::min(block, n - lo);
    const T* s0 = srcs[0] + lo;
    for (std::size_t i = 0; i < len; ++i) acc[i] = A(s0[i]);
    for (std::size_t r = 1; r < w; ++r) {
      const T* s = srcs[r] + lo;
      if (op == reduce_op::max) {
        // NaN wins, as in torch.max: a NaN accumulator stays, a NaN source replaces.
        for (std::size_t i = 0; i < len; ++i)
          if (!(A(s[i]) <= acc[i]) && acc[i] == acc[i]) acc[i] = A(s[i]);
      } else {
        for (std::size_t i = 0; i < len; ++i) acc[i] += A(s[i]);
      }
    }
    if (op == reduce_op::avg)
      for (std::size_t i = 0; i < len; ++i) acc[i] /= A(w);
    T* d = dst + lo;
    for (std::size_t i = 0; i < len; ++i) d[i] = T(acc[i]);
  }
}

}  // namespace shardlib::comm
