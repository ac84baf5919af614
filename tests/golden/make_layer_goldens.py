#!/usr/bin/python3
"""Writes tests/golden/layers/<case>.<f64|f32>.safetensors: PyTorch's forward and
backward of each nn primitive, a few losses and a small encoder classifier, which
tests/unit/test_parity.cpp compares shardlib against, and of the decoder layers
(RMSNorm, SiLU, LLaMA's and GPT-2's MLPs, learned positions, token-level
cross-entropy and a small stack of them), which tests/unit/test_decoder_layers.cpp
compares (tests/support/golden.hpp lists every case). Run by hand (CI only reads
the files), with Debian's CPU torch (apt-get install python3-torch python3-numpy):

    /usr/bin/python3 tests/golden/make_layer_goldens.py [CASE ...]

Named cases only, or every case without arguments. Regenerate only the cases you
add or change: torch's kernels differ by CPU, so another machine rewrites the
other files with differences of a few ulps (seen: 1e-16 in float64 between two
x86 machines).

Each case builds its module in float64 with torch's default init, moves every
parameter by U(-0.2, 0.2) (so zero biases and unit LayerNorm weights are
exercised too), and runs it once in float64 and once in a float32 copy whose
parameters and inputs are the float64 values rounded: both runs see the same
model. The objective is sum(y * r) for a fixed random r, or the loss for the
losses and the classifier. Every case draws from its own seed (crc32 of its
name), so adding a case leaves the others' files unchanged.

Tensors in a file (plain little-endian safetensors, written by write_safetensors):
    input            x, or token ids (I64) for the embedding, or logits for a loss
    mask             U8 [batch, sequence], nonzero = padding key (attention cases with a mask)
    attn_mask        F32 [sequence, sequence], added to the scores (attention cases with an attn_mask)
    target           class ids (I64) or regression targets (losses, classifier)
    r                dL/d(output) (cases without a loss)
    output           the module's output (cases with a module)
    loss             scalar, shape [] (losses, classifier)
    input.grad       dL/d(input) (not for token ids)
    <name>, <name>.grad   every parameter under its state_dict name, and its gradient
"""
import copy
import json
import os
import struct
import sys
import zlib

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, NHEAD, DIM_FF, SEQ, BATCH = 16, 4, 32, 5, 3
VOCAB, CLASSES = 10, 4
MAX_POSITIONS, POSITION_OFFSET = 8, 2  # positions 2..6 of 8
LENGTHS = (5, 3, 4)  # of each padded sample: at least one key, where torch gives NaN (docs/parity.md)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layers")
ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.int64: "I64", torch.uint8: "U8"}
PRECISIONS = ((torch.float64, "f64"), (torch.float32, "f32"))
ONLY = set(sys.argv[1:])  # the cases to write; empty = all
WRITTEN = set()


def write_safetensors(path, tensors, metadata):
    """8-byte little-endian header size, JSON header padded with spaces to a
    multiple of 8 (so the data starts aligned), then the tensors' bytes in order."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        data = t.detach().contiguous().numpy().tobytes()  # x86 is little-endian, as the format
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def generator(case):
    return torch.Generator().manual_seed(zlib.crc32(case.encode()))


def uniform(gen, shape, lo=-1.0, hi=1.0):
    return torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo


def padding_mask():
    return torch.arange(SEQ).expand(BATCH, SEQ) >= torch.tensor(LENGTHS).unsqueeze(1)  # True = padding


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm (torch 1.13 has none): weight * x / sqrt(mean(x^2) + eps)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaMLP(nn.Module):
    """LLaMA's feed-forward under Hugging Face's names: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim, inner):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GPT2MLP(nn.Module):
    """GPT-2's feed-forward under Hugging Face's names, with nn.Linear where HF has
    Conv1D (shardlib's weights are Linear's [out, in]): dropout(c_proj(gelu_tanh(c_fc(x))))."""

    def __init__(self, dim):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class PositionEmbedding(nn.Module):
    """GPT-2's wpe added to hidden states [..., seq, D]: x + weight[offset : offset + seq]."""

    def __init__(self, max_positions, dim, offset=0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_positions, dim))  # nn.Embedding's N(0, 1)
        self.offset = offset

    def forward(self, x):
        return x + self.weight[self.offset:self.offset + x.shape[-2]]


def token_cross_entropy(logits, target):
    """F.cross_entropy over logits [batch, seq, vocab] and targets [batch, seq]
    (torch wants the classes second), ignore_index -100 by default."""
    return F.cross_entropy(logits.transpose(1, 2), target)


class MeanPool(nn.Module):
    """shardlib's nn::MeanPool without a mask: x.mean(dim)."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return x.mean(self.dim)


def emit(case, x, module=None, call=None, mask=None, target=None, loss=None, about="", attn_mask=None):
    """Runs `module` (float64; None for a bare loss) on x as call(module, x, mask)
    in both precisions (call(module, x, mask, attn_mask) when there is one) and writes
    the two files. With `loss`, the objective is loss(y, target); otherwise sum(y * r)."""
    if ONLY and case not in ONLY:
        return
    WRITTEN.add(case)
    gen = generator(case)
    if module is not None:
        torch.manual_seed(zlib.crc32(case.encode()))  # torch's default init draws from the global stream
        module = module().double()
        names = [n for n, _ in module.named_parameters()]
        assert names == list(module.state_dict()), f"{case}: state beyond parameters: {list(module.state_dict())}"
        with torch.no_grad():
            for p in module.parameters():
                p.add_(uniform(gen, p.shape, -0.2, 0.2))
    x = x(gen)
    target = target(gen) if target is not None else None
    r = None
    for dtype, suffix in PRECISIONS:
        m = copy.deepcopy(module).to(dtype) if module is not None else None
        xi = x.to(dtype).clone().requires_grad_() if x.is_floating_point() else x
        ti = target.to(dtype) if target is not None and target.is_floating_point() else target
        if m is None:
            y = xi
        elif attn_mask is not None:
            y = call(m, xi, mask, attn_mask.to(dtype))
        else:
            y = call(m, xi, mask)
        if loss is not None:
            objective = loss(y, ti)
        else:
            if r is None:
                r = uniform(gen, y.shape)
            objective = (y * r.to(dtype)).sum()
        objective.backward()

        t = {"input": xi}
        if mask is not None:
            t["mask"] = mask.to(torch.uint8)
        if attn_mask is not None:
            t["attn_mask"] = attn_mask.to(torch.float32)
        if target is not None:
            t["target"] = ti
        if loss is None:
            t["r"] = r.to(dtype)
        if m is not None:
            t["output"] = y
        if loss is not None:
            t["loss"] = objective
        if x.is_floating_point():
            t["input.grad"] = xi.grad
        if m is not None:
            for name, p in m.named_parameters():
                t[name] = p
                t[name + ".grad"] = p.grad
        meta = {"case": case, "dtype": str(dtype), "torch": torch.__version__,
                "module": about or repr(m)}
        write_safetensors(os.path.join(OUT_DIR, f"{case}.{suffix}.safetensors"), t, meta)


def batch_first_input(gen):
    return torch.randn(BATCH, SEQ, D_MODEL, generator=gen, dtype=torch.float64)


def seq_first_input(gen):
    return torch.randn(SEQ, BATCH, D_MODEL, generator=gen, dtype=torch.float64)


def plain(m, x, mask):
    return m(x)


def self_attention(m, x, mask, attn_mask=None):
    return m(x, x, x, key_padding_mask=mask, attn_mask=attn_mask, need_weights=False)[0]


def encoder(m, x, mask, attn_mask=None):
    return m(x, src_mask=attn_mask, src_key_padding_mask=mask)


def scores_mask():
    """An additive [SEQ, SEQ] mask: -inf above the diagonal (causal), values in
    (-1, 1) elsewhere; float32 values, so both precisions add the same numbers. Key 0
    is never padded (LENGTHS), so every query keeps a key."""
    g = generator("scores_mask")
    m = uniform(g, (SEQ, SEQ)).float().double()
    return m.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))


def main():
    os.makedirs(OUT_DIR, exist_ok=True)

    emit("linear_bias", batch_first_input, lambda: nn.Linear(D_MODEL, 8), plain)
    emit("linear_nobias", batch_first_input, lambda: nn.Linear(D_MODEL, 8, bias=False), plain)
    emit("embedding", lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),  # 15 ids of 10: repeats
         lambda: nn.Embedding(VOCAB, D_MODEL), plain)
    emit("layer_norm", lambda g: 2 * batch_first_input(g) + 1, lambda: nn.LayerNorm(D_MODEL), plain)
    emit("relu", lambda g: 2 * batch_first_input(g), nn.ReLU, plain)
    emit("gelu", lambda g: 2 * batch_first_input(g), nn.GELU, plain)
    emit("gelu_tanh", lambda g: 2 * batch_first_input(g), lambda: nn.GELU(approximate="tanh"), plain)
    emit("meanpool_dim0", seq_first_input, lambda: MeanPool(0), plain, about="x.mean(0)")
    emit("meanpool_dim1", batch_first_input, lambda: MeanPool(1), plain, about="x.mean(1)")

    for batch_first in (False, True):
        layout = "batch_first" if batch_first else "seq_first"
        x = batch_first_input if batch_first else seq_first_input
        for mask in (None, padding_mask()):
            emit(f"mha_{layout}" + ("_mask" if mask is not None else ""), x,
                 lambda: nn.MultiheadAttention(D_MODEL, NHEAD, batch_first=batch_first), self_attention, mask)

    emit("mha_batch_first_attn_mask", batch_first_input,
         lambda: nn.MultiheadAttention(D_MODEL, NHEAD, batch_first=True), self_attention, padding_mask(),
         attn_mask=scores_mask())
    emit("encoder_post_relu", seq_first_input,
         lambda: nn.TransformerEncoderLayer(D_MODEL, NHEAD, DIM_FF, dropout=0.0), encoder)
    emit("encoder_pre_gelu_mask", batch_first_input,
         lambda: nn.TransformerEncoderLayer(D_MODEL, NHEAD, DIM_FF, dropout=0.0, activation="gelu",
                                            batch_first=True, norm_first=True), encoder, padding_mask())
    emit("encoder_post_relu_attn_mask", seq_first_input,
         lambda: nn.TransformerEncoderLayer(D_MODEL, NHEAD, DIM_FF, dropout=0.0), encoder, attn_mask=scores_mask())

    rows = BATCH * SEQ
    logits = lambda g: 2 * torch.randn(rows, 7, generator=g, dtype=torch.float64)
    classes = lambda g: torch.randint(0, 7, (rows,), generator=g)

    def with_ignored(g):
        t = classes(g)
        t[::3] = 3  # rows 0, 3, 6, ... (and any drawn as 3) are ignored
        return t

    emit("cross_entropy", logits, target=classes, loss=F.cross_entropy, about="F.cross_entropy(input, target)")
    emit("cross_entropy_ignore_index", logits, target=with_ignored,
         loss=lambda y, t: F.cross_entropy(y, t, ignore_index=3),
         about="F.cross_entropy(input, target, ignore_index=3)")
    emit("cross_entropy_label_smoothing", logits, target=classes,
         loss=lambda y, t: F.cross_entropy(y, t, label_smoothing=0.1),
         about="F.cross_entropy(input, target, label_smoothing=0.1)")
    emit("cross_entropy_ignore_smoothing", logits, target=with_ignored,
         loss=lambda y, t: F.cross_entropy(y, t, ignore_index=3, label_smoothing=0.1),
         about="F.cross_entropy(input, target, ignore_index=3, label_smoothing=0.1)")
    emit("mse_loss", lambda g: torch.randn(BATCH, SEQ, generator=g, dtype=torch.float64),
         target=lambda g: torch.randn(BATCH, SEQ, generator=g, dtype=torch.float64), loss=F.mse_loss,
         about="F.mse_loss(input, target)")

    def classifier():
        layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, DIM_FF, dropout=0.0, batch_first=True)
        # enable_nested_tensor=False: the plain path, whatever the mask and mode.
        return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), MeanPool(1),
                             nn.Linear(D_MODEL, CLASSES))

    emit("classifier", batch_first_input, classifier, plain,
         target=lambda g: torch.randint(0, CLASSES, (BATCH,), generator=g), loss=F.cross_entropy)


    decoder_cases()


def decoder_cases():
    emit("rms_norm", lambda g: 2 * batch_first_input(g) + 1, lambda: RMSNorm(D_MODEL), plain)
    emit("silu", lambda g: 3 * batch_first_input(g), nn.SiLU, plain)
    emit("llama_mlp", batch_first_input, lambda: LlamaMLP(D_MODEL, DIM_FF), plain)
    emit("gpt2_mlp", batch_first_input, lambda: GPT2MLP(D_MODEL), plain)
    emit("position_embedding_offset", batch_first_input,
         lambda: PositionEmbedding(MAX_POSITIONS, D_MODEL, POSITION_OFFSET), plain)

    def tokens(g):
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    def next_tokens(g):
        t = tokens(g)
        t[:, -1] = -100  # no next token after the last position
        t[1, 1] = -100   # and one padding position inside a sequence
        return t

    emit("token_cross_entropy", lambda g: 2 * torch.randn(BATCH, SEQ, VOCAB, generator=g, dtype=torch.float64),
         target=next_tokens, loss=token_cross_entropy,
         about="F.cross_entropy(input.transpose(1, 2), target), ignore_index -100")

    def decoder_stack():
        return nn.Sequential(nn.Embedding(VOCAB, D_MODEL), PositionEmbedding(MAX_POSITIONS, D_MODEL),
                             RMSNorm(D_MODEL), LlamaMLP(D_MODEL, DIM_FF), RMSNorm(D_MODEL), GPT2MLP(D_MODEL),
                             nn.Linear(D_MODEL, VOCAB))

    emit("decoder_stack", tokens, decoder_stack, plain, target=next_tokens, loss=token_cross_entropy)


if __name__ == "__main__":
    main()
    if ONLY - WRITTEN:
        sys.exit(f"no such case: {', '.join(sorted(ONLY - WRITTEN))}")
