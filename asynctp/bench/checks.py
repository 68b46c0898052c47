"""`asynctp bench --checks`: the host time per call of the default call checks, on and off.

Ranks (CPU processes over gloo and the cpu backend, or one per GPU) time, in one run:
  checks_alone  begin_call + end_call in a group of one: the checks' own host work
  agreement   Workspace.begin_call + end_call alone: the signature hash (cached), the call
              number, and on CPU the compare in the signal pad, which waits for the peers
  all_gather  a small asynctp.all_gather, with Config.check_calls on and off
Medians over --iters calls after --warmup, the maximum over ranks. The difference on - off
of the op is what the checks cost a call; on CUDA the compare runs on the device (the opening
barrier's flag value), so there the host cost is the hash and the bookkeeping.
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
    for on in (True, False):
        with asynctp.config.override(check_calls=on):
            dist.barrier()

            def call() -> None:
                asynctp.all_gather(x, 0, group)
                if device == "cuda":
                    torch.cuda.synchronize()

            results[f"all_gather_checks_{'on' if on else 'off'}_us"] = _per_call_us(call, iters, warmup)
    results["checks_cost_us"] = results["all_gather_checks_on_us"] - results["all_gather_checks_off_us"]
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
