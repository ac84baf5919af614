// examples/common/checkpointing.hpp — sharded checkpoints in the language-model examples
// (train_gpt, train_gpt_cuda): --checkpoint-dir and --checkpoint-every save the model and
// its optimizer state while training goes on (io::async_save_checkpoint, each save waited
// for before the next and at the end), --resume continues from one at any world size.
#pragma once
#include <shardlib/io/checkpoint.hpp>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "common/flags.hpp"

namespace example {

struct checkpoint_settings {
  std::string checkpoint_dir;  // root of the checkpoints: root/step-<8 digits>
  long checkpoint_every = 0;   // 0: none
  std::string resume;          // a checkpoint, or a root whose latest is loaded
};

inline void add_checkpoint_flags(command_line& cli, checkpoint_settings& s) {
  cli.add_option("--checkpoint-dir", s.checkpoint_dir, "where sharded checkpoints go (DIR/step-NNNNNNNN, the last 2 kept)");
  cli.add_option("--checkpoint-every", s.checkpoint_every,
                 "save a sharded checkpoint every this many steps, written while training goes on (0: never)")
      ->check(whole(0, max_size));
  cli.add_option("--resume", s.resume,
                 "continue from this sharded checkpoint, or the latest under this directory: parameters, optimizer "
                 "state and step, at any --world")
      ->check(CLI::ExistingDirectory);
}

// For the program's callback: --checkpoint-every needs a directory.
inline void check_checkpoint_settings(const checkpoint_settings& s) {
  if (s.checkpoint_every > 0 && s.checkpoint_dir.empty())
    throw CLI::ValidationError("--checkpoint-every", "needs --checkpoint-dir");
}

// The step training goes on from: 0, or the resumed checkpoint's step count.
template <class Sharded, class O>
long resume(Sharded& sharded, O& opt, const checkpoint_settings& s, const char* program) {
  if (s.resume.empty()) return 0;
  const auto r = shardlib::io::load_checkpoint(s.resume, sharded, opt);
  if (sharded.comm().rank() == 0)
    std::printf("%s: resumed from %s (saved by %d ranks) at step %llu\n", program, r.path.c_str(),
                r.metadata.world_size, static_cast<unsigned long long>(sharded.steps()));
  return static_cast<long>(sharded.steps());
}

// A checkpoint every checkpoint_every steps, each written in the background until the
// next save or finish() waits for it (both collective, like the save).
template <class Sharded, class O>
class periodic_checkpoints {
 public:
  periodic_checkpoints(Sharded& sharded, O& opt, const checkpoint_settings& s, const char* program)
      : sharded_(sharded), opt_(opt), s_(s), program_(program) {}

  // After step `step` (0-based) has been taken.
  void after_step(long step) {
    if (s_.checkpoint_every == 0 || (step + 1) % s_.checkpoint_every != 0) return;
    finish();
    pending_.emplace(shardlib::io::async_save_checkpoint(s_.checkpoint_dir, sharded_, opt_, {.keep_last = 2}));
  }
  void finish() {
    if (!pending_) return;
    const auto path = pending_->wait();
    pending_.reset();
    if (sharded_.comm().rank() == 0) std::printf("%s: checkpoint %s written\n", program_, path.c_str());
  }

 private:
  using pending_type = decltype(shardlib::io::async_save_checkpoint(std::declval<const std::filesystem::path&>(),
                                                                    std::declval<Sharded&>(), std::declval<O&>()));
  Sharded& sharded_;
  O& opt_;
  const checkpoint_settings& s_;
  const char* program_;
  std::optional<pending_type> pending_;
};

}  // namespace example
