// shardlib/comm/rendezvous.hpp — store_from_environment: the TcpStore through which the
// processes of a launched job meet, wherever their launcher says it is.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/environment.hpp"
#include "shardlib/comm/store.hpp"
#include "shardlib/comm/tcp.hpp"
#include "shardlib/comm/torch_store.hpp"
#include "shardlib/core/error.hpp"

#include <charconv>      // std::from_chars
#include <cstdint>       // std::uint16_t
#include <string>        // std::string
#include <system_error>  // std::errc

namespace shardlib::comm {

// Rank 0 serves the store and every rank joins it (a process alone, with no rendezvous
// set, serves itself on a free port):
//   - torchrun-style variables (tools/launch, Slurm or MPI jobs that set them by hand):
//     at MASTER_ADDR:MASTER_PORT;
//   - under torchrun itself, whose agent already serves PyTorch's store there
//     (env.agent_store): on a free port of rank 0's host, which rank 0 announces in the
//     agent's store under shardlib/<attempt>/store, as its address on the way there;
//     the others read it (an address on the loopback meaning the agent's host, as
//     SocketComm reads its peers').
// `timeout` bounds joining and every later wait of the store.
inline TcpStore store_from_environment(const launch_environment& env, seconds timeout) {
  const bool alone = env.size == 1 && !(env.master_addr && env.master_port);
  require<comm_error>(alone || (env.master_addr && env.master_port), "started by ", name(env.kind), " as rank ",
                      env.rank, " of ", env.size, ", but ", env.master_addr ? "MASTER_PORT" : "MASTER_ADDR",
                      " is not set: the processes meet at MASTER_ADDR:MASTER_PORT (rank 0's host and a free port)",
                      env.is_mpi() ? "; or run them over MPI (comm::mpi_backend)" : "");
  if (alone || !env.agent_store)
    return TcpStore(alone ? "127.0.0.1" : *env.master_addr, alone ? 0 : *env.master_port, env.rank, env.size,
                    env.rank == 0, timeout);
  torch_store agent(*env.master_addr, *env.master_port, timeout, cat("rank ", env.rank));
  const std::string key = cat("shardlib/", env.attempt, "/store");
  if (env.rank == 0) {
    TcpStore store("127.0.0.1", 0, 0, env.size, true, timeout);
    agent.set(key, cat(agent.local_address(), ":", store.port()));
    return store;
  }
  const std::string published = agent.get(key);
  const std::string at = detail::reachable(published, agent.local_address(), agent.store_host_address());
  const auto colon = at.rfind(':');
  std::uint16_t port = 0;
  const auto [end, ec] = colon == std::string::npos ? std::from_chars_result{nullptr, std::errc::invalid_argument}
                                                    : std::from_chars(at.data() + colon + 1, at.data() + at.size(), port);
  require<comm_error>(ec == std::errc{} && end == at.data() + at.size() && colon > 0 && port > 0, "rank ", env.rank,
                      ": torchrun's store at ", agent.address(), " holds '", published, "' under ", key,
                      ", where rank 0 announces its store as host:port");
  return TcpStore(at.substr(0, colon), port, env.rank, env.size, false, timeout);
}

}  // namespace shardlib::comm
