// examples/common/text_corpus.hpp — the training data of the language-model examples
// (train_gpt, train_gpt_cuda) as token ids: a text file's bytes (a byte-level model,
// vocabulary 256) or llm.c's token files (GPT-2's or LLaMA 3's tokens, written by its
// dev/data scripts, one shard or many, mapped from the files rather than read into
// memory); the split into training and held-out tokens, the unigram entropy to beat, the
// training windows each step draws, and windows of ids and next-token targets.
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>     // open
#include <sys/mman.h>  // mmap, munmap
#include <sys/stat.h>  // fstat
#include <unistd.h>    // close

#include "common/token_decoder.hpp"

namespace example {

// A run of token ids stored `width` bytes each: a text's bytes (1) or a token file's
// uint16 (2) or uint32 (4) ids.
struct token_run {
  const unsigned char* data = nullptr;
  std::size_t size = 0;
  unsigned width = 1;

  std::uint32_t operator[](std::size_t i) const {
    if (width == 1) return data[i];
    if (width == 2) {
      std::uint16_t t;
      std::memcpy(&t, data + 2 * i, 2);
      return t;
    }
    std::uint32_t t;
    std::memcpy(&t, data + 4 * i, 4);
    return t;
  }
  token_run sub(std::size_t from, std::size_t n) const { return {data + from * width, n, width}; }
};

// Runs read as one sequence, except that a window never crosses from one run into the next.
struct token_runs {
  std::vector<token_run> runs;

  std::size_t size() const {
    std::size_t n = 0;
    for (const auto& r : runs) n += r.size;
    return n;
  }
  // Where windows of `seq` tokens and their next-token targets may start, counted over all
  // runs: size - seq - 1 in each run long enough (one fewer than fit: the rule the examples'
  // batches were drawn by before there were runs, kept so that a text's batches stay the same).
  std::size_t positions(long seq) const {
    std::size_t n = 0;
    for (const auto& r : runs) n += r.size > std::size_t(seq) + 1 ? r.size - std::size_t(seq) - 1 : 0;
    return n;
  }
  // The run and offset of window start `p` (of positions(seq)).
  std::pair<const token_run*, std::size_t> window(std::size_t p, long seq) const {
    for (const auto& r : runs) {
      const std::size_t here = r.size > std::size_t(seq) + 1 ? r.size - std::size_t(seq) - 1 : 0;
      if (p < here) return {&r, p};
      p -= here;
    }
    throw shardlib::error(shardlib::cat("token_runs: window start past the ", positions(seq), " positions"));
  }
  // The i-th token, counted over all runs.
  std::uint32_t operator[](std::size_t i) const {
    for (const auto& r : runs) {
      if (i < r.size) return r[i];
      i -= r.size;
    }
    throw shardlib::error(shardlib::cat("token_runs: token ", i, " past the end"));
  }
  // The first id at or above `v` and where, and with `tally` how often each id below it
  // occurs: one pass, each run read at its own width. (The vocabulary check and the entropy
  // were two passes with a width test per token: 2.8 ns per token of a 200M-token GPT-2
  // file, 1.3 now.)
  struct id_counts {
    std::vector<std::uint64_t> low;                               // ids below min(v, 2^24)
    std::unordered_map<std::uint32_t, std::uint64_t> high;        // the rest below v (a vast --vocab)
    std::optional<std::pair<std::size_t, std::uint32_t>> outside;  // (token, id) of the first at or above v
  };
  id_counts count_ids(std::int64_t v, bool tally_ids = true) const {
    id_counts c;
    const std::uint64_t limit = std::uint64_t(v), low = tally_ids ? std::min<std::uint64_t>(limit, 1u << 24) : 0;
    c.low.assign(low, 0);
    std::size_t before = 0;  // tokens in the runs before this one
    const auto tally = [&]<class T>(const token_run& r, T) {
      for (std::size_t i = 0; i < r.size; ++i) {
        T t;
        std::memcpy(&t, r.data + i * sizeof(T), sizeof(T));
        if (t < low) ++c.low[t];
        else if (t >= limit) {
          if (!c.outside) c.outside = {before + i, t};
        } else if (tally_ids) {
          ++c.high[t];
        }
      }
    };
    for (const auto& r : runs) {
      if (r.width == 1) tally(r, std::uint8_t{});
      else if (r.width == 2) tally(r, std::uint16_t{});
      else tally(r, std::uint32_t{});
      before += r.size;
    }
    return c;
  }
};

// A file mapped read-only, unmapped with it (a member, so a constructor that throws after
// mapping unmaps too).
class mapped_file {
 public:
  mapped_file() = default;
  // The whole of `path`, a regular file of at least `least` bytes (else what it is, naming it).
  mapped_file(const std::string& path, std::size_t least, const std::string& too_short) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    shardlib::require(fd >= 0, "cannot read ", path);
    struct stat st {};
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    bytes_ = regular ? std::size_t(st.st_size) : 0;
    void* p = regular && bytes_ >= least ? ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    ::close(fd);
    shardlib::require(regular, path, " is not a regular file");
    shardlib::require(bytes_ >= least, path, ": ", bytes_, too_short);
    shardlib::require(p != MAP_FAILED, "cannot map ", path);
    data_ = static_cast<const unsigned char*>(p);
  }
  mapped_file(mapped_file&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  mapped_file& operator=(mapped_file&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~mapped_file() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), bytes_);
  }
  const unsigned char* data() const { return data_; }
  std::size_t size() const { return bytes_; }

 private:
  const unsigned char* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// llm.c's token file (dev/data/data_common.py), mapped read-only: 256 little-endian int32
// of header (magic, version, token count), then the tokens: GPT-2's as uint16, LLaMA 3's
// as uint32.
class token_file {
 public:
  const char* format = "";  // "GPT-2" or "LLaMA 3"
  std::int64_t vocab = 0;   // that tokenizer's vocabulary: 50257 or 128256

  explicit token_file(const std::string& path)
      : map_(path, header, " bytes, less than the 1024-byte header of llm.c's token files") {
    const std::size_t bytes = map_.size();
    std::int32_t h[3];
    std::memcpy(h, map_.data(), sizeof h);
    unsigned width = 0;
    if (h[0] == 20240520 && h[1] == 1) {
      width = 2, format = "GPT-2", vocab = 50257;
    } else if (h[0] == 20240801 && h[1] == 7) {
      width = 4, format = "LLaMA 3", vocab = 128256;
    } else {
      throw shardlib::error(shardlib::cat(path, ": magic ", h[0], " version ", h[1],
                                          " is not an llm.c token file's (20240520 version 1: GPT-2's uint16 "
                                          "tokens; 20240801 version 7: LLaMA 3's uint32 tokens)"));
    }
    shardlib::require(h[2] >= 0 && bytes - header == std::size_t(h[2]) * width, path, ": the header says ", h[2],
                      " tokens (", std::size_t(std::max(h[2], 0)) * width, " bytes) but ", bytes - header,
                      " bytes follow it");
    tokens_ = {map_.data() + header, std::size_t(h[2]), width};
  }

  const token_run& tokens() const { return tokens_; }

 private:
  static constexpr std::size_t header = 256 * 4;
  mapped_file map_;
  token_run tokens_;
};

// The data as token ids, split into training runs and held-out runs (the tail, or files of
// their own). Move-only: the runs point into what it holds.
class corpus {
 public:
  token_runs train, val;
  std::string source;        // what was read, for the report
  bool bytes = true;         // a text, a token per byte
  std::int64_t vocab = 256;  // the vocabulary the data implies (--vocab may widen it)
  std::optional<token_decoder> tokenizer;  // --tokenizer: how token ids print as text

  corpus() = default;
  corpus(corpus&&) = default;
  corpus(const corpus&) = delete;

  const char* unit() const { return bytes ? "byte" : "token"; }

  // A text file's bytes; the last `val_fraction` held out.
  static corpus text(const std::string& path, double val_fraction, long seq) {
    std::ifstream in(path, std::ios::binary);
    shardlib::require(bool(in), "cannot read --data ", path);
    corpus c;
    c.text_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    c.source = path;
    c.split({{c.text_.data(), c.text_.size(), 1}}, val_fraction);
    c.fit(path, seq, held_out(val_fraction));
    return c;
  }

  // llm.c's token files, all of one format: `files` in turn, held out from `val_files` or,
  // when there are none, the last `val_fraction` of them.
  static corpus tokens(const std::vector<std::string>& files, const std::vector<std::string>& val_files,
                       double val_fraction, long seq) {
    corpus c;
    c.bytes = false;
    std::vector<token_run> head, tail;
    for (const auto& f : files) head.push_back(c.open(f));
    for (const auto& f : val_files) tail.push_back(c.open(f));
    const auto named = [](const std::vector<std::string>& f) {
      return f.size() == 1 ? f[0] : shardlib::cat(f[0], " and ", f.size() - 1, " more");
    };
    c.source = shardlib::cat(named(files), " (", c.files_[0].format, " tokens");
    if (val_files.empty()) {
      c.split(std::move(head), val_fraction);
      c.source += ")";
      c.fit(named(files), seq, held_out(val_fraction));
    } else {
      c.train.runs = std::move(head);
      c.val.runs = std::move(tail);
      c.source += shardlib::cat(", held out: ", named(val_files), ")");
      c.fit(named(files) + " and " + named(val_files), seq, "");
    }
    return c;
  }

  // Every id below the model's vocabulary `v`, else which is not, and where. Counts the
  // training ids on the way, for unigram_entropy.
  void check_vocab(std::int64_t v) {
    for (const auto* part : {&train, &val}) {
      auto counts = part->count_ids(v, part == &train);
      shardlib::require(!counts.outside, source, ": ", part == &train ? "training" : "held-out", " token ",
                        counts.outside ? counts.outside->first : 0, " is ", counts.outside ? counts.outside->second : 0,
                        ", outside the model's vocabulary of ", v, " (--vocab, or --init's config)");
      if (part == &train) train_counts_ = std::move(counts);
    }
  }

  // H = -sum p(t) ln p(t) over the training tokens, in nats: the loss of the best model
  // that ignores context, what "learned something" must beat.
  // Over the ids below the vocabulary checked (check_vocab), else the data's own.
  double unigram_entropy() const {
    const token_runs::id_counts counts = train_counts_ ? token_runs::id_counts{} : train.count_ids(vocab);
    const token_runs::id_counts& c = train_counts_ ? *train_counts_ : counts;
    const double n = double(train.size());
    double h = 0;
    const auto add = [&](std::uint64_t k) {
      if (k > 0) h -= double(k) / n * std::log(double(k) / n);
    };
    for (const std::uint64_t k : c.low) add(k);
    for (const auto& [id, k] : c.high) add(k);
    return h;
  }

 private:
  std::vector<unsigned char> text_;  // a text's bytes
  std::vector<token_file> files_;    // the mapped token files
  std::string first_;                // the first file's path
  std::optional<token_runs::id_counts> train_counts_;  // check_vocab's, kept for unigram_entropy

  static std::string held_out(double f) { return shardlib::cat(" at --val-fraction ", f); }
  token_run open(const std::string& path) {
    if (files_.empty()) first_ = path;
    files_.emplace_back(path);
    shardlib::require(std::string(files_.back().format) == files_[0].format, path, " holds ", files_.back().format,
                      " tokens and ", first_, " ", files_[0].format, " tokens");
    vocab = files_[0].vocab;
    return files_.back().tokens();
  }
  // The last `val_fraction` of `all`'s tokens held out, the rest trained on.
  void split(std::vector<token_run> all, double val_fraction) {
    std::size_t total = 0;
    for (const auto& r : all) total += r.size;
    std::size_t tail = std::size_t(double(total) * val_fraction);
    while (tail > 0) {
      token_run& last = all.back();
      const std::size_t n = std::min(tail, last.size);
      val.runs.insert(val.runs.begin(), last.sub(last.size - n, n));
      last.size -= n;
      tail -= n;
      if (last.size == 0) all.pop_back();
    }
    train.runs = std::move(all);
  }
  void fit(const std::string& what, long seq, const std::string& how) const {
    shardlib::require(train.positions(seq) > 0 && val.positions(seq) > 0, what, " (", train.size() + val.size(), " ",
                      unit(), "s) is too short for training and held-out windows of --seq ", seq, " + 1 ", unit(), "s",
                      how);
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

// ids = the `seq` tokens from window start p (of runs.positions(seq)), targets = the tokens
// after them, for each start.
inline std::pair<shardlib::Tensor<std::int64_t>, shardlib::Tensor<std::int64_t>> windows(
    const token_runs& runs, const std::vector<std::size_t>& starts, long seq) {
  const auto n = std::int64_t(starts.size());
  shardlib::Tensor<std::int64_t> ids({n, seq}), targets({n, seq});
  for (std::int64_t i = 0; i < n; ++i) {
    const auto [run, at] = runs.window(starts[std::size_t(i)], seq);
    for (long t = 0; t < seq; ++t) {
      ids[i * seq + t] = (*run)[at + std::size_t(t)];
      targets[i * seq + t] = (*run)[at + std::size_t(t) + 1];
    }
  }
  return {ids, targets};
}

}  // namespace example
