#!/usr/bin/env python3
"""Loads a LoRA adapter shardlib wrote (models::save_peft; train_gpt --lora ... --save DIR)
onto its base model with Hugging Face PEFT itself, and prints what PEFT sees: the adapter's
elements, how many of lora_B moved off zero, and the loss of the base model and of the
adapted one on byte windows of a text (the held-out tail train_gpt keeps, by default).
Run by hand, in make_peft_goldens.py's environment:

    train_gpt --save base && train_gpt --init base --lora c_attn c_fc --save adapter
    /tmp/hfenv/bin/python tests/golden/check_peft_adapter.py base adapter

PeftModel.from_pretrained refuses an adapter_config.json it cannot read and reports
tensors it cannot place; an adapter that trained lowers the held-out loss.
"""
import argparse

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--windows", type=int, default=64)
    a = p.parse_args()
    text = open(a.data, "rb").read()
    tail = text[int(len(text) * (1 - a.val_fraction)):]
    ids = torch.tensor([list(tail[i * a.seq:(i + 1) * a.seq]) for i in range(a.windows)])
    base = AutoModelForCausalLM.from_pretrained(a.base)
    with torch.no_grad():
        base_loss = base(input_ids=ids, labels=ids).loss.item()
    model = PeftModel.from_pretrained(base, a.adapter)
    lora = {n: t for n, t in model.named_parameters() if "lora_" in n}
    moved = sum(int((t != 0).sum()) for n, t in lora.items() if "lora_B" in n)
    with torch.no_grad():
        adapted_loss = model(input_ids=ids, labels=ids).loss.item()
    print(f"{len(lora)} adapter tensors, {sum(t.numel() for t in lora.values())} elements, {moved} of lora_B "
          f"nonzero; loss on {a.windows} windows of {a.seq} bytes: base {base_loss:.4f}, adapted {adapted_loss:.4f}")


if __name__ == "__main__":
    main()
