#!/usr/bin/python3
"""PyTorch DDP peer of bench/grad_sync.cc: the same model shapes, batch, loss
and optimizer through torch.nn.parallel.DistributedDataParallel (Gloo, 2
ranks on a FileStore), timed like the C++ bench: (a) compute only (the bare
module) and (b) DDP, interleaved step by step, 2 warm-up rounds, median per
mode, max over ranks. Prints one line: DDP_PEER {json} with, per shape,
compute_ms and ddp_ms.

  ddp_grad_sync_peer.py --shapes blocks:256,mlp:1024,branch:1024 --layers 8 \
      --batch 64 --steps 20 --bucket_bytes blocks=N,...

Started by a launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment, as bench/sync_topology.cc starts it on each simulated host),
it is one rank of that world (env://) instead of spawning two.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class Block(nn.Module):
    """bench/grad_sync.cc's Block: transformer-layer-shaped parameters."""

    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, h):
        x = self.ln1(h)
        h = h + self.o(torch.sigmoid(self.q(x)) * self.k(x) + self.v(x))
        return h + self.fc2(torch.relu(self.fc1(self.ln2(h))))


class Net(nn.Module):
    def __init__(self, shape, d, layers):
        super().__init__()
        self.shape = shape
        if shape == "blocks":
            self.body = nn.Sequential(*[Block(d) for _ in range(layers)])
        else:
            mods = []
            for _ in range(layers):
                mods += [nn.Linear(d, d), nn.ReLU()]
            self.body = nn.Sequential(*mods)
        self.branch = nn.Linear(d, d) if shape == "branch" else None

    def forward(self, x, step):
        h = self.body(x)
        if self.branch is not None and step % 2 == 0:
            h = h + self.branch(h)
        return h


def run(rank, args, store):
    torch.set_num_threads(1)
    if store is None:  # under a launcher
        dist.init_process_group("gloo", init_method="env://")
    else:
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    results = {}
    flag = torch.zeros(1)
    device = torch.device("cpu")
    if args.device == "cuda":  # rank r on cuda:r modulo the GPUs, as evenstep's bench
        device = torch.device("cuda", rank % torch.cuda.device_count())
    for spec in args.shapes.split(","):
        shape, d = spec.split(":")
        d = int(d)
        torch.manual_seed(0)
        model = Net(shape, d, args.layers).to(device)
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_bytes[shape] / 2**20,
            find_unused_parameters=shape == "branch")
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        torch.manual_seed(1 + rank)
        x = torch.randn(args.batch, d).to(device)
        times = {"compute": [], "ddp": []}
        for s in range(args.steps + 2):
            for mode in ("compute", "ddp"):
                dist.all_reduce(flag)  # start every step together
                start = time.perf_counter()
                opt.zero_grad()
                net = model if mode == "compute" else ddp
                net(x, s).pow(2).mean().backward()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                ms = (time.perf_counter() - start) * 1e3
                if s >= 2:
                    times[mode].append(ms)
        def q(v, p):  # nearest rank, as bench/grad_sync.cc's QuantileMs
            v = sorted(v)
            return v[min(len(v) - 1, int(p * len(v)))]
        t = torch.tensor([q(times["compute"], 0.5), q(times["ddp"], 0.5),
                          q(times["compute"], 0.1), q(times["compute"], 0.9),
                          q(times["ddp"], 0.1), q(times["ddp"], 0.9)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[shape] = {"compute_ms": t[0].item(), "ddp_ms": t[1].item(),
                          "compute_p10_ms": t[2].item(), "compute_p90_ms": t[3].item(),
                          "ddp_p10_ms": t[4].item(), "ddp_p90_ms": t[5].item()}
    if rank == 0:
        print("DDP_PEER " + json.dumps({"torch": torch.__version__, "shapes": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket_bytes", required=True, help="shape=bytes,...")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (over Gloo)")
    args = parser.parse_args()
    args.bucket_bytes = {k: int(v) for k, v in
                         (kv.split("=") for kv in args.bucket_bytes.split(","))}
    if "RANK" in os.environ:
        run(int(os.environ["RANK"]), args, None)
        return 0
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run, args=(args, os.path.join(d, "store")), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
