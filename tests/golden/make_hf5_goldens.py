#!/usr/bin/env python3
"""Writes tests/golden/hf5/: the GPT-2 and LLaMA of make_hf_goldens.py's shapes as
transformers 5 saves them, and their logits, so that shardlib's loaders are held to what
current transformers writes (config.json has "dtype" where 4.x wrote "torch_dtype", and
LLaMA's rope_theta only inside "rope_parameters"; LLaMA's weights in one file). Run by
hand (CI never installs torch or transformers), in a virtual environment with both from
PyPI (here transformers 5.25.0 and torch 2.15.0):

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers
    /tmp/tv/bin/python tests/golden/make_hf5_goldens.py

Nothing is downloaded: the models are built from configs, seeded, in float32 with dropout
0, eager attention. Each hf5/<model>/ holds config.json, generation_config.json and
model.safetensors as save_pretrained wrote them, and expected.safetensors:
    input_ids  I64 [2, 8]      token ids, drawn uniformly from the vocabulary
    logits     F32 [2, 8, 96]  the model's output for input_ids in eval mode, float32
                               (transformers 5's LLaMA computes RMSNorm and RoPE in float32
                               whatever the model's dtype, so float64 would not be exact
                               either; shardlib's float32 layers are held to 1e-5 of it)
"""
import os
import sys

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_layer_goldens import write_safetensors  # noqa: E402  (the same plain writer)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf5")
BATCH, SEQ, VOCAB = 2, 8, 96


def emit(name, model, seed):
    out = os.path.join(OUT_DIR, name)
    model.save_pretrained(out)
    model.eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    write_safetensors(os.path.join(out, "expected.safetensors"), {"input_ids": ids, "logits": logits},
                      {"format": "pt", "transformers": transformers.__version__, "torch": torch.__version__,
                       "about": f"{type(model).__name__}: tests/golden/make_hf5_goldens.py"})
    print(f"{name}: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")


def main():
    torch.manual_seed(13)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0, attn_implementation="eager"))
    emit("gpt2", gpt2, seed=1)
    torch.manual_seed(7)
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=88, vocab_size=VOCAB,
                                         max_position_embeddings=32, rms_norm_eps=1e-6,
                                         tie_word_embeddings=False, attention_dropout=0.0,
                                         attn_implementation="eager"))
    emit("llama", llama, seed=2)


if __name__ == "__main__":
    main()
