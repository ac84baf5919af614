// examples/common/device_world.cuh — a GPU program's NCCL communicator, from how the
// process was started: alone (a world of one), under mpirun (NCCL's id through MPI,
// when built with it), or under torchrun-style variables (tools/launch, torchrun,
// Slurm: through the TCP store rank 0 serves, comm::store_from_environment). Each
// process takes GPU local_rank % the GPUs it sees.
#pragma once
#include <shardlib/comm/environment.hpp>
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/comm/rendezvous.hpp>
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
  sl::comm::TcpStore store = sl::comm::store_from_environment(env, sl::comm::seconds{300});
  run(sl::comm::NcclComm::from_store(store, select_device(env.local_rank)), [&] { store.barrier(); });
}

}  // namespace example
