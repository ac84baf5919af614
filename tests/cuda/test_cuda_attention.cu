// The fused attention kernels (ops/cuda/flash_attention.cuh) against the host
// attention nn::sdpa_forward / sdpa_backward, computed in float64 from the same
// (rounded) inputs: small shapes covering every rule and L = 2048, fp32, bf16 and
// half (16-bit inputs through the tensor-core kernels and the CUDA-core ones),
// forward and backward; dropout masks bit for bit; backward's determinism.
//
// Tolerances are normwise (the largest error over the largest reference
// element): fp32 2e-5 at small L — sums of a few hundred fp32 products and
// exp, each rounding at 6e-8 — and 1e-4 at L = 2048 (sums of thousands); bf16
// 1e-2 and half 2e-3 — the outputs are rounded (2^-9 = 2e-3 and 2^-12 each),
// backward's D = dO . O reads the rounded O, and the tensor-core kernels round
// weights and score gradients too (their host model, test_attention_tiles,
// measured 4.7e-3 and 6.3e-4 at worst); bf16's dq gets test_support::bf16_dq_tolerance
// (causal row 0: see there). A wrong mask element, tile or rescale costs
// at least a weight of order 1 / L, above these at the small sizes, and the
// dropout mask is also compared exactly on its own.
#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/nn/sdpa.hpp>
#include <shardlib/ops/cuda/flash_attention.cuh>

#include "device_test.hpp"
#include "support/attention_cases.hpp"
#include "support/compare.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace sl = shardlib;
namespace fa = shardlib::ops::cuda;
using device_test::have_device;
using sl::nn::head_view;

using test_support::attention_case;
using test_support::view_of;

template <class U>
head_view<const U> cview(const head_view<U>& v) {
  return fa::as_const(v);
}

// Largest |got - want| over the largest |want|; NaN (a poisoned, unwritten element) counts as +inf.
test_support::max_error normwise(const std::vector<float>& got, const std::vector<double>& want) {
  return test_support::normwise_error(got, want);
}

template <class T>
void check_case(const attention_case& c, device_test::random_inputs& rnd, double tol, bool tensor_cores) {
  INFO(c.name << (tensor_cores ? "" : ", CUDA cores only") << " (seed " << rnd.seed << ")");
  const std::int64_t B = c.batch, H = c.heads, G = c.kv_heads, Lq = c.queries, Lk = c.keys, D = c.dim;
  const cudaStream_t s = sl::cuda::current_stream();
  test_support::attention_data in = test_support::make_attention_data<T>(c, rnd);
  fa::flash_options fo = in.flash;
  fo.tensor_cores = tensor_cores;
  const sl::nn::sdpa_options& o = in.options;

  // The kernels, every output poisoned first.
  auto dq_in = device_test::upload(device_test::as<T>(in.q), s), dk_in = device_test::upload(device_test::as<T>(in.k), s);
  auto dv_in = device_test::upload(device_test::as<T>(in.v), s);
  auto ddout = device_test::upload(device_test::as<T>(in.dout), s);
  sl::cuda::device_buffer<std::uint8_t> dpad;
  if (c.padding) {
    dpad = device_test::upload(std::vector<std::uint8_t>(o.key_padding_mask.data(),
                                                         o.key_padding_mask.data() + B * Lk), s);
    fo.key_padding = dpad.data();
  }
  auto out_buf = device_test::poisoned<T>(in.q.size(), s), dq_buf = device_test::poisoned<T>(in.q.size(), s);
  auto dk_buf = device_test::poisoned<T>(in.k.size(), s), dv_buf = device_test::poisoned<T>(in.v.size(), s);
  auto lse = device_test::poisoned<float>(std::size_t(B * H * Lq), s);
  const auto dview = [&](auto& buf, std::int64_t heads, std::int64_t l) {
    return view_of(buf.data(), B, heads, l, D, c.rows);
  };
  fa::flash_attention_forward<T>(cview(dview(dq_in, H, Lq)), cview(dview(dk_in, G, Lk)), cview(dview(dv_in, G, Lk)),
                                 dview(out_buf, H, Lq), lse.data(), fo, s);
  const auto backward = [&] {
    fa::flash_attention_backward<T>(cview(dview(dq_in, H, Lq)), cview(dview(dk_in, G, Lk)),
                                    cview(dview(dv_in, G, Lk)), cview(dview(out_buf, H, Lq)),
                                    cview(dview(ddout, H, Lq)), lse.data(), dview(dq_buf, H, Lq),
                                    dview(dk_buf, G, Lk), dview(dv_buf, G, Lk), fo, s);
  };
  backward();
  const std::vector<float> got_out = device_test::download_float(out_buf, s);
  CHECK(normwise(got_out, in.out) <= tol);
  const std::vector<float> got_dq = device_test::download_float(dq_buf, s);
  const std::vector<float> got_dk = device_test::download_float(dk_buf, s);
  const std::vector<float> got_dv = device_test::download_float(dv_buf, s);
  CHECK(normwise(got_dq, in.dq) <= (std::is_same_v<T, sl::bfloat16> ? test_support::bf16_dq_tolerance : tol));
  CHECK(normwise(got_dk, in.dk) <= tol);
  CHECK(normwise(got_dv, in.dv) <= tol);

  // Rows without a visible key: lse +inf, zero output; every other lse finite.
  CHECK(test_support::wrong_lse_rows(c, in, device_test::download(lse, s)) == 0);

  // Backward is deterministic: a second run gives the same bits.
  backward();
  CHECK(device_test::download_float(dq_buf, s) == got_dq);
  CHECK(device_test::download_float(dk_buf, s) == got_dk);
  CHECK(device_test::download_float(dv_buf, s) == got_dv);
}

}  // namespace

// 16-bit inputs run twice: the tensor-core kernels (where the GPU takes them), then
// the CUDA-core ones.
template <class T>
std::vector<bool> paths() {
  if (std::is_same_v<T, float>) return {false};
  return {true, false};
}
template <class T>
double tolerance(double fp32) {
  return std::is_same_v<T, float> ? fp32 : std::is_same_v<T, sl::bfloat16> ? 1e-2 : 2e-3;
}

TEMPLATE_TEST_CASE("flash attention equals nn::sdpa at small sizes, forward and backward", "[cuda][flash]", float,
                   sl::bfloat16, sl::half) {
  if (!have_device()) return;
  sl::cuda::stream st(0);
  sl::cuda::stream_scope scope(st);
  device_test::random_inputs rnd;
  for (const bool tensor_cores : paths<TestType>())
    for (const attention_case& c : test_support::small_attention_cases()) check_case<TestType>(c, rnd, tolerance<TestType>(2e-5), tensor_cores);
}

TEMPLATE_TEST_CASE("flash attention equals nn::sdpa at L = 2048", "[cuda][flash][large]", float, sl::bfloat16) {
  if (!have_device()) return;
  sl::cuda::stream st(0);
  sl::cuda::stream_scope scope(st);
  device_test::random_inputs rnd;
  const double tol = tolerance<TestType>(1e-4);
  for (const bool tensor_cores : paths<TestType>()) {
    check_case<TestType>({"L 2048, GQA 4 over 2, causal, dropout 0.1, D 64", 1, 4, 2, 2048, 2048, 64, true, 0, 0, 0.1},
                         rnd, tol, tensor_cores);
    check_case<TestType>({"L 2048, key padding, D 128, rows layout", 1, 2, 2, 2048, 2048, 128, false, 0, 1, -1, true},
                         rnd, tol, tensor_cores);
  }
}

TEST_CASE("flash attention takes the tensor cores for 16-bit inputs up to head_dim 128 on sm_80 and later",
          "[cuda][flash]") {
  if (!have_device()) return;
  int device = 0, major = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess);
  const fa::flash_options on{}, off{.tensor_cores = false};
  // The kernels read wmma's accumulators element by element, where mma.sync puts them, and
  // multiply by ldmatrix and mma.sync (flash_tensor_products.cuh): if this GPU lays them out
  // otherwise or a product is wrong, the CUDA cores take over.
  if (major >= 8) {
    CHECK(fa::detail::tensor_tiles_hold<sl::bfloat16>());
    CHECK(fa::detail::tensor_tiles_hold<sl::half>());
  }
  CHECK(fa::flash_uses_tensor_cores<sl::bfloat16>(64, on) == (major >= 8));
  CHECK(fa::flash_uses_tensor_cores<sl::half>(128, on) == (major >= 8));
  CHECK_FALSE(fa::flash_uses_tensor_cores<sl::bfloat16>(64, off));
  CHECK_FALSE(fa::flash_uses_tensor_cores<sl::bfloat16>(256, on));
  CHECK_FALSE(fa::flash_uses_tensor_cores<sl::bfloat16>(36, on));
  CHECK_FALSE(fa::flash_uses_tensor_cores<float>(64, on));
  CHECK_FALSE(fa::flash_uses_tensor_cores<sl::bfloat16>(64, {.scale = -0.125f}));  // the scale must be positive
  CHECK_FALSE(fa::flash_uses_tensor_cores<sl::bfloat16>(64, {.scale = NAN}));
  // and only for views whose rows start 16-byte aligned
  namespace ft = fa::detail::tensor;
  alignas(16) static sl::bfloat16 storage[64];
  using rows = fa::detail::fused::rows<const sl::bfloat16>;
  CHECK(ft::whole_vectors(rows{storage, 64, 32, 8}));
  CHECK_FALSE(ft::whole_vectors(rows{storage + 1, 64, 32, 8}));  // the data 2 bytes past a 16-byte boundary
  CHECK_FALSE(ft::whole_vectors(rows{storage, 64, 32, 12}));     // rows 24 bytes apart
  CHECK_FALSE(ft::whole_vectors(rows{storage, 64, 36, 8}));      // heads 72 bytes apart
}

// The masks forward and dk/dv draw, read back exactly (test_support::mask_probe_data): L 72
// gives a second key tile and keys past the last whole group, Lq 40 queries past the last.
TEMPLATE_TEST_CASE("flash attention draws nn::sdpa's dropout mask bit for bit", "[cuda][flash]", float, sl::bfloat16) {
  if (!have_device()) return;
  sl::cuda::stream st(0);
  sl::cuda::stream_scope scope(st);
  const cudaStream_t s = st;
  const attention_case c = test_support::mask_probe_case(2, 3, 40, 72);
  const std::int64_t B = c.batch, H = c.heads, Lq = c.queries, L = c.keys;
  const test_support::attention_data in = test_support::mask_probe_data(c, 0.3, sl::counter_rng(99, 3));
  auto q = device_test::upload(device_test::as<TestType>(in.q), s), kv = device_test::upload(device_test::as<TestType>(in.k), s);
  auto dout = device_test::upload(device_test::as<TestType>(in.dout), s);
  auto lse = device_test::poisoned<float>(std::size_t(B * H * Lq), s);
  const auto rows = [&](auto& buf, std::int64_t l) { return view_of(buf.data(), B, H, l, L, false); };
  for (const bool tensor_cores : paths<TestType>()) {  // the tensor cores' lanes draw a group of 8 weights at once
    INFO("tensor cores " << tensor_cores);
    fa::flash_options fo = in.flash;
    fo.tensor_cores = tensor_cores;
    auto out = device_test::poisoned<TestType>(in.q.size(), s), dq = device_test::poisoned<TestType>(in.q.size(), s);
    auto dk = device_test::poisoned<TestType>(in.k.size(), s), dv = device_test::poisoned<TestType>(in.k.size(), s);
    fa::flash_attention_forward<TestType>(cview(rows(q, Lq)), cview(rows(kv, L)), cview(rows(kv, L)), rows(out, Lq),
                                          lse.data(), fo, s);
    fa::flash_attention_backward<TestType>(cview(rows(q, Lq)), cview(rows(kv, L)), cview(rows(kv, L)),
                                           cview(rows(out, Lq)), cview(rows(dout, Lq)), lse.data(), rows(dq, Lq),
                                           rows(dk, L), rows(dv, L), fo, s);
    std::int64_t dropped = 0;
    CHECK(test_support::mask_mismatches(c, in, device_test::download_float(out, s), device_test::download_float(dv, s),
                                        dropped) == 0);
    CHECK(dropped > B * H * Lq * L / 5);  // p 0.3: the mask does drop
  }
}

// Checked before anything reaches the device: runs without a GPU too.
TEST_CASE("flash attention rejects shapes it cannot take", "[cuda][flash]") {
  const fa::flash_options fo{};
  const head_view<const float> q{nullptr, 1, 3, 4, 16, 192, 64, 16}, k{nullptr, 1, 2, 4, 16, 128, 64, 16};
  const head_view<float> out{nullptr, 1, 3, 4, 16, 192, 64, 16};
  CHECK_THROWS_AS(fa::flash_attention_forward<float>(q, k, k, out, nullptr, fo, nullptr), sl::shape_error);
  const head_view<const float> big{nullptr, 1, 1, 4, 300, 1200, 1200, 300};
  const head_view<float> big_out{nullptr, 1, 1, 4, 300, 1200, 1200, 300};
  CHECK_THROWS_AS(fa::flash_attention_forward<float>(big, big, big, big_out, nullptr, fo, nullptr), sl::shape_error);
}
