// shardlib/models/peft.hpp — LoRA adapters in Hugging Face PEFT's files, as
// PeftModel.save_pretrained / from_pretrained exchange them: adapter_config.json and
// adapter_model.safetensors (tensors "base_model.model.<module>.lora_A.weight", F32).
//
//   const auto peft = models::read_peft_config("adapter-dir");
//   models::LlamaForCausalLM<float> model(config);
//   nn::add_lora(model, peft.target_modules, peft.lora);   // before wrapping
//   auto sharded = shard::fully_shard(model, comm, shard::FullShard{}, {...});
//   models::load_hf(sharded, "base-dir");      // the base model, into the base layers
//   models::load_peft(sharded, "adapter-dir"); // the adapters
//   ...train...
//   models::save_peft(sharded, "out-dir");     // adapter_config.json + adapter_model.safetensors
//   models::merge_peft("base-dir", "out-dir", "merged-dir");  // the fine-tuned model, merged
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"  // dtype
#include "shardlib/core/error.hpp"
#include "shardlib/io/state_dict.hpp"
#include "shardlib/models/hf.hpp"  // detail::held_model, detail::as_writer
#include "shardlib/nn/lora.hpp"    // add_lora, lora_modules, lora_target_matches, lora_options
#include "shardlib/nn/replicated.hpp"  // merge_peft's host model

#include <nlohmann/json.hpp>  // nlohmann::json, nlohmann::ordered_json

#include <algorithm>    // std::ranges::sort, std::ranges::unique
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <filesystem>   // std::filesystem::path
#include <map>          // std::map
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v, std::remove_cvref_t
#include <utility>      // std::pair
#include <vector>       // std::vector

namespace shardlib::models {

// What adapter_config.json says of a LoRA adapter that shardlib can take (LoraConfig's names).
struct peft_lora_config {
  nn::lora_options lora;                    // r, lora_alpha, use_rslora, lora_dropout
  std::vector<std::string> target_modules;  // as nn::add_lora takes them
};

namespace detail {
// The adapters alone, under PEFT's tensor names: the causal-LM wrapper's "base_model.model."
// before the model's own.
inline io::state_dict_options peft_options(bool strict) {
  return {.names = io::name_map::prefixes({{"base_model.model.", ""}}),
          .strict = strict,
          .save_dtype = dtype::f32,
          .only = {"*.lora_A.weight", "*.lora_B.weight"}};
}

// The adapter's target_modules as PEFT would write them: a module's last name where
// every Linear of that name is adapted ("c_attn"), else the adapted ones' dotted names.
template <class M>
std::vector<std::string> peft_targets(M& model) {
  std::map<std::string, bool> all_adapted;  // last name -> every Linear so named adapted
  std::vector<std::pair<std::string, std::string>> adapted;  // {last name, dotted name}
  auto see = [&](std::string_view name, auto& linear) {
    const std::string leaf(name.substr(name.rfind('.') + 1));
    const bool a = linear.lora() != nullptr;
    auto [it, fresh] = all_adapted.emplace(leaf, a);
    if (!fresh) it->second = it->second && a;
    if (a) adapted.emplace_back(leaf, name);
  };
  nn::detail::each_linear(model, "", see);
  std::vector<std::string> targets;
  for (const auto& [leaf, name] : adapted) targets.push_back(all_adapted.at(leaf) ? leaf : name);
  std::ranges::sort(targets);
  targets.erase(std::ranges::unique(targets).begin(), targets.end());
  return targets;
}

// The options every adapter of `model` shares; io_error naming `what` when there are
// none or they differ (PEFT's rank_pattern and alpha_pattern are not written).
template <class M>
nn::lora_options shared_lora_options(M& model, std::string_view what) {
  const auto modules = nn::lora_modules(model);
  require<io_error>(!modules.empty(), what, ": the model has no LoRA adapters (nn::add_lora adds them)");
  const auto& [first, o] = *modules.begin();
  for (const auto& [name, other] : modules)
    require<io_error>(other == o, what, ": the adapters differ (", first, " has r ", o.r, ", alpha ", o.alpha,
                      ", rslora ", o.rslora, ", dropout ", o.dropout, "; ", name, " has r ", other.r, ", alpha ",
                      other.alpha, ", rslora ", other.rslora, ", dropout ", other.dropout,
                      "): one adapter_config.json describes one rank, alpha, rslora and dropout for all");
  return o;
}

// That `model`'s adapters are the ones `c` describes: each Linear adapted exactly where
// c.target_modules names it, with c's options, and each target naming one; io_error
// naming the first difference.
template <class M>
void check_adapters(M& model, const peft_lora_config& c, std::string_view what) {
  const auto modules = nn::lora_modules(model);
  std::vector<bool> used(c.target_modules.size(), false);
  auto check = [&](std::string_view name, auto&) {
    const bool named = nn::lora_targets_name(c.target_modules, name, used);
    const auto it = modules.find(std::string(name));
    require<io_error>(named == (it != modules.end()), what, ": ", name,
                      named ? " is a target of the adapter but has no LoRA adapter in the model"
                            : " has a LoRA adapter in the model but is not among the adapter's target_modules",
                      " (nn::add_lora with the config's target_modules builds the model it was saved from)");
    if (named)
      require<io_error>(it->second == c.lora, what, ": ", name, "'s adapter has r ", it->second.r, ", alpha ",
                        it->second.alpha, ", rslora ", it->second.rslora, ", dropout ", it->second.dropout,
                        "; the file's r ", c.lora.r, ", lora_alpha ", c.lora.alpha, ", use_rslora ", c.lora.rslora,
                        ", lora_dropout ", c.lora.dropout);
  };
  nn::detail::each_linear(model, "", check);
  for (std::size_t k = 0; k < used.size(); ++k)
    require<io_error>(used[k], what, ": target_modules' '", c.target_modules[k], "' names no Linear of the model");
}
}  // namespace detail

// The LoRA adapter `dir_or_file` (a directory with adapter_config.json, or the file)
// describes. What shardlib's adapters cannot be is refused, naming the field:
// peft_type other than LORA, a regex target_modules (a string; list the modules),
// bias other than "none", use_dora, rank_pattern / alpha_pattern, layers_to_transform,
// modules_to_save.
inline peft_lora_config read_peft_config(const std::filesystem::path& dir_or_file) {
  const auto path = detail::json_file(dir_or_file, "adapter_config.json");
  return detail::with_json(path, "the adapter's adapter_config.json", [&](const nlohmann::json& j) {
    peft_lora_config c;
    const auto where = [&](std::string_view key) { return cat(path.string(), ": ", key); };
    const auto given = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
    require<io_error>(given("peft_type") && j["peft_type"] == "LORA", where("peft_type"), " must be \"LORA\", got ",
                      given("peft_type") ? j["peft_type"].dump() : "nothing");
    require<io_error>(given("r") && j["r"].is_number_integer() && j["r"].get<std::int64_t>() >= 1, where("r"),
                      " must be a positive integer");
    c.lora.r = j["r"].get<std::int64_t>();
    c.lora.alpha = given("lora_alpha") ? j["lora_alpha"].get<double>() : 8.0;  // LoraConfig's default
    c.lora.rslora = given("use_rslora") && j["use_rslora"].get<bool>();
    c.lora.dropout = given("lora_dropout") ? j["lora_dropout"].get<double>() : 0.0;
    require<io_error>(c.lora.dropout >= 0 && c.lora.dropout < 1, where("lora_dropout"), " must be in [0, 1), got ",
                      c.lora.dropout);
    require<io_error>(given("target_modules") && j["target_modules"].is_array(), where("target_modules"),
                      " must be a list of module names (a string is PEFT's regex over the names, which ",
                      "shardlib does not take: list the modules)");
    c.target_modules = j["target_modules"].get<std::vector<std::string>>();
    const std::string bias = given("bias") ? j["bias"].get<std::string>() : "none";
    require<io_error>(bias == "none", where("bias"), " \"", bias,
                      "\" trains the base layers' biases too; only \"none\" is supported");
    require<io_error>(!given("use_dora") || !j["use_dora"].get<bool>(), where("use_dora"), ": DoRA is not supported");
    for (const char* key : {"rank_pattern", "alpha_pattern"})
      require<io_error>(!given(key) || j[key].empty(), where(key), ": per-module ranks and alphas are not supported");
    for (const char* key : {"layers_to_transform", "modules_to_save"})
      require<io_error>(!given(key), where(key), " is not supported (it must be null)");
    return c;
  });
}

// Reads the adapter PEFT's save_pretrained wrote into `dir` (adapter_config.json and
// adapter_model.safetensors) into the adapters of the model `holder` keeps (a
// shard::ShardedModel: collective, every rank reading its own piece; or an
// nn::Replicated). The model must have been adapted as the config says (nn::add_lora
// with its target_modules and options), else io_error naming the first module that
// differs, on every rank. Strict by default, over the adapters: the base layers are
// load_hf's.
template <class Holder>
io::load_report load_peft(Holder& holder, const std::filesystem::path& dir, bool strict = true) {
  auto& model = detail::held_model(holder);
  detail::on_every_rank(holder, cat("loading the adapter ", dir.string()), [&] {
    detail::check_adapters(model, read_peft_config(dir), detail::json_file(dir, "adapter_config.json").string());
  });
  return io::load_state_dict(dir / "adapter_model.safetensors", holder, detail::peft_options(strict));
}

// Writes what PeftModel.save_pretrained writes into `dir`: adapter_config.json (LoRA,
// task CAUSAL_LM, the adapters' r, lora_alpha, use_rslora and lora_dropout, target_modules as
// detail::peft_targets names them, fan_in_fan_out for GPT-2's Conv1D layout) and
// adapter_model.safetensors (F32, the adapters alone). Every adapter must share one r,
// alpha, rslora and dropout. Collective for a ShardedModel (rank 0 writes).
template <class Holder>
void save_peft(Holder& holder, const std::filesystem::path& dir) {
  auto& model = detail::held_model(holder);
  const std::string what = cat("saving the adapter to ", dir.string());
  nn::lora_options o;
  std::vector<std::string> targets;
  detail::on_every_rank(holder, what, [&] {
    o = detail::shared_lora_options(model, what);
    targets = detail::peft_targets(model);
  });
  using M = std::remove_cvref_t<decltype(model)>;
  const bool conv1d = std::is_same_v<typename M::config_type, gpt2_config>;
  detail::as_writer(holder, cat("creating ", dir.string()), [&] { std::filesystem::create_directories(dir); });
  io::save_state_dict(dir / "adapter_model.safetensors", holder, detail::peft_options(true));
  const nlohmann::ordered_json config{{"peft_type", "LORA"},
                                      {"task_type", "CAUSAL_LM"},
                                      {"r", o.r},
                                      {"lora_alpha", o.alpha},
                                      {"use_rslora", o.rslora},
                                      {"target_modules", targets},
                                      {"lora_dropout", o.dropout},
                                      {"bias", "none"},
                                      {"fan_in_fan_out", conv1d},
                                      {"init_lora_weights", true},
                                      {"inference_mode", true},
                                      {"base_model_name_or_path", nullptr},
                                      {"modules_to_save", nullptr},
                                      {"layers_to_transform", nullptr},
                                      {"layers_pattern", nullptr},
                                      {"rank_pattern", nlohmann::ordered_json::object()},
                                      {"alpha_pattern", nlohmann::ordered_json::object()},
                                      {"use_dora", false},
                                      {"revision", nullptr}};
  detail::as_writer(holder, cat("writing ", (dir / "adapter_config.json").string()), [&] {
    io::detail::atomic_file f(dir / "adapter_config.json");
    f.write(io::detail::as_bytes(config.dump(2) + "\n"));
    f.commit();
  });
}

namespace detail {
template <class M>
void merge_into(const std::filesystem::path& base, const std::filesystem::path& adapter,
                const std::filesystem::path& out) {
  M model(read_hf_config<typename M::config_type>(base));
  const peft_lora_config peft = read_peft_config(adapter);
  nn::add_lora(model, peft.target_modules, peft.lora);
  nn::Replicated<float, M> owner(model, 0);
  load_hf(owner, base);
  load_peft(owner, adapter);
  nn::merge_lora(model);
  save_hf(owner, out);  // the base layers under the base names: now the fine-tuned model
}
}  // namespace detail

// PEFT's PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(out):
// the GPT-2 or LLaMA checkpoint in `base` (config.json's model_type says which) with the
// LoRA adapter in `adapter` folded into its weights (W += s B A, in float32 on the host),
// written to `out` as save_hf writes a model (config.json and model.safetensors) for
// from_pretrained or load_hf. What the loads refuse, this refuses (io_error naming it).
inline void merge_peft(const std::filesystem::path& base, const std::filesystem::path& adapter,
                       const std::filesystem::path& out) {
  visit_hf_config(base, [&]<class Config>(const Config&) {
    if constexpr (std::is_same_v<Config, gpt2_config>) detail::merge_into<GPT2LMHeadModel<float>>(base, adapter, out);
    else detail::merge_into<LlamaForCausalLM<float>>(base, adapter, out);
  });
}

}  // namespace shardlib::models
