// examples/common/text_corpus.hpp — a text file as training bytes for the byte-level
// language-model examples (train_gpt, train_gpt_cuda): the split into a training head and
// a held-out tail, the unigram entropy to beat, the training windows each step draws, and
// windows of ids and next-byte targets.
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace example {

// The text as bytes, split into a training head and a held-out tail.
struct corpus {
  std::string train, val;

  corpus(const std::string& path, double val_fraction, long seq) {
    std::ifstream in(path, std::ios::binary);
    shardlib::require(bool(in), "cannot read --data ", path);
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const auto tail = std::size_t(double(text.size()) * val_fraction);
    train = text.substr(0, text.size() - tail);
    val = text.substr(text.size() - tail);
    shardlib::require(train.size() > std::size_t(seq + 1) && val.size() > std::size_t(seq + 1), path, " (",
                      text.size(), " bytes) is too short for training and held-out windows of --seq ", seq,
                      " + 1 bytes at --val-fraction ", val_fraction);
  }

  // H = -sum p(b) ln p(b) over the training bytes, in nats: the loss of the best
  // model that ignores context, what "learned something" must beat.
  double unigram_entropy() const {
    std::array<double, 256> count{};
    for (unsigned char b : train) count[b] += 1;
    double h = 0;
    for (double c : count)
      if (c > 0) h -= c / double(train.size()) * std::log(c / double(train.size()));
    return h;
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

// ids = text[start, start + seq), targets = the bytes after them, for each start.
inline std::pair<shardlib::Tensor<std::int64_t>, shardlib::Tensor<std::int64_t>> windows(
    const std::string& text, const std::vector<std::size_t>& starts, long seq) {
  const auto n = std::int64_t(starts.size());
  shardlib::Tensor<std::int64_t> ids({n, seq}), targets({n, seq});
  for (std::int64_t i = 0; i < n; ++i)
    for (long t = 0; t < seq; ++t) {
      ids[i * seq + t] = static_cast<unsigned char>(text[starts[std::size_t(i)] + std::size_t(t)]);
      targets[i * seq + t] = static_cast<unsigned char>(text[starts[std::size_t(i)] + std::size_t(t) + 1]);
    }
  return {ids, targets};
}

}  // namespace example
