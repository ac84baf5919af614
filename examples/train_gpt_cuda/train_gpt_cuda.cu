// train_gpt_cuda — train_gpt on GPUs: a byte-level GPT-2 (or, with --model llama,
// a LLaMA: RMSNorm, RoPE, SwiGLU, grouped-query attention) trained on a text
// file, or on llm.c's token files (--tokens), the model in device memory (cuda_space), layers computing in bfloat16
// over fp32 master weights and AdamW state (optim::cuda::AdamW), FullShard over
// NCCL with every block its own unit, linear warmup and cosine decay, gradients
// clipped to norm 1. It prints "Rank r, Step s, Loss: x" every --every steps,
// the held-out loss every --eval-every steps, the throughput at the end, and a
// continuation of a held-out prompt sampled on the GPUs with the KV cache. With
// --checkpoint-dir and --checkpoint-every it saves sharded checkpoints while it trains
// (the shards copied to the host, the files written in the background); --resume goes on
// from one, saved at any world size (train_gpt's too: the files are the same). --init,
// --freeze and --lora fine-tune as train_gpt's do (LoRA's products in bfloat16 too).
//
//   train_gpt_cuda                                  one GPU (world size 1)
//   mpirun -np 8 train_gpt_cuda                     one process per GPU (device = local rank)
//   tools/launch -n 8 train_gpt_cuda                the same without MPI (torchrun-style
//                                                   variables, NCCL's id through the TCP store)
//   mpirun -np 16 train_gpt_cuda --reshard-to 8     two nodes of 8: backward gathers each block
//                                                   within a node (shard::policy::reshard_to)
//   train_gpt_cuda --batch 4 --grad-accum 8         steps of 8 micro-batches of 4 sequences per GPU
//                  [--no-sync] [--no-reshard-after-backward]     (train_step over them)
//   --model llama --dtype fp32 --data FILE          ...
//   --tokens 'fineweb_train_*.bin' --val-tokens fineweb_val_000000.bin --layers 12 --d-model 768
//   --heads 12 --seq 1024 --vocab 50304             GPT-2 124M on llm.c's FineWeb tokens
//
// Differences from train_gpt: the validation loss is the mean over the ranks'
// windows through NCCL.
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/core/random.hpp>
#include <shardlib/cuda.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/models/cuda.cuh>
#include <shardlib/models/hf.hpp>
#include <shardlib/models/sharded_generate.hpp>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/optim/schedule.hpp>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/byte_models.hpp"
#include "common/checkpointing.hpp"
#include "common/flags.hpp"
#include "common/fine_tuning.hpp"
#include "common/lm_run.hpp"
#include "common/memory_report.hpp"
#include "common/sharding_flags.hpp"
#include "common/device_world.cuh"
#include "common/text_corpus.hpp"
#include "common/text_sample.hpp"

namespace sl = shardlib;  // not `using namespace`: CUDA declares a global `half`

namespace {

struct settings : example::byte_model_shape, example::lm_run_settings, example::sample_settings,
                  example::checkpoint_settings, example::fine_tune_settings, example::sharding_settings {
  settings() {
    d_model = 256;
    heads = 8;
    seq = 256;
    batch = 8;
    steps = 300;
    lr = 2e-3;
  }
  std::string dtype = "bf16", save;
  bool no_frozen_masters = false;  // shard::options::frozen_masters = false
};

using example::corpus;

// Device ids = tokens[start, start + seq) and targets = the tokens after them, for each start.
std::pair<sl::Tensor<std::int64_t, sl::cuda_space>, sl::Tensor<std::int64_t, sl::cuda_space>> device_windows(
    const example::token_runs& tokens, const std::vector<std::size_t>& starts, long seq) {
  const auto [ids, targets] = example::windows(tokens, starts, seq);
  return {sl::cuda::to_device(ids), sl::cuda::to_device(targets)};
}

template <class T>
sl::shard::mixed_precision compute_precision() {
  if constexpr (std::is_same_v<T, float>) return {};
  else return {.param = sl::dtype_of<T>, .reduce = sl::dtype::f32};
}

template <class T, class Config>
void train(const sl::comm::NcclComm& nccl, const settings& s, const corpus& data) {
  sl::cuda::stream compute(nccl.device());
  sl::cuda::stream_scope on_compute(compute.get());  // where tensors are allocated and layers run
  auto c = nccl.on(compute.get());                   // collectives ordered after that stream's work
  auto model = example::make_byte_model<T, sl::cuda_space>(s, std::type_identity<Config>{});
  example::prepare(model, s, c.rank(), "train_gpt_cuda");
  using model_t = decltype(model);
  auto sharded = sl::shard::fully_shard<sl::optim::cuda::AdamW>(
      model, c, example::full_shard(s),
      {.wrap = sl::shard::wrap_types<typename model_t::block_type>{},
       .seed = s.seed,
       .precision = compute_precision<T>(),
       .frozen_masters = !s.no_frozen_masters,
       .frozen_grads = !s.no_frozen_grads});
  sl::optim::cuda::AdamW adamw{{.lr = s.lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = s.weight_decay}};
  const sl::optim::warmup_cosine schedule = example::lr_schedule(s);
  const double entropy = data.unigram_entropy();
  if (c.rank() == 0)
    std::printf("train_gpt_cuda: %s, %zu %ss (%zu training, %zu held out); unigram entropy %.4f nats per %s\n"
                "train_gpt_cuda: %s%s, %zu parameters (%ld layers, d_model %ld, %ld heads, context %ld, vocabulary "
                "%ld, dropout %g), %s compute, FullShard over %d GPU(s) (NCCL)%s, %zu units, %ld sequences per rank\n",
                data.source.c_str(), data.train.size() + data.val.size(), data.unit(), data.train.size(),
                data.val.size(), entropy, data.unit(), s.model.c_str(), s.config.empty() ? "" : " (--init's config)",
                sl::nn::parameter_count(model), s.layers, s.d_model, s.heads, s.seq, s.vocab,
                example::dropout_of(model.config()), s.dtype.c_str(), c.size(), example::sharding_note(s).c_str(),
                sharded.unit_count(), s.batch);

  // The held-out windows, evenly spread over the tail and split between the
  // ranks; the mean of the ranks' mean losses.
  const auto validation_loss = [&] {
    const long total = s.batch * c.size();
    const std::size_t span = data.val.positions(s.seq);
    std::vector<std::size_t> starts;
    for (long i = c.rank() * s.batch; i < (c.rank() + 1) * s.batch; ++i)
      starts.push_back(span * std::size_t(i) / std::size_t(total));
    const auto [x, y] = device_windows(data.val, starts, s.seq);
    sharded.eval();  // no activations kept, every unit freed after use
    sl::Tensor<float> mine({1});
    mine[0] = sl::nn::cross_entropy(sharded.forward(x), y).loss;
    sharded.train();
    auto all = sl::cuda::to_device(mine);
    c.all_reduce(all.span(), sl::comm::reduce_op::avg);
    float v = 0;
    sl::cuda::copy_async(std::span<float>(&v, 1), std::span<const float>(all.span()), compute.get());
    sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (validation loss)");
    return double(v);
  };

  const sl::counter_rng draws(s.seed, sl::fnv1a("train_gpt batches"));
  const std::size_t positions = data.train.positions(s.seq);
  example::load_init(sharded, s);
  const long first = example::resume(sharded, adamw, s, "train_gpt_cuda");  // batches and schedule go on from its step
  example::periodic_checkpoints checkpoints(sharded, adamw, s, "train_gpt_cuda");
  const auto t0 = std::chrono::steady_clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  float loss = 0;
  double val = 0, eval_s = 0;  // eval_s: the validation passes' share of the time
  for (long step = first; step < s.steps; ++step) {
    std::vector<sl::Tensor<std::int64_t, sl::cuda_space>> xs, ys;  // this rank's micro-batches of the step
    for (long k = 0; k < s.grad_accum; ++k) {
      auto [x, y] = device_windows(
          data.train, example::step_starts(draws, step, c.size(), c.rank(), s.batch, s.grad_accum, k, positions), s.seq);
      xs.push_back(std::move(x));
      ys.push_back(std::move(y));
    }
    adamw.options.lr = schedule(step);
    const auto r = example::train_step(sharded, adamw, xs, ys, sl::nn::cross_entropy, s,
                                       {.max_norm = 1.0f, .loss = sl::shard::loss_report::local});
    checkpoints.after_step(step);
    if (step % s.every == 0 || step + 1 == s.steps) {
      loss = r.loss;  // waits for this step's loss only when printed
      std::printf("Rank %d, Step %ld, Loss: %f\n", c.rank(), step, double(loss));
    }
    if ((step + 1) % s.eval_every == 0 || step + 1 == s.steps) {
      // The steps queued before it count as training: wait for them first.
      sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (before validation)");
      const double before = seconds();
      val = validation_loss();
      eval_s += seconds() - before;
      if (c.rank() == 0)
        std::printf("train_gpt_cuda: step %ld, %.1f s, validation loss %.4f nats per %s (unigram entropy %.4f)\n",
                    step + 1, seconds(), val, data.unit(), entropy);
    }
  }
  checkpoints.finish();
  if (first >= s.steps) {  // resumed at the end: nothing to train, the held-out loss still measured
    const double before = seconds();
    val = validation_loss();
    eval_s += seconds() - before;
  }
  sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (end of training)");
  const double trained_s = seconds() - eval_s;
  if (c.rank() == 0) example::print_peaks("train_gpt_cuda", 0, sl::current_ledger());  // training and validation's
  const long trained = std::max(s.steps - first, 1L);
  const double tokens = double(trained) * double(s.grad_accum * s.batch) * double(s.seq) * double(c.size());
  if (c.rank() == 0)
    std::printf("train_gpt_cuda: %ld steps in %.1f s of training (%.1f ms/step, %.0f tokens/s over %d GPU(s); "
                "validation excluded); final training loss "
                "%.4f (rank 0's batch), validation %.4f nats per %s, unigram entropy %.4f\n",
                s.steps - first, trained_s, 1e3 * trained_s / double(trained), tokens / trained_s, c.size(),
                double(loss), val, data.unit(), entropy);
  if (s.sample > 0) {  // every rank alike (each forward is collective); the cache and the logits on the device
    const sl::Tensor<std::int64_t> prompt = example::sample_prompt(data, s.seq);
    const long prompt_len = long(prompt.dim(1));
    example::sample_printer printer("train_gpt_cuda", s, data, prompt, c.rank() == 0);  // rank 0 prints as it comes
    auto options = example::sample_options(s, prompt_len, s.seq, s.seed);
    options.on_tokens = std::ref(printer);
    const double before_sample = seconds();
    const auto out = sl::models::generate(sharded, prompt, options);
    const double sample_s = seconds() - before_sample;
    printer.end();
    if (c.rank() == 0)
      std::printf("train_gpt_cuda: sampled %lld %ss in %.3f s (%.1f ms per %s, the KV cache on the GPU, printing "
                  "included)\n",
                  static_cast<long long>(out.dim(1) - prompt_len), data.unit(), sample_s,
                  1e3 * sample_s / double(std::max<std::int64_t>(out.dim(1) - prompt_len, 1)), data.unit());
  }
  const char* saved = s.save.empty() ? nullptr : example::save(sharded, s, s.save);
  if (c.rank() != 0) return;
  if (saved) std::printf("train_gpt_cuda: %s written to %s\n", saved, s.save.c_str());
}

void train(const sl::comm::NcclComm& nccl, const settings& s, const corpus& data) {
  const bool llama = s.model == "llama";
  if (s.dtype == "bf16") {
    if (llama) train<sl::bfloat16, sl::models::llama_config>(nccl, s, data);
    else train<sl::bfloat16, sl::models::gpt2_config>(nccl, s, data);
  } else {
    if (llama) train<float, sl::models::llama_config>(nccl, s, data);
    else train<float, sl::models::gpt2_config>(nccl, s, data);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a launcher's pipe gets each line as it comes
  settings s;
  example::command_line cli("train_gpt on GPUs: a byte-level GPT-2 (or LLaMA) on a text file, or one over llm.c's "
                            "token files, bf16 compute over fp32 "
                            "masters, AdamW, FullShard over NCCL; one GPU, or one process per GPU under mpirun or "
                            "tools/launch.",
                            "train_gpt_cuda");
  example::add_byte_model_flags(cli, s);
  cli.add_option("--dtype", s.dtype, "compute dtype")->check(CLI::IsMember({"bf16", "fp32"}));
  example::add_lm_run_flags(cli, s);
  example::add_sample_flags(cli, s);
  cli.add_option("--save", s.save, "directory for a Hugging Face checkpoint (empty: none)");
  example::add_checkpoint_flags(cli, s);
  example::add_sharding_flags(cli, s);
  example::add_fine_tune_flags(cli, s);
  cli.add_flag("--no-frozen-masters", s.no_frozen_masters, "--dtype bf16 with --freeze or --lora: keep the frozen "
               "parameters in bf16 alone, without fp32 masters (4 bytes per frozen element less)");
  cli.callback([&] {
    example::check_accumulation_flags(s);
    example::check_lm_run(cli, s);
    example::take_init_shape(cli, s, s.init);
    example::check_byte_model(s);
    example::check_checkpoint_settings(s);
    example::check_fine_tune(s);
    if (s.no_frozen_masters && (s.dtype == "fp32" || (s.freeze.empty() && s.lora.empty())))
      throw CLI::ValidationError("--no-frozen-masters", s.dtype == "fp32" ? "fp32 layers' values are their masters"
                                                                          : "nothing is frozen (--freeze, --lora)");
  });
  cli.parse_or_exit(argc, argv);
  try {
    if (const std::string problem = sl::cuda::device_problem(); !problem.empty())
      throw sl::error(sl::cat("no usable GPU: ", problem));
    corpus data = example::read_corpus(s, s.seq);
    example::use_vocab(s, data, "train_gpt_cuda");
    example::on_device_world(argc, argv, [&](const sl::comm::NcclComm& nccl, auto&&) { train(nccl, s, data); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
