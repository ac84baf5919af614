// shardlib/nn/tied_linear.hpp — TiedLinear: y = x W^T with W borrowed from another
// layer (GPT-2's lm_head reading the token embedding), and the BorrowsParameters
// concept the sharding engine checks ties with.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/gemm.hpp"

#include <concepts>     // std::convertible_to
#include <cstdint>      // std::int64_t
#include <string_view>  // std::string_view

namespace shardlib::nn {

// What borrowed_parameters(v) calls: v(name, Param<T>* source), null when untied.
struct borrow_visitor_archetype {
  template <class T>
  void operator()(std::string_view name, Param<T>* source) const;
};

// A layer that lists, among its parameters(), Params owned by another layer of
// the model says which with borrowed_parameters(v): the sharding engine then
// refuses a borrowed Param that is unset or that no other layer of the model
// lists (docs/design.md, "Tied parameters").
template <class L>
concept BorrowsParameters = requires(L& l, borrow_visitor_archetype v) { l.borrowed_parameters(v); };

// y = x W^T over the last dimension, no bias, W [out, in] borrowed: tie(weight)
// points it at another layer's Param, e.g. an Embedding(vocab, D)'s weight for
// TiedLinear(D, vocab): logits = h W_te^T. It lists that Param as "weight", so a
// whole-model walk sees it under both names; backward adds dW into the same
// gradient the embedding adds into, so the two uses' gradients sum.
//
// Copies and moves are untied: a copied model would otherwise read the
// original's parameter (or a destroyed one). Tie once the model is in place;
// forward on an untied layer and fully_shard of a model holding one raise.
template <class T>
class TiedLinear {
 public:
  using input = Tensor<T>;
  using output = Tensor<T>;

  TiedLinear(std::int64_t in_features, std::int64_t out_features) : in_(in_features), out_(out_features) {}
  TiedLinear(const TiedLinear& o) : in_(o.in_), out_(o.out_) {}
  TiedLinear& operator=(const TiedLinear& o) {
    in_ = o.in_;
    out_ = o.out_;
    weight_ = nullptr;
    x_ = {};
    return *this;
  }

  // Borrows `weight`, which must be [out_features, in_features].
  void tie(Param<T>& weight) {
    require<shape_error>(weight.shape == Shape{out_, in_}, "TiedLinear(", in_, " -> ", out_, "): tie needs a weight [",
                         out_, ", ", in_, "], got ", weight.shape);
    weight_ = &weight;
  }
  bool tied() const { return weight_ != nullptr; }
  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }

  template <class V>
  void parameters(V&& v) {
    if (weight_) v("weight", *weight_);
  }
  template <class V>
  void borrowed_parameters(V&& v) {
    v("weight", weight_);
  }

  // Caches x for backward unless the context says none follows (nn::grad_enabled).
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    require<shape_error>(x.rank() >= 1 && x.shape()[x.rank() - 1] == in_, "TiedLinear(", in_, " -> ", out_,
                         "): input's last dimension must be ", in_, ", got shape ", x.shape());
    check_tied(false);
    x_ = grad_enabled(ctx) ? x : input{};
    Shape ys = x.shape();
    ys[ys.rank() - 1] = out_;
    output y(ys);
    const std::int64_t rows = x.numel() / in_;
    ops::gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, T(1), x.data(), in_, weight_->value, in_, T(0),
              y.data(), out_);
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require<shape_error>(!x_.empty() && dy.numel() == x_.numel() / in_ * out_, "TiedLinear(", in_, " -> ", out_,
                         "): backward needs the gradient of the last forward's output, got shape ", dy.shape());
    check_tied(true);
    const std::int64_t rows = x_.numel() / in_;
    ops::gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, T(1), dy.data(), out_, x_.data(), in_, T(1),
              weight_->grad, in_);  // dW += dy^T x
    input dx(x_.shape());
    ops::gemm(ops::trans::no, ops::trans::no, rows, in_, out_, T(1), dy.data(), out_, weight_->value, in_, T(0),
              dx.data(), in_);  // dx = dy W
    x_ = {};
    return dx;
  }

 private:
  void check_tied(bool with_grad) const {
    require(weight_ != nullptr, "TiedLinear(", in_, " -> ", out_, "): not tied to a weight (copies and moves are ",
            "untied: call tie(weight) once the model is in place)");
    weight_->require_bound("TiedLinear", with_grad);
  }

  std::int64_t in_, out_;
  Param<T>* weight_ = nullptr;
  input x_;  // cached for backward
};

}  // namespace shardlib::nn
