// Device tests of what the sharding engine runs on the GPU: every
// space_ops<cuda_space> function against space_ops<host_space> on fresh random
// inputs (with infinities, signed zeros and subnormals), outputs poisoned with
// NaN first; the collectives of small host arrays over an NcclComm at world
// size 1; the device Adam/AdamW against the host optimizers; and a device
// train_step that waits for the device only when its results are read (pending
// values, whose host behaviour is checked here without a GPU too).
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/core/buffer.hpp>
#include <shardlib/core/pending.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/nn/cuda/activation.cuh>
#include <shardlib/nn/cuda/embedding.cuh>
#include <shardlib/nn/cuda/linear.cuh>
#include <shardlib/nn/cuda/loss.cuh>
#include <shardlib/nn/cuda/pooling.cuh>
#include <shardlib/nn/flat.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/optim/cuda/sgd.cuh>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include <catch2/catch.hpp>
#include <cuda/std/chrono>  // the gate kernel's clock

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <cstring>
#include <stdexcept>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "device_test.hpp"

namespace test_cuda_engine {

namespace sl = shardlib;
using namespace device_test;

namespace {

using device_ops = sl::shard::space_ops<sl::cuda_space>;
using host_ops = sl::shard::space_ops<sl::host_space>;

// A stream of device 0, current for the test's lifetime (space_ops and the
// device optimizer run on the current stream).
struct device_fixture {
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream.get()};
};

template <class T>
std::span<const T> cspan(const sl::cuda::device_buffer<T>& d) {
  return d.span();
}

// Device memory read back with a plain copy (not through the code under test).
template <class T>
std::vector<T> fetch(std::span<const T> d, cudaStream_t s) {
  std::vector<T> v(d.size());
  sl::cuda::copy_async(std::span<T>(v), d, s);
  sl::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return v;
}

template <class T>
double as_double(T x) {
  if constexpr (std::is_integral_v<T>) return double(x);
  else return double(float(x));
}

// Bit for bit (so -0 differs from +0, and each NaN is compared by its bits);
// reports the first element that differs.
template <class T>
void require_same_bits(const std::vector<T>& got, const std::vector<T>& want) {
  REQUIRE(got.size() == want.size());
  std::size_t first = got.size();
  for (std::size_t i = 0; i < got.size() && first == got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) first = i;
  if (first < got.size()) {
    INFO("element " << first << " of " << got.size() << ": got " << as_double(got[first]) << ", want "
                    << as_double(want[first]));
    REQUIRE(first == got.size());
  }
}

// The values whose handling a kernel could get wrong, at the first positions
// (NaN only where the operation is a conversion: arithmetic on NaN keeps the
// operand's payload on x86 and gives CUDA's canonical NaN on the device).
std::vector<float> with_specials(std::vector<float> x, bool nan) {
  const float specials[] = {INFINITY, -INFINITY, -0.0f, 0.0f, 1e-40f, -1e-41f, 65504.0f, 65520.0f, -3.3e38f,
                            5.96e-8f, 1e-8f, 1.00390625f /* a bf16 tie */};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  if (nan) x[std::size(specials)] = NAN;
  return x;
}

constexpr std::size_t n = 100003;  // not a multiple of any block size

}  // namespace

TEMPLATE_TEST_CASE("fill, copy, to_host and from_host equal the host's", "[cuda][space_ops]", float, double) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const auto xf = rnd.normal(n);
  const std::vector<T> x(xf.begin(), xf.end());

  const T value = T(rnd.normal(1)[0]);
  auto filled = poisoned<T>(n, f.stream);
  device_ops::fill(filled.span(), value);
  std::vector<T> want(n);
  host_ops::fill(std::span<T>(want), value);
  require_same_bits(fetch(cspan(filled), f.stream), want);

  auto up = poisoned<T>(n, f.stream);
  device_ops::from_host(std::span<const T>(x), up.span());  // complete on return: x may change now
  auto copied = poisoned<T>(n, f.stream);
  device_ops::copy(cspan(up), copied.span());
  std::vector<T> back(n, std::numeric_limits<T>::quiet_NaN());
  device_ops::to_host(cspan(copied), std::span<T>(back));
  require_same_bits(back, x);

  CHECK_THROWS_AS(device_ops::copy(cspan(up), copied.span().first(n - 1)), sl::shape_error);
}

TEMPLATE_TEST_CASE("narrow, widen_add and round_to equal the host's bit for bit", "[cuda][space_ops]", sl::bfloat16,
                   sl::half) {
  if (!have_device()) return;
  using H = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const auto x = with_specials(rnd.normal(n, 100.0f), true);
  const auto dx = upload(x, f.stream);

  auto narrowed = poisoned<H>(n, f.stream);
  device_ops::narrow(cspan(dx), narrowed.span());
  std::vector<H> want_narrow(n);
  host_ops::narrow(std::span<const float>(x), std::span<H>(want_narrow));
  require_same_bits(fetch(cspan(narrowed), f.stream), want_narrow);

  auto rounded_x = poisoned<float>(n, f.stream);
  device_ops::round_to<H>(cspan(dx), rounded_x.span());
  std::vector<float> want_round(n);
  host_ops::round_to<H>(std::span<const float>(x), std::span<float>(want_round));
  require_same_bits(fetch(cspan(rounded_x), f.stream), want_round);

  // widen_add: 16-bit inputs without NaN, onto finite outputs.
  const auto h = as<H>(with_specials(rnd.normal(n, 10.0f), false));
  const auto dh = upload(h, f.stream);
  const auto out0 = rnd.normal(n);
  for (bool overwrite : {false, true}) {
    INFO("overwrite " << overwrite);
    auto out = overwrite ? poisoned<float>(n, f.stream) : upload(out0, f.stream);
    device_ops::widen_add(cspan(dh), out.span(), overwrite);
    std::vector<float> want = out0;
    host_ops::widen_add(std::span<const H>(h), std::span<float>(want), overwrite);
    require_same_bits(fetch(cspan(out), f.stream), want);
  }
}

TEMPLATE_TEST_CASE("add and scale equal the host's bit for bit", "[cuda][space_ops]", float, double) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  std::vector<T> in(n), out0(n);
  const auto a = with_specials(rnd.normal(n), false), b = rnd.normal(n);
  for (std::size_t i = 0; i < n; ++i) {
    in[i] = T(a[i]);
    out0[i] = T(b[i]);
  }
  const auto din = upload(in, f.stream);
  for (bool overwrite : {false, true}) {
    INFO("overwrite " << overwrite);
    auto out = overwrite ? poisoned<T>(n, f.stream) : upload(out0, f.stream);
    device_ops::add(cspan(din), out.span(), overwrite);
    std::vector<T> want = out0;
    host_ops::add(std::span<const T>(in), std::span<T>(want), overwrite);
    require_same_bits(fetch(cspan(out), f.stream), want);
  }

  if constexpr (std::is_same_v<T, float>) {
    const float c = 0.37f;
    auto x = upload(a, f.stream);
    device_ops::scale(x.span(), c);
    std::vector<float> want = a;
    host_ops::scale(std::span<float>(want), c);
    require_same_bits(fetch(cspan(x), f.stream), want);
  }
}

TEST_CASE("add_sum_squares and add_nonfinite agree with the host's and leave their results on the device",
          "[cuda][space_ops]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const auto x = rnd.normal(1000003, 3.0f), z = rnd.normal(4097, 0.5f);
  const auto dx = upload(x, f.stream), dz = upload(z, f.stream);
  // Each square is exact in double (a float has 24 significant bits) and both
  // sides add in double, in different orders (CUB's tree, the host's eight
  // lanes): they differ by roundings of the sum, about n * 2^-53 relative at
  // worst (1e-10 here). 1e-6 is what the engine needs (a norm for clipping,
  // whose coefficient is a float) and leaves no room for a lost or doubled element.
  auto total = device_ops::make_scalars<double>(1);
  auto host_total = host_ops::make_scalars<double>(1);
  const auto before = sl::host_syncs();
  for (const auto* part : {&dx, &dz}) device_ops::add_sum_squares(cspan(*part), total.data());
  device_ops::add_sum_squares(std::span<const float>(), total.data());
  CHECK(sl::host_syncs() == before);  // nothing waits
  for (const auto* part : {&x, &z}) host_ops::add_sum_squares(std::span<const float>(*part), host_total.data());
  CHECK(fetch(cspan(total), f.stream)[0] == Approx(host_total[0]).epsilon(1e-6));

  // Units with a non-finite gradient are counted, each once however many it holds.
  auto count = device_ops::make_scalars<float>(1);
  auto host_count = host_ops::make_scalars<float>(1);
  std::vector<sl::cuda::device_buffer<float>> parts;
  std::vector<std::vector<float>> host_parts;
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    for (std::size_t at : {std::size_t{0}, z.size() / 2, z.size() - 1}) {
      auto y = z;
      y[at] = bad;
      y[(at + 1) % y.size()] = bad;
      host_parts.push_back(y);
      parts.push_back(upload(y, f.stream));
    }
  }
  host_parts.push_back(z);
  parts.push_back(upload(z, f.stream));
  const auto counting = sl::host_syncs();
  for (const auto& p : parts) device_ops::add_nonfinite(cspan(p), count.data());
  device_ops::add_nonfinite(std::span<const float>(), count.data());
  CHECK(sl::host_syncs() == counting);
  for (const auto& p : host_parts) host_ops::add_nonfinite(std::span<const float>(p), host_count.data());
  CHECK(host_count[0] == 9.0f);
  CHECK(fetch(cspan(count), f.stream)[0] == 9.0f);

  // wait_for_reads: the copies issued before it are complete, and it is one counted wait.
  double read = -1;
  device_ops::issue_to_host(cspan(total), std::span<double>(&read, 1));
  const auto waiting = sl::host_syncs();
  device_ops::wait_for_reads();
  CHECK(sl::host_syncs() == waiting + 1);
  CHECK(read == Approx(host_total[0]).epsilon(1e-6));
}

TEMPLATE_TEST_CASE("initialize writes nn::initialize_range's values, in chunks", "[cuda][space_ops]", float, double) {
  if (!have_device()) return;
  using T = TestType;
  device_fixture f;
  // A weight larger than the staging chunk (2^22 elements), a bias, a constant,
  // 16-aligned as nn::flatten lays them out.
  sl::nn::flat_layout layout;
  layout.entries.push_back({"blocks.0.weight", sl::Shape{2048, 2100}, sl::nn::init_rule::linear_default(2100), 0});
  layout.entries.push_back({"blocks.0.bias", sl::Shape{2048}, sl::nn::init_rule::normal_with(0.0, 0.02), 4300800});
  layout.entries.push_back({"norm.weight", sl::Shape{77}, sl::nn::init_rule::constant_one(), 4302848});
  layout.numel = 4302925;
  const std::uint64_t seed = 1234;
  for (std::size_t first : {std::size_t{0}, std::size_t{12345}}) {
    INFO("first " << first);
    const std::size_t count = layout.numel - first + 100;  // runs into the zero padding after the last parameter
    auto out = poisoned<T>(count, f.stream);
    device_ops::initialize(layout, seed, first, out.span());
    std::vector<T> want(count);
    host_ops::initialize(layout, seed, first, std::span<T>(want));
    require_same_bits(fetch(cspan(out), f.stream), want);
  }
}

TEST_CASE("all_reduce_values and all_gather_values go through an NcclComm at world size 1", "[cuda][space_ops][nccl]") {
  if (!have_device()) return;
  device_fixture f;
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  const sl::comm::NcclComm base(id, 0, 1, 0);
  // The engine's setting (the communicator on the current stream), and one left
  // on the legacy default stream: the values are staged on its stream instead.
  for (bool on_current : {true, false}) {
    INFO("communicator on the current stream: " << on_current);
    sl::comm::NcclComm comm = on_current ? base.on(f.stream.get()) : base;

    std::vector<double> norms = {3.5, 0.5, 1e300, 7.25};
    const auto want_norms = norms;
    for (auto op : {sl::comm::reduce_op::sum, sl::comm::reduce_op::max, sl::comm::reduce_op::avg}) {
      INFO("op " << sl::comm::name(op));
      device_ops::all_reduce_values(comm, std::span<double>(norms), op);
      require_same_bits(norms, want_norms);
    }
    std::vector<std::int64_t> flags = {1, 0, -5};
    device_ops::all_reduce_values(comm, std::span<std::int64_t>(flags), sl::comm::reduce_op::sum);
    CHECK(flags == std::vector<std::int64_t>{1, 0, -5});

    const std::vector<std::int64_t> hashes = {0x0123456789ABCDEF, -1, 42};
    std::vector<std::int64_t> all(3, 0);
    device_ops::all_gather_values(comm, std::span<const std::int64_t>(hashes), std::span<std::int64_t>(all));
    CHECK(all == hashes);
    std::vector<float> floats_all(1, NAN);
    const std::vector<float> mine = {2.5f};
    device_ops::all_gather_values(comm, std::span<const float>(mine), std::span<float>(floats_all));
    CHECK(floats_all == mine);

    std::vector<std::int64_t> too_many(4);
    CHECK_THROWS_WITH(
        device_ops::all_gather_values(comm, std::span<const std::int64_t>(hashes), std::span<std::int64_t>(too_many)),
        Catch::Contains("rank 0: all_gather_values of 3 values per rank over 1 ranks needs 3 outputs, got 4"));
  }
}

namespace {

// Each buffer of a device optimizer's state against the host state's of that name: within
// 1e-5 relative and atol.at(name) absolute. Returns how many buffers there were.
template <class HostState, class DevState>
std::size_t require_states_close(HostState& hstate, DevState& dstate, const std::map<std::string, double>& atol,
                                 cudaStream_t stream) {
  std::map<std::string, std::vector<float>> host_buffers;
  hstate.for_each_buffer([&](std::string_view name, sl::Buffer<float>& b) {
    host_buffers[std::string(name)].assign(b.data(), b.data() + b.size());
  });
  dstate.for_each_buffer([&](std::string_view name, sl::Buffer<float, sl::cuda_space>& b) {
    INFO(name);
    require_close(fetch(std::span<const float>(b.span()), stream), host_buffers.at(std::string(name)), 1e-5,
                  atol.at(std::string(name)));
  });
  return host_buffers.size();
}

// Ten steps of a host optimizer and of its device twin from the same state, the device's
// params starting `offset` elements into their buffer (1: the kernel's unaligned path), the
// learning rate changed half way. With H not void, the device step also writes the compute
// copy, which must equal its own new parameters rounded to H. nvcc fuses multiply-adds where
// g++ may not: the parameters and each state buffer within 1e-5 relative and, absolute, the
// few ulps of their scale that `atol` gives by name ("params" and each buffer's).
template <class G, class H, class Host, class Dev>
void check_device_optimizer(Host host, Dev dev, const std::map<std::string, double>& atol, std::size_t offset,
                            device_fixture& f, random_inputs& rnd) {
  constexpr std::size_t count = 10007;  // not a multiple of 4: the vector path has a tail
  const double lr = host.options.lr;
  auto p_host = rnd.normal(count);
  auto hstate = host.make_state(count);
  auto dstate = dev.make_state(count);

  std::vector<std::string> host_names, dev_names;
  hstate.for_each_buffer([&](std::string_view name, sl::Buffer<float>&) { host_names.emplace_back(name); });
  dstate.for_each_buffer([&](std::string_view name, sl::Buffer<float, sl::cuda_space>& b) {
    dev_names.emplace_back(name);
    CHECK(b.kind() == sl::category::optimizer_state);
    CHECK(fetch(std::span<const float>(b.span()), f.stream) == std::vector<float>(count, 0.0f));
  });
  REQUIRE(dev_names == host_names);

  std::vector<float> padded(offset, 0.0f);
  padded.insert(padded.end(), p_host.begin(), p_host.end());
  auto dp = upload(padded, f.stream);
  const std::span<float> params = dp.span().subspan(offset);
  constexpr bool with_copy = !std::is_void_v<H>;
  using C = std::conditional_t<with_copy, H, sl::bfloat16>;
  auto copy = poisoned<C>(count + offset, f.stream);
  for (int step = 0; step < 10; ++step) {
    if (step == 5) host.options.lr = dev.options.lr = lr / 2;
    const auto g = as<G>(rnd.normal(count, 0.1f));
    host.step(std::span<float>(p_host), std::span<const G>(g), hstate);
    std::vector<G> padded_g(offset, G(0.0f));
    padded_g.insert(padded_g.end(), g.begin(), g.end());
    const auto dg = upload(padded_g, f.stream);
    const auto grads = cspan(dg).subspan(offset);
    if constexpr (with_copy) dev.step(params, grads, dstate, copy.span().subspan(offset));
    else dev.step(params, grads, dstate);
  }
  REQUIRE(dstate.step == hstate.step);
  REQUIRE(dstate.step == 10);

  const auto p_all = fetch(cspan(dp), f.stream);
  const std::vector<float> p_dev(p_all.begin() + std::ptrdiff_t(offset), p_all.end());
  require_close(p_dev, p_host, 1e-5, atol.at("params"));
  require_states_close(hstate, dstate, atol, f.stream);
  if constexpr (with_copy) {
    const auto c_all = fetch(cspan(copy), f.stream);
    const std::vector<C> c(c_all.begin() + std::ptrdiff_t(offset), c_all.end());
    require_same_bits(c, as<C>(p_dev));
  }
}

// Adam's scales: g ~ 0.1, so m ~ 1e-2 and v ~ 1e-5.
const std::map<std::string, double> adam_atol{
    {"params", 1e-7}, {"exp_avg", 1e-8}, {"exp_avg_sq", 1e-11}, {"max_exp_avg_sq", 1e-11}};
template <sl::optim::decay_style Style, class G, class H>
void check_device_adam(const typename sl::optim::BasicAdam<Style>::options_type& options, std::size_t offset,
                       device_fixture& f, random_inputs& rnd) {
  check_device_optimizer<G, H>(sl::optim::BasicAdam<Style>{options}, sl::optim::cuda::BasicAdam<Style>{options},
                               adam_atol, offset, f, rnd);
}

}  // namespace

TEST_CASE("device Adam and AdamW follow the host optimizers over ten steps", "[cuda][optim]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  using sl::optim::decay_style;
  for (std::size_t offset : {0, 1}) {  // aligned: 16-byte vectors; offset by one: element by element
    INFO("offset " << offset);
    {
      INFO("Adam, fp32 gradients, bf16 compute copy");
      check_device_adam<decay_style::l2, float, sl::bfloat16>({.lr = 1e-2}, offset, f, rnd);
    }
    {
      INFO("AdamW, bf16 gradients, fp16 compute copy");
      check_device_adam<decay_style::decoupled, sl::bfloat16, sl::half>({.lr = 1e-2, .weight_decay = 0.1}, offset, f,
                                                                        rnd);
    }
    {
      INFO("Adam with L2 decay and amsgrad, bf16 gradients, no copy");
      check_device_adam<decay_style::l2, sl::bfloat16, void>({.lr = 1e-3, .weight_decay = 0.01, .amsgrad = true},
                                                             offset, f, rnd);
    }
    {
      INFO("AdamW, fp32 gradients, no copy");
      check_device_adam<decay_style::decoupled, float, void>({.lr = 1e-2}, offset, f, rnd);
    }
  }
}

namespace {

// A shard holding frozen parameters, six steps of which those in [gated_from, gated_to) are
// gated (the later ones go through the gate's always-0 flag) and those in `cancelled` are
// cancelled: its runs but the frozen ones step as the host's step_unfrozen steps them over
// the steps taken, with a state of their elements only (each buffer within 1e-5 relative and
// `atol` by name), and the frozen runs' parameters and compute copy stay exactly as they were.
template <class Host, class Dev>
void check_gated_runs(Host host, Dev dev, const std::map<std::string, double>& atol, int gated_from, int gated_to,
                      const std::vector<int>& cancelled) {
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  using sl::optim::segment;
  const std::size_t count = 1003;
  const std::vector<segment> runs{{0, 301, 0}, {301, 99, segment::frozen}, {400, 600, 0}, {1000, 3, segment::frozen}};
  auto p_host = rnd.normal(count);
  const auto initial = p_host;
  const std::size_t trained = sl::optim::trained_size(runs);
  REQUIRE(trained == count - 102);
  auto hstate = host.make_state(trained);
  auto dstate = dev.make_state(trained);
  auto dp = upload(p_host, f.stream);
  auto copy = poisoned<sl::bfloat16>(count, f.stream);
  const auto poison = fetch(cspan(copy), f.stream);
  const std::vector<double> zero{0.0}, one{1.0};
  auto skip = upload(zero, f.stream);
  for (int step = 0; step < 6; ++step) {
    const auto g = rnd.normal(count, 0.1f);
    const auto dg = upload(g, f.stream);
    const bool gated = step >= gated_from && step < gated_to;
    const bool cancel = std::find(cancelled.begin(), cancelled.end(), step) != cancelled.end();
    if (gated) sl::cuda::copy_async(skip.span(), std::span<const double>(cancel ? one : zero), f.stream);
    dev.step(dp.span(), cspan(dg), dstate, copy.span(), runs, sl::optim::skip_flag{gated ? skip.data() : nullptr});
    if (!cancel) sl::optim::step_unfrozen(host, std::span<float>(p_host), std::span<const float>(g), hstate, runs);
  }
  dstate.settle();
  CHECK(hstate.step == 6 - std::int64_t(cancelled.size()));
  CHECK(dstate.step == hstate.step);
  const auto p_dev = fetch(cspan(dp), f.stream);
  require_close(p_dev, p_host, 1e-5, atol.at("params"));
  CHECK(require_states_close(hstate, dstate, atol, f.stream) > 0);
  const auto c_dev = fetch(cspan(copy), f.stream);
  std::size_t frozen = 0;
  for (const auto& r : runs)
    for (std::size_t i = r.begin; i < r.begin + r.size; ++i) {
      const bool is_frozen = r.group == segment::frozen;
      frozen += is_frozen;
      CHECK((std::memcmp(&p_dev[i], &initial[i], sizeof(float)) == 0) == is_frozen);
      CHECK((std::memcmp(&c_dev[i], &poison[i], sizeof(sl::bfloat16)) == 0) == is_frozen);  // the rest's copy written
    }
  CHECK(frozen == 102);
}

}  // namespace

// AdamW's step 3 cancelled, gated from step 2; SGD's first and fourth, gated until the last:
// its momentum buffer starts at the first step taken (PyTorch's buffer is the first gradient
// it sees; dampened, so that a later step's (1 - dampening) g would differ).
TEST_CASE("device optimizers over runs step the rest as the host does, gated or not, and leave frozen runs alone",
          "[cuda][optim][frozen]") {
  if (!have_device()) return;
  {
    INFO("AdamW");
    const sl::optim::AdamW::options_type adamw{.lr = 1e-2, .weight_decay = 0.1};
    check_gated_runs(sl::optim::AdamW{adamw}, sl::optim::cuda::AdamW{adamw}, adam_atol, 2, 6, {3});
  }
  {
    INFO("SGD");
    const sl::optim::SGD::options_type sgd{.lr = 1e-2, .momentum = 0.9, .dampening = 0.5, .weight_decay = 0.1};
    check_gated_runs(sl::optim::SGD{sgd}, sl::optim::cuda::SGD{sgd}, {{"params", 1e-8}, {"momentum_buffer", 1e-8}}, 0,
                     5, {0, 3});
  }
}

TEST_CASE("device Adam refuses what the host one refuses, naming what is wrong", "[cuda][optim]") {
  if (!have_device()) return;
  device_fixture f;
  sl::optim::cuda::Adam plain{};
  auto state = plain.make_state(8);
  auto p = poisoned<float>(8, f.stream);
  auto g = poisoned<float>(7, f.stream);
  CHECK_THROWS_WITH(plain.step(p.span(), cspan(g), state), Catch::Contains("gradients has 7 entries, the parameters 8"));
  CHECK(state.step == 0);

  sl::optim::cuda::Adam amsgrad{{.amsgrad = true}};
  auto g8 = poisoned<float>(8, f.stream);
  CHECK_THROWS_WITH(amsgrad.step(p.span(), cspan(g8), state), Catch::Contains("amsgrad is set but the state was made"));
  sl::optim::cuda::Adam bad_lr{{.lr = -1}};
  CHECK_THROWS_WITH(bad_lr.step(p.span(), cspan(g8), state), Catch::Contains("invalid learning rate"));
  CHECK(state.step == 0);
}

namespace {

// SGD's scales: steps of lr g ~ 1e-3, a momentum buffer ~ 0.1.
template <class G, class H>
void check_device_sgd(const sl::optim::SGD::options_type& options, std::size_t offset, device_fixture& f,
                      random_inputs& rnd) {
  check_device_optimizer<G, H>(sl::optim::SGD{options}, sl::optim::cuda::SGD{options},
                               {{"params", 1e-8}, {"momentum_buffer", 1e-8}}, offset, f, rnd);
}

}  // namespace

TEST_CASE("device SGD follows the host optimizer over ten steps", "[cuda][optim][sgd]") {
  if (!have_device()) return;
  device_fixture f;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (std::size_t offset : {0, 1}) {
    INFO("offset " << offset);
    {
      INFO("plain, fp32 gradients, bf16 compute copy");
      check_device_sgd<float, sl::bfloat16>({.lr = 1e-2}, offset, f, rnd);
    }
    {
      INFO("momentum and weight decay, bf16 gradients, fp16 compute copy");
      check_device_sgd<sl::bfloat16, sl::half>({.lr = 1e-2, .momentum = 0.9, .weight_decay = 1e-2}, offset, f, rnd);
    }
    {
      INFO("Nesterov, fp32 gradients, no copy");
      check_device_sgd<float, void>({.lr = 1e-2, .momentum = 0.9, .nesterov = true}, offset, f, rnd);
    }
    {
      INFO("dampened momentum, bf16 gradients, no copy");
      check_device_sgd<sl::bfloat16, void>({.lr = 1e-2, .momentum = 0.9, .dampening = 0.25}, offset, f, rnd);
    }
  }
}

TEST_CASE("device SGD refuses what the host one refuses, naming what is wrong", "[cuda][optim][sgd]") {
  if (!have_device()) return;
  device_fixture f;
  sl::optim::cuda::SGD plain{{.lr = 1e-2}};
  auto state = plain.make_state(8);
  auto p = poisoned<float>(8, f.stream);
  auto g7 = poisoned<float>(7, f.stream), g8 = poisoned<float>(8, f.stream);
  CHECK_THROWS_WITH(plain.step(p.span(), cspan(g7), state), Catch::Contains("gradients has 7 entries, the parameters 8"));
  sl::optim::cuda::SGD momentum{{.lr = 1e-2, .momentum = 0.9}};
  CHECK_THROWS_WITH(momentum.step(p.span(), cspan(g8), state),
                    Catch::Contains("SGD (CUDA): momentum is 0.9 but the state was made with momentum 0"));
  sl::optim::cuda::SGD nesterov{{.lr = 1e-2, .momentum = 0.9, .dampening = 0.1, .nesterov = true}};
  CHECK_THROWS_WITH(nesterov.step(p.span(), cspan(g8), state), Catch::Contains("Nesterov momentum requires"));
  CHECK(state.step == 0);
}

// --- pending values and a train_step that does not wait ---------------------------------------

// On the host (no GPU needed): a pending value is read once, by whichever copy is
// read first; before_wait runs between the reader's copies and its wait; a reader's
// error comes back at every access; host values cost nothing.
TEST_CASE("pending: host values are resolved, deferred ones read once, errors kept", "[pending]") {
  const sl::pending<float> host = 2.5f;
  CHECK(host.ready());
  CHECK(host.device() == nullptr);
  CHECK(float(host) == 2.5f);

  int reads = 0;
  std::vector<std::string> order;
  const float slot = 7.0f;  // stands for the device address
  sl::pending<float> later([&](const std::function<void()>& before_wait) {
    ++reads;
    order.push_back("copy");
    before_wait();
    order.push_back("wait");
    return slot;
  }, &slot);
  const auto copy = later;
  CHECK(!later.ready());
  CHECK(later.device() == &slot);
  CHECK(reads == 0);
  CHECK(copy.get_with([&] { order.push_back("mine"); }) == 7.0f);
  CHECK(order == std::vector<std::string>{"copy", "mine", "wait"});
  CHECK(float(later) == 7.0f);  // the copy's read served both
  CHECK(later.ready());
  CHECK(later.device() == nullptr);
  CHECK(reads == 1);
  bool ran = false;
  CHECK(later.get_with([&] { ran = true; }) == 7.0f);  // resolved: before_wait still runs, nothing is read
  CHECK(ran);
  CHECK(reads == 1);

  sl::pending<float> failing([&](const std::function<void()>&) -> float {
    ++reads;
    throw sl::shape_error("cross_entropy: target 9 in row 1 is out of range");
  }, nullptr);
  CHECK_THROWS_WITH(failing.get(), Catch::Contains("target 9 in row 1"));
  CHECK_THROWS_AS(failing.get(), sl::shape_error);  // the same error again, not a second read
  CHECK(reads == 2);
  CHECK(!failing.ready());
}

namespace {

// A two-layer classifier on GPU 0 under FullShard over an NcclComm of one rank (the
// communicator whose collectives only order streams), each Linear a unit.
template <class C>
using device_mlp = sl::nn::Sequential<sl::nn::Linear<C, sl::cuda_space>, sl::nn::ReLU<C, sl::cuda_space>,
                                      sl::nn::Linear<C, sl::cuda_space>>;
constexpr std::int64_t mlp_rows = 16, mlp_in = 24, mlp_hidden = 32, mlp_classes = 5;

// Each run has its own stream, current only inside its calls, so that two runs
// can alternate on one thread.
inline sl::comm::NcclComm single_rank_nccl(cudaStream_t s) {
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  return sl::comm::NcclComm(id, 0, 1, 0).on(s);
}

// The optimizer a run steps with: Adam, or SGD with dampened momentum (a buffer that its
// first step taken starts as that step's gradient, undampened).
template <class Opt>
Opt run_optimizer() {
  if constexpr (std::is_same_v<Opt, sl::optim::cuda::SGD>) return {{.lr = 1e-2, .momentum = 0.9, .dampening = 0.5}};
  else return {{.lr = 1e-2}};
}

template <class C, class Opt = sl::optim::cuda::Adam>
struct mlp_run {
  using layer = sl::nn::Linear<C, sl::cuda_space>;
  using sharded_type = sl::shard::ShardedModel<device_mlp<C>, sl::comm::NcclComm, sl::shard::FullShard, float, Opt>;
  sl::cuda::stream stream{0};
  sl::comm::NcclComm comm = single_rank_nccl(stream.get());
  device_mlp<C> model{layer(mlp_in, mlp_hidden), sl::nn::ReLU<C, sl::cuda_space>{}, layer(mlp_hidden, mlp_classes)};
  Opt opt = run_optimizer<Opt>();
  std::optional<sharded_type> sharded;

  // fp16's scale starts low enough that this model's gradients never overflow, unless
  // given; the parameters named in `frozen` are frozen (requires_grad = false), with or
  // without fp32 masters and gradient storage (options.frozen_masters, frozen_grads).
  explicit mlp_run(float scale = 256.f, const std::vector<std::string>& frozen = {}, bool frozen_masters = true,
                   bool frozen_grads = true) {
    sl::cuda::stream_scope scope(stream.get());
    model.parameters([&](std::string_view name, auto& p) {
      p.requires_grad = std::find(frozen.begin(), frozen.end(), name) == frozen.end();
    });
    sl::shard::mixed_precision precision{};
    if constexpr (!std::is_same_v<C, float>) precision = {.param = sl::dtype_of<C>, .reduce = sl::dtype::f32};
    sharded.emplace(model, comm, sl::shard::FullShard{},
                    sl::shard::options{.wrap = sl::shard::wrap_types<layer>{},
                                       .seed = 3,
                                       .precision = precision,
                                       .scaler = {.scale = scale},
                                       .frozen_masters = frozen_masters,
                                       .frozen_grads = frozen_grads});
  }

  // Step s's batch, drawn from s alone, so that two runs see the same data; the
  // uploads are complete on return (they are not the step's).
  std::pair<sl::Tensor<C, sl::cuda_space>, sl::Tensor<std::int64_t, sl::cuda_space>> batch(int s,
                                                                                           std::int64_t bad_row = -1) {
    sl::cuda::stream_scope scope(stream.get());
    random_inputs rnd{.seed = std::uint32_t(100 + s)};
    const auto x = as<C>(rnd.normal(std::size_t(mlp_rows * mlp_in)));
    sl::Tensor<C> hx(sl::Shape{mlp_rows, mlp_in});
    std::copy(x.begin(), x.end(), hx.data());
    sl::Tensor<std::int64_t> hy(sl::Shape{mlp_rows});
    for (std::int64_t r = 0; r < mlp_rows; ++r) hy[r] = (r * 7 + s) % mlp_classes;
    if (bad_row >= 0) hy[bad_row] = mlp_classes + 2;
    auto out = std::pair(sl::cuda::to_device(hx), sl::cuda::to_device(hy));
    sl::cuda::check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize (the batch uploaded)");
    return out;
  }
  sl::shard::pending_step_result step(int s, const sl::shard::step_options& so = {}, std::int64_t bad_row = -1) {
    auto [x, y] = batch(s, bad_row);
    sl::cuda::stream_scope scope(stream.get());
    return sharded->train_step(opt, x, y, sl::nn::cross_entropy, so);
  }
};

// Holds a stream until the host opens it (a flag in mapped pinned memory), or until
// `limit_ns` have passed, and then records whether it gave up: a host that waits for
// the stream while the gate is closed makes it give up.
template <class Flag>
__global__ void gate_kernel(volatile Flag* open, long long limit_ns, int* gave_up) {
  using clock = cuda::std::chrono::system_clock;  // the global timer in device code
  const auto start = clock::now();
  do {
    if (*open) {
      *gave_up = 0;
      return;
    }
  } while (cuda::std::chrono::duration_cast<cuda::std::chrono::nanoseconds>(clock::now() - start).count() < limit_ns);
  *gave_up = 1;
}

}  // namespace

TEST_CASE("a device train_step waits for the device only when its loss is read", "[cuda][engine][pending]") {
  if (!have_device()) return;
  // a reads every loss at once, b reads its losses after the last step; both train
  // on one batch, so that the losses fall from step to step
  mlp_run<float> a, b;
  std::vector<float> read_at_once;
  std::vector<sl::pending<float>> read_later;
  (void)float(a.step(0));  // the first step allocates (and may wait for that)
  (void)float(b.step(0));
  for (int s = 0; s < 4; ++s) {
    read_at_once.push_back(a.step(0));
    const auto before = sl::host_syncs();
    auto r = b.step(0);
    CHECK(sl::host_syncs() - before == 0);  // forward, loss, backward, reductions, Adam: no wait
    CHECK(!r.loss.ready());
    CHECK(!r.skipped);
    CHECK(!r.grad_norm);
    read_later.push_back(r.loss);
  }
  for (int s = 0; s < 4; ++s) {
    INFO("step " << s);
    const auto before = sl::host_syncs();
    const float loss = read_later[std::size_t(s)];
    CHECK(sl::host_syncs() - before == 1);  // one wait, the report read with the loss
    CHECK(float(read_later[std::size_t(s)]) == loss);
    CHECK(sl::host_syncs() - before == 1);  // read once
    CHECK(std::isfinite(loss));
    CHECK(loss == read_at_once[std::size_t(s)]);  // the same bits, however late it is read
  }
  for (int s = 1; s < 4; ++s) CHECK(read_at_once[std::size_t(s)] < read_at_once[std::size_t(s) - 1]);  // it trains

  // This rank's own loss (no collective) is the loss function's pending value itself.
  const auto before = sl::host_syncs();
  auto local = b.step(4, {.loss = sl::shard::loss_report::local});
  CHECK(sl::host_syncs() - before == 0);
  CHECK(std::isfinite(float(local)));
  CHECK(sl::host_syncs() - before == 1);
}

// Any host wait, counted or not (an allocator, a pageable copy, a collective), would
// hold the host inside train_step until the gate in front of the step's work gives up.
TEST_CASE("a device train_step returns while its stream is still blocked", "[cuda][engine][pending]") {
  if (!have_device()) return;
  mlp_run<float> run;
  (void)float(run.step(0));  // the first step allocates (and may wait for that)
  auto [x, y] = run.batch(1);
  sl::cuda::stream_scope scope(run.stream.get());
  int* open = nullptr;
  sl::cuda::check(cudaHostAlloc(&open, sizeof(int), cudaHostAllocMapped), "cudaHostAlloc");
  *open = 0;
  sl::cuda::device_buffer<int> gave_up(1, sl::category::activations, run.stream.get());
  sl::cuda::check(cudaStreamSynchronize(run.stream.get()), "cudaStreamSynchronize");
  constexpr long long limit_ns = 3'000'000'000;  // far longer than a step of this model
  sl::ops::cuda::launch_kernel("gate_kernel", gate_kernel<int>, 1, 1, 0, run.stream.get(), open, limit_ns,
                               gave_up.data());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run.sharded->train_step(run.opt, x, y, sl::nn::cross_entropy);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *reinterpret_cast<volatile int*>(open) = 1;
  const float loss = r.loss;
  const auto flag = fetch(cspan(gave_up), run.stream.get());
  sl::cuda::check(cudaFreeHost(open), "cudaFreeHost");
  INFO("train_step took " << seconds << " s behind the gate");
  CHECK(flag[0] == 0);
  CHECK(seconds < 1.0);
  CHECK(std::isfinite(loss));
}

TEST_CASE("clipping decides on the device: the step never waits, and its loss, norm and flag come in one read",
          "[cuda][engine][pending]") {
  if (!have_device()) return;
  mlp_run<float> run;
  (void)float(run.step(0));
  for (int s = 1; s < 3; ++s) {
    const auto before = sl::host_syncs();
    auto r = run.step(s, {.max_norm = 0.5f});
    CHECK(sl::host_syncs() - before == 0);  // the decision and the clipping ran on the device
    CHECK(!r.loss.ready());
    REQUIRE(r.grad_norm);
    const float norm = *r.grad_norm;
    CHECK(sl::host_syncs() - before == 1);
    CHECK(std::isfinite(norm));
    CHECK(norm > 0.0f);
    CHECK(!r.skipped);
    CHECK(std::isfinite(float(r.loss)));
    CHECK(sl::host_syncs() - before == 1);  // one read for all three
  }
  // grad_norm() alone: the squares summed and reduced on the device, one read.
  (void)float(run.step(3));
  sl::cuda::stream_scope scope(run.stream.get());
  const auto before = sl::host_syncs();
  const double norm = run.sharded->grad_norm();
  CHECK(sl::host_syncs() - before == 1);
  CHECK(std::isfinite(norm));
}

// A frozen weight on the device, in fp32 and in bf16 layers: steps decided by the host,
// on the device (clipping: gated), and after those (through the gate's always-0 flag)
// leave it exactly as it was, and train the rest.
// With the whole first layer frozen, its unit keeps no gradients and its steps only count.
TEMPLATE_TEST_CASE("a frozen parameter stays as it was through device steps, gated or not",
                   "[cuda][engine][frozen]", float, sl::bfloat16) {
  if (!have_device()) return;
  for (const std::vector<std::string>& frozen : {std::vector<std::string>{"0.weight"}, {"0.weight", "0.bias"}}) {
    INFO(frozen.size() << " frozen");
    mlp_run<TestType> run(256.f, frozen);
    run.opt.options.weight_decay = 0.1;  // a frozen element stepped would move even with a zero gradient
    const auto before = [&] {
      sl::cuda::stream_scope scope(run.stream.get());
      return run.sharded->full_state_dict(false);
    }();
    (void)float(run.step(0));
    (void)float(run.step(1, {.max_norm = 0.05f}));
    (void)float(run.step(2));
    sl::cuda::stream_scope scope(run.stream.get());
    const auto after = run.sharded->full_state_dict(false);
    REQUIRE(after.size() == before.size());
    for (std::size_t k = 0; k < after.size(); ++k) {
      INFO(after[k].name);
      const auto a = after[k].value.span(), b = before[k].value.span();
      const bool same = std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
      CHECK(same == (std::find(frozen.begin(), frozen.end(), after[k].name) != frozen.end()));
    }
    std::size_t kept = 0;  // the frozen unit's reduced gradients
    for (const auto& u : run.sharded->units()) kept += u.frozen() ? u.grad.size() + 1 : 0;
    CHECK(kept == (frozen.size() == 2 ? 1 : 0));  // one frozen unit, no gradients
    CHECK(run.sharded->optimizer_state(run.opt, 1).step == 3);  // its steps counted
  }
}

// A unit of a frozen weight and a trained bias keeps the bias's reduced gradients alone
// (its reduction packs them: 32 of its 800 elements), and the device Adam finds them: one
// step moves every trained parameter as a run with nothing frozen does (the first step's
// gradients do not depend on the frozen weight's not moving), bit for bit; but fp32's
// first bias, whose gradient comes from the column-sum kernel where the trained weight's
// product sums it (BGRADB): Adam's first step moves it by lr g / (|g| + eps), which a
// rounding of g changes by about lr eps / |g|, a wrong gradient by up to 2 lr = 2e-2.
TEMPLATE_TEST_CASE("a device unit of frozen and trained parameters keeps its trained gradients alone",
                   "[cuda][engine][frozen]", float, sl::bfloat16) {
  if (!have_device()) return;
  mlp_run<TestType> frozen(256.f, {"0.weight"}), all(256.f);
  auto first_layer = [](auto& run) -> const auto& {
    const auto& units = run.sharded->units();
    const auto u = std::find_if(units.begin(), units.end(), [](const auto& v) { return v.name == "0"; });
    REQUIRE(u != units.end());
    return *u;
  };
  CHECK(first_layer(frozen).grad.size() == std::size_t(mlp_hidden));
  CHECK(first_layer(all).grad.size() == std::size_t(mlp_in * mlp_hidden + mlp_hidden));
  (void)float(frozen.step(0));
  (void)float(all.step(0));
  const auto got = [&] {
    sl::cuda::stream_scope scope(frozen.stream.get());
    return frozen.sharded->full_state_dict(false);
  }();
  sl::cuda::stream_scope scope(all.stream.get());
  const auto want = all.sharded->full_state_dict(false);
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    if (got[k].name == "0.weight") continue;
    INFO(got[k].name);
    const auto a = got[k].value.span(), b = want[k].value.span();
    REQUIRE(a.size() == b.size());
    if (std::is_same_v<TestType, float> && got[k].name == "0.bias") {
      std::size_t far = 0;  // NaN counts
      for (std::size_t i = 0; i < a.size(); ++i) far += std::abs(a[i] - b[i]) <= 1e-6f ? 0 : 1;
      CHECK(far == 0);
    } else {
      CHECK(std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
    }
  }
}

// options.frozen_masters = false on the device: the frozen elements of unit 0 (a wholly
// frozen unit, or a packed one: its bias trained) keep no fp32 master; the device Adam steps
// the trained runs end to end and they are rounded into the compute copy after, gated by
// fp16's vote with half. With frozen_grads = false too, backward binds no gradient storage
// for them (the device Linear skips the null grad). Training is the same bit for bit;
// frozen values read back are the compute dtype's.
TEMPLATE_TEST_CASE("without frozen masters a device model trains the same bit for bit", "[cuda][engine][frozen]",
                   sl::bfloat16, sl::half) {
  if (!have_device()) return;
  // half also from a scale whose first steps overflow: cancelled on the device, then taken
  const std::vector<float> scales = std::is_same_v<TestType, sl::half> ? std::vector<float>{256.f, 16777216.f}
                                                                       : std::vector<float>{256.f};
  for (const float scale : scales)
  for (const std::vector<std::string>& frozen : {std::vector<std::string>{"0.weight"}, {"0.weight", "0.bias"}}) {
    INFO(frozen.size() << " frozen, scale " << scale);
    mlp_run<TestType> with(scale, frozen, true), without(scale, frozen, false, false);
    std::size_t masters = 0;  // fp32 elements unit 0 keeps without frozen masters
    for (const auto& u : without.sharded->units())
      if (u.name == "0") {
        masters = u.trained_master.size() + (u.master ? u.master->local().size() : 0);
        CHECK(u.local_trained_only());
        CHECK(u.local_size == masters);  // backward's gradients: the bias's alone, or none
      }
    CHECK(masters == (frozen.size() == 2 ? 0 : std::size_t(mlp_hidden)));
    const int steps = scale > 256.f ? 8 : 3;
    for (int s = 0; s < steps; ++s) {
      const sl::shard::step_options so{.max_norm = s == 1 ? 0.05f : 0.f};
      (void)float(with.step(s, so));
      (void)float(without.step(s, so));
    }
    long skipped = 0;
    const auto want = [&] {
      sl::cuda::stream_scope scope(with.stream.get());
      if (scale > 256.f) skipped = with.sharded->scaler()->skipped;
      return with.sharded->full_state_dict(false);
    }();
    sl::cuda::stream_scope scope(without.stream.get());
    if (scale > 256.f) {  // some steps were cancelled, and some taken, alike
      CHECK(skipped >= 1);
      CHECK(skipped < steps);
      CHECK(without.sharded->scaler()->skipped == skipped);
    }
    const auto got = without.sharded->full_state_dict(false);
    REQUIRE(got.size() == want.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      INFO(got[k].name);
      const bool is_frozen = std::find(frozen.begin(), frozen.end(), got[k].name) != frozen.end();
      const auto a = got[k].value.span(), b = want[k].value.span();
      REQUIRE(a.size() == b.size());
      std::size_t differ = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        const float expected = is_frozen ? float(TestType(b[i])) : b[i];
        differ += std::memcmp(&a[i], &expected, sizeof(float)) != 0;
      }
      CHECK(differ == 0);
    }
  }
}

// half compute with fp16 loss scaling: the overflow vote, the skip decision and the
// scaler's update stay on the device; scaler() and the optimizer's step count read them.
TEST_CASE("fp16 loss scaling decides on the device: no wait per step", "[cuda][engine][pending][f16]") {
  if (!have_device()) return;
  mlp_run<sl::half> run;
  REQUIRE(run.sharded->scaler());
  (void)float(run.step(0));  // the first step allocates (and may wait for that)
  for (int s = 1; s < 4; ++s) {
    INFO("step " << s);
    const auto before = sl::host_syncs();
    auto r = run.step(s);
    CHECK(sl::host_syncs() - before == 0);
    CHECK(!r.loss.ready());
    CHECK(!r.skipped);
    CHECK(std::isfinite(float(r.loss)));
    CHECK(sl::host_syncs() - before == 1);
  }
  sl::cuda::stream_scope scope(run.stream.get());
  const auto before = sl::host_syncs();
  CHECK(run.sharded->scaler()->good_steps == 4);
  CHECK(sl::host_syncs() - before == 1);
  CHECK(run.sharded->optimizer_state(run.opt, 0).step == 4);
}

// Every unit's master piece, in unit order.
template <class C, class Opt>
std::vector<float> all_masters(mlp_run<C, Opt>& run) {
  sl::cuda::stream_scope scope(run.stream.get());
  std::vector<float> all;
  for (std::size_t i = 0; i < run.sharded->unit_count(); ++i) {
    const auto piece = fetch(run.sharded->master_piece(i), run.stream.get());
    all.insert(all.end(), piece.begin(), piece.end());
  }
  return all;
}

// A scale of 2^24 makes the loss gradient itself overflow fp16 (1/16 * 2^24 > 65504):
// the device cancels those steps, leaving masters, optimizer state and the step count as
// they were, until the scale has backed off far enough. Adam's and SGD's (whose momentum
// buffer the first step taken starts).
TEMPLATE_TEST_CASE("fp16 steps that overflow are cancelled on the device, as the host skips them",
                   "[cuda][engine][pending][f16]", sl::optim::cuda::Adam, sl::optim::cuda::SGD) {
  if (!have_device()) return;
  using run_type = mlp_run<sl::half, TestType>;
  run_type run(16777216.f);
  const auto initial = all_masters(run);
  std::vector<sl::shard::pending_step_result> results;
  for (int s = 0; s < 14; ++s) results.push_back(run.step(s));
  int skipped = 0;
  while (skipped < int(results.size()) && bool(results[std::size_t(skipped)].skipped)) ++skipped;
  INFO(skipped << " steps skipped before the first taken");
  REQUIRE(skipped >= 1);
  REQUIRE(skipped < int(results.size()));
  for (std::size_t s = std::size_t(skipped); s < results.size(); ++s) CHECK(!results[s].skipped);  // it has backed off
  sl::cuda::stream_scope scope(run.stream.get());
  const auto scaler = *run.sharded->scaler();
  CHECK(scaler.skipped == skipped);
  CHECK(scaler.scale == 16777216.f / float(1 << skipped));  // no growth: 2000 good steps are far away
  CHECK(scaler.skipped_in_row == 0);
  for (std::size_t i = 0; i < run.sharded->unit_count(); ++i)
    CHECK(run.sharded->optimizer_state(run.opt, i).step == std::int64_t(results.size()) - skipped);
  const auto trained = all_masters(run);
  CHECK(trained != initial);  // the steps taken moved them
  // As a run that starts at the backed-off scale on the same batches: the cancelled steps
  // changed nothing, and the step number counts only the steps taken (Adam's bias
  // corrections, SGD's first step, which starts the buffer).
  run_type fresh(16777216.f / float(1 << skipped));
  for (int s = skipped; s < int(results.size()); ++s) CHECK(!fresh.step(s).skipped);
  CHECK(trained == all_masters(fresh));

  // Cancelled from the start: nothing moves.
  run_type stuck(16777216.f);
  const auto before = [&] {
    sl::cuda::stream_scope s(stuck.stream.get());
    return fetch(stuck.sharded->master_piece(1), stuck.stream.get());
  }();
  CHECK(bool(stuck.step(0).skipped));
  sl::cuda::stream_scope s2(stuck.stream.get());
  CHECK(fetch(stuck.sharded->master_piece(1), stuck.stream.get()) == before);
  stuck.sharded->optimizer_state(stuck.opt, 1).for_each_buffer([&](std::string_view name, auto& b) {
    INFO(name);
    const auto values = fetch(std::span<const float>(b.span()), stuck.stream.get());
    CHECK(!values.empty());
    CHECK(values == std::vector<float>(values.size(), 0.f));
  });
  CHECK(stuck.sharded->optimizer_state(stuck.opt, 1).step == 0);
}

// The device finds a bad target without the host waiting: the step returns, and the
// loss's read raises the host's error (the host raises it inside train_step).
TEST_CASE("a bad target is raised when the device loss is read", "[cuda][engine][pending]") {
  if (!have_device()) return;
  mlp_run<float> run;
  (void)float(run.step(0));
  const auto before = sl::host_syncs();
  auto r = run.step(1, {}, 3);
  CHECK(sl::host_syncs() - before == 0);
  const std::string message = "cross_entropy: target 7 in row 3 is out of range for 5 classes (ignore_index is -100)";
  CHECK_THROWS_WITH(float(r.loss), message);
  CHECK_THROWS_AS(float(r.loss), sl::shape_error);  // kept: every read raises it
  // With clipping the device decides too: the step returns, and every field's read raises.
  const auto before_clipped = sl::host_syncs();
  auto clipped = run.step(2, {.max_norm = 1.0f}, 3);
  CHECK(sl::host_syncs() - before_clipped == 0);
  CHECK_THROWS_WITH(bool(clipped.skipped), message);
  CHECK_THROWS_WITH(float(*clipped.grad_norm), message);
}

// The Embedding checks its ids on the device too: its report is read with the loss,
// in the same single wait, and a bad id is raised there with the host's message.
TEST_CASE("a device train_step through an Embedding waits only when its loss is read", "[cuda][engine][pending]") {
  if (!have_device()) return;
  using Emb = sl::nn::Embedding<float, sl::cuda_space>;
  using Lin = sl::nn::Linear<float, sl::cuda_space>;
  using Model = sl::nn::Sequential<Emb, sl::nn::MeanPool<float, sl::cuda_space>, Lin>;
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope(stream.get());
  sl::comm::NcclComm comm = single_rank_nccl(stream.get());
  Model model{Emb(10, 8), sl::nn::MeanPool<float, sl::cuda_space>(1), Lin(8, 3)};  // the mean over positions
  sl::optim::cuda::Adam adam{{.lr = 1e-2}};
  sl::shard::ShardedModel<Model, sl::comm::NcclComm, sl::shard::FullShard, float, sl::optim::cuda::Adam> sharded(
      model, comm, sl::shard::FullShard{}, sl::shard::options{.seed = 3});
  sl::Tensor<std::int64_t> ids(sl::Shape{4, 5}), targets(sl::Shape{4});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = (i * 3) % 10;
  for (std::int64_t r = 0; r < 4; ++r) targets[r] = r % 3;
  const auto y = sl::cuda::to_device(targets);
  auto x = sl::cuda::to_device(ids);
  (void)float(sharded.train_step(adam, x, y, sl::nn::cross_entropy).loss);  // the first step allocates
  sl::cuda::check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");

  auto before = sl::host_syncs();
  auto r = sharded.train_step(adam, x, y, sl::nn::cross_entropy);
  CHECK(sl::host_syncs() - before == 0);
  CHECK(std::isfinite(float(r.loss)));
  CHECK(sl::host_syncs() - before == 1);

  ids[7] = 12;
  x = sl::cuda::to_device(ids);
  sl::cuda::check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");
  before = sl::host_syncs();
  auto bad = sharded.train_step(adam, x, y, sl::nn::cross_entropy);
  CHECK(sl::host_syncs() - before == 0);
  CHECK_THROWS_WITH(float(bad.loss),
                    "Embedding(10, 8): id 12 at position [1, 2] of the input [4, 5] is out of range for a table of "
                    "10 rows");
}

}  // namespace test_cuda_engine
