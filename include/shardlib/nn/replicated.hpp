// shardlib/nn/replicated.hpp — Replicated<T, L>: parameter and gradient storage for
// a whole model on one rank (plain training; every rank of DDP).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/layer.hpp"

#include <algorithm>  // std::fill
#include <cstdint>    // std::uint64_t
#include <span>       // std::span

namespace shardlib::nn {

// Allocates one flat value buffer and one flat gradient buffer for every Param
// of the layer (recorded as parameters and gradients in the ledger), binds the
// layer's views into them, and initialises the values from `seed`. The layer
// must outlive this owner and must not move while bound. The layout records which
// parameters were frozen when it was made: a step that leaves them out runs over
// optim::cut_frozen({{0, n, 0}}, layout(), 0, n) through optim::step_unfrozen.
template <class T, Layer L>
class Replicated {
 public:
  Replicated(L& layer, std::uint64_t seed)
      : layer_(&layer),
        layout_(flatten<T>(layer)),
        values_(layout_.numel, category::parameters),
        grads_(layout_.numel, category::gradients) {
    initialize_range<T>(layout_, seed, 0, values_.span());
    zero_grad();
    bind<T>(layer, layout_, values_.data(), grads_.data());
  }
  Replicated(const Replicated&) = delete;
  Replicated& operator=(const Replicated&) = delete;

  L& layer() { return *layer_; }
  const flat_layout& layout() const { return layout_; }
  std::span<T> values() { return values_.span(); }
  std::span<T> grads() { return grads_.span(); }
  void zero_grad() { std::fill(grads_.data(), grads_.data() + grads_.size(), T(0)); }

  // The values of one parameter by its dotted name.
  std::span<T> value(std::string_view name) { return values().subspan(entry(name).offset, entry(name).numel()); }
  std::span<T> grad(std::string_view name) { return grads().subspan(entry(name).offset, entry(name).numel()); }

 private:
  const flat_entry& entry(std::string_view name) const {
    for (const auto& e : layout_.entries)
      if (e.name == name) return e;
    throw error(cat("Replicated: no parameter named '", name, "'"));
  }

  L* layer_;
  flat_layout layout_;
  Buffer<T> values_, grads_;
};

}  // namespace shardlib::nn
