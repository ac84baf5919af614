// examples/common/reference_model.hpp — the FSDP article's classifier, sized by flags,
// in any element type and memory space (float on the host; bfloat16 on a GPU).
#pragma once
#include <shardlib/core/memory_space.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>

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

// --layers encoder layers of width task.d (--heads, --ff, --dropout), batch-first,
// mean-pooled over the sequence, and a Linear head to task.classes.
template <class T = float, class Space = shardlib::host_space>
ModelOf<T, Space> reference_model(const flags& f, const synthetic_task& task) {
  namespace nn = shardlib::nn;
  return ModelOf<T, Space>{nn::Stack<EncoderOf<T, Space>>(std::size_t(f.num("layers")),
                                                          {.d_model = task.d,
                                                           .nhead = f.num("heads"),
                                                           .dim_feedforward = f.num("ff"),
                                                           .dropout = f.real("dropout"),
                                                           .batch_first = true}),
                           nn::MeanPool<T, Space>(1), nn::Linear<T, Space>(task.d, task.classes)};
}

}  // namespace example
