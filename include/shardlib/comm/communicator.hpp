// shardlib/comm/communicator.hpp — the Communicator concept, reduce_op, and a diagnostic for user types.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"

#include <concepts>     // std::same_as
#include <span>         // std::span
#include <string_view>  // std::string_view

namespace shardlib::comm {

enum class reduce_op { sum, avg, max };

constexpr std::string_view name(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::max: return "max";
  }
  return "?";
}

// A waitable handle for an asynchronous collective.
template <class W>
concept Work = requires(W w) {
  w.wait();
  { w.test() } -> std::same_as<bool>;
};

// The requirements, one concept per member so that a diagnostic can name the
// member a type lacks. They are checked with float and bfloat16 buffers, which
// stand for every element type (a model must accept all of them).
//
// Buffers and counts (n elements per rank, W ranks):
//   all_gather(send[n], recv[W*n])           recv = send of rank 0, ..., send of rank W-1
//   reduce_scatter(send[W*n], recv[n], op)   recv = op over ranks of send[rank*n, (rank+1)*n)
//   all_reduce(send[n], recv[n], op)         recv = op over ranks of send (send may equal recv)
//   all_reduce(data[n], op)                  in place
//   broadcast(data[n], root)                 data = data of root
// In-place forms pass overlapping spans: all_gather's send is recv's own slice,
// reduce_scatter's recv is send's own slice.
namespace detail {
template <class C, class T>
concept has_all_gather = requires(C& c, std::span<const T> in, std::span<T> out) {
  c.all_gather(in, out);
  { c.all_gather_async(in, out) } -> Work;
};
template <class C, class T>
concept has_reduce_scatter = requires(C& c, std::span<const T> in, std::span<T> out, reduce_op op) {
  c.reduce_scatter(in, out, op);
  { c.reduce_scatter_async(in, out, op) } -> Work;
};
template <class C, class T>
concept has_all_reduce = requires(C& c, std::span<const T> in, std::span<T> out, reduce_op op) {
  c.all_reduce(in, out, op);
  c.all_reduce(out, op);
  { c.all_reduce_async(in, out, op) } -> Work;
};
template <class C, class T>
concept has_broadcast = requires(C& c, std::span<T> data, int root) {
  c.broadcast(data, root);
  { c.broadcast_async(data, root) } -> Work;
};
template <class C>
concept has_rank_and_size = requires(const C& c) {
  { c.rank() } -> std::same_as<int>;
  { c.size() } -> std::same_as<int>;
};
template <class C>
concept has_barrier = requires(C& c) { c.barrier(); };
template <class C>
concept has_split = requires(C& c, int color, int key) {
  { c.split(color, key) } -> std::same_as<C>;
};
}  // namespace detail

template <class C>
concept Communicator =
    detail::has_rank_and_size<C> && detail::has_barrier<C> && detail::has_split<C> &&
    detail::has_all_gather<C, float> && detail::has_all_gather<C, bfloat16> &&
    detail::has_reduce_scatter<C, float> && detail::has_reduce_scatter<C, bfloat16> &&
    detail::has_all_reduce<C, float> && detail::has_all_reduce<C, bfloat16> &&
    detail::has_broadcast<C, float> && detail::has_broadcast<C, bfloat16>;

// static_assert(check_communicator<MyComm>()) reports the first member MyComm
// lacks by name, where a failed `Communicator<MyComm>` only says "not satisfied".
template <class C>
constexpr bool check_communicator() {
  static_assert(detail::has_rank_and_size<C>, "Communicator: missing `int rank() const` or `int size() const`");
  static_assert(detail::has_barrier<C>, "Communicator: missing `barrier()`");
  static_assert(detail::has_split<C>, "Communicator: missing `C split(int color, int key)` returning the same type");
  static_assert(detail::has_all_gather<C, float> && detail::has_all_gather<C, bfloat16>,
                "Communicator: missing `all_gather(span<const T>, span<T>)` or `all_gather_async` (returning a Work)");
  static_assert(detail::has_reduce_scatter<C, float> && detail::has_reduce_scatter<C, bfloat16>,
                "Communicator: missing `reduce_scatter(span<const T>, span<T>, reduce_op)` or `reduce_scatter_async`");
  static_assert(detail::has_all_reduce<C, float> && detail::has_all_reduce<C, bfloat16>,
                "Communicator: missing `all_reduce(span<const T>, span<T>, reduce_op)`, `all_reduce(span<T>, "
                "reduce_op)` or `all_reduce_async`");
  static_assert(detail::has_broadcast<C, float> && detail::has_broadcast<C, bfloat16>,
                "Communicator: missing `broadcast(span<T>, int root)` or `broadcast_async`");
  return Communicator<C>;
}

}  // namespace shardlib::comm
