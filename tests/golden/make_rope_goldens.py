#!/usr/bin/env python3
"""Writes tests/golden/hf/llama3_rope/: a small LlamaForCausalLM whose config has
Llama 3.1's rope_scaling, saved by transformers itself, and what transformers computes
with it, for shardlib's rope_scaling (nn/rotary.hpp) and config.json reader
(models/hf.hpp) to be checked against (tests/unit/test_models.cpp). Run by hand (CI
never installs torch or transformers), with Debian's CPU torch 1.13 and transformers
4.45.2 (rope_scaling's llama3 kind arrived in 4.43; make_hf_goldens.py pins 4.40.2):

    apt-get install python3-torch python3-venv
    /usr/bin/python3 -m venv --system-site-packages /tmp/hfenv
    /tmp/hfenv/bin/pip install transformers==4.45.2
    /tmp/hfenv/bin/python tests/golden/make_rope_goldens.py

Nothing is downloaded; the script is deterministic (torch.manual_seed).

The model: LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
num_key_value_heads=2, intermediate_size=88, vocab_size=96, max_position_embeddings=128,
rope_theta=10000, rope_scaling llama3 with factor 8, low_freq_factor 1, high_freq_factor 4,
original_max_position_embeddings 64), eager attention. Its head_dim 8 has four
frequencies, base^(-2i/8) = 1, 0.1, 0.01, 0.001, wavelengths 2 pi / f = 6.3, 63, 628,
6283 positions against the thresholds 64 / 4 = 16 and 64 / 1 = 64: the first is kept,
the second blended, the last two divided by 8, so every branch of the rule is used.

What the directory holds:
    config.json, model.safetensors   save_pretrained of the initialised model (F32)
    expected.safetensors:
        input_ids       I64 [2, 48]  token ids, drawn uniformly from the vocabulary
        logits          F32 [2, 48, 96]  the model's output for input_ids, in float32 as
                                     transformers computes it (RoPE's angles in float32)
        inv_freq_llama3 F32 [4]      the model's rotary_emb.inv_freq (ROPE_INIT_FUNCTIONS)
        inv_freq_linear F32 [4]      the same base with rope_scaling linear, factor 4

transformers computes the frequencies in float32 (a few roundings of 6e-8 each) and the
angles and sines in float32, so shardlib's double frequencies agree to about 1e-6
relative and its logits to about 1e-6 of the largest; the tests hold them to 1e-6 and 1e-5.
"""
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_layer_goldens import write_safetensors  # noqa: E402  (the same plain writer)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf", "llama3_rope")
BATCH, SEQ, VOCAB = 2, 48, 96


def config(rope_scaling):
    return LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=88, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=10000.0,
                       rope_scaling=rope_scaling, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_dropout=0.0, attn_implementation="eager")


def main():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    torch.manual_seed(11)
    model = LlamaForCausalLM(config(llama3))
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    model.eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    inv_llama3 = model.model.rotary_emb.inv_freq.clone()
    inv_linear, scaling = ROPE_INIT_FUNCTIONS["linear"](config({"rope_type": "linear", "factor": 4.0}), "cpu")
    assert scaling == 1.0
    assert torch.equal(inv_llama3, ROPE_INIT_FUNCTIONS["llama3"](config(llama3), "cpu")[0])

    write_safetensors(os.path.join(OUT_DIR, "expected.safetensors"), {
        "input_ids": ids, "logits": logits, "inv_freq_llama3": inv_llama3.float(),
        "inv_freq_linear": inv_linear.float()},
        {"format": "pt", "transformers": transformers.__version__, "torch": torch.__version__,
         "about": "LlamaForCausalLM with llama3 rope_scaling: tests/golden/make_rope_goldens.py"})
    print(f"inv_freq llama3 {inv_llama3.tolist()}, linear {inv_linear.tolist()}")


if __name__ == "__main__":
    main()
