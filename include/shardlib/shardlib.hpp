// shardlib/shardlib.hpp — the host umbrella: every part a trainer uses on the host
// (core, thread ranks and launching, layers, GPT-2 and LLaMA, sharding engine,
// optimizers, checkpoints and state dicts, planner).
// MPI, CUDA and NCCL have their own umbrellas (shardlib/mpi.hpp, shardlib/cuda.hpp,
// shardlib/nccl.hpp), since they need libraries the host build may lack.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"          // Buffer
#include "shardlib/core/element.hpp"         // bfloat16, half, dtype
#include "shardlib/core/error.hpp"           // error and subclasses
#include "shardlib/core/ledger.hpp"          // ledger, category
#include "shardlib/core/memory_space.hpp"    // host_space, can_access
#include "shardlib/core/random.hpp"          // counter_rng
#include "shardlib/core/shape.hpp"           // Shape
#include "shardlib/core/tensor.hpp"          // Tensor (owning, shared), TensorView
#include "shardlib/comm/communicator.hpp"    // Communicator, reduce_op
#include "shardlib/comm/environment.hpp"     // discover_environment (torchrun, OpenMPI, MPICH/PMI, Slurm)
#include "shardlib/comm/launch.hpp"          // launch, rank_failure
#include "shardlib/comm/rendezvous.hpp"      // store_from_environment (also under torchrun's agent)
#include "shardlib/comm/run.hpp"             // run_from_environment (threads, sockets or MPI)
#include "shardlib/comm/socket_comm.hpp"     // SocketComm (processes over TCP)
#include "shardlib/comm/store.hpp"           // TcpStore, store_server
#include "shardlib/comm/thread_comm.hpp"     // ThreadComm
#include "shardlib/comm/torch_store.hpp"     // torch_store (a client of PyTorch's TCPStore)
#include "shardlib/nn/activation.hpp"        // ReLU, GELU (erf or tanh), SiLU
#include "shardlib/nn/attention.hpp"         // MultiheadAttention
#include "shardlib/nn/context.hpp"           // context
#include "shardlib/nn/dropout.hpp"           // Dropout
#include "shardlib/nn/embedding.hpp"         // Embedding, PositionEmbedding
#include "shardlib/nn/feed_forward.hpp"      // LlamaMLP (SwiGLU), GPT2MLP
#include "shardlib/nn/grad_mode.hpp"         // grad_enabled (layers skip caching when off)
#include "shardlib/nn/gpt2_attention.hpp"    // GPT2Attention (causal, c_attn/c_proj)
#include "shardlib/nn/layer.hpp"             // Layer, Composite, check_layer
#include "shardlib/nn/layer_norm.hpp"        // LayerNorm
#include "shardlib/nn/linear.hpp"            // Linear
#include "shardlib/nn/llama_attention.hpp"   // LlamaAttention (GQA, RoPE, KV cache)
#include "shardlib/nn/lora.hpp"              // add_lora, merge_lora: LoRA adapters across a model (PEFT)
#include "shardlib/nn/loss.hpp"              // cross_entropy, mse
#include "shardlib/nn/pooling.hpp"           // MeanPool
#include "shardlib/nn/replicated.hpp"        // Replicated (unsharded owner)
#include "shardlib/nn/rms_norm.hpp"          // RMSNorm
#include "shardlib/nn/rotary.hpp"            // rotary_table (RoPE)
#include "shardlib/nn/sdpa.hpp"              // sdpa_forward, sdpa_backward
#include "shardlib/nn/sequential.hpp"        // Sequential
#include "shardlib/nn/stack.hpp"             // Stack
#include "shardlib/nn/tied_linear.hpp"       // TiedLinear (a head borrowing an embedding's weight)
#include "shardlib/nn/transformer.hpp"       // TransformerEncoderLayer
#include "shardlib/optim/adam.hpp"           // Adam, AdamW
#include "shardlib/optim/clip.hpp"           // clip_grad_norm
#include "shardlib/optim/optimizer.hpp"      // Optimizer, check_optimizer
#include "shardlib/optim/param_groups.hpp"   // param_groups, no_decay_split
#include "shardlib/optim/schedule.hpp"       // learning-rate schedules
#include "shardlib/optim/sgd.hpp"            // SGD
#include "shardlib/shard/sharded_model.hpp"  // fully_shard, ShardedModel, options
#include "shardlib/shard/sharded_tensor.hpp" // shard_layout, ShardedTensor
#include "shardlib/shard/strategy.hpp"       // policy, FullShard, ShardGradOp, ShardOptimizer, NoShard, HybridShard
#include "shardlib/shard/wrap.hpp"           // wrap_types, wrap_names, wrap_none, wrap_min_params, wrap_any
#include "shardlib/io/checkpoint.hpp"        // save_checkpoint, load_checkpoint, export/load_safetensors
#include "shardlib/io/hf_checkpoint.hpp"     // hf::gpt2, hf::llama (Hugging Face names, transposes, ties)
#include "shardlib/io/safetensors.hpp"       // safetensors files
#include "shardlib/io/sharded_state.hpp"     // state dicts in memory: sharded or full, model and optimizer
#include "shardlib/io/state_dict.hpp"        // load_state_dict, save_state_dict (name maps, strict or a report)
#include "shardlib/models/gpt2.hpp"          // GPT2LMHeadModel, GPT2Block, gpt2_config
#include "shardlib/models/hf.hpp"            // load_hf, save_hf, read_hf_config
#include "shardlib/models/llama.hpp"         // LlamaForCausalLM, LlamaDecoderLayer, llama_config
#include "shardlib/models/peft.hpp"          // load_peft, save_peft, read_peft_config: PEFT's LoRA adapter files
#include "shardlib/models/causal_lm.hpp"     // generate (greedy, top-k, KV cache), causal_lm_targets
#include "shardlib/models/sharded_generate.hpp"  // generate on a sharded model (ranks checked to agree)
#include "shardlib/plan/chooser.hpp"         // choose
#include "shardlib/plan/describe.hpp"        // describe, describe_model, measure_activations
#include "shardlib/plan/memory_plan.hpp"     // make_plan
#include "shardlib/plan/strategies.hpp"      // the strategies as values
#include "shardlib/plan/transformer.hpp"     // a coarse transformer
#include "shardlib/plan/zero_states.hpp"     // zero_model_states
#include "shardlib/plan/presets.hpp"         // decoder presets: gpt2-124m ... llama-70b
