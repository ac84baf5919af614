#!/usr/bin/python3
"""Writes optim_goldens.bin: torch.optim trajectories that tests/unit/test_optim.cpp
compares shardlib's optimizers against. Run by hand, with Debian's CPU torch
(apt-get install python3-torch python3-numpy; torch 1.13):

    /usr/bin/python3 tests/golden/make_optim_goldens.py

Each variant below runs 100 steps on N parameters, once in float32 and once in
float64, from the same initial parameters and gradient sequence. Both are given
by integer formulas (initial_params, gradient) that the C++ test repeats; every
value is exactly representable in float32, so both runs and the C++ test start
from identical inputs. The inputs are stored too, so the test checks that its
formulas agree with these.

File format: records until the end of the file, all little-endian:
    u32  name length in bytes
    ...  name (ASCII)
    u64  count
    ...  count float64 values
Names: "input/param0", "input/grad/<t>" (t = 1, 100), and
"<dtype>/<variant>/<what>/<t>" with dtype f32 or f64, what = param after step t
(t = 1, 100) or a state buffer after step 100 (exp_avg, exp_avg_sq,
max_exp_avg_sq, momentum_buffer: PyTorch's state names).
"""
import os
import struct

import numpy as np
import torch

N = 256
STEPS = 100
SNAPSHOTS = (1, STEPS)


def initial_params():
    # Odd multiples of 1/512 in (-0.79, 0.78): never zero, exact in float32.
    return np.array([(2 * ((i * 37 + 11) % 401) - 401) / 512 for i in range(N)])


def gradient(t):
    # A hash of (t, i) to an integer in [-1000, 1000], over 512 and over 16^(i mod 4):
    # magnitudes from about 2 down to 5e-4, exact in float32.
    g = []
    for i in range(N):
        h = ((t * 1000003 + i * 7919 + 12345) * 2654435761) % 2**32
        g.append(((h >> 7) % 2001 - 1000) / 512 / 16 ** (i % 4))
    return np.array(g)


VARIANTS = {
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam_l2": (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_weight_decay": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
}


def run(variant, dtype):
    cls, kwargs = VARIANTS[variant]
    p = torch.tensor(initial_params(), dtype=dtype, requires_grad=True)
    opt = cls([p], foreach=False, **kwargs)  # the single-tensor path shardlib follows
    out = {}
    for t in range(1, STEPS + 1):
        p.grad = torch.tensor(gradient(t), dtype=dtype)
        opt.step()
        if t in SNAPSHOTS:
            out[f"param/{t}"] = p.detach().double().numpy().copy()
    for key, value in opt.state[p].items():
        if key != "step" and value is not None:  # plain SGD keeps momentum_buffer = None
            out[f"{key}/{STEPS}"] = value.double().numpy().copy()
    return out


def main():
    torch.set_num_threads(1)
    records = {"input/param0": initial_params()}
    for t in SNAPSHOTS:
        records[f"input/grad/{t}"] = gradient(t)
    for dtype, tag in ((torch.float32, "f32"), (torch.float64, "f64")):
        for variant in VARIANTS:
            for what, values in run(variant, dtype).items():
                records[f"{tag}/{variant}/{what}"] = values
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_goldens.bin")
    with open(path, "wb") as f:
        for name, values in records.items():
            data = np.ascontiguousarray(values, dtype="<f8")
            f.write(struct.pack("<I", len(name)) + name.encode("ascii"))
            f.write(struct.pack("<Q", data.size) + data.tobytes())
    print(f"wrote {len(records)} arrays to {path} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
