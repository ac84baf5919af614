#!/usr/bin/env python3
"""Turns the JSON lines of shardlib's benchmarks and tools into PNG figures.

    tools/plot.py [--out docs/figures] FILE.jsonl...

Each line says what wrote it in "bench"; every figure whose data is present is drawn:
  strategies (bench_strategies --json) + plan (shardlib-plan --json)
      memory.png      per-rank peak memory by ledger category against world size, for
                      each strategy: measured bars beside the planner's prediction
      step_time.png   step time against world size, per strategy
  collectives (bench_collectives --json)
      collectives.png bus bandwidth against message size, beside the bus bandwidth the
                      same bytes would reach at the memcpy rate measured in the same run
  train_fsdp (train_fsdp --metrics)
      loss.png        loss per step (each rank, and their mean) and throughput
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import collections
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

CATEGORIES = ["parameters", "gradients", "optimizer_state", "gathered_parameters", "activations", "comm_scratch"]
COLORS = dict(zip(CATEGORIES, ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]))
ORDER = ["NoShard", "ShardOptimizer", "ShardGradOp", "FullShard", "HybridShard"]
ALIAS = {"NoShard": "DDP", "ShardOptimizer": "ZeRO-1", "ShardGradOp": "ZeRO-2", "FullShard": "ZeRO-3/FSDP",
         "HybridShard": "HSDP"}
MIB = 1024.0 ** 2


def read(paths):
    rows = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"plot.py: {path}:{n}: not JSON ({e})")
                rows[row.get("bench", "?")].append(row)
    return rows


def save(fig, out, name):
    path = os.path.join(out, name)
    # No software or date stamps: regenerating unchanged data gives unchanged files.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"plot.py: wrote {path}")


def strategies_present(rows):
    return [s for s in ORDER if any(r["strategy"] == s for r in rows)]


def memory(measured, planned, out):
    plan = {(r["strategy"], r["world"]): r["bytes"] for r in planned}
    names = strategies_present(measured)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 4.2), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], names):
        runs = sorted((r for r in measured if r["strategy"] == s), key=lambda r: r["world"])
        for i, r in enumerate(runs):
            predicted = plan.get((s, r["world"]))
            for offset, values, hatch in ((-0.2, r["peak_bytes"], None), (0.2, predicted, "//")):
                if values is None:
                    continue
                bottom = 0.0
                for c in CATEGORIES:
                    h = values[c] / MIB
                    ax.bar(i + offset, h, 0.38, bottom=bottom, color=COLORS[c], hatch=hatch, edgecolor="white",
                           linewidth=0.5)
                    bottom += h
        ax.set_xticks(range(len(runs)), [str(r["world"]) for r in runs])
        ax.set_xlabel("world size (ranks)")
        group = f", groups of {runs[0]['group']}" if s == "HybridShard" and runs else ""
        ax.set_title(f"{s}\n({ALIAS[s]}{group})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("per-rank peak by category (MiB)")
    axes[0][0].set_ylim(top=axes[0][0].get_ylim()[1] * 1.06)  # the tallest bar clear of the frame
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in CATEGORIES]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey"),
                plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="//")]
    fig.legend(handles, CATEGORIES + ["measured (left)", "planned (right)"], loc="lower center", ncol=8,
               fontsize=8, frameon=False)
    r0 = measured[0]
    fig.suptitle(f"Per-rank memory, {r0['layers']}-layer encoder (d_model {r0['d_model']}), Adam, fp32: "
                 "ledger peaks beside shardlib-plan", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    save(fig, out, "memory.png")


def step_time(measured, out):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in strategies_present(measured):
        runs = sorted((r for r in measured if r["strategy"] == s), key=lambda r: r["world"])
        ax.plot([r["world"] for r in runs], [r["step_s"] * 1e3 for r in runs], marker="o", label=f"{s} ({ALIAS[s]})")
    worlds = sorted({r["world"] for r in measured})
    ax.set_xticks(worlds)
    ax.set_xlabel("world size (ranks; threads on this machine)")
    ax.set_ylabel("step time (ms, median)")
    r0 = measured[0]
    note = f"{r0['cores']} cores: above that, ranks share cores" if "cores" in r0 else ""
    ax.set_title(f"Step time, per-rank batch {r0['batch']} x {r0['seq']} tokens\n{note}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out, "step_time.png")


def collectives(rows, out):
    rows = [r for r in rows if r.get("comm") == "thread" and not r["in_place"]]
    ops = [o for o in ("all_gather", "reduce_scatter", "all_reduce") if any(r["op"] == o for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.3 * len(ops), 4.0), sharey=True, squeeze=False)
    for ax, op in zip(axes[0], ops):
        for i, w in enumerate(sorted({r["world"] for r in rows if r["op"] == op})):
            runs = sorted((r for r in rows if r["op"] == op and r["world"] == w), key=lambda r: r["bytes"])
            color = f"C{i}"
            ax.plot([r["bytes"] for r in runs], [r["busbw_GBps"] for r in runs], marker="o", color=color,
                    label=f"W={w}")
            # floor_ratio = memcpy time of the bytes the collective moves / its time.
            ax.plot([r["bytes"] for r in runs], [r["busbw_GBps"] / r["floor_ratio"] for r in runs], linestyle="--",
                    color=color, label=f"W={w} at memcpy rate")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes, nccl-tests' definition)")
        ax.set_title(op, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    fig.suptitle("ThreadComm collectives (out of place) against memcpy of the same bytes", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    save(fig, out, "collectives.png")


def loss(rows, out):
    by_rank = collections.defaultdict(list)
    for r in rows:
        by_rank[r["rank"]].append(r)
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(10, 4.0))
    steps = collections.defaultdict(list)
    for rank in sorted(by_rank):
        runs = sorted(by_rank[rank], key=lambda r: r["step"])
        ax.plot([r["step"] for r in runs], [r["loss"] for r in runs], linewidth=0.7, alpha=0.5, label=f"rank {rank}")
        for r in runs:
            steps[r["step"]].append(r)
    xs = sorted(steps)
    ax.plot(xs, [sum(r["loss"] for r in steps[s]) / len(steps[s]) for s in xs], color="black", linewidth=1.8,
            label="mean over ranks")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (rank's own batch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    # A step ends for everyone when its slowest rank does: all ranks' tokens over the slowest's time.
    tx.plot(xs, [sum(r["tokens_per_s"] * r["step_s"] for r in steps[s]) / max(r["step_s"] for r in steps[s])
                 for s in xs], color="C2")
    tx.set_xlabel("step")
    tx.set_ylabel("tokens/s, all ranks")
    tx.grid(alpha=0.3)
    r0 = rows[0]
    fig.suptitle(f"train_fsdp: {r0['strategy']} on {r0['world']} ranks", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    save(fig, out, "loss.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/figures", help="directory for the PNGs")
    ap.add_argument("files", nargs="+", help="JSON-lines files")
    args = ap.parse_args()
    rows = read(args.files)
    os.makedirs(args.out, exist_ok=True)
    drawn = 0
    if rows["strategies"]:
        memory(rows["strategies"], rows["plan"], args.out)
        step_time(rows["strategies"], args.out)
        drawn += 2
    if rows["collectives"]:
        collectives(rows["collectives"], args.out)
        drawn += 1
    if rows["train_fsdp"]:
        loss(rows["train_fsdp"], args.out)
        drawn += 1
    if not drawn:
        sys.exit("plot.py: no rows from bench_strategies, bench_collectives or train_fsdp in " + " ".join(args.files))


if __name__ == "__main__":
    main()
