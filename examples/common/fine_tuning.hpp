// examples/common/fine_tuning.hpp — the language-model examples' fine-tuning flags
// (train_gpt, train_gpt_cuda): --init starts from a Hugging Face checkpoint (an earlier
// --save), --freeze keeps the parameters a list of globs names as they are (nn::freeze),
// and --lora trains LoRA adapters on the Linears it names with the rest frozen
// (nn::add_lora, PEFT's target_modules), --save then writing PEFT's adapter files;
// --no-frozen-grads keeps no gradients of the frozen parameters (shard::options::frozen_grads).
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/models/hf.hpp>
#include <shardlib/models/peft.hpp>
#include <shardlib/nn/freeze.hpp>
#include <shardlib/nn/lora.hpp>

#include <cstddef>
#include <cstdio>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/byte_models.hpp"
#include "common/flags.hpp"

namespace example {

struct fine_tune_settings {
  std::string init;                 // a Hugging Face checkpoint to start from
  std::vector<std::string> freeze;  // globs over the parameters' dotted names
  std::vector<std::string> lora;    // PEFT's target_modules
  long lora_r = 8;
  double lora_alpha = 16, lora_dropout = 0;
  bool no_frozen_grads = false;  // shard::options::frozen_grads = false
  shardlib::nn::lora_options lora_options() const { return {.r = lora_r, .alpha = lora_alpha, .dropout = lora_dropout}; }
};

inline void add_fine_tune_flags(command_line& cli, fine_tune_settings& s) {
  cli.add_option("--init", s.init, "a Hugging Face checkpoint to start from (config.json and model.safetensors, "
                 "an earlier --save or a GPT-2 or LLaMA from the Hub): the model is its config's, shape flags may only "
                 "repeat it")->check(CLI::ExistingDirectory);
  cli.add_option("--freeze", s.freeze, "parameters kept as they are: globs over dotted names ('*' any run of "
                 "characters), e.g. 'transformer.wte.*' 'transformer.h.0.*'");
  cli.add_option("--lora", s.lora, "train LoRA adapters on the Linears these name (PEFT's target_modules: a "
                 "module's last names or a glob, e.g. c_attn, or q_proj v_proj), everything else frozen; --save then "
                 "writes PEFT's adapter files");
  cli.add_option("--lora-r", s.lora_r, "--lora: the adapters' rank")->check(whole(1, 4096));
  cli.add_option("--lora-alpha", s.lora_alpha, "--lora: lora_alpha (the update is scaled by alpha / r)")
      ->check(positive());
  cli.add_option("--lora-dropout", s.lora_dropout, "--lora: dropout on the adapters' input, in training")
      ->check(real(0, 0.99));
  cli.add_flag("--no-frozen-grads", s.no_frozen_grads, "with --freeze or --lora: backward keeps no gradients of "
               "frozen parameters (shard::options::frozen_grads = false)");
}

// Freezes what --freeze names and adds what --lora asks for; rank 0 says how much.
template <class Model>
void prepare(Model& model, const fine_tune_settings& s, int rank, const char* program) {
  // Elements in all and those that train (GPT-2's tied head lists the embedding twice).
  const auto count = [&] {
    std::size_t all = 0, trained = 0;
    std::set<const void*> seen;
    model.parameters([&](std::string_view, auto& p) {
      if (!seen.insert(&p).second) return;
      all += p.numel();
      trained += p.requires_grad ? p.numel() : 0;
    });
    return std::pair{all, trained};
  };
  const std::size_t frozen = s.freeze.empty() ? 0 : shardlib::nn::freeze(model, s.freeze);
  const auto [before_all, before_trained] = count();
  std::vector<std::string> adapted;
  if (!s.lora.empty()) adapted = shardlib::nn::add_lora(model, s.lora, s.lora_options());
  if (rank != 0) return;
  const auto [all, still] = count();
  if (frozen > 0)
    std::printf("%s: frozen (--freeze): %zu parameters, %zu elements\n", program, frozen, before_all - before_trained);
  if (!adapted.empty())
    std::printf("%s: LoRA (--lora, r %ld, alpha %g, dropout %g): %zu Linears adapted, %zu of %zu elements trained "
                "(%.2f%%)\n", program, s.lora_r, s.lora_alpha, s.lora_dropout, adapted.size(), still, all,
                100.0 * double(still) / double(all));
}

// For the program's callback: a --freeze glob or --lora target that names nothing is a
// flag error, found before any rank or GPU starts (on a host model of the same shape:
// layers hold no storage).
template <class Settings>
void check_fine_tune(const Settings& s) {
  if (s.no_frozen_grads && s.freeze.empty() && s.lora.empty())
    throw CLI::ValidationError("--no-frozen-grads", "nothing is frozen (--freeze, --lora)");
  byte_model_shape shape = s;
  if (shape.vocab == 0) shape.vocab = 256;  // the data's is not known yet; names do not depend on it
  const auto check = [&](auto config) {
    if (!s.freeze.empty()) {
      auto m = make_byte_model<float, shardlib::host_space>(shape, config);
      try {
        shardlib::nn::freeze(m, s.freeze);
      } catch (const shardlib::error& e) {
        throw CLI::ValidationError("--freeze", e.what());
      }
    }
    if (!s.lora.empty()) {
      auto m = make_byte_model<float, shardlib::host_space>(shape, config);
      try {
        shardlib::nn::add_lora(m, s.lora, s.lora_options());
      } catch (const shardlib::error& e) {
        throw CLI::ValidationError("--lora", e.what());
      }
    }
  };
  if (s.model == "llama") check(std::type_identity<shardlib::models::llama_config>{});
  else check(std::type_identity<shardlib::models::gpt2_config>{});
}

// --init: the checkpoint into the sharded model (its base layers, with --lora).
template <class Sharded>
void load_init(Sharded& sharded, const fine_tune_settings& s) {
  if (!s.init.empty()) shardlib::models::load_hf(sharded, s.init);
}

// --save: the model as Hugging Face's from_pretrained reads it, or with --lora the
// adapters as PEFT's save_pretrained writes them (the base is --init's). What it wrote.
template <class Sharded>
const char* save(Sharded& sharded, const fine_tune_settings& s, const std::string& dir) {
  if (s.lora.empty()) {
    shardlib::models::save_hf(sharded, dir);
    return "Hugging Face checkpoint";
  }
  shardlib::models::save_peft(sharded, dir);
  return "PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors)";
}

}  // namespace example
