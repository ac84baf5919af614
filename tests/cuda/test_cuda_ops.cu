// Device tests: each CUDA op against the host op or layer on fresh random
// inputs, outputs poisoned with NaN first so that an element a kernel skips
// fails the comparison. fp32 within 1e-5 relative, bf16/fp16 within 1e-2
// (against the host in float on the same rounded inputs). The same file runs
// on the CPU as tests/emulated/test_emulated_ops.cpp: no cuBLAS here.
#include <shardlib/cuda/caching_allocator.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/ops/cuda/adam.cuh>
#include <shardlib/ops/cuda/cross_entropy.cuh>
#include <shardlib/ops/cuda/elementwise.cuh>
#include <shardlib/ops/cuda/embedding.cuh>
#include <shardlib/ops/cuda/index_report.hpp>
#include <shardlib/ops/cuda/launch.cuh>
#include <shardlib/ops/cuda/layer_norm.cuh>
#include <shardlib/ops/cuda/reduce.cuh>
#include <shardlib/ops/cuda/softmax.cuh>
#include <shardlib/nn/context.hpp>
#include <shardlib/nn/dropout.hpp>
#include <shardlib/nn/embedding.hpp>
#include <shardlib/nn/layer_norm.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/clip.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <numeric>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "device_test.hpp"

namespace test_cuda_ops {

namespace sl = shardlib;
namespace oc = shardlib::ops::cuda;
using namespace device_test;
using sl::Shape;
using sl::Tensor;

namespace {

// A stream and the allocator of device 0 for one test.
struct device_fixture {
  sl::cuda::stream stream{0};
  sl::cuda::caching_allocator& alloc = sl::cuda::device_allocator(0);
};

}  // namespace

// One block per row: 2^31 rows or more would launch rows mod 2^32 blocks, or fail at the
// launch, where a shape_error naming the kernel is raised before anything runs.
TEST_CASE("row kernels refuse more rows than a grid holds", "[cuda][rows]") {
  if (!have_device()) return;
  device_fixture f;
  const std::int64_t rows = std::int64_t(1) << 31;
  float* none = nullptr;
  CHECK_THROWS_WITH(oc::layer_norm_forward(none, none, none, none, nullptr, rows, 8, 1e-5f, f.stream),
                    Catch::Contains("layer_norm_forward: 2147483648 rows of one block each are more than a grid holds"));
  CHECK_THROWS_WITH(oc::masked_softmax(none, nullptr, rows, 8, 1, f.stream),
                    Catch::Contains("masked_softmax: 2147483648 rows"));
  CHECK_THROWS_WITH(oc::softmax_backward(none, none, rows, 8, f.stream),
                    Catch::Contains("softmax_backward: 2147483648 rows"));
}

TEMPLATE_TEST_CASE("layer_norm forward and backward match nn::LayerNorm", "[cuda][layer_norm]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (std::int64_t d : {45, 64, 768}) {  // below a warp's multiple, one row per thread, several per thread
    INFO("d " << d);
    const std::int64_t rows = 70;  // two chunks of the parameter-gradient sum
    auto xv = rnd.normal(std::size_t(rows * d), 2.0f);
    for (auto& x : xv) x += 3.0f;
    const auto x = rounded<T>(xv), dy = rounded<T>(rnd.normal(std::size_t(rows * d)));
    const auto w = rounded<T>(rnd.normal(std::size_t(d))), b = rounded<T>(rnd.normal(std::size_t(d)));
    const auto gw = rounded<T>(rnd.normal(std::size_t(d))), gb = rounded<T>(rnd.normal(std::size_t(d)));

    sl::nn::LayerNorm<float> ln(d);
    std::vector<float> hw = w, hb = b, hgw = gw, hgb = gb;
    ln.weight.value = hw.data();
    ln.bias.value = hb.data();
    ln.weight.grad = hgw.data();
    ln.bias.grad = hgb.data();
    sl::nn::context ctx;
    const auto y_host = values(ln.forward(ctx, host_tensor({rows, d}, x)));
    const auto dx_host = values(ln.backward(ctx, host_tensor({rows, d}, dy)));

    auto dxv = upload(as<T>(x), f.stream), ddy = upload(as<T>(dy), f.stream);
    auto dw = upload(as<T>(w), f.stream), db = upload(as<T>(b), f.stream);
    auto dgw = upload(as<T>(gw), f.stream), dgb = upload(as<T>(gb), f.stream);
    auto y = poisoned<T>(std::size_t(rows * d), f.stream), dx = poisoned<T>(std::size_t(rows * d), f.stream);
    auto stats = poisoned<oc::row_stats>(std::size_t(rows), f.stream);
    oc::layer_norm_forward(dxv.data(), dw.data(), db.data(), y.data(), stats.data(), rows, int(d), 1e-5f, f.stream);
    oc::layer_norm_backward(dxv.data(), ddy.data(), dw.data(), stats.data(), dx.data(), dgw.data(), dgb.data(), rows,
                            int(d), f.stream, f.alloc);
    require_close(download_float(y, f.stream), y_host, rtol<T>, 10 * rtol<T>);
    require_close(download_float(dx, f.stream), dx_host, rtol<T>, 10 * rtol<T> * max_abs(dx_host));
    require_close(download_float(dgw, f.stream), hgw, rtol<T>, 10 * rtol<T> * max_abs(hgw));
    require_close(download_float(dgb, f.stream), hgb, rtol<T>, 10 * rtol<T> * max_abs(hgb));
  }
}

TEMPLATE_TEST_CASE("masked softmax and its backward match the host rows", "[cuda][softmax]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t N = 3, H = 2, L = 77, rows = N * H * L;
  const auto scores = rounded<T>(rnd.normal(std::size_t(rows * L), 3.0f)), dp = rounded<T>(rnd.normal(std::size_t(rows * L)));
  std::vector<std::uint8_t> mask(std::size_t(N * L), 0);
  for (std::int64_t j = 0; j < L; j += 4) mask[std::size_t(j)] = 1;      // sample 0: every fourth key
  std::fill(mask.begin() + 2 * L, mask.end(), std::uint8_t(1));  // sample 2: all keys masked

  // The host: the same row functions with one lane, in float.
  std::vector<float> p_host = scores, dp_host = dp;
  for (std::int64_t r = 0; r < rows; ++r) {
    oc::masked_softmax_row(oc::serial_team{}, p_host.data() + r * L, mask.data() + (r / (H * L)) * L, int(L));
    oc::softmax_backward_row(oc::serial_team{}, p_host.data() + r * L, dp_host.data() + r * L, int(L));
  }
  auto dsc = upload(as<T>(scores), f.stream), ddp = upload(as<T>(dp), f.stream);
  auto dmask = upload(mask, f.stream);
  oc::masked_softmax(dsc.data(), dmask.data(), rows, int(L), H * L, f.stream);
  oc::softmax_backward(dsc.data(), ddp.data(), rows, int(L), f.stream);
  const auto p = download_float(dsc, f.stream);
  require_close(p, rounded<T>(p_host), rtol<T>, 1e-6);
  require_close(download_float(ddp, f.stream), rounded<T>(dp_host), rtol<T>, 10 * rtol<T> * max_abs(dp_host));
  for (std::int64_t i = 2 * H * L * L; i < rows * L; ++i) REQUIRE(p[std::size_t(i)] == 0.0f);  // all masked: zeros
}

TEMPLATE_TEST_CASE("cross_entropy matches nn::cross_entropy_loss and reports bad targets", "[cuda][cross_entropy]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (std::int64_t classes : {10, 1000}) {
    const std::int64_t rows = 37;
    const auto z = rounded<T>(rnd.normal(std::size_t(rows * classes), 2.0f));
    std::vector<std::int64_t> y(rows);
    for (auto& t : y) t = rnd.integer(0, classes - 1);
    y[3] = -100;
    Tensor<std::int64_t> targets(Shape{rows});
    std::copy(y.begin(), y.end(), targets.data());
    for (const sl::nn::cross_entropy_options& o :
         {sl::nn::cross_entropy_options{}, sl::nn::cross_entropy_options{.label_smoothing = 0.1},
          sl::nn::cross_entropy_options{.reduction = sl::nn::loss_reduction::sum}}) {
      INFO("classes " << classes << ", smoothing " << o.label_smoothing);
      const auto want = sl::nn::cross_entropy_loss{o}(host_tensor({rows, classes}, z), targets);
      auto dz = upload(as<T>(z), f.stream);
      auto dy = upload(y, f.stream);
      auto grad = poisoned<T>(std::size_t(rows * classes), f.stream);
      auto loss = poisoned<float>(1, f.stream);
      oc::index_report bad(f.stream);
      oc::cross_entropy(dz.data(), dy.data(), rows, int(classes), o, grad.data(), loss.data(), bad, f.stream, f.alloc);
      REQUIRE_FALSE(bad.read(f.stream).has_value());
      CHECK(download(loss, f.stream)[0] == Approx(want.loss).epsilon(rtol<T>));
      const auto g = values(want.grad);
      require_close(download_float(grad, f.stream), g, rtol<T>, rtol<T> * max_abs(g));
    }
  }
  SECTION("a target out of range is reported by row") {
    std::vector<std::int64_t> y{0, 1, 7, 2, 9};  // classes 4: rows 2 and 4 are bad, the first reported is 2
    auto dz = upload(as<T>(rnd.normal(20)), f.stream);
    auto dy = upload(y, f.stream);
    auto grad = poisoned<T>(20, f.stream);
    auto loss = poisoned<float>(1, f.stream);
    oc::index_report bad(f.stream);
    oc::cross_entropy(dz.data(), dy.data(), 5, 4, {}, grad.data(), loss.data(), bad, f.stream, f.alloc);
    REQUIRE(bad.read(f.stream) == std::optional<std::int64_t>(2));
  }
}

TEST_CASE("embedding forward and backward equal nn::Embedding bit for bit", "[cuda][embedding]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t num = 50, dim = 96, n = 600;  // many repeated ids
  auto w = rnd.normal(std::size_t(num * dim)), g = rnd.normal(std::size_t(num * dim));
  std::vector<std::int64_t> ids(n);
  for (auto& id : ids) id = rnd.integer(0, num - 1);
  const auto dyv = rnd.normal(std::size_t(n * dim));

  sl::nn::Embedding<float> emb(num, dim);
  std::vector<float> hg = g;
  emb.weight.value = w.data();
  emb.weight.grad = hg.data();
  Tensor<std::int64_t> tids(Shape{n});
  std::copy(ids.begin(), ids.end(), tids.data());
  sl::nn::context ctx;
  const auto y_host = values(emb.forward(ctx, tids));
  emb.backward(ctx, host_tensor({n, dim}, dyv));

  auto dw = upload(w, f.stream), dg = upload(g, f.stream), ddy = upload(dyv, f.stream);
  auto did = upload(ids, f.stream);
  auto y = poisoned<float>(std::size_t(n * dim), f.stream);
  oc::index_report bad(f.stream);
  oc::embedding_forward(dw.data(), num, int(dim), did.data(), n, y.data(), bad, f.stream);
  oc::embedding_backward(did.data(), n, ddy.data(), dg.data(), num, int(dim), f.stream, f.alloc);
  REQUIRE_FALSE(bad.read(f.stream).has_value());
  REQUIRE(download(y, f.stream) == y_host);
  REQUIRE(download(dg, f.stream) == hg);  // same order of additions: identical bits

  SECTION("an id out of range is reported by position") {
    ids[17] = num;
    ids[40] = -1;
    auto bad_ids = upload(ids, f.stream);
    oc::index_report report(f.stream);
    oc::embedding_forward(dw.data(), num, int(dim), bad_ids.data(), n, y.data(), report, f.stream);
    REQUIRE(report.read(f.stream) == std::optional<std::int64_t>(17));
  }
}

TEMPLATE_TEST_CASE("GELU and ReLU forward and backward match the host functions", "[cuda][activation]", float,
                   sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::size_t n = 100003;  // not a multiple of the block
  const auto x = rounded<T>(rnd.normal(n, 3.0f)), dy = rounded<T>(rnd.normal(n));
  auto dx_in = upload(as<T>(x), f.stream), ddy = upload(as<T>(dy), f.stream);
  auto out = poisoned<T>(n, f.stream);
  const std::span<const T> xs(dx_in.span()), dys(ddy.span());
  auto check = [&](auto host_fn) {
    std::vector<float> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = float(T(host_fn(x[i], dy[i])));
    // erff on the device and in glibc differ by ulps; where 1 + erf(x) cancels
    // that is absolute, not relative.
    require_close(download_float(out, f.stream), want, rtol<T>, std::is_same_v<T, float> ? 1e-5 : 1e-2);
    sl::cuda::fill_bytes_async(out.span(), 0xFF, f.stream);
  };
  for (auto a : {sl::nn::gelu_approx::none, sl::nn::gelu_approx::tanh}) {
    oc::gelu(xs, out.span(), a, f.stream);
    check([&](float v, float) { return sl::nn::gelu(v, a); });
    oc::gelu_backward(xs, dys, out.span(), a, f.stream);
    check([&](float v, float g) { return sl::nn::gelu_backward(v, g, a); });
  }
  oc::relu(xs, out.span(), f.stream);
  check([](float v, float) { return sl::nn::relu(v); });
  oc::relu_backward(xs, dys, out.span(), f.stream);
  check([](float v, float g) { return sl::nn::relu_backward(v, g); });
}

namespace {
bool is_nan16(std::uint16_t b, std::uint16_t exp_mask, std::uint16_t man_mask) {
  return (b & exp_mask) == exp_mask && (b & man_mask) != 0;
}

// Element i of the batch starting at `first`: the float with bit pattern first + i.
__global__ void narrow_patterns_kernel(std::uint64_t first, std::int64_t n, std::uint16_t* bf16, std::uint16_t* f16) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float f = __uint_as_float(std::uint32_t(first + std::uint64_t(i)));
    bf16[i] = sl::bfloat16(f).bits;
    f16[i] = sl::half(f).bits;
  }
}

struct narrow_tally {
  std::uint64_t mismatches = 0, first_mismatch = 0;
  std::uint64_t nan_not_nan = 0;          // a NaN input whose device result is not a NaN
  std::uint64_t nan_other_payload = 0;    // a NaN result other than the host's canonical 0x7FFF
  void add(const narrow_tally& o) {
    if (o.mismatches && !mismatches) first_mismatch = o.first_mismatch;
    mismatches += o.mismatches;
    nan_not_nan += o.nan_not_nan;
    nan_other_payload += o.nan_other_payload;
  }
};
}  // namespace

// The device's float -> bf16/fp16 conversions are the hardware's cvt.rn
// instructions, the host's the arithmetic in core/element.hpp: every one of
// the 2^32 float patterns must give the same bits. NaN inputs: both sides
// must give a NaN; the host's is always 0x7FFF, and a device NaN with another
// payload is counted and printed (not an error: no NaN payload is promised).
TEST_CASE("every float narrows to the same bf16 and fp16 bits on the device as on the host", "[cuda][element]") {
  if (!have_device()) return;
  device_fixture f;
  constexpr std::int64_t batch = std::int64_t(1) << 28;
  auto bf = poisoned<std::uint16_t>(std::size_t(batch), f.stream), hf = poisoned<std::uint16_t>(std::size_t(batch), f.stream);
  std::vector<std::uint16_t> got_bf(static_cast<std::size_t>(batch)), got_hf(static_cast<std::size_t>(batch));
  const unsigned workers = std::max(1U, std::thread::hardware_concurrency());
  narrow_tally bf_total, hf_total;
  for (std::uint64_t first = 0; first < (std::uint64_t(1) << 32); first += std::uint64_t(batch)) {
    oc::launch_kernel("narrow_patterns_kernel", narrow_patterns_kernel, 4096, 256, 0, f.stream, first, batch, bf.data(),
                      hf.data());
    sl::cuda::copy_async(std::span<std::uint16_t>(got_bf), std::span<const std::uint16_t>(bf.span()), f.stream);
    sl::cuda::copy_async(std::span<std::uint16_t>(got_hf), std::span<const std::uint16_t>(hf.span()), f.stream);
    f.stream.synchronize();
    std::vector<narrow_tally> bf_part(workers), hf_part(workers);
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < workers; ++w)
      pool.emplace_back([&, w] {
        for (std::int64_t i = w; i < batch; i += workers) {
          const std::uint32_t bits = std::uint32_t(first + std::uint64_t(i));
          float x;
          std::memcpy(&x, &bits, 4);
          const std::uint16_t want_bf = sl::detail::float_to_bf16_bits(x), want_hf = sl::detail::float_to_half_bits(x);
          const std::uint16_t gb = got_bf[std::size_t(i)], gh = got_hf[std::size_t(i)];
          if (std::isnan(x)) {
            bf_part[w].nan_not_nan += !is_nan16(gb, 0x7F80, 0x007F);
            hf_part[w].nan_not_nan += !is_nan16(gh, 0x7C00, 0x03FF);
            bf_part[w].nan_other_payload += gb != want_bf;
            hf_part[w].nan_other_payload += gh != want_hf;
            continue;
          }
          if (gb != want_bf && !bf_part[w].mismatches++) bf_part[w].first_mismatch = bits;
          if (gh != want_hf && !hf_part[w].mismatches++) hf_part[w].first_mismatch = bits;
        }
      });
    for (auto& t : pool) t.join();
    for (unsigned w = 0; w < workers; ++w) {
      bf_total.add(bf_part[w]);
      hf_total.add(hf_part[w]);
    }
  }
  std::cout << "float -> bf16 on the device: " << bf_total.mismatches << " mismatches, " << bf_total.nan_other_payload
            << " NaNs with another payload than 0x7FFF\nfloat -> fp16 on the device: " << hf_total.mismatches
            << " mismatches, " << hf_total.nan_other_payload << " NaNs with another payload than 0x7FFF\n";
  INFO("first bf16 mismatch at float bits 0x" << std::hex << bf_total.first_mismatch);
  CHECK(bf_total.mismatches == 0);
  INFO("first fp16 mismatch at float bits 0x" << std::hex << hf_total.first_mismatch);
  CHECK(hf_total.mismatches == 0);
  CHECK(bf_total.nan_not_nan == 0);
  CHECK(hf_total.nan_not_nan == 0);
}

namespace {
// Poison bytes of a buffer (0xFF) as the element type sees them.
template <class T>
T poison_value() {
  T v;
  std::memset(&v, 0xFF, sizeof(T));
  return v;
}

// Runs an element-wise op on the device over n outputs starting `out_off`
// elements into a poisoned buffer (its inputs start `in_off` elements into
// theirs: launch takes the offsets) and checks every output's bits against
// want(i), and that the elements before the offset are still the poison.
template <class Out, class Launch, class Want>
void check_map(const char* what, std::size_t n, std::size_t out_off, device_fixture& f, Launch launch, Want want) {
  INFO(what << ": n " << n << ", output offset " << out_off);
  auto out = poisoned<Out>(n + out_off, f.stream);
  launch(out.span().subspan(out_off));
  const auto got = download(out, f.stream);
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Out w = want(i);
    if (std::memcmp(&got[out_off + i], &w, sizeof(Out)) != 0 && !bad++) first_bad = i;
  }
  INFO(bad << " wrong elements, the first at " << first_bad);
  CHECK(bad == 0);
  const Out poison = poison_value<Out>();
  for (std::size_t i = 0; i < out_off; ++i) CHECK(std::memcmp(&got[i], &poison, sizeof(Out)) == 0);
}
}  // namespace

// The element-wise kernels move 16 bytes per access on aligned bodies and one
// element at a time on unaligned heads and tails: every path must give the
// host's bits. Sizes: above 2^24 (each thread loops several times), below one
// vector, and odd remainders; offsets: aligned, one element in for input and
// output (a head, then vectors), and different for input and output (no
// common alignment: all one by one).
TEST_CASE("element-wise kernels give the host's bits on every vector path", "[cuda][elementwise]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::size_t sizes[] = {(std::size_t(1) << 24) + 3, 1001, 5};
  const std::pair<std::size_t, std::size_t> offsets[] = {{0, 0}, {1, 1}, {3, 3}, {1, 0}, {0, 2}};
  const sl::counter_rng stream = sl::nn::context({.training = true, .seed = rnd.seed}).random_stream();
  for (std::size_t n : sizes) {
    auto xv = rnd.normal(n + 3, 3.0f);
    auto yv = rnd.normal(n + 3);
    xv[0] = INFINITY;  // a few specials among the inputs
    xv[std::min<std::size_t>(4, n + 2)] = -0.0f;
    xv[n + 2] = 1e-40f;
    const auto xb = as<sl::bfloat16>(xv), yb = as<sl::bfloat16>(yv);
    auto dx = upload(xv, f.stream), dy = upload(yv, f.stream);
    auto dxb = upload(xb, f.stream), dyb = upload(yb, f.stream);
    for (auto [in_off, out_off] : offsets) {
      INFO("input offset " << in_off);
      const std::span<const float> x = std::span<const float>(dx.span()).subspan(in_off, n);
      const std::span<const float> y = std::span<const float>(dy.span()).subspan(in_off, n);
      const std::span<const sl::bfloat16> x16 = std::span<const sl::bfloat16>(dxb.span()).subspan(in_off, n);
      const std::span<const sl::bfloat16> y16 = std::span<const sl::bfloat16>(dyb.span()).subspan(in_off, n);
      check_map<sl::bfloat16>("cast float -> bf16", n, out_off, f, [&](auto out) { oc::cast(x, out, f.stream); },
                              [&](std::size_t i) { return sl::element_cast<sl::bfloat16>(xv[in_off + i]); });
      check_map<float>("cast bf16 -> float", n, out_off, f, [&](auto out) { oc::cast(x16, out, f.stream); },
                       [&](std::size_t i) { return float(xb[in_off + i]); });
      check_map<sl::bfloat16>("relu bf16", n, out_off, f, [&](auto out) { oc::relu(x16, out, f.stream); },
                              [&](std::size_t i) { return sl::bfloat16(sl::nn::relu(float(xb[in_off + i]))); });
      check_map<sl::bfloat16>(
          "relu_backward bf16", n, out_off, f, [&](auto out) { oc::relu_backward(x16, y16, out, f.stream); },
          [&](std::size_t i) {
            return sl::bfloat16(sl::nn::relu_backward(float(xb[in_off + i]), float(yb[in_off + i])));
          });
      check_map<float>("add float", n, out_off, f, [&](auto out) { oc::add(x, y, out, f.stream); },
                       [&](std::size_t i) { return xv[in_off + i] + yv[in_off + i]; });
      check_map<sl::bfloat16>("add bf16", n, out_off, f, [&](auto out) { oc::add(x16, y16, out, f.stream); },
                              [&](std::size_t i) { return sl::bfloat16(float(xb[in_off + i]) + float(yb[in_off + i])); });
      const sl::bfloat16 scale = oc::dropout_scale<sl::bfloat16>(0.25);
      check_map<sl::bfloat16>(
          "dropout bf16", n, out_off, f, [&](auto out) { oc::dropout(x16, out, stream, 11, 0.25, f.stream); },
          [&](std::size_t i) { return oc::dropout_element(xb[in_off + i], stream, 11 + i, 0.25f, scale); });
    }
    for (std::size_t out_off : {0, 1, 5}) {
      check_map<sl::bfloat16>("fill bf16", n, out_off, f,
                              [&](auto out) { oc::fill(out, sl::bfloat16(1.5f), f.stream); },
                              [](std::size_t) { return sl::bfloat16(1.5f); });
      std::size_t width = 1;  // n's largest divisor up to 64: whole rows
      for (std::size_t w = 64; w > 1 && width == 1; --w)
        if (n % w == 0) width = w;
      check_map<float>("repeat_rows float", n, out_off, f,
                       [&](auto out) { oc::repeat_rows(std::span<const float>(dx.span()).first(width), out, f.stream); },
                       [&](std::size_t i) { return xv[i % width]; });
    }
  }
}

TEST_CASE("dropout draws nn::Dropout's mask bit for bit", "[cuda][dropout]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t n = 50001;
  const auto x = rnd.normal(std::size_t(n));
  for (double p : {0.1, 0.5, 1.0}) {
    sl::nn::Dropout<float> drop(p);
    sl::nn::context ctx({.training = true, .seed = rnd.seed});
    const auto want = values(drop.forward(ctx, host_tensor({n}, x)));
    const sl::counter_rng stream = sl::nn::context({.training = true, .seed = rnd.seed}).random_stream();
    auto dx = upload(x, f.stream);
    auto y = poisoned<float>(std::size_t(n), f.stream);
    oc::dropout(std::span<const float>(dx.span()), y.span(), stream, 0, p, f.stream);
    INFO("p " << p);
    REQUIRE(download(y, f.stream) == want);
  }
}

TEST_CASE("sum_squares and count_nonfinite reduce whole buffers", "[cuda][reduce]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  auto g = rnd.normal(1000003);
  const double want = sl::optim::grad_norm_squared(std::span<const float>(g));
  auto dg = upload(g, f.stream);
  auto out = poisoned<double>(1, f.stream);
  oc::sum_squares(std::span<const float>(dg.span()), out.data(), f.stream, f.alloc);
  CHECK(download(out, f.stream)[0] == Approx(want).epsilon(1e-12));

  g[5] = INFINITY;
  g[77] = NAN;
  g[1000000] = -INFINITY;
  auto bad = upload(as<sl::bfloat16>(g), f.stream);
  auto count = poisoned<unsigned long long>(1, f.stream);
  oc::count_nonfinite(std::span<const sl::bfloat16>(bad.span()), count.data(), f.stream, f.alloc);
  REQUIRE(download(count, f.stream)[0] == 3);
}

namespace {
// Five steps of `opt` on the host and on the device from the same state, the
// device over params starting `offset` elements into its buffer (offset 1
// takes the unaligned, one-by-one path).
template <class G, class Opt>
void check_fused_adam(const Opt& opt, std::size_t offset, device_fixture& f, random_inputs& rnd) {
  const std::size_t n = 10007;  // not a multiple of 4: the vector path has a tail
  auto p_host = rnd.normal(n);
  auto state = opt.make_state(n);
  std::vector<float> padded(offset, 0.0f);
  padded.insert(padded.end(), p_host.begin(), p_host.end());
  auto dp = upload(padded, f.stream);
  auto dstate = oc::make_adam_state(opt, n, f.stream, f.alloc);
  auto copy = poisoned<sl::bfloat16>(n + offset, f.stream);
  const std::span<float> params = dp.span().subspan(offset);
  for (int step = 0; step < 5; ++step) {
    const auto g = as<G>(rnd.normal(n, 0.1f));
    opt.step(std::span<float>(p_host), std::span<const G>(g), state);
    std::vector<G> padded_g(offset, G(0.0f));
    padded_g.insert(padded_g.end(), g.begin(), g.end());
    auto dg = upload(padded_g, f.stream);
    oc::fused_adam_step(opt, dstate, params, std::span<const G>(dg.span()).subspan(offset),
                        copy.span().subspan(offset), f.stream);
  }
  REQUIRE(dstate.step == state.step);
  const auto p_dev = download(dp, f.stream);
  const std::vector<float> got(p_dev.begin() + std::ptrdiff_t(offset), p_dev.end());
  // nvcc fuses multiply-adds where g++ may not: a few ulps of each value's
  // operands (g ~ 0.1: m ~ 1e-2, v ~ 1e-5) as absolute slack.
  require_close(got, p_host, 1e-5, 1e-7);
  require_close(download(dstate.exp_avg, f.stream), {state.exp_avg.data(), state.exp_avg.data() + n}, 1e-5, 1e-8);
  require_close(download(dstate.exp_avg_sq, f.stream), {state.exp_avg_sq.data(), state.exp_avg_sq.data() + n}, 1e-5,
                1e-11);
  const auto c = widened(download(copy, f.stream));
  require_close({c.begin() + std::ptrdiff_t(offset), c.end()}, rounded<sl::bfloat16>(p_host), 1e-2, 0);
}
}  // namespace

TEST_CASE("fused Adam/AdamW matches the host optimizer, with the bf16 copy written in the same pass", "[cuda][adam]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (std::size_t offset : {0, 1}) {
    INFO("offset " << offset);
    check_fused_adam<float>(sl::optim::Adam{{.lr = 1e-2}}, offset, f, rnd);
    check_fused_adam<sl::bfloat16>(sl::optim::AdamW{{.lr = 1e-2, .weight_decay = 0.1}}, offset, f, rnd);
    check_fused_adam<sl::half>(sl::optim::Adam{{.lr = 1e-3, .weight_decay = 0.01, .amsgrad = true}}, offset, f, rnd);
  }
}

namespace {
// d[i] = k / 64 with k in [-127, 127] from a hash of i: exact in bf16 and
// float, and so are the sums of up to 2^17 of them in float, whatever the
// order: the kernel's sums must equal the float64 reference exactly.
__host__ __device__ inline float grid_value(std::uint64_t i) {
  i ^= i >> 33;
  i *= 0xff51afd7ed558ccdULL;
  i ^= i >> 33;
  return float(int(i % 255) - 127) / 64.0f;
}
template <class T>
struct grid_value_of {
  __device__ T operator()(std::int64_t i) const { return T(grid_value(std::uint64_t(i))); }
};

// Column sums of the grid values in float64, rows split over threads.
std::vector<double> grid_column_sums(std::int64_t rows, std::int64_t cols) {
  const unsigned workers = std::max(1U, std::thread::hardware_concurrency());
  std::vector<std::vector<double>> part(workers, std::vector<double>(std::size_t(cols), 0.0));
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (std::int64_t r = w; r < rows; r += workers)
        for (std::int64_t c = 0; c < cols; ++c) part[w][std::size_t(c)] += grid_value(std::uint64_t(r * cols + c));
    });
  for (auto& t : pool) t.join();
  for (unsigned w = 1; w < workers; ++w)
    for (std::size_t c = 0; c < std::size_t(cols); ++c) part[0][c] += part[w][c];
  return part[0];
}

// g[c] + the column sums of grid values [rows, cols] on the device, against the float64 sums
// rounded once to T: the same bits.
template <class T>
void check_column_sums(device_fixture& f, std::int64_t rows, std::int64_t cols) {
  INFO("rows " << rows << ", cols " << cols);
  sl::cuda::device_buffer<T> d(std::size_t(rows * cols), sl::category::activations, f.stream, f.alloc);
  oc::map_elements(rows * cols, grid_value_of<T>{}, f.stream, "grid values", d.data());
  std::vector<T> g0(static_cast<std::size_t>(cols));
  for (std::int64_t c = 0; c < cols; ++c) g0[std::size_t(c)] = T(grid_value(std::uint64_t(c) + 12345));
  auto g = upload(g0, f.stream);
  oc::add_column_sums(d.data(), rows, cols, g.data(), f.stream, f.alloc);
  const auto got = download(g, f.stream);
  const auto sums = grid_column_sums(rows, cols);
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t c = 0; c < std::size_t(cols); ++c) {
    const T want = T(double(float(g0[c])) + sums[c]);  // exact in float: one rounding to T on both sides
    if (std::memcmp(&got[c], &want, sizeof(T)) != 0 && !bad++) first_bad = c;
  }
  INFO(bad << " wrong columns, the first " << first_bad << ": got " << float(got[first_bad]) << ", want "
            << double(float(g0[first_bad])) + sums[first_bad]);
  CHECK(bad == 0);
}
}  // namespace

// Every path of the launch: one chunk of rows (1, 7), two chunks of 64 rows over a
// vocabulary's width (128 x 50257) and hundreds of chunks (32768 rows, few columns).
TEMPLATE_TEST_CASE("add_column_sums adds every row of every column to the gradient", "[cuda][reduce][bias]", float,
                   sl::bfloat16) {
  if (!have_device()) return;
  device_fixture f;
  for (std::int64_t rows : {1, 7, 128, 4096 * 8})
    for (std::int64_t cols : {1, 3, 768, 50257})
      if (!(rows == 4096 * 8 && cols == 50257)) check_column_sums<TestType>(f, rows, cols);  // that one: [large]
}

// A bias gradient over a vocabulary for 32768 tokens: 1.6e9 elements (6.6 GB in float).
TEMPLATE_TEST_CASE("add_column_sums over 32768 rows of a vocabulary's width", "[cuda][reduce][bias][large]", float,
                   sl::bfloat16) {
  if (!have_device()) return;
  device_fixture f;
  check_column_sums<TestType>(f, 4096 * 8, 50257);
}

// Rounding, on random values: within 1e-6 of the column's sum of |d| (fp32
// accumulation over at most a few thousand terms per lane gives ~1e-9 on
// random signs; a row left out or added twice changes a sum by ~1/rows of it,
// 3e-5 here), and the same bits on a second run.
TEST_CASE("add_column_sums of random values is close to float64 and deterministic", "[cuda][reduce][bias]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t rows = 4096 * 8, cols = 768;
  const auto dv = rnd.normal(std::size_t(rows * cols));
  auto d = upload(dv, f.stream);
  auto g1 = upload(std::vector<float>(std::size_t(cols), 0.0f), f.stream);
  auto g2 = upload(std::vector<float>(std::size_t(cols), 0.0f), f.stream);
  oc::add_column_sums(d.data(), rows, cols, g1.data(), f.stream, f.alloc);
  oc::add_column_sums(d.data(), rows, cols, g2.data(), f.stream, f.alloc);
  const auto got = download(g1, f.stream);
  REQUIRE(download(g2, f.stream) == got);
  std::vector<double> want(std::size_t(cols), 0.0), abs_sum(std::size_t(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      want[std::size_t(c)] += dv[std::size_t(r * cols + c)];
      abs_sum[std::size_t(c)] += std::abs(dv[std::size_t(r * cols + c)]);
    }
  for (std::size_t c = 0; c < std::size_t(cols); ++c) {
    INFO("column " << c << ": got " << got[c] << ", want " << want[c]);
    REQUIRE(std::abs(double(got[c]) - want[c]) <= 1e-6 * abs_sum[c]);  // false on NaN
  }
}

// Realistic sizes: 2^16 rows of 768 (a GPT-2 small batch of 32 x 2048
// tokens), and rows longer than a block has threads (512), against
// nn::LayerNorm with the tolerances of the small test above.
TEMPLATE_TEST_CASE("layer_norm over many rows and over long rows matches nn::LayerNorm", "[cuda][layer_norm][large]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (auto [rows, d] : {std::pair<std::int64_t, std::int64_t>{65536, 768}, {300, 5000}}) {
    INFO("rows " << rows << ", d " << d);
    auto xv = rnd.normal(std::size_t(rows * d), 2.0f);
    for (auto& x : xv) x += 3.0f;
    const auto x = rounded<T>(xv), dy = rounded<T>(rnd.normal(std::size_t(rows * d)));
    const auto w = rounded<T>(rnd.normal(std::size_t(d))), b = rounded<T>(rnd.normal(std::size_t(d)));
    sl::nn::LayerNorm<float> ln(d);
    std::vector<float> hw = w, hb = b, hgw(std::size_t(d), 0.0f), hgb(std::size_t(d), 0.0f);
    ln.weight.value = hw.data();
    ln.bias.value = hb.data();
    ln.weight.grad = hgw.data();
    ln.bias.grad = hgb.data();
    sl::nn::context ctx;
    const auto y_host = values(ln.forward(ctx, host_tensor({rows, d}, x)));
    const auto dx_host = values(ln.backward(ctx, host_tensor({rows, d}, dy)));

    auto dxv = upload(as<T>(x), f.stream), ddy = upload(as<T>(dy), f.stream);
    auto dw = upload(as<T>(w), f.stream), db = upload(as<T>(b), f.stream);
    auto dgw = upload(std::vector<T>(std::size_t(d), T(0.0f)), f.stream);
    auto dgb = upload(std::vector<T>(std::size_t(d), T(0.0f)), f.stream);
    auto y = poisoned<T>(std::size_t(rows * d), f.stream), dx = poisoned<T>(std::size_t(rows * d), f.stream);
    auto stats = poisoned<oc::row_stats>(std::size_t(rows), f.stream);
    oc::layer_norm_forward(dxv.data(), dw.data(), db.data(), y.data(), stats.data(), rows, int(d), 1e-5f, f.stream);
    oc::layer_norm_backward(dxv.data(), ddy.data(), dw.data(), stats.data(), dx.data(), dgw.data(), dgb.data(), rows,
                            int(d), f.stream, f.alloc);
    require_close(download_float(y, f.stream), y_host, rtol<T>, 10 * rtol<T>);
    require_close(download_float(dx, f.stream), dx_host, rtol<T>, 10 * rtol<T> * max_abs(dx_host));
    // The parameter gradients sum 2^16 rows: float sums in another order than
    // the host's differ by ~sqrt(rows) ulps of the terms, relative to the largest.
    require_close(download_float(dgw, f.stream), hgw, rtol<T>, 10 * rtol<T> * max_abs(hgw));
    require_close(download_float(dgb, f.stream), hgb, rtol<T>, 10 * rtol<T> * max_abs(hgb));
  }
}

TEMPLATE_TEST_CASE("masked softmax over many rows and over long rows matches the host rows", "[cuda][softmax][large]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  // [N, H, L, L] scores with a key-padding mask: 67,584 rows of 768, and 6000 rows of 3000.
  for (auto [N, H, L] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{8, 11, 768}, {2, 1, 3000}}) {
    INFO("N " << N << ", H " << H << ", L " << L);
    const std::int64_t rows = N * H * L;
    const auto scores = rounded<T>(rnd.normal(std::size_t(rows * L), 3.0f));
    const auto dp = rounded<T>(rnd.normal(std::size_t(rows * L)));
    std::vector<std::uint8_t> mask(std::size_t(N * L), 0);
    for (std::int64_t n = 0; n < N; ++n)  // sample n pads its last n * L / (2 N) keys
      for (std::int64_t j = L - n * L / (2 * N); j < L; ++j) mask[std::size_t(n * L + j)] = 1;
    std::vector<float> p_host = scores, dp_host = dp;
    for (std::int64_t r = 0; r < rows; ++r) {
      oc::masked_softmax_row(oc::serial_team{}, p_host.data() + r * L, mask.data() + (r / (H * L)) * L, int(L));
      oc::softmax_backward_row(oc::serial_team{}, p_host.data() + r * L, dp_host.data() + r * L, int(L));
    }
    auto dsc = upload(as<T>(scores), f.stream), ddp = upload(as<T>(dp), f.stream);
    auto dmask = upload(mask, f.stream);
    oc::masked_softmax(dsc.data(), dmask.data(), rows, int(L), H * L, f.stream);
    oc::softmax_backward(dsc.data(), ddp.data(), rows, int(L), f.stream);
    require_close(download_float(dsc, f.stream), rounded<T>(p_host), rtol<T>, 1e-6);
    require_close(download_float(ddp, f.stream), rounded<T>(dp_host), rtol<T>, 10 * rtol<T> * max_abs(dp_host));
  }
}

}  // namespace test_cuda_ops
