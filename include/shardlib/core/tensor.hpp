// shardlib/core/tensor.hpp — Tensor<T, Space>: an owning, shared, row-major tensor (activations).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/core/memory_space.hpp"
#include "shardlib/core/shape.hpp"
#include "shardlib/core/tensor_view.hpp"

#include <algorithm>  // std::fill_n
#include <memory>     // std::shared_ptr
#include <span>       // std::span

namespace shardlib {

// What flows between layers. Copies share the storage (like torch.Tensor), so a
// layer caches its input for backward by keeping a copy, and the memory goes
// back to the ledger when the last holder lets go.
template <class T, MemorySpace Space = host_space>
class Tensor {
 public:
  using value_type = T;
  using space = Space;

  Tensor() = default;  // empty: no storage, numel() == 0
  // Uninitialised storage for `shape`, recorded under `kind`.
  explicit Tensor(Shape shape, category kind = category::activations)
      : storage_(std::make_shared<Buffer<T, Space>>(std::size_t(shape.numel()), kind)), shape_(shape) {}

  static Tensor zeros(Shape shape, category kind = category::activations)
    requires can_access<host_space, Space>
  {
    Tensor t(shape, kind);
    std::fill_n(t.data(), t.numel(), T{});
    return t;
  }

  bool empty() const { return !storage_; }
  T* data() const { return storage_ ? storage_->data() : nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_[i]; }
  std::int64_t numel() const { return storage_ ? shape_.numel() : 0; }
  std::span<T> span() const { return {data(), std::size_t(numel())}; }
  TensorView<T, Space> view() const { return {data(), shape_}; }

  T& operator[](std::int64_t i) const
    requires can_access<host_space, Space>
  { return data()[i]; }

  // The same storage under another shape with the same element count.
  Tensor reshape(Shape s) const {
    require<shape_error>(s.numel() == numel(), "Tensor::reshape: ", shape_, " has ", numel(), " elements, the new shape ",
                         s, " has ", s.numel());
    Tensor t = *this;
    t.shape_ = s;
    return t;
  }

 private:
  std::shared_ptr<Buffer<T, Space>> storage_;
  Shape shape_{};
};

}  // namespace shardlib
