#!/usr/bin/env python3
"""Writes tests/golden/peft/: LoRA adapters that Hugging Face PEFT made and trained on the
two decoders of tests/golden/hf (make_hf_goldens.py), for shardlib's add_lora and its
PEFT adapter files (models/peft.hpp) to be checked against (tests/unit/test_models.cpp).
Run by hand (CI never installs torch, transformers or peft), with Debian's CPU torch 1.13,
transformers 4.40.2 and peft 0.10.0 in a virtual environment that sees the system's torch:

    /usr/bin/python3 -m venv --system-site-packages /tmp/hfenv
    /tmp/hfenv/bin/pip install transformers==4.40.2 peft==0.10.0
    /tmp/hfenv/bin/python tests/golden/make_peft_goldens.py

Each model is tests/golden/hf/<model>/initial, wrapped by get_peft_model with
    gpt2   LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "mlp.c_proj"],
                      fan_in_fan_out=True)                            scaling 8 / 4 = 2
    llama  LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                      use_rslora=True)                                scaling 8 / sqrt(4) = 4
(lora_dropout 0, bias "none", task_type CAUSAL_LM), PEFT's own init: lora_A
kaiming-uniform, lora_B zero, so the adapted model starts as the base model.

What each directory holds:
    peft/<model>/initial/   save_pretrained right after get_peft_model (torch.manual_seed
                            per model): adapter_config.json and adapter_model.safetensors,
                            F32, names "base_model.model.<module>.lora_A.weight".
    peft/<model>/trained/   the same after the 20 AdamW steps below, float64 values rounded
                            to F32 (as make_hf_goldens.py's trained/).
    peft/<model>/expected.safetensors, float64 where it is a float:
        input_ids  I64 [2, 8], labels I64 [2, 8]   make_hf_goldens.py's batch for the model
        losses     F64 [21]    losses[k]: the loss after k steps of torch.optim.AdamW(lr=1e-2,
                               betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01) over the
                               model's parameters (the frozen base gets no gradient, so it is
                               not stepped), each step on the same batch
        logits     F64 [2, 8, 96]  the trained adapted model's output for input_ids

Rerunning rewrites the same tensors; adapter_config.json's target_modules come from a
Python set, so their order may change between runs (PEFT matches them as a set).

The model runs in float64 after the F32 initial adapter is saved, LLaMA with
make_hf_goldens.py's float64 RMSNorm and RoPE. lr is 1e-2 rather than the base goldens'
1e-3: lora_B starts at zero, and the adapters should move the loss visibly in 20 steps.
"""
import os
import sys

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.models.llama import modeling_llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_goldens import STEPS, batch, rms_norm_in_input_dtype, rope_in_input_dtype, train  # noqa: E402
from make_layer_goldens import write_safetensors  # noqa: E402

GOLDEN = os.path.dirname(os.path.abspath(__file__))
LR = 1e-2


def emit(name, model_type, config, seed, batch_seed):
    out = os.path.join(GOLDEN, "peft", name)
    base = model_type.from_pretrained(os.path.join(GOLDEN, "hf", name, "initial"))
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    model.save_pretrained(os.path.join(out, "initial"), safe_serialization=True)
    model = model.double()
    model.train()  # dropout is 0: train and eval compute the same
    ids, labels = batch(batch_seed)
    losses = train(model, ids, labels, lr=LR)
    with torch.no_grad():
        result = model(input_ids=ids, labels=labels)
    model.float().save_pretrained(os.path.join(out, "trained"), safe_serialization=True)
    write_safetensors(os.path.join(out, "expected.safetensors"), {
        "input_ids": ids, "labels": labels, "losses": torch.tensor(losses, dtype=torch.float64),
        "logits": result.logits.detach()},
        {"format": "pt", "transformers": transformers.__version__, "torch": torch.__version__,
         "peft": peft.__version__, "about": f"LoRA on {type(base).__name__}: tests/golden/make_peft_goldens.py"})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{name}: loss {losses[0]:.6f} -> {losses[-1]:.6f} after {STEPS} AdamW steps; {trainable} trained")


def main():
    common = dict(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    emit("gpt2", GPT2LMHeadModel,
         LoraConfig(target_modules=["c_attn", "mlp.c_proj"], fan_in_fan_out=True, **common), seed=21, batch_seed=1)
    modeling_llama.LlamaRMSNorm.forward = rms_norm_in_input_dtype
    modeling_llama.LlamaRotaryEmbedding.forward = rope_in_input_dtype
    emit("llama", LlamaForCausalLM,
         LoraConfig(target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True, **common), seed=22,
         batch_seed=2)


if __name__ == "__main__":
    main()
