// shardlib/io/optimizer_record.hpp — an optimizer as checkpoints record it: its name,
// its hyperparameters (Adam's and SGD's, saved and restored; parameter groups with their
// members, checked), its buffers' names, the checks that a recorded optimizer fits the
// one loading it, and that every rank saving holds the same one.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"            // io_error, cat
#include "shardlib/io/checkpoint_format.hpp"  // checkpoint_optimizer, detail::optimizer_to_json
#include "shardlib/io/rank_agreement.hpp"     // detail::on_all_ranks, broadcast_string
#include "shardlib/io/safetensors.hpp"        // detail::fail
#include "shardlib/optim/adam.hpp"            // BasicAdam, decay_style
#include "shardlib/optim/optimizer.hpp"       // detail::has_state, has_make_state, has_step_count, has_lr
#include "shardlib/optim/param_groups.hpp"    // param_groups, is_param_groups, OptimizerOrGroups
#include "shardlib/optim/sgd.hpp"             // SGD

#include <nlohmann/json.hpp>  // nlohmann::json

#include <algorithm>    // std::find
#include <cmath>        // std::isfinite
#include <cstddef>      // std::size_t
#include <set>          // std::set
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v, std::remove_reference_t
#include <vector>       // std::vector

namespace shardlib::io {

namespace detail {

template <class O>
inline constexpr bool is_adam = false;
template <optim::decay_style S>
inline constexpr bool is_adam<optim::BasicAdam<S>> = true;
// An optimizer that names a host_optimizer (optim::cuda::Adam: the host one's options
// and update over state in another memory space) is recorded as that one, so that a
// device run's checkpoint is the host run's and either loads the other's.
template <class O>
struct recorded_as {
  using type = O;
};
template <class O>
  requires requires { typename O::host_optimizer; }
struct recorded_as<O> {
  using type = typename O::host_optimizer;
};
template <class O>
using recorded_t = typename recorded_as<O>::type;
}  // namespace detail

// An optimizer whose state checkpoints save and load: an optim::Optimizer, parameter
// groups, or one like it whose state buffers live in another memory space
// (optim::cuda::Adam's in device memory: its for_each_buffer passes Buffer<float, Space>).
template <class O>
concept SavableOptimizer = optim::OptimizerOrGroups<O> ||
                           (optim::detail::has_state<O> && optim::detail::has_make_state<O> &&
                            optim::detail::has_step_count<O> && optim::detail::has_lr<O>);

namespace detail {
// The library's optimizers, whose options a checkpoint records and restores (as
// PyTorch's optimizer state_dict does with param_groups), and groups of any optimizer.
template <class O>
inline constexpr bool known_optimizer =
    is_adam<recorded_t<O>> || std::is_same_v<recorded_t<O>, optim::SGD> || optim::is_param_groups<O>;

// f(name, field) for every hyperparameter in options `o` of a known optimizer O.
template <class O, class Options, class F>
void each_option(Options& o, F&& f) {
  if constexpr (is_adam<recorded_t<O>>) {
    f("lr", o.lr);
    f("beta1", o.beta1);
    f("beta2", o.beta2);
    f("eps", o.eps);
    f("weight_decay", o.weight_decay);
    f("amsgrad", o.amsgrad);
  } else if constexpr (std::is_same_v<recorded_t<O>, optim::SGD>) {
    f("lr", o.lr);
    f("momentum", o.momentum);
    f("dampening", o.dampening);
    f("weight_decay", o.weight_decay);
    f("nesterov", o.nesterov);
  }
}
template <class O, class Options>
nlohmann::json options_json(const Options& o) {
  auto j = nlohmann::json::object();
  each_option<O>(o, [&](const char* k, const auto& v) { j[k] = v; });
  return j;
}
template <class O, class Options>
void restore_options(Options& o, const nlohmann::json& j, std::string_view origin) {
  if (const auto g = j.find("param_groups"); g != j.end() && g->is_array())
    fail(origin, "it holds ", g->size(), " parameter groups; load it into optim::param_groups over this optimizer");
  each_option<O>(o, [&](const char* k, auto& v) {
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

// The names of the model's parameters each group takes, in the model's order.
template <class Engine, class O>
std::vector<std::vector<std::string>> group_members(const Engine& model, const optim::param_groups<O>& opt) {
  std::vector<std::vector<std::string>> out(opt.groups().size());
  for (std::size_t i = 0; i < model.unit_count(); ++i)
    for (const auto& e : model.unit_layout(i).entries)
      out[std::size_t(opt.group_of(e.name, e.shape))].push_back(e.name);
  return out;
}

// An optimizer's hyperparameters as a checkpoint records them: its options, or for
// parameter groups {"param_groups": [{"name", "lr_scale", the options..., "params":
// [the names it takes]}, ...]}, as PyTorch's state_dict holds param_groups.
template <class Engine, class O>
nlohmann::json hyperparameters_of(const Engine& model, const O& opt) {
  if constexpr (optim::is_param_groups<O>) {
    const auto members = group_members(model, opt);
    auto groups = nlohmann::json::array();
    for (std::size_t g = 0; g < members.size(); ++g) {
      const auto& group = opt.groups()[g];
      auto j = options_json<typename O::optimizer>(group.options);
      j["name"] = group.name;
      j["lr_scale"] = group.lr_scale;
      j["params"] = members[g];
      groups.push_back(std::move(j));
    }
    return {{"param_groups", std::move(groups)}};
  } else {
    return options_json<O>(opt.options);
  }
}

// Parameter groups load only into the same groups: each group's name, members,
// lr_scale and options but lr must agree, else an io_error names the group and the
// field; lr is restored (as PyTorch's load_state_dict does; a schedule sets it anyway).
template <class Engine, class O>
void restore_groups(const Engine& model, optim::param_groups<O>& opt, const nlohmann::json& j,
                    std::string_view origin) {
  auto& groups = opt.groups();
  std::string ours;
  for (const auto& g : groups) ours += cat(ours.empty() ? "'" : ", '", g.name, "'");
  const auto saved = j.find("param_groups");
  if (saved == j.end() || !saved->is_array() || saved->size() != groups.size())
    throw io_error(cat(origin, ": it holds ", saved == j.end() || !saved->is_array() ? 0 : saved->size(),
                       " parameter groups; this optimizer has ", groups.size(), " (", ours, ")"));
  const auto members = group_members(model, opt);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const nlohmann::json& there = (*saved)[g];
    const auto name = there.find("name");
    if (!there.is_object() || name == there.end() || *name != groups[g].name)
      throw io_error(cat(origin, ": parameter group ", g, " is ",
                         there.is_object() && name != there.end() ? name->dump() : std::string("unnamed"),
                         " there, '", groups[g].name, "' here"));
    auto differs = [&](std::string_view field, const nlohmann::json& here) {
      const auto it = there.find(field);
      if (it == there.end() || *it != here)
        throw io_error(cat(origin, ": parameter group '", groups[g].name, "': ", field, " is ",
                           it == there.end() ? std::string("absent") : it->dump(), " there, ", here.dump(), " here"));
    };
    each_option<O>(groups[g].options, [&](std::string_view k, const auto& v) {
      if (k != "lr") differs(k, v);
    });
    differs("lr_scale", groups[g].lr_scale);
    const auto params = there.find("params");
    if (params == there.end() || !params->is_array())
      fail(origin, "parameter group '", groups[g].name, "' lists no params");
    std::set<std::string> listed;
    for (const auto& p : *params) {
      if (!p.is_string()) fail(origin, "parameter group '", groups[g].name, "': a param name is ", p.dump());
      listed.insert(p.get<std::string>());
    }
    const std::set<std::string> mine(members[g].begin(), members[g].end());
    for (const auto& p : listed)
      if (!mine.contains(p))
        throw io_error(cat(origin, ": parameter group '", groups[g].name, "': params: '", p,
                           "' is in it there, not here"));
    for (const auto& p : mine)
      if (!listed.contains(p))
        throw io_error(cat(origin, ": parameter group '", groups[g].name, "': params: '", p,
                           "' is in it here, not there"));
  }
  if constexpr (known_optimizer<O>)
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const nlohmann::json lr = (*saved)[g].value("lr", nlohmann::json());
      if (!lr.is_number() || !std::isfinite(lr.get<double>()))
        fail(origin, "parameter group '", groups[g].name, "': lr must be a finite number, found ", lr.dump());
      groups[g].options.lr = lr.get<double>();
    }
}

// Restores (or, for parameter groups, checks and restores) what a source recorded.
template <class Engine, class O>
void restore_hyperparameters(const Engine& model, O& opt, const nlohmann::json& j, std::string_view origin) {
  if constexpr (optim::is_param_groups<O>) restore_groups(model, opt, j, origin);
  else restore_options<O>(opt.options, j, origin);
}
template <class O>
std::string optimizer_name() {
  if constexpr (requires { O::name; }) return std::string(O::name);
  else return {};
}

// The names of an optimizer's per-parameter buffers (in whatever memory space they live).
template <class O>
std::vector<std::string> buffer_names(O& opt) {
  std::vector<std::string> names;
  auto probe = opt.make_state(1);
  probe.for_each_buffer([&](std::string_view n, auto&) { names.emplace_back(n); });
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
// ranks and what differs. Compared as compared_text: a buffer or group name that is not
// UTF-8 fails no rank's dump here (the save refuses it later, on every rank alike).
template <class Comm>
void check_same_optimizer(Comm& comm, const checkpoint_optimizer& mine, std::string_view what) {
  const nlohmann::json ours = optimizer_to_json(mine);
  const nlohmann::json first = nlohmann::json::parse(broadcast_string(comm, compared_text(ours), 0));
  on_all_ranks(comm, what, [&] {
    for (const char* key : {"type", "state", "step", "hyperparameters"})
      if (compared_text(ours[key]) != compared_text(first[key]))
        throw io_error(cat("ranks 0 and ", comm.rank(), " save different optimizers, which one checkpoint cannot ",
                           "hold: optimizer ", key, " ", compared_text(first[key]), " on rank 0, ",
                           compared_text(ours[key]), " on rank ", comm.rank()));
  });
}

}  // namespace detail

}  // namespace shardlib::io
