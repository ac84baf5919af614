#!/usr/bin/env python3
"""Writes tests/golden/hf5/gpt2 (transformers' GPT2LMHeadModel) as llm.c's GPT-2 checkpoint,
the format llm.c's train_gpt2.py writes and train_gpt2.c/.cu read: 256 little-endian int32 of
header (magic 20240326; version 3, every tensor fp32, or 5, every tensor bf16; max_seq_len,
vocab_size, num_layers, num_heads, channels, padded_vocab_size), then the tensors: wte with
its rows padded by zeros to a multiple of 128, wpe, then each kind of block tensor for every
layer in turn (ln_1 weight and bias, c_attn weight and bias, attn.c_proj weight and bias, ln_2
weight and bias, c_fc weight and bias, mlp.c_proj weight and bias), then ln_f's weight and
bias; weights as nn.Linear keeps them, [out, in] (transformers' Conv1D keeps [in, out]).
bf16 is torch's conversion (round to nearest even).

    /path/to/venv/bin/python tests/golden/llmc/make_llmc_goldens.py    (torch, safetensors)
"""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
HF = HERE.parent / "hf5" / "gpt2"


def main():
    config = json.loads((HF / "config.json").read_text())
    sd = load_file(str(HF / "model.safetensors"))
    sd = {k if k.startswith("transformer.") or k.startswith("lm_head.") else "transformer." + k: v for k, v in sd.items()}
    L, C, V, T = config["n_layer"], config["n_embd"], config["vocab_size"], config["n_positions"]
    Vp = (V + 127) // 128 * 128
    wte = torch.zeros(Vp, C)
    wte[:V] = sd["transformer.wte.weight"]
    order = [wte, sd["transformer.wpe.weight"]]
    for leaf, conv in [("ln_1.weight", False), ("ln_1.bias", False), ("attn.c_attn.weight", True),
                       ("attn.c_attn.bias", False), ("attn.c_proj.weight", True), ("attn.c_proj.bias", False),
                       ("ln_2.weight", False), ("ln_2.bias", False), ("mlp.c_fc.weight", True),
                       ("mlp.c_fc.bias", False), ("mlp.c_proj.weight", True), ("mlp.c_proj.bias", False)]:
        for i in range(L):
            t = sd[f"transformer.h.{i}.{leaf}"]
            order.append(t.t().contiguous() if conv else t)
    order += [sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]]
    for version, dtype, name in [(3, torch.float32, "gpt2_f32.bin"), (5, torch.bfloat16, "gpt2_bf16.bin")]:
        header = torch.zeros(256, dtype=torch.int32)
        header[:8] = torch.tensor([20240326, version, T, V, L, config["n_head"], C, Vp], dtype=torch.int32)
        body = b"".join(t.to(dtype).contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                        .numpy().tobytes() for t in order)
        (HERE / name).write_bytes(header.numpy().tobytes() + body)
        print(f"wrote {name}: {len(body)} bytes of tensors, vocab {V} padded to {Vp}")


if __name__ == "__main__":
    main()
