#!/usr/bin/env python3
"""Writes tests/golden/hf5/<model>/padded_generate.safetensors: transformers' greedy
generate() on a left-padded batch of the models make_hf5_goldens.py wrote, so that
shardlib's models::generate with an attention_mask is held to what transformers does
with one (position ids from the mask, padding masked as keys). Run by hand (CI never
installs torch or transformers), after make_hf5_goldens.py, in the same environment
(here transformers 5.25.0 and torch 2.15.0):

    /tmp/tv/bin/python tests/golden/make_padded_generate_goldens.py

Each file holds, for prompts of 3, 6 and 1 tokens left-padded with token 0 to 6:
    input_ids       I64 [3, 6]        the padded prompt (ids drawn uniformly)
    attention_mask  I64 [3, 6]        1 = token, 0 = padding
    sequences       I64 [3, 6 + 8]    generate(do_sample=False, max_new_tokens=8), no end token
    step_logits     F32 [3, 8, 96]    each step's raw logits of the next token (output_logits)
    eos_token_ids   I64 [m]           end tokens: of each row, the first new token from its
                                      (n + 1)-th on that it has not generated before, if any
    sequences_eos   I64 [3, 6 + k]    the same generate with eos_token_id=eos_token_ids and
                                      pad_token_id=0 (ended rows get 0; it stops once all
                                      ended); the rows end at different steps, so some get 0s
    sequences_rep   I64 [3, 6 + 8]    generate(do_sample=False, repetition_penalty=1.5,
                                      max_new_tokens=8): every token already in a row
                                      from its first real one on (not its left padding)
                                      has its logit divided by 1.5 (multiplied where
                                      negative) before the argmax
"""
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_layer_goldens import write_safetensors  # noqa: E402  (the same plain writer)

HF5 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf5")
LENGTHS, SEQ, NEW, VOCAB = (3, 6, 1), 6, 8, 96


def emit(name, seed):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(HF5, name), attn_implementation="eager")
    model.eval()
    ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(SEQ).expand(len(LENGTHS), SEQ) >= SEQ - torch.tensor(LENGTHS).unsqueeze(1)).long()
    ids = ids * mask  # padding: token 0
    # No end token: generate() fills unset fields from the model's own generation config.
    model.generation_config.eos_token_id = None
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert out.sequences.shape == (len(LENGTHS), SEQ + NEW), out.sequences.shape
    logits = torch.stack(out.logits, dim=1).float()
    new = out.sequences[:, SEQ:].tolist()
    eos = []
    for n, row in enumerate(new):
        fresh = [t for i, t in enumerate(row) if i > n and t not in row[:i]]
        if fresh:
            eos.append(fresh[0])
    eos = torch.tensor(sorted(set(eos)))
    ending = GenerationConfig(do_sample=False, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos.tolist())
    with torch.no_grad():
        ended = model.generate(input_ids=ids, attention_mask=mask, generation_config=ending)
    assert (ended[:, SEQ:] == 0).any() and len(eos) > 0, "no row was padded: choose other end tokens"
    penalised = GenerationConfig(do_sample=False, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                                 repetition_penalty=1.5)
    with torch.no_grad():
        rep = model.generate(input_ids=ids, attention_mask=mask, generation_config=penalised)
    assert not torch.equal(rep, out.sequences), "the penalty changed nothing: choose another"
    write_safetensors(os.path.join(HF5, name, "padded_generate.safetensors"),
                      {"input_ids": ids, "attention_mask": mask, "sequences": out.sequences, "step_logits": logits,
                       "eos_token_ids": eos, "sequences_eos": ended, "sequences_rep": rep},
                      {"format": "pt", "transformers": transformers.__version__, "torch": torch.__version__,
                       "about": f"{name}: tests/golden/make_padded_generate_goldens.py"})
    print(f"{name}: transformers {transformers.__version__}, torch {torch.__version__}:",
          out.sequences[:, SEQ:].tolist(), "ending at", eos.tolist(), ended[:, SEQ:].tolist(),
          "penalised", rep[:, SEQ:].tolist())


def main():
    emit("gpt2", seed=21)
    emit("llama", seed=22)


if __name__ == "__main__":
    main()
