#!/usr/bin/env python3
"""The PyTorch peer of bench/ckpt_throughput: torch.distributed.checkpoint
(DCP) on the same state (32 float32 tensors of SIZE_MB in all, replicated on
every rank, as evenstep's benchmark holds it, on the CPU or with --device
cuda on the GPU) over Gloo on RANKS local ranks.
Measures, on the slowest rank:
  dcp_save_s          dcp.save: the training thread blocks until committed
  dcp_async_stall_s   dcp.async_save: until it returns (the staging copy)
  dcp_async_commit_s  dcp.async_save: until its future is done
Each after one warm-up call of the same kind (process groups, staging
buffers), like evenstep's measured save. Prints one line
"RESULT key=value ..." on rank 0. Needs torch >= 2.3 (async_save).

    dcp_peer.py --size_mb 256 --ranks 2 --dir /tmp/d
"""
import argparse
import os
import shutil
import socket
import sys
import time


def worker(rank, args, port):
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)  # DCP's TypedStorage notice
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=args.ranks)
    torch.manual_seed(0)
    per = max(1, (args.size_mb << 20) // 4 // 32)
    state = {"p%d" % i: torch.rand(per).to(args.device) for i in range(32)}

    def timed(kind, step):
        path = os.path.join(args.dir, "%s-%d" % (kind, step))
        dist.barrier()
        t = time.monotonic()
        if kind == "sync":
            dcp.save(state, checkpoint_id=path)
            stall = time.monotonic() - t
            commit = stall
        else:
            future = dcp.async_save(state, checkpoint_id=path)
            stall = time.monotonic() - t
            future.result()
            commit = time.monotonic() - t
        dist.barrier()
        commit = max(commit, time.monotonic() - t)
        if rank == 0:
            shutil.rmtree(os.path.join(args.dir, "%s-%d" % (kind, step - 1)), ignore_errors=True)
        return stall, commit

    timed("sync", 0)
    _, save_s = timed("sync", 1)
    timed("async", 0)
    stall_s, commit_s = timed("async", 1)
    v = torch.tensor([save_s, stall_s, commit_s], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT dcp_save_s=%.6f dcp_async_stall_s=%.6f dcp_async_commit_s=%.6f torch=%s" %
              (v[0].item(), v[1].item(), v[2].item(), torch.__version__.split("+")[0]), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size_mb", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--device", default="cpu",
                        help="where the state lives: cpu, or cuda (ranks share the GPU over Gloo)")
    args = parser.parse_args()
    import torch
    import torch.distributed.checkpoint as dcp
    if not hasattr(dcp, "async_save"):
        print("dcp_peer: torch %s has no torch.distributed.checkpoint.async_save (needs >= 2.3)"
              % torch.__version__)
        return 3
    os.makedirs(args.dir, exist_ok=True)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
