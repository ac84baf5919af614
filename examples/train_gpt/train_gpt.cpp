// train_gpt — a byte-level GPT-2 (models::GPT2LMHeadModel, vocabulary 256: one token
// per byte; or, with --model llama, a LLaMA: RMSNorm, RoPE, SwiGLU, grouped-query
// attention) trained on a text file, or on llm.c's token files (--tokens, --val-tokens:
// GPT-2's or LLaMA 3's tokens, the vocabulary theirs), sharded over --world rank threads, or one rank
// per process under tools/launch, torchrun, Slurm or mpirun (FullShard, every transformer block its own unit, GPT-2's tied head with the embedding in the root), AdamW
// with linear warmup and cosine decay, gradients clipped to norm 1. It prints
// "Rank r, Step s, Loss: x" every --every steps as train_fsdp does, the loss on a
// held-out tail of the data (or --val-tokens) every --eval-every steps, its unigram entropy (the
// loss of the best model that ignores context: what "learned something" must beat), a
// continuation sampled with the KV cache at the end, and saves the model as Hugging
// Face's GPT2LMHeadModel or LlamaForCausalLM would (config.json + model.safetensors, --save
// DIR), which transformers loads with from_pretrained(DIR). With --checkpoint-dir and
// --checkpoint-every it saves sharded checkpoints while it trains; --resume goes on from one.
// --reshard-to R keeps 1/R of each block from its forward to its backward, which gathers it
// within groups of R ranks (shard::policy::reshard_to); the losses are the same.
// --grad-accum K makes each step K micro-batches of --batch sequences per rank (train_step
// over them: the windows of one batch K times as large), --no-sync reduces their gradients
// once, --no-reshard-after-backward keeps the blocks gathered between them.
// Fine-tuning: --init DIR starts from a Hugging Face checkpoint (an earlier --save, or a
// GPT-2 or LLaMA from the Hub: the model is the one its config.json describes),
// --freeze PATTERN... keeps the parameters it names as they are (nn::freeze), and --lora
// TARGET... trains LoRA adapters on the Linears it names, everything else frozen
// (nn::add_lora; --save then writes PEFT's adapter files, which PeftModel.from_pretrained
// puts on the --init model):
//
//   train_gpt --save base && train_gpt --init base --lora c_attn --lr 1e-3 --save adapter
#include <shardlib/comm/run.hpp>
#include <shardlib/models/hf.hpp>
#include <shardlib/models/sharded_generate.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/schedule.hpp>
#include <shardlib/shard/sharded_model.hpp>
#if SHARDLIB_EXAMPLE_WITH_MPI
#include <shardlib/comm/mpi_backend.hpp>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "common/byte_models.hpp"
#include "common/checkpointing.hpp"
#include "common/flags.hpp"
#include "common/fine_tuning.hpp"
#include "common/launched.hpp"
#include "common/lm_run.hpp"
#include "common/memory_report.hpp"
#include "common/sharding_flags.hpp"
#include "common/text_corpus.hpp"
#include "common/text_sample.hpp"

using namespace shardlib;

namespace {

struct settings : example::byte_model_shape, example::lm_run_settings, example::sample_settings,
                  example::checkpoint_settings, example::fine_tune_settings, example::sharding_settings {
  std::string save = "train_gpt_model";
  long world = 4;
};

using example::corpus;
using example::windows;

template <class Sharded, comm::Communicator C>
double validation_loss(Sharded& sharded, C& c, const corpus& data, long seq, long per_rank) {
  // Windows evenly spread over the tail, split between the ranks; the mean over all.
  const long total = per_rank * c.size();
  const std::size_t span = data.val.positions(seq);
  std::vector<std::size_t> starts;
  for (long i = c.rank() * per_rank; i < (c.rank() + 1) * per_rank; ++i) starts.push_back(span * std::size_t(i) / std::size_t(total));
  const auto [x, y] = windows(data.val, starts, seq);
  sharded.eval();  // no activations kept, every unit freed after use
  std::vector<double> loss{double(nn::cross_entropy(sharded.forward(x), y).loss)};
  sharded.train();
  c.all_reduce(std::span<double>(loss), comm::reduce_op::avg);
  return loss[0];
}

template <class Config, comm::Communicator C>
void train(C& c, const settings& s, const corpus& data) {
  auto model = example::make_byte_model<float, host_space>(s, std::type_identity<Config>{});
  example::prepare(model, s, c.rank(), "train_gpt");
  using model_t = decltype(model);
  auto sharded = shard::fully_shard<optim::AdamW>(
      model, c, example::full_shard(s),
      {.wrap = shard::wrap_types<typename model_t::block_type>{}, .seed = s.seed, .frozen_grads = !s.no_frozen_grads});
  optim::AdamW adamw{{.lr = s.lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = s.weight_decay}};
  const optim::warmup_cosine schedule = example::lr_schedule(s);
  const double entropy = data.unigram_entropy();
  const std::size_t parameters = nn::parameter_count(model);  // GPT-2's tied head's weight once
  if (c.rank() == 0)
    std::printf("train_gpt: %s, %zu %ss (%zu training, %zu held out); unigram entropy %.4f nats = %.4f bits per "
                "%s\ntrain_gpt: %s%s, %zu parameters (%ld layers, d_model %ld, %ld heads, context %ld, vocabulary "
                "%ld, dropout %g) in %zu units, FullShard over %d ranks%s, %ld sequences per rank\n",
                data.source.c_str(), data.train.size() + data.val.size(), data.unit(), data.train.size(),
                data.val.size(), entropy, entropy / std::log(2.0), data.unit(), s.model.c_str(),
                s.config.empty() ? "" : " (--init's config)", parameters, s.layers, s.d_model, s.heads, s.seq, s.vocab,
                example::dropout_of(model.config()), sharded.unit_count(), c.size(), example::sharding_note(s).c_str(),
                s.batch);

  example::load_init(sharded, s);
  const long first = example::resume(sharded, adamw, s, "train_gpt");  // batches and schedule go on from its step
  example::periodic_checkpoints checkpoints(sharded, adamw, s, "train_gpt");
  const auto t0 = std::chrono::steady_clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const counter_rng draws(s.seed, fnv1a("train_gpt batches"));
  const std::size_t positions = data.train.positions(s.seq);
  float loss = 0;
  double val = 0, eval_s = 0;  // eval_s: the validation passes' share of the time
  for (long step = first; step < s.steps; ++step) {
    std::vector<Tensor<std::int64_t>> xs, ys;  // this rank's micro-batches of the step
    for (long k = 0; k < s.grad_accum; ++k) {
      auto [x, y] = windows(
          data.train, example::step_starts(draws, step, c.size(), c.rank(), s.batch, s.grad_accum, k, positions), s.seq);
      xs.push_back(std::move(x));
      ys.push_back(std::move(y));
    }
    adamw.options.lr = schedule(step);
    loss = example::train_step(sharded, adamw, xs, ys, nn::cross_entropy, s,
                               {.max_norm = 1.0f, .loss = shard::loss_report::local});
    checkpoints.after_step(step);
    if (step % s.every == 0 || step + 1 == s.steps) std::printf("Rank %d, Step %ld, Loss: %f\n", c.rank(), step, double(loss));
    if ((step + 1) % s.eval_every == 0 || step + 1 == s.steps) {
      const double before = seconds();
      val = validation_loss(sharded, c, data, s.seq, s.batch);
      eval_s += seconds() - before;
      if (c.rank() == 0)
        std::printf("train_gpt: step %ld, %.1f s, validation loss %.4f nats per %s (unigram entropy %.4f)\n",
                    step + 1, seconds(), val, data.unit(), entropy);
    }
  }
  checkpoints.finish();
  if (first >= s.steps) {  // resumed at the end: nothing to train, the held-out loss still measured
    const double before = seconds();
    val = validation_loss(sharded, c, data, s.seq, s.batch);
    eval_s += seconds() - before;
  }
  const double trained_s = seconds() - eval_s;
  if (c.rank() == 0) example::print_peaks("train_gpt", 0, current_ledger());  // training and validation's

  if (c.rank() == 0)
    std::printf("train_gpt: %ld steps in %.1f s of training (%.3f s/step; validation excluded); final training "
                "loss %.4f (rank 0's batch), validation %.4f nats per %s = %.2f bits, unigram entropy %.4f nats = "
                "%.2f bits\n",
                s.steps - first, trained_s, trained_s / double(std::max(s.steps - first, 1L)), double(loss), val,
                data.unit(), val / std::log(2.0), entropy, entropy / std::log(2.0));
  if (s.sample > 0) {  // a continuation of the held-out text's first paragraph (or its first tokens), every rank
                       // alike (each forward is collective)
    const Tensor<std::int64_t> prompt = example::sample_prompt(data, s.seq);
    example::sample_printer printer("train_gpt", s, data, prompt, c.rank() == 0);  // rank 0 prints as it comes
    auto options = example::sample_options(s, long(prompt.dim(1)), s.seq, s.seed);
    options.on_tokens = std::ref(printer);
    models::generate(sharded, prompt, options);  // in eval, the ranks checked to agree
    printer.end();
  }
  const char* saved = s.save.empty() ? nullptr : example::save(sharded, s, s.save);
  if (saved && c.rank() == 0) std::printf("train_gpt: %s written to %s\n", saved, s.save.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a launcher's pipe gets each line as it comes
  settings s;
  example::command_line cli("A byte-level GPT-2 (or LLaMA) trained on a text file, or one over llm.c's token "
                            "files, FullShard over --world rank threads (or a rank per process under tools/launch, "
                            "torchrun, Slurm or mpirun), every block a unit; validation on held-out data, a sample, a "
                            "Hugging Face checkpoint.",
                            "train_gpt");
  cli.add_option("--world", s.world, "ranks, as threads of this process (under a launcher: one per process)")
      ->check(example::whole(1, std::numeric_limits<int>::max()));
  example::add_byte_model_flags(cli, s);
  example::add_lm_run_flags(cli, s);
  example::add_sample_flags(cli, s);
  cli.add_option("--save", s.save, "directory for the Hugging Face checkpoint (empty: none)");
  example::add_fine_tune_flags(cli, s);
  example::add_checkpoint_flags(cli, s);
  example::add_sharding_flags(cli, s);
  cli.callback([&] {
    example::check_accumulation_flags(s);
    // Rank threads: --world is the world. Under a launcher the world is the launcher's (--reshard-to
    // checked as the model is sharded).
    const bool threads = example::ranks_are_threads(cli, s.world);
    if (threads && s.reshard_to > 0 && s.world % s.reshard_to != 0)
      throw CLI::ValidationError("--reshard-to", shardlib::cat(s.reshard_to, " does not divide --world ", s.world));
    example::check_lm_run(cli, s);
    example::take_init_shape(cli, s, s.init);
    example::check_byte_model(s);
    example::check_checkpoint_settings(s);
    example::check_fine_tune(s);
  });
  cli.parse_or_exit(argc, argv);
  try {
    corpus data = example::read_corpus(s, s.seq);
    example::use_vocab(s, data, "train_gpt");
    const auto body = [&](auto& c) {
      if (s.model == "llama") train<models::llama_config>(c, s, data);
      else train<models::gpt2_config>(c, s, data);
    };
    const comm::run_options options{.threads = int(s.world)};
#if SHARDLIB_EXAMPLE_WITH_MPI
    comm::run_from_environment(body, options, comm::mpi_backend{});
#else
    comm::run_from_environment(body, options);
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
