// staged_comm: NcclComm seen through host buffers, so that the Communicator
// conformance suite (tests/support/comm_conformance.hpp), written for host
// memory, runs unchanged over NCCL: each call copies its host buffers to the
// device (keeping in-place aliasing), runs the NcclComm collective, and copies
// the result back once it is waited for.
#pragma once
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/core/element.hpp>
#include <shardlib/core/ledger.hpp>
#include <shardlib/cuda/caching_allocator.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/stream.hpp>

#include <functional>
#include <memory>
#include <span>
#include <utility>

namespace device_test {

namespace sl = shardlib;

// The device twin of a call's two host spans: `in` and `out` as device spans,
// aliased as the host spans are (in place stays in place).
template <class T>
struct staged {
  sl::cuda::device_buffer<T> first, second;
  std::span<const T> in;
  std::span<T> out;

  staged(std::span<const T> host_in, std::span<T> host_out, cudaStream_t s, int device) {
    const T *i = host_in.data(), *o = host_out.data();
    if (!host_in.empty() && i >= o && i + host_in.size() <= o + host_out.size()) {  // in lies in out
      first = upload(std::span<const T>(host_out), s, device);
      out = first.span();
      in = std::span<const T>(first.data() + (i - o), host_in.size());
    } else if (!host_out.empty() && o >= i && o + host_out.size() <= i + host_in.size()) {  // out lies in in
      first = upload(host_in, s, device);
      in = first.span();
      out = std::span<T>(first.data() + (o - i), host_out.size());
    } else {
      first = upload(host_in, s, device);
      second = upload(std::span<const T>(host_out), s, device);
      in = first.span();
      out = second.span();
    }
  }

  static sl::cuda::device_buffer<T> upload(std::span<const T> h, cudaStream_t s, int device) {
    sl::cuda::device_buffer<T> d(h.size(), sl::category::comm_scratch, s, sl::cuda::device_allocator(device));
    sl::cuda::copy_async(d.span(), h, s);
    return d;
  }
};

class staged_comm {
 public:
  // After the device work, copies the result to the host buffer and waits.
  class work {
   public:
    work(sl::comm::nccl_work w, std::function<void()> finish) : w_(std::move(w)), finish_(std::move(finish)) {}
    void wait() {
      w_.wait();
      if (finish_) std::exchange(finish_, nullptr)();
    }
    bool test() { return w_.test(); }

   private:
    sl::comm::nccl_work w_;
    std::function<void()> finish_;
  };

  explicit staged_comm(sl::comm::NcclComm c)
      : stream_(std::make_shared<sl::cuda::stream>(c.device())), c_(c.on(stream_->get())) {}

  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  void barrier() { c_.barrier(); }
  staged_comm split(int color, int key) { return staged_comm(c_.split(color, key)); }

  template <sl::Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    all_gather_async(send, recv).wait();
  }
  template <sl::Element T>
  work all_gather_async(std::span<const T> send, std::span<T> recv) {
    auto d = std::make_shared<staged<T>>(send, recv, stream_->get(), c_.device());
    return finish(c_.all_gather_async(d->in, d->out), d, recv);
  }

  template <sl::Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, sl::comm::reduce_op op) {
    reduce_scatter_async(send, recv, op).wait();
  }
  template <sl::Element T>
  work reduce_scatter_async(std::span<const T> send, std::span<T> recv, sl::comm::reduce_op op) {
    auto d = std::make_shared<staged<T>>(send, recv, stream_->get(), c_.device());
    return finish(c_.reduce_scatter_async(d->in, d->out, op), d, recv);
  }

  template <sl::Element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, sl::comm::reduce_op op) {
    all_reduce_async(send, recv, op).wait();
  }
  template <sl::Element T>
  void all_reduce(std::span<T> data, sl::comm::reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <sl::Element T>
  work all_reduce_async(std::span<const T> send, std::span<T> recv, sl::comm::reduce_op op) {
    auto d = std::make_shared<staged<T>>(send, recv, stream_->get(), c_.device());
    return finish(c_.all_reduce_async(d->in, d->out, op), d, recv);
  }

  template <sl::Element T>
  void broadcast(std::span<T> data, int root) {
    broadcast_async(data, root).wait();
  }
  template <sl::Element T>
  work broadcast_async(std::span<T> data, int root) {
    auto d = std::make_shared<staged<T>>(std::span<const T>(data), data, stream_->get(), c_.device());
    return finish(c_.broadcast_async(d->out, root), d, data);
  }

 private:
  template <class T>
  work finish(sl::comm::nccl_work w, std::shared_ptr<staged<T>> d, std::span<T> host_out) {
    return work(std::move(w), [d, host_out, s = stream_] {
      sl::cuda::copy_async(host_out, std::span<const T>(d->out), s->get());
      s->synchronize();
    });
  }

  std::shared_ptr<sl::cuda::stream> stream_;
  sl::comm::NcclComm c_;
};

static_assert(sl::comm::check_communicator<staged_comm>());

}  // namespace device_test
