// shardlib/nn/cuda.cuh — the layers on the device (nvcc only): each
// nn::Layer<T, cuda_space> specialisation and cross-entropy over device tensors.
// A model runs on the device by naming cuda_space as its layers' space.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/cuda/activation.cuh"         // ReLU, GELU, SiLU
#include "shardlib/nn/cuda/attention.cuh"          // MultiheadAttention (fused attention)
#include "shardlib/nn/cuda/decoder_attention.cuh"  // GPT2Attention, LlamaAttention
#include "shardlib/nn/cuda/dropout.cuh"            // Dropout
#include "shardlib/nn/cuda/embedding.cuh"          // Embedding, PositionEmbedding
#include "shardlib/nn/cuda/feed_forward.cuh"       // LlamaMLP, GPT2MLP (fused SwiGLU)
#include "shardlib/nn/cuda/layer_norm.cuh"         // LayerNorm
#include "shardlib/nn/cuda/linear.cuh"             // Linear (cuBLASLt epilogues)
#include "shardlib/nn/cuda/lora.cuh"               // a LoRA adapter's products
#include "shardlib/nn/cuda/loss.cuh"               // cross_entropy_loss on device tensors
#include "shardlib/nn/cuda/pooling.cuh"            // MeanPool
#include "shardlib/nn/cuda/rms_norm.cuh"           // RMSNorm
#include "shardlib/nn/cuda/tied_linear.cuh"        // TiedLinear
#include "shardlib/nn/cuda/transformer.cuh"        // TransformerEncoderLayer's residual, linear1 + ReLU fused
