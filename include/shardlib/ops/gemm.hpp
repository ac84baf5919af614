// shardlib/ops/gemm.hpp — the one seam for host matrix products.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <Eigen/Core>

#include <cstdint>      // std::int64_t
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v

// The float backend is a library the program links, so it is fixed when the
// program is built: CMake picks it (docs/gemm.md) and names it with one compile
// definition on shardlib::shardlib. Without one, Eigen's own kernels need nothing.
#if defined(SHARDLIB_GEMM_ONEDNN)
#include <oneapi/dnnl/dnnl.h>
#if __has_include(<omp.h>)
#include <omp.h>  // omp_set_num_threads: see float_gemm
#else  // Clang without its OpenMP headers (Debian: libomp-dev) cannot see GCC's omp.h
extern "C" int omp_get_max_threads();    // the OpenMP runtime's C functions, from the
extern "C" void omp_set_num_threads(int);  // runtime oneDNN links (cmake/FindoneDNN.cmake)
#endif
#elif defined(SHARDLIB_GEMM_OPENBLAS)
#include <cblas.h>
#endif

namespace shardlib::ops {

enum class trans { no, yes };

namespace detail {

template <class T>
void eigen_gemm(trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
                std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
  using MMap = Eigen::Map<Mat, 0, Eigen::OuterStride<>>;
  MMap C(c, m, n, Eigen::OuterStride<>(ldc));
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

// float_gemm: row-major float products on the backend CMake chose. Ranks run as
// threads, one core each, so every rank's products run on its own thread only.
#if defined(SHARDLIB_GEMM_ONEDNN)
inline constexpr std::string_view gemm_backend_name = "onednn";
inline void float_gemm(trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                       std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  // oneDNN's OpenMP build sizes its team by omp_get_max_threads(), a setting of
  // the calling thread (a new thread starts from OMP_NUM_THREADS or the core
  // count): one thread for this call, and the caller's own setting back after it.
  const int callers = omp_get_max_threads();
  omp_set_num_threads(1);
  const dnnl_status_t s = dnnl_sgemm(ta == trans::no ? 'N' : 'T', tb == trans::no ? 'N' : 'T', m, n, k, alpha, a, lda,
                                     b, ldb, beta, c, ldc);
  omp_set_num_threads(callers);
  require(s == dnnl_success, "ops::gemm: dnnl_sgemm failed with status ", int(s), " on [", m, " x ", n, " x ", k,
          "], lda ", lda, ", ldb ", ldb, ", ldc ", ldc);
}
#elif defined(SHARDLIB_GEMM_OPENBLAS)
inline constexpr std::string_view gemm_backend_name = "openblas";
inline void float_gemm(trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                       std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  // OpenBLAS's pthread build (Debian's default variant) keeps one pool for the
  // whole process, sized to the cores: shrink it to the caller, once.
  static const bool one_thread = (openblas_set_num_threads(1), true);
  (void)one_thread;
  cblas_sgemm(CblasRowMajor, ta == trans::no ? CblasNoTrans : CblasTrans, tb == trans::no ? CblasNoTrans : CblasTrans,
              blasint(m), blasint(n), blasint(k), alpha, a, blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}
#else
inline constexpr std::string_view gemm_backend_name = "eigen";
inline constexpr auto float_gemm = eigen_gemm<float>;
#endif

}  // namespace detail

// What multiplies floats in this build: "onednn", "openblas" or "eigen".
inline constexpr std::string_view gemm_backend = detail::gemm_backend_name;

// C[M, N] = alpha * op(A) * op(B) + beta * C, all row-major with leading
// dimensions lda, ldb, ldc; op(A) is [M, K] (A stored [K, M] when transposed).
// beta == 0 overwrites C without reading it. Every layer's matrix products go
// through here: floats on the backend above, other types on Eigen's kernels.
template <class T>
void gemm(trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda,
          const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // nothing to multiply (and BLAS would reject lda < 1)
    using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<Mat, 0, Eigen::OuterStride<>> C(c, m, n, Eigen::OuterStride<>(ldc));
    if (beta == T(0)) C.setZero();
    else C *= beta;
    return;
  }
  // Tiny products (attention's per-head ones: 10 x 10 x 64) stay on Eigen: a
  // library call's fixed cost, ~1 us in oneDNN, is twice the product there.
  constexpr std::int64_t tiny = 32 * 32 * 32;
  if constexpr (std::is_same_v<T, float>)
    if (m * n * k > tiny) return detail::float_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  detail::eigen_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace shardlib::ops
