// examples/common/training.hpp — the training loop train_fsdp and train_fsdp_cuda
// share: the article's printout, a progress line with an ETA, --metrics JSON lines,
// and the consolidated model written to safetensors at the end.
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/core/ledger.hpp>
#include <shardlib/io/safetensors.hpp>
#include <shardlib/nn/layer.hpp>
#include <shardlib/nn/loss.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>  // std::function
#include <string>
#include <string_view>
#include <type_traits>  // std::remove_cvref_t
#include <vector>

#include "flags.hpp"
#include "sharding_flags.hpp"  // train_step over micro-batches
#include "synthetic.hpp"

namespace example {

// One JSON line per step of this rank; one fprintf per line, so the lines of ranks
// sharing the file (threads: a locked FILE; processes: O_APPEND) never interleave.
inline void log_metrics(std::FILE* out, std::string_view program, std::string_view strategy, int world, int rank,
                        long step, float loss, double seconds, double tokens, const shardlib::ledger& l) {
  namespace sl = shardlib;
  std::string peaks;
  for (int k = 0; k < sl::category_count; ++k)
    peaks += sl::cat("\"", sl::name(sl::category(k)), "\":", l.peak(sl::category(k)), ",");
  std::fprintf(out,
               "{\"bench\":\"%s\",\"strategy\":\"%s\",\"world\":%d,\"rank\":%d,\"step\":%ld,\"loss\":%.9g,"
               "\"step_s\":%.9g,\"tokens_per_s\":%.9g,\"peak_bytes\":{%s\"total\":%zu}}\n",
               std::string(program).c_str(), std::string(strategy).c_str(), world, rank, step, double(loss), seconds,
               tokens / seconds, peaks.c_str(), l.peak());
  std::fflush(out);
}

// run.steps steps of `sharded` (a shard::ShardedModel) with `opt` on the synthetic
// task, each train_step over run.accumulation.grad_accum micro-batches of run.batch rows per
// rank; batch(first, count) gives the inputs and labels of rows [first, first + count) of the
// global data set, in the model's memory space. finish(), when given, waits for a step's
// asynchronous work (the GPU's), so that step times are the steps' own.
template <class Sharded, class Optimizer, class Batch>
void train_loop(std::string_view program, Sharded& sharded, Optimizer& opt, const synthetic_task& task,
                const train_flags& run, std::FILE* metrics, Batch&& batch, const std::function<void()>& finish = {}) {
  namespace sl = shardlib;
  auto& c = sharded.comm();
  const std::string_view strategy = sharded.strategy().name;
  const long steps = run.steps, per_rank = run.batch, every = run.every, micro = run.accumulation.grad_accum;
  if (c.rank() == 0)
    std::printf("%s: %zu parameters in %zu units, %s over %d ranks, per-rank batch %ld%s\n",
                std::string(program).c_str(), sl::nn::parameter_count(sharded.model()), sharded.unit_count(),
                std::string(strategy).c_str(), c.size(), per_rank,
                micro > 1 ? (" x " + accumulation_note(run.accumulation)).c_str() : "");
  auto since = [](auto t) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); };
  sl::ledger& l = sl::current_ledger();  // this rank's
  const double tokens = double(per_rank * micro * task.seq);  // per rank and step
  auto t0 = std::chrono::steady_clock::now();
  long diverged = -1;  // the first step whose loss was inf or NaN on this rank
  for (long step = 0; step < steps; ++step) {
    l.reset_peaks();  // the peaks of this step alone
    const auto t_step = std::chrono::steady_clock::now();
    // Each rank takes its own slices of the global batch of step `step`, one per micro-batch.
    using rows = decltype(batch(0L, per_rank));
    std::vector<typename rows::first_type> xs;
    std::vector<typename rows::second_type> ys;
    for (long k = 0; k < micro; ++k) {
      auto [x, y] = batch(((step * c.size() + c.rank()) * micro + k) * per_rank, per_rank);
      xs.push_back(std::move(x));
      ys.push_back(std::move(y));
    }
    // Each rank prints its own loss, as the article's script does (train_step's default is the global mean).
    const float loss = example::train_step(sharded, opt, xs, ys, sl::nn::cross_entropy, run.accumulation,
                                           {.loss = sl::shard::loss_report::local});
    if (finish) finish();
    if (metrics) log_metrics(metrics, program, strategy, c.size(), c.rank(), step, loss, since(t_step), tokens, l);
    if (step % every == 0) std::printf("Rank %d, Step %ld, Loss: %f\n", c.rank(), step, double(loss));
    if (!std::isfinite(loss) && diverged < 0) {  // the ranks go on in step: stopping one alone would hang the others
      diverged = step;
      std::printf("Rank %d, Step %ld: the loss is %f: training diverged (try a lower --lr)\n", c.rank(), step,
                  double(loss));
    }
    if (step % every == 0 && c.rank() == 0) {
      const double elapsed = since(t0), per_step = elapsed / double(step + 1);
      std::printf("%s: step %ld/%ld, %.0f tokens/s over %d ranks, %.3f s/step, ETA %.1f s\n",
                  std::string(program).c_str(), step + 1, steps, tokens * c.size() / per_step, c.size(), per_step,
                  per_step * double(steps - step - 1));
    }
  }
  const double seconds = since(t0);
  auto state = sharded.full_state_dict();  // rank 0 holds it, one unit gathered at a time
  if (diverged >= 0)
    throw sl::error(sl::cat("rank ", c.rank(), ": the loss was not finite from step ", diverged, " on; ",
                            c.rank() == 0 ? "the model is not written" : "rank 0 writes no model"));
  if (c.rank() == 0) {
    for (auto& [name, t] : state)
      for (float v : t.span())
        if (!std::isfinite(v))
          throw sl::error(sl::cat("rank 0: parameter '", name, "' holds ", v, "; the model is not written"));
    sl::io::safetensors_writer out;
    for (auto& [name, t] : state) out.add<float>(name, t.shape(), t.span());
    out.set_metadata("format", "pt");
    out.write(run.out);
    std::printf("%s: %.3f s per step; model written to %s\n", std::string(program).c_str(), seconds / double(steps),
                run.out.c_str());
  }
}

}  // namespace example
