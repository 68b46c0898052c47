"""How much tensor-parallel communication a training step leaves exposed, from a torch.profiler
trace: the time during which a communication kernel or peer copy runs and no compute kernel does.

    communication   NCCL kernels (vanilla TP's collectives) and peer-to-peer copies (asynctp's
                    copy-engine transfers)
    compute         every other GPU kernel (GEMMs, attention, elementwise, asynctp's reductions)
    exposed         union(communication) minus union(compute), per step

This is the quantity the issue's target is stated against: async TP can at best hide all of
vanilla TP's exposed communication, so (T_vanilla - T_async) / exposed_vanilla is how much of it
was recovered.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["profile_steps", "trace_path", "exposed_time", "host_profile"]

Interval = tuple[float, float]


def profile_steps(step: Callable[[], Any], num_steps: int, trace_path: str | None = None,
                  host_ops: bool = True) -> dict[str, float]:
    """Run step() num_steps times under the profiler; per-step milliseconds of communication,
    exposed communication, compute, the GPU busy (any of them) and wall time. trace_path: where the
    profiler's Chrome trace goes too (gzipped when it ends in .gz). host_ops=False records the
    GPU's activity only: recording every host op slows the host enough to turn a GPU-bound step
    host-bound (compiled 8B-shaped stack, batch 1, 2xH200: about 100 ms a step profiled vs 64), and
    the GPU's idle time (wall - busy) is then the host's, not the step's."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    activities = [ProfilerActivity.CUDA] if on_gpu else []
    if host_ops or not on_gpu:
        activities.insert(0, ProfilerActivity.CPU)
    sync()
    with profile(activities=activities, record_shapes=host_ops) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        sync()
        wall = time.perf_counter() - start
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    comm, compute, by_name = _kernel_intervals(prof)
    totals = exposed_time(comm, compute)
    totals["busy_ms"] = totals["compute_ms"] + totals["exposed_comm_ms"]  # the union of both
    per_step: dict[str, Any] = {key: value / num_steps / 1000.0 for key, value in totals.items()}  # us -> ms
    per_step["wall_ms"] = wall / num_steps * 1000.0
    per_step["num_steps"] = num_steps
    per_step["host_ops"] = host_ops
    # what was classified how: the 8 longest kernel names of each class, ms per step
    for kind in ("comm", "compute"):
        top = sorted(((t, n) for (k, n), t in by_name.items() if k == kind), reverse=True)[:8]
        per_step[f"top_{kind}_kernels_ms"] = {n[:120]: round(t / num_steps / 1000.0, 3) for t, n in top}
    per_step["collectives_per_step"] = _collectives(prof, num_steps)
    return per_step


def trace_path(trace_dir: str | None, run_name: str) -> str | None:
    """Where this rank writes a run's profiler trace under trace_dir (made if missing; one file per
    rank: benchmarks/trace_kernels.py --skew reads two ranks' side by side); None without one."""
    if trace_dir is None:
        return None
    os.makedirs(trace_dir, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.path.join(trace_dir, f"trace_{re.sub(r'[^A-Za-z0-9]+', '_', run_name).strip('_')}_rank{rank}.json.gz")


def _collectives(prof: Any, num_steps: int) -> dict[str, float]:
    """The process groups' collectives the host issued ("nccl:" / "gloo:" ranges), by name and
    input shapes: calls per step (which collectives a plan leaves to the process group)."""
    counts: dict[str, int] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CPU and evt.name.startswith(("nccl:", "gloo:")):
            key = f"{evt.name} {evt.input_shapes}"[:160]
            counts[key] = counts.get(key, 0) + 1
    return {k: round(v / num_steps, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:16]}


def host_profile(queue_step: Callable[[torch.Tensor], Any], batches: list[torch.Tensor], device: torch.device,
                 top: int = 30) -> str:
    """cProfile of one step queued per batch, back to back (the host waits for the device only
    after the last): the host time a step and the functions by own time. Own times can hold time
    that is not the frame's (2xH100, the compiled fp8 demo: 0.20 s in torch's custom-op wrapper,
    where native samples put 1% of its time in the wrapper itself; the backward's host work runs on
    autograd's device thread beside this one). benchmarks/native_profile.sh samples each thread,
    native frames included."""
    import cProfile
    import io
    import pstats

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for tokens in batches:
        queue_step(tokens)
    profile.disable()
    host = (time.perf_counter() - start) / len(batches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    text = io.StringIO()
    text.write(f"{len(batches)} steps queued under cProfile: {1e3 * host:.1f} ms of host time a step (profiled)\n")
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _is_comm(name: str) -> bool:
    lowered = name.lower()
    return lowered.startswith("nccl") or "ptop" in lowered or "peer" in lowered


def _kernel_intervals(prof: Any) -> tuple[list[Interval], list[Interval], dict[tuple[str, str], float]]:
    comm, compute = [], []
    by_name: dict[tuple[str, str], float] = {}
    for evt in prof.events():
        # GPU-side annotations (a compiled graph's "## Call CompiledFxGraph ##", record_function
        # ranges such as "Optimizer.step", "nccl:...") span kernels and idle gaps alike: counted
        # as compute they covered a compiled step's whole communication (exposed 0.0)
        if evt.device_type != torch.autograd.DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        interval = (float(evt.time_range.start), float(evt.time_range.end))
        if interval[1] <= interval[0]:
            continue
        kind = "comm" if _is_comm(evt.name) else "compute"
        (comm if kind == "comm" else compute).append(interval)
        by_name[(kind, evt.name)] = by_name.get((kind, evt.name), 0.0) + interval[1] - interval[0]
    return comm, compute, by_name


def _merge(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def exposed_time(comm: list[Interval], compute: list[Interval]) -> dict[str, float]:
    """Totals (in the intervals' unit): comm_ms, exposed_comm_ms, compute_ms (union lengths)."""
    comm_u, compute_u = _merge(comm), _merge(compute)
    covered, j = 0.0, 0
    for lo, hi in comm_u:
        while j < len(compute_u) and compute_u[j][1] <= lo:
            j += 1
        k = j
        while k < len(compute_u) and compute_u[k][0] < hi:
            covered += min(hi, compute_u[k][1]) - max(lo, compute_u[k][0])
            k += 1
    comm_total = sum(hi - lo for lo, hi in comm_u)
    return {
        "comm_ms": comm_total,
        "exposed_comm_ms": comm_total - covered,
        "compute_ms": sum(hi - lo for lo, hi in compute_u),
    }
