"""Developer probe (not the benchmark): where a pipelined call's host time goes.

For each case (op, recipe, M) it prints eager device time, host time per call, the time of the
same call captured in a CUDA graph (device time without host gaps) and, on rank 0, a cProfile
of the host side; then the host cost of the primitives the pipelines are made of.

    python benchmarks/probe_host.py OUT_DIR
"""

import cProfile
import io
import json
import os
import pstats
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.probe_pipeline import timeit as device_us  # noqa: E402  (median us, max over ranks)

CASES = os.environ.get(
    "PROBE_CASES",
    "all_gather_matmul:4096,all_gather_scaled_matmul_rowwise:4096,all_gather_scaled_matmul_tensorwise:4096,"
    "matmul_reduce_scatter:4096,scaled_matmul_reduce_scatter_rowwise:4096",
).split(",")
STRATEGIES = os.environ.get("PROBE_STRATEGIES", "serial,pipeline").split(",")
TRACE_DIR = os.environ.get("PROBE_TRACE_DIR")  # chrome traces of the profiled pipeline calls
TRACE_TAG = "x"


def host_us(fn, iters=20):
    """Host time per call; the GPU queue is drained first, so launches do not block."""
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t) / iters * 1e6
    torch.cuda.synchronize()
    return round(dt, 1)


def graphed_us(fn):
    from asynctp.bench.timing import capture_graph

    try:
        replay, _ = capture_graph(fn, torch.device("cuda"))
    except Exception as exc:  # noqa: BLE001
        return f"capture failed: {str(exc)[:120]}"
    return device_us(replay)


def profile_text(fn, rank, iters=20):
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    dist.barrier()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    if rank != 0:
        return ""
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    return s.getvalue()


def probe_case(name, m, g, rank, out):
    import asynctp
    from asynctp.bench.cases import CASES as REG
    from asynctp.bench.shapes import shapes_for

    case = REG[name]
    shape = next(s for s in shapes_for("seed", case.kind, g.size()) if s.m == m)
    problem = case.build(shape, torch.bfloat16, g, torch.device("cuda"), 0)
    asynctp.reserve(g, problem.workspace_bytes)
    row = {"case": name, "m": m}
    row["compute_bound"] = device_us(problem.compute_bound)
    row["comm_bound"] = device_us(problem.comm_bound)
    for strat in STRATEGIES:
        fn = lambda: problem.asynctp(strat)  # noqa: E731
        row[f"{strat}_device"] = device_us(fn)
        row[f"{strat}_host"] = host_us(fn)
        row[f"{strat}_graphed"] = graphed_us(fn)
        text = profile_text(fn, rank)
        if rank == 0:
            with open(os.path.join(out, f"cprofile_{name}_{m}_{strat}.txt"), "w") as f:
                f.write(text)
        if strat != "serial":
            global TRACE_TAG
            TRACE_TAG = f"{name}_{m}_{os.environ.get('ASYNCTP_SIGNALS', 'streamops')}_c{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'd')}"
            text = torch_profile_text(fn, rank)
            if rank == 0:
                with open(os.path.join(out, f"torchprof_{name}_{m}_{strat}.txt"), "w") as f:
                    f.write(text)
    return row


def torch_profile_text(fn, rank, iters=5):
    """CPU-side durations of the CUDA runtime/driver calls: which one blocks the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    if TRACE_DIR:
        prof.export_chrome_trace(os.path.join(TRACE_DIR, f"trace_{TRACE_TAG}_rank{rank}.json"))
    if rank != 0:
        return ""
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def primitives(g, rank, ws_size):
    """Host us per call of each building block (both ranks run the same sequence)."""
    from asynctp.symm import get_workspace
    from torch._C._distributed_c10d import _SymmetricMemory

    ws = get_workspace(g, torch.device("cuda"))
    h = ws._handle
    peer = (rank + 1) % ws_size
    small = torch.zeros(1024, device="cuda")
    dst = torch.empty(1024, device="cuda")
    flags = torch.zeros(64, dtype=torch.uint32, device="cuda")
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    ev = torch.cuda.Event()
    s2 = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    res = {}

    def put_wait():
        h.put_signal(peer, channel=5, timeout_ms=60000)
        h.wait_signal(peer, channel=5, timeout_ms=60000)

    # asynctp's flags are set by the peer and reset by their owner: a flag's next set must come
    # after the reset, which alternating two channels guarantees (one in a row could lose a set)
    turn = [0]

    def sig_only():
        turn[0] ^= 1
        ws.put_signal(peer, channel=6 + turn[0])
        ws.wait_signal(peer, channel=6 + turn[0])

    def ws_barrier():
        turn[0] ^= 1
        ws.barrier(channel=turn[0])

    items = {
        "handle.barrier": lambda: h.barrier(channel=0, timeout_ms=60000),
        "ws.barrier": ws_barrier,
        "handle.put+wait": put_wait,
        "ws.put+wait": sig_only,
        "stream_write_value32": lambda: _SymmetricMemory.stream_write_value32(flags, 3, 1),
        "memset32": lambda: _SymmetricMemory.memset32(flags, offset=3, val=1, count=1),
        "event.record": lambda: ev.record(cur),
        "wait_event": lambda: cur.wait_event(ev),
        "set_stream x2": lambda: (torch.cuda.set_stream(s2), torch.cuda.set_stream(cur)),
        "is_capturing": torch.cuda.is_current_stream_capturing,
        "current_stream": torch.cuda.current_stream,
        "get_buffer": lambda: ws.get_buffer(peer, (256, 256), torch.bfloat16, 0),
        "slice": lambda: dst[0:512],
        "copy_ 4KB": lambda: dst.copy_(small),
        "mm 256": lambda: torch.mm(a, a),
        "mm 256 out": lambda: torch.mm(a, a, out=a.new_empty(256, 256)),
        "empty": lambda: torch.empty(256, 256, device="cuda"),
    }
    for name, fn in items.items():
        for _ in range(10):
            fn()
        res[name] = host_us(fn, iters=200)
    if rank == 0:
        print("primitives host us/call:", json.dumps(res, indent=1), flush=True)
    return res


def main(rank, ws_size, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29534", rank=rank, world_size=ws_size,
                            device_id=torch.device("cuda", rank))
    g = dist.group.WORLD
    rows = []
    for spec in CASES:
        name, m = spec.split(":")
        row = probe_case(name, int(m), g, rank, out)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    prims = {} if os.environ.get("PROBE_NO_PRIMS") else primitives(g, rank, ws_size)
    if rank == 0:
        with open(os.path.join(out, "probe_host.json"), "w") as f:
            json.dump({"rows": rows, "primitives_host_us": prims, "torch": torch.__version__}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    mp.spawn(main, args=(torch.cuda.device_count(), sys.argv[1]), nprocs=torch.cuda.device_count())
