// examples/common/freezing.hpp — --freeze in the language-model examples (train_gpt,
// train_gpt_cuda): the parameters a list of globs names are frozen before the model is
// wrapped (nn::freeze), so training leaves them as they are.
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/nn/freeze.hpp>

#include <cstddef>
#include <cstdio>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "common/byte_models.hpp"
#include "common/flags.hpp"

namespace example {

struct freeze_settings {
  std::vector<std::string> freeze;  // globs over the parameters' dotted names
};

inline void add_freeze_flag(command_line& cli, freeze_settings& s) {
  cli.add_option("--freeze", s.freeze, "parameters kept as they are: globs over dotted names ('*' any run of "
                 "characters), e.g. 'transformer.wte.*' 'transformer.h.0.*'");
}

// For the program's callback: a glob that names no parameter is a flag error, found before
// any rank or GPU starts (on a host model of the same shape: layers hold no storage).
template <class Settings>
void check_freeze(const Settings& s) {
  if (s.freeze.empty()) return;
  try {
    if (s.model == "llama") {
      auto m = make_byte_model<float, shardlib::host_space>(s, std::type_identity<shardlib::models::llama_config>{});
      shardlib::nn::freeze(m, s.freeze);
    } else {
      auto m = make_byte_model<float, shardlib::host_space>(s, std::type_identity<shardlib::models::gpt2_config>{});
      shardlib::nn::freeze(m, s.freeze);
    }
  } catch (const shardlib::error& e) {
    throw CLI::ValidationError("--freeze", e.what());
  }
}

// Freezes what --freeze names; rank 0 says how much (GPT-2's tied head lists the embedding
// twice: each parameter counts once).
template <class Model>
void freeze(Model& model, const freeze_settings& s, int rank, const char* program) {
  const std::size_t frozen = shardlib::nn::freeze(model, s.freeze);
  if (rank != 0 || frozen == 0) return;
  std::size_t elements = 0;
  std::set<const void*> seen;
  model.parameters([&](std::string_view, auto& p) {
    if (!p.requires_grad && seen.insert(&p).second) elements += p.numel();
  });
  std::printf("%s: frozen (--freeze): %zu parameters, %zu elements\n", program, frozen, elements);
}

}  // namespace example
