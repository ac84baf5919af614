// shardlib/comm/mpi_backend.hpp — mpi_backend: lets run_from_environment run under
// mpirun (OpenMPI or MPICH/PMI variables) on MpiComm. Link shardlib::mpi.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/environment.hpp"
#include "shardlib/comm/mpi_comm.hpp"

namespace shardlib::comm {

// Pass it to run_from_environment: comm::run_from_environment(fn, options, comm::mpi_backend{}).
struct mpi_backend {
  static bool claims(const launch_environment& env) { return env.is_mpi(); }
  template <class Fn>
  static void run(const launch_environment&, Fn& fn) {
    mpi_session session;
    auto world = MpiComm::world();
    fn(world);
  }
};

}  // namespace shardlib::comm
