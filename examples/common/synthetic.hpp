// examples/common/synthetic.hpp — a deterministic classification task a transformer can learn.
#pragma once
#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>

#include <cstdint>

namespace example {

// Sequences of `seq` tokens of width `d`: Gaussian noise plus a class pattern
// (a fixed random +-`signal` vector per class) on every token. Mean pooling over
// the sequence averages the noise away, so the class is learnable; with noise of
// unit variance per element the task starts at the chance loss ln(classes).
// Sample i of the whole data set depends only on (seed, i), so any rank can
// produce any slice of a global batch.
struct synthetic_task {
  std::int64_t seq = 10, d = 512, classes = 10;
  double signal = 0.5;
  std::uint64_t seed = 1;

  std::int64_t label(std::int64_t sample) const {
    return std::int64_t(shardlib::counter_rng(seed, 1).bits(std::uint64_t(sample))[0] % std::uint64_t(classes));
  }
  // Rows [first, first + count) of the data set, batch-first [count, seq, d].
  shardlib::Tensor<float> inputs(std::int64_t first, std::int64_t count) const {
    shardlib::Tensor<float> x({count, seq, d});
    const shardlib::counter_rng noise(seed, 2), pattern(seed, 3);
    for (std::int64_t b = 0; b < count; ++b) {
      const std::int64_t c = label(first + b);
      for (std::int64_t t = 0; t < seq; ++t)
        for (std::int64_t k = 0; k < d; ++k) {
          const std::uint64_t i = std::uint64_t(((first + b) * seq + t) * d + k);
          const float sign = (pattern.bits(std::uint64_t(c * d + k))[0] & 1) ? 1.f : -1.f;
          x[(b * seq + t) * d + k] = float(noise.normal(i)) + float(signal) * sign;
        }
    }
    return x;
  }
  shardlib::Tensor<std::int64_t> labels(std::int64_t first, std::int64_t count) const {
    shardlib::Tensor<std::int64_t> y({count});
    for (std::int64_t b = 0; b < count; ++b) y[b] = label(first + b);
    return y;
  }
};

}  // namespace example
