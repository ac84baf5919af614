// shardlib/io/optimizer_record.hpp — an optimizer as checkpoints record it: its name,
// its hyperparameters (Adam's and SGD's, saved and restored), its buffers' names, the
// checks that a recorded optimizer fits the one loading it, and that every rank saving
// holds the same one.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"           // Buffer
#include "shardlib/core/error.hpp"            // io_error, cat
#include "shardlib/io/checkpoint_format.hpp"  // checkpoint_optimizer, detail::optimizer_to_json
#include "shardlib/io/rank_agreement.hpp"     // detail::on_all_ranks, broadcast_string
#include "shardlib/io/safetensors.hpp"        // detail::fail
#include "shardlib/optim/adam.hpp"            // BasicAdam, decay_style
#include "shardlib/optim/sgd.hpp"             // SGD

#include <nlohmann/json.hpp>  // nlohmann::json

#include <algorithm>    // std::find
#include <cmath>        // std::isfinite
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v, std::remove_const_t, std::remove_reference_t
#include <vector>       // std::vector

namespace shardlib::io {

namespace detail {

template <class O>
inline constexpr bool is_adam = false;
template <optim::decay_style S>
inline constexpr bool is_adam<optim::BasicAdam<S>> = true;
// The library's optimizers, whose options a checkpoint records and restores (as
// PyTorch's optimizer state_dict does with param_groups).
template <class O>
inline constexpr bool known_optimizer = is_adam<O> || std::is_same_v<O, optim::SGD>;

// f(name, field) for every hyperparameter of a known optimizer.
template <class O, class F>
void each_hyperparameter(O& opt, F&& f) {
  auto& o = opt.options;
  if constexpr (is_adam<std::remove_const_t<O>>) {
    f("lr", o.lr);
    f("beta1", o.beta1);
    f("beta2", o.beta2);
    f("eps", o.eps);
    f("weight_decay", o.weight_decay);
    f("amsgrad", o.amsgrad);
  } else if constexpr (std::is_same_v<std::remove_const_t<O>, optim::SGD>) {
    f("lr", o.lr);
    f("momentum", o.momentum);
    f("dampening", o.dampening);
    f("weight_decay", o.weight_decay);
    f("nesterov", o.nesterov);
  }
}
template <class O>
nlohmann::json hyperparameters_of(const O& opt) {
  auto j = nlohmann::json::object();
  each_hyperparameter(opt, [&](const char* k, const auto& v) { j[k] = v; });
  return j;
}
template <class O>
void restore_hyperparameters(O& opt, const nlohmann::json& j, std::string_view origin) {
  each_hyperparameter(opt, [&](const char* k, auto& v) {
    const auto it = j.find(k);
    if (it == j.end()) fail(origin, "the optimizer's hyperparameters lack \"", k, "\"");
    if constexpr (std::is_same_v<std::remove_reference_t<decltype(v)>, bool>) {
      if (!it->is_boolean()) fail(origin, "hyperparameter \"", k, "\" must be true or false, found ", it->dump());
      v = it->template get<bool>();
    } else {
      if (!it->is_number() || !std::isfinite(it->template get<double>()))
        fail(origin, "hyperparameter \"", k, "\" must be a finite number, found ", it->dump());
      v = it->template get<double>();
    }
  });
}
template <class O>
std::string optimizer_name() {
  if constexpr (requires { O::name; }) return std::string(O::name);
  else return {};
}

// The names of an optimizer's per-parameter buffers.
template <class O>
std::vector<std::string> buffer_names(O& opt) {
  std::vector<std::string> names;
  auto probe = opt.make_state(1);
  probe.for_each_buffer([&](std::string_view n, Buffer<float>&) { names.emplace_back(n); });
  return names;
}

// The optimizer the source records must be the one loading: the same type...
template <class O>
void check_optimizer_type(const checkpoint_optimizer& saved, std::string_view source) {
  if (const std::string mine = optimizer_name<O>(); !saved.type.empty() && !mine.empty() && mine != saved.type)
    throw io_error(cat(source, ": it holds ", saved.type, " optimizer state; this optimizer is ", mine));
}
// ... keeping the same buffers (with the source's hyperparameters: amsgrad adds one).
template <class O>
void check_buffers(O& opt, const checkpoint_optimizer& saved, std::string_view source) {
  const auto names = buffer_names(opt);
  std::string held;
  for (const auto& n : saved.state) held += cat(held.empty() ? "" : ", ", n);
  for (const auto& n : names)
    if (std::find(saved.state.begin(), saved.state.end(), n) == saved.state.end())
      throw io_error(cat(source, ": this optimizer keeps '", n, "', which it lacks (it holds ",
                         held.empty() ? "no buffers" : held, ")"));
  for (const auto& n : saved.state)
    if (std::find(names.begin(), names.end(), n) == names.end())
      throw io_error(cat(source, ": it holds optimizer state '", n, "', which this optimizer does not keep"));
}

// Every rank must save the optimizer rank 0 saves: one record (type, buffers, step,
// hyperparameters) describes them all, and a rank with other buffers would write shard
// files that record cannot load. Collective; raises io_error on every rank naming the
// ranks and what differs.
template <class Comm>
void check_same_optimizer(Comm& comm, const checkpoint_optimizer& mine, std::string_view what) {
  const nlohmann::json ours = optimizer_to_json(mine);
  const nlohmann::json first = nlohmann::json::parse(broadcast_string(comm, ours.dump(), 0));
  on_all_ranks(comm, what, [&] {
    for (const char* key : {"type", "state", "step", "hyperparameters"})
      if (ours[key] != first[key])
        throw io_error(cat("ranks 0 and ", comm.rank(), " save different optimizers, which one checkpoint cannot ",
                           "hold: optimizer ", key, " ", first[key].dump(), " on rank 0, ", ours[key].dump(),
                           " on rank ", comm.rank()));
  });
}

}  // namespace detail

}  // namespace shardlib::io
