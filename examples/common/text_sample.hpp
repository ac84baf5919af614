// examples/common/text_sample.hpp — the continuation the language-model examples
// (train_gpt, train_gpt_cuda) sample at the end: its flags, its prompt (the held-out
// text's first paragraph, or the first held-out tokens), its options and its printout
// (text, or token ids: the examples have no tokenizer).
#pragma once
#include <shardlib/core/tensor.hpp>
#include <shardlib/models/causal_lm.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "common/flags.hpp"
#include "common/text_corpus.hpp"

namespace example {

struct sample_settings {
  long sample = 96, top_k = 8;  // tokens (bytes) to generate (0: none); the k most likely drawn from
  double temperature = 0.8, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
};

inline void add_sample_flags(command_line& cli, sample_settings& s) {
  cli.add_option("--sample", s.sample, "bytes (tokens) to generate at the end (at most --seq minus the prompt; 0: no sample)")
      ->check(whole(0, max_size));
  cli.add_option("--top-k", s.top_k, "sample among the k most likely bytes (tokens; 1 = greedy)")
      ->check(whole(1, max_size));
  cli.add_option("--temperature", s.temperature, "divides the logits before sampling")->check(positive(100));
  cli.add_option("--top-p", s.top_p, "then sample among the most likely bytes (tokens) whose probabilities reach p")
      ->check(positive(1));
  cli.add_option("--min-p", s.min_p, "then drop bytes (tokens) less likely than min_p times the most likely (0: off)")
      ->check(real(0, 1));
  cli.add_option("--repetition-penalty", s.repetition_penalty,
                 "divides the logits of bytes (tokens) already in the text (multiplies negative ones; 1: off)")
      ->check(positive(100));
}

// The first min(32, seq / 2) tokens of the held-out text's first paragraph (or of the
// held-out tokens, where it has none that long, or they are not text), as ids [1, len]:
// half the context at least is left for the continuation.
inline shardlib::Tensor<std::int64_t> sample_prompt(const corpus& data, long seq) {
  const auto len = std::size_t(std::min<long>(32, seq / 2));
  const std::size_t n = data.val.size();
  std::size_t from = 0;
  if (data.bytes)
    for (std::size_t i = 0; i + 2 + len <= n; ++i)
      if (data.val[i] == '\n' && data.val[i + 1] == '\n') {
        from = i + 2;
        break;
      }
  shardlib::Tensor<std::int64_t> prompt({1, std::int64_t(len)});
  for (std::size_t t = 0; t < len; ++t) prompt[std::int64_t(t)] = data.val[from + t];
  return prompt;
}

// As many new tokens as --sample asks and the context leaves after the prompt.
inline shardlib::models::generate_options sample_options(const sample_settings& s, long prompt_len, long seq,
                                                        std::uint64_t seed) {
  return {.max_new_tokens = std::min(s.sample, seq - prompt_len),
          .top_k = s.top_k,
          .temperature = s.temperature,
          .top_p = s.top_p,
          .min_p = s.min_p,
          .repetition_penalty = s.repetition_penalty,
          .seed = seed};
}

// The sample as generate makes it, printed by one rank: the header and the prompt first, each
// new token as it comes (generate_options::on_tokens, through std::ref; flushed), the
// closing line at end(). Text decodes through --tokenizer; a byte above 255 prints as <id>,
// ids without a tokenizer separated by spaces.
class sample_printer {
 public:
  sample_printer(const char* program, const sample_settings& s, const corpus& data,
                 const shardlib::Tensor<std::int64_t>& prompt, bool printing)
      : data_(data), printing_(printing) {
    if (!printing_) return;
    std::printf("%s: sample (top-%ld, temperature %.2f, top-p %.2f, min-p %.2f, repetition penalty %.2f)%s\n--- "
                "prompt ---\n",
                program, s.top_k, s.temperature, s.top_p, s.min_p, s.repetition_penalty,
                data.bytes ? "" : data.tokenizer ? ", decoded by --tokenizer" : ", token ids");
    const std::vector<std::int64_t> ids(prompt.data(), prompt.data() + prompt.numel());
    std::printf("%s\n--- continuation ---\n", text(ids, true, true).c_str());
    std::fflush(stdout);
  }
  void operator()(std::span<const std::int64_t> ids, std::int64_t) {
    if (!printing_ || ids.empty()) return;
    std::fputs(text({ids[0]}, false, first_).c_str(), stdout);
    std::fflush(stdout);
    first_ = false;
  }
  void end() const {
    if (printing_) std::printf("\n---\n");
  }

 private:
  const corpus& data_;
  bool printing_, first_ = true;  // first_: the continuation's first token is to come

  // `prompt`: the ids begin the text; `leading`: they begin the prompt's or the continuation's line.
  std::string text(const std::vector<std::int64_t>& ids, bool prompt, bool leading) const {
    if (data_.tokenizer) return data_.tokenizer->decode(ids, prompt);
    std::string to;
    for (std::int64_t id : ids)
      if (data_.bytes && id < 256) to += char(id);
      else to += shardlib::cat(data_.bytes || (to.empty() && leading) ? "" : " ", data_.bytes ? "<" : "", id,
                               data_.bytes ? ">" : "");
    return to;
  }
};

}  // namespace example
