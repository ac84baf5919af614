// shardlib/shard/step_items.hpp — train_step's loss_mean::per_item: the items each
// micro-batch's loss is a mean over, as its loss function counts them, their total over
// every rank, and from those each micro-batch's weight in the step's gradient and loss.
// Ops is the model's space_ops (shard/space_ops.hpp).
#pragma once
#include "shardlib/comm/communicator.hpp"  // reduce_op
#include "shardlib/core/error.hpp"
#include "shardlib/nn/loss.hpp"  // counts_items

#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t
#include <exception>  // std::exception
#include <span>       // std::span
#include <string>     // std::string
#include <vector>     // std::vector

namespace shardlib::shard {

struct step_items {
  std::vector<std::int64_t> each;  // this rank's micro-batches', in order
  std::int64_t mine = 0;           // their sum
  std::int64_t all = 0;            // over every rank

  // Micro-batch k's loss gradient times this: its items' share of the step's, times the
  // ranks an averaging reduction divides by (`averaged_over`; 1 for a sum).
  double gradient_factor(std::size_t k, double averaged_over) const {
    return double(each[k]) * averaged_over / double(all);
  }
  // Each loss's share of this rank's mean over its items: 0 for a micro-batch without any
  // (its loss, a mean over none, is NaN and left out), all 0 when the rank has none.
  std::vector<double> loss_weights() const {
    std::vector<double> w;
    for (std::int64_t c : each) w.push_back(mine > 0 ? double(c) / double(mine) : 0.0);
    return w;
  }
};

// Every rank counts its micro-batches' items (ys[k] through loss_fn.items) and the ranks sum
// their counts in one all-reduce, which also says whether each can run the step (`problem`,
// which counting can set): all raise together, the rank with a problem with its own error. A
// step with no item on any rank raises on every rank: its mean is over nothing.
template <class Ops, class Comm, class LossFn, class Target>
step_items count_step_items(Comm& comm, LossFn& loss_fn, std::span<const Target> ys, std::string& problem) {
  const int rank = comm.rank();
  step_items s;
  if (problem.empty()) {
    if constexpr (nn::counts_items<LossFn, Target>) {
      try {
        for (const auto& y : ys) {
          const std::int64_t c = loss_fn.items(y);
          if (c < 0) {
            problem = cat("rank ", rank, ": train_step with loss_mean::per_item: micro-batch ", s.each.size(),
                          "'s loss function counted ", c, " items; a count is >= 0");
            break;
          }
          s.each.push_back(c);
          s.mine += c;
        }
      } catch (const std::exception& x) {
        problem = cat("rank ", rank, ": train_step with loss_mean::per_item, counting micro-batch ", s.each.size(),
                      "'s items: ", x.what());
      }
    } else {
      problem = cat("rank ", rank, ": train_step with loss_mean::per_item: the loss function does not count the "
                    "items its mean is over (items(target) -> std::int64_t, as nn::cross_entropy_loss and "
                    "nn::squared_error_loss do)");
    }
  }
  std::int64_t sums[2] = {problem.empty() ? s.mine : 0, problem.empty() ? 0 : 1};
  Ops::all_reduce_values(comm, std::span<std::int64_t>(sums), comm::reduce_op::sum);
  require(problem.empty(), problem);
  require(sums[1] == 0, "rank ", rank, ": train_step: ", sums[1], " other rank(s) cannot run it (their errors say "
          "why)");
  require(sums[0] > 0, "rank ", rank, ": train_step with loss_mean::per_item: no rank's targets hold an item (every "
          "target ignored?), and a mean over none is undefined");
  s.all = sums[0];
  return s;
}

}  // namespace shardlib::shard
