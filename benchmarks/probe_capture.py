"""Developer probe: can CUDA stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32)
be captured into a CUDA graph and replayed, with set/reset flags between two ranks?

Each rank captures [write 1 into the peer's flag | wait until own flag == 1 | write 0 into own
flag | x += 1] on a side stream and replays it N times, alternating with eager (uncaptured) rounds
of the same protocol, then checks x. A hang is caught by a 60 s alarm.

    python benchmarks/probe_capture.py OUT_DIR
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.probe_pipeline import finish  # rank 0 writes the JSON, all leave the group

WAIT_EQ = 0x1


def main(rank: int, world: int, out: str) -> None:
    torch.cuda.set_device(rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory

    signal.signal(signal.SIGALRM, lambda *a: (print(f"rank {rank}: HANG", flush=True), os._exit(3)))
    signal.alarm(60)
    buf = symm_mem.empty(1 << 20, dtype=torch.uint8, device="cuda")
    h = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    pads = [int(p) for p in h.signal_pad_ptrs]
    off = int(_SymmetricMemory.signal_pad_size) - 4 * 64
    lib = ctypes.CDLL("libcuda.so.1")
    wr, wt = lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2
    for f in (wr, wt):
        f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        f.restype = ctypes.c_int
    peer = 1 - rank
    mine = pads[rank] + off + 4 * peer  # the peer sets this one
    theirs = pads[peer] + off + 4 * rank
    x = torch.zeros((), device="cuda")
    res: dict = {}

    def round_(stream: int) -> None:
        rcs = [wr(stream, theirs, 1, 0), wt(stream, mine, 1, WAIT_EQ), wr(stream, mine, 0, 0)]
        if any(rcs):
            raise RuntimeError(f"CUresults {rcs}")
        x.add_(1)

    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local")
            round_(s.cuda_stream)
            g.capture_end()
        res["capture"] = "ok"
    except Exception as exc:  # noqa: BLE001
        res["capture"] = f"failed: {exc!r}"
    torch.cuda.synchronize()
    n = 0
    if res["capture"] == "ok":
        t0 = time.perf_counter()
        for i in range(2000):
            if i % 3 == 2:
                round_(torch.cuda.current_stream().cuda_stream)
            else:
                g.replay()
            n += 1
        torch.cuda.synchronize()
        res["rounds"] = n
        res["x"] = float(x)
        res["ok"] = float(x) == n
        res["us_per_round"] = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(200):
            g.replay()
        res["replay_host_us"] = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    res["storage_use_count"] = hasattr(torch._C, "_storage_Use_Count")
    print(f"rank {rank}: {res}", flush=True)
    finish(rank, os.path.join(out, "probe_capture.json"), res)


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    mp.spawn(main, args=(2, sys.argv[1]), nprocs=2)
