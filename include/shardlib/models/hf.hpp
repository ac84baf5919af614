// shardlib/models/hf.hpp — GPT-2 and LLaMA checkpoints in Hugging Face's layout, as
// from_pretrained / save_pretrained exchange them: config.json to and from the
// models' config structs, and the parameters through io::load_state_dict /
// io::save_state_dict with Hugging Face's conventions (io/hf_checkpoint.hpp:
// GPT-2's transposed Conv1D weights, the tied lm_head.weight left out of the file).
//
//   auto config = models::read_hf_config<models::gpt2_config>("gpt2-dir");
//   models::GPT2LMHeadModel<float> model(config);
//   auto sharded = shard::fully_shard(model, comm, shard::FullShard{}, {...});
//   models::load_hf(sharded, "gpt2-dir");   // or an nn::Replicated holding the model
//   models::save_hf(sharded, "out-dir");    // config.json + model.safetensors
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/io/hf_checkpoint.hpp"
#include "shardlib/io/safetensors.hpp"
#include "shardlib/io/state_dict.hpp"
#include "shardlib/models/gpt2.hpp"
#include "shardlib/models/llama.hpp"
#include "shardlib/models/token_ids.hpp"
#include "shardlib/nn/lora.hpp"  // peft_base_names, lora_modules

#include <nlohmann/json.hpp>  // nlohmann::json, nlohmann::ordered_json

#include <cmath>        // std::floor
#include <cstdint>      // std::int64_t, std::uint64_t
#include <filesystem>   // std::filesystem::path
#include <fstream>      // std::ifstream
#include <functional>   // std::less
#include <optional>     // std::optional
#include <set>          // std::set
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move, std::pair
#include <variant>      // std::variant, std::visit (visit_hf_config)

namespace shardlib::models {

namespace detail {
// bos_token_id, eos_token_id (an id or a list of them) and pad_token_id: an id, or null
// for none; absent, the struct's default (the config class's) stays.
inline void read_token_ids(const nlohmann::json& j, token_ids& t, std::string_view who) {
  const auto id = [&](const char* key, const nlohmann::json& v) {
    require(v.is_number_integer(), who, ": ", key, " must be a token id (an integer) or null, got ", v.dump());
    return v.get<std::int64_t>();
  };
  for (const auto& [key, field] : {std::pair{"bos_token_id", &t.bos}, std::pair{"pad_token_id", &t.pad}})
    if (j.contains(key)) *field = j[key].is_null() ? std::nullopt : std::optional(id(key, j[key]));
  if (!j.contains("eos_token_id")) return;
  const auto& e = j["eos_token_id"];
  t.eos.clear();
  if (e.is_array()) {
    for (const auto& v : e) t.eos.push_back(id("eos_token_id", v));
  } else if (!e.is_null()) {
    t.eos.push_back(id("eos_token_id", e));
  }
}
inline void write_token_ids(nlohmann::ordered_json& j, const token_ids& t) {
  const auto id = [](const std::optional<std::int64_t>& v) {
    return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json();
  };
  j["bos_token_id"] = id(t.bos);
  j["eos_token_id"] = t.eos.empty()      ? nlohmann::ordered_json()
                      : t.eos.size() == 1 ? nlohmann::ordered_json(t.eos[0])
                                          : nlohmann::ordered_json(t.eos);
  j["pad_token_id"] = id(t.pad);
}
}  // namespace detail

// config.json's fields for each model (transformers' names); absent fields keep
// the struct's defaults, as PretrainedConfig does.
inline void from_json(const nlohmann::json& j, gpt2_config& c) {
  const auto get = [&](const char* key, auto& field) {
    if (j.contains(key) && !j[key].is_null()) j[key].get_to(field);
  };
  get("vocab_size", c.vocab_size);
  get("n_positions", c.n_positions);
  get("n_embd", c.n_embd);
  get("n_layer", c.n_layer);
  get("n_head", c.n_head);
  get("n_inner", c.n_inner);
  get("resid_pdrop", c.resid_pdrop);
  get("embd_pdrop", c.embd_pdrop);
  get("attn_pdrop", c.attn_pdrop);
  get("layer_norm_epsilon", c.layer_norm_epsilon);
  get("initializer_range", c.initializer_range);
  get("tie_word_embeddings", c.tie_word_embeddings);
  detail::read_token_ids(j, c.tokens, "gpt2_config");
  // transformers' switches that change the attention's scores: only their defaults
  // (scores q.k / sqrt(head_dim)) are GPT-2's here.
  require(!j.contains("scale_attn_weights") || j["scale_attn_weights"] != false,
          "gpt2_config: scale_attn_weights false (unscaled scores) is not supported");
  require(!j.contains("scale_attn_by_inverse_layer_idx") || j["scale_attn_by_inverse_layer_idx"] != true,
          "gpt2_config: scale_attn_by_inverse_layer_idx true (scores also divided by layer + 1) is not supported");
  require(!j.contains("model_type") || j["model_type"] == "gpt2", "gpt2_config: model_type ",
          j.value("model_type", nlohmann::json()).dump(), " is not GPT-2: its own fields would go unread");
  // gelu_pytorch_tanh is the same tanh approximation, computed by PyTorch's kernel.
  if (j.contains("activation_function"))
    require(j["activation_function"] == "gelu_new" || j["activation_function"] == "gelu_pytorch_tanh",
            "gpt2_config: activation_function ", j["activation_function"].dump(),
            " is not supported (GPT-2's MLP uses gelu_new, the tanh approximation)");
}
// LlamaConfig's rope_scaling: {"rope_type" (or the older "type"): "linear" or
// "llama3", "factor", and llama3's "low_freq_factor", "high_freq_factor" and
// "original_max_position_embeddings" (an integer)}. Other kinds (dynamic, yarn,
// longrope) are refused, and so is a field missing that its kind needs. Both
// "type" and "rope_type" with different values are refused: transformers 4.4x
// reads the first, 5.x the second.
inline nn::rope_scaling rope_scaling_from(const nlohmann::json& j, std::string_view key = "rope_scaling") {
  const auto where = [&] { return cat("llama_config: ", key, " ", j.dump()); };
  require(j.is_object(), where(), " must be an object");
  for (const char* key : {"rope_type", "type"})
    require(!j.contains(key) || j[key].is_string(), where(), ": '", key, "' must be a string");
  require(!j.contains("rope_type") || !j.contains("type") || j["rope_type"] == j["type"], where(),
          ": 'type' and 'rope_type' differ (transformers 4.4x reads 'type', 5.x 'rope_type'); make them agree");
  const std::string type = j.contains("rope_type") ? j["rope_type"].get<std::string>()
                           : j.contains("type")    ? j["type"].get<std::string>()
                                                   : std::string();
  nn::rope_scaling r;
  if (type == "default" || (type.empty() && key == "rope_parameters")) return r;
  require(type == "linear" || type == "llama3", where(), ": rope_type '", type,
          "' is not supported (linear and llama3 are; dynamic, yarn and longrope are not)");
  const auto need = [&](const char* key) {
    require(j.contains(key) && j[key].is_number(), where(), ": ", type, " scaling needs a number '", key, "'");
    return j[key].get<double>();
  };
  r.type = type == "linear" ? nn::rope_scaling::kind::linear : nn::rope_scaling::kind::llama3;
  r.factor = need("factor");
  if (r.type == nn::rope_scaling::kind::llama3) {
    r.low_freq_factor = need("low_freq_factor");
    r.high_freq_factor = need("high_freq_factor");
    const double positions = need("original_max_position_embeddings");
    require(positions == std::floor(positions) && positions > 0 && positions <= 0x1p53, where(),
            ": original_max_position_embeddings must be a positive integer, got ", positions);
    r.original_max_position_embeddings = std::int64_t(positions);
  }
  nn::check_rotary({.head_dim = 2, .scaling = r}, where());
  return r;
}
inline nlohmann::ordered_json rope_scaling_json(const nn::rope_scaling& r) {
  using kind = nn::rope_scaling::kind;
  if (r.type == kind::none) return nullptr;
  if (r.type == kind::linear) return {{"rope_type", "linear"}, {"factor", r.factor}};
  return {{"rope_type", "llama3"},
          {"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position_embeddings", r.original_max_position_embeddings}};
}

inline void from_json(const nlohmann::json& j, llama_config& c) {
  const auto get = [&](const char* key, auto& field) {
    if (j.contains(key) && !j[key].is_null()) j[key].get_to(field);
  };
  get("vocab_size", c.vocab_size);
  get("hidden_size", c.hidden_size);
  get("intermediate_size", c.intermediate_size);
  get("num_hidden_layers", c.num_hidden_layers);
  get("num_attention_heads", c.num_attention_heads);
  get("num_key_value_heads", c.num_key_value_heads);
  get("head_dim", c.head_dim);
  get("max_position_embeddings", c.max_position_embeddings);
  get("rms_norm_eps", c.rms_norm_eps);
  get("rope_theta", c.rope_theta);
  get("initializer_range", c.initializer_range);
  get("attention_bias", c.attention_bias);
  get("mlp_bias", c.mlp_bias);
  get("attention_dropout", c.attention_dropout);
  get("tie_word_embeddings", c.tie_word_embeddings);
  detail::read_token_ids(j, c.tokens, "llama_config");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) c.rope_scaling = rope_scaling_from(j["rope_scaling"]);
  // transformers 5.x keeps rope_theta and the scaling together in rope_parameters; where
  // the older keys are there too they must say the same.
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& p = j["rope_parameters"];
    require(p.is_object(), "llama_config: rope_parameters ", p.dump(), " must be an object");
    if (p.contains("rope_theta")) {
      require(p["rope_theta"].is_number(), "llama_config: rope_parameters' rope_theta must be a number, got ",
              p["rope_theta"].dump());
      const double theta = p["rope_theta"].get<double>();
      require(!j.contains("rope_theta") || j["rope_theta"].is_null() || j["rope_theta"] == theta,
              "llama_config: rope_theta ", j.value("rope_theta", nlohmann::json()).dump(), " and rope_parameters' ",
              theta, " differ");
      c.rope_theta = theta;
    }
    const nn::rope_scaling r = rope_scaling_from(p, "rope_parameters");
    require(!j.contains("rope_scaling") || j["rope_scaling"].is_null() ||
                rope_scaling_json(c.rope_scaling) == rope_scaling_json(r),
            "llama_config: rope_scaling and rope_parameters differ: ", j.value("rope_scaling", nlohmann::json()).dump(),
            " against ", p.dump());
    c.rope_scaling = r;
  }
  require(!j.contains("model_type") || j["model_type"] == "llama", "llama_config: model_type ",
          j.value("model_type", nlohmann::json()).dump(), " is not LLaMA: its own fields would go unread");
  require(!j.contains("sliding_window") || j["sliding_window"].is_null(), "llama_config: sliding_window ",
          j.value("sliding_window", nlohmann::json()).dump(),
          " is not supported (LLaMA's attention sees every earlier position)");
  if (j.contains("hidden_act"))
    require(j["hidden_act"] == "silu", "llama_config: hidden_act ", j["hidden_act"].dump(), " is not supported (silu)");
}

// What transformers needs to rebuild the model with from_pretrained.
inline nlohmann::ordered_json hf_config_json(const gpt2_config& c) {
  nlohmann::ordered_json j = {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"activation_function", "gelu_new"},
          {"vocab_size", c.vocab_size},
          {"n_positions", c.n_positions},
          {"n_embd", c.n_embd},
          {"n_layer", c.n_layer},
          {"n_head", c.n_head},
          {"n_inner", c.n_inner > 0 ? nlohmann::ordered_json(c.n_inner) : nlohmann::ordered_json()},
          {"resid_pdrop", c.resid_pdrop},
          {"embd_pdrop", c.embd_pdrop},
          {"attn_pdrop", c.attn_pdrop},
          {"layer_norm_epsilon", c.layer_norm_epsilon},
          {"initializer_range", c.initializer_range},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"torch_dtype", "float32"}};
  detail::write_token_ids(j, c.tokens);
  return j;
}
inline nlohmann::ordered_json hf_config_json(const llama_config& c) {
  nlohmann::ordered_json j = {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_act", "silu"},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads > 0 ? c.num_key_value_heads : c.num_attention_heads},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", rope_scaling_json(c.rope_scaling)},
          {"initializer_range", c.initializer_range},
          {"attention_bias", c.attention_bias},
          {"mlp_bias", c.mlp_bias},
          {"attention_dropout", c.attention_dropout},
          {"head_dim", c.head_dim > 0 ? c.head_dim : c.hidden_size / c.num_attention_heads},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"torch_dtype", "float32"}};
  detail::write_token_ids(j, c.tokens);
  return j;
}

namespace detail {
// `dir_or_file`/`name` when it is a directory, else the file itself.
inline std::filesystem::path json_file(const std::filesystem::path& dir_or_file, std::string_view name) {
  return std::filesystem::is_directory(dir_or_file) ? dir_or_file / name : dir_or_file;
}
// f(the JSON in `path`); a file that cannot be opened ("cannot open " + `what`) or parsed,
// or a field of the wrong type, an io_error naming the file.
template <class F>
auto with_json(const std::filesystem::path& path, std::string_view what, F&& f) {
  std::ifstream in(path);
  if (!in) throw io_error(cat(path.string(), ": cannot open ", what));
  try {
    return f(nlohmann::json::parse(in));
  } catch (const nlohmann::json::exception& e) {
    throw io_error(cat(path.string(), ": ", e.what()));
  }
}
}  // namespace detail

// The config in `dir`/config.json (or the file itself).
template <class Config>
Config read_hf_config(const std::filesystem::path& dir_or_file) {
  return detail::with_json(detail::json_file(dir_or_file, "config.json"), "the model's config.json",
                           [](const nlohmann::json& j) {
                             Config c;
                             from_json(j, c);
                             return c;
                           });
}

// f(the config in `dir`/config.json, or the file itself), a gpt2_config or a llama_config
// by its model_type. Another type, or none, raises an io_error naming the file; so does a
// field the models refuse (from_json, and what building the model would check).
template <class F>
decltype(auto) visit_hf_config(const std::filesystem::path& dir_or_file, F&& f) {
  const auto path = detail::json_file(dir_or_file, "config.json");
  const auto config = detail::with_json(path, "the model's config.json", [&](const nlohmann::json& j) {
    const auto type = j.is_object() ? j.value("model_type", nlohmann::json()) : nlohmann::json();
    try {
      if (type == "gpt2") return std::variant<gpt2_config, llama_config>(detail::checked(j.get<gpt2_config>()));
      if (type == "llama") return std::variant<gpt2_config, llama_config>(detail::checked(j.get<llama_config>()));
    } catch (const error& e) {  // with_json names the file for JSON's own errors
      throw io_error(cat(path.string(), ": ", e.what()));
    }
    throw io_error(cat(path.string(), ": model_type ", type.is_null() ? "(none)" : type.dump(),
                       " is not one the library builds (\"gpt2\", \"llama\")"));
  });
  return std::visit(std::forward<F>(f), config);
}

// Hugging Face's load/save conventions for each model, from its config.
template <class T, class Space>
io::state_dict_options hf_options(const GPT2LMHeadModel<T, Space>& m, bool strict = true) {
  io::state_dict_options o = io::hf::gpt2(strict);
  if (!m.config().tie_word_embeddings) o.tied.clear();
  return o;
}
template <class T, class Space>
io::state_dict_options hf_options(const LlamaForCausalLM<T, Space>& m, bool strict = true) {
  return io::hf::llama(m.config().tie_word_embeddings, strict);
}

namespace detail {
// Options `o` for a model with LoRA adapters (nn::add_lora): its base layers read and
// written under the base model's names ("...c_attn.weight" for "...c_attn.base_layer.weight",
// transposed where those are), its adapters left out (they are not missing: PEFT's
// adapter files hold them, models/peft.hpp). A model without adapters keeps `o`.
template <class M>
io::state_dict_options without_lora(io::state_dict_options o, M& model) {
  const auto pairs = nn::peft_base_names(model);
  if (pairs.empty()) return o;
  o.names = io::name_map::chain(std::move(o.names), io::name_map::table(pairs));
  const std::size_t n = o.transposed.size();
  for (std::size_t i = 0; i < n; ++i)
    if (std::string s = o.transposed[i]; s.ends_with(".weight"))
      o.transposed.push_back(s.insert(s.size() - std::string_view(".weight").size(), ".base_layer"));
  std::set<std::string, std::less<>> adapters;
  for (const auto& [name, options] : nn::lora_modules(model))
    for (const char* leaf : {"lora_A.weight", "lora_B.weight"}) adapters.insert(nn::join_name(name, leaf));
  std::set<const void*> seen;  // a tied parameter once, under its first name (the holder's)
  model.parameters([&](std::string_view name, auto& p) {
    if (seen.insert(&p).second && !adapters.contains(name)) o.only.emplace_back(name);
  });
  return o;
}

// The model a parameter holder holds: a ShardedModel's model(), an nn::Replicated's layer().
template <class Holder>
auto& held_model(Holder& h) {
  if constexpr (requires { h.model(); }) return h.model();
  else return h.layer();
}

// Runs f on every rank of a ShardedModel, all agreeing on whether it failed (io_error
// on every rank, none left waiting in a collective), or on the one caller of an
// nn::Replicated (its failure an io_error too).
template <class Holder, class F>
void on_every_rank(Holder& h, std::string_view what, F&& f) {
  if constexpr (requires { h.comm(); }) {
    auto comm = io::detail::host_collectives_of(h);
    io::detail::on_all_ranks(comm, what, f);
  } else {
    try {
      f();
    } catch (const io_error&) {
      throw;
    } catch (const std::exception& e) {
      throw io_error(cat(what, ": ", e.what()));
    }
  }
}

// Runs f as the rank that writes: rank 0 of a ShardedModel, or the one caller of an
// nn::Replicated, failing on every rank as on_every_rank.
template <class Holder, class F>
void as_writer(Holder& h, std::string_view what, F&& f) {
  on_every_rank(h, what, [&] {
    if constexpr (requires { h.comm(); })
      if (h.comm().rank() != 0) return;
    f();
  });
}
}  // namespace detail

// Loads a checkpoint transformers wrote (a directory with model.safetensors or the
// sharded index, or one file) into the GPT-2 or LLaMA parameters `holder` keeps: a
// shard::ShardedModel (collective: every rank reads its own piece) or an
// nn::Replicated. Strict by default: every missing, unexpected or misshapen tensor
// raises io_error naming it; otherwise the report lists them. A model with LoRA
// adapters (nn::add_lora) loads the checkpoint into its base layers, as PEFT wraps a
// loaded model; its adapters keep their values and are not reported (models::load_peft
// reads them).
template <class Holder>
io::load_report load_hf(Holder& holder, const std::filesystem::path& dir_or_file, bool strict = true) {
  auto& model = detail::held_model(holder);
  return io::load_state_dict(dir_or_file, holder, detail::without_lora(hf_options(model, strict), model));
}

// Writes what save_pretrained writes into `dir`: config.json and model.safetensors
// (F32, metadata {"format": "pt"}, a tied lm_head.weight left out), or with
// max_shard_bytes > 0 the sharded layout with model.safetensors.index.json.
// Collective for a ShardedModel (rank 0 writes). A model with LoRA adapters writes its
// base layers under the base model's names (what from_pretrained reads), and not its
// adapters: nn::merge_lora first puts the fine-tune into them; models::save_peft writes
// the adapters as PEFT does.
template <class Holder>
void save_hf(Holder& holder, const std::filesystem::path& dir, std::uint64_t max_shard_bytes = 0) {
  auto& model = detail::held_model(holder);
  io::state_dict_options o = detail::without_lora(hf_options(model), model);
  o.max_shard_bytes = max_shard_bytes;
  detail::as_writer(holder, cat("creating ", dir.string()), [&] { std::filesystem::create_directories(dir); });
  io::save_state_dict(max_shard_bytes > 0 ? dir : dir / "model.safetensors", holder, o);
  detail::as_writer(holder, cat("writing ", (dir / "config.json").string()), [&] {
    io::detail::atomic_file f(dir / "config.json");
    f.write(io::detail::as_bytes(hf_config_json(model.config()).dump(2) + "\n"));
    f.commit();
  });
}

}  // namespace shardlib::models
