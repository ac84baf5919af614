// tests/support/comm_conformance.hpp — one conformance suite for every Communicator.
// Ranks record failures in a per-rank report (Catch2 assertions are not thread-safe);
// the test driver asserts the reports are empty after the ranks return.
#pragma once
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/element.hpp"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace conformance {

using namespace shardlib;
using comm::reduce_op;

struct report {
  std::vector<std::string> failures;
  int checks = 0;
  void expect(bool ok, const std::string& what) {
    ++checks;
    if (!ok && failures.size() < 20) failures.push_back(what);
  }
};

// Input of `rank` at index i: small integers, exact in every element type, so sums
// over up to 8 ranks are exact too and expected values need no tolerance.
// A plain array (std::vector<bool> has no data()).
template <class T>
struct array {
  explicit array(std::size_t n, T fill = T{}) : n_(n), p_(new T[n == 0 ? 1 : n]) { std::fill_n(p_.get(), n, fill); }
  T& operator[](std::size_t i) { return p_[i]; }
  T* data() { return p_.get(); }
  std::size_t size() const { return n_; }
  operator std::span<T>() { return {p_.get(), n_}; }
  operator std::span<const T>() { return {p_.get(), n_}; }
  std::size_t n_;
  std::unique_ptr<T[]> p_;
};

template <class T>
T input(int rank, std::size_t i) {
  int v = int((i * 7 + std::size_t(rank) * 13) % 17) - 8;  // -8 .. 8
  if constexpr (std::is_same_v<T, bool>) return ((i + std::size_t(rank)) % 3) == 0;
  else if constexpr (std::is_unsigned_v<T>) return T(v + 8);
  else return T(v);
}

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, shardlib::half>) return double(float(x));
  else return double(x);
}

// What reduce_op gives for index i over ranks 0..w-1, computed the way the
// library promises: accumulate in accumulator type, in rank order, round once.
template <class T>
T expected_reduce(int w, std::size_t i, reduce_op op) {
  using A = std::conditional_t<std::is_same_v<T, bfloat16> || std::is_same_v<T, shardlib::half>, float, T>;
  A acc = A(input<T>(0, i));
  for (int r = 1; r < w; ++r) {
    A x = A(input<T>(r, i));
    acc = op == reduce_op::max ? (x > acc ? x : acc) : A(acc + x);
  }
  if (op == reduce_op::avg) acc = acc / A(w);
  return T(acc);
}

template <class T>
bool same(T a, T b) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, shardlib::half>) return a.bits == b.bits;
  else return a == b;
}

template <class T>
std::string where(const char* what, comm::Communicator auto& c, std::size_t n, std::size_t i, T got, T want) {
  return cat("rank ", c.rank(), "/", c.size(), " ", what, "<", name(dtype_of<T>), "> n=", n, " index ", i, ": got ",
             as_double(got), ", expected ", as_double(want));
}

template <class T, comm::Communicator C>
void all_gather_case(C& c, std::size_t n, bool in_place, bool async, report& out) {
  const int w = c.size();
  array<T> recv(n * w), own(n);
  for (std::size_t i = 0; i < n; ++i) own[i] = input<T>(c.rank(), i);
  std::span<const T> send = std::span<const T>(own);
  if (in_place) {
    std::copy_n(own.data(), n, recv.data() + c.rank() * n);
    send = std::span<const T>(recv.data() + c.rank() * n, n);
  }
  if (async) c.all_gather_async(send, std::span<T>(recv)).wait();
  else c.all_gather(send, std::span<T>(recv));
  for (int r = 0; r < w; ++r)
    for (std::size_t i = 0; i < n; ++i) {
      T want = input<T>(r, i);
      if (!same(recv[r * n + i], want)) return out.expect(false, where("all_gather", c, n, r * n + i, recv[r * n + i], want));
    }
  out.expect(true, "");
}

template <class T, comm::Communicator C>
void reduce_scatter_case(C& c, std::size_t n, reduce_op op, bool in_place, bool async, report& out) {
  const int w = c.size();
  array<T> send(n * w);
  for (std::size_t i = 0; i < n * w; ++i) send[i] = input<T>(c.rank(), i);
  array<T> separate(n);
  std::span<T> recv = in_place ? std::span<T>(send.data() + c.rank() * n, n) : std::span<T>(separate);
  if (async) c.reduce_scatter_async(std::span<const T>(send), recv, op).wait();
  else c.reduce_scatter(std::span<const T>(send), recv, op);
  for (std::size_t i = 0; i < n; ++i) {
    T want = expected_reduce<T>(w, c.rank() * n + i, op);
    if (!same(recv[i], want)) return out.expect(false, where("reduce_scatter", c, n, i, recv[i], want));
  }
  out.expect(true, "");
}

template <class T, comm::Communicator C>
void all_reduce_case(C& c, std::size_t n, reduce_op op, bool in_place, bool async, report& out) {
  array<T> send(n), recv(n);
  for (std::size_t i = 0; i < n; ++i) send[i] = input<T>(c.rank(), i);
  std::span<T> result = in_place ? std::span<T>(send) : std::span<T>(recv);
  if (async) c.all_reduce_async(std::span<const T>(send), result, op).wait();
  else if (in_place) c.all_reduce(result, op);
  else c.all_reduce(std::span<const T>(send), result, op);
  for (std::size_t i = 0; i < n; ++i) {
    T want = expected_reduce<T>(c.size(), i, op);
    if (!same(result[i], want)) return out.expect(false, where("all_reduce", c, n, i, result[i], want));
  }
  out.expect(true, "");
}

template <class T, comm::Communicator C>
void broadcast_case(C& c, std::size_t n, int root, bool async, report& out) {
  array<T> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = input<T>(c.rank(), i);
  if (async) c.broadcast_async(std::span<T>(data), root).wait();
  else c.broadcast(std::span<T>(data), root);
  for (std::size_t i = 0; i < n; ++i) {
    T want = input<T>(root, i);
    if (!same(data[i], want)) return out.expect(false, where("broadcast", c, n, i, data[i], want));
  }
  out.expect(true, "");
}

// Counts: empty, fewer than the ranks, not divisible by any of 2..8, and large
// enough to span several internal blocks.
inline constexpr std::size_t counts[] = {0, 1, 3, 7, 1031, 5003};

template <class T, comm::Communicator C>
void element_suite(C& c, report& out) {
  for (std::size_t n : counts) {
    for (bool async : {false, true}) {
      for (bool in_place : {false, true}) all_gather_case<T>(c, n, in_place, async, out);
      broadcast_case<T>(c, n, c.size() - 1, async, out);
      if constexpr (!std::is_same_v<T, bool>) {
        std::vector<reduce_op> ops{reduce_op::sum, reduce_op::max};
        if constexpr (FloatingElement<T>) ops.push_back(reduce_op::avg);
        for (reduce_op op : ops)
          for (bool in_place : {false, true}) {
            reduce_scatter_case<T>(c, n, op, in_place, async, out);
            all_reduce_case<T>(c, n, op, in_place, async, out);
          }
      }
    }
  }
}

// Every collective, every element type, sync and async, in place and not.
template <comm::Communicator C>
void full_suite(C& c, report& out) {
  element_suite<double>(c, out);
  element_suite<float>(c, out);
  element_suite<shardlib::half>(c, out);
  element_suite<bfloat16>(c, out);
  element_suite<std::int64_t>(c, out);
  element_suite<std::int32_t>(c, out);
  element_suite<std::int16_t>(c, out);
  element_suite<std::int8_t>(c, out);
  element_suite<std::uint8_t>(c, out);
  element_suite<bool>(c, out);
  c.barrier();
}

// Split into even and odd ranks, with the key reversing the order, and run the
// float suite inside each half.
template <comm::Communicator C>
void split_suite(C& c, report& out) {
  C sub = c.split(c.rank() % 2, -c.rank());
  const int expected_size = (c.size() + (c.rank() % 2 == 0 ? 1 : 0)) / 2;
  out.expect(sub.size() == expected_size, cat("rank ", c.rank(), ": split size ", sub.size(), ", expected ", expected_size));
  const int higher = [&] {  // ranks of my color above me come first (key = -rank)
    int k = 0;
    for (int r = c.rank() + 2; r < c.size(); r += 2) ++k;
    return k;
  }();
  out.expect(sub.rank() == higher, cat("rank ", c.rank(), ": split rank ", sub.rank(), ", expected ", higher));
  element_suite<float>(sub, out);
}

// A non-exact float sum whose bits must equal a serial sum over ranks in rank
// order: for communicators that promise rank-ordered, reproducible reductions.
template <comm::Communicator C>
void ordered_sum_suite(C& c, report& out) {
  std::vector<float> x(257);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(std::sin(double(i + 1) * (c.rank() + 1)) * 1e3);
  std::vector<float> sum(x.size());
  c.all_reduce(std::span<const float>(x), std::span<float>(sum), reduce_op::sum);
  for (std::size_t i = 0; i < x.size(); ++i) {
    float serial = 0.f;
    for (int r = 0; r < c.size(); ++r) {
      float xr = float(std::sin(double(i + 1) * (r + 1)) * 1e3);
      serial = r == 0 ? xr : serial + xr;
    }
    if (std::memcmp(&serial, &sum[i], 4) != 0)
      return out.expect(false, cat("rank ", c.rank(), ": all_reduce is not the rank-ordered sum at ", i));
  }
  out.expect(true, "");
}

}  // namespace conformance
