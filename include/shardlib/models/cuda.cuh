// shardlib/models/cuda.cuh — the decoder language models on the device (nvcc
// only): models::GPT2LMHeadModel<T, cuda_space> and LlamaForCausalLM<T,
// cuda_space> are the host templates over the device layers this header brings.
// Ids [batch, seq] and logits [batch, seq, vocab] are device tensors; the token
// cross-entropy of nn/cuda/loss.cuh takes the logits and device targets. No KV
// cache on the device (generation runs on the host model).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/models/gpt2.hpp"
#include "shardlib/models/llama.hpp"
#include "shardlib/nn/cuda.cuh"                    // Linear, LayerNorm, Dropout, GELU, residual, cross-entropy
#include "shardlib/nn/cuda/decoder_attention.cuh"  // GPT2Attention, LlamaAttention
#include "shardlib/nn/cuda/embedding.cuh"          // Embedding, PositionEmbedding
#include "shardlib/nn/cuda/feed_forward.cuh"       // GPT2MLP, LlamaMLP
#include "shardlib/nn/cuda/rms_norm.cuh"           // RMSNorm
#include "shardlib/nn/cuda/tied_linear.cuh"        // the tied lm_head
