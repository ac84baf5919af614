// NcclComm's device tests (tests/cuda/test_nccl.cpp: the Communicator conformance suite
// at world size 1 and over the emulated machine's four devices, one thread each,
// errors instead of hangs, torchrun's bootstrap), compiled by the host compiler and run
// on the CPU against include/nccl.h's thread-rank communicators; ctest runs them all
// again with the ranks meeting through files (test_emulated_nccl.files), as processes do.
#include "cuda/test_nccl.cpp"

namespace test_nccl {  // the device test's, whose helpers these cases use

namespace {

// SHARDLIB_EMULATED_NCCL_DIR set to a fresh folder for a scope, then as it was.
struct files_mode {
  files_mode() : dir(std::filesystem::temp_directory_path() / sl::cat("nccl-files-", getpid())) {
    if (const char* d = std::getenv("SHARDLIB_EMULATED_NCCL_DIR")) before = d;
    std::filesystem::remove_all(dir);
    setenv("SHARDLIB_EMULATED_NCCL_DIR", dir.c_str(), 1);
  }
  ~files_mode() {
    if (before) setenv("SHARDLIB_EMULATED_NCCL_DIR", before->c_str(), 1);
    else unsetenv("SHARDLIB_EMULATED_NCCL_DIR");
    std::filesystem::remove_all(dir);
  }
  std::filesystem::path dir;
  std::optional<std::string> before;
};

}  // namespace

// What processes under tools/launch or mpirun get (tests/launch/device_processes.sh trains
// so): the conformance suite over four ranks whose communicators meet through files
// alone, splits included, and the calls checked across them.
TEST_CASE("ranks that meet through files pass the conformance suite, as processes would", "[nccl][files]") {
  const files_mode files;
  std::vector<conformance::report> reports(4);
  std::vector<int> through_files(4);
  sl::comm::launch(4, [&](sl::comm::ThreadComm& host) {
    NcclComm n = NcclComm::bootstrap(host, host.rank());
    through_files[host.rank()] = n.native()->files != nullptr;
    staged_comm c(std::move(n));
    nccl_suite(c, reports[host.rank()]);
    conformance::split_suite(c, reports[host.rank()]);
  });
  for (const auto& r : reports) require_clean(r);
  CHECK(through_files == std::vector<int>(4, 1));
  // Each communicator a folder; a rank keeps at most its last two calls' files in each.
  std::size_t folders = 0;
  for (const auto& f : std::filesystem::directory_iterator(files.dir)) {
    ++folders;
    for (int r = 0; r < 4; ++r) {
      std::size_t calls = 0;
      for (const auto& g : std::filesystem::directory_iterator(f.path()))
        if (g.path().extension() == sl::cat(".", r) && g.path().stem().string().find_first_not_of("0123456789") ==
                                                            std::string::npos)
          ++calls;
      CHECK(calls <= 2);
    }
  }
  CHECK(folders > 1);  // the world's and its splits'
}

// Rank 0 publishes its failure in the store: the others raise at once with its reason
// instead of waiting out the store's timeout for an id that never comes.
TEST_CASE("from_store: when rank 0 cannot make an id every rank raises with its reason", "[nccl][bootstrap]") {
  const int ranks = 3;
  sl::comm::store_server server(0, ranks);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  nccl_emulator::unique_id_failures() = 1;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        sl::comm::TcpStore store("127.0.0.1", server.port(), r, ranks, false, sl::comm::seconds{60});
        NcclComm c = NcclComm::from_store(store, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  CHECK(nccl_emulator::unique_id_failures() == 0);
  for (int r = 0; r < ranks; ++r) {
    CHECK_THAT(errors[r], Catch::Contains(sl::cat("rank ", r, ": rank 0 could not make an NCCL id")) &&
                              Catch::Contains("no socket interface found"));
  }
}

// Through files as with threads: ranks that join one id with different sizes are refused at
// once (not after the timeout), on both sides, naming the sizes.
TEST_CASE("ranks that meet through files and disagree on the size are refused at once", "[nccl][files]") {
  const files_mode files;
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<std::string> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        NcclComm c(id, r, 2 + r, r, {.timeout = std::chrono::seconds(60)});  // rank 1 joins one of 3
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  CHECK_THAT(errors[0], Catch::Contains("rank 1 joined a communicator of 3 ranks, rank 0 one of 2"));
  CHECK_THAT(errors[1], Catch::Contains("rank 0 joined a communicator of 2 ranks, rank 1 one of 3"));
}

// A refusal stays: two ranks on one device, non-blocking, through files. Every poll after the
// last join says ncclInvalidUsage ("Duplicate GPU detected"), not only the first.
TEST_CASE("through files, a refused communicator stays refused at every poll", "[nccl][files]") {
  const files_mode files;
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<std::vector<ncclResult_t>> polls(2);
  std::vector<std::string> why(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclComm_t comm = nullptr;
      ncclResult_t state = ncclCommInitRankConfig(&comm, 2, id, r, &config);  // both on device 0
      const auto t0 = std::chrono::steady_clock::now();
      while (state == ncclInProgress && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ncclCommGetAsyncError(comm, &state);
      }
      polls[std::size_t(r)].push_back(state);
      ncclCommGetAsyncError(comm, &state);
      polls[std::size_t(r)].push_back(state);
      why[std::size_t(r)] = ncclGetLastError(comm);
      ncclCommAbort(comm);
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(polls[std::size_t(r)] == std::vector<ncclResult_t>{ncclInvalidUsage, ncclInvalidUsage});
    CHECK_THAT(why[std::size_t(r)], Catch::Contains("Duplicate GPU detected: ranks 0 and 1 both on device 0"));
  }
}

}  // namespace test_nccl
