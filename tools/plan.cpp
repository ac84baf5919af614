// shardlib-plan — per-rank memory by category and bytes sent per step for every sharding
// strategy, and which strategies fit a device, fastest first (docs/planner.md).
//
//   shardlib-plan --article
//       the FSDP article's scenario: a 6e9-parameter transformer on 4 ranks, Adam, fp32
//       and bf16 mixed precision, DDP / ZeRO-1 / ZeRO-2 / FSDP, with the arithmetic to check
//   shardlib-plan --params 6e9 --layers 28 --hidden 4096 --heads 16 --seq 2048 --batch 1 [common flags]
//       a coarse transformer: blocks of 12·hidden² parameters, the rest in the root
//   shardlib-plan --model gpt2-124m|gpt2-350m|llama-7b|llama-70b|CONFIG [--seq 2048] [--batch 1]
//                 [--frozen-layers 16 | --lora q_proj v_proj [--lora-r 8]] [--no-frozen-masters]
//                 [--no-frozen-grads] [common flags]
//       a published decoder's architecture, or the GPT-2 or LLaMA a Hugging Face config.json
//       describes (CONFIG: the file or its folder), its parameters counted tensor by tensor
//       and laid out as the engine lays them out, each block a unit; --seq defaults to the
//       context it was trained with (a config's n_positions or max_position_embeddings); --frozen-layers N
//       plans a fine-tune with the embeddings and the lower N blocks frozen, --lora one of
//       LoRA adapters on the projections it names (nn::add_lora), everything else frozen
//   shardlib-plan --encoder --layers 4 --d-model 256 --heads 4 --ff 1024 --classes 10 --seq 16 --batch 8
//                 [--dropout 0.1] [--frozen-layers 2] [common flags]
//       the model train_fsdp and bench_strategies train, walked exactly as fully_shard wraps
//       it, its activations measured by one unsharded step on this machine
//   common flags: --world 4 | --worlds 1,2,4,8   --strategy all|full|grad-op|optimizer|none|hybrid
//                 --group 2 --prefetch 1 --keep-gathered 1 --reshard-to 8 --param f32 --reduce f32
//                 --grad-accum 4 [--no-sync] [--no-reshard-after-backward] [--no-replica-all-reduce]
//                 (micro-batches of --batch per step)
//                 --step-batch 16 (sequences per rank and step: the chooser splits them into the
//                 fewest micro-batches that fit, for each strategy)
//                 --compute f32|bf16|f16
//                 --fused-attention (--model, --params: the device layers' attention)
//                 --optimizer adam|amsgrad|momentum|sgd
//                 --memory 80 (GB) --bandwidth 100 (GB/s per rank) --flops 100 (TFLOP/s per rank)
//                 --node-size 8 --node-bandwidth 450 (GB/s per rank within a node)
//                 --json FILE (one JSON line per strategy and world)
// --compute defaults to the param dtype for --params (an engine computing in it, as on
// GPUs) and to f32 for --encoder (the host engine computes in fp32).
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>
#include <shardlib/plan/chooser.hpp>
#include <shardlib/plan/describe.hpp>
#include <shardlib/plan/hf_config.hpp>
#include <shardlib/plan/lora.hpp>
#include <shardlib/plan/memory_plan.hpp>
#include <shardlib/plan/presets.hpp>
#include <shardlib/plan/transformer.hpp>
#include <shardlib/plan/zero_states.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/flags.hpp"
#include "common/reference_model.hpp"

using namespace shardlib;

namespace {

// Parameters the planner takes at the most: a thousand times today's largest models, so that
// every byte count it computes (a few tens of bytes per parameter) stays far inside 64 bits.
constexpr double max_params = 1e15;

struct settings : example::accumulation_flags {
  bool article = false, encoder = false, fused_attention = false;
  bool no_frozen_masters = false;  // shard::options::frozen_masters = false
  bool no_frozen_grads = false;    // shard::options::frozen_grads = false
  std::string preset;  // --model: a preset's name or a config.json's path
  std::optional<plan::decoder_shape> decoder;  // --model's, read once while the flags are checked
  long frozen_layers = 0;  // --frozen-layers
  long keep_gathered = 0;  // --keep-gathered: the last N units
  int reshard_to = 0;      // --reshard-to: shard::policy::reshard_to of FullShard and HybridShard
  std::vector<std::string> lora;  // --lora: target modules
  long lora_r = 8;
  double params = 0;  // 0: the blocks alone
  long hidden = 0, batch = 8;
  long step_batch = 0;  // --step-batch: the chooser splits it into the fewest micro-batches that fit
  // --encoder's model; --params reads its --layers, --heads and --seq.
  example::model_flags model{.layers = 4, .d_model = 256, .heads = 4, .ff = 1024, .classes = 10, .seq = 16};
  int world = 4, group = 2, prefetch = 1;
  bool group_given = false;  // --group: the chooser tries that group size alone
  std::vector<int> worlds;
  std::string strategy = "all", param = "f32", reduce = "f32", compute, optimizer = "adam", json;
  double memory = 80, bandwidth = 100, flops = 100;
  int node_size = 0;          // --node-size: ranks per node
  double node_bandwidth = 0;  // --node-bandwidth: GB/s within a node
};

// --model's decoder: a preset, or the one the config.json at that path describes (named
// by the path, which `s` holds).
plan::decoder_shape decoder_of(const settings& s) {
  for (const auto& m : plan::decoder_presets)
    if (m.name == s.preset) return m;
  return plan::read_decoder_shape(s.preset, s.preset);
}

dtype parse_type(std::string s) {
  for (auto& ch : s) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  return parse_dtype(s);
}

settings parse(int argc, char** argv) {
  settings s;
  using example::whole;
  example::command_line cli("Per-rank memory by category and bytes sent per step for every sharding strategy, and "
                            "which strategies fit a device, fastest first (docs/planner.md).",
                            "shardlib-plan");
  cli.footer(
      "Models: --article, the FSDP article's scenario; --model NAME|CONFIG, a published GPT-2 or LLaMA, or the one a\n"
      "Hugging Face config.json describes (the file or its folder; --seq defaults to its context, --batch to 1;\n"
      "--frozen-layers N freezes its embeddings and lower N blocks, --lora TARGET...\n"
      "plans LoRA adapters on the projections it names, the rest frozen);\n"
      "--params N --layers L --hidden H --seq S [--heads A] [--batch B], a coarse transformer of blocks of\n"
      "12 hidden^2 parameters, the rest in the root (heads and batch default to 1); --encoder [--layers --d-model\n"
      "--heads --ff --classes --seq --batch --dropout --frozen-layers], the model train_fsdp and bench_strategies\n"
      "train, walked exactly as fully_shard wraps it.");
  auto* article = cli.add_flag("--article", s.article, "the FSDP article's scenario, with the arithmetic to check");
  auto* encoder = cli.add_flag("--encoder", s.encoder, "train_fsdp's model")->excludes(article);
  std::vector<std::string> presets;
  for (const auto& m : plan::decoder_presets) presets.emplace_back(m.name);
  auto* preset = cli.add_option("--model", s.preset,
                                "a published decoder language model, or a Hugging Face config.json of a GPT-2 or "
                                "LLaMA (the file or its folder; a preset's name is the preset: ./NAME for a folder "
                                "of that name)")
                     ->check(CLI::Validator(
                         [presets](std::string& v) {
                           if (std::find(presets.begin(), presets.end(), v) != presets.end() ||
                               std::filesystem::exists(v))
                             return std::string();
                           std::string known;
                           for (const auto& p : presets) known += cat(known.empty() ? "" : ", ", p);
                           return cat(v, " is neither a preset (", known, ") nor a config.json or a folder holding one");
                         },
                         "NAME|CONFIG"))
                     ->excludes(article)
                     ->excludes(encoder);
  auto* frozen_layers =
      cli.add_option("--frozen-layers", s.frozen_layers,
                     "a fine-tune with the lower N blocks frozen: no gradients reduced or kept, no optimizer state "
                     "(--model: the embeddings too, and those blocks run forward only; --encoder: its lower N layers)")
          ->check(whole(0, example::max_size))
          ->excludes(article);
  auto* lora = cli.add_option("--lora", s.lora,
                              "--model: a LoRA fine-tune, adapters on the projections these name (PEFT's "
                              "target_modules, e.g. q_proj v_proj, or c_attn), everything else frozen")
                   ->excludes(frozen_layers)
                   ->excludes(article);
  cli.add_option("--lora-r", s.lora_r, "--lora: the adapters' rank")->check(whole(1, 1 << 16))->needs(lora);
  cli.add_flag("--no-frozen-masters", s.no_frozen_masters,
               "16-bit layers with --frozen-layers or --lora: frozen parameters keep no fp32 master "
               "(shard::options::frozen_masters = false)")
      ->excludes(article);
  cli.add_flag("--no-frozen-grads", s.no_frozen_grads,
               "with --frozen-layers or --lora: backward keeps no gradients of frozen parameters "
               "(shard::options::frozen_grads = false)")
      ->excludes(article);
  auto* params = cli.add_option("--params", s.params, "parameters of the coarse transformer (default: its blocks alone)")
      ->check(example::positive(max_params))
      ->default_str("")
      ->excludes(article)
      ->excludes(encoder)
      ->excludes(preset);
  auto* hidden = cli.add_option("--hidden", s.hidden, "hidden size of the coarse transformer")
                     ->check(whole(1, example::max_size))
                     ->default_str("")
                     ->excludes(encoder)
                     ->excludes(preset);
  example::add_model_flags(cli, s.model);
  for (const char* shape_flag : {"--layers", "--d-model", "--heads", "--ff", "--classes", "--dropout"})
    preset->excludes(cli.get_option(shape_flag));  // the preset fixes the architecture; --seq may change
  for (const char* encoder_flag : {"--d-model", "--ff", "--classes", "--dropout"})  // the coarse transformer's
    params->excludes(cli.get_option(encoder_flag));                               // blocks are 12·hidden²
  auto* batch = cli.add_option("--batch", s.batch, "sequences per rank")->check(whole(1, example::max_size));
  auto* world = cli.add_option("--world", s.world, "ranks")->check(whole(1, example::max_size))->excludes(article);
  cli.add_option("--worlds", s.worlds, "world sizes, comma-separated")
      ->delimiter(',')
      ->check(whole(1, example::max_size))
      ->excludes(world)
      ->excludes(article);
  cli.add_option("--strategy", s.strategy, "strategies to plan")
      ->check(CLI::IsMember({"all", "full", "grad-op", "optimizer", "none", "hybrid"}))
      ->excludes(article);
  cli.add_option("--group", s.group, "HybridShard: ranks one replica is sharded over")
      ->check(whole(1, example::max_size));
  cli.add_option("--prefetch", s.prefetch, "units gathered ahead")->check(whole(0, example::max_size))->excludes(article);
  cli.add_option("--keep-gathered", s.keep_gathered,
                 "the last N units stay gathered from their forward to their backward (shard::options::keep_gathered; "
                 "FSDP2's reshard_after_forward=False)")
      ->check(whole(0, example::max_size))
      ->excludes(article);
  cli.add_option("--reshard-to", s.reshard_to,
                 "FullShard and HybridShard: after forward each unit keeps 1/R of its full values, gathered again "
                 "within groups of R ranks in backward (shard::policy::reshard_to; FSDP2's reshard_after_forward=R, "
                 "ZeRO++'s hpZ); R divides the world and --group")
      ->check(whole(1, example::max_size))
      ->excludes(article);
  auto* accum = example::add_accumulation_flags(cli, s, true)->excludes(article);
  cli.add_option("--step-batch", s.step_batch,
                 "sequences per rank and step: the chooser splits them, for each strategy, into the fewest "
                 "micro-batches that fit (run as --no-sync and the like say); the table plans them as one batch")
      ->check(whole(1, example::max_size))
      ->excludes(batch)
      ->excludes(accum)
      ->excludes(article);
  for (const char* shaping : {"--no-sync", "--no-reshard-after-backward", "--no-replica-all-reduce"})
    cli.get_option(shaping)->remove_needs(accum);  // they shape --step-batch's micro-batches too
  const auto dtypes = CLI::IsMember({"f32", "bf16", "f16"}, CLI::ignore_case);
  cli.add_option("--param", s.param, "all-gather dtype")->check(dtypes)->excludes(article);
  cli.add_option("--reduce", s.reduce, "gradient reduction dtype")->check(dtypes)->excludes(article);
  cli.add_option("--compute", s.compute, "compute dtype (default: --param's, f32 with --encoder)")->check(dtypes);
  cli.add_flag("--fused-attention", s.fused_attention,
               "the device layers' fused attention: no stored seq x seq weights, a float log-sum-exp per query "
               "(--model and --params; the host layers keep the weights)")
      ->excludes(encoder)
      ->excludes(article);
  cli.add_option("--optimizer", s.optimizer, "optimizer state to plan for")
      ->check(CLI::IsMember({"adam", "adamw", "amsgrad", "momentum", "sgd"}))
      ->excludes(article);
  cli.add_option("--memory", s.memory, "device memory per rank, GB")->check(example::positive())->excludes(article);
  cli.add_option("--bandwidth", s.bandwidth, "what one rank sends, GB/s (across nodes, with --node-size)")
      ->check(example::positive())
      ->excludes(article);
  auto* node_bandwidth = cli.add_option("--node-bandwidth", s.node_bandwidth,
                                        "what one rank sends within a node, GB/s (NVLink's bus bandwidth, say)")
                             ->check(example::positive());
  cli.add_option("--node-size", s.node_size,
                 "ranks per node: the chooser times collectives within a node at --node-bandwidth, the others at "
                 "--bandwidth")
      ->check(whole(1, example::max_size))
      ->needs(node_bandwidth)
      ->excludes(article);
  node_bandwidth->needs(cli.get_option("--node-size"));
  cli.add_option("--flops", s.flops, "sustained compute per rank, TFLOP/s")->check(example::positive())->excludes(article);
  cli.add_option("--json", s.json, "writes one JSON line per strategy and world size")->excludes(article);
  cli.callback([&] {
    if (s.article) return;
    if (s.step_batch > 0) s.batch = s.step_batch;
    for (const auto& [flag, given] : {std::pair{"--no-frozen-masters", s.no_frozen_masters},
                                      std::pair{"--no-frozen-grads", s.no_frozen_grads}})
      if (given && s.frozen_layers == 0 && s.lora.empty())
        throw CLI::ValidationError(flag, "nothing is frozen (--frozen-layers, --lora)");
    if (s.no_frozen_masters &&
        parse_type(!s.compute.empty() ? s.compute : s.encoder ? std::string("f32") : s.param) == dtype::f32)
      throw CLI::ValidationError("--no-frozen-masters", "fp32 layers' values are their masters (16-bit compute: "
                                                        "--param bf16 or --compute bf16)");
    s.group_given = cli.get_option("--group")->count() > 0;
    for (int w : s.worlds.empty() ? std::vector<int>{s.world} : s.worlds) {
      if (s.group_given && w % s.group != 0)
        throw CLI::ValidationError("--group", cat(s.group, " does not divide the world size ", w));
      if (s.reshard_to > 0 && w % s.reshard_to != 0)
        throw CLI::ValidationError("--reshard-to", cat(s.reshard_to, " does not divide the world size ", w));
      if (s.node_size > 0 && w > s.node_size && w % s.node_size != 0)
        throw CLI::ValidationError("--node-size", cat(s.node_size, " does not divide the world size ", w));
    }
    if (s.step_batch <= 1) example::check_accumulation_flags(s);  // --step-batch N > 1 may split
    if (s.reshard_to > 0 && s.group_given && s.group % s.reshard_to != 0)
      throw CLI::ValidationError("--reshard-to", cat(s.reshard_to, " does not divide the group size ", s.group));
    // Every model here makes one unit per block (layer) beside the root.
    const auto check_kept = [&](long layers) {
      if (s.keep_gathered > layers)
        throw CLI::ValidationError("--keep-gathered", cat(s.keep_gathered, " is more than the ", layers,
                                                          " units besides the root"));
    };
    if (!s.preset.empty()) {
      try {
        s.decoder = decoder_of(s);
        (void)plan::decoder(*s.decoder);  // the shape's own checks
      } catch (const error& e) {
        throw CLI::ValidationError("--model", e.what());
      }
      const plan::decoder_shape& m = *s.decoder;
      const long layers = m.layers;
      check_kept(layers);
      if (s.frozen_layers > layers)
        throw CLI::ValidationError("--frozen-layers", cat(s.frozen_layers, " is more than ", s.preset, "'s ", layers,
                                                          " blocks"));
      if (cli.get_option("--seq")->count() == 0) s.model.seq = 0;  // the preset's
      if (batch->count() == 0 && s.step_batch == 0) s.batch = 1;
      if (s.lora.empty()) return;
      try {
        (void)plan::with_lora(plan::decoder(m), m, s.lora, s.lora_r);
      } catch (const error& e) {
        throw CLI::ValidationError("--lora", e.what());
      }
      return;
    }
    if (lora->count() > 0) throw CLI::ValidationError("--lora", "plans a published decoder's fine-tune (--model)");
    if (s.encoder) {
      example::check_model_flags(s.model);
      check_kept(s.model.layers);
      if (s.frozen_layers > s.model.layers)
        throw CLI::ValidationError("--frozen-layers", cat(s.frozen_layers, " is more than the encoder's ",
                                                          s.model.layers, " layers"));
      return;
    }
    if (frozen_layers->count() > 0)
      throw CLI::ValidationError("--frozen-layers", "a coarse transformer has no layers to freeze (--model or --encoder)");
    for (auto* o : {cli.get_option("--layers"), hidden, cli.get_option("--seq")})
      if (o->count() == 0) throw CLI::ValidationError(o->get_name(), "a coarse transformer needs it (or --encoder)");
    check_kept(s.model.layers);
    if (cli.get_option("--heads")->count() == 0) s.model.heads = 1;
    if (batch->count() == 0 && s.step_batch == 0) s.batch = 1;
    const double blocks = 12 * double(s.hidden) * double(s.hidden) * double(s.model.layers);
    if (blocks > max_params)
      throw CLI::ValidationError("--hidden", cat(s.model.layers, " blocks of hidden size ", s.hidden, " have ", blocks,
                                                 " parameters, more than ", max_params));
  });
  cli.parse_or_exit(argc, argv);
  return s;
}

std::size_t optimizer_bytes(const std::string& o) {
  if (o == "adam" || o == "adamw") return plan::adam_state_bytes;
  if (o == "amsgrad") return plan::adam_amsgrad_state_bytes;
  if (o == "momentum") return plan::sgd_momentum_state_bytes;
  return plan::sgd_state_bytes;  // "sgd"
}

std::vector<plan::strategy> strategies(const std::string& s) {
  using plan::strategy;
  if (s == "all") return {std::begin(plan::all_strategies), std::end(plan::all_strategies)};
  const std::map<std::string, strategy> by_flag{{"full", strategy::full_shard},
                                                {"grad-op", strategy::shard_grad_op},
                                                {"optimizer", strategy::shard_optimizer},
                                                {"none", strategy::no_shard},
                                                {"hybrid", strategy::hybrid_shard}};
  return {by_flag.at(s)};
}

// The model train_fsdp and bench_strategies train, each encoder layer a unit.
plan::model_desc encoder_model(const settings& s) {
  const long layers = s.model.layers, d = s.model.d_model, seq = s.model.seq, batch = s.batch;
  example::Model shape = example::reference_model(s.model);
  example::freeze_lower_layers(shape, s.frozen_layers);
  auto desc = plan::describe_model(shape, shard::wrap_types<example::Encoder>{});
  example::Model probe = example::reference_model(s.model);
  example::freeze_lower_layers(probe, s.frozen_layers);  // frozen layers keep no inputs for their weights
  desc.activation_bytes = plan::measure_activations(probe, [&](nn::context& ctx) {
    Tensor<float> x({batch, seq, d});  // sizes, not values, decide what is allocated
    Tensor<std::int64_t> y({batch});
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 0.f;
    for (std::int64_t i = 0; i < batch; ++i) y[i] = 0;
    auto out = ctx.forward(probe, x);
    ctx.backward(probe, nn::cross_entropy(out, y).grad);
  });
  // FLOPs as for plan::transformer: 6 per parameter per token plus attention's scores.
  const double tokens = double(batch * seq);
  desc.flops = 6 * double(desc.parameters()) * tokens + 12 * double(layers * d * seq) * tokens;
  return desc;
}

// 124439808 -> "124,439,808".
std::string grouped(std::size_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Decimal units, one for the whole table, so every column reads alike.
struct unit {
  const char* name;
  double scale;
};
unit unit_for(double largest) {
  return largest >= 1e9 ? unit{"GB", 1e9} : largest >= 1e6 ? unit{"MB", 1e6} : unit{"kB", 1e3};
}
std::string in(unit u, double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", bytes / u.scale);
  return b;
}

void print_model(const plan::model_desc& d, const char* activations_note) {
  std::printf("# model: %zu flat elements in %zu units (root %zu", d.parameters(), d.units.size(), d.units[0]);
  for (std::size_t i = 1; i < d.units.size(); ++i)
    if (i == 1 || d.units[i] != d.units[i - 1]) {
      std::size_t same = 1;
      while (i + same < d.units.size() && d.units[i + same] == d.units[i]) ++same;
      std::printf("; %zu x %zu", same, d.units[i]);
    }
  std::printf("); activations %s (%s); %.3g FLOP per rank and batch\n",
              plan::detail::human(double(d.activation_bytes)).c_str(), activations_note, d.flops);
  if (const auto kept = std::count(d.kept_gathered.begin(), d.kept_gathered.end(), true); kept > 0)
    std::printf("# units kept gathered from forward to backward: the last %td\n", kept);
  if (d.frozen.empty()) return;
  std::size_t elements = 0, wholly = 0, forward_only = 0;
  for (const auto& f : d.frozen) {
    for (const auto& [lo, hi] : f.ranges) elements += hi - lo;
    wholly += f.all;
    forward_only += f.no_backward;
  }
  std::printf("# frozen: %s elements; %zu units wholly, %zu of them forward only\n", grouped(elements).c_str(), wholly,
              forward_only);
}

void print_setup(const plan::setup& s) {
  const plan::accumulation& acc = s.accumulation;
  const std::string accumulation =
      acc.micro_batches == 1 ? std::string()
                             : cat("; ", acc.micro_batches, " micro-batches per step",
                                   acc.no_sync ? ", reduced once (no_sync)" : ", each reduced",
                                   acc.keep_after_backward ? ", units kept gathered after backward" : "",
                                   acc.replica_all_reduce ? "" : ", HybridShard's replicas averaged once");
  std::printf(
      "# W = %d ranks, optimizer state %zu B/parameter, fp32 master%s%s; gather %s, reduce %s, compute %s; "
      "prefetch %d%s\n",
      s.world, s.optimizer_bytes, s.frozen_masters ? "" : " (none for frozen parameters of wholly frozen and packed units)",
      s.frozen_grads ? "" : ", no gradients of frozen parameters",
      std::string(name(s.precision.param)).c_str(),
      std::string(name(s.precision.reduce)).c_str(), std::string(name(s.precision.compute)).c_str(), s.prefetch,
      accumulation.c_str());
}

// The strategy column: wide enough for the longest label (groups, reshard_to).
int label_width(const std::vector<plan::setup>& setups) {
  std::size_t w = 34;
  for (const auto& s : setups) w = std::max(w, plan::label(s).size());
  return int(w);
}

// With 16-bit parameters: the model states as the ZeRO paper counts them, read off
// each strategy's policy (plan::zero_model_states), beside the plan's total. The rest
// is what the paper leaves out: activations, gathered copies, full gradients in
// flight, scratch, and the engine's fp32 reduced-gradient piece and 16-bit copy of
// the master piece.
void print_model_states(const plan::model_desc& d, const std::vector<plan::setup>& setups, const unit& u) {
  if (!d.frozen.empty()) {
    std::printf("\n# model states as the ZeRO paper counts them: not compared, its arithmetic trains every parameter\n");
    return;
  }
  const double psi = double(d.parameters()), b = double(size_of(setups.front().precision.param));
  const double k = double(plan::master_bytes + setups.front().optimizer_bytes);
  std::printf("\n# model states as the ZeRO paper counts them: %g B/parameter 16-bit parameters, %g 16-bit gradients,\n"
              "# K = %g of optimizer state (fp32 master and moments), each / N_d where the policy shards it at the peak\n",
              b, b, k);
  const int w = label_width(setups);
  std::printf("%-*s %10s %10s %10s %12s %10s %10s\n", w, cat("strategy (", u.name, " per rank)").c_str(), "parameters",
              "gradients", "optimizer", "model states", "the rest", "total");
  for (const plan::setup& s : setups) {
    auto m = plan::zero_model_states(s.resolved(), s.world, psi, k, s.accumulation);
    m.parameters *= b / 2;
    m.gradients *= b / 2;
    const double total = double(plan::make_plan(d, s).memory.total());
    std::printf("%-*s %10s %10s %10s %12s %10s %10s\n", w, plan::label(s).c_str(), in(u, m.parameters).c_str(),
                in(u, m.gradients).c_str(), in(u, m.optimizer).c_str(), in(u, m.total()).c_str(),
                in(u, total - m.total()).c_str(), in(u, total).c_str());
  }
}

// "total" sums the category peaks: an upper bound of the peak.
void print_table(const plan::model_desc& d, const plan::setup& base, const std::vector<plan::strategy>& which,
                 std::FILE* json) {
  std::vector<plan::setup> setups;
  double largest = 0;
  for (plan::strategy st : which) {
    plan::setup s = base;
    s.strategy = st;
    if (st == plan::strategy::hybrid_shard && (s.group < 1 || s.world % s.group != 0)) continue;
    if (st == plan::strategy::hybrid_shard && s.reshard_to > 0 && s.group % s.reshard_to != 0) {
      std::printf("# %s: not planned, --reshard-to %d does not divide its group\n", plan::label(s).c_str(),
                  s.reshard_to);
      continue;
    }
    setups.push_back(s);
    largest = std::max(largest, double(plan::make_plan(d, s).memory.total()));
  }
  const unit u = unit_for(largest);
  const int w = label_width(setups);
  std::printf("%-*s %10s %10s %10s %10s %11s %8s %9s %10s\n", w, cat("strategy (", u.name, " per rank)").c_str(),
              "parameters", "gradients", "optimizer", "gathered", "activations", "scratch", "total", "sent/step");
  for (const plan::setup& s : setups) {
    const auto p = plan::make_plan(d, s);
    const auto& m = p.memory;
    std::printf("%-*s %10s %10s %10s %10s %11s %8s %9s %10s\n", w, plan::label(s).c_str(),
                in(u, double(m.parameters)).c_str(), in(u, double(m.gradients)).c_str(),
                in(u, double(m.optimizer_state)).c_str(), in(u, double(m.gathered_parameters)).c_str(),
                in(u, double(m.activations)).c_str(), in(u, double(m.comm_scratch)).c_str(),
                in(u, double(m.total())).c_str(), in(u, p.sent.total()).c_str());
    if (!json) continue;
    std::string bytes = "{";
    for (int k = 0; k < category_count; ++k) bytes += cat("\"", name(category(k)), "\":", m[category(k)], ",");
    bytes += cat("\"total\":", m.total(), "}");
    std::fprintf(json,
                 "{\"bench\":\"plan\",\"strategy\":\"%s\",\"world\":%d,\"group\":%d,\"reshard_to\":%d,\"prefetch\":%d,"
                 "\"micro_batches\":%d,\"no_sync\":%s,\"keep_after_backward\":%s,\"replica_all_reduce\":%s,"
                 "\"param\":\"%s\","
                 "\"reduce\":\"%s\",\"compute\":\"%s\",\"units\":%zu,\"parameters\":%zu,\"bytes\":%s,"
                 "\"sent_bytes\":%.9g,\"sent_by\":{\"all_gather\":%.9g,\"reduce_scatter\":%.9g,\"all_reduce\":%.9g},"
                 "\"sent_within_reshard_groups\":%.9g}\n",
                 std::string(name(s.strategy)).c_str(), s.world, s.shard_group(), s.resolved().reshard_to, s.prefetch,
                 s.accumulation.micro_batches, s.accumulation.no_sync ? "true" : "false",
                 s.accumulation.keep_after_backward ? "true" : "false", s.accumulation.replica_all_reduce ? "true" : "false",
                 std::string(name(s.precision.param)).c_str(), std::string(name(s.precision.reduce)).c_str(),
                 std::string(name(s.precision.compute)).c_str(), d.units.size(), d.parameters(), bytes.c_str(),
                 p.sent.total(), p.sent.all_gather, p.sent.reduce_scatter, p.sent.all_reduce,
                 p.sent.within_reshard_groups);
  }
  for (const plan::setup& s : setups)
    if (const double within = plan::make_plan(d, s).sent.within_reshard_groups; within > 0)
      std::printf("# %s: %s of the bytes sent per step stay within groups of %d ranks (backward's all-gathers)\n",
                  plan::label(s).c_str(), cat(in(u, within), " ", u.name).c_str(), s.resolved().reshard_to);
  for (const plan::setup& s : setups)
    if (const std::string why = plan::engine_refusal(s); !why.empty())
      std::printf("# %s: the formula only; the engine refuses it: %s\n", plan::label(s).c_str(), why.c_str());
  if (!setups.empty() && base.precision.param != dtype::f32) print_model_states(d, setups, u);
}

// `how`: what the choice varies beyond the strategy, if anything.
void print_choice(const std::vector<plan::choice>& choices, const plan::machine& mc, const std::string& how = "") {
  std::printf("\n# which fits %g GB per rank, sending %g GB/s%s and computing %g TFLOP/s per rank%s (fastest first)\n",
              mc.memory_bytes / 1e9, mc.link_bytes_per_s / 1e9,
              mc.node_size > 0 ? cat(" across nodes and ", mc.node_link_bytes_per_s / 1e9, " GB/s within nodes of ",
                                     mc.node_size, " ranks").c_str()
                               : "",
              mc.flops_per_s / 1e12, how.c_str());
  for (const auto& c : choices) std::printf("%s %s\n", c.fits ? "+" : "-", c.why.c_str());
}

// The model at `batch` sequences per rank: its units, activations and FLOPs (`decoder`
// is --model's, when given).
plan::model_desc describe(const settings& s, const std::optional<plan::decoder_shape>& decoder,
                          const plan::precision& p, long batch) {
  plan::model_desc d;
  if (decoder) {
    const plan::decoder_shape& m = *decoder;
    d = plan::decoder(m, batch, s.model.seq, p.compute, s.fused_attention);
    if (s.frozen_layers > 0) d = plan::with_frozen_prefix(d, m, s.frozen_layers, batch, s.model.seq, p.compute);
    if (!s.lora.empty()) d = plan::with_lora(d, m, s.lora, s.lora_r, batch, s.model.seq, p.compute);
  } else if (s.encoder) {
    settings at = s;
    at.batch = batch;
    d = encoder_model(at);
  } else {
    d = plan::transformer({.parameters = s.params,
                           .layers = s.model.layers,
                           .hidden = s.hidden,
                           .heads = s.model.heads,
                           .seq = s.model.seq,
                           .batch = batch,
                           .fused_attention = s.fused_attention},
                          p.compute);
  }
  if (s.keep_gathered > 0) {
    d.kept_gathered.assign(d.units.size(), false);
    std::fill(d.kept_gathered.end() - s.keep_gathered, d.kept_gathered.end(), true);
  }
  return d;
}

void article() {
  // GPT-J's shape: 28 blocks of hidden size 4096 and 16 heads; 6e9 parameters in all.
  const plan::transformer_shape shape{
      .parameters = 6e9, .layers = 28, .hidden = 4096, .heads = 16, .seq = 2048, .batch = 1};
  const std::vector<plan::strategy> which{plan::strategy::no_shard, plan::strategy::shard_optimizer,
                                          plan::strategy::shard_grad_op, plan::strategy::full_shard};
  std::printf(
      "# The FSDP article's scenario: a 6B-parameter transformer (28 blocks, hidden 4096, 16 heads) on 4 ranks,\n"
      "# Adam, one 2048-token sequence per rank. Per rank, GB = 1e9 bytes; 'sent' = bytes one rank sends per step.\n");
  const plan::precision fp32{}, bf16 = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16});
  for (const auto& [title, p] :
       {std::pair{"fp32", fp32}, std::pair{"bf16 mixed precision (fp32 master and Adam)", bf16}}) {
    const auto d = plan::transformer(shape, p.compute);
    std::printf("\n## %s\n", title);
    print_model(d, "estimate");
    print_table(d, {.world = 4, .precision = p}, which, nullptr);
  }
  std::printf(
      "\n# check by hand (Ψ = 6e9, W = 4; a block is 12·4096² = 201,326,592 parameters, the root 362,855,424):\n"
      "#   fp32 parameters 4 B·Ψ = 24 GB (the article says 12), sharded 24/4 = 6 GB;\n"
      "#   Adam 8 B·Ψ = 48 GB, sharded 12 GB.\n"
      "#   ZeRO-1 shards only the optimizer state: 24 + 24 (+ 6, the reduced quarter it steps) + 12 GB.\n"
      "#   ZeRO-2 shards the optimizer state too (every stage does; the article says it stays replicated) and the\n"
      "#   gradients: 6 GB + the root's and two blocks' full gradients, 4 B·(362,855,424 + 2·201,326,592) = 3.062 GB;\n"
      "#   ShardGradOp keeps every unit gathered from forward to backward (24 GB); FullShard only the root and two\n"
      "#   blocks (3.062 GB).\n"
      "#   bf16: 16 B per parameter under DDP (fp32 master 4, bf16 copy 2, bf16 gradients 2, Adam 8) = 96 GB.\n"
      "#   sent: all-reduce 2·(3/4)·24 GB = 36 GB; reduce-scatter + all-gather (3/4)·(24 + 24) = 36 GB; FullShard\n"
      "#   gathers the blocks again in backward: (3/4)·4 B·(2Ψ - root) + 18 = 52.9 GB.\n"
      "#   activations (Korthikanti et al. 2022): 28·2048·4096·(34 + 5·16·2048/4096) B = 17.381 GB in 16 bits.\n");
  const plan::machine mc{.memory_bytes = 80e9, .link_bytes_per_s = 200e9, .flops_per_s = 150e12};
  print_choice(plan::choose(plan::transformer(shape, dtype::bf16), {.world = 4, .precision = bf16}, mc), mc);
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
  try {
    if (s.article) {
      article();
      return 0;
    }
    plan::precision p{.param = parse_type(s.param), .reduce = parse_type(s.reduce)};
    p.compute = !s.compute.empty() ? parse_type(s.compute) : s.encoder ? dtype::f32 : p.param;
    const std::optional<plan::decoder_shape>& decoder = s.decoder;
    if (decoder) {
      const plan::decoder_shape& m = *decoder;
      const std::string head = m.head_size() * m.heads != m.hidden ? cat(", head size ", m.head_size()) : std::string();
      const std::string biases = m.attention_bias || m.mlp_bias
                                     ? cat(", biases on ", m.attention_bias ? "attention" : "",
                                           m.attention_bias && m.mlp_bias ? " and " : "", m.mlp_bias ? "MLP" : "")
                                     : std::string();
      std::printf("# %s: %s, %ld layers, hidden %ld, %ld heads (%ld kv)%s, vocab %ld, intermediate %ld%s, seq %ld, "
                  "%s: %s parameters\n",
                  std::string(m.name).c_str(), m.family == plan::family::gpt2 ? "GPT-2" : "LLaMA", m.layers, m.hidden,
                  m.heads, m.kv_heads, head.c_str(), m.vocab, m.intermediate, biases.c_str(),
                  s.model.seq > 0 ? s.model.seq : m.seq, m.tied ? "head tied to the embedding" : "untied head",
                  grouped(plan::parameters(m)).c_str());
    }
    const plan::model_desc d = describe(s, decoder, p, s.batch);
    std::FILE* json = s.json.empty() ? nullptr : std::fopen(s.json.c_str(), "w");
    require(s.json.empty() || json, "shardlib-plan: cannot write ", s.json);
    const char* note = s.encoder ? "measured, one unsharded step"
                       : s.preset.empty()
                           ? (s.fused_attention ? "estimate, fused attention: no seq x seq weights kept" : "estimate")
                           : (s.fused_attention ? "the library's layers, fused attention: no seq x seq weights kept"
                                                : "the library's layers");
    print_model(d, note);
    const plan::machine mc{
        .memory_bytes = s.memory * 1e9, .link_bytes_per_s = s.bandwidth * 1e9, .flops_per_s = s.flops * 1e12,
        .node_size = s.node_size, .node_link_bytes_per_s = s.node_bandwidth * 1e9};
    for (int w : s.worlds.empty() ? std::vector<int>{s.world} : s.worlds) {
      const plan::setup base{.world = w,
                             .group = s.group,
                             .prefetch = s.prefetch,
                             .reshard_to = s.reshard_to,
                             .precision = p,
                             .optimizer_bytes = optimizer_bytes(s.optimizer),
                             .frozen_masters = !s.no_frozen_masters,
                             .frozen_grads = !s.no_frozen_grads,
                             .accumulation = {.micro_batches = int(s.grad_accum),
                                              .no_sync = s.no_sync,
                                              .keep_after_backward = s.no_reshard_after_backward,
                                              .replica_all_reduce = !s.no_replica_all_reduce}};
      std::printf("\n");
      print_setup(base);
      print_table(d, base, strategies(s.strategy), json);
      const std::vector<int> groups = s.group_given ? std::vector<int>{base.group} : std::vector<int>{};
      if (s.step_batch == 0) {
        print_choice(plan::choose(d, base, mc, groups), mc);
        continue;
      }
      const auto at = [&](long micro) { return describe(s, decoder, p, micro); };
      print_choice(plan::choose_micro_batches(at, s.step_batch, base, mc, groups), mc,
                   cat(", ", s.step_batch, " sequences per rank and step in the fewest micro-batches that fit",
                       s.no_sync ? " (reduced once" : " (each reduced",
                       s.no_reshard_after_backward ? ", kept gathered between them" : "",
                       s.no_replica_all_reduce ? ", replicas averaged once)" : ")"));
    }
    if (json) std::fclose(json);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardlib-plan: %s\n", e.what());
    return 1;
  }
  return 0;
}
