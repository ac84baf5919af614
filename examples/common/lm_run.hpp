// examples/common/lm_run.hpp — what train_gpt and train_gpt_cuda share beyond the model's
// shape: the data (a text, or llm.c's token files), the batches, steps and reports, AdamW's
// learning-rate schedule and weight decay, the seed; their flags, their checks, the
// schedule they make and the data they read.
#pragma once
#include <shardlib/optim/schedule.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <glob.h>  // glob

#include "common/flags.hpp"
#include "common/text_corpus.hpp"

namespace example {

struct lm_run_settings {
  std::string data = "/usr/share/common-licenses/GPL-3";
  std::vector<std::string> tokens, val_tokens;  // --tokens, --val-tokens: llm.c's token files instead of --data
  std::string tokenizer;           // --tokenizer: llm.c's or Hugging Face's, to print samples as text
  long batch = 4, steps = 500, every = 25, eval_every = 100, warmup = 30;
  double lr = 3e-3, weight_decay = 0.1, val_fraction = 0.1;
  double min_lr = 0;  // --min-lr; unset: a tenth of lr
  std::uint64_t seed = 0;
};

inline void add_lm_run_flags(command_line& cli, lm_run_settings& s) {
  const CLI::Validator size = whole(1, max_size);
  auto* data = cli.add_option("--data", s.data, "the text to train on, a token per byte")->check(CLI::ExistingFile);
  auto* tokens = cli.add_option("--tokens", s.tokens,
                                "train on llm.c's token files instead (dev/data's .bin shards, or a quoted pattern "
                                "such as 'fineweb_train_*.bin': GPT-2's uint16 or LLaMA 3's uint32 tokens, mapped "
                                "from the files; --vocab defaults to that tokenizer's)")
                     ->excludes(data);
  cli.add_option("--batch", s.batch, "sequences per rank and step (and micro-batch, with --grad-accum)")->check(size);
  cli.add_option("--steps", s.steps, "training steps")->check(size);
  cli.add_option("--every", s.every, "print the loss every this many steps")->check(size);
  cli.add_option("--eval-every", s.eval_every, "validation loss every this many steps")->check(size);
  cli.add_option("--warmup", s.warmup, "linear warmup steps")->check(whole(0, max_size));
  cli.add_option("--lr", s.lr, "peak learning rate")->check(positive());
  cli.add_option("--min-lr", s.min_lr, "learning rate at the end of the cosine decay (default: a tenth of --lr)")
      ->check(real(0, 1));
  cli.add_option("--weight-decay", s.weight_decay, "AdamW's decoupled weight decay")->check(real(0, 1));
  auto* fraction = cli.add_option("--val-fraction", s.val_fraction, "the held-out tail's share of the data")
                       ->check(real(0.01, 0.5));
  cli.add_option("--val-tokens", s.val_tokens, "--tokens: held-out tokens from these files (or a quoted pattern) "
                 "instead of the tail")
      ->needs(tokens)
      ->excludes(fraction);
  cli.add_option("--tokenizer", s.tokenizer,
                 "--tokens: llm.c's tokenizer file (gpt2_tokenizer.bin) or a Hugging Face tokenizer.json, to "
                 "print the sample as text")
      ->check(CLI::ExistingFile)
      ->needs(tokens);
  cli.add_option("--seed", s.seed, "seed of the initialization, the batches and the sample")
      ->check(whole(0, std::numeric_limits<long long>::max()));
}

// In the parse's callback: --min-lr's default, and a decay that does not climb.
inline void check_lm_run(const CLI::App& cli, lm_run_settings& s) {
  if (cli.count("--min-lr") == 0) s.min_lr = s.lr / 10;
  if (s.min_lr > s.lr)
    throw CLI::ValidationError("--min-lr", std::to_string(s.min_lr) + " is above --lr " + std::to_string(s.lr) +
                                               " (the cosine decay would climb)");
}

// The files a flag names: each path as given, or a pattern with *, ? or [ in sorted order
// of its matches (llm.c's shards: 'fineweb_train_*.bin').
inline std::vector<std::string> expand_patterns(const std::vector<std::string>& given, const char* flag) {
  std::vector<std::string> files;
  for (const auto& g : given) {
    if (g.find_first_of("*?[") == std::string::npos || std::filesystem::exists(g)) {  // a path, even with [ in it
      files.push_back(g);
      continue;
    }
    glob_t found{};
    const int rc = ::glob(g.c_str(), 0, nullptr, &found);
    for (std::size_t i = 0; rc == 0 && i < found.gl_pathc; ++i) files.emplace_back(found.gl_pathv[i]);
    ::globfree(&found);
    shardlib::require(rc != GLOB_NOMATCH, flag, " ", g, " matches no file");
    shardlib::require(rc == 0, flag, " ", g, ": the pattern could not be read (glob error ", rc, ")");
  }
  return files;
}

// The data the flags name, for windows of `seq` tokens, with --tokenizer's pieces.
inline corpus read_corpus(const lm_run_settings& s, long seq) {
  if (s.tokens.empty()) return corpus::text(s.data, s.val_fraction, seq);
  corpus c = corpus::tokens(expand_patterns(s.tokens, "--tokens"), expand_patterns(s.val_tokens, "--val-tokens"),
                            s.val_fraction, seq);
  if (!s.tokenizer.empty()) c.tokenizer = token_decoder::read(s.tokenizer);
  return c;
}

// Linear warmup (at most the whole run), then cosine decay to --min-lr at the last step.
inline shardlib::optim::warmup_cosine lr_schedule(const lm_run_settings& s) {
  return {.peak_lr = s.lr, .min_lr = s.min_lr, .warmup_steps = std::min(s.warmup, s.steps), .total_steps = s.steps};
}

}  // namespace example
