// shardlib/ops/gemm.hpp — the one seam for host matrix products.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"

#include <Eigen/Core>

#include <cstdint>  // std::int64_t

namespace shardlib::ops {

enum class trans { no, yes };

// C[M, N] = alpha * op(A) * op(B) + beta * C, all row-major with leading
// dimensions lda, ldb, ldc; op(A) is [M, K] (A stored [K, M] when transposed).
// Every layer's matrix products go through here, so the backend is chosen in
// one place (Eigen's own kernels now; see docs/design.md for the candidates).
template <class T>
void gemm(trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda,
          const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
  using MMap = Eigen::Map<Mat, 0, Eigen::OuterStride<>>;
  MMap C(c, m, n, Eigen::OuterStride<>(ldc));
  if (m == 0 || n == 0) return;
  if (k == 0) {
    C = beta == T(0) ? Mat::Zero(m, n).eval() : (beta * C).eval();
    return;
  }
  CMap A(a, ta == trans::no ? m : k, ta == trans::no ? k : m, Eigen::OuterStride<>(lda));
  CMap B(b, tb == trans::no ? k : n, tb == trans::no ? n : k, Eigen::OuterStride<>(ldb));
  auto run = [&](const auto& opa, const auto& opb) {
    if (beta == T(0)) C.noalias() = alpha * (opa * opb);
    else {
      if (beta != T(1)) C *= beta;
      C.noalias() += alpha * (opa * opb);
    }
  };
  if (ta == trans::no && tb == trans::no) run(A, B);
  else if (ta == trans::no) run(A, B.transpose());
  else if (tb == trans::no) run(A.transpose(), B);
  else run(A.transpose(), B.transpose());
}

}  // namespace shardlib::ops
