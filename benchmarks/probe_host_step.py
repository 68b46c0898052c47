"""Where the host time of a training step goes: the demo's 8B block on all local GPUs, one rank
profiled with cProfile over a few warm steps (after CUDA-graph captures settled).

    python benchmarks/probe_host_step.py OUT_DIR [vanilla:none asynctp:rowwise asynctp:tensorwise asynctp:none ...]

Writes OUT_DIR/host_<variant>_<recipe>.txt (pstats, top functions by own and cumulative time)
and prints the host / step time per variant.
"""

import cProfile
import io
import os
import pstats
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, out_dir: str, specs: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import SIZES
    from asynctp.demo.train import VARIANTS, TrainSettings, _build, _queue_step

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cuda", (world,))
    cfg = SIZES["8b-block"]
    for spec in specs:
        name, recipe = spec.split(":")
        settings = TrainSettings(cfg=cfg, steps=1, dtype=torch.bfloat16, lr=1e-4, float8=None if recipe == "none" else recipe)
        model = _build(VARIANTS[name], settings, mesh, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        data = MarkovTokens(cfg.vocab_size, seed=0)

        def step() -> tuple[float, float]:
            tokens = data.batch(cfg.batch_size, cfg.seq_len).to(device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = _queue_step(model, opt, tokens)
            host = time.perf_counter() - start
            loss.item()
            torch.cuda.synchronize()
            return host, time.perf_counter() - start

        for _ in range(8):
            step()
        plain = [step() for _ in range(5)]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            step()
        prof.disable()
        if rank == 0:
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
            with open(os.path.join(out_dir, f"host_{name}_{recipe}.txt"), "w") as f:
                f.write(f"{spec}: unprofiled host / step ms per step: {[(round(h * 1e3, 1), round(s * 1e3, 1)) for h, s in plain]}\n")
                f.write(text.getvalue())
            print(f"{spec}: host {sorted(h for h, _ in plain)[2] * 1e3:.1f} ms, step {sorted(s for _, s in plain)[2] * 1e3:.1f} ms", flush=True)
        del model, opt
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    specs = sys.argv[2:] or ["vanilla:none", "asynctp:none", "asynctp:rowwise", "asynctp:tensorwise"]
    os.makedirs(out, exist_ok=True)
    world = torch.cuda.device_count()
    mp.spawn(rank_main, args=(world, out, specs), nprocs=world)
