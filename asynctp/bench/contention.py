"""`asynctp bench --contention`: how much a collective slows a large matmul running beside it.

Per rank: a bf16 matmul (default 8192^3) runs back to back on one stream while a collective
(all-gather of `--contention-mb` MB per rank) runs back to back on another, for NCCL's
all_gather_into_tensor and for asynctp.all_gather (copy engines). Reported: the matmul's time
alone and beside each collective (slowdown = with / alone - 1), and each collective's time
alone and beside the matmul. Medians over repeats, max over ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from asynctp.runtime.collective import all_gather_rows

__all__ = ["measure_contention"]


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _loop_ms(fn: Callable[[], object], n: int, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(n):
            fn()
        end.record(stream)
    return start, end


def _run(mm: Callable[[], object], coll: Callable[[], object] | None, n_mm: int, n_coll: int) -> tuple[float, float]:
    """(ms per matmul, ms per collective) with both loops launched together (coll may be None)."""
    s_mm, s_coll = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    dist.barrier()
    mm_ev = _loop_ms(mm, n_mm, s_mm) if n_mm else None
    coll_ev = _loop_ms(coll, n_coll, s_coll) if coll is not None and n_coll else None
    torch.cuda.synchronize()
    per_mm = mm_ev[0].elapsed_time(mm_ev[1]) / n_mm if mm_ev else float("nan")
    per_coll = coll_ev[0].elapsed_time(coll_ev[1]) / n_coll if coll_ev else float("nan")
    return per_mm, per_coll


def measure_contention(group: dist.ProcessGroup, size: int = 8192, mb: int = 256, repeats: int = 5) -> dict:
    """Times in microseconds (see the module docstring)."""
    import asynctp

    world = group.size()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(size, size, **bf), torch.randn(size, size, **bf)
    shard = torch.randn(mb * 2**20 // 2, **bf)
    gathered = torch.empty(world * shard.numel(), **bf)
    ours = lambda: asynctp.all_gather(shard, 0, group)  # noqa: E731
    nccl = lambda: all_gather_rows(gathered, shard, group)  # noqa: E731
    mm = lambda: torch.mm(a, b)  # noqa: E731
    asynctp.reserve(group, world * shard.numel() * 2, "cuda")  # a push gather: one slot per rank
    for fn in (ours, nccl, mm):  # warm-up
        fn()
    # every count below must be the same on every rank (a collective issued by one rank only
    # hangs the others), so the times they derive from are agreed first
    mm_alone = _max_over_ranks(statistics.median(_run(mm, None, 10, 0)[0] for _ in range(repeats)))
    out = {"matmul": f"{size}^3 bf16", "gather_mb_per_rank": mb, "world_size": world, "matmul_alone_us": mm_alone * 1e3}
    for name, coll in (("nccl", nccl), ("asynctp", ours)):
        alone = _max_over_ranks(statistics.median(_run(mm, coll, 0, 10)[1] for _ in range(repeats)))
        # as many collectives as fit in the matmul loop, so they overlap it throughout
        n_coll = max(1, int(10 * mm_alone / alone))
        both = [_run(mm, coll, 10, n_coll) for _ in range(repeats)]
        out[f"{name}_alone_us"] = alone * 1e3
        out[f"matmul_beside_{name}_us"] = statistics.median(m for m, _ in both) * 1e3
        out[f"{name}_beside_matmul_us"] = statistics.median(c for _, c in both) * 1e3
    for key in [k for k in out if k.endswith("_us")]:
        out[key] = round(_max_over_ranks(out[key]), 1)
    for name in ("nccl", "asynctp"):
        out[f"matmul_slowdown_{name}"] = round(out[f"matmul_beside_{name}_us"] / out["matmul_alone_us"] - 1, 4)
    return out
