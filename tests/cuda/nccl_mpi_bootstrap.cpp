// NcclComm bootstraps over MpiComm (one process per GPU under mpirun): compiled here so
// that a change on either side that breaks the pairing fails the cuda.compile test.
#include <shardlib/comm/mpi_comm.hpp>
#include <shardlib/comm/nccl_comm.hpp>

template shardlib::comm::NcclComm shardlib::comm::NcclComm::bootstrap<shardlib::comm::MpiComm>(
    shardlib::comm::MpiComm&, int, const shardlib::comm::nccl_options&);
