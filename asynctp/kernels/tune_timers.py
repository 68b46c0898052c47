"""Timers of the kernel tuner (configs.tune): each times one candidate config the way its call
runs the kernel, on random operands made once per problem. `gather(...)(cfg)`: the all-gather's
GEMM with the gathered rows kept (as training keeps them), stored by the GEMM where it can, else
copied out beside it on another stream; `producer(...)(cfg)`: the reduce-scatter's producer as
rank 0 of `world`, every peer's partial already received (flags set), its flags and counters
reset before each run as a call leaves them."""

from __future__ import annotations

import functools

import torch

from asynctp.kernels.async_input_mm import ChunkMap, launch
from asynctp.kernels.configs import Config
from asynctp.kernels.producer_mm import launch_producer

__all__ = ["gather", "producer"]


def _operands(dtype: torch.dtype, m: int, n: int, k: int, device: torch.device):
    """Random a [m, k] and b = weight.t() [k, n] of `dtype`, the output dtype, unit scales (fp8)."""
    fp8 = dtype.itemsize == 1
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype).t()
    one = torch.ones((), device=device) if fp8 else None
    return a, b, torch.bfloat16 if fp8 else dtype, one


def gather(dtype: torch.dtype, m: int, n: int, k: int, rows: int, device: torch.device, world: int):
    """A timer of the all-gather's GEMM for this problem (operands made at its first use)."""
    @functools.cache
    def made():
        a, b, out_dtype, one = _operands(dtype, m, n, k, device)
        out = torch.empty(m, n, device=device, dtype=out_dtype)
        return a, b, out, one, torch.empty_like(a), torch.cuda.Stream(device)

    def time_us(cfg: Config) -> float:
        a, b, out, one, kept, side = made()

        def run():
            main = torch.cuda.current_stream(device)
            start = main.record_event()
            if not launch(a, b, out, None, (1, 1, 0), m, 0, ChunkMap(), a_scale=one, b_scale=one, config=cfg,
                          gathered=kept):
                side.wait_event(start)
                with torch.cuda.stream(side):
                    kept.copy_(a)
                main.wait_stream(side)

        return _median_us(run, lambda: None, device)

    return time_us


def producer(dtype: torch.dtype, m: int, n: int, k: int, rows: int, device: torch.device, world: int):
    """A timer of the reduce-scatter's producer for this problem (operands made at its first use):
    rank 0 of `world` ranks of m // world rows each, in blocks of `rows`."""
    chunk = m // world
    blocks = chunk // rows

    @functools.cache
    def made():
        a, b, out_dtype, one = _operands(dtype, m, n, k, device)
        out = torch.empty(chunk, n, device=device, dtype=out_dtype)
        partials = torch.empty(max(1, world - 1), chunk, n, device=device, dtype=out_dtype)
        received = torch.zeros(world, chunk, n, device=device, dtype=out_dtype)
        flags = torch.ones(world * blocks, dtype=torch.int32, device=device)  # every peer's partial there
        counters = torch.zeros(world * blocks + blocks, dtype=torch.int32, device=device)
        return a, b, partials, received, out, flags, counters, one

    def time_us(cfg: Config) -> float:
        a, b, partials, received, out, flags, counters, one = made()

        def reset():  # the own tiles clear the peers' flags and the peer tiles count: as a call leaves them
            flags.fill_(1)
            counters.zero_()

        return _median_us(lambda: launch_producer(a, b, partials, received, out, 0, world, blocks, (chunk, rows), flags,
                                                  (1, world), counters, a_scale=one, b_scale=one, config=cfg),
                          reset, device)

    return time_us


def _median_us(run, reset, device: torch.device) -> float:
    """The median of 5 timed runs (after one untimed), `reset` before each, outside the timing."""
    reset()
    run()
    times = []
    for _ in range(5):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize(device)
    return sorted(s.elapsed_time(e) for s, e in times)[2] * 1e3
