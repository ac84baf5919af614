// The fused attention's kernels — the tensor-core set (flash_tensor_kernels.cuh)
// and the CUDA-core set (flash_kernels.cuh), the very code a GPU runs — on the CPU
// through tests/emulated/cuda_emulator.hpp, against nn::sdpa in float64: the same
// cases, inputs and tolerances as tests/cuda/test_cuda_attention.cu, which runs
// them where a GPU is. Every output starts as NaN, shared memory too before each
// block, so an element or a tile left unwritten fails the comparison.
//
// What this finds that the host model of the tile arithmetic (test_attention_tiles)
// cannot: the kernels' indexing, staging, masking at tile edges, the warps' parts,
// the barriers (a missing one reads NaN or stale tiles; one not every thread reaches
// raises), the launch geometry and shared-memory sizes (a write past the declared
// bytes raises). Each launch runs twice, threads first to last in lockstep and
// last to first warp by warp; the results must be equal bit for bit (a result
// that depends on the order the threads run in is a race). What it cannot find:
// the hardware's own rounding in wmma's products (summed here in fp32, in order)
// and anything about speed.
//
// Tolerances, normwise as on the device (see there): fp32 2e-5, bf16 1e-2, half 2e-3.
#include <shardlib/core/element.hpp>
#include <shardlib/ops/cuda/flash_kernels.cuh>
#include <shardlib/ops/cuda/flash_tensor_kernels.cuh>

#include "dynamic_shared.hpp"  // the kernels' shared memory
#include "support/attention_cases.hpp"
#include "support/compare.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace test_emulated_attention {

namespace {

namespace sl = shardlib;
namespace fa = shardlib::ops::cuda;
namespace fd = fa::detail::fused;
namespace ft = fa::detail::tensor;
using test_support::attention_case;
using test_support::attention_data;
using test_support::view_of;

// n elements, then a guard of as many, every byte 0xFF (NaN in float, bf16 and fp16):
// an element left unwritten fails the comparison, one written past the n changes the
// guard (guard_intact).
template <class T>
std::vector<T> poisoned(std::size_t n) {
  std::vector<T> v(2 * n);
  std::memset(v.data(), 0xFF, v.size() * sizeof(T));
  return v;
}
template <class T>
bool guard_intact(const std::vector<T>& v) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(v.data() + v.size() / 2);
  return std::all_of(bytes, bytes + v.size() / 2 * sizeof(T), [](unsigned char b) { return b == 0xFF; });
}
template <class T>
std::vector<float> widened(const std::vector<T>& x) {  // the elements before the guard
  return {x.begin(), x.begin() + std::ptrdiff_t(x.size() / 2)};
}

// What one run of forward and backward wrote.
template <class T>
struct outputs {
  std::vector<T> out, dq, dk, dv;
  std::vector<float> lse;
};
template <class U>
bool same_bits(const std::vector<U>& a, const std::vector<U>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(U)) == 0;
}
template <class T>
bool same_bits(const outputs<T>& a, const outputs<T>& b) {
  return same_bits(a.out, b.out) && same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv) &&
         same_bits(a.lse, b.lse);
}

template <class T>
outputs<T> run_kernels(const attention_case& c, const attention_data& in, bool tensor_cores,
                       cuda_emulator::launch_options lo, bool longest_first = true) {
  const std::int64_t B = c.batch, H = c.heads, G = c.kv_heads, Lq = c.queries, Lk = c.keys, D = c.dim;
  using test_support::as;
  const std::vector<T> q = as<T>(in.q), k = as<T>(in.k), v = as<T>(in.v), dout = as<T>(in.dout);
  std::vector<std::uint8_t> padding;
  fa::flash_options fo = in.flash;
  fo.longest_first = longest_first;
  if (c.padding) {
    padding.assign(in.options.key_padding_mask.data(), in.options.key_padding_mask.data() + B * Lk);
    fo.key_padding = padding.data();
  }
  outputs<T> r{poisoned<T>(q.size()), poisoned<T>(q.size()), poisoned<T>(k.size()), poisoned<T>(v.size()),
               poisoned<float>(std::size_t(B * H * Lq))};
  const auto view = [&](const std::vector<T>& x, std::int64_t heads, std::int64_t l) {
    return view_of(x.data(), B, heads, l, D, c.rows);
  };
  const auto out_view = [&](std::vector<T>& x, std::int64_t heads, std::int64_t l) {
    return view_of(x.data(), B, heads, l, D, c.rows);
  };
  const sl::ops::flash::tile_problem p = fd::problem(view(q, H, Lq), view(k, G, Lk), view(v, G, Lk), fo, "emulated");
  const float scale = fd::scale_of(fo, D);
  const fd::forward_args<T> fwd{fd::rows_of(view(q, H, Lq)), fd::rows_of(view(k, G, Lk)), fd::rows_of(view(v, G, Lk)),
                                fd::rows_of(out_view(r.out, H, Lq)), r.lse.data(), p, scale, int(D), longest_first};
  std::vector<float> row_d = poisoned<float>(std::size_t(B * H * Lq));
  const fd::backward_args<T> bwd{fd::rows_of(view(q, H, Lq)),    fd::rows_of(view(k, G, Lk)),
                                 fd::rows_of(view(v, G, Lk)),    fd::rows_of(view(r.out, H, Lq)),
                                 fd::rows_of(view(dout, H, Lq)), r.lse.data(),
                                 row_d.data(),                   fd::rows_of(out_view(r.dq, H, Lq)),
                                 fd::rows_of(out_view(r.dk, G, Lk)), fd::rows_of(out_view(r.dv, G, Lk)),
                                 p,                              scale,
                                 int(D),                         longest_first};
  // One kernel set's forward, dq and dk/dv (kernels, query or key tile, shared bytes),
  // with D = dO . O between forward and backward.
  const auto run_set = [&](auto forward, auto dq, auto dkdv, int rows, std::array<std::size_t, 3> bytes) {
    const dim3 block(fd::threads);
    cuda_emulator::launch(forward, fd::query_grid(p, rows, longest_first), block, bytes[0], lo, fwd);
    cuda_emulator::launch(fd::row_d_kernel<T>, dim3(unsigned((B * H * Lq + fd::warps - 1) / fd::warps)), block, 0, lo,
                          bwd);
    cuda_emulator::launch(dq, fd::query_grid(p, rows, longest_first), block, bytes[1], lo, bwd);
    cuda_emulator::launch(dkdv, fd::key_grid(p, rows, longest_first), block, bytes[2], lo, bwd);
  };
  if constexpr (ft::takes<T>) {
    if (tensor_cores) {
      REQUIRE(ft::takes_dim(D));
      REQUIRE((ft::whole_vectors(fwd.q) && ft::whole_vectors(fwd.k) && ft::whole_vectors(fwd.v) &&
               ft::whole_vectors(fwd.out) && ft::whole_vectors(bwd.dout) && ft::whole_vectors(bwd.dq) &&
               ft::whole_vectors(bwd.dk) && ft::whole_vectors(bwd.dv)));
      ft::dispatch_dim(D, [&]<int DM>() {
        const auto forward = p.dropout ? ft::forward_kernel<DM, T, true> : ft::forward_kernel<DM, T, false>;
        run_set(forward, ft::dq_kernel<DM, T>, ft::dkdv_kernel<DM, T>, ft::tile,
                {ft::forward_bytes<DM>, ft::dq_bytes<DM>, ft::dkdv_bytes<DM>});
      });
      return r;
    }
  }
  REQUIRE_FALSE(tensor_cores);
  fd::dispatch_dim(D, "emulated", [&]<int DM>() {
    run_set(fd::forward_kernel<DM, T>, fd::dq_kernel<DM, T>, fd::dkdv_kernel<DM, T>, fd::tile,
            {fd::forward_bytes<DM>, fd::dq_bytes<DM>, fd::dkdv_bytes<DM>});
  });
  return r;
}

template <class T>
double dq_tolerance(double tol) {
  return std::is_same_v<T, sl::bfloat16> ? test_support::bf16_dq_tolerance : tol;
}

template <class T>
void check_case(const attention_case& c, test_support::random_inputs& rnd, double tol, bool tensor_cores) {
  INFO(c.name << (tensor_cores ? ", tensor-core kernels" : ", CUDA-core kernels") << " (seed " << rnd.seed << ")");
  const attention_data in = test_support::make_attention_data<T>(c, rnd);
  const outputs<T> got = run_kernels<T>(c, in, tensor_cores, {});
  CHECK(test_support::normwise_error(widened(got.out), in.out) <= tol);
  CHECK(test_support::normwise_error(widened(got.dq), in.dq) <= dq_tolerance<T>(tol));
  CHECK(test_support::normwise_error(widened(got.dk), in.dk) <= tol);
  CHECK(test_support::normwise_error(widened(got.dv), in.dv) <= tol);
  CHECK(test_support::wrong_lse_rows(c, in, got.lse) == 0);
  CHECK((guard_intact(got.out) && guard_intact(got.dq) && guard_intact(got.dk) && guard_intact(got.dv) &&
         guard_intact(got.lse)));
  // The same bits with the threads run the other way round, warp by warp, the
  // asynchronous copies landing when issued (above: in lockstep, when waited for), and
  // the blocks in the tile-fastest grid (above: longest first).
  CHECK(same_bits(run_kernels<T>(c, in, tensor_cores,
                                 {.reversed = true, .warp_serial = true, .copies_at_issue = true}, false),
                  got));
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : std::is_same_v<T, sl::bfloat16> ? 1e-2 : 2e-3;
}

}  // namespace

// On a GPU the products load operands by ldmatrix.x4 and multiply by mma.sync m16n8k16
// (the emulator runs wmma instead). Modelled here on the PTX ISA's layouts: ldmatrix gives
// lane t row t / 4, elements 2 (t % 4) and + 1, of each 8x8 matrix (transposed: column t / 4,
// rows 2 (t % 4) and + 1), whose row i lane 8 j + i addresses; mma wants lane t's A element
// i at row t / 4 + 8 ((i / 2) % 2), k 2 (t % 4) + i % 2 + 8 (i / 4), and B element i at k
// 2 (t % 4) + i % 2 + 8 (i / 2), column t / 4. Each lane must receive what mma wants.
TEST_CASE("the lanes' ldmatrix addresses give mma.sync its operands", "[emulated][flash]") {
  const auto ldmatrix = [](const std::vector<int>& m, auto piece, bool trans, int t) {
    std::array<std::array<int, 2>, 4> r{};
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const int row = trans ? 2 * (t % 4) + h : t / 4, col = trans ? t / 4 : 2 * (t % 4) + h;
        const ft::piece p = piece(8 * j + row);
        r[std::size_t(j)][std::size_t(h)] = m[std::size_t(p.row * 16 + p.col + col)];
      }
    return r;
  };
  std::vector<int> tile(256);  // element (row, col) holds 100 row + col
  for (int e = 0; e < 256; ++e) tile[std::size_t(e)] = 100 * (e / 16) + e % 16;
  int wrong = 0;
  for (int t = 0; t < 32; ++t) {
    const int g = t / 4, q = t % 4;
    const auto a = ldmatrix(tile, ft::a_piece, false, t);
    for (int i = 0; i < 8; ++i)  // A [row][k]
      wrong += a[std::size_t(i / 2)][std::size_t(i % 2)] != 100 * (g + 8 * ((i / 2) % 2)) + 2 * q + i % 2 + 8 * (i / 4);
    const auto bt = ldmatrix(tile, ft::b_transposed_piece, false, t), b = ldmatrix(tile, ft::b_piece, true, t);
    for (int half = 0; half < 2; ++half)  // columns 0-7, then 8-15
      for (int i = 0; i < 4; ++i) {
        const int k = 2 * q + i % 2 + 8 * (i / 2), n = g + 8 * half;
        const auto at = [&](const auto& r) { return r[std::size_t(2 * half + i / 2)][std::size_t(i % 2)]; };
        wrong += at(bt) != 100 * n + k;  // the tile holds B^T: [n][k]
        wrong += at(b) != 100 * k + n;   // the tile holds B: [k][n]
      }
  }
  CHECK(wrong == 0);
}

// Forward skips O's rescale unless some lane's row raised its max (__any_sync). Emulated
// lanes each hold every row, so they agree whatever the vote; the vote itself is checked here.
__global__ void any_kernel(int* votes, int lane_on) {
  votes[threadIdx.x] = __any_sync(0xffffffffu, int(threadIdx.x) == lane_on);
}
TEST_CASE("the emulator's __any_sync is an OR over the warp", "[emulated][flash]") {
  for (const int lane_on : {-1, 0, 17, 31}) {
    std::vector<int> votes(32, -1);
    cuda_emulator::launch(any_kernel, dim3(1), dim3(32), 0, {}, votes.data(), lane_on);
    CHECK(votes == std::vector<int>(32, lane_on >= 0 ? 1 : 0));
  }
}

// dk/dv reads each query's lse and D once per column a lane holds (its column slots, 4 on a
// GPU), not once per element: the slot of each of the 8 elements must name its column.
TEST_CASE("the accumulator's column slots name each element's column", "[emulated][flash]") {
  int wrong = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 8; ++e) {
      const int j = ft::mma_column_slot(e);
      wrong += j < 0 || j >= 4 || ft::mma_column_of_slot(j, lane) != ft::mma_column(e, lane);
    }
  CHECK(wrong == 0);
}

// The masks forward and dk/dv draw, read back exactly as tests/cuda does
// (test_support::mask_probe_data): L 72 gives a second key tile and keys past the last whole
// group, Lq 40 queries past the last.
TEMPLATE_TEST_CASE("the attention kernels, emulated, draw nn::sdpa's dropout mask bit for bit", "[emulated][flash]",
                   float, sl::bfloat16) {
  const attention_case c = test_support::mask_probe_case(2, 3, 40, 72);
  const attention_data in = test_support::mask_probe_data(c, 0.3, sl::counter_rng(99, 3));
  for (const bool tensor_cores : {true, false}) {
    if (tensor_cores && !ft::takes<TestType>) continue;
    INFO("tensor cores " << tensor_cores);
    const outputs<TestType> got = run_kernels<TestType>(c, in, tensor_cores, {});
    std::int64_t dropped = 0;
    CHECK(test_support::mask_mismatches(c, in, widened(got.out), widened(got.dv), dropped) == 0);
    CHECK(dropped > c.batch * c.heads * c.queries * c.keys / 5);  // p 0.3: the mask does drop
  }
}

// On a GPU forward and dq draw dropout once per lane and accumulator, at its element 0, and
// dk/dv (rows are keys) twice, at its elements 0 and 1 (lane_group); each element then reads
// its bit.
// That holds only if those elements head the groups (nn::attention_keep) of all 8 in
// mma.sync's layout, for a tile whose first row and column are multiples of 16.
TEST_CASE("a lane's accumulator elements are whole dropout groups", "[emulated][flash][dropout]") {
  const std::int64_t Lq = 64, Lk = 80, head = 3, r0 = 16, c0 = 48;  // the tile's first row and column
  int wrong = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 8; ++e) {
      const std::int64_t r = r0 + ft::mma_row(e, lane), c = c0 + ft::mma_column(e, lane);
      // rows are queries (forward, dq): element 0's group
      wrong += sl::nn::attention_keep::index(head, Lq, Lk, r, c) !=
               sl::nn::attention_keep::index(head, Lq, Lk, r0 + ft::mma_row(0, lane), c0 + ft::mma_column(0, lane));
      // rows are keys (dk/dv): query c, key r, in the group of element e % 2
      wrong += sl::nn::attention_keep::index(head, Lk, Lq, c, r) !=
               sl::nn::attention_keep::index(head, Lk, Lq, c0 + ft::mma_column(e % 2, lane), r0 + ft::mma_row(0, lane));
    }
  CHECK(wrong == 0);
}

// The kernels read accumulators element by element where row_of and column_of say; the
// probe that checks it (and the products) on a GPU must hold here, where every lane holds
// the whole tile.
TEMPLATE_TEST_CASE("the accumulator layout probe holds for the emulated fragments", "[emulated][flash]",
                   sl::bfloat16, sl::half) {
  std::vector<int> flags(32, -1);
  cuda_emulator::launch(ft::layout_probe_kernel<TestType>, dim3(1), dim3(32), 0, {}, flags.data());
  CHECK(flags == std::vector<int>(32, 1));
}

// Forward takes a row's largest product and scales it, which only a positive scale
// keeps the largest: flash_uses_tensor_cores asks takes_scale, and other scales (the
// negative case of small_attention_cases) take the CUDA cores.
TEST_CASE("the tensor-core kernels take finite positive scales only", "[emulated][flash]") {
  CHECK(ft::takes_scale(0.125f));
  CHECK(ft::takes_scale(fd::scale_of({}, 128)));
  CHECK_FALSE(ft::takes_scale(-0.3f));
  CHECK_FALSE(ft::takes_scale(0.0f));
  CHECK_FALSE(ft::takes_scale(NAN));
  CHECK_FALSE(ft::takes_scale(INFINITY));
  CHECK_FALSE(ft::takes_scale(1e-40f));                                // subnormal: 0 under -ftz
  CHECK_FALSE(ft::takes_scale(std::numeric_limits<float>::max() / 1.2f));  // times log2(e) overflows
}

// The grids' blocks, in the order a GPU starts them (x fastest), through the kernels'
// own query_place and key_place: each tile of each head and batch element once, the
// causal work of each (keys a query tile sees, queries a key tile meets) never growing,
// heads sharing a kv head next to each other; and the limits, checked before a launch.
TEST_CASE("the fused attention's blocks cover every tile once, the most causal work first", "[emulated][flash]") {
  for (const std::int64_t offset : {0, 70}) {  // 70: keys - queries, the last query sees every key
    INFO("query_offset " << offset);
    const auto p = sl::ops::flash::make_problem(3, 4, 2, 130, 200, true, offset, nullptr, std::nullopt, 0.0);
    for (const bool queries : {true, false}) {
      INFO((queries ? "query" : "key") << " tiles");
      const std::int64_t heads = queries ? p.heads : p.kv_heads, count = queries ? p.queries : p.keys;
      const std::int64_t tiles = (count + ft::tile - 1) / ft::tile;
      const dim3 grid = queries ? fd::query_grid(p, ft::tile, true) : fd::key_grid(p, ft::tile, true);
      const std::int64_t blocks = std::int64_t(grid.x) * grid.y * grid.z;
      REQUIRE(blocks == tiles * heads * p.batch);
      const auto work = [&](std::int64_t t) {
        const std::int64_t first = t * ft::tile, last = std::min(first + ft::tile, count) - 1;
        return queries ? sl::ops::flash::key_end(p, last) : p.queries - sl::ops::flash::query_begin(p, first);
      };
      CHECK(work(queries ? tiles - 1 : 0) > work(queries ? 0 : tiles - 1));  // the order matters here
      std::vector<int> seen(std::size_t(blocks), 0);
      std::int64_t previous = work(queries ? tiles - 1 : 0);
      fd::block_place last{};
      for (std::int64_t b = 0; b < blocks; ++b) {
        const unsigned x = unsigned(b % grid.x), y = unsigned(b / grid.x % grid.y), z = unsigned(b / grid.x / grid.y);
        const fd::block_place at =
            queries ? fd::query_place(x, y, z, grid.z, true) : fd::key_place(x, y, z, true);
        REQUIRE((at.tile >= 0 && at.tile < tiles && at.head >= 0 && at.head < heads && at.batch >= 0 &&
                 at.batch < p.batch));
        ++seen[std::size_t((at.tile * p.batch + at.batch) * heads + at.head)];
        CHECK(work(at.tile) <= previous);  // the most work first
        if (b % heads != 0) CHECK(at.head == last.head + 1);
        previous = work(at.tile);
        last = at;
      }
      CHECK(std::count(seen.begin(), seen.end(), 1) == blocks);
      // The tile-fastest grid, for comparison: the same blocks, each head's tiles in turn.
      const dim3 by_tile = queries ? fd::query_grid(p, ft::tile, false) : fd::key_grid(p, ft::tile, false);
      CHECK((by_tile.x == tiles && by_tile.y == heads && by_tile.z == p.batch));
      const fd::block_place second =
          queries ? fd::query_place(1, 0, 0, by_tile.z, false) : fd::key_place(1, 0, 0, false);
      CHECK((second.tile == 1 && second.head == 0 && second.batch == 0));
    }
  }
  // A sequence of more tiles than a grid's z holds raises before anything runs, for queries or keys.
  const auto view = [](std::int64_t batch, std::int64_t seq) {
    return sl::nn::head_view<const sl::bfloat16>{nullptr, batch, 1, seq, 64, seq * 64, seq * 64, 64};
  };
  const std::int64_t most = fd::max_sequence;
  CHECK_NOTHROW(fd::problem(view(1, most), view(1, most), view(1, most), {}, "test"));
  CHECK_THROWS_AS(fd::problem(view(1, most + 1), view(1, 8), view(1, 8), {}, "test"), sl::shape_error);
  CHECK_THROWS_AS(fd::problem(view(1, 8), view(1, most + 1), view(1, most + 1), {}, "test"), sl::shape_error);
  CHECK_THROWS_AS(fd::problem(view(65536, 8), view(65536, 8), view(65536, 8), {}, "test"), sl::shape_error);
  CHECK_NOTHROW(fd::problem(view(1, most + 1), view(1, 8), view(1, 8), {.longest_first = false}, "test"));
}

TEMPLATE_TEST_CASE("the tensor-core attention kernels, emulated, equal nn::sdpa", "[emulated][flash]", sl::bfloat16,
                   sl::half) {
  test_support::random_inputs rnd;
  for (const attention_case& c : test_support::small_attention_cases())
    if (ft::takes_dim(c.dim) && ft::takes_scale(fd::scale_of({.scale = float(c.scale)}, c.dim)))
      check_case<TestType>(c, rnd, tolerance<TestType>(), true);
}

// The small cases see at most two key tiles per query tile: these keep the tensor
// kernels' pipelines in their steady state (five key tiles; dk/dv's buffers over ten
// query tiles of two heads). Without padding, most tiles are wholly visible and skip the
// per-element test: offset 46 puts some warps' causal limit one column short of a whole
// tile (forward and dq: column - row <= 62; dk/dv: >= -14) and others just on it (63, -15).
TEST_CASE("the tensor-core attention kernels, emulated, over many tiles", "[emulated][flash]") {
  test_support::random_inputs rnd;
  for (const std::int64_t dim : {96, 64})
    check_case<sl::bfloat16>({"L 300, GQA 4 over 2, causal, key padding, dropout 0.1, D " + std::to_string(dim), 1, 4,
                              2, 300, 300, dim, true, 0, 1, 0.1},
                             rnd, tolerance<sl::bfloat16>(), true);
  check_case<sl::bfloat16>({"Lq 254, Lk 300, causal offset 46, no padding, D 64", 1, 2, 1, 254, 300, 64, true, 46}, rnd,
                           tolerance<sl::bfloat16>(), true);
}

TEMPLATE_TEST_CASE("the CUDA-core attention kernels, emulated, equal nn::sdpa", "[emulated][flash]", float,
                   sl::bfloat16) {
  test_support::random_inputs rnd;
  for (const attention_case& c : test_support::small_attention_cases())
    check_case<TestType>(c, rnd, tolerance<TestType>(), false);
}

}  // namespace test_emulated_attention
