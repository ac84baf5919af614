// Launching without mpirun: the launcher's environment, the TCP store and SocketComm,
// here with ranks as threads of one process on the loopback (tests/launch runs them
// as processes through tools/launch).
#include "shardlib/comm/environment.hpp"
#include "shardlib/comm/rendezvous.hpp"
#include "shardlib/comm/run.hpp"
#include "shardlib/comm/socket_comm.hpp"
#include "shardlib/comm/store.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <latch>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../support/comm_conformance.hpp"

namespace test_launch {

using namespace shardlib;
using namespace std::chrono_literals;
using comm::reduce_op;
using comm::SocketComm;
using comm::TcpStore;

namespace {

comm::env_lookup from(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    comm::discover_environment(from(vars));
  } catch (const error& e) {
    return e.what();
  }
  return "no error";
}

// Runs fn(rank) on w threads and returns what each threw ("" for none).
template <class Fn>
std::vector<std::string> on_threads(int w, Fn fn) {
  std::vector<std::string> errors(w);
  std::vector<std::thread> threads;
  for (int r = 0; r < w; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// w ranks as threads, each with its own store client and SocketComm over the loopback.
template <class Fn>
std::vector<std::string> socket_ranks(int w, Fn fn, comm::socket_options options = {}, comm::seconds join = 20s) {
  comm::store_server server(0, w, 5s);
  return on_threads(w, [&](int r) {
    TcpStore store("127.0.0.1", server.port(), r, w, false, join);
    SocketComm c(store, options);
    fn(c);
  });
}

// run_from_environment on w rank threads, rank r in env_of(r); each SocketComm rank
// all-reduces rank + 1. The sums, and what each rank threw ("" for none).
template <class EnvOf>
std::pair<std::vector<double>, std::vector<std::string>> sum_over_sockets(int w, EnvOf env_of) {
  std::vector<double> sums(std::size_t(w), 0.0);
  auto errors = on_threads(w, [&](int r) {
    comm::run_from_environment(
        [&](auto& c) {
          if constexpr (std::is_same_v<std::decay_t<decltype(c)>, SocketComm>) {
            double x = c.rank() + 1;
            c.all_reduce(std::span<double>(&x, 1), reduce_op::sum);
            sums[c.rank()] = x;
          }
        },
        {.environment = env_of(r), .join_timeout = 20s});
  });
  return {sums, errors};
}

// PyTorch's TCPStore as torchrun's agent serves it, to c10d's wire format (see
// comm/torch_store.hpp): a connection validates first, then sets, waits and gets.
// Anything else is recorded as a protocol error and hung up on.
class fake_torch_store {
 public:
  explicit fake_torch_store(std::uint16_t port = 0) : listener_(comm::detail::listen_on(port, "fake torch store")) {
    acceptor_ = std::thread([this] {
      while (!stop_) {
        auto c = comm::detail::accept_until(listener_, comm::detail::deadline_after(50ms));
        if (!c) continue;
        auto fd = std::make_shared<comm::detail::socket_fd>(std::move(c));
        std::lock_guard lock(m_);
        clients_.emplace_back([this, fd] { serve(fd->get()); });
      }
    });
  }
  fake_torch_store(const fake_torch_store&) = delete;
  fake_torch_store& operator=(const fake_torch_store&) = delete;
  ~fake_torch_store() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    acceptor_.join();
    for (auto& t : clients_) t.join();
  }

  std::uint16_t port() const { return comm::detail::bound_port(listener_); }
  void set(const std::string& key, const std::string& value) {
    std::lock_guard lock(m_);
    data_[key] = value;
  }
  std::map<std::string, std::string> data() {
    std::lock_guard lock(m_);
    return data_;
  }
  std::vector<std::string> errors() {
    std::lock_guard lock(m_);
    return errors_;
  }

 private:
  void serve(int fd) {
    const auto read = [&](void* p, std::size_t n) {
      return comm::detail::recv_all(fd, p, n, comm::detail::deadline_after(5s)) == comm::detail::io_status::done;
    };
    const auto read_string = [&](std::string& out) {
      std::uint64_t n = 0;
      if (!read(&n, sizeof n) || n > 4096) return false;
      out.resize(n);
      return read(out.data(), n);
    };
    const auto fail = [&](std::string why) {
      std::lock_guard lock(m_);
      errors_.push_back(std::move(why));
    };
    for (bool validated = false;;) {
      while (!stop_ && !comm::detail::wait_for(fd, POLLIN, comm::detail::deadline_after(50ms))) {
      }
      std::uint8_t query = 0;
      if (stop_ || !read(&query, 1)) return;  // the client hung up
      std::string key, value;
      if (!validated) {
        std::uint32_t magic = 0;
        if (query != 0 || !read(&magic, sizeof magic) || magic != 0x3C85F7CE)
          return fail(cat("query ", int(query), " before validating"));
        validated = true;
      } else if (query == 1) {  // set: key, value; no reply
        if (!read_string(key) || !read_string(value)) return fail("a short set");
        std::lock_guard lock(m_);
        data_[key] = value;
        cv_.notify_all();
      } else if (query == 6) {  // wait: a count of keys, the keys; one byte once all exist
        std::uint64_t count = 0;
        if (!read(&count, sizeof count) || count != 1 || !read_string(key)) return fail("a wait for other than one key");
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_ || data_.count(key) > 0; });
        if (stop_) return;
        const std::uint8_t stop_waiting = 0;
        comm::detail::send_all(fd, &stop_waiting, 1, comm::detail::deadline_after(5s));
      } else if (query == 3) {  // get: key; its value as a byte vector
        if (!read_string(key)) return fail("a short get");
        std::string reply;
        {
          std::lock_guard lock(m_);
          value = data_.count(key) ? data_[key] : "";
        }
        const std::uint64_t n = value.size();
        reply.append(reinterpret_cast<const char*>(&n), sizeof n).append(value);
        comm::detail::send_all(fd, reply.data(), reply.size(), comm::detail::deadline_after(5s));
      } else {
        return fail(cat("query ", int(query)));
      }
    }
  }

  comm::detail::socket_fd listener_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
  std::vector<std::string> errors_;
  std::vector<std::thread> clients_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
};

void require_clean(const std::vector<conformance::report>& reports, const std::vector<std::string>& errors) {
  for (std::size_t r = 0; r < reports.size(); ++r) {
    INFO("rank " << r);
    CHECK(errors[r].empty());
    CHECK(reports[r].checks > 0);
    for (auto& f : reports[r].failures) FAIL_CHECK(f);
  }
}

}  // namespace

TEST_CASE("each launcher's variables give rank, size and local rank", "[launch][environment]") {
  auto none = comm::discover_environment(from({}));
  CHECK(none.kind == comm::launcher::none);
  CHECK((none.rank == 0 && none.size == 1 && none.local_rank == 0 && !none.local_size && !none.master_addr));

  auto torch = comm::discover_environment(from({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                                {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"},
                                                {"MASTER_PORT", "29500"}}));
  CHECK(torch.kind == comm::launcher::torchrun);
  CHECK((torch.rank == 5 && torch.size == 8 && torch.local_rank == 1 && torch.local_size == 4));
  CHECK((torch.master_addr == "node0" && torch.master_port == 29500));
  CHECK(!torch.agent_store);
  // What torchrun itself adds: its agent's store is at MASTER_ADDR:MASTER_PORT.
  auto agent = comm::discover_environment(from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "localhost"},
                                                {"MASTER_PORT", "34039"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  CHECK(agent.agent_store);
  CHECK(!comm::discover_environment(from({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}}))
             .agent_store);

  auto ompi = comm::discover_environment(from({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  CHECK(ompi.kind == comm::launcher::openmpi);
  CHECK((ompi.rank == 3 && ompi.size == 4 && ompi.local_rank == 1 && ompi.local_size == 2 && ompi.is_mpi()));

  auto pmi = comm::discover_environment(from({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "0"}}));
  CHECK(pmi.kind == comm::launcher::pmi);
  CHECK((pmi.rank == 2 && pmi.size == 3 && pmi.local_rank == 0 && !pmi.local_size && pmi.is_mpi()));
  auto pmi_bare = comm::discover_environment(from({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}));
  CHECK(pmi_bare.local_rank == 1);  // no MPI_LOCALRANKID: one node

  auto slurm = comm::discover_environment(from({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                                                {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}}));
  CHECK(slurm.kind == comm::launcher::slurm);
  CHECK((slurm.rank == 6 && slurm.size == 8 && slurm.local_rank == 2 && !slurm.is_mpi()));
  CHECK((slurm.master_addr == "10.0.0.1" && slurm.master_port == 1234));
}

TEST_CASE("the innermost launcher wins: torchrun, then OpenMPI, then MPICH/PMI, then Slurm",
          "[launch][environment]") {
  const std::map<std::string, std::string> slurm{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}};
  auto with = [](std::map<std::string, std::string> a, const std::map<std::string, std::string>& b) {
    a.insert(b.begin(), b.end());
    return a;
  };
  const std::map<std::string, std::string> pmi{{"PMI_RANK", "1"}, {"PMI_SIZE", "3"}};
  const std::map<std::string, std::string> ompi{
      {"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}};
  const std::map<std::string, std::string> torch{{"RANK", "3"}, {"WORLD_SIZE", "5"}};
  CHECK(comm::discover_environment(from(with(slurm, pmi))).kind == comm::launcher::pmi);
  CHECK(comm::discover_environment(from(with(with(slurm, pmi), ompi))).kind == comm::launcher::openmpi);
  const auto all = comm::discover_environment(from(with(with(with(slurm, pmi), ompi), torch)));
  CHECK((all.kind == comm::launcher::torchrun && all.rank == 3 && all.size == 5));
}

TEST_CASE("bad launcher variables raise naming the variable and its value", "[launch][environment]") {
  CHECK_THAT(error_of({{"RANK", "x1"}, {"WORLD_SIZE", "4"}}), Catch::Contains("RANK=\"x1\" is not a whole number"));
  CHECK_THAT(error_of({{"RANK", "1"}, {"WORLD_SIZE", ""}}), Catch::Contains("WORLD_SIZE=\"\" is not a whole number"));
  CHECK_THAT(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), Catch::Contains("RANK=4 is not below WORLD_SIZE=4"));
  CHECK_THAT(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}), Catch::Contains("RANK=-1 is outside [0, "));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), Catch::Contains("WORLD_SIZE=0 is outside [1, "));
  CHECK_THAT(error_of({{"RANK", "1"}}), Catch::Contains("WORLD_SIZE is not set, though other torchrun variables are"));
  CHECK_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
             Catch::Contains("OMPI_COMM_WORLD_LOCAL_RANK is not set"));
  CHECK_THAT(error_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "2"}}),
             Catch::Contains("SLURM_LOCALID=2 is outside [0, 1]"));
  CHECK_THAT(error_of({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
             Catch::Contains("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"));
  CHECK_THAT(error_of({{"PMI_RANK", "3"}, {"PMI_SIZE", "2"}}), Catch::Contains("PMI_RANK=3 is not below PMI_SIZE=2"));
  CHECK_THAT(error_of({{"MASTER_PORT", "70000"}}), Catch::Contains("MASTER_PORT=70000 is outside [1, 65535]"));
  CHECK_THAT(error_of({{"MASTER_PORT", "29500 "}}), Catch::Contains("MASTER_PORT=\"29500 \" is not a whole number"));
  CHECK_THAT(error_of({{"MASTER_ADDR", ""}}), Catch::Contains("MASTER_ADDR is set but empty"));
  CHECK_THAT(error_of({{"TORCHELASTIC_USE_AGENT_STORE", "1"}}),
             Catch::Contains("TORCHELASTIC_USE_AGENT_STORE=\"1\" is neither True nor False"));
  CHECK_THAT(error_of({{"MASTER_ADDR", "node0"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}}),
             Catch::Contains("TORCHELASTIC_USE_AGENT_STORE=True, but MASTER_ADDR and MASTER_PORT, where torchrun's "
                             "store is, are not both set"));
}

TEST_CASE("the store sets, gets, adds, checks and holds a barrier", "[launch][store]") {
  comm::store_server server(0, 3);
  const auto errors = on_threads(3, [&](int r) {
    TcpStore s("127.0.0.1", server.port(), r, 3, false, 20s);
    s.set("from/" + std::to_string(r), std::string("value\0of ", 9) + std::to_string(r));  // bytes, not C strings
    const auto all = s.get(std::vector<std::string>{"from/0", "from/1", "from/2"});
    for (int p = 0; p < 3; ++p)
      require<error>(all[p] == std::string("value\0of ", 9) + std::to_string(p), "rank ", r, " read ", all[p]);
    s.add("counter", r + 1);
    s.barrier();
    require<error>(s.add("counter", 0) == 6, "rank ", r, ": the counter is not 1 + 2 + 3");
    require<error>(s.check({"from/0", "counter"}) && !s.check({"never"}), "rank ", r, ": check is wrong");
    s.barrier();
  });
  for (auto& e : errors) CHECK(e == "");
  TcpStore s("127.0.0.1", server.port(), 0, 3, false, 20s);  // a counter past the top wraps (no overflow)
  CHECK(s.add("big", std::numeric_limits<std::int64_t>::max()) == std::numeric_limits<std::int64_t>::max());
  CHECK(s.add("big", 1) == std::numeric_limits<std::int64_t>::min());
}

TEST_CASE("the store hangs up on a malformed request and goes on serving the others", "[launch][store]") {
  comm::store_server server(0, 1, 1s);
  TcpStore good("127.0.0.1", server.port(), 0, 1, false, 20s);
  // A set whose key is longer than the store takes, and a get of more keys than it
  // takes, neither followed by what it announces: the server must not wait for it.
  for (const auto& [op, count] : {std::pair{comm::detail::store_op::set, comm::detail::longest_store_string + 1},
                                  std::pair{comm::detail::store_op::get, comm::detail::most_store_keys + 1}}) {
    INFO("store_op " << int(op));
    auto raw = comm::detail::connect_to("127.0.0.1", server.port(), comm::detail::deadline_after(5s), "test");
    std::string request(1, char(op));
    request.append(reinterpret_cast<const char*>(&count), sizeof count);
    const auto deadline = comm::detail::deadline_after(5s);
    REQUIRE(comm::detail::send_all(raw.get(), request.data(), request.size(), deadline) ==
            comm::detail::io_status::done);
    char reply = 0;
    CHECK(comm::detail::recv_all(raw.get(), &reply, 1, deadline) == comm::detail::io_status::closed);
    good.set("after", std::to_string(int(op)));
    CHECK(good.get("after") == std::to_string(int(op)));
  }
  CHECK_THROWS_WITH(good.set("big", std::string(std::size_t(comm::detail::longest_store_string) + 1, 'x')),
                    Catch::Contains("rank 0: setting 'big' in the store: keys and values may have up to"));
}

namespace {
int open_descriptors() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}
}  // namespace

// Connections that come and go (health checks, port scans, reconnects) are reaped: the
// server kept each one's descriptor and thread until it ended, and ran out of
// descriptors after about a thousand, when no rank could join any more.
TEST_CASE("the store reaps clients that hung up: descriptors do not pile up", "[launch][store]") {
  comm::store_server server(0, 2, 1s);
  const int before = open_descriptors();
  for (int i = 0; i < 300; ++i)
    comm::detail::connect_to("127.0.0.1", server.port(), comm::detail::deadline_after(5s), "test");  // closed at once
  int after = 0;
  for (int tries = 0; tries < 100 && (after = open_descriptors()) > before + 5; ++tries) std::this_thread::sleep_for(50ms);
  INFO(before << " descriptors before, " << after << " after 300 connections came and went");
  CHECK(after <= before + 5);
  TcpStore s("127.0.0.1", server.port(), 1, 2, false, 5s);  // a rank still joins
  s.set("k", "v");
  CHECK(s.get("k") == "v");
}

// The store lingers at the end for ranks still connected, not for a connection that
// never said which rank it is.
TEST_CASE("a silent connection does not hold the store's end", "[launch][store]") {
  auto server = std::make_unique<comm::store_server>(0, 1, 30s);
  auto silent = comm::detail::connect_to("127.0.0.1", server->port(), comm::detail::deadline_after(5s), "test");
  std::this_thread::sleep_for(200ms);  // accepted
  const auto start = std::chrono::steady_clock::now();
  server.reset();
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("a store wait that outlasts its timeout names the key and the ranks that never came", "[launch][store]") {
  comm::store_server server(0, 3);
  TcpStore s("127.0.0.1", server.port(), 0, 3, false, 0.3s);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(s.get("addr/2"), Catch::Contains("rank 0: the store at 127.0.0.1:" +
                                                     std::to_string(server.port()) + " has no key 'addr/2' after 0.3 s") &&
                                         Catch::Contains("ranks that never connected: 1, 2"));
  CHECK_THROWS_WITH(s.barrier(), Catch::Contains("store barrier 0") &&
                                     Catch::Contains("ranks that never arrived within 0.3 s: 1, 2"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

// A get's reply had to be sent by the deadline for reading its request: a value set
// later than that, too large for the socket's buffer, was dropped with the connection,
// and the rank waiting for it was told the store did not answer.
TEST_CASE("a get answered after a long wait still receives a large value", "[launch][store]") {
  comm::store_server server(0, 2, 1s, "the store", 0.5s);  // 0.5 s to send a request or take a reply
  std::string got;
  std::thread waiter([&] {
    try {
      TcpStore s("127.0.0.1", server.port(), 0, 2, false, 20s);
      got = s.get("big");
    } catch (const std::exception& e) {
      got = e.what();
    }
  });
  TcpStore setter("127.0.0.1", server.port(), 1, 2, false, 20s);
  std::this_thread::sleep_for(1500ms);
  const std::string big(std::size_t(16) << 20, 'v');  // more than loopback's socket buffers hold
  setter.set("big", big);
  waiter.join();
  INFO(got.substr(0, 300));  // the error, if it is one
  CHECK(got.size() == big.size());
  const bool same = got == big;
  CHECK(same);
}

TEST_CASE("a store nobody serves is an error naming its address, not a hang", "[launch][store]") {
  std::uint16_t port = 0;
  {
    comm::store_server probe(0, 1);  // a port that was free a moment ago, and is closed now
    port = probe.port();
  }
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", port, 1, 2, false, 0.3s),
                    Catch::Contains("rank 1: the store: cannot connect to 127.0.0.1:" + std::to_string(port)));
}

TEST_CASE("a store port another process holds is an error naming the rank and the port", "[launch][store]") {
  comm::store_server holder(0, 1);
  const auto port = holder.port();
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", port, 0, 2, true, 0.3s),
                    Catch::Contains("rank 0: serving the store: cannot listen on port " + std::to_string(port) +
                                    ": bind failed: Address already in use (another process listens there"));
}

TEST_CASE("connecting to a listener that never answers ends at the timeout", "[launch][store]") {
  // A listener whose accept queue is full drops new SYNs: a blocking connect would
  // wait out the kernel's retries (about two minutes).
  auto listener = comm::detail::listen_on(0, "test");
  REQUIRE(::listen(listener.get(), 0) == 0);
  const std::uint16_t port = comm::detail::bound_port(listener);
  std::vector<comm::detail::socket_fd> queued;
  for (int i = 0; i < 4; ++i) {
    queued.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    ::connect(queued.back().get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", port, 1, 2, false, 0.5s),
                    Catch::Contains("rank 1: the store: cannot connect to 127.0.0.1:" + std::to_string(port)));
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

TEST_CASE("accepting goes on while the process is out of file descriptors for a moment", "[launch][socket]") {
  auto listener = comm::detail::listen_on(0, "test");
  auto client = comm::detail::connect_to("127.0.0.1", comm::detail::bound_port(listener),
                                         comm::detail::deadline_after(5s), "test");
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  const int lowest_free = ::dup(listener.get());
  ::close(lowest_free);
  rlimit none = saved;
  none.rlim_cur = rlim_t(lowest_free);  // the accepted socket would need a descriptor past it
  std::latch running(1), lowered(1);
  std::thread restore([&] {  // running first: the sanitizers' runtime needs descriptors to start a thread
    running.count_down();
    lowered.wait();
    std::this_thread::sleep_for(200ms);
    ::setrlimit(RLIMIT_NOFILE, &saved);
  });
  running.wait();
  const bool limited = ::setrlimit(RLIMIT_NOFILE, &none) == 0;
  lowered.count_down();
  const auto accepted = comm::detail::accept_until(listener, comm::detail::deadline_after(10s));
  restore.join();
  REQUIRE(limited);
  CHECK(bool(accepted));
}

TEST_CASE("SocketComm passes the conformance suite", "[launch][socket]") {
  for (int w : {1, 2, 3, 4}) {
    DYNAMIC_SECTION("world size " << w) {
      std::vector<conformance::report> reports(w);
      const auto errors = socket_ranks(w, [&](SocketComm& c) {
        conformance::full_suite(c, reports[c.rank()]);
        conformance::split_suite(c, reports[c.rank()]);
        conformance::ordered_sum_suite(c, reports[c.rank()]);
      });
      require_clean(reports, errors);
    }
  }
}

TEST_CASE("SocketComm ranks that disagree about a collective raise the same error, and go on", "[launch][socket]") {
  std::vector<std::string> caught(3);
  const auto errors = socket_ranks(3, [&](SocketComm& c) {
    std::vector<float> x(4 + (c.rank() == 1 ? 1 : 0)), all(x.size() * 3);
    try {
      c.all_gather(std::span<const float>(x), std::span<float>(all));
    } catch (const comm_error& e) {
      caught[c.rank()] = e.what();
    }
    std::vector<float> y(3, float(c.rank()));
    c.all_reduce(std::span<float>(y), reduce_op::sum);  // the streams still line up
    require<error>(y[0] == 3.f, "rank ", c.rank(), ": all_reduce after the disagreement gave ", y[0]);
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[r].empty());
    CHECK_THAT(caught[r], Catch::Contains("rank " + std::to_string(r) + ": ranks disagree") &&
                              Catch::Contains("rank 0 called all_gather(4 x F32), rank 1 called all_gather(5 x F32)"));
  }
}

TEST_CASE("an infinite or huge timeout means no limit, not a deadline already past", "[launch][socket][store]") {
  for (const double limit : {std::numeric_limits<double>::infinity(), 1e300}) {
    INFO("timeout " << limit << " s");
    std::vector<float> sums(2);
    const auto errors = socket_ranks(
        2,
        [&](SocketComm& c) {
          float x = float(c.rank() + 1);
          c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
          sums[c.rank()] = x;
        },
        {.timeout = comm::seconds(limit)}, comm::seconds(limit));
    for (int r = 0; r < 2; ++r) {
      CHECK(errors[r].empty());
      CHECK(sums[r] == 3.f);
    }
  }
}

TEST_CASE("SocketComm: a rank's invalid arguments make every rank raise at once, and the ranks go on in step",
          "[launch][socket]") {
  std::vector<std::string> caught(3);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = socket_ranks(
      3,
      [&](SocketComm& c) {
        const int r = c.rank();
        std::vector<float> x(4, float(r)), out(r == 1 ? 3 : 4);
        try {
          c.all_reduce(std::span<const float>(x), std::span<float>(out), reduce_op::sum);
        } catch (const error& e) {
          caught[r] = e.what();
        }
        try {
          c.broadcast(std::span<float>(x), r == 2 ? 3 : 0);
        } catch (const error& e) {
          caught[r] += std::string(" | ") + e.what();
        }
        c.all_reduce(std::span<float>(x), reduce_op::sum);  // pairs with the others' all_reduce
        require<error>(x[0] == 3.f, "rank ", r, ": all_reduce after the invalid calls gave ", x[0]);
      },
      {.timeout = 60s});
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  const std::string reduce = "rank 1: all_reduce of 4 elements needs a receive buffer of the same size, got 3";
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(errors[r].empty());
    CHECK_THAT(caught[r], Catch::StartsWith(r == 1 ? reduce
                                                   : cat("rank ", r, ": all_reduce(4 x F32, sum) abandoned: rank 1 passed "
                                                         "invalid arguments to all_reduce(4 x F32, sum) (", reduce, ")")));
    CHECK_THAT(caught[r], Catch::EndsWith(r == 2 ? std::string("| rank 2: broadcast root 3 is not a rank of 3")
                                                 : cat("| rank ", r, ": broadcast(4 x F32, root 0) abandoned: rank 2 "
                                                       "passed invalid arguments to broadcast(4 x F32, root 3) (rank 2: "
                                                       "broadcast root 3 is not a rank of 3)")));
  }
}

TEST_CASE("a rank that leaves makes the others raise naming it, at once", "[launch][socket][failure]") {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = socket_ranks(
      3,
      [&](SocketComm& c) {
        std::vector<float> x(1000, 1.f);
        c.all_reduce(std::span<float>(x), reduce_op::sum);
        if (c.rank() == 1) throw std::runtime_error("rank 1 stops here");  // its connections close as it unwinds
        c.all_reduce(std::span<float>(x), reduce_op::sum);
      },
      {.timeout = 60s});
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(errors[1] == "rank 1 stops here");
  // The first survivor to notice names rank 1 and tells the other (an out-of-band
  // byte), which then names rank 1 too, unless the first has hung up before the
  // notice could be read: then it names the first. So: both raise, at least one
  // names rank 1 directly.
  int direct = 0;
  for (int r : {0, 2}) {
    CHECK_THAT(errors[r], Catch::Contains("rank " + std::to_string(r) + ": all_reduce(1000 x F32, sum), collective 2") &&
                              Catch::Contains("the connection to rank ") &&
                              Catch::Contains("exited, failed, or left the communicator"));
    direct += errors[r].find("the connection to rank 1 (127.0.0.1:") != std::string::npos &&
              errors[r].find("closed: rank 1 exited") != std::string::npos;
  }
  CHECK(direct >= 1);
}

TEST_CASE("a rank that stops answering makes the others raise naming it after the timeout",
          "[launch][socket][failure]") {
  // Rank 2 stays connected until both others have raised: were it to leave after
  // the first, the second could see its connection close before its own timeout.
  std::atomic<int> raised{0};
  const auto start = std::chrono::steady_clock::now();
  const auto errors = socket_ranks(
      3,
      [&](SocketComm& c) {
        std::vector<float> x(8, 1.f), all(24);
        if (c.rank() == 2) {  // alive, connected, but never calls the collective
          while (raised < 2 && std::chrono::steady_clock::now() - start < 10s) std::this_thread::sleep_for(10ms);
          return;
        }
        try {
          c.all_gather(std::span<const float>(x), std::span<float>(all));
        } catch (...) {
          ++raised;
          throw;
        }
      },
      {.timeout = 0.5s});
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  for (int r : {0, 1})
    CHECK_THAT(errors[r], Catch::Contains("rank " + std::to_string(r) + ": all_gather(8 x F32), collective 1") &&
                              Catch::Contains("nothing from or to rank 2 (127.0.0.1:") &&
                              Catch::Contains("for 0.5 s"));
}

TEST_CASE("a rank that never joins makes the others raise naming it, not hang", "[launch][socket][failure]") {
  comm::store_server server(0, 3);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(2, [&](int r) {  // rank 2 never comes
    TcpStore store("127.0.0.1", server.port(), r, 3, false, 0.5s);
    SocketComm c(store);
  });
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  for (int r : {0, 1})
    CHECK_THAT(errors[r], Catch::Contains("rank " + std::to_string(r) + ": the store at 127.0.0.1:") &&
                              Catch::Contains("'socket_comm/0/2'") && Catch::Contains("never connected: 2"));
}

// A connection to a rank's listener that says nothing (a port scan, a health check)
// must not hold up the ranks that connect after it: the join read one handshake at a
// time and waited on the stray until the join's deadline.
TEST_CASE("a silent stray connection does not hold up the ranks joining", "[launch][socket]") {
  comm::store_server server(0, 2);
  comm::detail::socket_fd stray;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(2, [&](int r) {
    TcpStore store("127.0.0.1", server.port(), r, 2, false, 20s);
    if (r == 1) {  // first the stray, at rank 0's published address
      const std::string a = store.get("socket_comm/0/0");
      const auto colon = a.rfind(':');
      stray = comm::detail::connect_to(a.substr(0, colon), std::uint16_t(std::stoi(a.substr(colon + 1))),
                                       comm::detail::deadline_after(5s), "test");
    }
    SocketComm c(store);
    std::vector<float> x{float(r)};
    c.all_reduce(std::span<float>(x), reduce_op::sum);
    if (x[0] != 1.f) throw error("wrong sum");
  });
  CHECK(errors == std::vector<std::string>(2));
  CHECK(std::chrono::steady_clock::now() - start < 5s);  // not the 20 s deadline
}

// The out-of-band notice that a rank has gone carries its mesh rank in one byte; 255
// stands for any rank from 255 on. A peer that sends it reports a loss, it is not the
// one lost: rank 0 of a 300-process job hears from rank 1 (alive) of a 2-rank group.
TEST_CASE("a notice of a lost rank numbered 255 or more does not blame the rank that reports it",
          "[launch][socket][failure]") {
  auto error_after_notice = [](unsigned char notice) {
    auto listener = comm::detail::listen_on(0, "test");
    auto mine = comm::detail::connect_to("127.0.0.1", comm::detail::bound_port(listener),
                                         comm::detail::deadline_after(5s), "test");
    auto theirs = comm::detail::accept_until(listener, comm::detail::deadline_after(5s));
    auto mesh = std::make_shared<comm::detail::socket_mesh>();
    mesh->rank = 0;
    mesh->timeout = comm::seconds(5);
    mesh->peers.resize(300);
    for (int r = 0; r < 300; ++r) mesh->addresses.push_back("10.0.0.1:" + std::to_string(1000 + r));
    comm::detail::set_nonblocking(mine.get());
    mesh->peers[1] = std::move(mine);
    comm::detail::socket_group g{mesh, {0, 1}, 0, 42, 0};
    ::send(theirs.get(), &notice, 1, MSG_OOB);  // what rank 1 sends after it lost a rank
    std::this_thread::sleep_for(100ms);
    try {
      g.begin({comm::detail::op_kind::barrier});
    } catch (const comm_aborted& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error_after_notice(7), Catch::Contains("the connection to process rank 7 (10.0.0.1:1007) closed (rank 1 "
                                                    "reports it)"));
  const std::string unnamed = error_after_notice(255);
  CHECK_THAT(unnamed, Catch::Contains("rank 1 (10.0.0.1:1001) reports that a process of the job numbered 255 or more "
                                      "has gone"));
  CHECK_THAT(unnamed, !Catch::Contains("rank 1 exited"));
}

TEST_CASE("run_from_environment: threads without a launcher, SocketComm under torchrun variables",
          "[launch][run]") {
  std::atomic<int> ranks{0};
  comm::run_from_environment(
      [&](auto& c) {
        static_assert(std::is_same_v<std::decay_t<decltype(c)>, comm::ThreadComm> ||
                      std::is_same_v<std::decay_t<decltype(c)>, SocketComm>);
        if (std::is_same_v<std::decay_t<decltype(c)>, comm::ThreadComm> && c.size() == 3) ++ranks;
      },
      {.threads = 3, .environment = comm::launch_environment{}});
  CHECK(ranks == 3);

  std::uint16_t port = 0;
  {
    comm::store_server probe(0, 1);
    port = probe.port();
  }
  const auto [sums, errors] = sum_over_sockets(4, [&](int r) {
    return comm::launch_environment{.kind = comm::launcher::torchrun, .rank = r, .size = 4, .local_rank = r,
                                    .local_size = 4, .master_addr = "127.0.0.1", .master_port = port};
  });
  for (int r = 0; r < 4; ++r) {
    CHECK(errors[r].empty());
    CHECK(sums[r] == 10.0);
  }
  // A launched process without a rendezvous is told which variable is missing.
  comm::launch_environment slurm{.kind = comm::launcher::slurm, .rank = 0, .size = 2};
  CHECK_THROWS_WITH(comm::run_from_environment([](auto&) {}, {.environment = slurm}),
                    Catch::Contains("started by Slurm as rank 0 of 2, but MASTER_ADDR is not set"));
}

TEST_CASE("under torchrun, rank 0 serves the store on a free port and announces it in the agent's store",
          "[launch][run][torchrun]") {
  // torchrun's agent serves PyTorch's TCPStore at MASTER_PORT, where the library's own
  // store cannot listen (it did, and every torchrun launch failed: "Address already in use").
  fake_torch_store agent;
  const auto env_of = [&](int r, int size) {
    return comm::launch_environment{.kind = comm::launcher::torchrun, .rank = r, .size = size, .local_rank = r,
                                    .local_size = size, .master_addr = "127.0.0.1", .master_port = agent.port(),
                                    .agent_store = true};
  };
  const auto [sums, errors] = sum_over_sockets(3, [&](int r) { return env_of(r, 3); });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[r].empty());
    CHECK(sums[r] == 6.0);
  }
  CHECK(agent.errors().empty());
  const auto data = agent.data();
  REQUIRE(data.size() == 1);
  CHECK(data.begin()->first == "/shardlib/store");
  const std::string first = data.begin()->second;
  CHECK_THAT(first, Catch::StartsWith("127.0.0.1:") && !Catch::EndsWith(cat(":", agent.port())));

  // A restarted group finds the last group's announcement, its store gone with it (each
  // agent counts only its own restarts, so no count names the group): the others wait
  // for rank 0's new one, whichever comes first.
  for (const bool rank0_last : {false, true}) {
    INFO("rank 0 " << (rank0_last ? "last" : "first"));
    REQUIRE(agent.data().at("/shardlib/store") != "");
    const auto again = sum_over_sockets(3, [&](int r) {
      if (r == 0 && rank0_last) std::this_thread::sleep_for(300ms);
      return env_of(r, 3);
    });
    for (int r = 0; r < 3; ++r) {
      CHECK(again.second[r].empty());
      CHECK(again.first[r] == 6.0);
    }
  }
  CHECK(agent.data().at("/shardlib/store") != first);

  // Only a stale announcement, and no rank 0: the wait ends at the timeout, naming it.
  const std::string stale = agent.data().at("/shardlib/store");
  CHECK_THROWS_WITH(comm::store_from_environment(env_of(1, 2), 0.5s),
                    cat("rank 1: torchrun's store at 127.0.0.1:", agent.port(), " holds ", stale,
                        " under /shardlib/store, where nothing accepts connections (an earlier group's rank 0?), "
                        "and rank 0 announced no other within 0.5 s"));
  // One deadline for the whole join: an agent that comes up late (a rank started before
  // it; the connection retries) leaves the wait for the announcement only what is left,
  // so the join ends at 2 s, not at 1.5 + 2 s as when each step had the whole timeout.
  std::uint16_t late_port = 0;
  {
    const auto probe = comm::detail::listen_on(0, "a free port");
    late_port = comm::detail::bound_port(probe);
  }
  const auto started = std::chrono::steady_clock::now();
  std::string late_error;
  std::thread joining([&] {
    auto env = env_of(1, 2);
    env.master_port = late_port;
    try {
      comm::store_from_environment(env, 2s);
    } catch (const std::exception& e) {
      late_error = e.what();
    }
  });
  std::this_thread::sleep_for(1500ms);
  {
    fake_torch_store late(late_port);  // never announces
    joining.join();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO("the join took " << took << " s");
  CHECK_THAT(late_error, Catch::Contains("rank 1: torchrun's store at 127.0.0.1:") &&
                             Catch::Contains("has no '/shardlib/store' within 2 s"));
  CHECK(took < 3.0);  // 2 s and the thread's start and end; each step's own 2 s would take 3.5

  // An announcement that is no address.
  agent.set("/shardlib/store", "10.0.0.1");
  CHECK_THROWS_WITH(comm::store_from_environment(env_of(1, 2), 5s),
                    Catch::Contains("holds '10.0.0.1' under /shardlib/store, where rank 0 announces its store as "
                                    "host:port"));
  CHECK(agent.errors().empty());
}

}  // namespace test_launch
