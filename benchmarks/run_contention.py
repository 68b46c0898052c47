"""Spawn one rank per GPU and run asynctp.bench.contention.measure_contention; writes JSON.

    python benchmarks/run_contention.py OUT.json [--size 8192] [--mb 256]
"""

import argparse
import json
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _rank(rank: int, world: int, args: argparse.Namespace) -> None:
    from asynctp.bench.contention import measure_contention

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29541", rank=rank, world_size=world)
    result = measure_contention(dist.group.WORLD, size=args.size, mb=args.mb)
    if rank == 0:
        result["device"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
        print(json.dumps(result, indent=1))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
    mp.spawn(_rank, args=(torch.cuda.device_count(), args), nprocs=torch.cuda.device_count())
