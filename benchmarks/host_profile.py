"""Where the host time of one fused call goes: cProfile of rank 0 over isolated calls.

    python benchmarks/host_profile.py OUT_DIR [--op all_gather_matmul] [--strategy fused]
        [--m 4096 --n 3584 --k 8192] [--calls 30] [--graphs 0]

Two ranks (the local GPUs, or 2 CPU processes over gloo with a small shape). Each profiled call
starts on an idle GPU (the ranks line up first), as `asynctp bench`'s isolated calls do. Writes
OUT_DIR/host_profile_<op>_<strategy>_graphs<G>.txt: the host time per call (median), then the functions by
own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asynctp.bench.launch import SAFE_ENV
from asynctp.bench.timing import align_ranks


def _call(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, group):
    import asynctp

    if op == "all_gather_matmul":
        return asynctp.all_gather_matmul(a, [b], 0, group, return_a=False, strategy=strategy)
    return asynctp.matmul_reduce_scatter(a, b, 0, group, strategy=strategy)


def _rank(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    os.environ["ASYNCTP_GRAPHS"] = args.graphs
    cuda = torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    m, n, k = (args.m, args.n, args.k) if cuda else (256, 128, 256)
    torch.manual_seed(rank)
    if args.op == "all_gather_matmul":
        a = torch.randn(m // world, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
    else:
        a = torch.randn(m, k // world, device=device, dtype=dtype)
        b = torch.randn(k // world, n, device=device, dtype=dtype)

    for _ in range(5):
        _call(args.op, args.strategy, a, b, group)
    align_ranks(group, device)
    profile = cProfile.Profile()
    host = []
    for _ in range(args.calls):
        align_ranks(group, device)
        t0 = time.perf_counter()
        profile.enable()
        _call(args.op, args.strategy, a, b, group)
        profile.disable()
        host.append((time.perf_counter() - t0) * 1e6)
    align_ranks(group, device)
    if rank == 0:
        text = io.StringIO()
        text.write(f"{args.op} strategy={args.strategy} graphs={args.graphs} {m}x{n}x{k} on {device}: "
                   f"host time per call (profiled) median {statistics.median(host):.0f} us, "
                   f"min {min(host):.0f} us over {args.calls} calls\n\n")
        for order in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
        path = os.path.join(args.out, f"host_profile_{args.op}_{args.strategy}_graphs{args.graphs}.txt")
        with open(path, "w") as f:
            f.write(text.getvalue())
        print(text.getvalue()[:4000])
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--op", default="all_gather_matmul", choices=("all_gather_matmul", "matmul_reduce_scatter"))
    p.add_argument("--strategy", default="fused")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=3584)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--graphs", default="0", choices=("0", "1", "auto"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for key, value in SAFE_ENV.items():  # never NVLink multicast
        os.environ.setdefault(key, value)
    fd, store = tempfile.mkstemp(prefix="asynctp-host-profile-")
    os.close(fd)
    os.unlink(store)
    mp.spawn(_rank, args=(2, f"file://{store}", args), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
