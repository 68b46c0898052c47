"""Developer probe (not the benchmark): serial vs pipeline at several row-block counts vs torch's
fused op, seed shapes, all local GPUs, plus an optional profiler trace. Used to choose the
pipeline's defaults; `asynctp bench` is the measurement of record.

    python benchmarks/probe_pipeline.py OUT_DIR [profile]
"""

import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from asynctp.bench.timing import time_us  # noqa: E402

SPLITS = [int(s) for s in os.environ.get("PROBE_SPLITS", "1,2,4").split(",")]
MS = [int(s) for s in os.environ.get("PROBE_M", "2048,4096,8192").split(",")]
# SM carve-outs to try (ASYNCTP_SM_CARVEOUT) for the default pipeline plan and the ring
RING_SPLITS = [int(s) for s in os.environ.get("PROBE_RING_SPLITS", "1").split(",")]
CARVEOUTS = [int(s) for s in os.environ.get("PROBE_CARVEOUT", "").split(",") if s]


def timeit(fn, iters=30, warmup=5):
    """fn's median time in us, ranks started together, the slowest rank's (asynctp.bench.timing)."""
    return round(time_us(fn, iters, warmup, dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())), 1)


def with_env(name, value, fn):
    """fn, called with os.environ[name] = value for the duration of each call."""
    def call():
        os.environ[name] = str(value)
        try:
            return fn()
        finally:
            os.environ.pop(name, None)

    return call


def finish(rank, path, data):
    """Rank 0 writes `data` as JSON to `path`; then every rank leaves the process group."""
    if rank == 0:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def with_carveout(c, fn):
    return with_env("ASYNCTP_SM_CARVEOUT", c, fn)


def with_splits(sp, fn):
    return with_env("ASYNCTP_SPLITS", sp, fn)


def sweep_carveouts(r, mm, pipe, ring):
    """mm (under the carve-out), default-plan pipeline and ring per carve-out value."""
    from asynctp.ops.carveout import sm_carveout

    for c in CARVEOUTS:
        def mm_under_carveout():
            with sm_carveout(torch.device("cuda"), "pipeline"):
                return mm()

        r[f"mm_co{c}"] = timeit(with_carveout(c, mm_under_carveout))
        r[f"pipe_co{c}"] = timeit(with_carveout(c, pipe))
        for rs in RING_SPLITS:
            r[f"ring_co{c}_s{rs}"] = timeit(with_env("ASYNCTP_RING_SPLITS", rs, with_carveout(c, ring)))


def probe_shape(M, g, rank, ws):
    import asynctp

    gn = g.group_name
    N, K = 3584, 8192
    torch.manual_seed(rank)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a_shard, a_full = torch.randn(M // ws, K, **bf), torch.randn(M, K, **bf)
    b = torch.randn(K, N, **bf) / 64
    ag_out = torch.empty(M, K, **bf)
    r = {"op": "ag", "M": M}
    r["mm"] = timeit(lambda: torch.mm(a_full, b))
    r["nccl"] = timeit(lambda: dist.all_gather_into_tensor(ag_out, a_shard, group=g))
    r["serial"] = timeit(lambda: asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="serial"))
    ref = asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="serial")
    for sp in SPLITS:
        call = with_splits(sp, lambda: asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="pipeline"))
        got = call()
        assert torch.equal(got[0], ref[0])
        torch.testing.assert_close(got[1][0], ref[1][0], rtol=2e-2, atol=2e-2)
        r[f"pipe{sp}"] = timeit(call)
    r["ring"] = timeit(lambda: asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="ring"))
    sweep_carveouts(r, lambda: torch.mm(a_full, b),
                    lambda: asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="pipeline"),
                    lambda: asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="ring"))
    try:
        r["torch"] = timeit(lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, gn))
    except Exception as e:  # noqa: BLE001
        r["torch"] = str(e)[:80]
    rows = [r]
    a2, b2 = torch.randn(M, N, **bf), torch.randn(N, K, **bf) / 64
    full, rs_out = torch.randn(M, K, **bf), torch.empty(M // ws, K, **bf)
    r = {"op": "rs", "M": M}
    r["mm"] = timeit(lambda: torch.mm(a2, b2))
    r["nccl"] = timeit(lambda: dist.reduce_scatter_tensor(rs_out, full, group=g))
    r["serial"] = timeit(lambda: asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="serial"))
    ref = asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="serial")
    for sp in SPLITS:
        call = with_splits(sp, lambda: asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="pipeline"))
        torch.testing.assert_close(call(), ref, rtol=2e-2, atol=5e-2)
        r[f"pipe{sp}"] = timeit(call)
    r["ring"] = timeit(lambda: asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="ring"))
    sweep_carveouts(r, lambda: torch.mm(a2, b2),
                    lambda: asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="pipeline"),
                    lambda: asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="ring"))
    try:
        r["torch"] = timeit(lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a2, b2, "sum", 0, gn))
    except Exception as e:  # noqa: BLE001
        r["torch"] = str(e)[:80]
    rows.append(r)
    return rows


def profile(g, rank, ws, out):
    import asynctp
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    M = int(os.environ.get("PROBE_PROFILE_M", "8192"))
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a_shard, b = torch.randn(M // ws, 8192, **bf), torch.randn(8192, 3584, **bf)
    a2, b2 = torch.randn(M, 3584, **bf), torch.randn(3584, 8192, **bf)

    def step():
        asynctp.all_gather_matmul(a_shard, [b], 0, g, strategy="pipeline")
        asynctp.matmul_reduce_scatter(a2, b2, 0, g, strategy="pipeline")

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(os.path.join(out, "trace_rank0.json"))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def host_overhead(g, rank):
    """Host microseconds per call at a tiny shape (the GPU is idle: pure launch + Python cost)."""
    import cProfile
    import pstats
    import time

    import asynctp

    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(256, 256, **bf), torch.randn(256, 256, **bf)
    res = {}
    for name, fn in (
        ("ag_pipe", lambda: asynctp.all_gather_matmul(a, [b], 0, g, strategy="pipeline")),
        ("rs_pipe", lambda: asynctp.matmul_reduce_scatter(a, b, 0, g, strategy="pipeline")),
        ("ag_serial", lambda: asynctp.all_gather_matmul(a, [b], 0, g, strategy="serial")),
        ("mm", lambda: torch.mm(a, b)),
    ):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        res[name] = round((time.perf_counter() - t) / 200 * 1e6, 1)
        torch.cuda.synchronize()
    if rank == 0:
        print("host us/call", res)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            asynctp.all_gather_matmul(a, [b], 0, g, strategy="pipeline")
            asynctp.matmul_reduce_scatter(a, b, 0, g, strategy="pipeline")
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    else:
        for _ in range(100):
            asynctp.all_gather_matmul(a, [b], 0, g, strategy="pipeline")
            asynctp.matmul_reduce_scatter(a, b, 0, g, strategy="pipeline")
        torch.cuda.synchronize()


def main(rank, ws, out, do_profile):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=ws)
    g = dist.group.WORLD
    try:
        import torch.distributed._symmetric_memory as sm

        sm.enable_symm_mem_for_group(g.group_name)
    except Exception as e:  # noqa: BLE001
        print("enable_symm_mem_for_group:", e)
    if not os.environ.get("PROBE_NO_HOST"):
        host_overhead(g, rank)
    rows = []
    for M in MS:
        rows += probe_shape(M, g, rank, ws)
        if rank == 0:
            print(rows[-2], rows[-1], flush=True)
    if do_profile:
        profile(g, rank, ws, out)
    if rank == 0:
        with open(os.path.join(out, "probe.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(torch.cuda.device_count(), sys.argv[1], len(sys.argv) > 2), nprocs=torch.cuda.device_count())
