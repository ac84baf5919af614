// shardlib/comm/rendezvous.hpp — store_from_environment: the TcpStore through which the
// processes of a launched job meet, wherever their launcher says it is.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/environment.hpp"
#include "shardlib/comm/store.hpp"
#include "shardlib/comm/tcp.hpp"
#include "shardlib/comm/torch_store.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>     // std::max, std::min
#include <chrono>        // std::chrono::milliseconds
#include <charconv>      // std::from_chars
#include <cstdint>       // std::uint16_t
#include <string>        // std::string
#include <string_view>   // std::string_view
#include <system_error>  // std::errc
#include <thread>        // std::this_thread::sleep_for

namespace shardlib::comm {

// Where rank 0 announces its store in torchrun's (PyTorch's Python client reads it as
// "shardlib/store": it puts a '/' before every key).
inline constexpr std::string_view announcement_key = "/shardlib/store";

// Rank 0 serves the store and every rank joins it (a process alone, with no rendezvous
// set, serves itself on a free port):
//   - torchrun-style variables (tools/launch, Slurm or MPI jobs that set them by hand):
//     at MASTER_ADDR:MASTER_PORT;
//   - under torchrun itself, whose agent already serves PyTorch's store there
//     (env.agent_store): on a free port of rank 0's host, which rank 0 announces in the
//     agent's store under announcement_key, as its address on the way there; the others
//     read it (an address on the loopback meaning the agent's host, as SocketComm reads
//     its peers'). The agent's store outlives a restarted group, and each agent counts
//     only its own restarts, so the key may still hold the last group's rank 0, whose
//     store has gone with it: an address that refuses connections is read again until
//     rank 0 announces anew.
// `timeout` bounds joining (reaching the agent, the announcement and rank 0's store, all
// within it together) and every later wait of the store.
inline TcpStore store_from_environment(const launch_environment& env, seconds timeout) {
  const bool alone = env.size == 1 && !(env.master_addr && env.master_port);
  require<comm_error>(alone || (env.master_addr && env.master_port), "started by ", name(env.kind), " as rank ",
                      env.rank, " of ", env.size, ", but ", env.master_addr ? "MASTER_PORT" : "MASTER_ADDR",
                      " is not set: the processes meet at MASTER_ADDR:MASTER_PORT (rank 0's host and a free port)",
                      env.is_mpi() ? "; or run them over MPI (comm::mpi_backend)" : "");
  if (alone || !env.agent_store)
    return TcpStore(alone ? "127.0.0.1" : *env.master_addr, alone ? 0 : *env.master_port, env.rank, env.size,
                    env.rank == 0, timeout);
  const auto deadline = detail::deadline_after(timeout);  // for the whole join through the agent's store
  torch_store agent(*env.master_addr, *env.master_port, timeout, cat("rank ", env.rank), deadline);
  if (env.rank == 0) {
    TcpStore store("127.0.0.1", 0, 0, env.size, true, timeout);
    agent.set(announcement_key, cat(agent.local_address(), ":", store.port()));
    return store;
  }
  const std::string mine = agent.local_address(), agent_host = agent.store_host_address();
  for (std::string published = agent.get(announcement_key);; published = agent.read(announcement_key)) {
    const std::string at = detail::reachable(published, mine, agent_host);
    const auto colon = at.rfind(':');
    std::uint16_t port = 0;
    const auto [end, ec] = colon == std::string::npos
                               ? std::from_chars_result{nullptr, std::errc::invalid_argument}
                               : std::from_chars(at.data() + colon + 1, at.data() + at.size(), port);
    require<comm_error>(ec == std::errc{} && end == at.data() + at.size() && colon > 0 && port > 0, "rank ",
                        env.rank, ": torchrun's store at ", agent.address(), " holds '", published, "' under ",
                        announcement_key, ", where rank 0 announces its store as host:port");
    const std::string host = at.substr(0, colon);
    bool open = true;
    try {
      // At most a second, at least a tenth (however little of the deadline is left).
      detail::connect_to(host, port,
                         std::max(std::min(deadline, detail::deadline_after(seconds(1))),
                                  detail::deadline_after(std::chrono::milliseconds(100))),
                         "");
    } catch (const comm_error&) {
      open = false;
    }
    if (open) return TcpStore(host, port, env.rank, env.size, false, timeout);
    require<comm_error>(!detail::expired(deadline), "rank ", env.rank, ": torchrun's store at ", agent.address(),
                        " holds ", at, " under ", announcement_key,
                        ", where nothing accepts connections (an earlier group's rank 0?), and rank 0 announced no "
                        "other within ",
                        timeout.count(), " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace shardlib::comm
