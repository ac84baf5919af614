#!/usr/bin/env python3
"""Writes tests/golden/hf/: two small Hugging Face decoder language models with random
weights (GPT2LMHeadModel and LlamaForCausalLM), saved by transformers itself, and what
they compute, for shardlib's loaders (tests/unit/test_safetensors.cpp) and its GPT-2 and
LLaMA models to be checked against. Run by hand (CI never installs torch or
transformers), with Debian's CPU torch 1.13 and transformers 4.40.2 in a virtual
environment that sees the system's torch:

    /usr/bin/python3 -m venv --system-site-packages /tmp/hfenv
    /tmp/hfenv/bin/pip install transformers==4.40.2
    /tmp/hfenv/bin/python tests/golden/make_hf_goldens.py

Nothing is downloaded: the models are built from configs. The script is deterministic
(torch.manual_seed per model), so rerunning it rewrites the same bytes.

The models (config.json beside each file says the rest; dropout is 0 everywhere):
    gpt2   GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32),
           activation gelu_new (tanh), layer_norm_epsilon 1e-5, lm_head tied to
           transformer.wte (save_pretrained leaves lm_head.weight out of the file).
    llama  LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
           num_key_value_heads=2, intermediate_size=88, vocab_size=96, rope_theta=10000,
           rms_norm_eps=1e-6, tie_word_embeddings=False), eager attention.

What each directory holds (every tensor name as written):
    hf/<model>/initial/   save_pretrained of the freshly initialised model: config.json and
                          model.safetensors (gpt2), or HF's sharded layout for llama:
                          model-0000k-of-0000n.safetensors + model.safetensors.index.json
                          (max_shard_size 40kB), so the sharded loader is tested on a file
                          transformers wrote. F32: the model is initialised in float32 and
                          saved before it is converted, so these values are exact.
    hf/<model>/trained/   save_pretrained after the 20 AdamW steps below, same layout,
                          float64 values rounded to F32 (the weights move by ~1e-3 a step;
                          F32 keeps ~1e-9 of them, far below the 1e-4 the losses are held to).
    hf/<model>/expected.safetensors, float64 where it is a float:
        input_ids  I64 [2, 8]      token ids, drawn uniformly from the vocabulary
        labels     I64 [2, 8]      input_ids with a few positions set to -100 (ignored)
        logits     F64 [2, 8, 96]  the initial model's output for input_ids (no attention mask)
        loss       F64 []          its loss for labels: HF shifts inside the model, so it is the
                                   mean over t < 7 with labels[:, t+1] != -100 of
                                   cross_entropy(logits[:, t], labels[:, t+1])
        losses     F64 [21]        losses[k]: the loss after k steps of
                                   torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.01) on every parameter (biases, norms and
                                   embeddings included; GPT-2's tied weight is one parameter
                                   whose gradient sums both uses), each step on the same batch;
                                   losses[0] == loss

The forward and the training run in float64 (model.double() after saving the F32 initial
weights). Stock LLaMA in transformers 4.40 computes two things in float32 even in a float64
model: RMSNorm's mean of squares and RoPE's cos/sin. This script replaces both with the same
formulas in the input's dtype (LlamaRMSNorm.forward, LlamaRotaryEmbedding.forward below), so
every number is float64; unpatched, the logits differ from these by about 1e-7 relative.

What shardlib's GPT-2 and LLaMA are expected to match, loading initial/ through
io::load_state_dict with the Hugging Face conventions (io/hf_checkpoint.hpp), in float64:
logits to 1e-5 (relative to max |logit|), loss to 1e-5, losses[k] for every k to 1e-4 and
the trained weights to 1e-4 relative to max(|w|, lr) after their own 20 AdamW steps.
"""
import json
import math
import os
import sys

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_layer_goldens import write_safetensors  # noqa: E402  (the same plain writer)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
BATCH, SEQ, VOCAB, STEPS = 2, 8, 96, 20
IGNORED = ((0, 0), (0, 5), (1, 3))  # (sample, position) whose label is -100


def rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@torch.no_grad()
def rope_in_input_dtype(self, x, position_ids):
    inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=x.dtype) / self.dim))
    freqs = position_ids[:, :, None].to(x.dtype) * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    for b, t in IGNORED:
        labels[b, t] = -100
    return ids, labels


def train(model, ids, labels, lr):
    """STEPS steps of torch.optim.AdamW(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01) on one
    batch; the loss before each step and after the last."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step_loss = model(input_ids=ids, labels=labels).loss
        losses.append(step_loss.item())
        step_loss.backward()
        opt.step()
    with torch.no_grad():
        losses.append(model(input_ids=ids, labels=labels).loss.item())
    return losses


def emit(name, model, seed):
    out = os.path.join(OUT_DIR, name)
    shard = "40kB" if name == "llama" else "10GB"
    model.save_pretrained(os.path.join(out, "initial"), safe_serialization=True, max_shard_size=shard)
    model = model.double()
    model.train()  # dropout is 0: train and eval modes compute the same
    ids, labels = batch(seed)
    result = model(input_ids=ids, labels=labels)
    logits, loss = result.logits.detach(), result.loss.detach()

    losses = train(model, ids, labels, lr=1e-3)
    assert losses[0] == loss.item()
    model.float().save_pretrained(os.path.join(out, "trained"), safe_serialization=True, max_shard_size=shard)

    write_safetensors(os.path.join(out, "expected.safetensors"), {
        "input_ids": ids, "labels": labels, "logits": logits, "loss": loss,
        "losses": torch.tensor(losses, dtype=torch.float64)},
        {"format": "pt", "transformers": transformers.__version__, "torch": torch.__version__,
         "about": f"{type(model).__name__}: tests/golden/make_hf_goldens.py"})
    print(f"{name}: loss {losses[0]:.6f} -> {losses[-1]:.6f} after {STEPS} AdamW steps; "
          f"{sum(p.numel() for p in model.parameters())} parameters")


def main():
    torch.manual_seed(13)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    emit("gpt2", gpt2, seed=1)

    modeling_llama.LlamaRMSNorm.forward = rms_norm_in_input_dtype
    modeling_llama.LlamaRotaryEmbedding.forward = rope_in_input_dtype
    torch.manual_seed(7)
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=88, vocab_size=VOCAB,
                                         max_position_embeddings=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                                         tie_word_embeddings=False, attention_dropout=0.0,
                                         attn_implementation="eager"))
    emit("llama", llama, seed=2)


if __name__ == "__main__":
    main()
