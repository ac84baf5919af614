// shardlib/core/buffer.hpp — Buffer<T, Space>: owning, aligned, recorded in the rank's ledger.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/core/memory_space.hpp"

#include <cstddef>      // std::size_t
#include <span>         // std::span
#include <type_traits>  // std::is_trivially_copyable_v
#include <utility>      // std::exchange

namespace shardlib {

// A contiguous array of n elements of T in memory space Space. Every byte is
// recorded in the ledger of the rank that allocated it, under one category, and
// released to that same ledger. Contents start uninitialised (like cudaMalloc):
// the library overwrites gathered and scratch buffers before reading them.
template <class T, MemorySpace Space = host_space>
class Buffer {
  static_assert(std::is_trivially_copyable_v<T>, "Buffer<T>: T must be trivially copyable (an element type)");

 public:
  using value_type = T;
  using space = Space;

  Buffer() = default;
  Buffer(std::size_t n, category c) : category_(c), ledger_(&current_ledger()) {
    data_ = static_cast<T*>(Space::allocate(detail::bytes_of(n, sizeof(T), Space::name)));
    size_ = n;
    ledger_->allocate(category_, bytes());
  }
  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        category_(o.category_),
        ledger_(std::exchange(o.ledger_, nullptr)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      category_ = o.category_;
      ledger_ = std::exchange(o.ledger_, nullptr);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  // Frees the memory now (the buffer becomes empty).
  void reset() noexcept {
    if (ledger_) ledger_->release(category_, bytes());
    Space::deallocate(data_, bytes());
    data_ = nullptr;
    size_ = 0;
    ledger_ = nullptr;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  bool empty() const { return size_ == 0; }
  category kind() const { return category_; }

  std::span<T> span() { return {data_, size_}; }
  std::span<const T> span() const { return {data_, size_}; }
  T& operator[](std::size_t i)
    requires can_access<host_space, Space>
  { return data_[i]; }
  const T& operator[](std::size_t i) const
    requires can_access<host_space, Space>
  { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  category category_ = category::activations;
  ledger* ledger_ = nullptr;
};

}  // namespace shardlib
