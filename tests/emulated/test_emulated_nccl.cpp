// NcclComm's device tests (tests/cuda/test_nccl.cpp: the Communicator conformance suite
// at world size 1 and over the emulated machine's four devices, one thread each,
// errors instead of hangs, torchrun's bootstrap), compiled by the host compiler and run
// on the CPU against include/nccl.h's thread-rank communicators.
#include "cuda/test_nccl.cpp"

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
