// The device tests of gemm_lt's epilogues, cuBLAS's products and the device Linear
// (tests/cuda/test_cuda_gemm.cu), compiled by the host compiler and run on the CPU:
// cuBLAS and cuBLASLt are the stand-ins of tests/emulated/include, which compute in
// float64 as their documentation states the operations, so what runs here is the
// library's side: which operand goes where, the layouts, transposes, leading
// dimensions, the epilogue's vectors and aux, and the Linear's choice of path.
#include "cuda/test_cuda_gemm.cu"

#include <shardlib/nn/cuda/tied_linear.cuh>
#include <shardlib/nn/tied_linear.hpp>

namespace test_cuda_gemm {  // the device test's, whose helpers these cases use

namespace {

// Sets one of the stand-in's refusals for a scope: the heuristic's "no algorithm"
// (lt_refuses), or cublasLtMatmul's NOT_SUPPORTED (lt_matmul_refuses).
struct lt_refusing {
  explicit lt_refusing(std::atomic<bool>& f) : flag(f) { flag = true; }
  ~lt_refusing() { flag = false; }
  lt_refusing(const lt_refusing&) = delete;
  lt_refusing& operator=(const lt_refusing&) = delete;
  std::atomic<bool>& flag;
};

// A case's stream (the thread's current one while it lives) and seeded inputs.
struct device_case {
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream};
  random_inputs rnd;
};

}  // namespace

// Counts the cuBLASLt products a forward and backward run: forward fuses the bias, ReLU
// and (16-bit, out_features a multiple of 8) tanh-GELU; backward fuses the bias gradient
// in fp32 only. With no algorithm, the layer still equals the host's through cuBLAS and
// its kernels, and so where cublasLtMatmul refuses the algorithm its heuristic found.
// Each part uses sizes the others do not, and the refusing parts come last and use sizes
// no other case does: the cuBLASLt handle (one per thread and device, for the whole
// process) keeps its answer per problem, "none" included.
TEMPLATE_TEST_CASE("device Linear fuses what cuBLASLt takes, and runs unfused where it finds or runs no algorithm",
                   "[cuda][gemm][layers]", float, sl::bfloat16) {
  using T = TestType;
  device_case dc;
  INFO("seed " << dc.rnd.seed);
  const auto products = [&](std::int64_t rows, std::int64_t in, std::int64_t out, nn::fused_activation act) {
    const std::int64_t before = cuda_emulator::lt_matmuls;
    compare_linear<T>(rows, in, out, act, dc.rnd, dc.stream);
    return cuda_emulator::lt_matmuls - before;
  };
  constexpr bool fp32 = std::is_same_v<T, float>;
  const std::int64_t bgrad = fp32 ? 1 : 0;
  CHECK(products(9, 24, 16, nn::fused_activation::none) == 1 + bgrad);
  CHECK(products(9, 24, 16, nn::fused_activation::relu) == 1 + bgrad);
  CHECK(products(9, 24, 16, nn::fused_activation::gelu_tanh) == (fp32 ? 0 : 1) + bgrad);
  CHECK(products(9, 24, 15, nn::fused_activation::gelu_tanh) == bgrad);  // GELU's aux would need padding
  constexpr nn::fused_activation acts[] = {nn::fused_activation::none, nn::fused_activation::relu,
                                           nn::fused_activation::gelu_tanh};
  {
    const lt_refusing refused(cuda_emulator::lt_matmul_refuses);  // found, then refused by cublasLtMatmul
    for (auto act : acts) CHECK(products(13, 28, 32, act) == 0);
  }
  for (auto act : acts) CHECK(products(13, 28, 32, act) == 0);  // the refusal is kept: not asked again
  const lt_refusing none(cuda_emulator::lt_refuses);
  for (auto act : acts) CHECK(products(11, 20, 24, act) == 0);
}

// cuBLAS (the stand-in) counts the products it gets with rows off 16-byte boundaries:
// gemm hands them on, gemm_staged copies them first, and the device Linear's products
// (an output of 67 features: y's and dy's rows 134 or 268 bytes apart) take gemm_staged,
// or cuBLASLt on dy's aligned copy (fp32's bias gradient), never cuBLASLt on unaligned rows
// (the forward's epilogue), which the staging does not reach.
TEMPLATE_TEST_CASE("gemm_staged gives cuBLAS aligned rows, and the device Linear's products go through it",
                   "[cuda][gemm]", float, sl::bfloat16) {
  using T = TestType;
  device_case dc;
  INFO("seed " << dc.rnd.seed);
  sl::cuda::blas handle(0);
  const auto unaligned = [](auto&& run) {
    const std::int64_t before = cuda_emulator::unaligned_products;
    run();
    return cuda_emulator::unaligned_products - before;
  };
  const std::int64_t m = 64, n = 67, k = 64;  // C = A B^T with C's rows n = 67 elements apart
  auto a = upload(as<T>(rounded<T>(dc.rnd.normal(std::size_t(m * k)))), dc.stream);
  auto b = upload(as<T>(rounded<T>(dc.rnd.normal(std::size_t(n * k)))), dc.stream);
  auto c = poisoned<T>(std::size_t(m * n), dc.stream);
  const auto product = [&](bool staged) {
    if (staged)
      oc::gemm_staged(handle, dc.stream, sl::cuda::device_allocator(0), trans::no, trans::yes, m, n, k, 1.0f, a.data(),
                      k, b.data(), k, 0.0f, c.data(), n);
    else
      oc::gemm(handle, dc.stream, trans::no, trans::yes, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  };
  CHECK(unaligned([&] { product(false); }) == 1);
  CHECK(unaligned([&] { product(true); }) == 0);
  const std::int64_t lt_before = cuda_emulator::lt_matmuls;
  for (auto act : {nn::fused_activation::none, nn::fused_activation::relu})
    CHECK(unaligned([&] { compare_linear<T>(64, 64, 67, act, dc.rnd, dc.stream); }) == 0);
  CHECK(cuda_emulator::lt_matmuls - lt_before == (std::is_same_v<T, float> ? 2 : 0));  // fp32: dW with db, per layer
}

// GPT-2's tied head at an odd vocabulary (the logits' rows 67 elements apart): the device
// TiedLinear's three products reach cuBLAS with aligned rows, and equal the host layer's.
TEMPLATE_TEST_CASE("the device TiedLinear at an odd vocabulary gives cuBLAS aligned rows and equals the host's",
                   "[cuda][gemm][layers]", float, sl::bfloat16) {
  using T = TestType;
  device_case dc;
  INFO("seed " << dc.rnd.seed);
  const std::int64_t rows = 64, in = 64, vocab = 67;
  std::vector<float> w = rounded<T>(dc.rnd.normal(std::size_t(vocab * in), 0.2f)), hgw(w.size(), 0.0f);
  nn::Param<float> hp{.shape = Shape{vocab, in}, .init = {}, .value = w.data(), .grad = hgw.data()};
  nn::TiedLinear<float> host(in, vocab);
  host.tie(hp);
  auto dw = upload(as<T>(w), dc.stream), dgw = upload(as<T>(hgw), dc.stream);
  nn::Param<T> dp{.shape = Shape{vocab, in}, .init = {}, .value = dw.data(), .grad = dgw.data()};
  nn::TiedLinear<T, cuda_space> dev(in, vocab);
  dev.tie(dp);
  const auto x = rounded<T>(dc.rnd.normal(std::size_t(rows * in)));
  const auto dy = rounded<T>(dc.rnd.normal(std::size_t(rows * vocab)));
  nn::context ctx({.training = true});
  const auto hy = values(host.forward(ctx, host_tensor(Shape{rows, in}, x)));
  const auto hdx = values(host.backward(ctx, host_tensor(Shape{rows, vocab}, dy)));
  Tensor<T, cuda_space> dx_in(Shape{rows, in}), dy_in(Shape{rows, vocab});
  const std::vector<T> x_t = as<T>(x), dy_t = as<T>(dy);
  sl::cuda::copy_async(dx_in.span(), std::span<const T>(x_t), dc.stream);
  sl::cuda::copy_async(dy_in.span(), std::span<const T>(dy_t), dc.stream);
  const std::int64_t before = cuda_emulator::unaligned_products;
  const long copies = cuda_emulator::copies_2d;
  const auto y = dev.forward(ctx, dx_in);
  CHECK(cuda_emulator::copies_2d - copies == 1);  // the logits out of their aligned scratch
  const auto dx = dev.backward(ctx, dy_in);
  CHECK(cuda_emulator::copies_2d - copies == 2);  // dy into aligned rows once, for dW and dx
  CHECK(cuda_emulator::unaligned_products == before);
  const auto near = [](const std::vector<float>& got, const std::vector<float>& want) {
    require_close(got, want, rtol<T>, rtol<T> * max_abs(want));
  };
  const auto to_host = [&](std::span<const T> d) {
    std::vector<T> v(d.size());
    sl::cuda::copy_async(std::span<T>(v), d, dc.stream);
    sl::cuda::check(cudaStreamSynchronize(dc.stream), "cudaStreamSynchronize");
    return widened(v);
  };
  near(to_host(y.span()), hy);
  near(to_host(dx.span()), hdx);
  near(download_float(dgw, dc.stream), hgw);
}

}  // namespace test_cuda_gemm
