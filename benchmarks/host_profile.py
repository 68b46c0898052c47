"""Where the host time of one fused call goes: cProfile of rank 0 over isolated calls, or the
stages of a call timed without a profiler (--stages).

    python benchmarks/host_profile.py OUT_DIR [--op all_gather_matmul] [--strategy fused]  # --op: a bench op
        [--m 4096 --n 3584 --k 8192 --num-bs 1] [--calls 30] [--graphs 0] [--stages | --gpu-trace [--main WORD] [--caller-graph]]

Two ranks (the local GPUs, or 2 CPU processes over gloo with a small shape). The call is the
bench's own (`asynctp.bench.cases`, a row M x N x K as in asynctp/bench/shapes.py). Each profiled
call starts on an idle GPU (the ranks line up first), as `asynctp bench`'s isolated calls do. Writes
OUT_DIR/host_profile_<op>_<strategy>_graphs<G>.txt: the host time per call (median), then the functions by
own time and by cumulative time. --stages writes host_stages_<op>_<strategy>_graphs<G>.txt instead:
each stage's (STAGES: a function of the call path, wrapped by a timer) calls and inclusive host
time per op call, beside the host time of the op's local matmul alone (the bench's compute bound).

--gpu-trace: back-to-back calls under torch.profiler instead; each rank writes its trace
(gpu_trace_<op>_<strategy>_graphs<G>_m<M>_rank<r>.json.gz) and rank 0 writes gpu_timeline_<...>.txt: per
call, every GPU activity of both ranks (kernels, copies, memsets) on one clock (the traces'
host-clock base), from rank 0's start of the call's main kernel (--main: a word of its name), as
medians over the calls: what waits on what, and how far the ranks are apart. --caller-graph: the
call captured in a CUDA graph of the caller's (as the bench's "graphed" columns), its replays traced.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asynctp.bench.cases import CASES
from asynctp.bench.launch import SAFE_ENV
from asynctp.bench.timing import align_ranks, capture_graph, isolated_us, max_over_ranks, time_us
from trace_kernels import load_trace  # benchmarks/trace_kernels.py, beside this script


# (module, attribute path): the functions of a fused call's path whose host time is reported
STAGES = [
    ("asynctp.ops.repeat", "call"),
    ("asynctp.ops.repeat", "_replay"),
    ("asynctp.runtime.graphs", "GraphCache.replay_ready"),
    ("asynctp.ops.all_gather_matmul", "check_all_gather_matmul"),
    ("asynctp.ops.matmul_reduce_scatter", "check_matmul_reduce_scatter"),
    ("asynctp.ops.all_gather_matmul", "eager_call_ok"),
    ("asynctp.ops.all_gather_matmul", "_run"),
    ("asynctp.ops.matmul_reduce_scatter", "_run_terms"),
    ("asynctp.symm.calls", "Calls.begin_call"),
    ("asynctp.symm.calls", "Calls.end_call"),
    ("asynctp.ops.all_gather_scaled_matmul", "check_all_gather_scaled_matmul"),
    ("asynctp.ops.scaled_matmul_reduce_scatter", "check_scaled_matmul_reduce_scatter"),
    ("asynctp.ops.all_gather_scaled_matmul", "_run"),
    ("asynctp.ops.all_gather_scaled_matmul", "_fused"),
    ("asynctp.ops.scaled_matmul_reduce_scatter", "_run"),
    ("asynctp.ops.scaled_matmul_reduce_scatter", "scatter_layout"),
    ("asynctp.ops.all_gather_scaled_matmul", "gather_layout"),
    ("asynctp.ops.all_gather_scaled_matmul", "make_plan"),
    ("asynctp.ops.scaled_matmul_reduce_scatter", "make_plan"),
    ("asynctp.ops.all_gather_scaled_matmul", "execute"),
    ("asynctp.ops.scaled_matmul_reduce_scatter", "execute"),
    ("asynctp.runtime.graphs", "GraphCache._eager"),
    ("asynctp.ops.all_gather_matmul", "make_plan"),
    ("asynctp.ops.matmul_reduce_scatter", "make_plan"),
    ("asynctp.ops.all_gather_matmul", "execute"),
    ("asynctp.ops.matmul_reduce_scatter", "execute"),
    ("asynctp.runtime.graphs", "GraphCache.call"),
    ("asynctp.runtime.graphs", "GraphCache._replay"),
    ("asynctp.runtime.keys", "Entry.result"),
    ("asynctp.symm.workspace", "Lanes.replay"),
    ("asynctp.symm.cuda", "CudaWorkspace.watch_replay"),
    ("asynctp.ops.all_gather_matmul", "_fused"),
    ("asynctp.ops.matmul_reduce_scatter", "_fused"),
    ("asynctp.runtime.kernel_path", "gather_available"),
    ("asynctp.runtime.kernel_path", "scatter_available"),
    ("asynctp.runtime.kernel_path", "gather_matmul"),
    ("asynctp.runtime.kernel_path", "matmul_scatter"),
    ("asynctp.runtime.kernel_path", "launch"),
    ("asynctp.runtime.kernel_path", "launch_producer"),
    ("asynctp.runtime.kernel_path", "_wait_counter"),
    ("asynctp.kernels._ag_kernel", "launch"),
    ("asynctp.kernels._ag_kernel", "TensorDescriptor"),
    ("asynctp.kernels._ag_kernel", "_ag_mm_kernel.run"),
    ("asynctp.kernels._rs_kernel", "launch"),
    ("asynctp.kernels._rs_kernel", "_items"),
    ("asynctp.symm.workspace", "Lanes.fork"),
    ("asynctp.symm.workspace", "Lanes.join"),
    ("asynctp.symm.workspace", "Workspace.ensure"),
    ("asynctp.symm.workspace", "Workspace.get_buffer"),
    ("asynctp.symm.cuda", "CudaWorkspace.signal_flags"),
    ("asynctp.symm.cuda", "CudaWorkspace.barrier"),
    ("asynctp.symm.cuda", "CudaWorkspace.put_signal"),
    ("asynctp.symm.cuda", "CudaWorkspace.watch_device_wait"),
    ("asynctp.symm.cuda", "CudaWorkspace.wait_value"),
]


class StageTimer:
    """Wraps each importable stage with a timer: calls and inclusive nanoseconds per stage."""

    def __init__(self, stages: list[tuple[str, str]]) -> None:
        import importlib

        self.totals: dict[str, list[int]] = {}
        self.missing: list[str] = []
        for module, path in stages:
            name = f"{module.rsplit('.', 1)[-1]}.{path}"
            try:
                owner = importlib.import_module(module)
                *parents, attr = path.split(".")
                for part in parents:
                    owner = getattr(owner, part)
                fn = getattr(owner, attr)
            except (ImportError, AttributeError):
                self.missing.append(name)
                continue
            setattr(owner, attr, self._wrap(name, fn))

    def _wrap(self, name: str, fn):
        total = self.totals.setdefault(name, [0, 0])
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += 1
                total[1] += clock() - t0

        return timed

    def reset(self) -> None:
        for total in self.totals.values():
            total[0] = total[1] = 0

    def table(self, calls: int) -> str:
        rows = [f"{'stage':58s} {'calls/op':>9s} {'us/op':>9s}"]
        for name, (count, ns) in sorted(self.totals.items(), key=lambda kv: -kv[1][1]):
            if count:
                rows.append(f"{name:58s} {count / calls:9.1f} {ns / calls / 1e3:9.1f}")
        if self.missing:
            rows.append(f"(not found: {', '.join(self.missing)})")
        return "\n".join(rows) + "\n"


def _stages(args: argparse.Namespace, problem, group, device, rank: int) -> None:
    call = lambda: problem.asynctp(args.strategy)  # noqa: E731
    timer = StageTimer(STAGES)
    for _ in range(5):
        call()
    timer.reset()
    _, host = isolated_us(call, args.calls, group, device)
    text = (f"{args.op} strategy={args.strategy} graphs={args.graphs} {args.m}x{args.n}x{args.k} on {device}: "
            f"host time per call {host:.1f} us (median over {args.calls} isolated calls, slowest rank; stage timers "
            f"on)\n\n" + timer.table(args.calls))
    align_ranks(group, device)
    timer.reset()
    queued = []
    for _ in range(args.calls):  # back to back: the GPU still busy with the previous calls
        t0 = time.perf_counter()
        call()
        queued.append((time.perf_counter() - t0) * 1e6)
    align_ranks(group, device)
    text += (f"\nback to back (queued behind the previous calls): host time per call median "
             f"{statistics.median(queued):.1f} us, min {min(queued):.1f} us\n\n" + timer.table(args.calls))
    _, mm = isolated_us(problem.compute_bound, args.calls, group, device)
    text += (f"\nthe op's local matmul alone (the bench's compute bound), host time per call {mm:.1f} us "
             "(median, slowest rank)\n")
    if rank == 0:
        path = os.path.join(args.out, f"host_stages_{args.op}_{args.strategy}_graphs{args.graphs}.txt")
        with open(path, "w") as f:
            f.write(text)
        print(text)


def _activities(path: str) -> list[tuple[float, float, str, int]]:
    """(start on the host's clock, duration, name, stream) of a trace's GPU activities, us."""
    events, base = load_trace(path)
    return sorted((e["ts"] + base, e.get("dur", 0.0), e["name"], e.get("args", {}).get("stream", e.get("tid", -1)))
                  for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def timeline(paths: list[str], main: str) -> str:
    """Both ranks' activities per call, relative to rank 0's start of the call's main kernel:
    (rank, name, n-th of that name in the call) -> median start and duration over the calls."""
    acts = [_activities(p) for p in paths]
    starts = [t for t, _, name, _ in acts[0] if main in name]
    if len(starts) < 3:
        return f"fewer than 3 calls of a kernel named *{main}* on rank 0\n"
    period = statistics.median(b - a for a, b in zip(starts, starts[1:]))
    rows: dict[tuple, list[tuple[float, float]]] = {}
    for t0 in starts[1:-1]:  # whole windows only
        for r, events in enumerate(acts):
            seen: dict[str, int] = {}
            for t, dur, name, stream in events:
                if t0 - period / 2 <= t < t0 + period / 2:
                    short = re.sub(r"<.*", "", name)[:48]
                    n = seen[short] = seen.get(short, 0) + 1
                    rows.setdefault((r, short, n, stream), []).append((t - t0, dur))
    calls = len(starts) - 2
    lines = [f"{calls} calls, period {period:.1f} us (rank 0's main kernel *{main}* to the next); start and end are"
             f" from rank 0's main-kernel start, medians over the calls (an activity in fewer calls: its count)",
             f"{'rank':>4s} {'stream':>6s} {'start':>8s} {'end':>8s} {'dur':>8s} {'calls':>5s}  activity"]
    for (r, short, n, stream), v in sorted(rows.items(), key=lambda kv: (statistics.median(x for x, _ in kv[1]), kv[0][0])):
        st = statistics.median(x for x, _ in v)
        du = statistics.median(d for _, d in v)
        lines.append(f"{r:4d} {stream!s:>6s} {st:8.1f} {st + du:8.1f} {du:8.1f} {len(v):5d}  {short} #{n}")
    alone: dict[str, list[float]] = {}  # what ran after the calls: the local matmul alone
    for t, dur, name, _ in acts[0]:
        if t >= starts[-1] + period:
            alone.setdefault(re.sub(r"<.*", "", name)[:48], []).append(dur)
    lines += [f"after the calls, rank 0: {len(v)} x {statistics.median(v):.1f} us  {name}" for name, v in alone.items()
              if len(v) >= calls // 2]
    return "\n".join(lines) + "\n"


def _window_us(fn, calls: int, group, device) -> float:
    """The slowest rank's mean time of `calls` back-to-back calls: one pair of events around them."""
    align_ranks(group, device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return max_over_ranks(start.elapsed_time(end) * 1e3 / calls, group, device)


def _gpu_trace(args: argparse.Namespace, problem, group, device, rank: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    call = lambda: problem.asynctp(args.strategy)  # noqa: E731
    if args.caller_graph:  # inside a capture of the caller's, as the bench's graphed columns
        call, _ = capture_graph(call, device)
    for _ in range(10):
        call()
    # the same calls timed as the bench times them (per-call events, median) and as one window over
    # all of them (a mean): the two differ where the per-call times are skewed or the calls overlap
    timed = {what: (time_us(fn, 50, 5, group, device), _window_us(fn, 50, group, device))
             for what, fn in (("op", call), ("local matmul", problem.compute_bound))}
    align_ranks(group, device)
    name = f"{args.op}_{args.strategy}_graphs{args.graphs}{'_callergraph' if args.caller_graph else ''}_m{args.m}"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        align_ranks(group, device)
        for _ in range(args.calls):  # the op's local matmul alone, for its kernel's duration
            problem.compute_bound()
        align_ranks(group, device)
    paths = [os.path.join(args.out, f"gpu_trace_{name}_rank{r}.json.gz") for r in range(dist.get_world_size(group))]
    prof.export_chrome_trace(paths[rank])
    dist.barrier(group)
    if rank == 0:
        how = "replays of the caller's graph of the call, " if args.caller_graph else ""
        text = (f"{args.op} strategy={args.strategy} graphs={args.graphs} {args.m}x{args.n}x{args.k} on {device}, {how}"
                f"{args.calls} back-to-back calls, then {args.calls} of the local matmul alone\n")
        text += "".join(f"{what}, 50 back-to-back calls unprofiled: per-call events' median {med:.1f} us (the bench's "
                        f"reading), window mean {mean:.1f} us (slowest rank)\n" for what, (med, mean) in timed.items())
        text += "\n"
        text += timeline(paths, args.main)
        with open(os.path.join(args.out, f"gpu_timeline_{name}.txt"), "w") as f:
            f.write(text)
        print(text[:6000])


def _rank(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    from asynctp.bench.shapes import Shape

    os.environ["ASYNCTP_GRAPHS"] = args.graphs
    cuda = torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        args.m, args.n, args.k = 256, 128, 256
    # the bench's own call of the op (asynctp bench --op), on a row of this size
    problem = CASES[args.op].build(Shape("host_profile", "", args.m, args.n, args.k, args.num_bs), torch.bfloat16, group,
                                   device, 0)

    if args.stages or args.gpu_trace:
        (_gpu_trace if args.gpu_trace else _stages)(args, problem, group, device, rank)
        dist.destroy_process_group()
        return
    for _ in range(5):
        problem.asynctp(args.strategy)
    align_ranks(group, device)
    profile = cProfile.Profile()
    host = []
    for _ in range(args.calls):
        align_ranks(group, device)
        t0 = time.perf_counter()
        profile.enable()
        problem.asynctp(args.strategy)
        profile.disable()
        host.append((time.perf_counter() - t0) * 1e6)
    align_ranks(group, device)
    if rank == 0:
        text = io.StringIO()
        text.write(f"{args.op} strategy={args.strategy} graphs={args.graphs} {args.m}x{args.n}x{args.k} on {device}: "
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
    p.add_argument("--op", default="all_gather_matmul", choices=sorted(CASES))
    p.add_argument("--strategy", default="fused")
    # a bench row, M x N x K (asynctp/bench/shapes.py); default: seed M 4096
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=3584)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--num-bs", type=int, default=1, help="matrices sharing the gather (the llama sets' w13: 2)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--graphs", default="0", choices=("0", "1", "auto"))
    p.add_argument("--stages", action="store_true", help="time the stages of the call path without a profiler")
    p.add_argument("--gpu-trace", action="store_true", help="back-to-back calls under torch.profiler: both ranks' "
                   "GPU activities per call on one clock")
    p.add_argument("--main", default="_mm_kernel", help="--gpu-trace: a word of the call's main kernel's name")
    p.add_argument("--caller-graph", action="store_true", help="--gpu-trace: the call captured in a CUDA graph of the "
                   "caller's, its replays traced")
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
