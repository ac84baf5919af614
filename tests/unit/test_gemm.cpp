// ops::gemm through the configured backend (oneDNN, OpenBLAS or Eigen) on shapes
// large enough to leave the small-product path, against a double-precision loop.
#include "shardlib/ops/gemm.hpp"
#include "support/compare.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace test_gemm {

using namespace shardlib;

namespace {
float value(std::int64_t i, int salt) { return float(((i * 37 + salt * 11) % 23) - 11) / 8.f; }
}  // namespace

TEST_CASE("gemm matches a float64 reference for every transpose, beta and leading dimension", "[ops][gemm]") {
  INFO("backend: " << ops::gemm_backend);
  const std::int64_t m = 70, n = 45, k = 66;  // m * n * k > 32^3: the backend path
  for (auto ta : {ops::trans::no, ops::trans::yes})
    for (auto tb : {ops::trans::no, ops::trans::yes})
      for (float beta : {0.f, 1.f, 0.5f}) {
        const std::int64_t lda = (ta == ops::trans::no ? k : m) + 3, ldb = (tb == ops::trans::no ? n : k) + 5,
                           ldc = n + 2;
        std::vector<float> a((ta == ops::trans::no ? m : k) * lda), b((tb == ops::trans::no ? k : n) * ldb),
            c(m * ldc);
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = value(std::int64_t(i), 1);
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = value(std::int64_t(i), 2);
        for (std::size_t i = 0; i < c.size(); ++i)  // beta = 0 must ignore C, NaN included
          c[i] = beta == 0 ? std::numeric_limits<float>::quiet_NaN() : value(std::int64_t(i), 3);
        const auto c0 = c;
        ops::gemm(ta, tb, m, n, k, 1.5f, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
        test_support::max_error worst;  // NaN and infinities count as +inf
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j) {
            double want = beta == 0 ? 0.0 : double(beta) * c0[i * ldc + j];
            for (std::int64_t p = 0; p < k; ++p) {
              const double av = ta == ops::trans::no ? a[i * lda + p] : a[p * lda + i];
              const double bv = tb == ops::trans::no ? b[p * ldb + j] : b[j * ldb + p];
              want += 1.5 * av * bv;
            }
            worst.relative(c[i * ldc + j], want, 1.0);
          }
        // fp32 products summed over k = 66 terms: error ~ k * 2^-24 relative to the
        // magnitudes summed (~1e-5 here); 1e-4 bounds it for any summation order.
        INFO("ta " << int(ta) << " tb " << int(tb) << " beta " << beta << ": worst " << worst);
        CHECK(worst < 1e-4);
        for (std::int64_t i = 0; i < m; ++i)  // the padding columns of C are untouched
          for (std::int64_t j = n; j < ldc; ++j)
            if (std::memcmp(&c[i * ldc + j], &c0[i * ldc + j], 4) != 0) FAIL("gemm wrote past n in row " << i);
      }
}

}  // namespace test_gemm
