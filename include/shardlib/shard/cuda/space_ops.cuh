// shardlib/shard/cuda/space_ops.cuh — space_ops<cuda_space>: what the sharding
// engine does to flat buffers in device memory (the contract is in
// shard/space_ops.hpp), on the thread's current stream. Element-wise results are
// the host's bit for bit: the same single operation or conversion per element.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"       // Communicator, reduce_op
#include "shardlib/core/element.hpp"            // element_cast
#include "shardlib/core/pending.hpp"            // count_host_sync
#include "shardlib/core/error.hpp"              // require, shape_error
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator, device_buffer
#include "shardlib/cuda/copy.hpp"               // copy_async
#include "shardlib/cuda/current.hpp"            // current_stream
#include "shardlib/cuda/error.hpp"              // check, current_device
#include "shardlib/cuda/memory_space.hpp"       // cuda_space, pinned_space
#include "shardlib/cuda/stream.hpp"             // stream, event
#include "shardlib/nn/flat.hpp"                 // flat_layout, initialize_range
#include "shardlib/ops/cuda/elementwise.cuh"    // cast, fill
#include "shardlib/ops/cuda/launch.cuh"         // map_elements
#include "shardlib/ops/cuda/reduce.cuh"         // sum_squares, count_nonfinite
#include "shardlib/shard/space_ops.hpp"         // space_ops, EngineSpace

#include <cuda_runtime.h>

#include <algorithm>  // std::clamp, std::min
#include <concepts>   // std::convertible_to
#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t, std::uint64_t
#include <span>       // std::span
#include <thread>     // std::thread
#include <vector>     // std::vector

// options.offload beside device memory: pinned host memory, which the copies reach
// asynchronously and the host optimizer steps in place.
namespace shardlib {
template <>
struct offload_space_of<cuda_space> {
  using type = pinned_space;
};
}  // namespace shardlib

namespace shardlib::shard {

namespace detail {

inline void require_same_size(const char* op, std::size_t in, std::size_t out) {
  require<shape_error>(in == out, "space_ops<cuda_space>::", op, ": input has ", in, " elements, output ", out);
}

inline void synchronize(cudaStream_t s, const char* op) {
  count_host_sync();
  cuda::check(cudaStreamSynchronize(s), "space_ops<cuda_space>::", op, ": cudaStreamSynchronize");
}

// The stream a communicator orders its collectives after (NcclComm's compute
// stream): staging there puts the uploads before the collective and the
// downloads after it, whatever the current stream is.
template <class Comm>
cudaStream_t staging_stream(const Comm& comm) {
  if constexpr (requires {
                  { comm.compute_stream() } -> std::convertible_to<cudaStream_t>;
                }) {
    return comm.compute_stream();
  } else {
    return cuda::current_stream();
  }
}

// The per-element maps; each is the host's expression in space_ops<host_space>.
// An accumulating map reads the output as its last input (in place: each element
// is read and written by the same thread).
template <class H>
struct device_widen_add_of {
  __device__ float operator()(std::int64_t, H in) const { return 0.0f + element_cast<float>(in); }  // overwrite
  __device__ float operator()(std::int64_t, H in, float out) const { return out + element_cast<float>(in); }
};
template <class H>
struct device_round_to_of {
  __device__ float operator()(std::int64_t, float in) const { return element_cast<float>(element_cast<H>(in)); }
};
template <class T>
struct device_add_of {
  __device__ T operator()(std::int64_t, T in) const { return T(0) + in; }  // overwrite
  __device__ T operator()(std::int64_t, T in, T out) const { return out + in; }
};
struct device_scale_of {
  float c;
  __device__ float operator()(std::int64_t, float x) const { return x * c; }
};
// The factor read on the device, as the host's scale_by computes it.
struct device_scale_by {
  const double* factor;
  bool reciprocal;
  __device__ float operator()(std::int64_t, float x) const {
    const float c = float(*factor);
    return x * (reciprocal ? 1.f / c : c);
  }
};

// out = op(in) when overwriting, op(in, out) when accumulating into out.
template <class T, class Out, class Op>
void map_into(std::span<const T> in, std::span<Out> out, bool overwrite, Op op, const char* name) {
  const std::int64_t n = std::int64_t(in.size());
  if (overwrite)
    ops::cuda::map_elements(n, op, cuda::current_stream(), name, out.data(), in.data());
  else
    ops::cuda::map_elements(n, op, cuda::current_stream(), name, out.data(), in.data(),
                            static_cast<const Out*>(out.data()));
}

// One thread folds a reduction's result into a per-step scalar, so that the
// scalar stays on the device. (Templates: a __global__ function cannot be inline.)
template <class T>
__global__ void accumulate_kernel(const T* x, T* total) {
  *total += *x;
}
template <class Rule>
__global__ void decide_step_kernel(Rule rule, const float* shared, const double* norm_squared, double* scaler,
                                   double* outcome) {
  shard::decide_step(rule, shared[1], norm_squared, scaler, outcome);
}
template <class Count>
__global__ void count_if_nonzero_kernel(const unsigned long long* bad, Count* count) {
  *count += *bad != 0 ? Count(1) : Count(0);
}

}  // namespace detail

template <>
struct space_ops<cuda_space> {
  template <class T>
  static void fill(std::span<T> x, T value) {
    ops::cuda::fill(x, value, cuda::current_stream());
  }
  template <class T>
  static void copy(std::span<const T> src, std::span<T> dst) {
    cuda::copy_async(dst, src, cuda::current_stream());
  }
  template <class T>
  static void to_host(std::span<const T> src, std::span<T> host) {
    const cudaStream_t s = cuda::current_stream();
    cuda::copy_async(host, src, s);
    detail::synchronize(s, "to_host");
  }
  template <class T>
  static void from_host(std::span<const T> host, std::span<T> dst) {
    const cudaStream_t s = cuda::current_stream();
    cuda::copy_async(dst, host, s);
    detail::synchronize(s, "from_host");
  }
  // Computed on the host (it is the host's function) a chunk at a time, so a
  // large shard needs only a chunk of host memory, each chunk by several host
  // threads (a billion values take ~25 s on one: the draws, not the copies).
  template <class T>
  static void initialize(const nn::flat_layout& layout, std::uint64_t seed, std::size_t first, std::span<T> out) {
    constexpr std::size_t chunk = std::size_t{1} << 22;
    const std::size_t workers = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 16);
    const cudaStream_t s = cuda::current_stream();
    std::vector<T> staging(std::min(chunk, out.size()));
    for (std::size_t done = 0; done < out.size(); done += chunk) {
      const std::span<T> part(staging.data(), std::min(chunk, out.size() - done));
      const std::size_t piece = (part.size() + workers - 1) / workers;
      std::vector<std::thread> threads;
      for (std::size_t b = 0; b < part.size(); b += piece)
        threads.emplace_back([&, b] {
          const std::span<T> mine = part.subspan(b, std::min(piece, part.size() - b));
          nn::initialize_range<T>(layout, seed, first + done + b, mine);
        });
      for (auto& t : threads) t.join();
      cuda::copy_async(out.subspan(done, part.size()), std::span<const T>(part), s);
      detail::synchronize(s, "initialize");  // before the next chunk overwrites the staging
    }
  }
  template <class H>
  static void narrow(std::span<const float> in, std::span<H> out) {
    detail::require_same_size("narrow", in.size(), out.size());
    ops::cuda::cast(in, out, cuda::current_stream());
  }
  template <class H>
  static void widen(std::span<const H> in, std::span<float> out) {
    detail::require_same_size("widen", in.size(), out.size());
    ops::cuda::cast(in, out, cuda::current_stream());
  }
  template <class H>
  static void widen_add(std::span<const H> in, std::span<float> out, bool overwrite) {
    detail::require_same_size("widen_add", in.size(), out.size());
    detail::map_into(in, out, overwrite, detail::device_widen_add_of<H>{}, "space_ops widen_add");
  }
  template <class H>
  static void round_to(std::span<const float> in, std::span<float> out) {
    detail::require_same_size("round_to", in.size(), out.size());
    ops::cuda::map_elements(std::int64_t(in.size()), detail::device_round_to_of<H>{}, cuda::current_stream(),
                            "space_ops round_to", out.data(), in.data());
  }
  template <class T>
  static void add(std::span<const T> in, std::span<T> out, bool overwrite) {
    detail::require_same_size("add", in.size(), out.size());
    detail::map_into(in, out, overwrite, detail::device_add_of<T>{}, "space_ops add");
  }
  static void scale(std::span<float> x, float c) {
    ops::cuda::map_elements(std::int64_t(x.size()), detail::device_scale_of{c}, cuda::current_stream(),
                            "space_ops scale", x.data(), static_cast<const float*>(x.data()));
  }
  static void scale_by(std::span<float> x, const double* factor, bool reciprocal) {
    ops::cuda::map_elements(std::int64_t(x.size()), detail::device_scale_by{factor, reciprocal},
                            cuda::current_stream(), "space_ops scale_by", x.data(), static_cast<const float*>(x.data()));
  }
  static void decide_step(const step_rule& rule, const float* shared, const double* norm_squared, double* scaler,
                          double* outcome) {
    ops::cuda::launch_kernel("space_ops decide_step", detail::decide_step_kernel<step_rule>, 1, 1, 0,
                             cuda::current_stream(), rule, shared, norm_squared, scaler, outcome);
  }
  // The per-step scalars (the contract in shard/space_ops.hpp): reductions go into
  // device memory and stay there; nothing here waits but wait_for_reads. Sums of
  // squares: each square and the sum in double, as the host's; the order of the sum
  // differs (CUB's tree against the host's eight lanes).
  template <class T>
  using scalars = cuda::device_buffer<T>;
  template <class T>
  static scalars<T> make_scalars(std::size_t n) {
    const cudaStream_t s = cuda::current_stream();
    scalars<T> d(n, category::comm_scratch, s);
    cuda::fill_bytes_async(d.span(), 0, s);
    return d;
  }
  static void add_sum_squares(std::span<const float> x, double* total) {
    if (x.empty()) return;
    const cudaStream_t s = cuda::current_stream();
    auto& alloc = cuda::device_allocator(cuda::current_device());
    cuda::device_buffer<double> d(1, category::activations, s, alloc);
    ops::cuda::sum_squares(x, d.data(), s, alloc);
    ops::cuda::launch_kernel("space_ops add_sum_squares", detail::accumulate_kernel<double>, 1, 1, 0, s, d.data(),
                             total);
  }
  static void add_nonfinite(std::span<const float> x, float* count) {
    if (x.empty()) return;
    const cudaStream_t s = cuda::current_stream();
    auto& alloc = cuda::device_allocator(cuda::current_device());
    cuda::device_buffer<unsigned long long> d(1, category::activations, s, alloc);
    ops::cuda::count_nonfinite(x, d.data(), s, alloc);
    ops::cuda::launch_kernel("space_ops add_nonfinite", detail::count_if_nonzero_kernel<float>, 1, 1, 0, s, d.data(),
                             count);
  }
  // The communicator reads and writes device memory, ordered after its compute
  // stream, which check_stream made the current one.
  template <class T, comm::Communicator Comm>
  static void all_reduce_in_place(Comm& comm, std::span<T> values, comm::reduce_op op) {
    comm.all_reduce(values, op);
  }
  template <class T>
  static void issue_to_host(std::span<const T> src, std::span<T> host) {
    cuda::copy_async(host, src, cuda::current_stream());
  }
  static void wait_for_reads() { detail::synchronize(cuda::current_stream(), "wait_for_reads"); }
  // A value read later (pending) is read on the stream that computed it, whichever is current then.
  struct issue_point {
    cudaStream_t stream;
    template <class F>
    void run(F&& f) const {
      cuda::stream_scope scope(stream);
      f();
    }
  };
  static issue_point issued_here() { return {cuda::current_stream()}; }

  // The communicator (NcclComm) reads and writes device memory: the host
  // values go up, through the collective and back down; complete on return.
  template <class T, comm::Communicator Comm>
  static void all_reduce_values(Comm& comm, std::span<T> values, comm::reduce_op op) {
    const cudaStream_t s = detail::staging_stream(comm);
    cuda::device_buffer<T> d(values.size(), category::comm_scratch, s);
    cuda::copy_async(d.span(), std::span<const T>(values), s);
    comm.all_reduce(d.span(), op);
    cuda::copy_async(values, std::span<const T>(d.span()), s);
    detail::synchronize(s, "all_reduce_values");
  }
  template <class T, comm::Communicator Comm>
  static void all_gather_values(Comm& comm, std::span<const T> mine, std::span<T> all) {
    const std::size_t n = mine.size(), ranks = std::size_t(comm.size()), rank = std::size_t(comm.rank());
    require<shape_error>(all.size() == n * ranks, "rank ", rank, ": all_gather_values of ", n, " values per rank over ",
                         ranks, " ranks needs ", n * ranks, " outputs, got ", all.size());
    const cudaStream_t s = detail::staging_stream(comm);
    cuda::device_buffer<T> d(all.size(), category::comm_scratch, s);
    const std::span<T> slice = d.span().subspan(rank * n, n);
    cuda::copy_async(slice, mine, s);
    comm.all_gather(std::span<const T>(slice), d.span());  // in place: this rank's slice is the send buffer
    cuda::copy_async(all, std::span<const T>(d.span()), s);
    detail::synchronize(s, "all_gather_values");
  }
  // Device tensors are allocated and layers run on the current stream; a
  // communicator ordered against another stream (an NcclComm without
  // .on(stream)) would read gradients before they are written.
  template <class Comm>
  static void check_stream(const Comm& comm, int rank) {
    if constexpr (requires {
                    { comm.compute_stream() } -> std::convertible_to<cudaStream_t>;
                  })
      require(comm.compute_stream() == cuda::current_stream(), "rank ", rank,
              ": the communicator orders its collectives after another stream than the thread's current one, "
              "where the model's tensors and layers work: pass comm.on(stream) for the stream of the "
              "cuda::stream_scope the model runs in");
  }

  // options.offload's copies between device memory and pinned host memory, on a side
  // stream of the current device, so that they overlap the compute stream's work and
  // the host's optimizer steps: a copy to the offload space first waits (an event) for
  // what the compute stream has issued; fence() makes the compute stream wait (an
  // event) for every copy back, and the host too, since its next step rewrites the
  // pinned sources. Both directions share the side stream, so they run in issue order.
  class offload_channel {
   public:
    using ticket = std::size_t;
    offload_channel() : side_(cuda::current_device()) {}

    template <class T>
    ticket to_offload(std::span<const T> src, std::span<T> dst) {
      cuda::event issued;
      issued.record(cuda::current_stream());
      issued.make_wait(side_);
      cuda::copy_async(dst, src, side_);
      copied_.emplace_back().record(side_);
      return copied_.size() - 1;
    }
    void wait(ticket t) const {
      require(t < copied_.size(), "offload_channel: waiting for copy ", t, " never issued");
      count_host_sync();
      copied_[t].synchronize();
    }
    template <class T>
    void from_offload(std::span<const T> src, std::span<T> dst) {
      cuda::copy_async(dst, src, side_);
    }
    void fence() {
      cuda::event back;
      back.record(side_);
      back.make_wait(cuda::current_stream());
      count_host_sync();
      back.synchronize();
      copied_.clear();
    }

   private:
    cuda::stream side_;
    std::vector<cuda::event> copied_;
  };
};

static_assert(EngineSpace<cuda_space>);
static_assert(OffloadSpace<cuda_space>);

}  // namespace shardlib::shard
