"""Where the host time of one fused call goes: cProfile of rank 0 over isolated calls, or the
stages of a call timed without a profiler (--stages).

    python benchmarks/host_profile.py OUT_DIR [--op all_gather_matmul] [--strategy fused]  # --op: OPS (fp8: rowwise)
        [--m 4096 --n 3584 --k 8192] [--calls 30] [--graphs 0] [--stages]

Two ranks (the local GPUs, or 2 CPU processes over gloo with a small shape). Each profiled call
starts on an idle GPU (the ranks line up first), as `asynctp bench`'s isolated calls do. Writes
OUT_DIR/host_profile_<op>_<strategy>_graphs<G>.txt: the host time per call (median), then the functions by
own time and by cumulative time. --stages writes host_stages_<op>_<strategy>_graphs<G>.txt instead:
each stage's (STAGES: a function of the call path, wrapped by a timer) calls and inclusive host
time per op call, beside torch.mm's and torch's fused op's host time on the same operands.
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
from asynctp.bench.timing import align_ranks, isolated_us


# (module, attribute path): the functions of a fused call's path whose host time is reported
STAGES = [
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
    ("asynctp.runtime.graphs", "_Entry.result"),
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


def _stages(args: argparse.Namespace, a: torch.Tensor, b: torch.Tensor, group, device, rank: int) -> None:
    timer = StageTimer(STAGES)
    for _ in range(5):
        _call(args.op, args.strategy, a, b, group)
    timer.reset()
    _, host = isolated_us(lambda: _call(args.op, args.strategy, a, b, group), args.calls, group, device)
    shapes = " x ".join(str(tuple((t[0] if isinstance(t, tuple) else t).shape)) for t in (a, b))
    text = (f"{args.op} strategy={args.strategy} graphs={args.graphs} {shapes} on {device}: "
            f"host time per call {host:.1f} us (median over {args.calls} isolated calls, slowest rank; stage timers "
            f"on)\n\n" + timer.table(args.calls))
    align_ranks(group, device)
    timer.reset()
    queued = []
    for _ in range(args.calls):  # back to back: the GPU still busy with the previous calls
        t0 = time.perf_counter()
        _call(args.op, args.strategy, a, b, group)
        queued.append((time.perf_counter() - t0) * 1e6)
    align_ranks(group, device)
    text += (f"\nback to back (queued behind the previous calls): host time per call median "
             f"{statistics.median(queued):.1f} us, min {min(queued):.1f} us\n\n" + timer.table(args.calls))
    rows, b_mm = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    full = torch.randn(rows.shape[0] * (2 if args.op.startswith("all_gather") else 1), rows.shape[1],
                       device=device).to(torch.bfloat16)
    b_mm = b_mm.to(torch.bfloat16)
    _, mm = isolated_us(lambda: torch.mm(full, b_mm), args.calls, group, device)
    text += f"\ntorch.mm on the full rows, host time per call {mm:.1f} us (median, slowest rank)\n"
    if rank == 0:
        path = os.path.join(args.out, f"host_stages_{args.op}_{args.strategy}_graphs{args.graphs}.txt")
        with open(path, "w") as f:
            f.write(text)
        print(text)


OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather_scaled_matmul_rowwise",
       "scaled_matmul_reduce_scatter_rowwise")


def _call(op: str, strategy: str, a, b, group):
    """One call of `op`; fp8 ops take a = (rows, row scales), b = (weight.t(), column scales)."""
    import asynctp

    if op == "all_gather_matmul":
        return asynctp.all_gather_matmul(a, [b], 0, group, return_a=False, strategy=strategy)
    if op == "matmul_reduce_scatter":
        return asynctp.matmul_reduce_scatter(a, b, 0, group, strategy=strategy)
    (a8, a_scale), (b8, b_scale) = a, b
    if op == "all_gather_scaled_matmul_rowwise":
        return asynctp.all_gather_scaled_matmul(a8, [b8], a_scale, [b_scale], 0, group, return_a=False,
                                                strategy=strategy)
    return asynctp.scaled_matmul_reduce_scatter(a8, b8, a_scale, b_scale, 0, group, strategy=strategy)


def _operands(op: str, m: int, n: int, k: int, world: int, device: torch.device):
    """(a, b) of one call of `op` (see _call), seeded by rank."""
    gather = op.startswith("all_gather")
    rows, depth = (m // world, k) if gather else (m, k // world)
    if "scaled" not in op:
        return (torch.randn(rows, depth, device=device, dtype=torch.bfloat16),
                torch.randn(depth, n, device=device, dtype=torch.bfloat16))
    f8 = torch.float8_e4m3fn
    a = (torch.randn(rows, depth, device=device).to(f8), torch.rand(rows, 1, device=device) + 0.5)
    b = (torch.randn(n, depth, device=device).to(f8).t(), torch.rand(1, n, device=device) + 0.5)
    return a, b


def _rank(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    os.environ["ASYNCTP_GRAPHS"] = args.graphs
    cuda = torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    m, n, k = (args.m, args.n, args.k) if cuda else (256, 128, 256)
    torch.manual_seed(rank)
    a, b = _operands(args.op, m, n, k, world, device)

    if args.stages:
        _stages(args, a, b, group, device, rank)
        dist.destroy_process_group()
        return
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
    p.add_argument("--op", default="all_gather_matmul", choices=OPS)
    p.add_argument("--strategy", default="fused")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=3584)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--graphs", default="0", choices=("0", "1", "auto"))
    p.add_argument("--stages", action="store_true", help="time the stages of the call path without a profiler")
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
