// tests/support/negated_space.hpp — a host memory space that behaves like a separate
// memory, for testing on the host what device memory needs: negated_space holds every
// value with its sign bit flipped (integers bitwise inverted), so host code that reads
// or writes it in place, instead of through space_ops<negated_space>'s copies, sees
// wrong values and writes wrong files. Around it: the engine's space_ops (counting the
// copies to and from the host, with an injectable failure), a communicator over it
// (ThreadComm underneath, reductions on the decoded values, as device_thread_comm does
// over device memory), a Linear layer and an Adam over state in any space, written
// once for host_space and negated_space so that both compute the same bits.
#pragma once
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/thread_comm.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/memory_space.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/optimizer.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/space_ops.hpp"
#include "shardlib/shard/step_decision.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace negated {

using namespace shardlib;

struct negated_space {
  static constexpr std::string_view name = "negated (test)";
  static constexpr std::size_t alignment = host_space::alignment;
  static void* allocate(std::size_t bytes) { return host_space::allocate(bytes); }
  static void deallocate(void* p, std::size_t bytes) noexcept { host_space::deallocate(p, bytes); }
};

// The stored form of a value and back (an involution): floats with the sign bit
// flipped, integers inverted.
template <class T>
T flip(T x) {
  if constexpr (std::is_same_v<T, float>) return std::bit_cast<float>(std::bit_cast<std::uint32_t>(x) ^ 0x80000000u);
  else if constexpr (std::is_same_v<T, double>)
    return std::bit_cast<double>(std::bit_cast<std::uint64_t>(x) ^ 0x8000000000000000ull);
  else if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, half>)
    return std::bit_cast<T>(std::uint16_t(std::bit_cast<std::uint16_t>(x) ^ 0x8000u));
  else {
    static_assert(std::integral<T>, "negated_space holds floats and integers");
    return T(~x);
  }
}

// How a layer written once for both spaces reads and writes its memory.
template <class Space>
struct codec {
  template <class T>
  static T get(const T* p, std::int64_t i) {
    if constexpr (std::is_same_v<Space, negated_space>) return flip(p[i]);
    else return p[i];
  }
  template <class T>
  static void put(T* p, std::int64_t i, T v) {
    if constexpr (std::is_same_v<Space, negated_space>) p[i] = flip(v);
    else p[i] = v;
  }
};

// Copies between negated_space and the host (space_ops' to_host and from_host, the
// offload channel's both ways): calls and elements, and a failure injected at the
// n-th copy from now (1: the next).
struct copy_counts {
  std::atomic<std::size_t> to_host{0}, to_host_elements{0}, from_host{0}, from_host_elements{0};
  std::atomic<std::size_t> reads{0};  // space_ops' issue_to_host: the host reading per-step scalars
  std::atomic<int> fail_at{0};
  void reset() {
    to_host = to_host_elements = from_host = from_host_elements = reads = 0;
    fail_at = 0;
  }
};
inline copy_counts& counts() {
  static copy_counts c;
  return c;
}

namespace detail {
inline void maybe_fail(const char* op) {
  if (counts().fail_at > 0 && --counts().fail_at == 0)
    throw shardlib::error(shardlib::cat("negated_space ", op, ": injected copy failure"));
}
template <class T>
void flip_copy(std::span<const T> in, std::span<T> out) {
  require<shape_error>(in.size() == out.size(), "negated_space: copying ", in.size(), " values into ", out.size());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = flip(in[i]);
}
template <class T>
void to_host(std::span<const T> src, std::span<T> host) {
  maybe_fail("to_host");
  flip_copy(src, host);
  ++counts().to_host;
  counts().to_host_elements += src.size();
}
template <class T>
void from_host(std::span<const T> host, std::span<T> dst) {
  maybe_fail("from_host");
  flip_copy(host, dst);
  ++counts().from_host;
  counts().from_host_elements += host.size();
}
}  // namespace detail

// ThreadComm over negated memory: gathers and broadcasts move the stored bytes as they
// are; reductions decode, reduce on the host and store the result.
class negated_comm {
 public:
  explicit negated_comm(comm::ThreadComm c) : c_(std::move(c)) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  void barrier() { c_.barrier(); }
  negated_comm split(int color, int key) { return negated_comm(c_.split(color, key)); }

  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    c_.all_gather(in, out);
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    c_.broadcast(data, root);
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    std::vector<T> a(in.size()), b(out.size());
    detail::flip_copy(in, std::span<T>(a));
    c_.reduce_scatter(std::span<const T>(a), std::span<T>(b), op);
    detail::flip_copy(std::span<const T>(b), out);
  }
  template <class T>
  void all_reduce(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    std::vector<T> a(in.size()), b(out.size());
    detail::flip_copy(in, std::span<T>(a));
    c_.all_reduce(std::span<const T>(a), std::span<T>(b), op);
    detail::flip_copy(std::span<const T>(b), out);
  }
  template <class T>
  void all_reduce(std::span<T> data, comm::reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <class T>
  comm::work all_gather_async(std::span<const T> in, std::span<T> out) {
    all_gather(in, out);
    return {};
  }
  template <class T>
  comm::work reduce_scatter_async(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    reduce_scatter(in, out, op);
    return {};
  }
  template <class T>
  comm::work all_reduce_async(std::span<const T> in, std::span<T> out, comm::reduce_op op) {
    all_reduce(in, out, op);
    return {};
  }
  template <class T>
  comm::work broadcast_async(std::span<T> data, int root) {
    broadcast(data, root);
    return {};
  }

 private:
  comm::ThreadComm c_;
};

}  // namespace negated

// What the engine does to flat buffers in negated memory: the host's operations on
// the decoded values (the same bits), every copy to or from the host counted.
template <>
struct shardlib::shard::space_ops<negated::negated_space> {
  template <class T>
  static void fill(std::span<T> x, T value) {
    std::fill(x.begin(), x.end(), negated::flip(value));
  }
  template <class T>
  static void copy(std::span<const T> src, std::span<T> dst) {
    std::copy_n(src.data(), src.size(), dst.data());
  }
  template <class T>
  static void to_host(std::span<const T> src, std::span<T> host) {
    negated::detail::to_host(src, host);
  }
  template <class T>
  static void from_host(std::span<const T> host, std::span<T> dst) {
    negated::detail::from_host(host, dst);
  }
  template <class T>
  static void initialize(const nn::flat_layout& layout, std::uint64_t seed, std::size_t first, std::span<T> out) {
    std::vector<T> values(out.size());
    nn::initialize_range<T>(layout, seed, first, std::span<T>(values));
    negated::detail::flip_copy(std::span<const T>(values), out);
  }
  template <class H>
  static void narrow(std::span<const float> in, std::span<H> out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = negated::flip(H(negated::flip(in[i])));
  }
  template <class H>
  static void widen(std::span<const H> in, std::span<float> out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = negated::flip(float(negated::flip(in[i])));
  }
  template <class H>
  static void widen_add(std::span<const H> in, std::span<float> out, bool overwrite) {
    for (std::size_t i = 0; i < in.size(); ++i)
      out[i] = negated::flip((overwrite ? 0.f : negated::flip(out[i])) + float(negated::flip(in[i])));
  }
  template <class H>
  static void round_to(std::span<const float> in, std::span<float> out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = negated::flip(float(H(negated::flip(in[i]))));
  }
  template <class T>
  static void add(std::span<const T> in, std::span<T> out, bool overwrite) {
    for (std::size_t i = 0; i < in.size(); ++i)
      out[i] = negated::flip((overwrite ? T(0) : negated::flip(out[i])) + negated::flip(in[i]));
  }
  template <class T>
  static void scale(std::span<T> x, float c) {
    for (auto& v : x) v = negated::flip(T(negated::flip(v) * c));
  }
  template <class T>
  static double sum_squares(std::span<const T> x) {
    std::vector<T> v(x.size());
    negated::detail::flip_copy(x, std::span<T>(v));
    return optim::grad_norm_squared(std::span<const T>(v));
  }
  template <class T>
  static bool all_finite(std::span<const T> x) {
    return std::all_of(x.begin(), x.end(), [](T v) { return std::isfinite(v); });
  }
  // Host values through negated memory, as space_ops<cuda_space> stages them on a device.
  template <class T, comm::Communicator Comm>
  static void all_reduce_values(Comm& comm, std::span<T> values, comm::reduce_op op) {
    Buffer<T, negated::negated_space> d(values.size(), category::comm_scratch);
    negated::detail::flip_copy(std::span<const T>(values), d.span());
    comm.all_reduce(d.span(), op);
    negated::detail::flip_copy(std::span<const T>(d.span()), values);
  }
  template <class T, comm::Communicator Comm>
  static void all_gather_values(Comm& comm, std::span<const T> mine, std::span<T> all) {
    Buffer<T, negated::negated_space> d(all.size(), category::comm_scratch);
    const auto slice = d.span().subspan(mine.size() * std::size_t(comm.rank()), mine.size());
    negated::detail::flip_copy(mine, slice);
    comm.all_gather(std::span<const T>(slice), d.span());
    negated::detail::flip_copy(std::span<const T>(d.span()), all);
  }
  template <class Comm>
  static void check_stream(const Comm&, int) {}
  // Per-step scalars, stored negated like everything else; issue_to_host counts the
  // host's reads (copy_counts::reads), which a device step without waits makes none of.
  template <class T>
  using scalars = Buffer<T, negated::negated_space>;
  template <class T>
  static scalars<T> make_scalars(std::size_t n) {
    scalars<T> b(n, category::comm_scratch);
    fill(b.span(), T(0));
    return b;
  }
  template <class T>
  static void add_sum_squares(std::span<const T> x, double* total) {
    *total = negated::flip(negated::flip(*total) + sum_squares(x));
  }
  static void add_nonfinite(std::span<const float> x, float* count) {
    *count = negated::flip(negated::flip(*count) + (all_finite(x) ? 0.f : 1.f));
  }
  template <class T, comm::Communicator Comm>
  static void all_reduce_in_place(Comm& comm, std::span<T> values, comm::reduce_op op) {
    comm.all_reduce(values, op);
  }
  template <class T>
  static void issue_to_host(std::span<const T> src, std::span<T> host) {
    negated::detail::flip_copy(src, host);
    ++negated::counts().reads;
  }
  static void wait_for_reads() {}
  using issue_point = space_ops<host_space>::issue_point;  // the host's: work is done when issued
  static issue_point issued_here() { return {}; }
  static void scale_by(std::span<float> x, const double* factor, bool reciprocal) {
    const float c = float(negated::flip(*factor));
    scale(x, reciprocal ? 1.f / c : c);
  }
  // The host's decision on the decoded values, its results stored back.
  static void decide_step(const step_rule& rule, const float* shared, const double* norm_squared, double* scaler,
                          double* outcome) {
    double squared = norm_squared ? negated::flip(*norm_squared) : 0, slots[scaler_slots] = {}, out[outcome_slots];
    if (scaler)
      for (int i = 0; i < scaler_slots; ++i) slots[i] = negated::flip(scaler[i]);
    shard::decide_step(rule, negated::flip(shared[1]), norm_squared ? &squared : nullptr, slots, out);
    if (scaler)
      for (int i = 0; i < scaler_slots; ++i) scaler[i] = negated::flip(slots[i]);
    for (int i = 0; i < outcome_slots; ++i) outcome[i] = negated::flip(out[i]);
  }

  class offload_channel {
   public:
    using ticket = std::size_t;
    template <class T>
    ticket to_offload(std::span<const T> src, std::span<T> dst) {
      negated::detail::to_host(src, dst);
      return issued_++;
    }
    void wait(ticket t) const { require(t < issued_, "offload_channel: waiting for copy ", t, " never issued"); }
    template <class T>
    void from_offload(std::span<const T> src, std::span<T> dst) {
      negated::detail::from_host(src, dst);
    }
    void fence() {}

   private:
    ticket issued_ = 0;
  };
};

namespace negated {

static_assert(shard::OffloadSpace<negated_space>);
static_assert(comm::check_communicator<negated_comm>());

// y = x W^T + b over tensors of Space, written once for both spaces (plain loops in
// float, the same bits in each); V is the layers' element type (float, or bfloat16 for
// the engine's 16-bit compute path); PyTorch's names and layout.
template <class Space, class V = float>
struct Linear {
  using input = Tensor<V, Space>;
  using output = Tensor<V, Space>;
  using io = codec<Space>;
  nn::Param<V> weight, bias;
  std::int64_t in, out;
  input x_;

  Linear(std::int64_t i, std::int64_t o) : in(i), out(o) {
    weight.shape = Shape{o, i};
    weight.init = nn::init_rule::linear_default(i);
    bias.shape = Shape{o};
    bias.init = nn::init_rule::linear_default(i);
  }
  template <class P>
  void parameters(P&& v) {
    v("weight", weight);
    v("bias", bias);
  }
  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    const std::int64_t rows = x.numel() / in;
    output y({rows, out});
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        float acc = float(io::get(bias.value, o));
        for (std::int64_t k = 0; k < in; ++k)
          acc += float(io::get(x.data(), r * in + k)) * float(io::get(weight.value, o * in + k));
        io::put(y.data(), r * out + o, V(acc));
      }
    return y;
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    const std::int64_t rows = x_.numel() / in;
    input dx({rows, in});
    auto at = [](const V* p, std::int64_t i) { return float(io::get(p, i)); };
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < in; ++k) {
        float acc = 0;
        for (std::int64_t o = 0; o < out; ++o) acc += at(dy.data(), r * out + o) * at(weight.value, o * in + k);
        io::put(dx.data(), r * in + k, V(acc));
      }
    for (std::int64_t o = 0; o < out; ++o) {
      float db = 0;
      for (std::int64_t r = 0; r < rows; ++r) db += at(dy.data(), r * out + o);
      io::put(bias.grad, o, V(at(bias.grad, o) + db));
      for (std::int64_t k = 0; k < in; ++k) {
        float dw = 0;
        for (std::int64_t r = 0; r < rows; ++r) dw += at(dy.data(), r * out + o) * at(x_.data(), r * in + k);
        io::put(weight.grad, o * in + k, V(at(weight.grad, o * in + k) + dw));
      }
    }
    return dx;
  }
};

// optim::Adam over state in Space, as optim::cuda::Adam is over device memory: it names
// its host_optimizer, whose update it runs on the decoded values (the same bits).
template <class Space>
struct Adam {
  using host_optimizer = optim::Adam;
  using options_type = host_optimizer::options_type;
  static constexpr std::string_view name = host_optimizer::name;

  struct state {
    Buffer<float, Space> exp_avg, exp_avg_sq, max_exp_avg_sq;
    std::int64_t step = 0;
    Buffer<double, Space> cancelled;  // as optim::cuda::Adam's: [0] steps cancelled since settle(), [1] always 0
    template <class F>
    void for_each_buffer(F&& f) {
      f(std::string_view("exp_avg"), exp_avg);
      f(std::string_view("exp_avg_sq"), exp_avg_sq);
      if (!max_exp_avg_sq.empty()) f(std::string_view("max_exp_avg_sq"), max_exp_avg_sq);
    }
    void settle() {
      if (cancelled.empty()) return;
      step -= std::int64_t(codec<Space>::get(cancelled.data(), 0));
      codec<Space>::put(cancelled.data(), 0, 0.0);
    }
  };
  options_type options;

  state make_state(std::size_t n) const {
    auto zeroed = [](std::size_t count) {
      Buffer<float, Space> b(count, category::optimizer_state);
      shard::space_ops<Space>::fill(b.span(), 0.f);
      return b;
    };
    return {zeroed(n), zeroed(n), options.amsgrad ? zeroed(n) : Buffer<float, Space>{}, 0, {}};
  }
  // After a gated step, ungated ones go through the gate too (a flag that is always 0),
  // as optim::cuda::Adam's do, so that their t leaves the cancelled steps out.
  void step(std::span<float> params, std::span<const float> grads, state& s) const {
    if (!s.cancelled.empty()) return step(params, grads, s, std::span<float>{}, optim::skip_flag{s.cancelled.data() + 1});
    host_step(params, grads, s);
  }
  // A step the space may cancel (optim::skip_flag), as optim::cuda::Adam's: the flag
  // and the count of cancelled steps read where they are (a kernel's reads), `step`
  // counting attempts; the compute copy written when not empty.
  template <class H>
  void step(std::span<float> params, std::span<const float> grads, state& s, std::span<H> copy,
            optim::skip_flag flag) const {
    using io = codec<Space>;
    if (s.cancelled.empty()) {
      s.cancelled = Buffer<double, Space>(2, category::comm_scratch);
      shard::space_ops<Space>::fill(s.cancelled.span(), 0.0);
    }
    const double cancelled = io::get(s.cancelled.data(), 0);
    const std::int64_t attempts = s.step;
    if (io::get(flag.skip, 0) != 0) {
      io::put(s.cancelled.data(), 0, cancelled + 1);
    } else {
      s.step = attempts - std::int64_t(cancelled);
      host_step(params, grads, s);
      if (!copy.empty()) shard::space_ops<Space>::narrow(std::span<const float>(params), copy);
    }
    s.step = attempts + 1;
  }

 private:
  void host_step(std::span<float> params, std::span<const float> grads, state& s) const {
    const host_optimizer host{options};
    auto h = host.make_state(params.size());
    h.step = s.step;
    std::vector<float> p(params.size()), g(grads.size());
    auto down = [](std::span<const float> from, std::span<float> to) { shard::space_ops<Space>::to_host(from, to); };
    auto up = [](std::span<const float> from, std::span<float> to) { shard::space_ops<Space>::from_host(from, to); };
    down(params, p);
    down(grads, g);
    s.for_each_buffer([&](std::string_view n, Buffer<float, Space>& b) {
      h.for_each_buffer([&](std::string_view m, Buffer<float>& hb) {
        if (n == m) down(b.span(), hb.span());
      });
    });
    host.step(std::span<float>(p), std::span<const float>(g), h);
    up(p, params);
    s.for_each_buffer([&](std::string_view n, Buffer<float, Space>& b) {
      h.for_each_buffer([&](std::string_view m, Buffer<float>& hb) {
        if (n == m) up(hb.span(), b.span());
      });
    });
    s.step = h.step;
  }
};

// A host tensor's values in Space, as elements of V.
template <class Space, class V = float>
Tensor<V, Space> to_space(const Tensor<float>& host) {
  std::vector<V> values(host.span().begin(), host.span().end());
  Tensor<V, Space> t(host.shape());
  shard::space_ops<Space>::from_host(std::span<const V>(values), t.span());
  return t;
}

// Mean squared error over tensors of Space: the loss on the host, its gradient in Space.
template <class Space, class V = float>
struct mse_result {
  float loss;
  Tensor<V, Space> grad;
};
template <class Space, class V>
mse_result<Space, V> mse(const Tensor<V, Space>& y, const Tensor<float>& target) {
  using io = codec<Space>;
  mse_result<Space, V> r{0.f, Tensor<V, Space>(y.shape())};
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    const float d = float(io::get(y.data(), i)) - target[i];
    r.loss += d * d / float(y.numel());
    io::put(r.grad.data(), i, V(2 * d / float(y.numel())));
  }
  return r;
}

}  // namespace negated
