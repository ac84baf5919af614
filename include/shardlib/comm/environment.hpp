// shardlib/comm/environment.hpp — which rank this process is, from the variables its
// launcher set: OpenMPI, MPICH/Hydra (PMI), Slurm, torchrun (or tools/launch), or none.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <charconv>     // std::from_chars
#include <cstdint>      // std::uint16_t
#include <cstdlib>      // std::getenv
#include <functional>   // std::function
#include <optional>     // std::optional
#include <string>       // std::string
#include <string_view>  // std::string_view

namespace shardlib::comm {

enum class launcher { none, torchrun, openmpi, pmi, slurm };

constexpr std::string_view name(launcher l) {
  switch (l) {
    case launcher::none: return "none";
    case launcher::torchrun: return "torchrun";
    case launcher::openmpi: return "OpenMPI";
    case launcher::pmi: return "MPICH/PMI";
    case launcher::slurm: return "Slurm";
  }
  return "?";
}

// Where this process stands in its job. With launcher::none it is a single
// process (rank 0 of 1), which may still run several ranks as threads.
struct launch_environment {
  launcher kind = launcher::none;
  int rank = 0, size = 1;
  int local_rank = 0;
  std::optional<int> local_size = std::nullopt;  // processes on this node, where the launcher says
  // The rendezvous of torchrun-style launches (MASTER_ADDR, MASTER_PORT), read
  // under every launcher: Slurm and MPI jobs without MPI set them by hand.
  std::optional<std::string> master_addr = std::nullopt;
  std::optional<std::uint16_t> master_port = std::nullopt;
  // torchrun's agent serves a PyTorch TCPStore at MASTER_ADDR:MASTER_PORT for its
  // workers (TORCHELASTIC_USE_AGENT_STORE=True): the library's store listens elsewhere
  // and is announced there (store_from_environment, comm/rendezvous.hpp).
  bool agent_store = false;
  bool is_mpi() const { return kind == launcher::openmpi || kind == launcher::pmi; }
};

// One variable's value, or nothing when it is unset.
using env_lookup = std::function<std::optional<std::string>(const std::string&)>;

inline std::optional<std::string> process_variable(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (!v) return std::nullopt;
  return std::string(v);
}

namespace detail {

// A decimal whole number in [lo, hi]; the error names the variable and its value.
inline long env_number(const env_lookup& get, const std::string& var, long lo, long hi, std::string_view launched) {
  const auto v = get(var);
  require<error>(v.has_value(), "launch environment: ", var, " is not set, though other ", launched,
                 " variables are");
  long x = 0;
  const char* end = v->data() + v->size();
  const auto [p, ec] = std::from_chars(v->data(), end, x);
  require<error>(!v->empty() && p == end && ec == std::errc{}, "launch environment: ", var, "=\"", *v,
                 "\" is not a whole number");
  require<error>(x >= lo && x <= hi, "launch environment: ", var, "=", x, " is outside [", lo, ", ", hi, "]");
  return x;
}

inline std::optional<long> env_number_if_set(const env_lookup& get, const std::string& var, long lo, long hi,
                                             std::string_view launched) {
  if (!get(var)) return std::nullopt;
  return env_number(get, var, lo, hi, launched);
}

struct launcher_variables {
  launcher kind;
  const char *rank, *size, *local_rank, *local_size;  // local_size may be null
};

// In precedence order: the launcher that starts the process itself sets its
// variables last, and it is the innermost one. torchrun under srun (one torchrun
// per node) inherits Slurm's, mpirun inside an sbatch script inherits Slurm's
// too; an MPI job is rarely started by torchrun. So torchrun first, then the MPI
// launchers, then Slurm.
inline constexpr launcher_variables launchers[] = {
    {launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {launcher::openmpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {launcher::pmi, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
};

}  // namespace detail

// Reads the environment through `get` (a map in tests). A launcher counts as
// present when its rank or size variable is set; the first present one in the
// precedence order torchrun, OpenMPI, MPICH/PMI, Slurm decides. Its rank and size
// must both be set, whole, size >= 1 and rank < size; a local rank that is
// missing defaults to the rank (one node), except under OpenMPI and Slurm, which
// always set it. Errors name the variable and its value.
inline launch_environment discover_environment(const env_lookup& get = process_variable) {
  constexpr long most = 1L << 24;
  launch_environment env;
  for (const auto& l : detail::launchers) {
    if (!get(l.rank) && !get(l.size)) continue;
    const std::string_view who = name(l.kind);
    env.kind = l.kind;
    env.size = int(detail::env_number(get, l.size, 1, most, who));
    env.rank = int(detail::env_number(get, l.rank, 0, most, who));
    require<error>(env.rank < env.size, "launch environment: ", l.rank, "=", env.rank, " is not below ", l.size, "=",
                   env.size);
    const bool local_optional = l.kind == launcher::torchrun || l.kind == launcher::pmi;
    const auto local = local_optional ? detail::env_number_if_set(get, l.local_rank, 0, env.size - 1, who)
                                      : std::optional<long>(detail::env_number(get, l.local_rank, 0, env.size - 1, who));
    env.local_rank = int(local.value_or(env.rank));
    if (l.local_size)
      if (auto ls = detail::env_number_if_set(get, l.local_size, 1, env.size, who)) {
        require<error>(env.local_rank < *ls, "launch environment: ", l.local_rank, "=", env.local_rank,
                       " is not below ", l.local_size, "=", *ls);
        env.local_size = int(*ls);
      }
    break;
  }
  env.master_addr = get("MASTER_ADDR");
  if (env.master_addr)
    require<error>(!env.master_addr->empty(), "launch environment: MASTER_ADDR is set but empty");
  if (auto port = detail::env_number_if_set(get, "MASTER_PORT", 1, 65535, "the rendezvous"))
    env.master_port = std::uint16_t(*port);
  if (const auto agent = get("TORCHELASTIC_USE_AGENT_STORE")) {  // torchrun writes Python's str(bool)
    require<error>(*agent == "True" || *agent == "False", "launch environment: TORCHELASTIC_USE_AGENT_STORE=\"",
                   *agent, "\" is neither True nor False");
    env.agent_store = *agent == "True";
    require<error>(!env.agent_store || (env.master_addr && env.master_port),
                   "launch environment: TORCHELASTIC_USE_AGENT_STORE=True, but MASTER_ADDR and MASTER_PORT, where "
                   "torchrun's store is, are not both set");
  }
  return env;
}

}  // namespace shardlib::comm
