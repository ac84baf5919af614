// ckpt-demo — trains a small model on W thread ranks, saving or resuming sharded
// checkpoints: the command-line round trip of docs/checkpoints.md.
//
//   ckpt-demo --world W [--strategy S] [--group-size G] --steps N [--resume PATH] [--save ROOT]
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
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

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
  for (const auto& [step, v] : rb.losses)
    if (const auto it = ra.losses.find(step); it != ra.losses.end()) {
      worst_loss = std::max(worst_loss, std::abs(v - it->second) / std::max(1e-6, std::abs(it->second)));
      ++losses;
    }
  if (ra.params.size() != rb.params.size()) throw io_error(cat(a, " and ", b, " hold different parameters"));
  for (const auto& [name, want] : ra.params) {
    const auto& got = rb.params.at(name);
    if (got.size() != want.size()) throw io_error(cat("parameter ", name, " has different sizes"));
    for (std::size_t i = 0; i < want.size(); ++i, ++values)
      worst_param = std::max(worst_param, std::abs(got[i] - want[i]) / std::max(1e-2, std::abs(want[i])));
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

int run(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "compare") return compare(argv[2], argv[3]);
  settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--world") s.world = std::atoi(value.c_str());
    else if (flag == "--strategy") s.strategy = value;
    else if (flag == "--group-size") s.group_size = std::atoi(value.c_str());
    else if (flag == "--steps") s.steps = std::atol(value.c_str());
    else if (flag == "--resume") s.resume = value;
    else if (flag == "--save") s.save = value;
    else if (flag == "--out") s.out = value;
    else if (flag == "--chunk-bytes") s.chunk_bytes = std::strtoull(value.c_str(), nullptr, 10);
    else throw error(cat("unknown flag ", flag));
  }
  if (argc % 2 == 0 || s.world < 1 || global_rows % s.world != 0)
    throw error("usage: ckpt-demo --world W (a divisor of 24) [--strategy S] [--group-size G] --steps N "
                "[--resume PATH] [--save ROOT] [--chunk-bytes B] [--out FILE] | ckpt-demo compare A B");
  if (s.strategy == "FullShard") train(s, shard::FullShard{});
  else if (s.strategy == "ShardGradOp") train(s, shard::ShardGradOp{});
  else if (s.strategy == "ShardOptimizer") train(s, shard::ShardOptimizer{});
  else if (s.strategy == "NoShard") train(s, shard::NoShard{});
  else if (s.strategy == "HybridShard") train(s, shard::HybridShard{.group_size = s.group_size});
  else throw error(cat("unknown strategy ", s.strategy));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt-demo: %s\n", e.what());
    return 1;
  }
}
