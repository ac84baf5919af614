// Which types satisfy the Communicator concept, and which do not.
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/thread_comm.hpp"
#include "shardlib/comm/work.hpp"

#include <catch2/catch.hpp>

namespace test_concepts {

using namespace shardlib;
using namespace shardlib::comm;

namespace {
// A complete user communicator (signatures only).
struct user_comm {
  int rank() const { return 0; }
  int size() const { return 1; }
  void barrier() {}
  user_comm split(int, int) { return {}; }
  template <class T> void all_gather(std::span<const T>, std::span<T>) {}
  template <class T> work all_gather_async(std::span<const T>, std::span<T>) { return {}; }
  template <class T> void reduce_scatter(std::span<const T>, std::span<T>, reduce_op) {}
  template <class T> work reduce_scatter_async(std::span<const T>, std::span<T>, reduce_op) { return {}; }
  template <class T> void all_reduce(std::span<const T>, std::span<T>, reduce_op) {}
  template <class T> void all_reduce(std::span<T>, reduce_op) {}
  template <class T> work all_reduce_async(std::span<const T>, std::span<T>, reduce_op) { return {}; }
  template <class T> void broadcast(std::span<T>, int) {}
  template <class T> work broadcast_async(std::span<T>, int) { return {}; }
};
// The same without barrier().
struct no_barrier {
  int rank() const { return 0; }
  int size() const { return 1; }
  no_barrier split(int, int) { return {}; }
  template <class T> void all_gather(std::span<const T>, std::span<T>) {}
  template <class T> work all_gather_async(std::span<const T>, std::span<T>) { return {}; }
  template <class T> void reduce_scatter(std::span<const T>, std::span<T>, reduce_op) {}
  template <class T> work reduce_scatter_async(std::span<const T>, std::span<T>, reduce_op) { return {}; }
  template <class T> void all_reduce(std::span<const T>, std::span<T>, reduce_op) {}
  template <class T> void all_reduce(std::span<T>, reduce_op) {}
  template <class T> work all_reduce_async(std::span<const T>, std::span<T>, reduce_op) { return {}; }
  template <class T> void broadcast(std::span<T>, int) {}
  template <class T> work broadcast_async(std::span<T>, int) { return {}; }
};
// Only float collectives: fails for bfloat16.
struct float_only : user_comm {
  float_only split(int, int) { return {}; }
  void all_gather(std::span<const float>, std::span<float>) {}
};
struct not_work {};
}  // namespace

TEST_CASE("Communicator accepts complete types and rejects incomplete ones", "[concepts][comm]") {
  STATIC_REQUIRE(Communicator<ThreadComm>);
  STATIC_REQUIRE(Communicator<user_comm>);
  STATIC_REQUIRE(check_communicator<user_comm>());
  STATIC_REQUIRE_FALSE(Communicator<no_barrier>);
  STATIC_REQUIRE_FALSE(comm::detail::has_barrier<no_barrier>);
  STATIC_REQUIRE(comm::detail::has_all_gather<no_barrier, float>);
  STATIC_REQUIRE_FALSE(Communicator<float_only>);
  STATIC_REQUIRE_FALSE(Communicator<int>);
  STATIC_REQUIRE(Work<work>);
  STATIC_REQUIRE_FALSE(Work<not_work>);
}

}  // namespace test_concepts
