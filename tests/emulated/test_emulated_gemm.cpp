// The device tests of gemm_lt's epilogues, cuBLAS's products and the device Linear
// (tests/cuda/test_cuda_gemm.cu), compiled by the host compiler and run on the CPU:
// cuBLAS and cuBLASLt are the stand-ins of tests/emulated/include, which compute in
// float64 as their documentation states the operations, so what runs here is the
// library's side: which operand goes where, the layouts, transposes, leading
// dimensions, the epilogue's vectors and aux, and the Linear's choice of path.
#include "cuda/test_cuda_gemm.cu"

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
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream};
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const auto products = [&](std::int64_t rows, std::int64_t in, std::int64_t out, nn::fused_activation act) {
    const std::int64_t before = cuda_emulator::lt_matmuls;
    compare_linear<T>(rows, in, out, act, rnd, stream);
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
// none cuBLASLt, whose products the staging does not reach.
TEMPLATE_TEST_CASE("gemm_staged gives cuBLAS aligned rows, and the device Linear's products go through it",
                   "[cuda][gemm]", float, sl::bfloat16) {
  using T = TestType;
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream};
  sl::cuda::blas handle(0);
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const auto unaligned = [](auto&& run) {
    const std::int64_t before = cuda_emulator::unaligned_products;
    run();
    return cuda_emulator::unaligned_products - before;
  };
  const std::int64_t m = 64, n = 67, k = 64;  // C = A B^T with C's rows n = 67 elements apart
  auto a = upload(as<T>(rounded<T>(rnd.normal(std::size_t(m * k)))), stream);
  auto b = upload(as<T>(rounded<T>(rnd.normal(std::size_t(n * k)))), stream);
  auto c = poisoned<T>(std::size_t(m * n), stream);
  const auto product = [&](bool staged) {
    if (staged)
      oc::gemm_staged(handle, stream, sl::cuda::device_allocator(0), trans::no, trans::yes, m, n, k, 1.0f, a.data(), k,
                      b.data(), k, 0.0f, c.data(), n);
    else
      oc::gemm(handle, stream, trans::no, trans::yes, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  };
  CHECK(unaligned([&] { product(false); }) == 1);
  CHECK(unaligned([&] { product(true); }) == 0);
  const std::int64_t lt_before = cuda_emulator::lt_matmuls;
  for (auto act : {nn::fused_activation::none, nn::fused_activation::relu})
    CHECK(unaligned([&] { compare_linear<T>(64, 64, 67, act, rnd, stream); }) == 0);
  CHECK(cuda_emulator::lt_matmuls == lt_before);
}
