// examples/common/device_world.cuh — a GPU program's NCCL communicator, from how the
// process was started: alone (a world of one), under mpirun (NCCL's id through MPI,
// when built with it), or under torchrun-style variables (tools/launch, torchrun,
// Slurm: through the TCP store rank 0 serves at MASTER_ADDR:MASTER_PORT). Each
// process takes GPU local_rank % the GPUs it sees.
#pragma once
#include <shardlib/comm/environment.hpp>
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/comm/store.hpp>
#include <shardlib/cuda.hpp>
#if SHARDLIB_EXAMPLE_WITH_MPI
#include <shardlib/mpi.hpp>
#endif

namespace example {

inline int select_device(int local_rank) {
  namespace sl = shardlib;
  const int device = local_rank % sl::cuda::device_count();
  sl::cuda::check(cudaSetDevice(device), "cudaSetDevice(", device, ")");
  return device;
}

// Calls run(nccl, barrier): barrier() waits for every process on the host (for a
// file rank 0 creates before the others append to it).
template <class Run>
void on_device_world(int& argc, char**& argv, Run&& run) {
  namespace sl = shardlib;
  const sl::comm::launch_environment env = sl::comm::discover_environment();
  if (env.kind == sl::comm::launcher::none) {
    sl::comm::launch(1, [&](sl::comm::ThreadComm& host) {
      run(sl::comm::NcclComm::bootstrap(host, select_device(0)), [] {});
    });
    return;
  }
#if SHARDLIB_EXAMPLE_WITH_MPI
  if (env.is_mpi()) {
    sl::comm::mpi_session mpi(&argc, &argv);
    auto world = sl::comm::MpiComm::world();
    run(sl::comm::NcclComm::bootstrap(world, select_device(env.local_rank)), [&] { world.barrier(); });
    return;
  }
#else
  (void)argc, (void)argv;
#endif
  const bool alone = env.size == 1 && !(env.master_addr && env.master_port);
  sl::require(alone || (env.master_addr && env.master_port), "started by ", sl::comm::name(env.kind), " as rank ",
              env.rank, " of ", env.size, ", but MASTER_ADDR and MASTER_PORT are not both set",
              env.is_mpi() ? " (and this build has no MPI)" : "");
  sl::comm::TcpStore store(alone ? "127.0.0.1" : *env.master_addr, alone ? 0 : *env.master_port, env.rank, env.size,
                           env.rank == 0, sl::comm::seconds{300});
  run(sl::comm::NcclComm::from_store(store, select_device(env.local_rank)), [&] { store.barrier(); });
}

}  // namespace example
