#!/usr/bin/env python3
"""Writes the token files the train_gpt tests read (tests/cli/CMakeLists.txt), in llm.c's
format (dev/data/data_common.py): 256 little-endian int32 of header (magic, version,
token count), then the tokens, uint16 for GPT-2 (magic 20240520, version 1) and uint32
for LLaMA 3 (20240801, version 7). The tokens are a text's bytes spread over each
vocabulary (byte b -> 150 b + 7 for GPT-2, 500 b + 11 for LLaMA 3), so ids above 255 and,
for LLaMA 3, above 65535 are read; what the model learns is the text's byte statistics.
vocab96.bin holds the bytes modulo 96, for the models of tests/golden/hf5 (vocabulary 96).
tokenizer.bin is llm.c's tokenizer file (magic 20240328, version 2: the token count and
the end-of-text token in the header, then each token's bytes after a one-byte length) for
the GPT-2 files' ids: token 150 b + 7 is byte b, every other token empty but 50256,
"<|endoftext|>"; cut_tokenizer.bin promises three tokens and holds one.
Then four broken files: a wrong magic, a count the bytes do not match, a negative count, a
header cut short.

    python3 tests/golden/tokens/make_token_files.py README.md tests/golden/tokens
"""
import struct
import sys
from pathlib import Path


def write(path, magic, version, tokens, width, count=None):
    header = [0] * 256
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    body = struct.pack("<256i", *header) + struct.pack("<%d%s" % (len(tokens), "H" if width == 2 else "I"), *tokens)
    Path(path).write_bytes(body)


def main():
    text, out = Path(sys.argv[1]).read_bytes()[:6000], Path(sys.argv[2])
    head, tail = text[:4800], text[4800:]
    write(out / "gpt2_train.bin", 20240520, 1, [150 * b + 7 for b in head], 2)
    write(out / "gpt2_val.bin", 20240520, 1, [150 * b + 7 for b in tail], 2)
    write(out / "llama3.bin", 20240801, 7, [500 * b + 11 for b in text], 4)
    write(out / "vocab96.bin", 20240520, 1, [b % 96 for b in text[:2000]], 2)
    pieces = [b""] * 50257
    for b in range(256):
        pieces[150 * b + 7] = bytes([b])
    pieces[50256] = b"<|endoftext|>"
    header = [0] * 256
    header[:4] = [20240328, 2, len(pieces), 50256]
    (out / "tokenizer.bin").write_bytes(struct.pack("<256i", *header) +
                                             b"".join(bytes([len(p)]) + p for p in pieces))
    header[:4] = [20240328, 2, 3, 0]  # three tokens promised, one there
    (out / "cut_tokenizer.bin").write_bytes(struct.pack("<256i", *header) + b"\x01a")
    write(out / "bad_magic.bin", 20240521, 1, [7] * 100, 2)
    write(out / "bad_count.bin", 20240520, 1, [7] * 100, 2, count=101)
    write(out / "negative_count.bin", 20240520, 1, [7] * 100, 2, count=-1)
    (out / "short.bin").write_bytes(struct.pack("<3i", 20240520, 1, 0))


if __name__ == "__main__":
    main()
