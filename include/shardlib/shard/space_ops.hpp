// shardlib/shard/space_ops.hpp — space_ops<Space>: the few things the sharding
// engine does to the data of its flat buffers, for the memory space they live in.
// The host's are here; the device's (cuda_space) are in shard/cuda/space_ops.cuh.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/memory_space.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/optim/clip.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/step_decision.hpp"

#include <algorithm>  // std::copy_n, std::fill_n
#include <cstddef>    // std::size_t
#include <cstdint>    // std::uint64_t
#include <span>       // std::span
#include <type_traits>  // std::is_same_v, std::type_identity_t
#include <vector>       // std::vector

namespace shardlib::shard {

// The engine (shard/sharded_model.hpp) never touches its buffers' elements
// directly: it calls these. What a specialisation provides (T is float or
// double, H a 16-bit element type, Comm any Communicator over memory of Space):
//
//   fill(span<T>, T)                           every element <- value
//   copy(span<const T> src, span<T> dst)       within the space (same sizes)
//   to_host(span<const T>, span<T> host)       space -> host memory, complete on return
//   from_host(span<const T> host, span<T>)     host memory -> space, complete on return
//   initialize(layout, seed, first, span<T>)   nn::initialize_range's values into the space
//   narrow(span<const float>, span<H>)         out = H(in), out of place
//   widen(span<const H>, span<float>)          out = float(in), exactly (a zero keeps its sign)
//   widen_add(span<const H>, span<float>, bool overwrite)
//                                              out = (overwrite ? 0 : out) + float(in)
//   round_to<H>(span<const float>, span<float>) out = float(H(in))
//   add(span<const T>, span<T>, bool overwrite) out = (overwrite ? 0 : out) + in
//   scale(span<float>, float)                  x *= c
//   all_reduce_values(Comm&, span<T> host, reduce_op)
//   all_gather_values(Comm&, span<const T> host, span<T> host)
//                                              collectives over small host arrays
//                                              (hashes, norms, flags), staged through
//                                              the space when the communicator needs it
//   per-step scalars, which stay in the space until the host asks (device: no wait):
//     scalars<T>, make_scalars<T>(n)           n zeroed values in the space (not in the ledger)
//     add_sum_squares(span<const T>, double* total)   *total += the sum of x's squares, in double
//     add_nonfinite(span<const float>, float* count)  *count += (any element inf or NaN) ? 1 : 0
//     all_reduce_in_place(Comm&, span<T>, reduce_op)  a collective over values in the space
//     scale_by(span<float>, const double* factor, bool reciprocal)
//                                              x *= float(*factor), or 1.f / float(*factor):
//                                              a factor in the space, never read by the host
//     decide_step(step_rule, const float* shared, const double* norm_squared,
//                 double* scaler, double* outcome)
//                                              shard::decide_step where the values are
//                                              (shared[1]: the overflow count; device: one thread)
//     issue_to_host(span<const T>, span<T> host)      a copy the host may read after wait_for_reads()
//     wait_for_reads()                         the host waits for every issued copy
//                                              (device: one counted stream synchronisation)
//     issue_point, issued_here()               where work is issued now (device: the current
//                                              stream); .run(f) runs f issuing there again
//   check_stream(const Comm&, int rank)        raises when the communicator's collectives
//                                              would not be ordered after the work the
//                                              engine issues (device: its compute stream
//                                              must be the thread's current stream)
//   offload_channel                            options.offload's copies between Space and
//                                              O = offload_space_t<Space> (host memory):
//     to_offload(span<const T>, span<T> in O) -> ticket
//                                              issued after the work issued on Space so far
//     wait(ticket)                             the host waits for that copy alone
//     from_offload(span<const T> in O, span<T>)  issued now; the host may reuse the
//                                              source only after fence()
//     fence()                                  work issued on Space from now on runs after
//                                              every from_offload copy, and the host waits
//                                              for them
//
// Device implementations run on the thread's current stream and may return
// before the work is done, except where "complete on return" is said.
template <class Space>
struct space_ops;

template <>
struct space_ops<host_space> {
  template <class T>
  static void fill(std::span<T> x, T value) {
    std::fill_n(x.data(), x.size(), value);
  }
  template <class T>
  static void copy(std::span<const T> src, std::span<T> dst) {
    std::copy_n(src.data(), src.size(), dst.data());
  }
  template <class T>
  static void to_host(std::span<const T> src, std::span<T> host) {
    copy(src, host);
  }
  template <class T>
  static void from_host(std::span<const T> host, std::span<T> dst) {
    copy(host, dst);
  }
  template <class T>
  static void initialize(const nn::flat_layout& layout, std::uint64_t seed, std::size_t first, std::span<T> out) {
    nn::initialize_range<T>(layout, seed, first, out);
  }
  template <class H>
  static void narrow(std::span<const float> in, std::span<H> out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = H(in[i]);
  }
  template <class H>
  static void widen(std::span<const H> in, std::span<float> out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = float(in[i]);
  }
  template <class H>
  static void widen_add(std::span<const H> in, std::span<float> out, bool overwrite) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = (overwrite ? 0.f : out[i]) + float(in[i]);
  }
  template <class H>
  static void round_to(std::span<const float> in, std::span<float> out) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = float(H(in[i]));
  }
  template <class T>
  static void add(std::span<const T> in, std::span<T> out, bool overwrite) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = (overwrite ? T(0) : out[i]) + in[i];
  }
  template <class T>
  static void scale(std::span<T> x, std::type_identity_t<T> c) {  // c in T: a float64 model's 1/3 stays float64
    if constexpr (std::is_same_v<T, float>) optim::scale_grads(x, c);
    else for (auto& v : x) v *= c;
  }
  template <class T, comm::Communicator Comm>
  static void all_reduce_values(Comm& comm, std::span<T> values, comm::reduce_op op) {
    comm.all_reduce(values, op);
  }
  template <class T>
  using scalars = std::vector<T>;
  template <class T>
  static scalars<T> make_scalars(std::size_t n) {
    return scalars<T>(n, T(0));
  }
  template <class T>
  static void add_sum_squares(std::span<const T> x, double* total) {
    *total += optim::grad_norm_squared(x);
  }
  static void add_nonfinite(std::span<const float> x, float* count) { *count += shard::all_finite(x) ? 0.f : 1.f; }
  static void scale_by(std::span<float> x, const double* factor, bool reciprocal) {
    scale(x, reciprocal ? 1.f / float(*factor) : float(*factor));
  }
  static void decide_step(const step_rule& rule, const float* shared, const double* norm_squared, double* scaler,
                          double* outcome) {
    shard::decide_step(rule, shared[1], norm_squared, scaler, outcome);
  }
  template <class T, comm::Communicator Comm>
  static void all_reduce_in_place(Comm& comm, std::span<T> values, comm::reduce_op op) {
    comm.all_reduce(values, op);
  }
  template <class T>
  static void issue_to_host(std::span<const T> src, std::span<T> host) {
    copy(src, host);
  }
  static void wait_for_reads() {}
  struct issue_point {
    template <class F>
    void run(F&& f) const {
      f();
    }
  };
  static issue_point issued_here() { return {}; }
  template <class T, comm::Communicator Comm>
  static void all_gather_values(Comm& comm, std::span<const T> mine, std::span<T> all) {
    comm.all_gather(mine, all);
  }
  template <class Comm>
  static void check_stream(const Comm&, int) {}

  // Both spaces are host memory: each copy is complete when the call returns, so
  // nothing overlaps here; the engine issues and waits in the device's order
  // (a unit's gradients go out before the previous unit's optimizer step, its
  // parameters come back right after its own), which the host tests run.
  class offload_channel {
   public:
    using ticket = std::size_t;
    template <class T>
    ticket to_offload(std::span<const T> src, std::span<T> dst) {
      copy(src, dst);
      return issued_++;
    }
    void wait(ticket t) const { require(t < issued_, "offload_channel: waiting for copy ", t, " never issued"); }
    template <class T>
    void from_offload(std::span<const T> src, std::span<T> dst) {
      copy(src, dst);
    }
    void fence() {}

   private:
    ticket issued_ = 0;
  };
};

// The spaces the engine can keep a model's shards in.
template <class Space>
concept EngineSpace = MemorySpace<Space> && requires { sizeof(space_ops<Space>); };

// What options.offload needs besides: a host-reachable offload space and a channel to it.
template <class Space>
concept OffloadSpace = EngineSpace<Space> && can_access<host_space, offload_space_t<Space>> &&
                       requires { typename space_ops<Space>::offload_channel; };

}  // namespace shardlib::shard
