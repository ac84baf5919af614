// shardlib/nn/lora.hpp — LoRALinear: a frozen Linear plus a trained low-rank update,
// y = x W^T + b + s (x A^T) B^T (LoRA; Hugging Face PEFT's lora.Linear).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/saved_input.hpp"
#include "shardlib/ops/gemm.hpp"

#include <algorithm>    // std::fill_n
#include <cmath>        // std::sqrt
#include <cstdint>      // std::int64_t
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::pair
#include <vector>       // std::vector

namespace shardlib::nn {

// PEFT's LoraConfig fields that shape one adapter (its defaults; lora_dropout 0).
struct lora_options {
  std::int64_t r = 8;     // the update's rank
  double alpha = 8;       // lora_alpha: the update is scaled by alpha / r
  bool rslora = false;    // use_rslora: scaled by alpha / sqrt(r) instead
  bool bias = true;       // the base layer's bias
};

namespace detail {
// C = alpha op(A) op(B) + beta C, row-major, in Space: the host's here (alpha and beta
// rounded to T, as ops::gemm takes them), the device's (to float) in nn/cuda/lora.cuh.
template <class Space>
struct lora_product;

template <>
struct lora_product<host_space> {
  template <class T>
  static void run(ops::trans ta, ops::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                  const T* a, std::int64_t lda, const T* b, std::int64_t ldb, double beta, T* c, std::int64_t ldc) {
    ops::gemm(ta, tb, m, n, k, T(alpha), a, lda, b, ldb, T(beta), c, ldc);
  }
  template <class T>
  static void zero(T* x, std::int64_t n) {
    std::fill_n(x, n, T(0));
  }
};
}  // namespace detail

// base_layer: a Linear whose weight and bias are frozen at construction (PEFT freezes
// them; set requires_grad back to train them too). lora_A [r, in] starts as a Linear's
// weight does (kaiming_uniform, a = sqrt(5)), lora_B [out, r] at zero, so a new adapter
// changes nothing; their names are PEFT's in its saved adapters (base_layer.weight,
// lora_A.weight, lora_B.weight). Under fully_shard the base layer's frozen weight is
// neither stepped nor given optimizer state, and a unit holding it and the adapter
// reduces and keeps the adapter's gradients alone (docs/design.md, "Frozen parameters").
// Space: host_space here; cuda_space with nn/cuda/lora.cuh.
template <class T, class Space = host_space>
class LoRALinear {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;

  LoRALinear(std::int64_t in_features, std::int64_t out_features, lora_options o = {})
      : base_layer(in_features, out_features, o.bias), o_(o) {
    require<shape_error>(o.r >= 1 && in_features >= 1 && out_features >= 1, "LoRALinear(", in_features, " -> ",
                         out_features, "): rank r must be at least 1 and the features positive, got r = ", o.r);
    base_layer.weight.requires_grad = false;
    base_layer.bias.requires_grad = false;
    lora_A.shape = Shape{o.r, in_features};
    lora_A.init = init_rule::linear_default(in_features);
    lora_B.shape = Shape{out_features, o.r};
    lora_B.init = init_rule::constant_zero();
  }

  Linear<T, Space> base_layer;
  Param<T> lora_A, lora_B;

  std::int64_t in_features() const { return base_layer.in_features(); }
  std::int64_t out_features() const { return base_layer.out_features(); }
  std::int64_t rank() const { return o_.r; }
  // alpha / r, or alpha / sqrt(r) with rslora (PEFT's scaling).
  double scaling() const { return o_.alpha / (o_.rslora ? std::sqrt(double(o_.r)) : double(o_.r)); }

  template <class V>
  void children(V&& v) {
    v("base_layer", base_layer);
  }
  template <class V>
  void parameters(V&& v) {
    visit_parameters("base_layer", base_layer, v);
    v("lora_A.weight", lora_A);
    v("lora_B.weight", lora_B);
  }

  // Folds the update into the base weight, W += s B A, and sets lora_B to zero: the
  // layer computes what it did (up to W's rounding) from its base alone, PEFT's merge
  // followed by a fresh adapter (a base checkpoint saved now holds the fine-tune). On
  // bound values: a Replicated owner's, or inside a sharded model's summon_full_params
  // (writeback), between steps. The optimizer's state for lora_A and lora_B stays: with
  // it the next step moves lora_B off zero at once (a fresh adapter wants fresh state).
  void merge() {
    for (const Param<T>* p : {&base_layer.weight, &lora_A, &lora_B}) p->require_bound("LoRALinear::merge");
    product::run(ops::trans::no, ops::trans::no, out_features(), in_features(), o_.r, scaling(), lora_B.value, o_.r,
                 lora_A.value, in_features(), 1.0, base_layer.weight.value, in_features());
    product::zero(lora_B.value, out_features() * o_.r);
  }

  // Keeps x (for lora_A's gradient) and x A^T (for lora_B's) only when a backward
  // follows and that adapter matrix trains.
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    output y = ctx.forward(base_layer, x);
    lora_A.require_bound("LoRALinear");
    lora_B.require_bound("LoRALinear");
    const std::int64_t rows = x.numel() / in_features(), r = o_.r, out = out_features(), in = in_features();
    output h(Shape{rows, r});
    product::run(ops::trans::no, ops::trans::yes, rows, r, in, 1.0, x.data(), in, lora_A.value, in, 0.0, h.data(),
                 r);  // h = x A^T
    product::run(ops::trans::no, ops::trans::yes, rows, out, r, scaling(), h.data(), r, lora_B.value, r, 1.0,
                 y.data(), out);  // y += s h B^T
    x_.save(ctx, x, lora_A.requires_grad);
    h_.save(ctx, h, lora_B.requires_grad);
    return y;
  }

  // A frozen lora_A or lora_B gets no gradient, as a frozen Linear weight does.
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    x_.require(lora_A.requires_grad, "LoRALinear lora_A");
    h_.require(lora_B.requires_grad, "LoRALinear lora_B");
    lora_A.require_bound("LoRALinear", lora_A.requires_grad);
    lora_B.require_bound("LoRALinear", lora_B.requires_grad);
    input dx = ctx.backward(base_layer, dy);  // checks dy against the last forward
    const std::int64_t rows = x_.numel() / in_features(), r = o_.r, out = out_features(), in = in_features();
    const double s = scaling();
    output dh(Shape{rows, r});
    product::run(ops::trans::no, ops::trans::no, rows, r, out, s, dy.data(), out, lora_B.value, r, 0.0, dh.data(),
                 r);  // dh = s dy B
    if (lora_B.requires_grad)
      product::run(ops::trans::yes, ops::trans::no, out, r, rows, s, dy.data(), out, h_.values().data(), r, 1.0,
                   lora_B.grad, r);  // dB += s dy^T h
    if (lora_A.requires_grad)
      product::run(ops::trans::yes, ops::trans::no, r, in, rows, 1.0, dh.data(), r, x_.values().data(), in, 1.0,
                   lora_A.grad, in);  // dA += dh^T x
    product::run(ops::trans::no, ops::trans::no, rows, in, r, 1.0, dh.data(), r, lora_A.value, in, 1.0, dx.data(),
                 in);  // dx += dh A
    x_.clear();
    h_.clear();
    return dx;
  }

 private:
  using product = detail::lora_product<Space>;
  lora_options o_;
  saved_input<input> x_, h_;
};

// {file name, model name} for every base-layer parameter of the LoRA adapters in
// `model`: the names the base model's checkpoint holds them under ("attn.q.weight" for
// the model's "attn.q.base_layer.weight"). With io::name_map::table and strict = false a
// base checkpoint loads into the adapted model, the adapters reported missing (they keep
// their initial values), as PEFT wraps a loaded base model.
template <Layer L>
std::vector<std::pair<std::string, std::string>> peft_base_names(L& model) {
  std::vector<std::pair<std::string, std::string>> pairs;
  model.parameters([&](std::string_view name, auto&) {
    for (std::string_view leaf : {"base_layer.weight", "base_layer.bias"}) {  // a LoRALinear's own names
      if (!name.ends_with(leaf)) continue;
      const std::size_t at = name.size() - leaf.size();
      if (at == 0 || name[at - 1] == '.')
        pairs.emplace_back(cat(name.substr(0, at), leaf.substr(leaf.find('.') + 1)), std::string(name));
    }
  });
  return pairs;
}

}  // namespace shardlib::nn
