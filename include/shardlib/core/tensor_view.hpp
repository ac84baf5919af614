// shardlib/core/tensor_view.hpp — TensorView<T, Space>: a non-owning, row-major, contiguous view.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/memory_space.hpp"
#include "shardlib/core/shape.hpp"

#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <type_traits>  // std::remove_const_t

namespace shardlib {

// A shape over memory someone else owns (a Buffer, a gathered flat parameter,
// a user array). T may be const for read-only views.
template <class T, MemorySpace Space = host_space>
class TensorView {
 public:
  using value_type = std::remove_const_t<T>;
  using space = Space;

  TensorView() = default;
  TensorView(T* data, Shape shape) : data_(data), shape_(shape) {}
  // A view of a whole buffer with the given shape; the element counts must agree.
  template <class U>
  TensorView(Buffer<U, Space>& b, Shape shape) : data_(b.data()), shape_(shape) {
    require<shape_error>(std::size_t(shape.numel()) == b.size(), "TensorView: shape ", shape, " holds ", shape.numel(),
                         " elements but the buffer holds ", b.size());
  }
  // A non-const view converts to a const one.
  operator TensorView<const T, Space>() const { return {data_, shape_}; }

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_[i]; }
  std::int64_t numel() const { return shape_.numel(); }
  std::span<T> span() const { return {data_, std::size_t(numel())}; }

  // Element access by row-major indices (host-reachable spaces only).
  template <class... I>
  T& operator()(I... idx) const
    requires can_access<host_space, Space>
  {
    static_assert(sizeof...(I) <= Shape::max_rank);
    const std::int64_t is[] = {std::int64_t(idx)...};
    std::int64_t off = 0;
    for (int d = 0; d < int(sizeof...(I)); ++d) off = off * shape_[d] + is[d];
    return data_[off];
  }

  // The same memory under another shape with the same element count.
  TensorView reshape(Shape s) const {
    require<shape_error>(s.numel() == numel(), "TensorView::reshape: ", shape_, " has ", numel(),
                         " elements, the new shape ", s, " has ", s.numel());
    return {data_, s};
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
};

}  // namespace shardlib
