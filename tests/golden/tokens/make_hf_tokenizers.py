#!/usr/bin/env python3
"""Trains two small tokenizers with Hugging Face's `tokenizers` on this repository's README and
writes, for the examples' --tokenizer (examples/common/token_decoder.hpp):
  bytelevel_tokenizer.json   GPT-2's and Llama 3's kind: byte-level BPE (ByteLevel decoder),
                             with <|endoftext|> as an added special token;
  sentencepiece_tokenizer.json  LLaMA 2's kind: BPE over "▁"-marked words with byte fallback
                             (decoders Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0));
  hf_decode.json             for each, ids of a few texts (accents, emoji, newlines, a byte the
                             vocabulary lacks) and what tokenizers' decode gives for them.

    /path/to/venv/bin/python tests/golden/tokens/make_hf_tokenizers.py README.md tests/golden/tokens
(the committed files were trained on the README of 82d540a's parent)
"""
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEXTS = ["Sharded training, fused attention.\n\nIt's done: ½ · naïve café ☕ 42\tx",
         " leading space and  two spaces",
         "\x01 control and \u00ff"]


def bytelevel(text):
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


def sentencepiece(text):
    t = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    alphabet = ["<0x%02X>" % b for b in range(256)]
    t.train_from_iterator([text], trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"] + alphabet))
    return t


def main():
    text, out = Path(sys.argv[1]).read_text(), Path(sys.argv[2])
    golden = {}
    for name, make in [("bytelevel", bytelevel), ("sentencepiece", sentencepiece)]:
        t = make(text)
        t.save(str(out / f"{name}_tokenizer.json"))
        cases = []
        for s in TEXTS:
            ids = t.encode(s).ids
            cases.append({"ids": ids, "text": t.decode(ids, skip_special_tokens=False)})
        special = t.token_to_id("<|endoftext|>" if name == "bytelevel" else "</s>")
        cases.append({"ids": [special], "text": t.decode([special], skip_special_tokens=False)})
        golden[name] = cases
    (out / "hf_decode.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
