"""Where the host time of a training step goes: the demo's 8B block on all local GPUs, one rank
profiled with cProfile over a few warm steps (after CUDA-graph captures settled).

    python benchmarks/probe_host_step.py OUT_DIR [vanilla:none asynctp:rowwise asynctp:tensorwise asynctp:none ...]

A third field `compile` (`vanilla:none:compile`, `torch-async-tp:none:compile`) compiles the model
as the demo's --compile does; PROBE_BATCH=B sets the sequences per step (default: the model's).

Writes OUT_DIR/host_<variant>_<recipe>.txt (pstats, top functions by own and cumulative time)
and prints the host / step time per variant; then, with a CUDA-only torch profiler over the same
number of steps, OUT_DIR/kernels_<variant>_<recipe>.txt: device time per step by kernel category
(GEMM, quantization, elementwise, NCCL, copies, ...) and the top kernels, rank 0. PROBE_OPS=1:
also OUT_DIR/ops_<variant>_<recipe>.txt, aten ops by device time grouped by input shapes.
Every rank prints its unprofiled steps' (PROBE_STEPS of them, default 5, after PROBE_WARMUP
steps, default 8) median host and step time, peak memory and graph-cache calls per step; PROBE_PLAIN=1: that only, no profiles.
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
    import dataclasses

    import torch._inductor.config
    from torch.distributed.device_mesh import init_device_mesh

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import SIZES
    from asynctp.demo.train import VARIANTS, TrainSettings, _build
    from asynctp.ops import graphs

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cuda", (world,))
    cfg = SIZES["8b-block"]
    if os.environ.get("PROBE_BATCH"):
        cfg = dataclasses.replace(cfg, batch_size=int(os.environ["PROBE_BATCH"]))
    for spec in specs:
        name, recipe, *mode = spec.split(":")
        settings = TrainSettings(cfg=cfg, steps=1, dtype=torch.bfloat16, lr=1e-4, float8=None if recipe == "none" else recipe,
                                 compile=mode == ["compile"])
        model = _build(VARIANTS[name], settings, mesh, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = _stepper(model, opt, MarkovTokens(cfg.vocab_size, seed=0), cfg, device)
        for _ in range(int(os.environ.get("PROBE_WARMUP", "8"))):  # more where keys' addresses settle late
            step()
        torch.cuda.reset_peak_memory_stats(device)
        before = graphs.stats()
        plain = [step() for _ in range(int(os.environ.get("PROBE_STEPS", "5")))]
        after = graphs.stats()
        calls = {k: (after[k] - before[k]) // len(plain) for k in after if k != "graphs" and after[k] != before[k]}
        host, secs = sorted(h for h, _ in plain), sorted(s for _, s in plain)
        print(f"rank {rank} {spec} graphs={os.environ.get('ASYNCTP_GRAPHS', 'auto')} lag_ms={graphs.LAG_SECONDS * 1e3:g}: "
              f"host {host[len(host) // 2] * 1e3:.1f} ms, step {secs[len(secs) // 2] * 1e3:.1f} ms "
              f"(min {secs[0] * 1e3:.1f}, max {secs[-1] * 1e3:.1f}), peak allocated "
              f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB, reserved {torch.cuda.max_memory_reserved(device) / 2**30:.2f}, "
              f"graph calls per step {calls}", flush=True)
        if not os.environ.get("PROBE_PLAIN"):
            profiles(step, rank, out_dir, spec, plain)
        del model, opt
        torch._inductor.config._micro_pipeline_tp = False  # _build switched it on for torch-async-tp specs
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


def _stepper(model, opt, data, cfg, device):
    """step(): one timed training step, (host seconds, step seconds)."""
    from asynctp.demo.train import _queue_step

    def step() -> tuple[float, float]:
        tokens = data.batch(cfg.batch_size, cfg.seq_len).to(device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = _queue_step(model, opt, tokens)
        host = time.perf_counter() - start
        loss.item()
        torch.cuda.synchronize()
        return host, time.perf_counter() - start

    return step


def profiles(step, rank: int, out_dir: str, spec: str, plain: list[tuple[float, float]]) -> None:
    """cProfile of 3 steps (rank 0 writes host_<tag>.txt), the kernel breakdown, and with
    PROBE_OPS / PROBE_TRACE the ops by shape and a chrome trace of one step."""
    tag = spec.replace(":", "_")
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
        with open(os.path.join(out_dir, f"host_{tag}.txt"), "w") as f:
            f.write(f"{spec}: unprofiled host / step ms per step: {[(round(h * 1e3, 1), round(s * 1e3, 1)) for h, s in plain]}\n")
            f.write(text.getvalue())
    kernel_breakdown(step, rank, os.path.join(out_dir, f"kernels_{tag}.txt"), spec)
    if os.environ.get("PROBE_OPS"):  # which ops (and shapes) launch the copies and elementwise kernels
        ops_by_shape(step, rank, os.path.join(out_dir, f"ops_{tag}.txt"))
    if os.environ.get("PROBE_TRACE") and rank == 0:  # a chrome trace of one step, rank 0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{tag}.json"))
    elif os.environ.get("PROBE_TRACE"):
        step()


_CATEGORIES = (  # first match wins; names as the profiler reports kernels and copies
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "scaled_mm", "f8f8")),
    ("quantize (triton)", ("_rows_kernel", "_tile_kernel", "_dequant_kernel")),
    ("triton other", ("triton",)),
    ("attention", ("flash", "fmha", "attention")),
    ("copy", ("memcpy", "copy", "memset")),
    ("reduce", ("reduce", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_breakdown(step, rank: int, path: str, spec: str, steps: int = 3) -> None:
    """Device time per step by kernel category and the top kernels (rank 0 writes path)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    if rank != 0:
        return
    per_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / steps
    per_cat: dict[str, float] = {}
    for name, ms in per_name.items():
        per_cat[_category(name)] = per_cat.get(_category(name), 0.0) + ms
    lines = [f"{spec}: device ms per step by category (sum over streams; overlapped work counts twice)"]
    lines += [f"  {cat:20s} {ms:8.2f}" for cat, ms in sorted(per_cat.items(), key=lambda kv: -kv[1])]
    lines.append(f"  {'total':20s} {sum(per_cat.values()):8.2f}")
    lines.append("top kernels, ms per step:")
    for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[:40]:
        lines.append(f"  {ms:8.3f}  {_category(name):18s} {name[:110]}")
    text = "\n".join(lines)
    with open(path, "w") as f:
        f.write(text + "\n")
    print("\n".join(lines[: len(per_cat) + 2]), flush=True)


def ops_by_shape(step, rank: int, path: str, steps: int = 2) -> None:
    """aten ops by device time they launched, grouped by input shapes (CPU + CUDA profiler, so
    the step runs slower: device times only), rank 0 writes path. For the copies, casts and
    elementwise work around the matmuls that the kernel table cannot attribute."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    if rank != 0:
        return
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=60,
                                                                max_name_column_width=60, max_shapes_column_width=80)
    with open(path, "w") as f:
        f.write(f"{steps} steps\n{table}\n")


if __name__ == "__main__":
    out = sys.argv[1]
    specs = sys.argv[2:] or ["vanilla:none", "asynctp:none", "asynctp:rowwise", "asynctp:tensorwise"]
    os.makedirs(out, exist_ok=True)
    world = torch.cuda.device_count()
    mp.spawn(rank_main, args=(world, out, specs), nprocs=world)
