// NcclComm on a GPU: the Communicator conformance suite at world size 1 (and
// at every GPU of the machine when there are several), in-place and
// asynchronous use, the compute-stream ordering, and the errors that replace
// hangs (timeouts, host pointers, 16-bit integer reductions).
//
// The suite first: it names shardlib's `half` after a using-directive, which
// CUDA's headers make ambiguous with their global `half` once they are seen.
#include "support/comm_conformance.hpp"

#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/comm/store.hpp>
#include <shardlib/comm/thread_comm.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>  // getpid

#include "device_test.hpp"
#include "staged_comm.hpp"

namespace test_nccl {

namespace sl = shardlib;
using namespace device_test;
using sl::comm::NcclComm;
using sl::comm::reduce_op;

namespace {

NcclComm single_rank(const sl::comm::nccl_options& o = {}) {
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  return NcclComm(id, 0, 1, 0, o);
}

// Every element type NCCL reduces, plus bool (no reductions in the suite);
// I16 is checked separately (NCCL cannot reduce it).
template <sl::comm::Communicator C>
void nccl_suite(C& c, conformance::report& r) {
  conformance::element_suite<double>(c, r);
  conformance::element_suite<float>(c, r);
  conformance::element_suite<sl::half>(c, r);
  conformance::element_suite<sl::bfloat16>(c, r);
  conformance::element_suite<std::int64_t>(c, r);
  conformance::element_suite<std::int32_t>(c, r);
  conformance::element_suite<std::int8_t>(c, r);
  conformance::element_suite<std::uint8_t>(c, r);
  conformance::element_suite<bool>(c, r);
  c.barrier();
}

void require_clean(const conformance::report& r) {
  for (const auto& f : r.failures) INFO(f);
  CHECK(r.failures.empty());
  CHECK(r.checks > 100);
}

}  // namespace

TEST_CASE("NcclComm passes the Communicator conformance suite at world size 1", "[nccl][conformance]") {
  if (!have_device()) return;
  staged_comm c(single_rank());
  conformance::report r;
  nccl_suite(c, r);
  conformance::split_suite(c, r);
  conformance::ordered_sum_suite(c, r);
  require_clean(r);
}

TEST_CASE("NcclComm over every GPU of the machine, one thread each, bootstrapped over ThreadComm",
          "[nccl][conformance]") {
  if (!have_device()) return;
  const int gpus = std::min(sl::cuda::device_count(), 8);
  if (gpus < 2) {
    WARN("one GPU: the multi-rank conformance runs on machines with several");
    return;
  }
  std::vector<conformance::report> reports(gpus);
  sl::comm::launch(gpus, [&](sl::comm::ThreadComm& host) {
    staged_comm c(NcclComm::bootstrap(host, host.rank()));
    nccl_suite(c, reports[host.rank()]);
    conformance::split_suite(c, reports[host.rank()]);
  });
  for (const auto& r : reports) require_clean(r);
}

TEST_CASE("collectives are ordered after the compute stream's work and before what follows it", "[nccl][streams]") {
  if (!have_device()) return;
  sl::cuda::stream compute(0);
  NcclComm c = single_rank().on(compute);
  const std::size_t n = 1 << 22;
  std::vector<float> ones(n, 1.0f);
  sl::cuda::device_buffer<float> x(n, sl::category::activations, compute), y(n, sl::category::activations, compute);
  // Produced on the compute stream, reduced on the comm stream, read back on the compute stream.
  sl::cuda::copy_async(x.span(), std::span<const float>(ones), compute);
  auto w = c.all_reduce_async(std::span<const float>(x.span()), y.span(), reduce_op::sum);
  w.wait();
  std::vector<float> out(n);
  sl::cuda::copy_async(std::span<float>(out), std::span<const float>(y.span()), compute);
  compute.synchronize();
  CHECK(out == ones);
  CHECK(w.test());
  w.wait_host();  // already complete: returns at once
}

TEST_CASE("NcclComm refuses what NCCL cannot do with a message, not a crash or a hang", "[nccl][errors]") {
  if (!have_device()) return;
  NcclComm c = single_rank();
  std::vector<float> host(4);
  CHECK_THROWS_WITH(c.all_reduce(std::span<float>(host), reduce_op::sum),
                    Catch::Contains("host memory") && Catch::Contains("all_reduce(4 x F32, sum)"));
  sl::cuda::device_buffer<std::int16_t> i16(8, sl::category::activations, nullptr);
  CHECK_THROWS_WITH(c.all_reduce(i16.span(), reduce_op::sum), Catch::Contains("cannot reduce I16"));
  c.all_gather(std::span<const std::int16_t>(i16.span()), i16.span());  // gathers move any type
  sl::cuda::device_buffer<float> big(8, sl::category::activations, nullptr);
  CHECK_THROWS_AS(c.all_gather(std::span<const float>(big.span()).first(4), big.span().first(7)), sl::shape_error);
  CHECK_THROWS_WITH(c.all_reduce(std::span<const float>(big.span()).first(4), big.span().subspan(2, 4), reduce_op::sum),
                    Catch::Contains("overlap without being in place"));
  c.barrier();
}

// With check on, every rank's call is compared before the collective is enqueued: NCCL
// itself would hang or write past the buffers. (The emulated NCCL refuses disagreeing
// calls with a message of its own, "... while rank 0 called ...", which these do not
// accept: the library's check has to be what raises.)
TEST_CASE("with check on ranks calling different collectives raise on every rank and name both calls",
          "[nccl][check]") {
  if (!have_device()) return;
  const int gpus = std::min(sl::cuda::device_count(), 4);
  if (gpus < 2) {
    WARN("one GPU: the check between ranks runs on machines with several");
    return;
  }
  std::vector<std::string> sizes(gpus), kinds(gpus), invalid(gpus);
  std::vector<float> after(gpus, -1.0f);
  sl::comm::launch(gpus, [&](sl::comm::ThreadComm& host) {
    const int r = host.rank();
    sl::cuda::device_guard on(r);
    NcclComm c = NcclComm::bootstrap(host, r, {.timeout = std::chrono::seconds(60), .check = true});
    sl::cuda::device_buffer<float> src(8, sl::category::activations, nullptr),
        buf(std::size_t(8 * gpus), sl::category::activations, nullptr);
    const auto send = [&](std::size_t n) { return std::span<const float>(src.span()).first(n); };
    const auto error_of = [](auto f) -> std::string {
      try {
        f();
      } catch (const sl::comm_error& e) {
        return e.what();
      } catch (const sl::shape_error& e) {
        return std::string("shape_error: ") + e.what();
      }
      return "no error";
    };
    const std::size_t n = r == 1 ? 5 : 4;  // rank 1 gathers five elements, the others four
    sizes[r] = error_of([&] { c.all_gather(send(n), buf.span().first(n * gpus)); });
    kinds[r] = error_of([&] {  // rank 1 reduces where the others gather
      if (r == 1) c.all_reduce(buf.span().first(4), reduce_op::sum);
      else c.all_gather(send(4), buf.span().first(4 * gpus));
    });
    invalid[r] = error_of([&] {  // rank 1's receive buffer is one short
      c.all_gather(send(4), buf.span().first(4 * gpus - (r == 1 ? 1 : 0)));
    });
    // Every rank took part in every check: the communicator is still in step.
    std::vector<float> ones(4, 1.0f);
    sl::cuda::copy_async(buf.span().first(4), std::span<const float>(ones), nullptr);
    c.all_reduce(buf.span().first(4), reduce_op::sum);
    sl::cuda::copy_async(std::span<float>(ones), std::span<const float>(buf.span().first(4)), nullptr);
    sl::cuda::check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
    after[r] = ones[0];
  });
  for (int r = 0; r < gpus; ++r) {
    INFO("rank " << r);
    CHECK_THAT(sizes[r], Catch::Contains("rank " + std::to_string(r) + ": ranks disagree about a collective: rank 0 "
                                         "called all_gather(4 x F32), rank 1 called all_gather(5 x F32)"));
    CHECK_THAT(kinds[r], Catch::Contains("ranks disagree about a collective: rank 0 called all_gather(4 x F32), "
                                         "rank 1 called all_reduce(4 x F32, sum)"));
    if (r == 1)
      CHECK_THAT(invalid[r], Catch::StartsWith("shape_error: rank 1: all_gather of 4 elements per rank"));
    else
      CHECK_THAT(invalid[r], Catch::Contains("all_gather(4 x F32) abandoned: rank 1 passed invalid arguments"));
    CHECK(after[r] == float(gpus));
  }
}

TEST_CASE("nccl_options::check: off unless asked for, or SHARDLIB_NCCL_CHECK=1 when unset", "[nccl][check]") {
  ::unsetenv("SHARDLIB_NCCL_CHECK");
  CHECK_FALSE(sl::comm::checks_calls({}));
  CHECK(sl::comm::checks_calls({.check = true}));
  ::setenv("SHARDLIB_NCCL_CHECK", "1", 1);
  CHECK(sl::comm::checks_calls({}));
  CHECK_FALSE(sl::comm::checks_calls({.check = false}));
  ::setenv("SHARDLIB_NCCL_CHECK", "0", 1);
  CHECK_FALSE(sl::comm::checks_calls({}));
  ::unsetenv("SHARDLIB_NCCL_CHECK");
}

// A rank in a collective its peer never makes: NCCL may keep the call in progress (it
// connects lazily; the emulated NCCL always does) or run it and leave its kernel waiting.
// Either way abort() from another thread ends it at once, not at the timeout.
TEST_CASE("abort() from another thread ends a collective that waits for a peer", "[nccl][errors]") {
  if (!have_device()) return;
  if (sl::cuda::device_count() < 2) {
    WARN("one GPU: a communicator of two ranks needs two");
    return;
  }
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  const sl::comm::nccl_options o{.timeout = std::chrono::seconds(60)};
  std::atomic<bool> finished = false;
  std::thread peer([&] {  // rank 1 joins, then never makes the collective
    NcclComm other(id, 1, 2, 1, o);
    while (!finished) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    other.abort();  // finalising would wait for the collective it never made
  });
  NcclComm c(id, 0, 2, 0, o);
  sl::cuda::device_guard on(0);
  sl::cuda::device_buffer<float> x(4, sl::category::activations, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  std::string error = "no error";
  std::thread rank0([&] {
    sl::cuda::device_guard here(0);
    try {
      c.all_reduce_async(std::span<const float>(x.span()), x.span(), reduce_op::sum).wait_host();
    } catch (const sl::comm_error& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  c.abort();
  rank0.join();
  CHECK_THAT(error, Catch::Contains("rank 0/2: the NCCL communicator on device 0 was aborted: NcclComm::abort"));
  finished = true;
  peer.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));  // the timeout is 60 s
}

TEST_CASE("two ranks of one communicator on one GPU are refused, not hung", "[nccl][errors][timeout]") {
  if (!have_device()) return;
  // NCCL refuses it ("Duplicate GPU detected", ncclInvalidUsage): the initialisation fails on
  // each rank once all have joined, and bootstrap raises.
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(sl::comm::launch(2,
                                     [](sl::comm::ThreadComm& host) {
                                       (void)NcclComm::bootstrap(host, 0, {.timeout = std::chrono::seconds(30)});
                                     }),
                    Catch::Contains("NCCL initialisation (rank"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
}

TEST_CASE("an initialisation that cannot complete times out and aborts instead of hanging", "[nccl][timeout]") {
  if (!have_device()) return;
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 0 of 2, and rank 1 never comes.
  CHECK_THROWS_WITH(NcclComm(id, 0, 2, 0, {.timeout = std::chrono::seconds(3)}), Catch::Contains("timed out"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
}

// As the other communicators: SHARDLIB_COMM_TIMEOUT (seconds) when nccl_options::timeout is not
// given, 0 or inf for no limit, 600 s unset; a malformed value is refused, naming it.
TEST_CASE("the timeout is SHARDLIB_COMM_TIMEOUT's unless given", "[nccl][timeout]") {
  using std::chrono::milliseconds;
  struct restored {  // the variable as it was, however the case ends
    std::optional<std::string> was;
    restored() {
      if (const char* v = std::getenv("SHARDLIB_COMM_TIMEOUT")) was = v;
    }
    ~restored() {
      if (was) setenv("SHARDLIB_COMM_TIMEOUT", was->c_str(), 1);
      else unsetenv("SHARDLIB_COMM_TIMEOUT");
    }
  } const env;
  const auto with = [](const char* v) {
    setenv("SHARDLIB_COMM_TIMEOUT", v, 1);
    return sl::comm::nccl_options{}.timeout;
  };
  unsetenv("SHARDLIB_COMM_TIMEOUT");
  CHECK(sl::comm::nccl_options{}.timeout == milliseconds(600'000));
  CHECK(with("2.5") == milliseconds(2500));
  CHECK(with("0") == milliseconds(0));
  CHECK(with("inf") == milliseconds(0));
  CHECK(with("1e10") == milliseconds(0));  // past 30 years: none (the clock would overflow)
  CHECK_THROWS_WITH(with("soon"), Catch::Contains("SHARDLIB_COMM_TIMEOUT must be a number of seconds >= 0, got 'soon'"));
  CHECK(sl::comm::nccl_options{.timeout = std::chrono::seconds(7)}.timeout == milliseconds(7000));  // given: the env unread
  const auto never = std::chrono::steady_clock::time_point::max();
  CHECK(sl::comm::detail::nccl_deadline(milliseconds(0)) == never);
  CHECK(sl::comm::detail::nccl_deadline(std::chrono::hours(24 * 365 * 300)) == never);
  CHECK(sl::comm::detail::nccl_deadline(milliseconds(5)) < never);
  CHECK_THROWS_WITH(sl::comm::detail::nccl_deadline(milliseconds(-1)),
                    Catch::Contains("nccl_options::timeout must be >= 0 ms (0: no limit), got -1"));
  if (have_device()) {  // a rank that never comes: the environment's 2 s, not the default's 10 minutes
    setenv("SHARDLIB_COMM_TIMEOUT", "2", 1);
    ncclUniqueId id;
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    CHECK_THROWS_WITH(NcclComm(id, 0, 2, 0, {.timeout = milliseconds(-5)}),  // refused before it joins
                      Catch::Contains("nccl_options::timeout must be >= 0 ms (0: no limit), got -5"));
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(NcclComm(id, 0, 2, 0), Catch::Contains("timed out after 2000 ms"));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  }
}

TEST_CASE("from_env removes its id file when the initialisation fails too", "[nccl][bootstrap][timeout]") {
  if (!have_device()) return;
  const auto path = std::filesystem::temp_directory_path() / ("shardlib_nccl_failed_" + std::to_string(::getpid()));
  std::filesystem::remove(path);
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);  // rank 1 never comes
  ::setenv("LOCAL_RANK", "0", 1);
  CHECK_THROWS_WITH(NcclComm::from_env(path, {.timeout = std::chrono::seconds(2)}), Catch::Contains("timed out"));
  CHECK_FALSE(std::filesystem::exists(path));  // the next run is not refused
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("LOCAL_RANK");
}

TEST_CASE("from_env reads torchrun's variables and exchanges the id through a file", "[nccl][bootstrap]") {
  if (!have_device()) return;
  const auto path = std::filesystem::temp_directory_path() / ("shardlib_nccl_id_" + std::to_string(::getpid()));
  std::filesystem::remove(path);
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  {
    NcclComm c = NcclComm::from_env(path);
    CHECK(c.size() == 1);
    CHECK(c.device() == 0);
    CHECK_FALSE(std::filesystem::exists(path));  // removed once every rank joined
  }
  std::ofstream(path) << "stale";
  CHECK_THROWS_WITH(NcclComm::from_env(path), Catch::Contains("already exists"));
  std::filesystem::remove(path);
  ::unsetenv("WORLD_SIZE");
  CHECK_THROWS_WITH(NcclComm::from_env(path), Catch::Contains("WORLD_SIZE is not set"));
}

// tools/launch, torchrun and Slurm start processes without MPI: examples/common/
// device_world.cuh hands NCCL's id over the TCP store. Ranks as threads here, each
// with its own client of one store and its own GPU (one on a one-GPU machine).
TEST_CASE("from_store hands rank 0's id to every rank through the TCP store", "[nccl][bootstrap]") {
  if (!have_device()) return;
  const int ranks = std::min(sl::cuda::device_count(), 4);
  sl::comm::store_server server(0, ranks);
  std::vector<std::vector<int>> gathered(ranks);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        sl::comm::TcpStore store("127.0.0.1", server.port(), r, ranks, false, sl::comm::seconds{60});
        staged_comm c(NcclComm::from_store(store, r));
        if (c.rank() != r || c.size() != ranks) throw sl::error(sl::cat("rank ", c.rank(), " of ", c.size()));
        std::vector<int> mine{r + 1, 10 * (r + 1)};
        c.all_reduce(std::span<int>(mine), reduce_op::sum);
        gathered[r].resize(2 * ranks);
        c.all_gather(std::span<const int>(mine), std::span<int>(gathered[r]));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  const int sum = ranks * (ranks + 1) / 2;
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].empty());
    std::vector<int> want;
    for (int q = 0; q < ranks; ++q) want.insert(want.end(), {sum, 10 * sum});
    CHECK(gathered[r] == want);
  }
}

}  // namespace test_nccl
