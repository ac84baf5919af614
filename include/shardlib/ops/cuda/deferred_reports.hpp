// shardlib/ops/cuda/deferred_reports.hpp — deferred_reports: the checks a
// layer leaves unread on the device until the next loss read takes them.
#pragma once
#include "shardlib/config.hpp"

#include <cstddef>   // std::size_t
#include <deque>     // std::deque
#include <iterator>  // std::make_move_iterator
#include <utility>   // std::move
#include <vector>    // std::vector

namespace shardlib::ops::cuda {

// Reports in the order their layers made them (the device Embedding's bad ids),
// waiting for a read that waits for the device anyway: a device loss takes all of
// them when it is made and reads them in its own wait. A thread that makes no loss
// (inference) would keep one per forward, so past `limit` add() checks the oldest
// alone: one wait, and its error (if any) is thrown from add(). Report needs
// check(), which waits for its result and throws its layer's error if it has one.
template <class Report>
class deferred_reports {
 public:
  static constexpr std::size_t limit = 64;

  void add(Report r) {
    items_.push_back(std::move(r));
    if (items_.size() <= limit) return;
    Report oldest = std::move(items_.front());
    items_.pop_front();
    oldest.check();
  }

  // All of them, oldest first; the list is left empty.
  std::vector<Report> take() {
    std::vector<Report> all(std::make_move_iterator(items_.begin()), std::make_move_iterator(items_.end()));
    items_.clear();
    return all;
  }

  std::size_t size() const { return items_.size(); }

 private:
  std::deque<Report> items_;
};

}  // namespace shardlib::ops::cuda
