// examples/common/reference_model.hpp — the FSDP article's classifier, sized by flags.
#pragma once
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>

#include "flags.hpp"
#include "synthetic.hpp"

namespace example {

using Encoder = shardlib::nn::TransformerEncoderLayer<float>;
using Model = shardlib::nn::Sequential<shardlib::nn::Stack<Encoder>, shardlib::nn::MeanPool<float>,
                                       shardlib::nn::Linear<float>>;

// --layers encoder layers of width task.d (--heads, --ff, --dropout), batch-first,
// mean-pooled over the sequence, and a Linear head to task.classes.
inline Model reference_model(const flags& f, const synthetic_task& task) {
  namespace nn = shardlib::nn;
  return Model{nn::Stack<Encoder>(std::size_t(f.num("layers")), {.d_model = task.d,
                                                                 .nhead = f.num("heads"),
                                                                 .dim_feedforward = f.num("ff"),
                                                                 .dropout = f.real("dropout"),
                                                                 .batch_first = true}),
               nn::MeanPool<float>(1), nn::Linear<float>(task.d, task.classes)};
}

}  // namespace example
