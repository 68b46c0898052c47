"""How one thing is timed: per-iteration CUDA events (perf_counter on CPU), median, max over ranks.

Every rank runs the same calls in the same order: the collectives inside the timed functions
pair up across ranks, so a rank that skipped a call would hang the others. Each measurement
starts with the ranks lined up (a tiny all-reduce and a device sync), and reports the slowest
rank's median: a TP step is as slow as its slowest rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["synchronize", "align_ranks", "median_us", "max_over_ranks", "time_us", "isolated_us", "rounds_us",
           "capture_graph"]


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def align_ranks(group: dist.ProcessGroup, device: torch.device) -> None:
    """Return when every rank got here with an idle device."""
    synchronize(device)
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    synchronize(device)


def median_us(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Median of `iters` timed calls of fn after `warmup` untimed ones, in microseconds.

    On CUDA each call is bracketed by its own pair of events on the current stream, so the
    time includes any gap in which the GPU waited for the host to launch work (eager overhead
    counts, as it does in a training step). On CPU the calls are synchronous: perf_counter.
    """
    if iters < 1:
        raise ValueError(f"median_us requires iters >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def max_over_ranks(value: float, group: dist.ProcessGroup, device: torch.device) -> float:
    """The largest of every rank's `value` (collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def time_us(
    fn: Callable[[], Any], iters: int, warmup: int, group: dist.ProcessGroup, device: torch.device
) -> float:
    """The slowest rank's median time of fn, in microseconds (collective: every rank calls it)."""
    align_ranks(group, device)
    local = median_us(fn, iters, warmup, device)
    return max_over_ranks(local, group, device)


def isolated_us(
    fn: Callable[[], Any], iters: int, group: dist.ProcessGroup, device: torch.device
) -> tuple[float, float]:
    """(device time, host time) of isolated calls, the slowest rank's medians in microseconds:
    before each call the ranks line up with an idle GPU (a step whose host does not run ahead),
    so every launch latency and host cost before the GPU starts counts. Host time: how long
    the call took to return (queueing only, no sync; the timing events' records outside it)."""
    device_us, host_us = [], []
    for _ in range(max(1, iters)):
        align_ranks(group, device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host_us.append((time.perf_counter() - t0) * 1e6)
            end.record()
            torch.cuda.synchronize(device)
            device_us.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            host_us.append((time.perf_counter() - t0) * 1e6)
            device_us.append(host_us[-1])
    return (max_over_ranks(statistics.median(device_us), group, device),
            max_over_ranks(statistics.median(host_us), group, device))


def rounds_us(
    fns: list[Callable[[], Any]], iters: int, warmup: int, group: dist.ProcessGroup, device: torch.device,
    rounds: int = 6,
) -> list[float]:
    """The slowest rank's times of each of fns, measured in rounds of one block of calls each and
    reduced to the median of each one's round medians. For comparisons of variants whose
    difference is smaller than the drift of a machine over a row (host-bound calls; a GPU's clock
    under sustained load): all see the same conditions. Round r runs the blocks in the order of
    fns rotated by r (more than two: reversed in every other cycle of len(fns) rounds), so no
    variant always runs straight after the same other (2xH200, fp8 all-gather at llama70b w13, 3 ms
    a call: "auto" ran the very code of "serial" and timed 4-7% slower as the second of each pair,
    in two runs). The number of rounds is even (a multiple of 2 * len(fns) for more than two,
    where iters allows): each variant then comes at each position equally often."""
    n = len(fns)
    rounds = max(1, min(rounds, iters))
    if rounds > 1:
        cycle = 2 * n if n > 2 and rounds >= 2 * n else 2
        rounds -= rounds % cycle
    per_round = max(1, iters // rounds)
    align_ranks(group, device)
    for _ in range(warmup):
        for fn in fns:
            fn()
    meds: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = [(r + i) % n for i in range(n)]
        if n > 2 and (r // n) % 2:  # (two variants: the rotation alone alternates them)
            order.reverse()
        for i in order:
            meds[i].append(median_us(fns[i], per_round, 0, device))
    return [max_over_ranks(statistics.median(m), group, device) for m in meds]


def capture_graph(fn: Callable[[], Any], device: torch.device, warmup: int = 3) -> tuple[Callable[[], None], Any]:
    """Capture fn in a CUDA graph; returns (replay, the outputs the graph writes on each replay).

    fn runs `warmup` times eagerly on a side stream first (lazy initialisation, workspace
    growth and autotuning must not happen during capture). Collective: fn's communication must
    be captured on every rank.
    """
    if device.type != "cuda":
        raise RuntimeError(f"capture_graph requires a CUDA device, got {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread keeps querying events while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn()
    torch.cuda.synchronize(device)
    return graph.replay, outputs
