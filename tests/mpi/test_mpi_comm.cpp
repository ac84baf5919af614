// MpiComm under mpirun: the conformance suite on every world size, both reduction
// paths, misuse detection, MPI errors as exceptions, sessions and scratch accounting.
// Every process runs the same test cases in the same order (they call collectives);
// each asserts on its own results, and the job fails if any rank fails.
#include "shardlib/mpi.hpp"

#define CATCH_CONFIG_RUNNER  // main below: MPI starts before Catch and ends after it
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../support/comm_conformance.hpp"

using namespace shardlib;
using comm::MpiComm;
using comm::reduce_op;

namespace {

void require_clean(const conformance::report& report) {
  CHECK(report.checks > 0);
  for (auto& f : report.failures) FAIL_CHECK(f);
}

// Ranks outside the group under test wait here without spinning in MPI, so the
// busy ranks get the cores when there are more ranks than cores.
void sleeping_barrier(MpiComm& c) {
  MPI_Request req;
  int done = 0;
  bool ok = MPI_Ibarrier(c.native(), &req) == MPI_SUCCESS;
  while (ok && !done) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    ok = MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS;
  }
  REQUIRE(ok);
}

// Runs suite(group, report) on ranks 0..w-1 of `world` for every w, the other
// ranks idle; `world`'s options (checks, shared memory) carry over to the groups.
template <class Suite>
void on_every_size(MpiComm& world, Suite&& suite) {
  for (int w = 1; w <= world.size(); ++w) {
    MpiComm group = world.split(world.rank() < w ? 0 : 1, world.rank());
    if (world.rank() < w) {
      INFO("world size " << w);
      conformance::report report;
      suite(group, report);
      require_clean(report);
    }
    sleeping_barrier(world);
  }
}

std::string error_of(auto&& fn) {
  try {
    fn();
  } catch (const comm_error& e) {
    return e.what();
  } catch (const shape_error& e) {
    return std::string("shape_error: ") + e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("MPI communicator passes the conformance suite on every world size", "[comm][mpi]") {
  SECTION("shared-memory reductions, rank-ordered like ThreadComm") {
    auto world = MpiComm::world();
    on_every_size(world, [](MpiComm& c, conformance::report& r) {
      conformance::full_suite(c, r);
      conformance::split_suite(c, r);
      conformance::ordered_sum_suite(c, r);
    });
  }
  SECTION("MPI's own reductions (the path across nodes), checks off") {
    auto world = MpiComm::world({.check = false, .shared_memory = false});
    CHECK(!world.options().check);
    on_every_size(world, [](MpiComm& c, conformance::report& r) { conformance::full_suite(c, r); });
  }
}

TEST_CASE("max propagates NaN on both reduction paths", "[comm][mpi]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool shm : {true, false}) {
    auto c = MpiComm::world({.shared_memory = shm});
    INFO("shared memory " << shm);
    const int w = c.size();
    // NaN from the last rank at 0 and from rank 0 at 1, so it must win whichever side it is on.
    std::vector<float> x(std::size_t(3 * w), float(c.rank()));
    for (int r = 0; r < w; ++r) {
      if (c.rank() == w - 1) x[std::size_t(3 * r)] = nan;
      if (c.rank() == 0) x[std::size_t(3 * r + 1)] = nan;
    }
    std::vector<float> all(x.size()), mine(3);
    c.all_reduce(std::span<const float>(x), std::span<float>(all), reduce_op::max);
    c.reduce_scatter(std::span<const float>(x), std::span<float>(mine), reduce_op::max);
    CHECK(std::isnan(all[0]));
    CHECK(std::isnan(all[1]));
    CHECK(all[2] == float(w - 1));
    CHECK(std::isnan(mine[0]));
    CHECK(std::isnan(mine[1]));
    CHECK(mine[2] == float(w - 1));

    std::vector<bfloat16> b(2, bfloat16(float(c.rank())));
    if (c.rank() == w - 1) b[0] = bfloat16(nan);
    c.all_reduce(std::span<bfloat16>(b), reduce_op::max);
    CHECK(std::isnan(float(b[0])));
    CHECK(float(b[1]) == float(w - 1));
  }
}

// A mean within half's range is not inf on either path: MPI's own 16-bit sums round at
// every step, so the sum of the ranks' 60000 would overflow before it is divided.
TEST_CASE("half averages of values near the top of the range stay finite on both paths", "[comm][mpi]") {
  for (bool shm : {true, false}) {
    auto c = MpiComm::world({.shared_memory = shm});
    INFO("shared memory " << shm);
    std::vector<half> x(3, half(60000.f));
    c.all_reduce(std::span<half>(x), reduce_op::avg);
    CHECK(float(x[0]) == 60000.f);  // exact for 4 and 8 ranks: every partial sum is a half
    std::vector<half> send(std::size_t(c.size()), half(60000.f)), mine(1);
    c.reduce_scatter(std::span<const half>(send), std::span<half>(mine), reduce_op::avg);
    CHECK(float(mine[0]) == 60000.f);
  }
}

TEST_CASE("shared-memory bfloat16 sums accumulate in float and round once", "[comm][mpi]") {
  auto c = MpiComm::world();
  if (c.size() < 3) return;  // needs three contributions
  // 256 + 1 + 1: pairwise bfloat16 rounding gives 256 (257 ties to even), one rounding 258.
  const float mine = c.rank() == 0 ? 256.f : c.rank() <= 2 ? 1.f : 0.f;
  std::vector<bfloat16> x(5, bfloat16(mine));
  c.all_reduce(std::span<bfloat16>(x), reduce_op::sum);
  CHECK(float(x[0]) == 258.f);
  std::vector<bfloat16> send(std::size_t(c.size()), bfloat16(mine)), recv(1);
  c.reduce_scatter(std::span<const bfloat16>(send), std::span<bfloat16>(recv), reduce_op::sum);
  CHECK(float(recv[0]) == 258.f);
}

TEST_CASE("ranks that disagree about a collective raise on every rank", "[comm][mpi][misuse]") {
  auto c = MpiComm::world();
  if (c.size() < 2) return;

  SECTION("different counts") {
    std::vector<float> send(c.rank() == 1 ? 5 : 4), recv(send.size() * c.size());
    const auto e = error_of([&] { c.all_gather(std::span<const float>(send), std::span<float>(recv)); });
    CHECK_THAT(e, Catch::Contains("rank " + std::to_string(c.rank()) + ": ranks disagree") &&
                      Catch::Contains("rank 0 called all_gather(4 x F32)") &&
                      Catch::Contains("rank 1 called all_gather(5 x F32)"));
    c.barrier();  // still usable afterwards
    std::vector<float> ok(c.size()), one{float(c.rank())};
    c.all_gather(std::span<const float>(one), std::span<float>(ok));
    CHECK(ok.back() == float(c.size() - 1));
  }
  SECTION("in a communicator split in reverse, the messages name each process's world rank too") {
    auto rev = c.split(0, -c.rank());  // new rank r is world rank size - 1 - r
    const int w = c.size();
    std::vector<float> send(rev.rank() == 1 ? 5 : 4), recv(send.size() * w);
    const auto name = [&](int r) {  // the world's middle rank keeps its number
      return r == w - 1 - r ? cat("rank ", r) : cat("rank ", r, " (world rank ", w - 1 - r, ")");
    };
    const auto e = error_of([&] { rev.all_gather(std::span<const float>(send), std::span<float>(recv)); });
    CHECK_THAT(e, Catch::Contains(name(rev.rank()) + ": ranks disagree") &&
                      Catch::Contains(name(0) + " called all_gather(4 x F32)") &&
                      Catch::Contains(name(1) + " called all_gather(5 x F32)"));
  }
  SECTION("different operations, types and roots") {
    std::vector<double> d(8);
    std::vector<float> f(8);
    const auto ops = error_of([&] {
      if (c.rank() == 0) c.all_reduce(std::span<double>(d), reduce_op::sum);
      else c.all_reduce(std::span<float>(f), reduce_op::max);
    });
    CHECK_THAT(ops, Catch::Contains("all_reduce(8 x F64, sum)") && Catch::Contains("all_reduce(8 x F32, max)"));
    const auto same_type =
        error_of([&] { c.all_reduce(std::span<float>(f), c.rank() == 0 ? reduce_op::sum : reduce_op::avg); });
    CHECK_THAT(same_type, Catch::Contains("all_reduce(8 x F32, sum)") && Catch::Contains("all_reduce(8 x F32, avg)"));
    const auto roots = error_of([&] { c.broadcast(std::span<float>(f), c.rank()); });
    CHECK_THAT(roots, Catch::Contains("broadcast(8 x F32, root 0)") && Catch::Contains("broadcast(8 x F32, root 1)"));
  }
  SECTION("different collectives, asynchronous: the error surfaces on wait()") {
    std::vector<float> a(6), b(6 * c.size());
    auto w = c.rank() == 0 ? c.all_reduce_async(std::span<const float>(a), std::span<float>(a), reduce_op::sum)
                           : c.all_gather_async(std::span<const float>(a), std::span<float>(b));
    CHECK_THAT(error_of([&] { w.wait(); }), Catch::Contains("rank 0 called all_reduce(6 x F32, sum)") &&
                                                 Catch::Contains("rank 1 called all_gather(6 x F32)"));
  }
  SECTION("a wrong buffer on one rank: it raises its shape_error, the others comm_aborted") {
    std::vector<float> send(4), recv(c.rank() == 1 ? 7 : 4 * c.size());
    bool aborted = false;
    const auto e = error_of([&] {
      try {
        c.all_gather(std::span<const float>(send), std::span<float>(recv));
      } catch (const comm_aborted&) {
        aborted = true;
        throw;
      }
    });
    if (c.rank() == 1) {
      CHECK_THAT(e, Catch::StartsWith("shape_error: rank 1: all_gather of 4 elements") &&
                        Catch::Contains("needs a receive buffer of " + std::to_string(4 * c.size()) + ", got 7"));
    } else {
      CHECK(aborted);
      CHECK_THAT(e, Catch::Contains("rank 1 passed invalid arguments to all_gather(4 x F32)"));
    }
  }
  SECTION("an invalid reduction raises on every rank") {
    std::vector<std::int32_t> i(4);
    CHECK_THAT(error_of([&] { c.all_reduce(std::span<std::int32_t>(i), reduce_op::avg); }),
               Catch::Contains(cat("rank ", c.rank(), ": all_reduce: avg needs a floating element type, got I32")));
    std::unique_ptr<bool[]> bools(new bool[4]{});
    CHECK_THAT(error_of([&] { c.all_reduce(std::span<bool>(bools.get(), 4), reduce_op::max); }),
               Catch::Contains("max is not defined for BOOL"));
  }
}

TEST_CASE("MPI errors become comm_error on every rank, not an abort", "[comm][mpi][errors]") {
  auto c = MpiComm::world();
  std::vector<float> data(8, float(c.rank()));
  const auto e = error_of([&] { c.broadcast(std::span<float>(data), c.size()); });
  CHECK_THAT(e, Catch::StartsWith("rank " + std::to_string(c.rank()) + ": broadcast(8 x F32, root " +
                                  std::to_string(c.size()) + "): MPI_Bcast failed: MPI_ERR_ROOT"));
  c.broadcast(std::span<float>(data), 0);  // the communicator still works
  CHECK(data[7] == 0.f);

  // The library's communicators return errors; the user's MPI_COMM_WORLD is left alone.
  auto handler = [](MPI_Comm comm) {
    MPI_Errhandler h;
    MPI_Comm_get_errhandler(comm, &h);
    const bool returns = h == MPI_ERRORS_RETURN;
    MPI_Errhandler_free(&h);
    return returns;
  };
  auto sub = c.split(c.rank() % 2, c.rank());
  CHECK(handler(c.native()));
  CHECK(handler(sub.native()));
  CHECK_FALSE(handler(MPI_COMM_WORLD));
}

TEST_CASE("split orders by key and keeps the options", "[comm][mpi]") {
  auto c = MpiComm::world({.check = false});
  auto rev = c.split(0, -c.rank());
  CHECK(rev.size() == c.size());
  CHECK(rev.rank() == c.size() - 1 - c.rank());
  CHECK_FALSE(rev.options().check);
  CHECK_THAT(error_of([&] { c.split(-1, 0); }), Catch::Contains("split color must be >= 0, got -1"));
}

TEST_CASE("asynchronous collectives run in issue order, before later blocking ones", "[comm][mpi][async]") {
  auto c = MpiComm::world();
  const int w = c.size();
  std::vector<float> a(1000, float(c.rank())), ga(std::size_t(1000 * w)), b(std::size_t(1000 * w), 1.f), rb(1000);
  auto w1 = c.all_gather_async(std::span<const float>(a), std::span<float>(ga));
  auto w2 = c.reduce_scatter_async(std::span<const float>(b), std::span<float>(rb), reduce_op::sum);
  w2.wait();  // finishing the later one implies the earlier one ran
  CHECK(w1.test());
  CHECK(ga[1000 * std::size_t(w - 1)] == float(w - 1));
  CHECK(rb[999] == float(w));

  std::vector<float> x(100, 1.f);
  auto w3 = c.all_reduce_async(std::span<const float>(x), std::span<float>(x), reduce_op::sum);
  c.barrier();  // drains the worker first
  CHECK(w3.test());
  CHECK(x[0] == float(w));
}

TEST_CASE("the shared-memory window is comm scratch in the rank's ledger", "[comm][mpi][ledger]") {
  auto c = MpiComm::world();
  if (c.size() < 2) return;
  const std::size_t before = current_ledger().current(category::comm_scratch);
  {
    auto sub = c.split(0, c.rank());
    std::vector<float> send(std::size_t(10 * c.size()), 1.f), recv(10);
    sub.reduce_scatter(std::span<const float>(send), std::span<float>(recv), reduce_op::sum);
    CHECK(recv[9] == float(c.size()));
    CHECK(current_ledger().current(category::comm_scratch) == before + 2 * comm::detail::shm_piece_bytes);
  }
  CHECK(current_ledger().current(category::comm_scratch) == before);
}

TEST_CASE("the watchdog's limit: the option, else SHARDLIB_COMM_TIMEOUT, else 600 s", "[comm][mpi][watchdog]") {
  using namespace std::chrono_literals;
  const char* was = std::getenv("SHARDLIB_COMM_TIMEOUT");
  const std::string saved = was ? was : "";
  ::unsetenv("SHARDLIB_COMM_TIMEOUT");
  CHECK(MpiComm::world().options().timeout == comm::default_comm_timeout);
  CHECK(MpiComm::world({.timeout = 500s}).options().timeout == 500s);
  ::setenv("SHARDLIB_COMM_TIMEOUT", "250.5", 1);
  auto c = MpiComm::world();
  CHECK(c.options().timeout == 250.5s);
  CHECK(c.split(0, c.rank()).options().timeout == 250.5s);
  CHECK(MpiComm::world({.timeout = 0s}).options().timeout == 0s);  // no limit
  ::setenv("SHARDLIB_COMM_TIMEOUT", "ten", 1);
  CHECK_THAT(error_of([] { MpiComm::world(); }),
             Catch::Contains("SHARDLIB_COMM_TIMEOUT must be a number of seconds >= 0, got 'ten'"));
  CHECK_THAT(error_of([] { MpiComm::world({.timeout = -1s}); }),
             Catch::Contains("communicator timeout must be >= 0 s, got -1"));
  if (was) ::setenv("SHARDLIB_COMM_TIMEOUT", saved.c_str(), 1);
  else ::unsetenv("SHARDLIB_COMM_TIMEOUT");
}

TEST_CASE("a session under a running MPI neither initialises nor finalises it", "[comm][mpi][session]") {
  {
    comm::mpi_session inner;
    CHECK_FALSE(inner.owns_mpi());
    CHECK(inner.thread_level() >= MPI_THREAD_SERIALIZED);
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  CHECK(finalized == 0);
}

int main(int argc, char** argv) {
  comm::mpi_session session(&argc, &argv);
  const int failed = Catch::Session().run(argc, argv);
  int any = 0;  // every rank exits with the job's verdict
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}
