// examples/common/text_corpus.hpp — the training data of the language-model examples
// (train_gpt, train_gpt_cuda) as token ids: a text file's bytes (a byte-level model,
// vocabulary 256) or llm.c's token files (GPT-2's or LLaMA 3's tokens, written by its
// dev/data scripts); the split into training and held-out tokens, the unigram entropy to
// beat, the training windows each step draws, and windows of ids and next-token targets.
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>

#include "common/llmc_tokenizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace example {

// llm.c's token file (dev/data/data_common.py): 256 little-endian int32 of header (magic,
// version, token count), then the tokens: GPT-2's as uint16, LLaMA 3's as uint32.
struct token_file {
  std::vector<std::uint32_t> tokens;
  const char* format = "";  // "GPT-2" or "LLaMA 3"
  std::int64_t vocab = 0;   // that tokenizer's vocabulary: 50257 or 128256

  explicit token_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    shardlib::require(bool(in), "cannot read ", path);
    constexpr std::size_t header = 256 * 4;
    in.seekg(0, std::ios::end);
    const auto size = std::size_t(in.tellg());
    in.seekg(0);
    shardlib::require(size >= header, path, ": ", size, " bytes, less than the 1024-byte header of llm.c's token files");
    std::int32_t h[256];
    in.read(reinterpret_cast<char*>(h), header);
    std::size_t width = 0;
    if (h[0] == 20240520 && h[1] == 1) {
      width = 2, format = "GPT-2", vocab = 50257;
    } else if (h[0] == 20240801 && h[1] == 7) {
      width = 4, format = "LLaMA 3", vocab = 128256;
    } else {
      throw shardlib::error(shardlib::cat(path, ": magic ", h[0], " version ", h[1],
                                          " is not an llm.c token file's (20240520 version 1: GPT-2's uint16 "
                                          "tokens; 20240801 version 7: LLaMA 3's uint32 tokens)"));
    }
    shardlib::require(h[2] >= 0 && size - header == std::size_t(h[2]) * width, path, ": the header says ", h[2],
                      " tokens (", std::size_t(std::max(h[2], 0)) * width, " bytes) but ", size - header,
                      " bytes follow it");
    tokens.resize(std::size_t(h[2]));
    if (width == 4) {
      in.read(reinterpret_cast<char*>(tokens.data()), std::streamsize(4 * tokens.size()));
    } else {
      std::vector<std::uint16_t> narrow(tokens.size());
      in.read(reinterpret_cast<char*>(narrow.data()), std::streamsize(2 * narrow.size()));
      std::copy(narrow.begin(), narrow.end(), tokens.begin());
    }
    shardlib::require(bool(in), "cannot read ", path, "'s ", h[2], " tokens");
  }
};

// The data as token ids, split into a training head and a held-out tail (or a held-out file).
struct corpus {
  std::vector<std::uint32_t> train, val;
  std::string source;        // what was read, for the report
  bool bytes = true;         // a text, a token per byte
  std::int64_t vocab = 256;  // the vocabulary the data implies (--vocab may widen it)
  std::optional<llmc_tokenizer> tokenizer;  // --tokenizer: how token ids print as text

  const char* unit() const { return bytes ? "byte" : "token"; }

  // A text file's bytes; the last `val_fraction` held out.
  static corpus text(const std::string& path, double val_fraction, long seq) {
    std::ifstream in(path, std::ios::binary);
    shardlib::require(bool(in), "cannot read --data ", path);
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::vector<std::uint32_t> ids(text.size());
    std::transform(text.begin(), text.end(), ids.begin(), [](char ch) { return static_cast<unsigned char>(ch); });
    corpus c;
    c.source = path;
    c.split(std::move(ids), val_fraction);
    c.fit(path, seq, cat_fraction(val_fraction));
    return c;
  }

  // llm.c token files: `path`'s tokens, held out from `val_path` (a file of the same
  // format) or, when that is empty, the last `val_fraction` of them.
  static corpus tokens(const std::string& path, const std::string& val_path, double val_fraction, long seq) {
    token_file head(path);
    corpus c;
    c.bytes = false;
    c.vocab = head.vocab;
    c.source = shardlib::cat(path, " (", head.format, " tokens");
    if (val_path.empty()) {
      c.split(std::move(head.tokens), val_fraction);
      c.source += ")";
      c.fit(path, seq, cat_fraction(val_fraction));
      return c;
    }
    token_file tail(val_path);
    shardlib::require(std::string(tail.format) == head.format, val_path, " holds ", tail.format, " tokens and ", path,
                      " ", head.format, " tokens");
    c.train = std::move(head.tokens);
    c.val = std::move(tail.tokens);
    c.source += shardlib::cat(", held out: ", val_path, ")");
    c.fit(path + " and " + val_path, seq, "");
    return c;
  }

  // Every id below the model's vocabulary `v`, else which is not, and where.
  void check_vocab(std::int64_t v) const {
    for (const auto* part : {&train, &val}) {
      const auto at = std::find_if(part->begin(), part->end(), [&](std::uint32_t t) { return std::int64_t(t) >= v; });
      shardlib::require(at == part->end(), source, ": ", part == &train ? "training" : "held-out", " token ",
                        at - part->begin(), " is ", at == part->end() ? 0 : *at, ", outside the model's vocabulary of ",
                        v, " (--vocab, or --init's config)");
    }
  }

  // H = -sum p(t) ln p(t) over the training tokens, in nats: the loss of the best model
  // that ignores context, what "learned something" must beat.
  double unigram_entropy() const {
    std::vector<double> count(static_cast<std::size_t>(vocab));
    for (std::uint32_t t : train)
      if (t < count.size()) count[t] += 1;
    double h = 0;
    for (double n : count)
      if (n > 0) h -= n / double(train.size()) * std::log(n / double(train.size()));
    return h;
  }

 private:
  static std::string cat_fraction(double f) { return shardlib::cat(" at --val-fraction ", f); }
  void split(std::vector<std::uint32_t> all, double val_fraction) {
    const auto tail = std::size_t(double(all.size()) * val_fraction);
    val.assign(all.end() - std::ptrdiff_t(tail), all.end());
    all.resize(all.size() - tail);
    train = std::move(all);
  }
  void fit(const std::string& what, long seq, const std::string& how) const {
    shardlib::require(train.size() > std::size_t(seq + 1) && val.size() > std::size_t(seq + 1), what, " (",
                      train.size() + val.size(), " ", unit(), "s) is too short for training and held-out windows of --seq ",
                      seq, " + 1 ", unit(), "s", how);
  }
};

// Where the `batch` training windows of micro-batch `micro` (of `micro_batches`) of a step
// start on a rank, drawn by their place in the step's windows: a step's micro-batches take
// the windows one batch of batch x micro_batches sequences would.
inline std::vector<std::size_t> step_starts(const shardlib::counter_rng& draws, long step, int world, int rank,
                                            long batch, long micro_batches, long micro, std::size_t positions) {
  std::vector<std::size_t> starts;
  const long first = ((step * world + rank) * micro_batches + micro) * batch;
  for (long i = 0; i < batch; ++i)
    starts.push_back(std::size_t(draws.uniform_double(std::uint64_t(first + i)) * double(positions)));
  return starts;
}

// ids = tokens[start, start + seq), targets = the tokens after them, for each start.
inline std::pair<shardlib::Tensor<std::int64_t>, shardlib::Tensor<std::int64_t>> windows(
    std::span<const std::uint32_t> tokens, const std::vector<std::size_t>& starts, long seq) {
  const auto n = std::int64_t(starts.size());
  shardlib::Tensor<std::int64_t> ids({n, seq}), targets({n, seq});
  for (std::int64_t i = 0; i < n; ++i)
    for (long t = 0; t < seq; ++t) {
      ids[i * seq + t] = tokens[starts[std::size_t(i)] + std::size_t(t)];
      targets[i * seq + t] = tokens[starts[std::size_t(i)] + std::size_t(t) + 1];
    }
  return {ids, targets};
}

}  // namespace example
