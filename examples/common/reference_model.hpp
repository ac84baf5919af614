// examples/common/reference_model.hpp — the FSDP article's classifier, sized by flags,
// in any element type and memory space (float on the host; bfloat16 on a GPU).
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/core/memory_space.hpp>
#include <shardlib/nn/freeze.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>

#include <string>
#include <vector>

#include "flags.hpp"
#include "synthetic.hpp"

namespace example {

template <class T, class Space = shardlib::host_space>
using EncoderOf = shardlib::nn::TransformerEncoderLayer<T, Space>;
template <class T, class Space = shardlib::host_space>
using ModelOf = shardlib::nn::Sequential<shardlib::nn::Stack<EncoderOf<T, Space>>, shardlib::nn::MeanPool<T, Space>,
                                         shardlib::nn::Linear<T, Space>>;
using Encoder = EncoderOf<float>;
using Model = ModelOf<float>;

// m.layers encoder layers of width m.d_model (m.heads, m.ff, m.dropout), batch-first,
// mean-pooled over the sequence, and a Linear head to m.classes.
template <class T = float, class Space = shardlib::host_space>
ModelOf<T, Space> reference_model(const model_flags& m) {
  namespace nn = shardlib::nn;
  return ModelOf<T, Space>{nn::Stack<EncoderOf<T, Space>>(std::size_t(m.layers), {.d_model = m.d_model,
                                                                                 .nhead = m.heads,
                                                                                 .dim_feedforward = m.ff,
                                                                                 .dropout = m.dropout,
                                                                                 .batch_first = true}),
                           nn::MeanPool<T, Space>(1), nn::Linear<T, Space>(m.d_model, m.classes)};
}

// A fine-tune of it: the lower n encoder layers frozen (the stack is the model's child 0).
template <class T, class Space>
void freeze_lower_layers(ModelOf<T, Space>& model, long n) {
  std::vector<std::string> globs;
  for (long k = 0; k < n; ++k) globs.push_back(shardlib::cat("0.layers.", k, ".*"));
  shardlib::nn::freeze(model, globs);
}

// The synthetic task the model learns: m.seq tokens of width m.d_model, m.classes classes.
inline synthetic_task task_for(const model_flags& m) { return {.seq = m.seq, .d = m.d_model, .classes = m.classes}; }

}  // namespace example
