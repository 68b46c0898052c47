"""Developer probe: a CUDA-only profiler timeline of back-to-back pipelined calls (no host
activity recorded, so the host is not slowed), printed per stream for rank 0.

    PROBE_OP=ag|rs PROBE_KIND=bf16|rowwise|tensorwise PROBE_M=8192 python benchmarks/trace_pipeline.py OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def main(rank, ws, out):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29534", rank=rank, world_size=ws)
    g = dist.group.WORLD
    M = int(os.environ.get("PROBE_M", "8192"))
    op = os.environ.get("PROBE_OP", "ag")
    kind = os.environ.get("PROBE_KIND", "bf16")  # bf16, rowwise, tensorwise
    from benchmarks.probe_pipeline_plans import ag_case, rs_case

    if op == "ag":
        _, _, call = ag_case(kind, M, g, ws)
        fn = lambda: call("pipeline", False)  # noqa: E731
    else:
        _, call = rs_case(kind, M, g, ws)
        fn = lambda: call("pipeline")  # noqa: E731
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(out, f"trace_{op}_{kind}{M}_rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank == 0:
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
        ev.sort(key=lambda e: e["ts"])
        t0 = ev[0]["ts"]
        for e in ev[len(ev) // 2 :]:
            print(f'{e["ts"] - t0:9.1f} {e["dur"]:7.1f} s{e["args"].get("stream")} {e["name"][:50]}')
    dist.destroy_process_group()


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    mp.spawn(main, args=(torch.cuda.device_count(), sys.argv[1]), nprocs=torch.cuda.device_count())
