// device_thread_comm: ThreadComm over device memory, so that tests can run
// several ranks on one GPU (NCCL refuses two ranks on one device). Each
// collective waits for the thread's current stream, copies its device buffers
// to host memory, runs ThreadComm's collective there and copies the result
// back: synchronous and slow, but the same ranks, shards and rank-ordered
// reductions as ThreadComm, so a device run can be compared with a host run.
#pragma once
#include <shardlib/comm/communicator.hpp>
#include <shardlib/comm/thread_comm.hpp>
#include <shardlib/comm/work.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/cuda/error.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <span>
#include <utility>
#include <vector>

namespace device_test {

namespace sl = shardlib;

// Host copies of a call's two device spans, aliased as they are (the in-place
// forms pass one span inside the other).
template <class T>
class host_mirror {
 public:
  host_mirror(std::span<const T> in, std::span<T> out) : dev_in_(in), dev_out_(out) {
    wait_for_stream();
    const T *lo = std::min<const T*>(in.data(), out.data()),
            *hi = std::max<const T*>(in.data() + in.size(), out.data() + out.size());
    if (in.data() < out.data() + out.size() && out.data() < in.data() + in.size()) {  // overlapping: one copy
      whole_ = download(std::span<const T>(lo, std::size_t(hi - lo)));
      in_ = std::span<const T>(whole_.data() + (in.data() - lo), in.size());
      out_ = std::span<T>(whole_.data() + (out.data() - lo), out.size());
    } else {
      whole_ = download(in);
      second_ = download(std::span<const T>(out));  // broadcast and in-place all_reduce read it
      in_ = std::span<const T>(whole_);
      out_ = std::span<T>(second_);
    }
  }
  std::span<const T> in() const { return in_; }
  std::span<T> out() const { return out_; }
  // The host result back into the device output, finished before this returns
  // (a copy from pageable memory may return before its DMA is done, and the
  // rank's kernels run on its own stream, which a legacy-stream copy does not order).
  void upload() const {
    if (dev_out_.empty()) return;
    const cudaStream_t s = sl::cuda::current_stream();
    sl::cuda::check(cudaMemcpyAsync(dev_out_.data(), out_.data(), dev_out_.size_bytes(), cudaMemcpyDefault, s),
                    "cudaMemcpyAsync (device_thread_comm result)");
    wait_for_stream();
  }

 private:
  static void wait_for_stream() {
    sl::cuda::check(cudaStreamSynchronize(sl::cuda::current_stream()), "cudaStreamSynchronize (device_thread_comm)");
  }
  static std::vector<T> download(std::span<const T> d) {
    std::vector<T> h(d.size());
    if (d.empty()) return h;
    sl::cuda::check(cudaMemcpyAsync(h.data(), d.data(), d.size_bytes(), cudaMemcpyDefault, sl::cuda::current_stream()),
                    "cudaMemcpyAsync (device_thread_comm argument)");
    wait_for_stream();
    return h;
  }
  std::span<const T> dev_in_;
  std::span<T> dev_out_;
  std::vector<T> whole_, second_;
  std::span<const T> in_;
  std::span<T> out_;
};

class device_thread_comm {
 public:
  explicit device_thread_comm(sl::comm::ThreadComm c) : c_(std::move(c)) {}

  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  void barrier() { c_.barrier(); }
  device_thread_comm split(int color, int key) { return device_thread_comm(c_.split(color, key)); }

  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    host_mirror<T> m(in, out);
    c_.all_gather(m.in(), m.out());
    m.upload();
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, sl::comm::reduce_op op) {
    host_mirror<T> m(in, out);
    c_.reduce_scatter(m.in(), m.out(), op);
    m.upload();
  }
  template <class T>
  void all_reduce(std::span<const T> in, std::span<T> out, sl::comm::reduce_op op) {
    host_mirror<T> m(in, out);
    c_.all_reduce(m.in(), m.out(), op);
    m.upload();
  }
  template <class T>
  void all_reduce(std::span<T> data, sl::comm::reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    host_mirror<T> m(std::span<const T>(data), data);
    c_.broadcast(m.out(), root);
    m.upload();
  }
  // The asynchronous forms finish before they return.
  template <class T>
  sl::comm::work all_gather_async(std::span<const T> in, std::span<T> out) {
    all_gather(in, out);
    return {};
  }
  template <class T>
  sl::comm::work reduce_scatter_async(std::span<const T> in, std::span<T> out, sl::comm::reduce_op op) {
    reduce_scatter(in, out, op);
    return {};
  }
  template <class T>
  sl::comm::work all_reduce_async(std::span<const T> in, std::span<T> out, sl::comm::reduce_op op) {
    all_reduce(in, out, op);
    return {};
  }
  template <class T>
  sl::comm::work broadcast_async(std::span<T> data, int root) {
    broadcast(data, root);
    return {};
  }

 private:
  sl::comm::ThreadComm c_;
};

static_assert(sl::comm::check_communicator<device_thread_comm>());

}  // namespace device_test
