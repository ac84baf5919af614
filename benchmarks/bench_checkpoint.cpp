// bench_checkpoint — a sharded checkpoint's save, synchronous and in the background,
// against the disk. The save writes each rank's fp32 master shard and its two Adam
// moments (12 bytes per parameter in all), hashes every chunk and syncs every file; its
// limit is the disk's rate for the same bytes written the same way: each rank writing
// its share to a file of its own at once, in 4 MiB writes, then fsync, measured in the
// same run on the same directory. For async_save_checkpoint the figure that matters is
// how long the training thread is held: the call (the copy of the shards to host
// memory) plus what wait() still has to do once every rank's file is written (the ranks'
// agreement, rank 0's metadata and rename, keep_last). Each figure is the slowest rank's.
//
//   bench_checkpoint [--params 64] (2^20 parameters) [--world 4] [--dir DIR] [--rounds 3]
//                    [--keep-last 1] [--json FILE] [--quick]
#include <shardlib/comm/launch.hpp>
#include <shardlib/io/checkpoint.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/shard/sharded_model.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>   // open
#include <unistd.h>  // write, fsync, close

#include "bench_common.hpp"
#include "common/flags.hpp"

using namespace shardlib;
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t width = 1024;  // each layer a 1024 x 1024 Linear: 2^20 + 1024 parameters

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Every thread writes `bytes` to a file of its own at once, in 4 MiB writes, then syncs it.
double raw_write_seconds(const fs::path& dir, int threads, std::size_t bytes) {
  const std::vector<char> block(std::size_t(4) << 20, 1);
  std::vector<std::thread> writers;
  const double t0 = bench::now_s();
  for (int t = 0; t < threads; ++t)
    writers.emplace_back([&, t] {
      const auto file = dir / ("raw-" + std::to_string(t));
      const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throw error(cat(file.string(), ": cannot create"));
      for (std::size_t done = 0; done < bytes;) {
        const auto n = ::write(fd, block.data(), std::min(block.size(), bytes - done));
        if (n <= 0) throw error(cat(file.string(), ": write failed"));
        done += std::size_t(n);
      }
      if (::fsync(fd) != 0 || ::close(fd) != 0) throw error(cat(file.string(), ": fsync or close failed"));
    });
  for (auto& w : writers) w.join();
  const double s = bench::now_s() - t0;
  for (int t = 0; t < threads; ++t) fs::remove(dir / ("raw-" + std::to_string(t)));
  return s;
}

struct round_times {
  double raw = 0, sync = 0, call = 0, wait = 0, background = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::int64_t layers = 64;
  int world = 4, rounds = 3, keep_last = 1;
  std::string dir_flag, json;
  bool quick = false;
  example::command_line cli("A sharded checkpoint's save, synchronous and asynchronous, against the disk.",
                            "bench_checkpoint");
  cli.add_option("--params", layers, "parameters, in 2^20 (one 1024 x 1024 Linear each)")
      ->check(example::whole(1, 4096));
  cli.add_option("--world", world, "ranks (threads)")->check(example::whole(1, 64));
  cli.add_option("--dir", dir_flag, "where to write (default: the system's temporary directory)");
  cli.add_option("--rounds", rounds, "measured rounds; the median is reported")->check(example::whole(1, 100));
  cli.add_option("--keep-last", keep_last, "each save's keep_last (0: keep every checkpoint until the end)")
      ->check(example::whole(0, 1000));
  cli.add_option("--json", json, "appends one JSON line");
  cli.add_flag("--quick", quick, "16 x 2^20 parameters, one round");
  cli.parse_or_exit(argc, argv);
  if (quick) {
    layers = std::min<std::int64_t>(layers, 16);
    rounds = 1;
  }
  const fs::path root =
      (dir_flag.empty() ? fs::temp_directory_path() : fs::path(dir_flag)) / cat("shardlib_bench_checkpoint_", ::getpid());
  fs::create_directories(root);

  const std::uint64_t params = std::uint64_t(layers) * std::uint64_t(width * width + width);
  const std::uint64_t bytes = 12 * params;  // fp32 master, exp_avg, exp_avg_sq
  std::printf("checkpoint save: %d ranks (threads), FullShard, Adam, %.1f M parameters, %.1f MB (fp32 master and "
              "two moments) into %s\n",
              world, double(params) / 1e6, double(bytes) / 1e6, root.c_str());

  // [round][rank]
  std::vector<std::vector<round_times>> measured(static_cast<std::size_t>(rounds),
                                                 std::vector<round_times>(static_cast<std::size_t>(world)));
  comm::launch(world, [&](comm::ThreadComm& c) {
    nn::Stack<nn::Linear<float>> model(std::size_t(layers), nn::Linear<float>(width, width));
    auto sharded = shard::fully_shard<optim::Adam>(model, c, shard::FullShard{},
                                                   {.wrap = shard::wrap_types<nn::Linear<float>>{}});
    optim::Adam adam;
    for (int r = 0; r < rounds; ++r) {
      round_times t;
      c.barrier();
      if (c.rank() == 0) {
        io::finish_background_deletions();  // the last round's, which would slow the reference
        t.raw = raw_write_seconds(root, world, std::size_t(bytes) / std::size_t(world));
      }
      c.barrier();
      double t0 = bench::now_s();
      io::save_checkpoint(root, sharded, adam, {.keep_last = keep_last, .tag = cat("sync-", r)});
      t.sync = bench::now_s() - t0;
      c.barrier();
      t0 = bench::now_s();
      auto pending = io::async_save_checkpoint(root, sharded, adam, {.keep_last = keep_last, .tag = cat("async-", r)});
      t.call = bench::now_s() - t0;
      // "Training" until every rank's file is written: wait() is then the commit alone.
      while (!pending.written()) std::this_thread::sleep_for(std::chrono::microseconds(200));
      c.barrier();
      t.background = bench::now_s() - t0;
      const double w0 = bench::now_s();
      pending.wait();
      t.wait = bench::now_s() - w0;
      c.barrier();
      measured[std::size_t(r)][std::size_t(c.rank())] = t;
    }
  });
  io::finish_background_deletions();  // the async saves' keep_last deletes inside root
  fs::remove_all(root);

  // The median over rounds of the slowest rank's figure.
  const auto pick = [&](auto figure) {
    std::vector<double> v;
    for (const auto& ranks : measured) {
      double slowest = 0;
      for (const auto& t : ranks) slowest = std::max(slowest, figure(t));
      v.push_back(slowest);
    }
    return median(v);
  };
  const double raw = pick([](const round_times& t) { return t.raw; });
  const double sync = pick([](const round_times& t) { return t.sync; });
  const double call = pick([](const round_times& t) { return t.call; });
  const double wait = pick([](const round_times& t) { return t.wait; });
  const double held = pick([](const round_times& t) { return t.call + t.wait; });
  const double background = pick([](const round_times& t) { return t.background; });
  const double gb = double(bytes) / 1e9;
  std::printf("%-34s %9s %8s %s\n", "", "seconds", "GB/s", "vs the disk (raw write + fsync)");
  std::printf("%-34s %9.3f %8.2f\n", "raw write + fsync, same bytes", raw, gb / raw);
  std::printf("%-34s %9.3f %8.2f %.2fx\n", "save_checkpoint", sync, gb / sync, raw / sync);
  std::printf("%-34s %9.3f %8.2f %.2fx\n", "async: until every file is written", background, gb / background,
              raw / background);
  std::printf("%-34s %9.3f %8s training held %.1f%% of save_checkpoint's time (call %.3f s, wait %.3f s)\n",
              "async: training thread held", held, "", 100 * held / sync, call, wait);
  if (!json.empty()) {
    std::FILE* f = std::fopen(json.c_str(), "a");
    if (!f) throw error(cat(json, ": cannot open"));
    std::fprintf(f,
                 "{\"bench\":\"checkpoint\",\"world\":%d,\"params\":%llu,\"bytes\":%llu,\"raw_s\":%.6g,\"sync_s\":%.6g,"
                 "\"async_call_s\":%.6g,\"async_wait_s\":%.6g,\"async_held_s\":%.6g,\"async_written_s\":%.6g,"
                 "\"sync_vs_raw\":%.4g}\n",
                 world, static_cast<unsigned long long>(params), static_cast<unsigned long long>(bytes), raw, sync,
                 call, wait, held, background, raw / sync);
    std::fclose(f);
  }
  return 0;
}
