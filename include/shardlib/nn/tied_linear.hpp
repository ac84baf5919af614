// shardlib/nn/tied_linear.hpp — TiedLinear: y = x W^T with W borrowed from another
// layer (GPT-2's lm_head reading the token embedding), and the BorrowsParameters
// concept the sharding engine checks ties with.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/saved_input.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/gemm.hpp"

#include <concepts>     // std::convertible_to
#include <cstdint>      // std::int64_t
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v

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

namespace detail {
// What TiedLinear's two versions share (the host's below, the device's in
// nn/cuda/tied_linear.cuh): the tie, parameters(), borrowed_parameters() and
// the checks with their messages.
template <class T>
class tied_linear_base {
 public:
  tied_linear_base(std::int64_t in_features, std::int64_t out_features) : in_(in_features), out_(out_features) {}
  tied_linear_base(const tied_linear_base& o) : in_(o.in_), out_(o.out_) {}
  tied_linear_base& operator=(const tied_linear_base& o) {
    in_ = o.in_;
    out_ = o.out_;
    weight_ = nullptr;
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

 protected:
  // forward's check of x; the output's shape: x's with the last dimension out.
  Shape check_input(const Shape& x) const {
    require<shape_error>(x.rank() >= 1 && x[x.rank() - 1] == in_, "TiedLinear(", in_, " -> ", out_,
                         "): input's last dimension must be ", in_, ", got shape ", x);
    check_tied(false);
    Shape ys = x;
    ys[ys.rank() - 1] = out_;
    return ys;
  }
  // backward's check of dy against the input forward saved.
  template <class X, class Y>
  void check_grad(const saved_input<X>& x, const Y& dy) const {
    x.require(weight_ && weight_->requires_grad, "TiedLinear(", in_, " -> ", out_, ")");
    require<shape_error>(dy.numel() == x.numel() / in_ * out_, "TiedLinear(", in_, " -> ", out_,
                         "): backward needs the gradient of the last forward's output, got shape ", dy.shape());
    check_tied(true);
  }
  void check_tied(bool with_grad) const {
    require(weight_ != nullptr, "TiedLinear(", in_, " -> ", out_, "): not tied to a weight (copies and moves are ",
            "untied: call tie(weight) once the model is in place)");
    weight_->require_bound("TiedLinear", with_grad);
  }

  std::int64_t in_, out_;
  Param<T>* weight_ = nullptr;
};
}  // namespace detail

// y = x W^T over the last dimension, no bias, W [out, in] borrowed: tie(weight)
// points it at another layer's Param, e.g. an Embedding(vocab, D)'s weight for
// TiedLinear(D, vocab): logits = h W_te^T. It lists that Param as "weight", so a
// whole-model walk sees it under both names; backward adds dW into the same
// gradient the embedding adds into, so the two uses' gradients sum.
//
// Copies and moves are untied: a copied model would otherwise read the
// original's parameter (or a destroyed one). Tie once the model is in place;
// forward on an untied layer and fully_shard of a model holding one raise.
// Space: the host's layer; the device's (cuda_space) is in nn/cuda/tied_linear.cuh.
template <class T, class Space = host_space>
class TiedLinear : public detail::tied_linear_base<T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::TiedLinear: the host layer; for cuda_space include shardlib/nn/cuda/tied_linear.cuh");
  using base = detail::tied_linear_base<T>;
  using base::in_, base::out_, base::weight_;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;

  using base::base;  // TiedLinear(in_features, out_features)
  TiedLinear(const TiedLinear& o) : base(o) {}
  TiedLinear& operator=(const TiedLinear& o) {
    base::operator=(o);
    x_.clear();
    return *this;
  }

  // Keeps x for backward (saved_input: its shape alone if the weight is frozen).
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    output y(this->check_input(x.shape()));
    x_.save(ctx, x, weight_->requires_grad);
    const std::int64_t rows = x.numel() / in_;
    ops::gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, T(1), x.data(), in_, weight_->value, in_, T(0),
              y.data(), out_);
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / in_;
    if (weight_->requires_grad)  // frozen: no gradient, as Linear
      ops::gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, T(1), dy.data(), out_, x_.values().data(), in_, T(1),
                weight_->grad, in_);  // dW += dy^T x
    input dx(x_.shape());
    ops::gemm(ops::trans::no, ops::trans::no, rows, in_, out_, T(1), dy.data(), out_, weight_->value, in_, T(0),
              dx.data(), in_);  // dx = dy W
    x_.clear();
    return dx;
  }

 private:
  saved_input<input> x_;
};

}  // namespace shardlib::nn
