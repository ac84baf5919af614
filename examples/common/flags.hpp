// examples/common/flags.hpp — command-line flags for the examples, benchmarks and tools, on
// CLI11: typed values checked against their ranges, a generated --help, and every bad flag an
// exit with status 2 and a message that names it.
#pragma once
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

namespace example {

// Ranks as threads of one process (ThreadComm), each with a communication worker beside it.
// Each thread's stack takes memory mappings, of which Linux allows 65530 a process by default:
// some ten thousand ranks exhaust them (std::thread throws, and the process aborts, as
// --world 40000 did). 1024 stays well below, and above the cores of any machine this runs on.
inline constexpr long max_thread_ranks = 1024;
// Layer widths, layer counts, sequence lengths, batches, classes: up to 2^20 each, so that a
// tensor's element count (a product of three) stays far inside int64.
inline constexpr long max_size = 1L << 20;

// A whole number in [lo, hi], in plain decimal. CLI11's own conversion (strtoll with base 0)
// reads "010" as 8 and "0x10" as 16, clamps what overflows, and reads "-1" into an unsigned
// value as 2^64 - 1.
inline CLI::Validator whole(long long lo, long long hi) {
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return {[=](const std::string& s) -> std::string {
            long long v = 0;
            const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
            const bool number = end == s.data() + s.size() && (ec == std::errc::result_out_of_range ||
                                                               (ec == std::errc{} && std::to_string(v) == s));
            if (!number) return "expected a decimal whole number, got '" + s + "'";
            if (ec != std::errc{} || v < lo || v > hi) return s + " is outside " + range;
            return {};
          },
          range};
}

namespace detail {
// A finite number in [lo, hi], or (lo, hi] when `above_lo`; `range` names them in messages.
inline CLI::Validator finite(double lo, double hi, bool above_lo, const std::string& range) {
  return {[=](const std::string& s) -> std::string {
            double v = 0;
            const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
            if (end != s.data() + s.size() || ec != std::errc{} || !std::isfinite(v))
              return "expected a finite number, got '" + s + "'";
            if (v < lo || (above_lo && v == lo) || v > hi) return s + " is outside " + range;
            return {};
          },
          range};
}
}  // namespace detail

// A finite number in [lo, hi]; CLI::Range lets "nan" through, and "inf" where hi is infinite.
inline CLI::Validator real(double lo, double hi) {
  std::ostringstream range;
  range << "[" << lo << ", " << hi << "]";
  return detail::finite(lo, hi, false, range.str());
}
// A finite number above 0 and at most hi (CLI::PositiveNumber lets "inf" and "nan" through).
inline CLI::Validator positive(double hi = std::numeric_limits<double>::max()) {
  std::ostringstream range;
  if (hi == std::numeric_limits<double>::max()) range << "(0, inf)";
  else range << "(0, " << hi << "]";
  return detail::finite(0, hi, true, range.str());
}

// A CLI::App whose --help shows each option's default, and whose parse_or_exit ends the
// process on --help or a bad flag.
class command_line : public CLI::App {
 public:
  command_line(std::string description, std::string name) : CLI::App(std::move(description), std::move(name)) {
    option_defaults()->always_capture_default();
  }

  // --help prints the generated help and exits with status 0; a bad flag (unknown, without its
  // value, malformed, out of range, or failing a check between flags that a callback throws as
  // CLI::ValidationError) prints what is wrong with it, naming it, and exits with status 2, the
  // usage error of Unix tools.
  void parse_or_exit(int argc, const char* const* argv) {
    try {
      parse(argc, argv);
    } catch (const CLI::Success& e) {
      std::exit(exit(e));
    } catch (const CLI::ParseError& e) {
      exit(e);
      std::exit(2);
    }
  }
};

// The reference model's sizes (reference_model.hpp), and its synthetic task's.
struct model_flags {
  long layers = 6, d_model = 512, heads = 8, ff = 2048, classes = 10, seq = 10;
  double dropout = 0.1;
};

// --layers, --d-model, --heads, --ff, --classes, --seq and --dropout, defaulting to m's values.
inline void add_model_flags(CLI::App& app, model_flags& m) {
  const CLI::Validator size = whole(1, max_size);
  app.add_option("--layers", m.layers, "encoder layers")->check(size);
  app.add_option("--d-model", m.d_model, "model width")->check(size);
  app.add_option("--heads", m.heads, "attention heads (divides --d-model)")->check(size);
  app.add_option("--ff", m.ff, "feed-forward width")->check(size);
  app.add_option("--classes", m.classes, "classes of the synthetic task")->check(size);
  app.add_option("--seq", m.seq, "tokens per sequence")->check(size);
  app.add_option("--dropout", m.dropout, "dropout probability")->check(real(0, 1));
}

// What the model's layers require of those flags together; for a callback of the application.
inline void check_model_flags(const model_flags& m) {
  if (m.d_model % m.heads != 0)
    throw CLI::ValidationError("--heads", std::to_string(m.heads) + " does not divide --d-model " +
                                              std::to_string(m.d_model));
}

// Gradient accumulation: --grad-accum K makes a step train_step over K micro-batches of
// --batch sequences per rank; --no-sync and --no-reshard-after-backward say how those before
// the last run (shard::step_options::no_sync, reshard_after_backward = false).
struct accumulation_flags {
  long grad_accum = 1;
  bool no_sync = false, no_reshard_after_backward = false;
  bool no_replica_all_reduce = false;  // HybridShard (step_options::replica_all_reduce = false)
};
// What train_loop (training.hpp) runs, and train_reference.
struct train_flags {
  long steps = 100, batch = 8, every = 10;
  double lr = 1e-3;
  std::uint64_t seed = 0;
  std::string out = "model.safetensors", metrics;  // train_loop's outputs
  accumulation_flags accumulation{};                // train_loop's micro-batches (add_accumulation_flags)
};

// --steps, --batch, --every, --lr, --seed, defaulting to t's values; with `outputs`, --out and
// --metrics too.
inline void add_train_flags(CLI::App& app, train_flags& t, bool outputs = true) {
  app.add_option("--steps", t.steps, "training steps")->check(whole(1, std::numeric_limits<int>::max()));
  app.add_option("--batch", t.batch, "sequences per rank and step")->check(whole(1, max_size));
  app.add_option("--every", t.every, "print the loss every this many steps")->check(whole(1, max_size));
  app.add_option("--lr", t.lr, "Adam's learning rate")->check(positive());
  app.add_option("--seed", t.seed, "seed of the parameters' initialization and dropout")
      ->check(whole(0, std::numeric_limits<long long>::max()));
  if (!outputs) return;
  app.add_option("--out", t.out, "the trained model, as safetensors");
  app.add_option("--metrics", t.metrics, "one JSON line per step and rank (loss, tokens/s, peak memory)");
}

// The flags (--no-replica-all-reduce only for a program that can run HybridShard); returns
// --grad-accum's option (the others need it).
inline CLI::Option* add_accumulation_flags(CLI::App& app, accumulation_flags& a, bool hybrid = false) {
  auto* accum = app.add_option("--grad-accum", a.grad_accum,
                               "micro-batches of --batch sequences per rank, accumulated into each step")
                    ->check(whole(1, max_size));
  app.add_flag("--no-sync", a.no_sync,
               "the micro-batches before the last keep their gradients unreduced; the last reduces them all "
               "(step_options::no_sync; FSDP2's set_requires_gradient_sync(False))")
      ->needs(accum);
  app.add_flag("--no-reshard-after-backward", a.no_reshard_after_backward,
               "the micro-batches before the last keep every unit gathered after its backward, so the next forward "
               "gathers none (step_options::reshard_after_backward = false; FSDP2's set_reshard_after_backward)")
      ->needs(accum);
  if (!hybrid) return accum;
  app.add_flag("--no-replica-all-reduce", a.no_replica_all_reduce,
               "HybridShard: the micro-batches before the last reduce within the shard group only; the last "
               "averages across the replicas what they all reduced (step_options::replica_all_reduce = false; "
               "FSDP2's set_requires_all_reduce(False))")
      ->needs(accum);
  return accum;
}
// For the programs' first lines: "" (one micro-batch), or "K micro-batches per step each
// reduced" and how those before the last run.
inline std::string accumulation_note(const accumulation_flags& a) {
  if (a.grad_accum == 1) return "";
  return std::to_string(a.grad_accum) + " micro-batches per step" + (a.no_sync ? " reduced once" : " each reduced") +
         (a.no_reshard_after_backward ? ", kept gathered between them" : "") +
         (a.no_replica_all_reduce ? ", replicas averaged once" : "");
}

// --no-sync and --no-reshard-after-backward shape the micro-batches before the last: one
// micro-batch per step has none.
inline void check_accumulation_flags(const accumulation_flags& a) {
  if (a.grad_accum > 1) return;
  for (const auto& [flag, given] :
       {std::pair{"--no-sync", a.no_sync}, std::pair{"--no-reshard-after-backward", a.no_reshard_after_backward},
        std::pair{"--no-replica-all-reduce", a.no_replica_all_reduce}})
    if (given) throw CLI::ValidationError(flag, "one micro-batch per step (--grad-accum 1) has none before the last");
}

}  // namespace example
