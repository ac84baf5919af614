// bench_strategies — every sharding strategy training a model on W rank threads (the
// transformer classifier, or with --model gpt2 a GPT2LMHeadModel): the step time, each rank's peak memory by ledger category beside the
// strategy's memory formula (derived from the units' padded sizes), and the bytes each
// rank sends per step (counted by a communicator decorator, ring model) beside the
// strategy's traffic formula.
//
//   bench_strategies [--worlds 1,2,4,8] [--strategies full,grad-op,optimizer,none,hybrid]
//                    [--article] [--layers 4] [--d-model 256] [--heads 4] [--ff 1024] [--seq 16]
//                    [--batch 8] [--classes 10] [--dropout 0.1] [--prefetch 1] [--group 2]
//                    [--warmup 2] [--steps 8] [--rounds 3] [--json FILE]
//                    [--model encoder|gpt2] [--vocab 8192] [--frozen-layers N] [--freeze GLOB,...]
//                    [--lora TARGET,... [--lora-r 8]] [--no-frozen-grads] [--keep-gathered N]
//                    [--reshard-to R] [--grad-accum K [--no-sync] [--no-reshard-after-backward]]
//
// The default model is reduced so that the whole run takes a few minutes on 2 cores;
// --article selects the FSDP article's sizes (6 layers, d_model 512, 8 heads, ff 2048,
// seq 10), and size flags override single values whatever their position. --model gpt2
// trains models::GPT2LMHeadModel (tied head, each GPT2Block a unit, n_inner = --ff,
// --dropout for all three dropouts) with AdamW on next-token cross-entropy over random
// token ids, the sizes above and --vocab; --classes does not apply to it. --frozen-layers N
// trains a fine-tune: the encoder's lower N layers frozen, or GPT-2's embeddings (the
// tied head with them) and lower N blocks, a frozen prefix that runs forward only.
// --freeze freezes the parameters its globs name (nn::freeze, e.g. 'transformer.h.*.attn.*':
// every block then holds frozen and trained parameters, whose reduction sends the trained
// elements alone); a glob that names none is an error. --lora TARGET,... (gpt2) trains a
// LoRA fine-tune: adapters of rank --lora-r on the projections it names, the rest frozen.
// --no-frozen-grads wraps with shard::options::frozen_grads = false (backward keeps no
// gradients of frozen parameters in wholly frozen and packed units). --keep-gathered N keeps
// the last N layers' units gathered from their forward to their backward
// (shard::options::keep_gathered, FSDP2's reshard_after_forward=False). --reshard-to R runs
// FullShard and HybridShard with shard::policy::reshard_to = R (FSDP2's reshard_after_forward=R),
// at the world sizes (and groups) R divides. --grad-accum K makes each step train_step over K
// micro-batches of --batch sequences per rank, --no-sync and --no-reshard-after-backward
// setting its step_options; the formula's activations then add the caller's other K - 1
// micro-batches (their inputs and targets, held at once).
//
// Strategies run in turns, `rounds` times each, each run in a fresh child process, and
// step times are pooled over the rounds: other work on a shared machine then slows all
// strategies alike instead of whichever ran at a bad moment. Beside the wall time, the
// process's CPU time, system time and minor page faults per step (all ranks and their
// communication workers) show where time goes even when the machine is shared.
#include <shardlib/comm/launch.hpp>
#include <shardlib/models/gpt2.hpp>
#include <shardlib/nn/freeze.hpp>
#include <shardlib/nn/lora.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/replicated.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/plan/describe.hpp>
#include <shardlib/plan/memory_plan.hpp>
#include <shardlib/shard/sharded_model.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.hpp"
#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"
#include "counting_comm.hpp"

using namespace shardlib;
using Comm = bench::counting_comm<comm::ThreadComm>;
static_assert(comm::check_communicator<Comm>());

namespace {

struct config : example::accumulation_flags {
  std::string model_name = "encoder";  // or "gpt2"
  long vocab = 8192;              // gpt2 only
  long frozen_layers = 0;         // --frozen-layers
  std::vector<std::string> freeze;  // --freeze
  std::vector<std::string> lora;    // --lora: target modules (gpt2)
  long lora_r = 8;
  bool no_frozen_grads = false;   // --no-frozen-grads: shard::options::frozen_grads = false
  long keep_gathered = 0;         // --keep-gathered: the last N layers' units
  int reshard_to = 0;             // --reshard-to: FullShard's and HybridShard's policy::reshard_to
  example::model_flags model{.layers = 4, .d_model = 256, .heads = 4, .ff = 1024, .seq = 16};
  long batch = 8;
  int prefetch = 1, group = 2, warmup = 2, steps = 8, rounds = 3;
  std::vector<int> worlds{1, 2, 4, 8};
  std::vector<std::string> strategies{"full", "grad-op", "optimizer", "none", "hybrid"};
  std::FILE* json = nullptr;
};

// --freeze's globs or --lora's targets, comma-separated as given (for the header and a
// JSON string: they hold no quote or backslash, which parse() refuses).
std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& g : names) s += cat(s.empty() ? "" : ",", g);
  return s;
}

// What a run trains: the model, the units to wrap, the optimizer and each rank's
// batches. The encoder classifier on the synthetic task with Adam ...
struct encoder_workload {
  using model_type = example::Model;
  using unit = example::Encoder;
  using optimizer = optim::Adam;
  const config& cfg;
  example::synthetic_task task = example::task_for(cfg.model);

  model_type make() const {
    auto m = example::reference_model(cfg.model);
    example::freeze_lower_layers(m, cfg.frozen_layers);
    nn::freeze(m, cfg.freeze);
    return m;
  }
  auto inputs(long first) const { return task.inputs(first, cfg.batch); }
  auto targets(long first) const { return task.labels(first, cfg.batch); }
  static std::string unit_name(long k) { return cat("0.layers.", k); }
};

// ... or GPT-2 with AdamW on uniform random token ids (seeded by the batch's first
// sequence), predicting each next token as Hugging Face's labels = input_ids does.
struct gpt2_workload {
  using model_type = models::GPT2LMHeadModel<float>;
  using unit = models::GPT2Block<float>;
  using optimizer = optim::AdamW;
  const config& cfg;

  model_type make() const {
    const auto& m = cfg.model;
    model_type model({.vocab_size = cfg.vocab, .n_positions = m.seq, .n_embd = m.d_model, .n_layer = m.layers,
                      .n_head = m.heads, .n_inner = m.ff, .resid_pdrop = m.dropout, .embd_pdrop = m.dropout,
                      .attn_pdrop = m.dropout});
    std::vector<std::string> frozen;  // the embeddings (and so the tied head) and the lower blocks
    if (cfg.frozen_layers > 0) frozen = {"transformer.wte.*", "transformer.wpe.*"};
    for (long k = 0; k < cfg.frozen_layers; ++k) frozen.push_back(cat("transformer.h.", k, ".*"));
    nn::freeze(model, frozen);
    nn::freeze(model, cfg.freeze);
    if (!cfg.lora.empty()) nn::add_lora(model, cfg.lora, {.r = cfg.lora_r, .alpha = 2.0 * double(cfg.lora_r)});
    return model;
  }
  Tensor<std::int64_t> inputs(long first) const {
    Tensor<std::int64_t> t({cfg.batch, cfg.model.seq});
    const counter_rng rng(7, std::uint64_t(first));
    for (std::int64_t i = 0; i < t.numel(); ++i)
      t[i] = std::min<std::int64_t>(cfg.vocab - 1,
                                    std::int64_t(rng.uniform_double(std::uint64_t(i)) * double(cfg.vocab)));
    return t;
  }
  Tensor<std::int64_t> targets(long first) const { return models::causal_lm_targets(inputs(first)); }
  static std::string unit_name(long k) { return cat("transformer.h.", k); }
};

// --keep-gathered's units: the last N layers', by name.
template <class Workload>
shard::wrap_names kept_units(const config& cfg) {
  shard::wrap_names kept;
  for (long k = cfg.model.layers - cfg.keep_gathered; k < cfg.model.layers; ++k)
    kept.names.push_back(Workload::unit_name(k));
  return kept;
}

// Bytes by ledger category, then the total.
constexpr int total_index = category_count;
using per_category = std::array<double, category_count + 1>;
std::string column_name(int k) { return k == total_index ? "total" : std::string(name(category(k))); }

// One step of the whole process: wall time (the slowest rank's), CPU and system time
// of all threads, minor page faults.
struct step_sample {
  double wall_s = 0, cpu_s = 0, sys_s = 0, faults = 0;

  static step_sample now() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    auto seconds = [](const timeval& t) { return double(t.tv_sec) + 1e-6 * double(t.tv_usec); };
    return {bench::now_s(), seconds(u.ru_utime) + seconds(u.ru_stime), seconds(u.ru_stime), double(u.ru_minflt)};
  }
  step_sample operator-(const step_sample& o) const {
    return {wall_s - o.wall_s, cpu_s - o.cpu_s, sys_s - o.sys_s, faults - o.faults};
  }
};

// What one run measures apart from its steps; trivially copyable, so that the child
// process that ran it can hand it back as bytes.
struct totals {
  int world = 0, group = 0;  // group: ranks one shard is split over (W, or HybridShard's group size)
  std::size_t psi = 0;       // Ψ: parameters including padding, summed over units
  std::size_t units = 0;
  per_category peak{}, formula{};     // per rank; peak is the largest over ranks
  double sent = 0, sent_formula = 0;  // bytes one rank sends per step
  std::array<double, 4> sent_by{};    // all_gather, reduce_scatter, all_reduce, broadcast
};

struct measurement : totals {
  std::string strategy;
  std::vector<step_sample> steps;  // one per measured step, over all rounds
  double median(double step_sample::*field) const {
    std::vector<double> v;
    for (const auto& s : steps) v.push_back(s.*field);
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  }
};

// Activations are not a formula of the strategy: the same local batch through the
// unsharded model (plain context, replicated parameters) peaks at what every
// strategy should, since sharding only changes where parameters live.
template <class Workload>
double reference_activations(const Workload& work) {
  ledger l;
  ledger_scope scope(l);
  auto m = work.make();
  nn::Replicated<float, typename Workload::model_type> owner(m, 1);
  nn::context ctx;
  auto x = work.inputs(0);
  auto y = work.targets(0);
  auto out = ctx.forward(m, x);
  ctx.backward(m, nn::cross_entropy(out, y).grad);
  // train_step over micro-batches holds the other ones' inputs and targets too
  const auto bytes = [](const auto& t) { return double(t.numel()) * double(sizeof(*t.data())); };
  return double(l.peak(category::activations)) + double(work.cfg.grad_accum - 1) * (bytes(x) + bytes(y));
}

// The planner's formulas (include/shardlib/plan/memory_plan.hpp, docs/planner.md) for
// this run: memory by category and bytes sent per step, read off the strategy's
// policy and the wrapped model's units in their recorded order. Activations come
// from reference_activations, added by the caller; the total is the sum of the
// category peaks, an upper bound since categories peak at different moments.
template <class Strategy, class Engine>
std::pair<per_category, double> formulas(Engine& e, const Strategy& strategy, int w, const config& cfg) {
  const auto p = plan::make_plan(plan::describe(e), {.policy = strategy.policy(),
                                                     .world = w,
                                                     .prefetch = cfg.prefetch,
                                                     .frozen_grads = !cfg.no_frozen_grads,
                                                     .accumulation = {.micro_batches = int(cfg.grad_accum),
                                                                      .no_sync = cfg.no_sync,
                                                                      .keep_after_backward = cfg.no_reshard_after_backward,
                                                                      .replica_all_reduce = !cfg.no_replica_all_reduce}});
  per_category f{};
  for (int k = 0; k < category_count; ++k) {
    if (category(k) == category::activations) continue;
    f[k] = double(p.memory[category(k)]);
    f[total_index] += f[k];
  }
  return {f, p.sent.total()};
}

template <class Workload, class Strategy>
measurement run(const Workload& work, int w, Strategy strategy) {
  const config& cfg = work.cfg;
  measurement m;
  m.world = w;
  m.group = strategy.policy().group(w);
  std::vector<per_category> peaks(w);
  std::vector<std::array<double, 4>> sent(w);
  comm::launch(w, [&](comm::ThreadComm& c, ledger& l) {
    auto tally = std::make_shared<bench::traffic>();
    Comm counted(c, tally);
    auto model = work.make();
    typename Workload::optimizer opt{{.lr = 1e-3}};
    auto sharded = shard::fully_shard(
        model, counted, strategy, opt,
        {.wrap = shard::wrap_types<typename Workload::unit>{},
         .keep_gathered = kept_units<Workload>(cfg),
         .seed = 1,
         .prefetch = cfg.prefetch,
         .frozen_grads = !cfg.no_frozen_grads});
    for (int step = 0; step < cfg.warmup + cfg.steps; ++step) {
      if (step == cfg.warmup) {  // setup and warm-up (order recording, optimizer state) are not measured
        l.reset_peaks();
        tally->reset();
      }
      // this rank's slices of the global batch, one per micro-batch
      std::vector<decltype(work.inputs(0))> xs;
      std::vector<decltype(work.targets(0))> ys;
      for (long k = 0; k < cfg.grad_accum; ++k) {
        const long first = ((long(step) * w + c.rank()) * cfg.grad_accum + k) * cfg.batch;
        xs.push_back(work.inputs(first));
        ys.push_back(work.targets(first));
      }
      c.barrier();  // (not counted: raw communicator) ranks start together, not waiting for a straggler
      const auto before = step_sample::now();
      if (cfg.grad_accum == 1) sharded.train_step(opt, xs[0], ys[0], nn::cross_entropy);
      else sharded.train_step(opt, xs, ys, nn::cross_entropy,
                              {.no_sync = cfg.no_sync,
                               .reshard_after_backward = !cfg.no_reshard_after_backward,
                               .replica_all_reduce = !cfg.no_replica_all_reduce});
      c.barrier();  // a step ends when its slowest rank does
      if (step >= cfg.warmup && c.rank() == 0) m.steps.push_back(step_sample::now() - before);
    }
    for (int k = 0; k < category_count; ++k) peaks[c.rank()][k] = double(l.peak(category(k)));
    peaks[c.rank()][total_index] = double(l.peak());
    sent[c.rank()] = {tally->all_gather / cfg.steps, tally->reduce_scatter / cfg.steps,
                      tally->all_reduce / cfg.steps, tally->broadcast / cfg.steps};
    if (c.rank() != 0) return;
    m.units = sharded.unit_count();
    for (std::size_t i = 0; i < sharded.unit_count(); ++i) m.psi += sharded.partition(i).padded_size();
    std::tie(m.formula, m.sent_formula) = formulas(sharded, strategy, w, cfg);
  });
  for (int r = 0; r < w; ++r) {
    for (int k = 0; k <= total_index; ++k) m.peak[k] = std::max(m.peak[k], peaks[r][k]);
    for (int k = 0; k < 4; ++k) m.sent_by[k] = std::max(m.sent_by[k], sent[r][k]);
  }
  for (double b : m.sent_by) m.sent += b;
  const double activations = reference_activations(work);  // after the run, which it must not disturb
  m.formula[int(category::activations)] = activations;
  m.formula[total_index] += activations;
  return m;
}

void write_all(int fd, const std::string& bytes) {
  for (std::size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    require(n > 0, "bench_strategies: writing a result to the parent failed");
    done += std::size_t(n);
  }
}

// Runs one configuration in a child process and returns what it measured, so that each
// starts from a fresh process's allocator state, as a training program does: glibc
// raises its mmap and trim thresholds after large frees, and in one long process a run
// would inherit the policy the runs before it set (whether freed gathered buffers go
// back to the kernel and fault in again every step depended on the order of runs).
template <class Fn>
measurement in_fresh_process(Fn&& fn) {
  int fds[2];
  require(pipe(fds) == 0, "bench_strategies: pipe failed");
  std::fflush(nullptr);  // nothing buffered may be written by both processes
  const pid_t pid = fork();
  require(pid >= 0, "bench_strategies: fork failed");
  if (pid == 0) {
    close(fds[0]);
    int code = 0;
    try {
      const measurement m = fn();
      const totals t = m;
      std::string bytes(reinterpret_cast<const char*>(&t), sizeof t);
      bytes.append(reinterpret_cast<const char*>(m.steps.data()), m.steps.size() * sizeof(step_sample));
      write_all(fds[1], bytes);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_strategies: %s\n", e.what());
      code = 1;
    }
    std::fflush(nullptr);
    _exit(code);
  }
  close(fds[1]);
  std::string bytes;
  char buffer[4096];
  for (ssize_t n; (n = read(fds[0], buffer, sizeof buffer)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    bytes.append(buffer, std::size_t(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  require(WIFEXITED(status) && WEXITSTATUS(status) == 0 && bytes.size() >= sizeof(totals),
          "bench_strategies: a configuration failed (see above)");
  measurement m;
  totals t;
  std::memcpy(&t, bytes.data(), sizeof t);
  static_cast<totals&>(m) = t;
  m.steps.resize((bytes.size() - sizeof t) / sizeof(step_sample));
  std::memcpy(m.steps.data(), bytes.data() + sizeof t, m.steps.size() * sizeof(step_sample));
  return m;
}

// Runs fn with the strategy of a flag name (as shard::AnyStrategy: one engine type for
// all); HybridShard only where its group divides W; with --reshard-to, FullShard and
// HybridShard only where it divides their shard group.
template <class Fn>
void with_strategy(const std::string& s, const config& cfg, int w, Fn&& fn) {
  const int R = cfg.reshard_to;
  if (s == "full" && w % std::max(R, 1) == 0) fn(shard::AnyStrategy(shard::FullShard{.reshard_to = R}));
  else if (s == "grad-op") fn(shard::AnyStrategy(shard::ShardGradOp{}));
  else if (s == "optimizer") fn(shard::AnyStrategy(shard::ShardOptimizer{}));
  else if (s == "none") fn(shard::AnyStrategy(shard::NoShard{}));
  else if (s == "hybrid" && w % cfg.group == 0 && cfg.group % std::max(R, 1) == 0)
    fn(shard::AnyStrategy(shard::HybridShard{.group_size = cfg.group, .reshard_to = R}));
}

std::string ratio(double measured, double formula) {
  char b[32];
  if (formula == 0 && measured == 0) return "-";
  if (formula == 0) return "inf";
  std::snprintf(b, sizeof b, "%.3f", measured / formula);
  return b;
}

void print_tables(const std::vector<measurement>& all, unsigned cores) {
  auto oversubscribed = [&](int w) { return unsigned(w) > cores; };
  std::printf("\n## step time (medians; cpu, sys and faults: the whole process per step) and bytes sent per rank "
              "per step (ring model, MB = 1e6 bytes)\n");
  std::printf("%-15s %4s %9s %10s %8s %8s %7s %10s %11s %7s  %s\n", "strategy", "W", "step_ms", "vs_NoShard",
              "cpu_ms", "sys_ms", "faults", "sent_MB", "formula_MB", "ratio", "all_gather / reduce_scatter / all_reduce");
  for (const auto& m : all) {
    double none = 0;
    for (const auto& o : all)
      if (o.world == m.world && o.strategy == "NoShard") none = o.median(&step_sample::wall_s);
    const double wall = m.median(&step_sample::wall_s);
    std::printf("%-15s %3d%s %9.1f %10s %8.1f %8.1f %7.0f %10.3f %11.3f %7s  %.3f / %.3f / %.3f\n", m.strategy.c_str(),
                m.world, oversubscribed(m.world) ? "*" : " ", wall * 1e3, none > 0 ? ratio(wall, none).c_str() : "-",
                m.median(&step_sample::cpu_s) * 1e3, m.median(&step_sample::sys_s) * 1e3,
                m.median(&step_sample::faults), m.sent / 1e6, m.sent_formula / 1e6, ratio(m.sent, m.sent_formula).c_str(),
                m.sent_by[0] / 1e6, m.sent_by[1] / 1e6, m.sent_by[2] / 1e6);
  }
  std::printf("\n## per-rank peak memory by ledger category (MiB), beside the formula\n");
  std::printf("%-15s %4s %-9s", "strategy", "W", "");
  for (const char* label : {"parameters", "gradients", "optimizer", "gathered", "activations", "comm_scratch", "total"})
    std::printf(" %12s", label);
  std::printf("\n");
  for (const auto& m : all) {
    std::printf("%-15s %3d%s %-9s", m.strategy.c_str(), m.world, oversubscribed(m.world) ? "*" : " ", "measured");
    for (double b : m.peak) std::printf(" %12.3f", b / 1048576);
    std::printf("\n%-20s %-9s", "", "formula");
    for (double b : m.formula) std::printf(" %12.3f", b / 1048576);
    std::printf("\n%-20s %-9s", "", "ratio");
    for (int k = 0; k <= total_index; ++k) std::printf(" %12s", ratio(m.peak[k], m.formula[k]).c_str());
    std::printf("\n");
  }
  if (std::any_of(all.begin(), all.end(), [&](const measurement& m) { return oversubscribed(m.world); }))
    std::printf("\n* W > %u hardware threads: ranks (each with a communication worker) share the cores, so the\n"
                "  step time measures contention, not scaling.\n",
                cores);
}

void json_row(std::FILE* f, const config& cfg, const measurement& m, unsigned cores) {
  if (!f) return;
  auto object = [](const per_category& v) {
    std::string s = "{";
    for (int k = 0; k <= total_index; ++k) s += cat(k ? "," : "", "\"", column_name(k), "\":", std::size_t(v[k]));
    return s + "}";
  };
  std::string steps = "[";
  for (const auto& t : m.steps) steps += cat(steps.size() > 1 ? "," : "", t.wall_s);
  std::fprintf(f,
               "{\"bench\":\"strategies\",\"model\":\"%s\",\"vocab\":%ld,\"strategy\":\"%s\",\"world\":%d,\"group\":%d,\"cores\":%u,"
               "\"oversubscribed\":%s,\"layers\":%ld,\"d_model\":%ld,\"heads\":%ld,\"ff\":%ld,\"seq\":%ld,"
               "\"batch\":%ld,\"classes\":%ld,\"dropout\":%g,\"frozen_layers\":%ld,\"freeze\":\"%s\",\"lora\":\"%s\","
               "\"lora_r\":%ld,\"frozen_grads\":%s,\"prefetch\":%d,\"keep_gathered\":%ld,\"reshard_to\":%d,"
               "\"grad_accum\":%ld,\"no_sync\":%s,\"reshard_after_backward\":%s,\"replica_all_reduce\":%s,"
               "\"steps\":%zu,"
               "\"units\":%zu,"
               "\"padded_params\":%zu,\"step_s\":%.9g,\"cpu_s\":%.9g,\"sys_s\":%.9g,\"minor_faults\":%.9g,"
               "\"step_times_s\":%s],\"peak_bytes\":%s,\"formula_bytes\":%s,\"sent_bytes\":%.9g,"
               "\"sent_formula_bytes\":%.9g,\"sent_by\":{\"all_gather\":%.9g,\"reduce_scatter\":%.9g,"
               "\"all_reduce\":%.9g,\"broadcast\":%.9g}}\n",
               cfg.model_name.c_str(), cfg.model_name == "gpt2" ? cfg.vocab : 0L, m.strategy.c_str(), m.world, m.group, cores, unsigned(m.world) > cores ? "true" : "false",
               cfg.model.layers, cfg.model.d_model, cfg.model.heads, cfg.model.ff, cfg.model.seq, cfg.batch,
               cfg.model.classes, cfg.model.dropout, cfg.frozen_layers, joined(cfg.freeze).c_str(), joined(cfg.lora).c_str(),
               cfg.lora.empty() ? 0L : cfg.lora_r, cfg.no_frozen_grads ? "false" : "true", cfg.prefetch,
               cfg.keep_gathered, cfg.reshard_to, cfg.grad_accum, cfg.no_sync ? "true" : "false",
               cfg.no_reshard_after_backward ? "false" : "true", cfg.no_replica_all_reduce ? "false" : "true",
               m.steps.size(), m.units, m.psi, m.median(&step_sample::wall_s), m.median(&step_sample::cpu_s),
               m.median(&step_sample::sys_s), m.median(&step_sample::faults), steps.c_str(), object(m.peak).c_str(),
               object(m.formula).c_str(), m.sent, m.sent_formula,
               m.sent_by[0], m.sent_by[1], m.sent_by[2], m.sent_by[3]);
  std::fflush(f);
}

// Other work on a shared machine slows every run; the load average says how much there was.
void print_load(const char* when) {
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) std::printf("# load average at %s: %.2f %.2f %.2f\n", when, load[0], load[1], load[2]);
}

config parse(int argc, char** argv) {
  config c;
  // --article's sizes are the defaults that single size flags override, in any order.
  bool article = std::find(argv + 1, argv + argc, std::string_view("--article")) != argv + argc;
  if (article) c.model = {.layers = 6, .d_model = 512, .heads = 8, .ff = 2048, .seq = 10};
  std::string json;
  example::command_line cli("Every sharding strategy training a transformer classifier on W rank threads: step "
                            "time, per-rank memory and bytes sent per step, beside their formulas.",
                            "bench_strategies");
  cli.add_option("--worlds", c.worlds, "world sizes, comma-separated")
      ->delimiter(',')
      ->check(example::whole(1, example::max_thread_ranks));
  cli.add_option("--strategies", c.strategies, "strategies, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"full", "grad-op", "optimizer", "none", "hybrid"}));
  cli.add_option("--model", c.model_name, "the model trained")->check(CLI::IsMember({"encoder", "gpt2"}));
  cli.add_option("--vocab", c.vocab, "gpt2: vocabulary size")->check(example::whole(1, example::max_size));
  cli.add_flag("--article", article, "the FSDP article's sizes (6 layers, d_model 512, 8 heads, ff 2048, seq 10)");
  example::add_model_flags(cli, c.model);
  cli.add_option("--batch", c.batch, "sequences per rank and step")->check(example::whole(1, example::max_size));
  cli.add_option("--prefetch", c.prefetch, "units gathered ahead")->check(example::whole(0, example::max_size));
  cli.add_option("--group", c.group, "HybridShard's group (where it divides W)")
      ->check(example::whole(1, example::max_thread_ranks));
  // At least one warm-up step: it records the unit order.
  cli.add_option("--warmup", c.warmup, "warm-up steps")->check(example::whole(1, example::max_size));
  cli.add_option("--steps", c.steps, "measured steps")->check(example::whole(1, example::max_size));
  cli.add_option("--rounds", c.rounds, "runs of each strategy")->check(example::whole(1, example::max_size));
  cli.add_option("--frozen-layers", c.frozen_layers,
                 "a fine-tune: the lower N layers frozen (gpt2: the embeddings too, a frozen prefix)")
      ->check(example::whole(0, example::max_size));
  cli.add_option("--freeze", c.freeze, "parameters frozen by name: nn::freeze's globs, e.g. 'transformer.h.*.attn.*'")
      ->delimiter(',');
  cli.add_option("--lora", c.lora, "gpt2: a LoRA fine-tune, adapters on the projections these name "
                 "(nn::add_lora, e.g. c_attn,c_fc), everything else frozen")
      ->delimiter(',');
  cli.add_option("--lora-r", c.lora_r, "--lora: the adapters' rank")->check(example::whole(1, 4096));
  cli.add_flag("--no-frozen-grads", c.no_frozen_grads, "with --frozen-layers, --freeze or --lora: backward keeps "
               "no gradients of frozen parameters (shard::options::frozen_grads = false)");
  cli.add_option("--keep-gathered", c.keep_gathered, "the last N layers' units stay gathered from their forward to "
                 "their backward (shard::options::keep_gathered)")
      ->check(example::whole(0, example::max_size));
  cli.add_option("--reshard-to", c.reshard_to, "FullShard and HybridShard keep 1/R of each unit's full values from "
                 "forward to backward, gathered again within groups of R ranks (shard::policy::reshard_to); run where "
                 "R divides their shard group")
      ->check(example::whole(1, 1 << 16));
  example::add_accumulation_flags(cli, c, true);
  cli.add_option("--json", json, "appends one JSON line per strategy and world size");
  cli.callback([&] {
    example::check_model_flags(c.model);
    example::check_accumulation_flags(c);
    if (c.keep_gathered > c.model.layers)
      throw CLI::ValidationError("--keep-gathered",
                                 cat(c.keep_gathered, " is more than the model's ", c.model.layers, " layers"));
    if (c.no_frozen_grads && c.frozen_layers == 0 && c.freeze.empty() && c.lora.empty())
      throw CLI::ValidationError("--no-frozen-grads", "nothing is frozen (--frozen-layers, --freeze, --lora)");
    if (c.frozen_layers > c.model.layers)
      throw CLI::ValidationError("--frozen-layers",
                                 cat(c.frozen_layers, " is more than the model's ", c.model.layers, " layers"));
    for (const auto& [flag, names] : {std::pair{"--freeze", &c.freeze}, std::pair{"--lora", &c.lora}})
      for (const auto& g : *names)
        if (g.find_first_of("\"\\") != std::string::npos)
          throw CLI::ValidationError(flag, cat("'", g, "' holds a quote or a backslash, which no name does"));
    if (c.lora.empty()) return;
    if (c.model_name != "gpt2") throw CLI::ValidationError("--lora", "adapts GPT-2's projections (--model gpt2)");
    try {
      (void)gpt2_workload{c}.make();
    } catch (const error& e) {
      throw CLI::ValidationError("--lora", e.what());
    }
  });
  cli.parse_or_exit(argc, argv);
  if (!json.empty()) c.json = std::fopen(json.c_str(), "a");
  return c;
}

// The model's line of the header.
void print_model(const encoder_workload& work) {
  const config& cfg = work.cfg;
  auto probe = work.make();
  std::printf("# bench_strategies: transformer classifier, %ld encoder layers (d_model %ld, %ld heads, ff %ld), "
              "mean pool, Linear head: %zu parameters\n"
              "# per-rank batch %ld x seq %ld, %ld classes, dropout %g; Adam; fp32; each encoder layer a unit, ",
              cfg.model.layers, cfg.model.d_model, cfg.model.heads, cfg.model.ff, nn::parameter_count(probe),
              cfg.batch, cfg.model.seq, cfg.model.classes, cfg.model.dropout);
  if (cfg.frozen_layers > 0) std::printf("the lower %ld layers frozen, ", cfg.frozen_layers);
  if (!cfg.freeze.empty()) std::printf("frozen: %s, ", joined(cfg.freeze).c_str());
}
void print_model(const gpt2_workload& work) {
  const config& cfg = work.cfg;
  auto probe = work.make();
  std::printf("# bench_strategies: GPT2LMHeadModel, %ld blocks (n_embd %ld, %ld heads, n_inner %ld), vocabulary %ld, "
              "tied head: %zu parameters\n"
              "# per-rank batch %ld x seq %ld, next-token cross-entropy on random ids, dropout %g; AdamW; fp32; "
              "each GPT2Block a unit, ",
              cfg.model.layers, cfg.model.d_model, cfg.model.heads, cfg.model.ff, cfg.vocab, nn::parameter_count(probe), cfg.batch, cfg.model.seq, cfg.model.dropout);
  if (cfg.frozen_layers > 0) std::printf("the embeddings and the lower %ld blocks frozen (forward only), ", cfg.frozen_layers);
  if (!cfg.freeze.empty()) std::printf("frozen: %s, ", joined(cfg.freeze).c_str());
  if (!cfg.lora.empty()) std::printf("LoRA r %ld on %s (the rest frozen), ", cfg.lora_r, joined(cfg.lora).c_str());
  if (cfg.no_frozen_grads) std::printf("no gradients of frozen parameters, ");
}

template <class Workload>
void measure_all(const Workload& work, unsigned cores) {
  const config& cfg = work.cfg;
  print_model(work);
  if (cfg.keep_gathered > 0) std::printf("the last %ld units kept gathered after forward, ", cfg.keep_gathered);
  if (cfg.reshard_to > 0) std::printf("FullShard and HybridShard resharded to %d ranks after forward, ", cfg.reshard_to);
  if (cfg.grad_accum > 1) std::printf("%s, ", example::accumulation_note(cfg).c_str());
  std::printf("prefetch %d; %d warm-up + %d measured steps, %d rounds\n"
              "# ranks are threads (ThreadComm) on %u hardware threads; step = median over steps of the slowest "
              "rank's train_step, pooled over rounds\n",
              cfg.prefetch, cfg.warmup, cfg.steps, cfg.rounds, cores);
  print_load("start");
  // results[s][j]: strategy s at world size worlds[j]; empty where it does not apply
  std::vector<std::vector<measurement>> results(cfg.strategies.size(), std::vector<measurement>(cfg.worlds.size()));
  for (std::size_t j = 0; j < cfg.worlds.size(); ++j)
    for (int round = 0; round < cfg.rounds; ++round)
      for (std::size_t s = 0; s < cfg.strategies.size(); ++s)
        with_strategy(cfg.strategies[s], cfg, cfg.worlds[j], [&](auto strategy) {
          auto m = in_fresh_process([&] { return run(work, cfg.worlds[j], strategy); });
          m.strategy = std::string(strategy.name);
          std::fprintf(stderr, "bench_strategies: %s W=%d round %d: %.1f ms/step\n", m.strategy.c_str(), m.world,
                       round + 1, m.median(&step_sample::wall_s) * 1e3);
          m.steps.insert(m.steps.begin(), results[s][j].steps.begin(), results[s][j].steps.end());
          results[s][j] = std::move(m);
        });
  std::vector<measurement> all;
  for (auto& row : results)
    for (auto& m : row)
      if (!m.steps.empty()) {
        json_row(cfg.json, cfg, m, cores);
        all.push_back(std::move(m));
      }
  print_tables(all, cores);
  print_load("end");
}

}  // namespace

int main(int argc, char** argv) {
  const config cfg = parse(argc, argv);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  try {
    if (cfg.model_name == "gpt2") measure_all(gpt2_workload{cfg}, cores);
    else measure_all(encoder_workload{cfg}, cores);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_strategies: %s\n", e.what());
    return 1;
  }
  if (cfg.json) std::fclose(cfg.json);
  return 0;
}
