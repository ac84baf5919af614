// ops::cuda::gemm (plain cuBLAS) and gemm_staged (the same, rows not on 16-byte
// boundaries copied to aligned scratch first) against the host ops::gemm; ops::cuda::gemm_lt
// (cuBLASLt with fused epilogues) and the device Linear that uses it. Every
// epilogue against an unfused reference computed on the host in float64 from
// the same T-rounded inputs: the product, then the bias, then nn::relu /
// nn::gelu (tanh) and their backward, the host layers' own functions.
// Transposes, padded leading dimensions, and odd sizes (M, N, K from 1, 7, 33,
// 768, 3072, 50257) in a few combinations.
//
// Tolerances, per element, |got - want| <= bound (NaN fails):
// - the fp32 product, 1e-5 of the sum of the magnitudes of the terms summed
//   (|alpha| sum |a b| + |beta c| + |bias|): a sum is accurate relative to
//   that, not to a result that cancels; a missing or misplaced term is far
//   larger;
// - 16-bit outputs, one rounding to T besides (2^-8 of |want| for bf16,
//   2^-11 for fp16): cuBLASLt accumulates in fp32 and rounds once when it
//   writes C, so the output is the fp32 result rounded (half an ulp is 2^-9
//   for bf16; the fp32 sum may sit on the other side of a rounding boundary,
//   hence a whole ulp);
// - GELU: cuBLASLt computes its tanh approximately (its fp32 results differ
//   from the exact tanh form by ~1e-4, as tanh.approx.f32, whose relative
//   error is below 2^-10.99), so the bound adds the change of the result when
//   tanh is off by 7e-4 (2^-10.5) relatively. The pre-activation (aux) it writes is
//   held to the plain product bound.
// The device Linear, plain and with a fused ReLU or tanh-GELU, against the
// host Linear (then the host's ReLU or GELU): fp32 within 1e-5 relative, bf16
// within 1e-2, as tests/cuda/test_cuda_layers.cu (fp32 GELU is not fused, so
// cuBLASLt's approximate tanh never meets the 1e-5 bound).
#include <shardlib/cuda/blas.hpp>
#include <shardlib/cuda/blas_lt.hpp>
#include <shardlib/cuda/caching_allocator.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/nn/activation.hpp>
#include <shardlib/nn/context.hpp>
#include <shardlib/nn/cuda/linear.cuh>
#include <shardlib/nn/linear.hpp>
#include <shardlib/ops/cuda/gemm.hpp>
#include <shardlib/ops/cuda/gemm_lt.hpp>
#include <shardlib/ops/gemm.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "device_test.hpp"
#include "support/compare.hpp"

namespace test_cuda_gemm {

namespace sl = shardlib;
namespace nn = shardlib::nn;
namespace oc = shardlib::ops::cuda;
using namespace device_test;
using oc::epilogue;
using sl::cuda_space;
using sl::Shape;
using sl::Tensor;
using trans = sl::ops::trans;

namespace {

constexpr double sum_rtol = 1e-5;
template <class T>
constexpr double out_rtol = std::is_same_v<T, float> ? 0.0 : std::is_same_v<T, sl::bfloat16> ? 0x1p-8 : 0x1p-11;
// Below T's normal range a rounding is half its subnormal step, not relative: up to three
// roundings (the result and its parts) of half a step each (half: 2^-25; values near 1e-5
// are subnormal there and come out of small operands now and then).
template <class T>
constexpr double out_atol = std::is_same_v<T, float> ? 0.0 : 3 * (std::is_same_v<T, sl::bfloat16> ? 0x1p-134 : 0x1p-25);
// The rounding to T of values whose magnitudes sum to m.
template <class T>
double out_round(double m) {
  return out_rtol<T> * m + out_atol<T>;
}
constexpr double tanh_rtol = 7e-4;  // 2^-10.5, above tanh.approx.f32's 2^-10.99

// cuBLASLt's GELU (tanh form) and its derivative with tanh scaled by (1 + e):
// the reference at e = 0, and the reach of an approximate tanh at e = ±tanh_rtol.
double gelu_t(double x, double e) {
  const double t = std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)) * (1 + e);
  return 0.5 * x * (1 + t);
}
double dgelu_t(double x, double e) {
  const double k = 0.7978845608028654, c = 0.044715, t = std::tanh(k * (x + c * x * x * x)) * (1 + e);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * c * x * x);
}
template <class F>
double tanh_reach(F f, double x) {
  return test_support::max_keeping_nan(std::abs(f(x, tanh_rtol) - f(x, 0)), std::abs(f(x, -tanh_rtol) - f(x, 0)));
}

// |got[i] - want[i]| <= bound[i] everywhere (NaN fails); names the worst element.
void require_within(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& bound) {
  REQUIRE(got.size() == want.size());
  std::size_t worst = 0;
  double excess = -INFINITY;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    const double e = std::isnan(err) ? INFINITY : err - bound[i];
    if (e > excess) {
      excess = e;
      worst = i;
    }
  }
  INFO("worst element " << worst << " of " << got.size() << ": got " << got[worst] << ", want " << want[worst]
                        << ", bound " << bound[worst]);
  REQUIRE(excess <= 0);
}

struct dims {
  std::int64_t m, n, k;
  trans ta = trans::no, tb = trans::no;
};

// One product C[M, N] = alpha op(A) op(B) + beta C0 on device 0: T-rounded
// random operands on host and device (A, B with padded leading dimensions),
// C poisoned (beta 0) or C0, and the float64 reference p with s, the sum of
// the magnitudes of its terms, and r = |alpha op(A) op(B)| + |beta C0|.
//
// r is there because cuBLASLt, writing a 16-bit D, may round the product to T
// before it adds beta C0, the bias or applies the epilogue, and round again
// after: seen on an H200 with CUDA 13.0, up to one unit in the last place
// where one rounding gives half. So the 16-bit bounds allow T's rounding of
// each part as well as of the result (out_round: out_rtol (|result| + r + |bias|),
// and out_atol below T's normal range).
template <class T>
struct product {
  dims d;
  float alpha, beta;
  std::int64_t lda, ldb, ldc;
  std::vector<float> a, b, c0;
  sl::cuda::device_buffer<T> da, db, dc;
  std::vector<double> p, s, r;

  product(dims d_, float alpha_, float beta_, random_inputs& rnd, cudaStream_t st, std::int64_t pad = 0)
      : d(d_), alpha(alpha_), beta(beta_) {
    const auto [m, n, k, ta, tb] = d;
    const std::int64_t a_rows = ta == trans::no ? m : k, a_cols = ta == trans::no ? k : m;
    const std::int64_t b_rows = tb == trans::no ? k : n, b_cols = tb == trans::no ? n : k;
    lda = a_cols + pad;
    ldb = b_cols + pad;
    ldc = n;
    a = rounded<T>(rnd.normal(std::size_t(a_rows * lda)));
    b = rounded<T>(rnd.normal(std::size_t(b_rows * ldb)));
    c0 = rounded<T>(rnd.normal(std::size_t(m * n)));
    da = upload(as<T>(a), st);
    db = upload(as<T>(b), st);
    dc = beta == 0 ? poisoned<T>(std::size_t(m * n), st) : upload(as<T>(c0), st);
    p.assign(std::size_t(m * n), 0.0);
    s.assign(std::size_t(m * n), 0.0);
    r.assign(std::size_t(m * n), 0.0);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t q = 0; q < k; ++q) {
        const double av = ta == trans::no ? a[i * lda + q] : a[q * lda + i];
        double* pi = &p[std::size_t(i * n)];
        double* si = &s[std::size_t(i * n)];
        for (std::int64_t j = 0; j < n; ++j) {
          const double t = av * (tb == trans::no ? b[q * ldb + j] : b[j * ldb + q]);
          pi[j] += t;
          si[j] += std::abs(t);
        }
      }
    for (std::size_t i = 0; i < p.size(); ++i) {
      r[i] = std::abs(alpha * p[i]) + std::abs(beta * double(c0[i]));
      p[i] = alpha * p[i] + beta * double(c0[i]);
      s[i] = std::abs(alpha) * s[i] + std::abs(beta * double(c0[i]));
    }
  }
  // C's rows and columns from the element index.
  std::int64_t col(std::size_t i) const { return std::int64_t(i) % d.n; }

  bool run(const sl::cuda::blas_lt& h, cudaStream_t st, const oc::epilogue_args<T>& e) {
    return oc::gemm_lt(h, st, d.ta, d.tb, d.m, d.n, d.k, alpha, da.data(), lda, db.data(), ldb, beta, dc.data(), ldc,
                       e);
  }
};

// A [size] random vector rounded to T on host and device.
template <class T>
struct vec {
  std::vector<float> host;
  sl::cuda::device_buffer<T> dev;
  vec(std::int64_t size, random_inputs& rnd, cudaStream_t st)
      : host(rounded<T>(rnd.normal(std::size_t(size)))), dev(upload(as<T>(host), st)) {}
};

struct device_fixture {
  sl::cuda::stream stream{0};
  sl::cuda::blas_lt handle{0};
};

const std::vector<dims> odd_sizes = {
    {1, 1, 1},     {7, 33, 1},    {33, 7, 768, trans::no, trans::yes}, {1, 3072, 768, trans::no, trans::yes},
    {768, 33, 7},  {7, 50257, 33, trans::no, trans::yes},                {33, 7, 50257, trans::yes, trans::no},
    {768, 3072, 7, trans::yes, trans::yes}};

}  // namespace

// --- host: what gemm_lt checks before it reaches cuBLASLt ----------------------------------

TEST_CASE("gemm_lt's auxiliary layouts and argument checks (host)", "[cuda][gemm]") {
  CHECK(oc::gelu_aux_ld(7) == 8);
  CHECK(oc::gelu_aux_ld(3072) == 3072);
  CHECK(oc::relu_mask_ld(33) == 128);
  CHECK(oc::relu_mask_ld(129) == 256);
  CHECK(oc::relu_mask_bytes(3, 33) == 3 * 16);
  // Row-major bgrad_a sums op(A), which is cuBLASLt's B (A and B trade places).
  CHECK(oc::detail::lt_epilogue(epilogue::bgrad_a) == CUBLASLT_EPILOGUE_BGRADB);
  CHECK(oc::detail::lt_epilogue(epilogue::bgrad_b) == CUBLASLT_EPILOGUE_BGRADA);
  CHECK(oc::detail::lt_epilogue(epilogue::gelu_aux_bias) == CUBLASLT_EPILOGUE_GELU_AUX_BIAS);

  float v[256] = {};
  const auto ok = [&](trans ta, trans tb, std::int64_t n, oc::epilogue_args<float> e) {
    oc::detail::check_epilogue(ta, tb, n, e);
  };
  CHECK_NOTHROW(ok(trans::no, trans::no, 7, {.kind = epilogue::bias, .bias = v}));
  CHECK_THROWS_AS(ok(trans::no, trans::no, 7, {.kind = epilogue::bias}), sl::error);
  CHECK_THROWS_AS(ok(trans::no, trans::no, 7, {.kind = epilogue::bgrad_a, .bias_grad = v}), sl::error);
  CHECK_NOTHROW(ok(trans::yes, trans::no, 7, {.kind = epilogue::bgrad_a, .bias_grad = v}));
  CHECK_THROWS_AS(ok(trans::no, trans::yes, 7, {.kind = epilogue::bgrad_b, .bias_grad = v}), sl::error);
  CHECK_THROWS_AS(ok(trans::no, trans::no, 7, {.kind = epilogue::dgelu, .aux = v, .aux_ld = 7}), sl::error);
  CHECK_THROWS_AS(ok(trans::no, trans::no, 9, {.kind = epilogue::dgelu, .aux = v, .aux_ld = 8}), sl::error);
  CHECK_NOTHROW(ok(trans::no, trans::no, 7, {.kind = epilogue::dgelu, .aux = v, .aux_ld = 8}));
  CHECK_THROWS_AS(ok(trans::no, trans::no, 7, {.kind = epilogue::drelu, .mask = v, .aux_ld = 64}), sl::error);
  CHECK_NOTHROW(ok(trans::no, trans::no, 7, {.kind = epilogue::drelu, .mask = v, .aux_ld = 128}));
}

// --- device: every epilogue against the float64 reference ----------------------------------

TEMPLATE_TEST_CASE("gemm_lt without an epilogue and with a bias equals the float64 product", "[cuda][gemm]", float,
                   sl::bfloat16, sl::half) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  std::vector<dims> cases = odd_sizes;
  for (trans ta : {trans::no, trans::yes})
    for (trans tb : {trans::no, trans::yes}) cases.push_back({37, 53, 29, ta, tb});
  for (const dims& d : cases)
    for (epilogue kind : {epilogue::none, epilogue::bias})
      for (float beta : {0.0f, 0.5f}) {
        INFO("M " << d.m << " N " << d.n << " K " << d.k << " ta " << int(d.ta) << " tb " << int(d.tb) << " "
                  << oc::detail::name(kind) << " beta " << beta);
        product<T> pr(d, 1.5f, beta, rnd, f.stream, d.m == 37 ? 3 : 0);
        vec<T> bias(d.n, rnd, f.stream);
        REQUIRE(pr.run(f.handle, f.stream, {.kind = kind, .bias = bias.dev.data()}));
        const auto got = download_float(pr.dc, f.stream);
        std::vector<double> want = pr.p, bound(want.size());
        for (std::size_t i = 0; i < want.size(); ++i) {
          const double bj = kind == epilogue::bias ? bias.host[std::size_t(pr.col(i))] : 0.0;
          want[i] += bj;
          bound[i] = sum_rtol * (pr.s[i] + std::abs(bj)) + out_round<T>(std::abs(want[i]) + pr.r[i] + std::abs(bj));
        }
        require_within(got, want, bound);
      }
}

TEMPLATE_TEST_CASE("gemm_lt's ReLU epilogues: relu_bias, its mask, and drelu/drelu_bgrad as the host's ReLU backward",
                   "[cuda][gemm]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (const dims& d : {dims{33, 7, 768, trans::no, trans::yes}, dims{768, 3072, 33, trans::no, trans::yes},
                        dims{7, 129, 50, trans::yes, trans::no}}) {
    INFO("M " << d.m << " N " << d.n << " K " << d.k);
    const std::size_t size = std::size_t(d.m * d.n);
    // Forward: Z = P + bias, C = relu(Z), both without and with the mask.
    product<T> fw(d, 1.0f, 0.0f, rnd, f.stream);
    vec<T> bias(d.n, rnd, f.stream);
    std::vector<double> z(size), zb(size), want(size), bound(size);
    for (std::size_t i = 0; i < size; ++i) {
      const double bj = bias.host[std::size_t(fw.col(i))];
      z[i] = fw.p[i] + bj;
      zb[i] = sum_rtol * (fw.s[i] + std::abs(bj)) + out_round<T>(std::abs(z[i]) + fw.r[i] + std::abs(bj));
      want[i] = nn::relu(z[i]);
      bound[i] = zb[i];
    }
    REQUIRE(fw.run(f.handle, f.stream, {.kind = epilogue::relu_bias, .bias = bias.dev.data()}));
    require_within(download_float(fw.dc, f.stream), want, bound);

    const std::int64_t ld = oc::relu_mask_ld(d.n);
    sl::cuda::device_buffer<std::uint8_t> mask(std::size_t(oc::relu_mask_bytes(d.m, d.n)), sl::category::activations,
                                               f.stream);
    REQUIRE(fw.run(f.handle, f.stream,
                   {.kind = epilogue::relu_aux_bias, .bias = bias.dev.data(), .mask = mask.data(), .aux_ld = ld}));
    require_within(download_float(fw.dc, f.stream), want, bound);
    const auto bits = download(mask, f.stream);
    const auto bit = [&](std::size_t i) {
      const std::int64_t r = std::int64_t(i) / d.n, c = fw.col(i);
      return (bits[std::size_t((r * ld + c) / 8)] >> ((r * ld + c) % 8)) & 1;
    };
    std::size_t wrong_bits = 0, decided = 0;
    for (std::size_t i = 0; i < size; ++i)
      if (std::abs(z[i]) > zb[i]) {  // the sign is certain
        ++decided;
        wrong_bits += bit(i) != (z[i] >= 0);
      }
    CHECK(decided > size / 2);
    CHECK(wrong_bits == 0);

    // Backward: D = Q masked, bias_grad its column sums; where the sign of Z
    // is certain, D is nn::relu_backward(Z, Q).
    for (epilogue kind : {epilogue::drelu, epilogue::drelu_bgrad}) {
      INFO(oc::detail::name(kind));
      product<T> bw(d, 1.0f, 0.5f, rnd, f.stream);
      auto db = poisoned<T>(std::size_t(d.n), f.stream);
      REQUIRE(bw.run(f.handle, f.stream,
                     {.kind = kind, .bias_grad = kind == epilogue::drelu_bgrad ? db.data() : nullptr,
                      .mask = mask.data(), .aux_ld = ld}));
      const auto got = download_float(bw.dc, f.stream);
      std::vector<double> dwant(size), dbound(size), g(std::size_t(d.n), 0.0), gb(std::size_t(d.n), 0.0);
      std::vector<float> certain_got;
      std::vector<double> certain_want, certain_bound;
      for (std::size_t i = 0; i < size; ++i) {
        dwant[i] = bit(i) ? bw.p[i] : 0.0;
        dbound[i] = bit(i) ? sum_rtol * bw.s[i] + out_round<T>(std::abs(bw.p[i]) + bw.r[i]) : 0.0;
        g[std::size_t(bw.col(i))] += dwant[i];
        gb[std::size_t(bw.col(i))] += dbound[i] + out_round<T>(std::abs(dwant[i]));
        if (std::abs(z[i]) > zb[i]) {
          certain_got.push_back(got[i]);
          certain_want.push_back(nn::relu_backward(z[i], bw.p[i]));
          certain_bound.push_back(dbound[i]);
        }
      }
      require_within(got, dwant, dbound);
      require_within(certain_got, certain_want, certain_bound);
      if (kind == epilogue::drelu_bgrad) require_within(download_float(db, f.stream), g, gb);
    }
  }
}

TEMPLATE_TEST_CASE("gemm_lt's GELU epilogues are the tanh form: gelu_bias, gelu_aux_bias, dgelu/dgelu_bgrad",
                   "[cuda][gemm]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (const dims& d : {dims{33, 8, 768, trans::no, trans::yes}, dims{768, 3072, 33, trans::no, trans::yes},
                        dims{7, 33, 50, trans::yes, trans::no}}) {
    INFO("M " << d.m << " N " << d.n << " K " << d.k);
    const std::size_t size = std::size_t(d.m * d.n);
    // Inputs scaled so that Z spans GELU's curved part (|Z| of a few units).
    product<T> fw(d, float(2.0 / std::sqrt(double(d.k))), 0.0f, rnd, f.stream);
    vec<T> bias(d.n, rnd, f.stream);
    std::vector<double> z(size), zb(size), want(size), bound(size);
    for (std::size_t i = 0; i < size; ++i) {
      const double bj = bias.host[std::size_t(fw.col(i))];
      z[i] = fw.p[i] + bj;
      zb[i] = sum_rtol * (fw.s[i] + std::abs(bj)) + out_round<T>(std::abs(z[i]) + fw.r[i] + std::abs(bj));
      want[i] = nn::gelu(z[i], nn::gelu_approx::tanh);
      // |gelu'| <= 1.13: the pre-activation's error (its sums and roundings) passes through at most that.
      bound[i] = 1.13 * zb[i] + out_round<T>(std::abs(want[i])) + tanh_reach(gelu_t, z[i]);
    }
    REQUIRE(fw.run(f.handle, f.stream, {.kind = epilogue::gelu_bias, .bias = bias.dev.data()}));
    require_within(download_float(fw.dc, f.stream), want, bound);

    const std::int64_t ld = oc::gelu_aux_ld(d.n);
    auto aux = poisoned<T>(std::size_t(d.m * ld), f.stream);
    REQUIRE(fw.run(f.handle, f.stream,
                   {.kind = epilogue::gelu_aux_bias, .bias = bias.dev.data(), .aux = aux.data(), .aux_ld = ld}));
    require_within(download_float(fw.dc, f.stream), want, bound);
    const auto aux_got = download_float(aux, f.stream);
    std::vector<float> z_got(size);
    for (std::size_t i = 0; i < size; ++i) z_got[i] = aux_got[std::size_t(std::int64_t(i) / d.n * ld + fw.col(i))];
    require_within(z_got, z, zb);

    // Backward: D = Q gelu'(aux) (the aux as the device wrote it), bias_grad its column sums.
    for (epilogue kind : {epilogue::dgelu, epilogue::dgelu_bgrad}) {
      INFO(oc::detail::name(kind));
      product<T> bw(d, 1.0f, 0.0f, rnd, f.stream);
      auto db = poisoned<T>(std::size_t(d.n), f.stream);
      REQUIRE(bw.run(f.handle, f.stream,
                     {.kind = kind, .bias_grad = kind == epilogue::dgelu_bgrad ? db.data() : nullptr,
                      .aux = aux.data(), .aux_ld = ld}));
      std::vector<double> dwant(size), dbound(size), g(std::size_t(d.n), 0.0), gb(std::size_t(d.n), 0.0);
      for (std::size_t i = 0; i < size; ++i) {
        const double x = z_got[i];
        dwant[i] = nn::gelu_backward(x, bw.p[i], nn::gelu_approx::tanh);
        dbound[i] = std::abs(dgelu_t(x, 0)) * (sum_rtol * bw.s[i] + out_round<T>(std::abs(bw.p[i]) + bw.r[i])) +
                    out_round<T>(std::abs(dwant[i])) + std::abs(bw.p[i]) * tanh_reach(dgelu_t, x);
        g[std::size_t(bw.col(i))] += dwant[i];
        gb[std::size_t(bw.col(i))] += dbound[i] + out_round<T>(std::abs(dwant[i]));
      }
      require_within(download_float(bw.dc, f.stream), dwant, dbound);
      if (kind == epilogue::dgelu_bgrad) require_within(download_float(db, f.stream), g, gb);
    }
  }
}

TEMPLATE_TEST_CASE("gemm_lt's bgrad_a and bgrad_b sum the operands over K beside an ordinary product",
                   "[cuda][gemm]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (const dims& size : {dims{7, 33, 768}, dims{768, 3072, 33}, dims{1, 50257, 7}, dims{33, 1, 3072}})
    for (epilogue kind : {epilogue::bgrad_a, epilogue::bgrad_b})
      for (trans other : {trans::no, trans::yes}) {
        dims d = size;
        d.ta = kind == epilogue::bgrad_a ? trans::yes : other;
        d.tb = kind == epilogue::bgrad_b ? trans::no : other;
        INFO("M " << d.m << " N " << d.n << " K " << d.k << " " << oc::detail::name(kind) << " ta " << int(d.ta)
                  << " tb " << int(d.tb));
        product<T> pr(d, 1.0f, 1.0f, rnd, f.stream);  // beta 1: a gradient accumulating
        const std::int64_t len = kind == epilogue::bgrad_a ? d.m : d.n;
        auto db = poisoned<T>(std::size_t(len), f.stream);
        REQUIRE(pr.run(f.handle, f.stream, {.kind = kind, .bias_grad = db.data()}));
        std::vector<double> bound(pr.p.size());
        for (std::size_t i = 0; i < bound.size(); ++i)
          bound[i] = sum_rtol * pr.s[i] + out_round<T>(std::abs(pr.p[i]) + pr.r[i]);
        require_within(download_float(pr.dc, f.stream), pr.p, bound);
        // op(A)[i, q] is A[q, i] (ta yes); op(B)[q, j] is B[q, j] (tb no).
        std::vector<double> g(std::size_t(len), 0.0), gs(std::size_t(len), 0.0), gb(g.size());
        for (std::int64_t q = 0; q < d.k; ++q)
          for (std::int64_t i = 0; i < len; ++i) {
            const double v = kind == epilogue::bgrad_a ? pr.a[q * pr.lda + i] : pr.b[q * pr.ldb + i];
            g[std::size_t(i)] += v;
            gs[std::size_t(i)] += std::abs(v);
          }
        for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = sum_rtol * gs[i] + out_round<T>(std::abs(g[i]));
        require_within(download_float(db, f.stream), g, gb);
      }
}

// --- the device Linear, which takes the bias and bgrad_a epilogues ------------------------------

namespace {

// Forward and backward of a device Linear with activation `act` against the
// host Linear followed by the host's ReLU or GELU (tanh), on the same
// T-rounded parameters, input and output gradient; the parameter gradients
// start random, so that accumulation is checked.
template <class T>
void compare_linear(std::int64_t rows, std::int64_t in, std::int64_t out, nn::fused_activation act,
                    random_inputs& rnd, cudaStream_t stream) {
  INFO("rows " << rows << " in " << in << " out " << out << " activation " << int(act));
  nn::Linear<float> host(in, out);
  nn::ReLU<float> relu;
  nn::GELU<float> gelu(nn::gelu_approx::tanh);
  nn::Linear<T, cuda_space> dev(in, out);
  dev.fuse_activation(act);
  REQUIRE(dev.activation() == act);
  std::vector<float> w = rounded<T>(rnd.normal(std::size_t(out * in), 0.2f));
  std::vector<float> b = rounded<T>(rnd.normal(std::size_t(out)));
  std::vector<float> gw = rounded<T>(rnd.normal(w.size())), gb = rounded<T>(rnd.normal(b.size()));
  std::vector<float> hgw = gw, hgb = gb;
  host.weight.value = w.data();
  host.weight.grad = hgw.data();
  host.bias.value = b.data();
  host.bias.grad = hgb.data();
  auto dw = upload(as<T>(w), stream), dbias = upload(as<T>(b), stream);
  auto dgw = upload(as<T>(gw), stream), dgb = upload(as<T>(gb), stream);
  dev.weight.value = dw.data();
  dev.weight.grad = dgw.data();
  dev.bias.value = dbias.data();
  dev.bias.grad = dgb.data();

  const auto x = rounded<T>(rnd.normal(std::size_t(rows * in)));
  auto dy = rounded<T>(rnd.normal(std::size_t(rows * out)));
  if (act == nn::fused_activation::relu) {
    // Where the pre-activation lies within its sums' rounding of zero (1e-4 of the sum of
    // the terms' magnitudes: the device and the host sum in different orders), ReLU's mask
    // may differ between them and move that gradient element by all of it (seen in fp32,
    // about 1 run in 100 at these sizes). In 16 bits cuBLASLt may also round the product to
    // T before it adds the bias (see `product`), so the band is two of T's roundings wider
    // (seen on an H200: a dx element off by 0.8). The output gradient is 0 there, so the
    // mask carries nothing; everywhere else the comparison is unchanged.
    const double band = 1e-4 + 2 * out_rtol<T>;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < out; ++j) {
        double z = b[std::size_t(j)], terms = std::abs(z);
        for (std::int64_t k = 0; k < in; ++k) {
          const double t = double(x[std::size_t(r * in + k)]) * w[std::size_t(j * in + k)];
          z += t;
          terms += std::abs(t);
        }
        if (std::abs(z) <= band * terms) dy[std::size_t(r * out + j)] = 0;
      }
  }
  nn::context ctx({.training = true});
  Tensor<float> hy = host.forward(ctx, host_tensor(Shape{rows, in}, x));
  Tensor<float> hdy = host_tensor(Shape{rows, out}, dy);
  if (act == nn::fused_activation::relu) {
    hy = relu.forward(ctx, hy);
    hdy = relu.backward(ctx, hdy);
  } else if (act == nn::fused_activation::gelu_tanh) {
    hy = gelu.forward(ctx, hy);
    hdy = gelu.backward(ctx, hdy);
  }
  const auto hdx = values(host.backward(ctx, hdy));

  Tensor<T, cuda_space> dx_in(Shape{rows, in}), dy_in(Shape{rows, out});
  const std::vector<T> x_t = as<T>(x), dy_t = as<T>(dy);
  sl::cuda::copy_async(dx_in.span(), std::span<const T>(x_t), stream);
  sl::cuda::copy_async(dy_in.span(), std::span<const T>(dy_t), stream);
  const auto y = dev.forward(ctx, dx_in);
  const auto dx = dev.backward(ctx, dy_in);
  const auto to_host = [&](std::span<const T> s) {
    std::vector<T> v(s.size());
    sl::cuda::copy_async(std::span<T>(v), s, stream);
    sl::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return widened(v);
  };
  const auto near = [](const std::vector<float>& got, const std::vector<float>& want) {
    require_close(got, want, rtol<T>, rtol<T> * max_abs(want));  // sums cancel: slack scaled by the largest value
  };
  near(to_host(y.span()), values(hy));
  near(to_host(dx.span()), hdx);
  near(to_host(dgw.span()), hgw);
  near(to_host(dgb.span()), hgb);
}

// C[m, n] = 1.5 op(A) op(B) + beta C by run(a, lda, b, ldb, c, ldc) on the device (gemm or
// gemm_staged), each leading dimension its columns + pad, against the host ops::gemm, for every
// transpose; C's padding columns are left as they were (the poison where beta is 0).
template <class T, class Run>
void compare_with_host(std::int64_t m, std::int64_t n, std::int64_t k, std::array<std::int64_t, 3> pad, Run run) {
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (auto ta : {sl::ops::trans::no, sl::ops::trans::yes})
    for (auto tb : {sl::ops::trans::no, sl::ops::trans::yes})
      for (float beta : {0.0f, 0.5f}) {
        INFO("ta " << int(ta) << " tb " << int(tb) << " beta " << beta);
        const std::int64_t a_rows = ta == sl::ops::trans::no ? m : k, a_cols = ta == sl::ops::trans::no ? k : m;
        const std::int64_t b_rows = tb == sl::ops::trans::no ? k : n, b_cols = tb == sl::ops::trans::no ? n : k;
        const std::int64_t lda = a_cols + pad[0], ldb = b_cols + pad[1], ldc = n + pad[2];
        const auto a = rounded<T>(rnd.normal(std::size_t(a_rows * lda)));
        const auto b = rounded<T>(rnd.normal(std::size_t(b_rows * ldb)));
        auto c_host = rounded<T>(rnd.normal(std::size_t(m * ldc)));
        const std::vector<float> c_before = c_host;
        auto da = upload(as<T>(a), f.stream), db = upload(as<T>(b), f.stream);
        auto dc = beta == 0 ? poisoned<T>(c_host.size(), f.stream) : upload(as<T>(c_host), f.stream);
        run(f.stream, ta, tb, beta, da.data(), lda, db.data(), ldb, dc.data(), ldc);
        const auto c_dev = download_float(dc, f.stream);
        sl::ops::gemm<float>(ta, tb, m, n, k, 1.5f, a.data(), lda, b.data(), ldb, beta, c_host.data(), ldc);
        std::vector<float> got, want;
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j) {
            got.push_back(c_dev[i * ldc + j]);
            want.push_back(c_host[i * ldc + j]);
          }
        // Products of sums cancel: the absolute slack scales with the result's size.
        require_close(got, want, rtol<T>, rtol<T> * max_abs(want));
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = n; j < ldc; ++j) {
            const float p = c_dev[i * ldc + j];
            if (beta == 0) REQUIRE(std::isnan(p));
            else REQUIRE(p == c_before[std::size_t(i * ldc + j)]);
          }
      }
}

}  // namespace

// ops::cuda::gemm (cuBLAS, no epilogue) against the host ops::gemm.
TEMPLATE_TEST_CASE("gemm matches the host ops::gemm for every transpose, with padded leading dimensions",
                   "[cuda][gemm]", float, sl::bfloat16, sl::half) {
  if (!have_device()) return;
  using T = TestType;
  sl::cuda::blas handle(0);
  const std::int64_t m = 37, n = 53, k = 29;
  compare_with_host<T>(m, n, k, {3, 1, 2}, [&](cudaStream_t s, trans ta, trans tb, float beta, const T* a,
                                               std::int64_t lda, const T* b, std::int64_t ldb, T* c, std::int64_t ldc) {
    oc::gemm(handle, s, ta, tb, m, n, k, 1.5f, a, lda, b, ldb, beta, c, ldc);
  });
}

// gemm_staged: the operands it copies, then the product against the host's.
TEST_CASE("gemm_staged copies the operands whose rows are not 16 bytes apart, in products of 64 and more (host)",
          "[cuda][gemm]") {
  using bf = sl::bfloat16;
  alignas(16) static bf b16[8];
  alignas(16) static float f32[8];
  const bf* p = b16;  // only its address is looked at
  CHECK_FALSE(oc::staged_for<bf>(64, 64, 64, p, 64, p, 2048, p, 50304).any());
  const auto vocab = oc::staged_for<bf>(8192, 50257, 2048, p, 2048, p, 2048, p, 50257);  // logits = h W^T
  CHECK((!vocab.a && !vocab.b && vocab.c));
  const auto dw = oc::staged_for<bf>(50257, 2048, 8192, p, 50257, p, 2048, p, 2048);  // dW = dlogits^T h
  CHECK((dw.a && !dw.b && !dw.c));
  const auto shifted = oc::staged_for<bf>(64, 64, 64, p, 64, p + 1, 64, p, 64);  // a pointer 2 bytes off
  CHECK((!shifted.a && shifted.b && !shifted.c));
  CHECK_FALSE(oc::staged_for<bf>(63, 64, 64, p, 67, p, 67, p, 67).any());  // too small to pay for the copies
  CHECK_FALSE(oc::staged_for<bf>(64, 64, 63, p, 67, p, 67, p, 67).any());
  CHECK_FALSE(oc::staged_for<float>(64, 64, 64, f32, 68, f32, 4, f32, 64).any());  // fp32: 4 elements are 16 bytes
  CHECK(oc::staged_for<float>(64, 64, 64, f32, 66, f32, 64, f32, 64).a);
}

TEMPLATE_TEST_CASE("gemm_staged equals the host ops::gemm where no operand's rows are 16 bytes apart",
                   "[cuda][gemm]", float, sl::bfloat16, sl::half) {
  if (!have_device()) return;
  using T = TestType;
  sl::cuda::blas handle(0);
  auto& alloc = sl::cuda::device_allocator(0);
  const std::int64_t m = 67, n = 65, k = 71;  // every leading dimension 2 past its columns: odd, so unaligned
  compare_with_host<T>(m, n, k, {2, 2, 2}, [&](cudaStream_t s, trans ta, trans tb, float beta, const T* a,
                                               std::int64_t lda, const T* b, std::int64_t ldb, T* c, std::int64_t ldc) {
    const auto staged = oc::staged_for<T>(m, n, k, a, lda, b, ldb, c, ldc);
    REQUIRE((staged.a && staged.b && staged.c));
    oc::gemm_staged(handle, s, alloc, ta, tb, m, n, k, 1.5f, a, lda, b, ldb, beta, c, ldc);
  });
}

TEMPLATE_TEST_CASE("strided batched gemm equals one gemm per batch element", "[cuda][gemm]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  sl::cuda::blas handle(0);
  const std::int64_t m = 17, n = 19, k = 23, batch = 3, sa = m * k + 5, sb = k * n + 7, sc = m * n + 1;
  const auto a = rounded<T>(rnd.normal(std::size_t(batch * sa))), b = rounded<T>(rnd.normal(std::size_t(batch * sb)));
  auto da = upload(as<T>(a), f.stream), db = upload(as<T>(b), f.stream);
  auto dc = poisoned<T>(std::size_t(batch * sc), f.stream);
  oc::gemm_strided_batched(handle, f.stream, sl::ops::trans::no, sl::ops::trans::yes, m, n, k, 1.0f, da.data(), k, sa,
                           db.data(), k, sb, 0.0f, dc.data(), n, sc, batch);
  const auto c = download_float(dc, f.stream);
  for (std::int64_t i = 0; i < batch; ++i) {
    std::vector<float> want(std::size_t(m * n));
    sl::ops::gemm<float>(sl::ops::trans::no, sl::ops::trans::yes, m, n, k, 1.0f, a.data() + i * sa, k,
                         b.data() + i * sb, k, 0.0f, want.data(), n);
    const std::vector<float> got(c.begin() + i * sc, c.begin() + i * sc + m * n);
    require_close(got, want, rtol<T>, rtol<T> * max_abs(want));
  }
}

TEST_CASE("gemm with k = 0 scales C by beta", "[cuda][gemm]") {
  if (!have_device()) return;
  device_fixture f;
  sl::cuda::blas handle(0);
  auto dc = upload(std::vector<float>(12, 2.0f), f.stream);
  oc::gemm<float>(handle, f.stream, sl::ops::trans::no, sl::ops::trans::no, 3, 4, 0, 1.0f, nullptr, 0, nullptr, 4,
                  0.25f, dc.data(), 4);
  REQUIRE(download(dc, f.stream) == std::vector<float>(12, 0.5f));
}

TEMPLATE_TEST_CASE("device Linear (bias epilogue, bias gradient from the weight-gradient product) equals the host's",
                   "[cuda][gemm][layers]", float, sl::bfloat16) {
  if (!have_device()) return;
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream};
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (const auto& [rows, in, out] : std::vector<std::array<std::int64_t, 3>>{{768, 33, 7}, {7, 768, 3072}, {1, 7, 33}})
    compare_linear<TestType>(rows, in, out, nn::fused_activation::none, rnd, stream);
}

TEMPLATE_TEST_CASE("device Linear with a fused ReLU or tanh-GELU equals the host Linear then the activation",
                   "[cuda][gemm][layers]", float, sl::bfloat16) {
  if (!have_device()) return;
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream};
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  // out 7: GELU's pre-activation would need padding, so that case runs unfused.
  for (const auto& [rows, in, out] :
       std::vector<std::array<std::int64_t, 3>>{{33, 768, 3072}, {768, 33, 7}, {7, 40, 40}})
    for (auto act : {nn::fused_activation::relu, nn::fused_activation::gelu_tanh})
      compare_linear<TestType>(rows, in, out, act, rnd, stream);
}

}  // namespace test_cuda_gemm
