// benchmarks/counting_comm.hpp — counting_comm<C>: a Communicator that forwards every
// call to C and adds up the bytes this rank sends under the ring model of nccl-tests.
#pragma once
#include <shardlib/comm/communicator.hpp>

#include <atomic>
#include <memory>
#include <span>

namespace bench {

// Bytes one rank sends, per collective, under the ring algorithms that nccl-tests'
// bus bandwidth assumes (doc/PERFORMANCE.md): with W ranks, all_gather sends
// (W-1)/W of its output, reduce_scatter (W-1)/W of its input, all_reduce 2(W-1)/W
// of its buffer, and a pipelined broadcast (W-1)/W of it (every rank but the last
// forwards the whole buffer; this is the average). Barrier and split move no payload.
struct traffic {
  std::atomic<double> all_gather{0}, reduce_scatter{0}, all_reduce{0}, broadcast{0};

  double total() const { return all_gather + reduce_scatter + all_reduce + broadcast; }
  void reset() {
    all_gather = 0;
    reduce_scatter = 0;
    all_reduce = 0;
    broadcast = 0;
  }
};

// Counts when a collective is issued (also for the asynchronous forms), on the
// size of the communicator it runs on, so sub-groups made by split count at their
// own size — into the same tally, since it is still this rank that sends.
template <shardlib::comm::Communicator C>
class counting_comm {
 public:
  counting_comm(C inner, std::shared_ptr<traffic> tally) : inner_(std::move(inner)), tally_(std::move(tally)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  void barrier() { inner_.barrier(); }
  counting_comm split(int color, int key) { return {inner_.split(color, key), tally_}; }

  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    add(tally_->all_gather, ring(recv.size_bytes()));
    inner_.all_gather(send, recv);
  }
  template <class T>
  auto all_gather_async(std::span<const T> send, std::span<T> recv) {
    add(tally_->all_gather, ring(recv.size_bytes()));
    return inner_.all_gather_async(send, recv);
  }

  template <class T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, shardlib::comm::reduce_op op) {
    add(tally_->reduce_scatter, ring(send.size_bytes()));
    inner_.reduce_scatter(send, recv, op);
  }
  template <class T>
  auto reduce_scatter_async(std::span<const T> send, std::span<T> recv, shardlib::comm::reduce_op op) {
    add(tally_->reduce_scatter, ring(send.size_bytes()));
    return inner_.reduce_scatter_async(send, recv, op);
  }

  template <class T>
  void all_reduce(std::span<const T> send, std::span<T> recv, shardlib::comm::reduce_op op) {
    add(tally_->all_reduce, 2 * ring(send.size_bytes()));
    inner_.all_reduce(send, recv, op);
  }
  template <class T>
  void all_reduce(std::span<T> data, shardlib::comm::reduce_op op) {
    add(tally_->all_reduce, 2 * ring(data.size_bytes()));
    inner_.all_reduce(data, op);
  }
  template <class T>
  auto all_reduce_async(std::span<const T> send, std::span<T> recv, shardlib::comm::reduce_op op) {
    add(tally_->all_reduce, 2 * ring(send.size_bytes()));
    return inner_.all_reduce_async(send, recv, op);
  }

  template <class T>
  void broadcast(std::span<T> data, int root) {
    add(tally_->broadcast, ring(data.size_bytes()));
    inner_.broadcast(data, root);
  }
  template <class T>
  auto broadcast_async(std::span<T> data, int root) {
    add(tally_->broadcast, ring(data.size_bytes()));
    return inner_.broadcast_async(data, root);
  }

 private:
  double ring(std::size_t bytes) const { return double(bytes) * (size() - 1) / size(); }
  static void add(std::atomic<double>& to, double bytes) { to.fetch_add(bytes, std::memory_order_relaxed); }

  C inner_;
  std::shared_ptr<traffic> tally_;
};

}  // namespace bench
