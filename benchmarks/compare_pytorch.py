#!/usr/bin/env python3
"""compare_pytorch: bench_strategies' model trained by PyTorch on the CPU over gloo,
beside shardlib's bench_strategies run with the same settings on the same cores.

PyTorch side: torch.nn.TransformerEncoderLayer (batch_first) x layers, mean pool over
the sequence, Linear head, cross-entropy, Adam (lr 1e-3); W processes from
torch.multiprocessing.spawn; FSDP FULL_SHARD / SHARD_GRAD_OP (each encoder layer
wrapped, as shardlib wraps them; forward and backward prefetch of one unit, as
shardlib's prefetch 1), DDP with ZeroRedundancyOptimizer for ZeRO-1, DDP for NoShard.
Both sides: one compute thread per rank, pinned to the same cores (core 0 for W = 1,
cores 0..min(W, cores)-1 otherwise), a barrier before each step, the step time of the
slowest rank, the median over the measured steps pooled over rounds that alternate
the two sides, and peak resident memory per rank: each rank process's VmHWM for
PyTorch, the one process's peak (GNU time's %M) divided by W for shardlib, whose ranks
are threads of one process. (A child's ru_maxrss would count the pages of the parent
it was forked from, here a Python with torch loaded, hence VmHWM and GNU time.)

--model gpt2: Hugging Face's transformers.GPT2LMHeadModel (GPT2Config of the same sizes:
n_layer --layers, n_embd --d-model, n_head --heads, n_inner --ff, n_positions --seq,
vocab_size --vocab, all three dropouts --dropout, 0 by default) against shardlib's
models::GPT2LMHeadModel, AdamW (lr 1e-3), loss = the model's own with labels = input_ids
(next-token cross-entropy) on uniform random token ids, each GPT2Block an FSDP unit.

Run by hand, PyTorch is never a dependency. torch 2.x from pip runs FSDP on the CPU
when given device_id=cpu (Debian's torch 1.13 cannot: its FSDP needs CUDA and does not
import on Python 3.11: the script then leaves the FSDP rows out); Debian's torch multiplies
through libblas.so.3, the reference BLAS unless OpenBLAS is installed or its directory
(libopenblas0-pthread's openblas-pthread/) is put first on LD_LIBRARY_PATH; the table names
the BLAS the ranks loaded. GNU time (Debian package `time`) measures shardlib's RSS:
    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch
    cmake --build build/release --target bench_strategies
    /tmp/torchenv/bin/python benchmarks/compare_pytorch.py [--model encoder|gpt2] [--vocab 8192] [--worlds 1,2,4]
        [--strategies full,grad-op,optimizer,none] [--article] [--layers 4] [--d-model 256]
        [--heads 4] [--ff 1024] [--seq 16] [--batch 8] [--classes 10] [--dropout 0.1]
        [--warmup 2] [--steps 8] [--rounds 2] [--bench build/release/benchmarks/bench_strategies]
"""
import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# flag name -> (shardlib strategy name, what PyTorch runs)
STRATEGIES = {
    "full": ("FullShard", "FSDP FULL_SHARD"),
    "grad-op": ("ShardGradOp", "FSDP SHARD_GRAD_OP"),
    "optimizer": ("ShardOptimizer", "DDP + ZeroRedundancyOptimizer"),
    "none": ("NoShard", "DDP"),
}
GNU_TIME = "/usr/bin/time"
MODEL_FLAGS = ("model", "vocab", "layers", "d_model", "heads", "ff", "seq", "batch", "classes", "dropout")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("encoder", "gpt2"), default="encoder")
    p.add_argument("--vocab", type=int, default=8192, help="gpt2: vocabulary size")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--strategies", default="full,grad-op,optimizer,none")
    p.add_argument("--article", action="store_true", help="the FSDP article's sizes (6 x d512, 8 heads, ff 2048, seq 10)")
    for name, default in (("layers", None), ("d-model", None), ("heads", None), ("ff", None), ("seq", None),
                          ("batch", 8), ("classes", 10)):
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dropout", type=float, default=None, help="0.1 for the encoder, 0 for gpt2 unless given")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--bench", default=os.path.normpath(os.path.join(here, "..", "build", "release", "benchmarks",
                                                                    "bench_strategies")))
    a = p.parse_args()
    sizes = dict(layers=6, d_model=512, heads=8, ff=2048, seq=10) if a.article else \
        dict(layers=4, d_model=256, heads=4, ff=1024, seq=16)
    for k, v in sizes.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.dropout is None:
        a.dropout = 0.0 if a.model == "gpt2" else 0.1
    a.worlds = [int(w) for w in a.worlds.split(",")]
    a.strategies = a.strategies.split(",")
    for s in a.strategies:
        if s not in STRATEGIES:
            p.error(f"unknown strategy {s!r} (one of {', '.join(STRATEGIES)})")
    return a


def cores_for(world):
    available = sorted(os.sched_getaffinity(0))
    return available[:max(1, min(world, len(available)))]


def vm_hwm_kib():
    """This process's own peak resident set (ru_maxrss also counts the forking parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def blas_library():
    """The BLAS this process loaded: Debian's torch 1.13 calls whatever libblas.so.3 resolves
    to, the reference BLAS unless an optimised one is installed or put first on
    LD_LIBRARY_PATH, and its matrix products run several times slower on the reference one."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "blas" in line.split()[-1]}
    return ", ".join(sorted(paths)) or "none mapped"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- PyTorch side: one rank ----------------------------------------------------------------------
def torch_rank(rank, cfg, strategy, world, port, out_path):
    os.sched_setaffinity(0, cfg["cores"])
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)  # one compute thread per rank, as shardlib's rank threads
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    baseline_kib = vm_hwm_kib()  # interpreter, libtorch, gloo

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(cfg["d_model"], cfg["heads"], cfg["ff"], cfg["dropout"], batch_first=True)
                for _ in range(cfg["layers"]))
            self.head = nn.Linear(cfg["d_model"], cfg["classes"])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x.mean(dim=1))

    torch.manual_seed(1)
    if cfg["model"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["d_model"], n_layer=cfg["layers"],
            n_head=cfg["heads"], n_inner=cfg["ff"], resid_pdrop=cfg["dropout"], embd_pdrop=cfg["dropout"],
            attn_pdrop=cfg["dropout"]))
        unit, optimizer_class = GPT2Block, torch.optim.AdamW

        def batch(gen):
            ids = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
            return ids, ids

        def loss(x, y):
            return model(input_ids=x, labels=y).loss  # shifts the labels inside: next-token cross-entropy
    else:
        model = Classifier()
        unit, optimizer_class = nn.TransformerEncoderLayer, torch.optim.Adam

        def batch(gen):
            return (torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], generator=gen),
                    torch.randint(cfg["classes"], (cfg["batch"],), generator=gen))

        def loss(x, y):
            return F.cross_entropy(model(x), y)
    params = sum(p.numel() for p in model.parameters())
    if strategy in ("full", "grad-op"):
        import functools
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        model = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy.FULL_SHARD if strategy == "full" else ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                               transformer_layer_cls={unit}),
            forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            device_id=torch.device("cpu"))  # without it, FSDP refuses to run where no accelerator is found
        opt = optimizer_class(model.parameters(), lr=1e-3)
    else:
        from torch.nn.parallel import DistributedDataParallel
        # GPT-2's constant buffers (the causal mask is bool, which gloo cannot broadcast) stay out of DDP's sync
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in model.named_buffers()])
        model = DistributedDataParallel(model)
        if strategy == "optimizer":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-3)
        else:
            opt = optimizer_class(model.parameters(), lr=1e-3)
    model.train()

    gen = torch.Generator().manual_seed(1000 + rank)
    times = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = batch(gen)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss(x, y).backward()
        opt.step()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    mem = torch.tensor([vm_hwm_kib(), baseline_kib], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"step_times_s": t.tolist(), "peak_rss_kib": mem[0].item(), "baseline_rss_kib": mem[1].item(),
                       "params": params, "torch": torch.__version__, "blas": blas_library()}, f)
        os.rename(out_path + ".tmp", out_path)  # complete or absent
    dist.destroy_process_group()


def run_torch(cfg, strategy, world, attempts=3):
    """Gloo now and then aborts a rank while the processes shut down (std::terminate in a
    thread's destructor): a run whose results were written counts, another is retried."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        for attempt in range(1, attempts + 1):
            try:
                mp.spawn(torch_rank, args=(cfg, strategy, world, free_port(), out), nprocs=world, join=True)
            except ProcessException as e:
                done = os.path.exists(out)
                print(f"# PyTorch {strategy} W={world}, attempt {attempt}: {type(e).__name__} "
                      f"({'after' if done else 'before'} its results were written)", file=sys.stderr, flush=True)
                if not done and attempt == attempts:
                    raise
            if os.path.exists(out):
                with open(out) as f:
                    return json.load(f)
    sys.exit(f"compare_pytorch: PyTorch {strategy} W={world} wrote no results in {attempts} attempts")


# --- shardlib side ----------------------------------------------------------------------------------
def bench_command(args, strategy, world, json_path):
    cmd = [args.bench, "--worlds", str(world), "--strategies", strategy, "--rounds", "1",
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--prefetch", "1"]
    for k in MODEL_FLAGS:
        cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return cmd + ["--json", json_path]


def run_shardlib(args, strategy, world, cores):
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.NamedTemporaryFile(suffix=".rss") as rss:
        cmd = [GNU_TIME, "-f", "%M", "-o", rss.name] + bench_command(args, strategy, world, out.name)
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, cores))
        if done.returncode != 0:
            sys.exit(f"compare_pytorch: {args.bench} failed with status {done.returncode}")
        with open(out.name) as f:
            row = json.loads(f.readline())
        with open(rss.name) as f:
            row["process_peak_rss_kib"] = int(f.read().split()[-1])
    return row


def fsdp_unavailable():
    """Why this torch cannot run FSDP on the CPU, or None: torch 1.13's FSDP needs CUDA
    (and on Python 3.11 does not even import)."""
    import torch
    if int(torch.__version__.split(".")[0]) < 2:
        return f"torch {torch.__version__}: FSDP needs CUDA before torch 2"
    try:
        import torch.distributed.fsdp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no FSDP rows
        return f"importing torch.distributed.fsdp failed: {type(e).__name__}: {e}"
    return None


def mib_from_kib(kib):
    return kib / 1024


def main():
    args = parse_args()
    if not os.access(args.bench, os.X_OK):
        sys.exit(f"compare_pytorch: no bench_strategies at {args.bench} (build it, or pass --bench)")
    if not os.access(GNU_TIME, os.X_OK):
        sys.exit(f"compare_pytorch: needs GNU time at {GNU_TIME} (apt-get install time)")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # one compute thread per rank; spawned ranks inherit it
    import torch

    ncores = len(os.sched_getaffinity(0))
    print("# compare_pytorch: shardlib bench_strategies vs PyTorch on the CPU (gloo)")
    print(f"# run as: {' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv)}")
    print(f"# python {platform.python_version()}, torch {torch.__version__}, {ncores} usable cores "
          f"({platform.processor() or platform.machine()})")
    if args.model == "gpt2":
        import transformers
        print(f"# model: GPT2LMHeadModel({args.layers} blocks, n_embd {args.d_model}, {args.heads} heads, n_inner "
              f"{args.ff}, vocab {args.vocab}, dropout {args.dropout}, tied head), transformers "
              f"{transformers.__version__} ({'eager attention: this torch has no F.scaled_dot_product_attention' if not hasattr(torch.nn.functional, 'scaled_dot_product_attention') else 'its default attention'}); "
              f"per-rank batch {args.batch} x seq {args.seq}; AdamW lr 1e-3; fp32")
    else:
        print(f"# model: {args.layers} x TransformerEncoderLayer(d_model {args.d_model}, {args.heads} heads, ff "
              f"{args.ff}, dropout {args.dropout}, batch_first), mean pool, Linear -> {args.classes}; per-rank batch "
              f"{args.batch} x seq {args.seq}; Adam lr 1e-3; fp32")
    fsdp_missing = fsdp_unavailable()
    if fsdp_missing:
        print(f"# PyTorch's FSDP cannot run here ({fsdp_missing}): the full and grad-op rows are left out")
        args.strategies = [s for s in args.strategies if s not in ("full", "grad-op")]
        if not args.strategies:
            sys.exit("compare_pytorch: no strategy left that this torch can run (optimizer, none)")
    print(f"# {args.warmup} warm-up + {args.steps} measured steps per run, {args.rounds} rounds alternating the "
          f"sides; step = median of the slowest rank's step; both sides pinned to the same cores, one compute "
          f"thread per rank (torch.set_num_threads(1))")
    print(f"# shardlib: {' '.join(bench_command(args, '<strategy>', 'W', 'FILE'))} (pinned with sched_setaffinity)")
    print("# load average at start: %.2f %.2f %.2f (other work on the machine slows both sides)" % os.getloadavg())

    rows = []
    for world in args.worlds:
        cores = cores_for(world)
        cfg = {k: getattr(args, k) for k in MODEL_FLAGS + ("warmup", "steps")}
        cfg["cores"] = cores
        for strategy in args.strategies:
            ours, theirs = {"step_times_s": []}, {"step_times_s": []}
            for _ in range(args.rounds):
                t = run_torch(cfg, strategy, world)
                s = run_shardlib(args, strategy, world, cores)
                theirs["step_times_s"] += t.pop("step_times_s")
                ours["step_times_s"] += s.pop("step_times_s")
                for side, new in ((theirs, t), (ours, s)):
                    for k, v in new.items():
                        side[k] = max(side.get(k, v), v) if isinstance(v, (int, float)) else v
            row = dict(strategy=strategy, world=world, cores=cores,
                       torch_ms=1e3 * statistics.median(theirs["step_times_s"]),
                       ours_ms=1e3 * statistics.median(ours["step_times_s"]),
                       torch_rss=mib_from_kib(theirs["peak_rss_kib"]),
                       torch_base=mib_from_kib(theirs["baseline_rss_kib"]),
                       ours_rss=mib_from_kib(ours["process_peak_rss_kib"]) / world,
                       ours_ledger=ours["peak_bytes"]["total"] / 2**20,
                       params=theirs["params"], blas=theirs["blas"])
            rows.append(row)
            print(f"# done: {strategy} W={world}: PyTorch {row['torch_ms']:.1f} ms, shardlib {row['ours_ms']:.1f} ms",
                  file=sys.stderr, flush=True)

    print(f"\n{rows[0]['params']} parameters. Memory per rank in MiB: PyTorch's peak RSS (VmHWM) of each rank's process "
          f"(in parentheses: above its RSS after import and process-group setup); shardlib's one-process peak RSS "
          f"divided by W, and its ledger's per-rank peak (tensors only).\n")
    print("| strategy | PyTorch runs | W | cores | PyTorch step ms | shardlib step ms | shardlib / PyTorch "
          "| PyTorch peak RSS / rank | shardlib peak RSS / rank | shardlib ledger peak / rank |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        name, theirs = STRATEGIES[r["strategy"]]
        oversub = "*" if r["world"] > len(r["cores"]) else ""
        print(f"| {name} | {theirs} | {r['world']}{oversub} | {','.join(map(str, r['cores']))} | {r['torch_ms']:.1f} "
              f"| {r['ours_ms']:.1f} | {r['ours_ms'] / r['torch_ms']:.2f} "
              f"| {r['torch_rss']:.0f} ({r['torch_rss'] - r['torch_base']:+.0f}) | {r['ours_rss']:.1f} "
              f"| {r['ours_ledger']:.1f} |")
    print(f"\nPyTorch's BLAS: {rows[0]['blas']}")
    if any(r["world"] > len(r["cores"]) for r in rows):
        print("\n\\* more ranks than cores: both sides share the cores (contention, not scaling).")
    print("\n# load average at end: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
