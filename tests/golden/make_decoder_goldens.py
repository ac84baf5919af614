#!/usr/bin/python3
"""Writes tests/golden/decoder/<case>.<f64|f32>.safetensors: PyTorch's forward and
backward of GPT-2's and LLaMA's attention, which tests/unit/test_decoder_attention.cpp
compares nn::GPT2Attention and nn::LlamaAttention against. Run by hand (CI only
reads the files), with Debian's CPU torch (apt-get install python3-torch python3-numpy):

    /usr/bin/python3 tests/golden/make_decoder_goldens.py

torch 1.13 has no F.scaled_dot_product_attention, so the attention is written in
plain torch ops the way Hugging Face's eager attention computes it: projections,
rotate_half RoPE and repeat_kv (LLaMA), scores q k^T / sqrt(head_dim), the masks
as -inf (causal, key padding) or added (the additive mask), softmax, weights
times v, the output projection. Projections are nn.Linear, so weights are
[out, in]: shardlib's layout (GPT-2's Conv1D checkpoints hold the transpose; an
importer transposes them). Each case runs in float64 and in a float32 copy of the
same values, with the objective sum(y * r); parameters are torch's init moved by
U(-0.2, 0.2) so the zero biases are exercised. Seeds are crc32 of the case name.

Tensors in a file (written by make_layer_goldens.write_safetensors):
    input, input.grad     x [batch, seq, hidden] and dL/dx
    r                     dL/d(output)
    output                the layer's output
    mask                  U8 [batch, seq], nonzero = padding key (cases with padding)
    attn_mask             F32, added to the scores, broadcast to [batch, heads, seq, seq]
    <name>, <name>.grad   every parameter under shardlib's (Hugging Face's) name, and its gradient
"""
import copy
import math
import os
import sys
import zlib

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_layer_goldens import PRECISIONS, generator, uniform, write_safetensors  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decoder")
BATCH, SEQ, HIDDEN = 2, 5, 16


def padding(lengths, seq=SEQ):
    return torch.arange(seq).expand(len(lengths), seq) >= torch.tensor(lengths).unsqueeze(1)  # True = padding


def attend(q, k, v, pad, bias):
    """Causal attention of q [B, H, S, D] over k, v of the same shape."""
    s = q.shape[2]
    w = q @ k.transpose(2, 3) / math.sqrt(q.shape[3])
    if bias is not None:
        w = w + bias.to(w.dtype)
    forbidden = ~torch.ones(s, s, dtype=torch.bool).tril()
    if pad is not None:
        forbidden = forbidden | pad[:, None, None, :]
    w = torch.softmax(w.masked_fill(forbidden, -math.inf), dim=-1)
    return w @ v


class GPT2Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x, pad, bias):
        b, s, e = x.shape
        heads = lambda t: t.view(b, s, self.n_head, e // self.n_head).transpose(1, 2)
        q, k, v = (heads(t) for t in self.c_attn(x).split(e, dim=2))
        return self.c_proj(attend(q, k, v, pad, bias).transpose(1, 2).reshape(b, s, e))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, theta, bias):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x, pad, bias):
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, self.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        # Angles in float64 (shardlib's choice; Hugging Face uses float32), then cos and sin in x's dtype.
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = self.heads // self.kv_heads
        o = attend(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), pad, bias)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.heads * d))


def emit(case, module, pad=None, bias_shape=None, about=""):
    """Runs `module` on a random x in float64 and float32 with the key padding
    mask `pad` and, with bias_shape, a random additive mask; writes both files."""
    gen = generator(case)
    torch.manual_seed(zlib.crc32(case.encode()))  # torch's default init draws from the global stream
    module = module().double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(uniform(gen, p.shape, -0.2, 0.2))
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64)
    bias = uniform(gen, bias_shape).float() if bias_shape else None  # float32 values: exact in both runs
    r = None
    for dtype, suffix in PRECISIONS:
        m = copy.deepcopy(module).to(dtype)
        xi = x.to(dtype).clone().requires_grad_()
        y = m(xi, pad, bias)
        if r is None:
            r = uniform(gen, y.shape)
        (y * r.to(dtype)).sum().backward()
        t = {"input": xi, "input.grad": xi.grad, "r": r.to(dtype), "output": y}
        if pad is not None:
            t["mask"] = pad.to(torch.uint8)
        if bias is not None:
            t["attn_mask"] = bias
        for name, p in m.named_parameters():
            t[name] = p
            t[name + ".grad"] = p.grad
        meta = {"case": case, "dtype": str(dtype), "torch": torch.__version__, "module": about}
        write_safetensors(os.path.join(OUT_DIR, f"{case}.{suffix}.safetensors"), t, meta)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    emit("gpt2_causal_padding", lambda: GPT2Attention(HIDDEN, 4), pad=padding((5, 3)), bias_shape=(1, 4, SEQ, SEQ),
         about="GPT-2 attention (c_attn as nn.Linear), n_embd 16, n_head 4, causal, key padding, additive mask")
    emit("llama_gqa_rope", lambda: LlamaAttention(HIDDEN, 4, 2, 4, 10000.0, False), pad=padding((5, 4)),
         about="LLaMA attention, hidden 16, 4 heads, 2 kv heads, head_dim 4, rope_theta 1e4, causal, key padding")
    emit("llama_mqa_bias", lambda: LlamaAttention(HIDDEN, 2, 1, 8, 500000.0, True),
         about="LLaMA attention, hidden 16, 2 heads, 1 kv head, head_dim 8, rope_theta 5e5, attention_bias")


if __name__ == "__main__":
    main()
