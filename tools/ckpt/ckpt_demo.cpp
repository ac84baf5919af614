// ckpt-demo — trains a small model on W thread ranks, saving or resuming sharded
// checkpoints: the command-line round trip of docs/checkpoints.md.
//
//   ckpt-demo [--world W] [--strategy S] [--group-size G] [--steps N] [--resume PATH] [--save ROOT]
//             [--chunk-bytes B] [--out FILE]
//   ckpt-demo compare A B      compares two --out files: common steps' losses, final parameters
//
// Each step's global batch is 24 fixed rows and every rank takes its own rows, so runs
// at any world size (a divisor of 24) see the same data and differ by float rounding only.
#include <shardlib/comm/launch.hpp>
#include <shardlib/io/checkpoint.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/shard/sharded_model.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/flags.hpp"

namespace {

using namespace shardlib;
using Block = nn::Linear<float>;
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<Block>, nn::Linear<float>>;
constexpr long global_rows = 24, inputs = 16, hidden = 32, outputs = 4;

struct settings {
  int world = 4;
  std::string strategy = "FullShard";
  int group_size = 1;
  long steps = 5;
  std::string resume, save, out;
  std::uint64_t chunk_bytes = io::default_chunk_bytes;
};

// Rows [first, first + rows) of step `step`'s inputs, uniform in [-1, 1).
Tensor<float> inputs_of(long step, long rows, long first) {
  Tensor<float> x({rows, inputs});
  const counter_rng rng(1000 + std::uint64_t(step), 1);
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 2 * rng.uniform_float(std::uint64_t(first * inputs + i)) - 1;
  return x;
}
// The targets: a fixed random linear map of the inputs, which the model can learn.
Tensor<float> targets_of(const Tensor<float>& x) {
  const long rows = x.shape().extents()[0];
  Tensor<float> y({rows, outputs});
  const counter_rng w(7, 2);
  for (long b = 0; b < rows; ++b)
    for (long j = 0; j < outputs; ++j) {
      float sum = 0;
      for (long k = 0; k < inputs; ++k) sum += (2 * w.uniform_float(std::uint64_t(j * inputs + k)) - 1) * x[b * inputs + k];
      y[b * outputs + j] = sum / 4;
    }
  return y;
}

// Losses by step and final parameters by name, as --out writes them.
struct results {
  std::map<long, double> losses;
  std::map<std::string, std::vector<double>> params;
};

results read_results(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw io_error(cat(file, ": cannot open"));
  results r;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string kind, name;
    ls >> kind;
    if (kind == "loss") {
      long step = 0;
      double v = 0;
      ls >> step >> v;
      r.losses[step] = v;
    } else if (kind == "param") {
      ls >> name;
      for (double v; ls >> v;) r.params[name].push_back(v);
    }
  }
  return r;
}

// Within 1e-5 relative: the fp32 tolerance of tests/unit/test_shard.cpp for runs that
// sum the same terms in another order; parameters relative to max(|p|, lr), since
// Adam's steps are about lr in size whatever the gradient's scale.
int compare(const std::string& a, const std::string& b) {
  const auto ra = read_results(a), rb = read_results(b);
  double worst_loss = 0, worst_param = 0;
  std::size_t losses = 0, values = 0;
  const auto fold = [](double& worst, double e) {  // a NaN sticks (std::max would drop it)
    if (std::isnan(e) || e > worst) worst = std::isnan(worst) ? worst : e;
  };
  for (const auto& [step, v] : rb.losses)
    if (const auto it = ra.losses.find(step); it != ra.losses.end()) {
      fold(worst_loss, std::abs(v - it->second) / std::max(1e-6, std::abs(it->second)));
      ++losses;
    }
  if (ra.params.size() != rb.params.size()) throw io_error(cat(a, " and ", b, " hold different parameters"));
  for (const auto& [name, want] : ra.params) {
    const auto& got = rb.params.at(name);
    if (got.size() != want.size()) throw io_error(cat("parameter ", name, " has different sizes"));
    for (std::size_t i = 0; i < want.size(); ++i, ++values)
      fold(worst_param, std::abs(got[i] - want[i]) / std::max(1e-2, std::abs(want[i])));
  }
  const bool match = losses > 0 && worst_loss <= 1e-5 && worst_param <= 1e-5;
  std::printf("compared %zu common steps' losses and %zu parameter values: worst relative difference %.2g (losses), "
              "%.2g (parameters): %s\n",
              losses, values, worst_loss, worst_param, match ? "MATCH within 1e-5" : "DIFFERENT");
  return match ? 0 : 1;
}

template <class Strategy>
void train(const settings& s, Strategy strategy) {
  std::vector<io::load_result> loads(std::size_t(s.world));
  std::vector<std::string> log;
  results final_state;
  comm::launch(s.world, [&](comm::ThreadComm& c) {
    Model m{nn::Linear<float>(inputs, hidden), nn::Stack<Block>(2, Block(hidden, hidden)),
            nn::Linear<float>(hidden, outputs)};
    auto model = shard::fully_shard(m, c, strategy, {.wrap = shard::wrap_types<Block>{}, .seed = 1});
    optim::Adam adam{{.lr = 1e-2}};
    if (!s.resume.empty()) loads[std::size_t(c.rank())] = io::load_checkpoint(s.resume, model, adam);
    const long rows = global_rows / c.size();
    for (long i = 0; i < s.steps; ++i) {
      const long step = long(model.steps());
      const auto x = inputs_of(step, rows, c.rank() * rows);
      const auto y = targets_of(x);
      std::vector<float> loss{model.train_step(adam, x, y, nn::mse_loss)};
      c.all_reduce(std::span<float>(loss), comm::reduce_op::avg);
      if (c.rank() == 0) final_state.losses[step] = loss[0];
    }
    if (!s.save.empty()) {
      const auto path = io::save_checkpoint(s.save, model, adam, {.chunk_bytes = s.chunk_bytes});
      if (c.rank() == 0) log.push_back(cat("saved ", path.string()));
    }
    for (auto& [name, t] : model.full_state_dict())  // rank 0 only
      final_state.params[name].assign(t.span().begin(), t.span().end());
  });
  std::printf("ckpt-demo: %d ranks, %s\n", s.world, s.strategy.c_str());
  if (!s.resume.empty()) {
    const auto& m = loads[0].metadata;
    std::printf("resumed from %s (saved by %d ranks with %s after %llu steps)\n", loads[0].path.c_str(),
                m.world_size, m.strategy.c_str(), static_cast<unsigned long long>(m.steps));
    for (std::size_t r = 0; r < loads.size(); ++r) {
      std::string files;
      for (int f : loads[r].files_read) files += cat(files.empty() ? "" : ",", f);
      std::printf("  rank %zu read %llu bytes from shard files %s\n", r,
                  static_cast<unsigned long long>(loads[r].bytes_read), files.c_str());
    }
  }
  for (const auto& [step, loss] : final_state.losses) std::printf("step %ld loss %.7f\n", step, loss);
  for (const auto& line : log) std::printf("%s\n", line.c_str());
  if (!s.out.empty()) {
    std::ofstream out(s.out);
    out.precision(9);  // float round trip
    for (const auto& [step, loss] : final_state.losses) out << "loss " << step << ' ' << loss << '\n';
    for (const auto& [name, values] : final_state.params) {
      out << "param " << name;
      for (double v : values) out << ' ' << v;
      out << '\n';
    }
    if (!out) throw io_error(cat(s.out, ": cannot write"));
  }
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  std::string a, b;
  example::command_line cli("Trains a small model on --world thread ranks, saving or resuming sharded checkpoints.",
                            "ckpt-demo");
  cli.add_option("--world", s.world, "ranks, a divisor of 24 (the rows of a global batch)")
      ->check(example::whole(1, global_rows));
  cli.add_option("--strategy", s.strategy, "sharding strategy")
      ->check(CLI::IsMember({"FullShard", "ShardGradOp", "ShardOptimizer", "NoShard", "HybridShard"}));
  cli.add_option("--group-size", s.group_size, "HybridShard: ranks one replica is sharded over")
      ->check(example::whole(1, global_rows));
  cli.add_option("--steps", s.steps, "training steps")->check(example::whole(1, example::max_size));
  cli.add_option("--resume", s.resume, "a checkpoint, or a root of them, to resume from");
  cli.add_option("--save", s.save, "a root to save a checkpoint under at the end");
  cli.add_option("--chunk-bytes", s.chunk_bytes, "bytes per checksum")
      ->check(example::whole(io::detail::min_chunk_bytes, io::detail::max_chunk_bytes));
  cli.add_option("--out", s.out, "the losses and final parameters, for compare");
  auto* compare_cmd = cli.add_subcommand("compare", "compares two --out files: common steps' losses, final parameters");
  compare_cmd->add_option("A", a)->required();
  compare_cmd->add_option("B", b)->required();
  cli.require_subcommand(0, 1);
  cli.callback([&] {
    if (global_rows % s.world != 0)
      throw CLI::ValidationError("--world", cat(s.world, " does not divide ", global_rows));
    if (s.strategy == "HybridShard" && s.world % s.group_size != 0)
      throw CLI::ValidationError("--group-size", cat(s.group_size, " does not divide --world ", s.world));
  });
  cli.parse_or_exit(argc, argv);
  try {
    if (compare_cmd->parsed()) return compare(a, b);
    // One engine type for every strategy (shard::AnyStrategy).
    shard::AnyStrategy strategy = shard::HybridShard{.group_size = s.group_size};
    if (s.strategy == "FullShard") strategy = shard::FullShard{};
    else if (s.strategy == "ShardGradOp") strategy = shard::ShardGradOp{};
    else if (s.strategy == "ShardOptimizer") strategy = shard::ShardOptimizer{};
    else if (s.strategy == "NoShard") strategy = shard::NoShard{};
    train(s, strategy);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt-demo: %s\n", e.what());
    return 1;
  }
}
