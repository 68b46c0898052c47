"""`asynctp bench --checks`: the host time per call of the default call checks, on and off.

Ranks (CPU processes over gloo and the cpu backend, or one per GPU) time, in one run:
  checks_alone  begin_call + end_call in a group of one: the checks' own host work
  agreement   Workspace.begin_call + end_call alone: the signature hash (cached), the call
              number, and on CPU the compare in the signal pad, which waits for the peers
  matmul      asynctp.all_gather_matmul back to back (GPUs: the seed shape 4096 x 3584 x 8192;
              CPU: 64 x 64 x 64), Config.check_calls on and off in alternating rounds
Medians over --iters calls after --warmup (matmul: over rounds), the maximum over ranks.
checks_cost: the median of the on - off differences of adjacent rounds, and as a percentage of
the op's time; on CUDA the compare runs on the device (the opening barrier's flag value), so
there the host cost is the hash and the bookkeeping.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["measure", "main"]


def _per_call_us(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(device: str, iters: int, warmup: int) -> dict[str, float]:
    """On every rank of the default group: microseconds per call of each variant (this rank)."""
    import asynctp
    from asynctp.ops.signature import NAMES

    group = dist.group.WORLD
    x = torch.ones((16, 64), device=device)
    ws = asynctp.get_workspace(group, device)
    results: dict[str, float] = {}
    # the checks' own host work (hash, call number, publishing, bookkeeping), without waiting
    # for a peer: each rank alone in a group of one
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    own = asynctp.symm.lookup(alone, device) if device == "cpu" else None
    if own is not None:
        results["checks_alone_us"] = _per_call_us(
            lambda: (own.begin_call("all_gather", NAMES["all_gather"], (tuple(x.shape), x.dtype, 0)), own.end_call()),
            iters, warmup)
    if ws is not None:
        values = (tuple(x.shape), x.dtype, 0)

        def agreement() -> None:
            ws.begin_call("all_gather", NAMES["all_gather"], values)
            ws.end_call()

        results["agreement_us"] = _per_call_us(agreement, iters, warmup)
    # the checks on and off, in alternating rounds (a drift of the machine hits both alike), on
    # a seed-shaped all_gather_matmul on GPUs (4096 x 3584 x 8192, back to back), a small one on CPU
    world = dist.get_world_size()
    m, n, k = (4096, 3584, 8192) if device == "cuda" else (64, 64, 64)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(m // world, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    calls = 20 if device == "cuda" else 5

    def batch() -> None:
        for _ in range(calls):
            asynctp.all_gather_matmul(a, [b], 0, group, return_a=False)
        if device == "cuda":
            torch.cuda.synchronize()

    rounds: dict[bool, list[float]] = {True: [], False: []}
    for i in range(max(2, 2 * (iters // 100))):
        on = i % 2 == 0
        with asynctp.config.override(check_calls=on):
            dist.barrier()
            rounds[on].append(_per_call_us(batch, 1, 1 if i < 2 else 0) / calls)
    diffs = [x - y for x, y in zip(rounds[True], rounds[False])]
    results["matmul_checks_on_us"] = statistics.median(rounds[True])
    results["matmul_checks_off_us"] = statistics.median(rounds[False])
    results["checks_cost_us"] = statistics.median(diffs)
    results["checks_cost_pct"] = 100 * results["checks_cost_us"] / results["matmul_checks_off_us"]
    return results


def _rank(rank: int, world: int, init: str, device: str, iters: int, warmup: int, out) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        out.put((rank, measure(device, iters, warmup)))
    finally:
        dist.destroy_process_group()


def main(nproc: int | None, iters: int, warmup: int) -> int:
    """Spawn the ranks, print one line per variant (max over ranks); the exit code."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus >= 2 else "cpu"
    world = nproc or (gpus if device == "cuda" else 2)
    fd, path = tempfile.mkstemp(prefix="asynctp-bench-store-")
    os.close(fd)
    os.unlink(path)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, f"file://{path}", device, iters, warmup, out))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    if os.path.exists(path):
        os.unlink(path)
    print(f"asynctp bench --checks: {world} {device} ranks, median of {iters} calls, max over ranks")
    for key in per_rank[0]:
        print(f"  {key:32s} {max(r[key] for r in per_rank.values()):8.2f}")
    return 0
