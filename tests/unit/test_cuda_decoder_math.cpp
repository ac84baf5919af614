// The per-row and per-pair math of the decoder layers' CUDA kernels
// (ops/cuda/rms_norm.hpp, ops/cuda/rotary.hpp), compiled by g++ and run on the
// host, one lane or one index at a time, against the host layers. Both sides
// run the same float arithmetic in the same order, so they must agree bit for
// bit; as in test_cuda_math.cpp, the file compiles without contraction (before
// any include) so that GCC fuses no a * b + c differently on the two sides.
// The kernels call these same functions; tests/cuda checks them on a GPU.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/rms_norm.hpp"
#include "shardlib/nn/rotary.hpp"
#include "shardlib/nn/sdpa.hpp"
#include "shardlib/ops/cuda/rms_norm.hpp"
#include "shardlib/ops/cuda/rotary.hpp"
#include "shardlib/ops/cuda/team.hpp"

#include "support/random_inputs.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace sl = shardlib;
namespace oc = shardlib::ops::cuda;
using sl::Shape;
using sl::Tensor;
using test_support::host_tensor;
using test_support::random_inputs;

namespace {
constexpr oc::serial_team lane{};

// Equal element by element (NaN never equals itself, so a NaN fails).
void require_equal(std::span<const float> got, std::span<const float> want) {
  REQUIRE(got.size() == want.size());
  std::size_t mismatches = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]) && mismatches++ == 0) first = i;
  INFO(mismatches << " of " << got.size() << " differ; first at " << first << ": got " << got[first] << ", want "
                  << want[first]);
  REQUIRE(mismatches == 0);
}
}  // namespace

TEST_CASE("rms_norm rows equal nn::RMSNorm forward, backward and weight gradient bit for bit",
          "[cuda_math][rms_norm]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (const std::int64_t d : {1, 45, 1001}) {
    INFO("d " << d);
    const std::int64_t rows = 9;
    const float eps = 1e-5f;
    sl::nn::RMSNorm<float> norm(d, eps);
    auto w = rnd.normal(std::size_t(d)), gw = rnd.normal(std::size_t(d));
    norm.weight.value = w.data();
    norm.weight.grad = gw.data();
    const Tensor<float> x = host_tensor({rows, d}, rnd.normal(std::size_t(rows * d), 3.0f));
    const Tensor<float> dy = host_tensor({rows, d}, rnd.normal(std::size_t(rows * d)));

    const std::vector<float> gw_start = gw;
    sl::nn::context ctx;
    const Tensor<float> y_host = norm.forward(ctx, x);
    const Tensor<float> dx_host = norm.backward(ctx, dy);

    std::vector<float> y(std::size_t(rows * d)), dx(y.size()), rstd(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r)
      rstd[r] = oc::rms_norm_forward_row(lane, x.data() + r * d, w.data(), y.data() + r * d, int(d), eps);
    require_equal(y, y_host.span());
    for (std::int64_t r = 0; r < rows; ++r)
      oc::rms_norm_backward_row(lane, x.data() + r * d, dy.data() + r * d, w.data(), rstd[r], dx.data() + r * d,
                                int(d));
    require_equal(dx, dx_host.span());
    // The kernel's two stages: chunks of rows from zero, then the chunks in order
    // onto the starting gradient; one chunk of all rows is the host's sum.
    std::vector<float> g = gw_start;
    for (int i = 0; i < int(d); ++i)
      g[i] = oc::rms_norm_weight_grad(x.data(), dy.data(), rstd.data(), 0, rows, int(d), i, g[i]);
    require_equal(g, gw);
    for (int i = 0; i < int(d); ++i) {
      const float part0 = oc::rms_norm_weight_grad(x.data(), dy.data(), rstd.data(), 0, 4, int(d), i, 0.0f);
      const float part1 = oc::rms_norm_weight_grad(x.data(), dy.data(), rstd.data(), 4, rows, int(d), i, 0.0f);
      const double want = double(gw[i]) - double(gw_start[i]), got = double(part0) + double(part1);
      CHECK(std::abs(got - want) <= 1e-5 * (1 + std::abs(want)));  // another order of the same sum
    }
  }
}

TEST_CASE("rotary_pair over every index equals nn::rotary_table::apply bit for bit, strided and in place",
          "[cuda_math][rotary]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (const std::int64_t D : {2, 64, 128})
    for (const std::int64_t offset : {0, 17})
      for (const bool inverse : {false, true}) {
        INFO("head_dim " << D << ", offset " << offset << ", inverse " << inverse);
        const std::int64_t B = 2, H = 3, L = 5;
        const sl::nn::rotary_options o{.head_dim = D, .base = 10000};
        const sl::nn::rotary_table<float> at_offset(o, offset, L);
        const sl::nn::rotary_table<float> from_zero(o, 0, offset + L + 4);  // what the device uploads once

        // [B, H, L, D] contiguous, in place.
        Tensor<float> want = host_tensor({B, H, L, D}, rnd.normal(std::size_t(B * H * L * D)));
        Tensor<float> got = host_tensor(want.shape(), test_support::values(want));
        at_offset.apply(sl::nn::head_view<float>::bhsd(want), inverse);
        const auto view = sl::nn::head_view<float>::bhsd(got);
        const oc::rotary_pair<float> pair(view, view, from_zero.cosines().data(), from_zero.sines().data(), offset,
                                          inverse);
        for (std::int64_t i = 0; i < oc::rotary_pairs(view); ++i) pair(i);
        require_equal(got.span(), want.span());

        // The q part of a fused [B, L, 3 H D] projection, out of place into [B, H, L, D].
        Tensor<float> qkv = host_tensor({B, L, 3 * H * D}, rnd.normal(std::size_t(B * L * 3 * H * D)));
        const Tensor<float> before = host_tensor(qkv.shape(), test_support::values(qkv));
        Tensor<float> out(Shape{B, H, L, D});
        const auto q = sl::nn::head_view<float>::rows(qkv.data(), B, L, H, D, 3 * H * D);
        const auto out_view = sl::nn::head_view<float>::bhsd(out);
        oc::rotary_pair<float> strided(q, out_view, from_zero.cosines().data(), from_zero.sines().data(), offset,
                                       inverse);
        REQUIRE(strided.narrow);
        for (std::int64_t i = 0; i < oc::rotary_pairs(q); ++i) strided(i);
        Tensor<float> wide_out(Shape{B, H, L, D});  // the 64-bit index path, which only huge views take
        strided.y = wide_out.data();
        strided.narrow = false;
        for (std::int64_t i = 0; i < oc::rotary_pairs(q); ++i) strided(i);
        require_equal(qkv.span(), before.span());  // the input is untouched
        at_offset.apply(q, inverse);               // the host's rotation of the same heads, in place
        Tensor<float> want_out(Shape{B, H, L, D});
        for (std::int64_t n = 0; n < B; ++n)
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t l = 0; l < L; ++l)
              for (std::int64_t j = 0; j < D; ++j)
                want_out.data()[((n * H + h) * L + l) * D + j] = q.at(n, h)[l * q.row_stride + j];
        require_equal(out.span(), want_out.span());
        require_equal(wide_out.span(), want_out.span());

        // Position ids [B, L]: each token at its own table row, as rotary_table::apply_at.
        Tensor<std::int64_t> ids({B, L});
        for (std::int64_t i = 0; i < B * L; ++i) ids[i] = (7 * i + offset) % (offset + L + 4);
        Tensor<float> at_ids = host_tensor({B, H, L, D}, rnd.normal(std::size_t(B * H * L * D)));
        Tensor<float> want_at = host_tensor(at_ids.shape(), test_support::values(at_ids));
        from_zero.apply_at(sl::nn::head_view<float>::bhsd(want_at), ids, inverse);
        const auto ids_view = sl::nn::head_view<float>::bhsd(at_ids);
        const oc::rotary_pair<float> by_id(ids_view, ids_view, from_zero.cosines().data(), from_zero.sines().data(), 0,
                                           inverse, ids.data());
        for (std::int64_t i = 0; i < oc::rotary_pairs(ids_view); ++i) by_id(i);
        require_equal(at_ids.span(), want_at.span());
      }
}
