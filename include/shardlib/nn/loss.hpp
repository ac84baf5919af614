// shardlib/nn/loss.hpp — losses: cross-entropy and mean squared error, each
// returning its value and its gradient with respect to the model's output.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/pending.hpp"
#include "shardlib/core/tensor.hpp"

#include <algorithm>    // std::count_if, std::fill, std::max
#include <cmath>        // std::exp, std::log
#include <concepts>     // std::convertible_to
#include <cstdint>      // std::int64_t
#include <limits>       // std::numeric_limits
#include <type_traits>  // std::conditional_t, std::is_same_v

namespace shardlib::nn {

// Losses are not layers: they take targets, and start backward. Each is a small
// callable object: `nn::cross_entropy(logits, targets)` uses torch's defaults,
// and `nn::cross_entropy_loss{{.ignore_index = 0, .label_smoothing = 0.1}}` (or
// `nn::squared_error_loss{{.reduction = nn::loss_reduction::sum}}`) sets options;
// either can be passed wherever a loss callable is expected.
//
// On the device (cuda_space, with nn/cuda/loss.cuh) the gradient stays in device
// memory and so does the loss, computed in float there: a pending<float>, read
// (one wait for the thread's current stream at the call) when the caller reads
// it. A bad target is found on the device too and raised when the loss is read.
template <class T, class Space = host_space>
struct loss_result {
  std::conditional_t<std::is_same_v<Space, host_space>, T, pending<float>> loss;
  Tensor<T, Space> grad;  // dloss/d(model output), the shape of the output
};

enum class loss_reduction { mean, sum };

// torch.nn.functional.cross_entropy's options, in its order.
struct cross_entropy_options {
  std::int64_t ignore_index = -100;                 // targets equal to it give neither loss nor gradient
  loss_reduction reduction = loss_reduction::mean;  // mean: over the rows not ignored, as torch
  double label_smoothing = 0.0;                     // in [0, 1)
};

namespace detail {
// cross_entropy_loss's computation over checked arguments, for tensors in
// Space: the host's here, the device's in nn/cuda/loss.cuh.
template <class Space>
struct cross_entropy_rows;
}  // namespace detail

// A loss whose value is a mean over items it can count from the targets alone, before
// any forward: what train_step's shard::loss_mean::per_item weighs micro-batches and
// ranks by. items(target) must be the count the loss divides by.
template <class L, class Target>
concept counts_items = requires(const L& l, const Target& t) {
  { l.items(t) } -> std::convertible_to<std::int64_t>;
};

// Classes are the last dimension: logits [..., C] are N = numel / C rows, and
// targets (class indices) have the leading shape [...] or are flattened to [N].
// (torch puts C second for rank > 2 inputs; shardlib models emit [..., C].)
// A language model's token-level loss is this call as it stands: logits
// [batch, seq, vocab], targets [batch, seq] holding the next token, or -100 (the
// default ignore_index) at padding and after the last token; the mean is over
// the tokens not ignored.
//
// Per row, with log-probabilities lp = log_softmax(z) computed as z - logsumexp(z)
// (stable), target y and smoothing e over C classes
// (https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html):
//   loss = (1 - e) * -lp[y] + (e / C) * sum_c -lp[c]
//   dloss/dz[c] = softmax(z)[c] - (1 - e) [c == y] - e / C.
// The mean divides by the number of rows not ignored; with none it is NaN (0/0),
// as torch's, and the gradient is zero: such a batch adds nothing to the
// gradients, and the NaN in the log says it had no tokens rather than a loss of 0.
struct cross_entropy_loss {
  cross_entropy_options options{};

  template <class T, class Space>
  loss_result<T, Space> operator()(const Tensor<T, Space>& logits, const Tensor<std::int64_t, Space>& targets) const {
    const auto& o = options;
    require(o.label_smoothing >= 0 && o.label_smoothing < 1, "cross_entropy: label_smoothing must be in [0, 1), got ",
            o.label_smoothing);
    require<shape_error>(logits.rank() >= 1 && logits.dim(logits.rank() - 1) > 0,
                         "cross_entropy: logits must be [..., C] with C > 0 classes, got shape ", logits.shape());
    const std::int64_t classes = logits.dim(logits.rank() - 1), rows = logits.numel() / classes;
    const Shape leading(logits.shape().extents().first(std::size_t(logits.rank() - 1)));
    require<shape_error>(targets.numel() == rows && (targets.shape() == leading || targets.shape() == Shape{rows}),
                         "cross_entropy: targets must have the logits' leading shape ", leading, " or be [", rows,
                         "] for logits ", logits.shape(), ", got shape ", targets.shape());
    return detail::cross_entropy_rows<Space>::compute(o, logits, targets, rows, classes);
  }
  // The rows its mean is over: targets not equal to ignore_index (on a device, counted
  // there and read: one wait). A sum is a mean over no count: refused.
  template <class Space>
  std::int64_t items(const Tensor<std::int64_t, Space>& targets) const {
    require(options.reduction == loss_reduction::mean, "cross_entropy: items() counts the rows a mean is over; with "
            "reduction sum the loss is no mean (shard::loss_mean::per_item needs reduction mean)");
    return detail::cross_entropy_rows<Space>::items(options, targets);
  }
};
inline constexpr cross_entropy_loss cross_entropy{};

namespace detail {
template <>
struct cross_entropy_rows<host_space> {
  template <class T>
  static loss_result<T> compute(const cross_entropy_options& o, const Tensor<T>& logits,
                                const Tensor<std::int64_t>& targets, std::int64_t rows, std::int64_t classes) {
    const T e = T(o.label_smoothing), off = e / T(classes);  // off: each class's share of the smoothing
    Tensor<T> grad(logits.shape());
    double total = 0;  // accumulated in double: N can be large
    std::int64_t counted = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* z = logits.data() + r * classes;
      T* g = grad.data() + r * classes;
      const std::int64_t y = targets[r];
      if (y == o.ignore_index) {
        std::fill(g, g + classes, T(0));
        continue;
      }
      if (y < 0 || y >= classes)
        throw shape_error(cat("cross_entropy: target ", y, " in row ", r, " is out of range for ", classes,
                              " classes (ignore_index is ", o.ignore_index, ")"));
      T m = z[0];
      for (std::int64_t c = 1; c < classes; ++c) m = std::max(m, z[c]);
      T s = 0;
      for (std::int64_t c = 0; c < classes; ++c) s += std::exp(z[c] - m);
      const T lse = m + std::log(s);
      T sum_lp = 0;
      for (std::int64_t c = 0; c < classes; ++c) {
        sum_lp += z[c] - lse;
        g[c] = std::exp(z[c] - lse) - off;
      }
      g[y] -= T(1) - e;
      // Without smoothing the term is absent, not 0 * sum_lp: a -inf logit makes sum_lp -inf.
      total += double((T(1) - e) * (lse - z[y]) - (e > 0 ? off * sum_lp : T(0)));
      ++counted;
    }
    if (o.reduction == loss_reduction::sum) return {T(total), grad};
    if (counted == 0) return {std::numeric_limits<T>::quiet_NaN(), grad};
    const T scale = T(1) / T(counted);
    for (std::int64_t i = 0; i < grad.numel(); ++i) grad[i] *= scale;
    return {T(total / double(counted)), grad};
  }
  static std::int64_t items(const cross_entropy_options& o, const Tensor<std::int64_t>& targets) {
    return std::int64_t(std::count_if(targets.data(), targets.data() + targets.numel(),
                                      [&](std::int64_t y) { return y != o.ignore_index; }));
  }
};
}  // namespace detail

struct squared_error_options {
  loss_reduction reduction = loss_reduction::mean;  // mean: over all elements
};

// torch.nn.MSELoss: sum or mean of (input - target)^2 over all elements; the
// gradient is 2 (input - target), divided by the count for the mean.
struct squared_error_loss {
  squared_error_options options{};

  template <class T>
  loss_result<T> operator()(const Tensor<T>& input, const Tensor<T>& target) const {
    require<shape_error>(input.shape() == target.shape(), "mse_loss: input and target must have the same shape, got ",
                         input.shape(), " and ", target.shape());
    const std::int64_t n = input.numel();
    const T scale = options.reduction == loss_reduction::mean ? T(1) / T(n) : T(1);
    Tensor<T> grad(input.shape());
    double total = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const T d = input[i] - target[i];
      total += double(d * d);
      grad[i] = T(2) * d * scale;
    }
    return {T(options.reduction == loss_reduction::mean ? total / double(n) : total), grad};
  }
  // The elements its mean is over; a sum is refused, as cross_entropy_loss::items.
  template <class T>
  std::int64_t items(const Tensor<T>& target) const {
    require(options.reduction == loss_reduction::mean, "mse_loss: items() counts the elements a mean is over; with "
            "reduction sum the loss is no mean (shard::loss_mean::per_item needs reduction mean)");
    return target.numel();
  }
};
inline constexpr squared_error_loss mse_loss{};

}  // namespace shardlib::nn
