#!/usr/bin/python3
"""PyTorch's training step on the reference model, for comparison with bench_model.

The same model, sizes and optimizer as benchmarks/bench_model.cpp: 6 x
TransformerEncoderLayer(d_model 512, nhead 8, dim_feedforward 2048, dropout 0.1,
batch_first), mean pool over the sequence, Linear to 10 classes, cross-entropy,
Adam lr 1e-3; batch 32 x seq 10, in training mode. Forward+backward and the
optimizer step (step + zero_grad) are timed apart; medians over the steps.
Run by hand (Debian's python3-torch, torch 1.13), pinned to one core as
bench_model is:

    taskset -c 0 /usr/bin/python3 benchmarks/torch_reference_step.py [--steps 20]
"""
import argparse
import statistics
import time

import torch
from torch import nn


class Reference(nn.Module):
    def __init__(self, a):
        super().__init__()
        layer = nn.TransformerEncoderLayer(a.d_model, a.heads, a.ff, a.dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, a.layers)
        self.head = nn.Linear(a.d_model, a.classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("batch", 32), ("seq", 10), ("d-model", 512), ("heads", 8), ("ff", 2048), ("layers", 6),
                          ("classes", 10), ("steps", 20), ("threads", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dropout", type=float, default=0.1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Reference(a).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(a.batch, a.seq, a.d_model)
    y = torch.randint(0, a.classes, (a.batch,))
    params = sum(t.numel() for t in model.parameters())

    fwd_bwd, optimizer = [], []
    for step in range(a.steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if step >= 2:
            fwd_bwd.append(t1 - t0)
            optimizer.append(t2 - t1)
    total = [f + o for f, o in zip(fwd_bwd, optimizer)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {params} parameters, "
          f"batch {a.batch} x seq {a.seq}, dropout {a.dropout}; medians of {a.steps} steps")
    print(f"forward+backward  {statistics.median(fwd_bwd) * 1e3:8.1f} ms")
    print(f"optimizer         {statistics.median(optimizer) * 1e3:8.1f} ms  (Adam step + zero_grad)")
    print(f"training step     {statistics.median(total) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
