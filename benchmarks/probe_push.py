"""Peer-push bandwidth over NVLink: how fast a rank's copy engines write into a peer's symmetric
buffer, with one copy stream or the push split over several, the GPU idle or a GEMM beside it.
Every rank pushes to its successor at the same time (as the fused ops do).

    python benchmarks/probe_push.py OUT.json [--world-size 2] [--mib 16 32 64] [--streams 1 2 4]

Rows: (MiB, streams, mode) -> the push's time and GB/s, and for mode "gemm" the GEMM's time
beside the push against alone (median of --iters, slowest rank). Mode "sm" pushes with an
elementwise kernel (SMs) instead of a copy engine, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _slowest(us: float) -> float:
    t = torch.tensor([us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank: int, world: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    nbytes = max(args.mib) << 20
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, group)
    peer = handle.get_buffer((rank + 1) % world, (nbytes,), torch.uint8, 0)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(max(args.streams))]
    a = torch.randn(args.gemm[0], args.gemm[2], device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.gemm[2], args.gemm[1], device="cuda", dtype=torch.bfloat16)
    rows = []

    def push(size: int, nstreams: int, sm: bool, beside=None):
        """The push of `size` bytes, split over `nstreams` copy streams; beside(): work queued on
        the current stream after the copy streams forked from it (not waited for by them)."""
        main = torch.cuda.current_stream()
        piece = size // nstreams
        for s in streams[:nstreams]:
            s.wait_stream(main)
        if beside is not None:
            beside()
        for i, s in enumerate(streams[:nstreams]):
            with torch.cuda.stream(s):
                d, x = peer[i * piece : (i + 1) * piece], src[i * piece : (i + 1) * piece]
                if sm:  # an elementwise kernel (SMs), in 4-byte words where the piece allows
                    words = piece % 4 == 0
                    torch.add(x.view(torch.int32) if words else x, 0, out=d.view(torch.int32) if words else d)
                else:
                    d.copy_(x)
            main.wait_stream(s)

    gemm_alone = _slowest(_time(lambda: torch.mm(a, b), args.iters))
    for mib in args.mib:
        size = mib << 20
        for ns in args.streams:
            for mode in ("idle", "gemm", "sm"):
                if mode == "sm" and ns != 1:
                    continue
                if mode != "gemm":
                    us = _slowest(_time(lambda: push(size, ns, mode == "sm"), args.iters))
                    rows.append(dict(mib=mib, streams=ns, mode=mode, us=round(us, 1), gbps=round(size / us / 1e3, 1)))
                    continue
                gemm_ev = []

                def gemm():
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    torch.mm(a, b)
                    e1.record()
                    gemm_ev.append((e0, e1))

                both = _slowest(_time(lambda: push(size, ns, False, beside=gemm), args.iters))
                torch.cuda.synchronize()
                g = _slowest(statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in gemm_ev))
                rows.append(dict(mib=mib, streams=ns, mode=mode, us=round(both, 1), gemm_us=round(g, 1),
                                 gemm_alone_us=round(gemm_alone, 1)))
            if rank == 0:
                print(rows[-3:] if ns == 1 else rows[-2:], flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), world=world, torch=torch.__version__,
                           gemm=args.gemm, rows=rows), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mib", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--gemm", type=int, nargs=3, default=[8192, 4096, 4096], metavar=("M", "N", "K"))
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    mp.spawn(_worker, args=(args.world_size, args, 29511), nprocs=args.world_size)


if __name__ == "__main__":
    main()
