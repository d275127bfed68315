#!/usr/bin/python3
"""The conformance cases of tests/testing/conformance_models.h through
PyTorch's DistributedDataParallel (Gloo, 2 ranks on a FileStore: no port),
for conformance_test.cc to compare with evenstep's GradSync. The models,
initial values, data, split, loss and optimizers are that header's formulas:
change them together.

  ddp_peer.py --case tied_adam --out ddp.json [--world 2 --steps 5 --micro 3]

Rank 0 writes {"params": {name: [values]}, "buffers": {...}} after the last
step. DDP averages gradients over ranks, so each rank's loss is its sum of
per-sample losses / the global count * world (the mean over the global batch
after DDP's division); micro-steps but the last run under no_sync().
"""
import argparse
import json
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

N = 18


def init_parameters(model):
    with torch.no_grad():
        for k, (_, p) in enumerate(model.named_parameters()):
            n = p.numel()
            if n == 0:  # zero output features: nothing to set
                continue
            scale = 0.5 / math.sqrt(n // p.shape[0]) if p.dim() >= 2 else 0.1
            v = torch.sin(torch.arange(n, dtype=torch.float64) * 0.7 + 1.3 * k + 0.2) * scale
            p.copy_(v.view(p.shape).to(p.dtype))


def rows(samples, step, dims):
    s = torch.tensor(samples, dtype=torch.float64).unsqueeze(1) + 100.0 * step
    j = torch.arange(dims, dtype=torch.float64).unsqueeze(0)
    return torch.sin(0.37 * s + 0.91 * j).to(torch.float32)


def ids(samples, step, vocab):
    return torch.tensor([(step * 31 + s * 7) % vocab for s in samples], dtype=torch.long)


def targets(samples, step, classes):
    return torch.tensor([(step * 5 + s * 3) % classes for s in samples], dtype=torch.long)


def sum_ce(logits, t):
    return F.cross_entropy(logits, t, reduction="sum")


class Tied(nn.Module):
    V, D = 11, 8

    def __init__(self, adam):
        super().__init__()
        self.adam = adam
        self.embed = nn.Embedding(self.V, self.D)
        self.proj = nn.Linear(self.D, self.D)
        self.branch = nn.Linear(self.D, self.D)
        self.never = nn.Linear(self.D, self.D)
        self.head_weight = self.embed.weight  # tied
        for p in self.proj.parameters():
            p.requires_grad_(False)

    def loss(self, samples, step, rank):
        h = torch.tanh(self.proj(self.embed(ids(samples, step, self.V))))
        if step % 2 == 1 and (step + rank) % 3 != 0:
            h = h + self.branch(h)
        return sum_ce(h.matmul(self.head_weight.t()), targets(samples, step, self.V))

    def optimizer(self, params):
        if self.adam:
            return torch.optim.Adam(params, lr=0.01, weight_decay=0.01)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


class Sparse(nn.Module):
    V, D, C = 13, 6, 4

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.V, self.D, sparse=True)
        self.head = nn.Linear(self.D, self.C)

    def loss(self, samples, step, rank):
        return sum_ce(self.head(torch.tanh(self.embed(ids(samples, step, self.V)))),
                      targets(samples, step, self.C))

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class BatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, 3)

    def loss(self, samples, step, rank):
        return sum_ce(self.l2(torch.relu(self.bn(self.l1(rows(samples, step, 5))))),
                      targets(samples, step, 3))

    optimizer = staticmethod(momentum_sgd)


class Layout(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.t = nn.Parameter(torch.zeros(6, 4).t())
        self.u = nn.Parameter(torch.zeros(3, 8)[:, ::2])
        self.head = nn.Linear(6, 3)
        self.conv.weight.data = self.conv.weight.data.contiguous(memory_format=torch.channels_last)

    def loss(self, samples, step, rank):
        x = rows(samples, step, 32).view(-1, 2, 4, 4)
        f = torch.relu(self.conv(x)).mean((2, 3))
        logits = self.head(torch.tanh(f.matmul(self.t))) + f.matmul(self.u.t())
        return sum_ce(logits, targets(samples, step, 3))

    optimizer = staticmethod(momentum_sgd)


class Reverse(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(6, 6) for _ in range(4))

    def loss(self, samples, step, rank):
        h = torch.tanh(self.l4(rows(samples, step, 6)))
        h = torch.tanh(self.l3(h))
        h = torch.tanh(self.l2(h))
        return sum_ce(self.l1(h), targets(samples, step, 6))

    optimizer = staticmethod(momentum_sgd)


class OneParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(5, 5)
        self.w = nn.Linear(5, 3, bias=False)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def loss(self, samples, step, rank):
        return sum_ce(self.w(torch.tanh(self.frozen(rows(samples, step, 5)))),
                      targets(samples, step, 3))

    optimizer = staticmethod(momentum_sgd)


class ControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.never = (nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def loss(self, samples, step, rank):
        h = torch.tanh(self.a(rows(samples, step, 6)))
        if rank == 1 and step % 2 == 1:
            h = h + self.b(h)
        return sum_ce(self.head(h), targets(samples, step, 3))

    optimizer = staticmethod(momentum_sgd)


class ZeroFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.zero = nn.Linear(6, 0)
        self.head = nn.Linear(6, 3)

    def loss(self, samples, step, rank):
        h = torch.tanh(self.a(rows(samples, step, 6)))
        return sum_ce(self.head(h), targets(samples, step, 3)) + self.zero(h).sum()

    optimizer = staticmethod(momentum_sgd)


CASES = {
    "tied_adam": lambda: Tied(True),
    "tied_sgd": lambda: Tied(False),
    "sparse": Sparse,
    "batchnorm": BatchNorm,
    "layout": Layout,
    "reverse": Reverse,
    "one_param": OneParam,
    "control_flow": ControlFlow,
    "zero_features": ZeroFeatures,
}


def split(world, micro):
    out = [[[] for _ in range(micro)] for _ in range(world)]
    count = [0] * world
    for s in range(N):
        r = s % world
        out[r][count[r] % micro].append(s)
        count[r] += 1
    return out


class Wrapped(nn.Module):
    """DDP calls forward: route it to the case's loss."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, samples, step, rank):
        return self.inner.loss(samples, step, rank)


def run(rank, args, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank,
                            world_size=args.world)
    model = CASES[args.case]()
    init_parameters(model)
    ddp = nn.parallel.DistributedDataParallel(
        Wrapped(model),
        find_unused_parameters=args.case.startswith("tied") or args.case == "control_flow")
    opt = model.optimizer([p for p in model.parameters()])
    parts = split(args.world, args.micro)[rank]
    for step in range(1, args.steps + 1):
        for m, samples in enumerate(parts):
            last = m + 1 == len(parts)
            scale = args.world / N
            if last:
                (ddp(samples, step, rank) * scale).backward(create_graph=args.create_graph)
            else:
                with ddp.no_sync():
                    (ddp(samples, step, rank) * scale).backward(create_graph=args.create_graph)
        opt.step()
        if not args.keep_grad:
            opt.zero_grad(set_to_none=args.zero_grad_to_none)
    if rank == 0:
        out = {"params": {}, "buffers": {}}
        for name, p in model.named_parameters():
            out["params"][name] = p.detach().double().contiguous().view(-1).tolist()
        for name, b in model.named_buffers():
            out["buffers"][name] = b.detach().double().contiguous().view(-1).tolist()
        if not out["buffers"]:
            del out["buffers"]
        with open(args.out + ".partial", "w") as f:
            json.dump(out, f)
    dist.barrier()
    # args.out exists only once every rank has finished every step.
    if rank == 0:
        os.rename(args.out + ".partial", args.out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro", type=int, default=3)
    parser.add_argument("--zero_grad_to_none", action="store_true",
                        help="zero_grad resets gradients (libtorch 2.x's default) instead of "
                             "zeroing them (1.13's)")
    parser.add_argument("--keep_grad", action="store_true",
                        help="no zero_grad between steps: gradients accumulate over steps")
    parser.add_argument("--create_graph", action="store_true",
                        help="every backward with create_graph=True")
    args = parser.parse_args()
    if os.path.exists(args.out):
        os.remove(args.out)
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(run, args=(args, os.path.join(d, "store")), nprocs=args.world, join=True)
        except Exception as e:  # noqa: BLE001 (mp.spawn's ProcessRaised/ExitedException)
            if not os.path.exists(args.out):
                raise
            # Every rank finished every step (args.out is written after the
            # last barrier): the result stands; what failed is torch's own
            # teardown, seen rarely with Gloo under load (a CI flake).
            print(f"ddp {args.case}: a rank failed after the last step, in teardown: {e}",
                  file=sys.stderr)
    print("ddp", args.case, "written to", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
