"""Where the benchmark's ranks come from: torchrun's environment, or processes spawned here (one
per local GPU over NCCL, or CPU ranks over gloo as a smoke test). Rank 0 prints and writes."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from asynctp.bench.measure import BenchConfig, run_benchmark
from asynctp.bench.report import format_table, write_results

__all__ = ["Plan", "plan", "launch", "SAFE_ENV"]

# NVLink multicast can take a shared host's GPUs down: never use it, whatever the caller's env
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_CPU_RANKS = 2


@dataclass(frozen=True)
class Plan:
    """How the ranks are started."""

    backend: str  # "nccl" (one rank per GPU) or "gloo" (CPU ranks)
    world_size: int
    torchrun: bool  # ranks already exist (RANK / WORLD_SIZE set): this process is one of them


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def plan(nproc: int | None) -> Plan:
    """One rank per local GPU (or nproc of them), 2 gloo CPU ranks without GPUs, or torchrun's."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus else "gloo"
    if _under_torchrun():
        if nproc is not None and nproc != int(os.environ["WORLD_SIZE"]):
            print(f"asynctp bench: under torchrun, --nproc {nproc} is ignored "
                  f"(WORLD_SIZE={os.environ['WORLD_SIZE']})", file=sys.stderr)
        return Plan(backend, int(os.environ["WORLD_SIZE"]), True)
    n = nproc if nproc is not None else (gpus or _CPU_RANKS)
    if n < 2:
        raise ValueError(f"--nproc requires at least 2 ranks (a tensor-parallel group), got {n}")
    if gpus and n > gpus:
        raise ValueError(f"--nproc requires at most the {gpus} local GPUs, got {n}")
    return Plan(backend, n, False)


def _set_safe_env() -> None:
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)


def _rank_main(rank: int, world_size: int, backend: str, init_method: str, local_rank: int,
               cfg: BenchConfig, out_dir: str | None, status_path: str | None) -> int:
    """One rank's whole run; returns the process exit code (rank 0 also writes status_path)."""
    _set_safe_env()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        extra = {"device_id": device}
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device, extra = torch.device("cpu"), {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=5), **extra)
    try:
        if cfg.contention is not None:
            return _contention(cfg, rank, out_dir, status_path)
        save = functools.partial(_save_row, out_dir=out_dir) if rank == 0 and out_dir else None
        rows = run_benchmark(cfg, dist.group.WORLD, device, on_row=save)
        code = 0
        if rank == 0:
            code = _finish(rows, out_dir)
            if status_path:
                Path(status_path).write_text(json.dumps({"code": code}))
        return code
    finally:
        dist.destroy_process_group()


def _contention(cfg: BenchConfig, rank: int, out_dir: str | None, status_path: str | None) -> int:
    """--contention on every rank; rank 0 prints the result and writes contention_<hw>_<date>.json."""
    from asynctp.bench.contention import measure_contention
    from asynctp.bench.measure import environment
    from asynctp.bench.report import results_stem

    size, mb = cfg.contention
    result = measure_contention(dist.group.WORLD, size=size, mb=mb)
    if rank != 0:
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    result.update(environment(dist.group.WORLD, device, cfg.hardware), command=cfg.command)
    print(json.dumps(result, indent=1), flush=True)
    if out_dir:
        path = Path(out_dir) / (results_stem("contention", result["hardware"]) + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    if status_path:
        Path(status_path).write_text(json.dumps({"code": 0}))
    return 0


def _save_row(row: dict, out_dir: str) -> None:
    """Rank 0, after each row: into the results files at once (a hang later keeps it)."""
    write_results([row], out_dir, figures=False)


def _finish(rows: list[dict], out_dir: str | None) -> int:
    """Rank 0: print the table, write the files; exit code 1 if any row failed or none ran."""
    if not rows:
        print("asynctp bench: nothing was measured", file=sys.stderr)
        return 1
    print()
    print(format_table(rows), flush=True)
    if out_dir:
        for path in write_results(rows, out_dir):
            print(f"wrote {path}")
    failed = [r for r in rows if r.get("error")]
    for r in failed:
        print(f"FAILED {r['op']} {r['shape_set']} {r['shape']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def _spawned(local_rank: int, world_size: int, backend: str, init_method: str, cfg: BenchConfig,
             out_dir: str | None, status_path: str) -> None:
    _rank_main(local_rank, world_size, backend, init_method, local_rank, cfg, out_dir, status_path)


def launch(cfg: BenchConfig, how: Plan, out_dir: str | None) -> int:
    """Run the benchmark on every rank; returns rank 0's exit code."""
    _set_safe_env()  # inherited by spawned ranks, and set before this process touches NCCL
    if how.torchrun:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        code = _rank_main(rank, how.world_size, how.backend, "env://", local_rank, cfg, out_dir, None)
        return code if rank == 0 else 0
    if how.backend == "gloo":
        print(f"asynctp bench: no CUDA GPU, {how.world_size} CPU ranks over gloo with perf_counter "
              "timing: a smoke test of the harness, not a benchmark", file=sys.stderr)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="asynctp-bench-") as tmp:
        store, status = os.path.join(tmp, "store"), os.path.join(tmp, "status.json")
        mp.spawn(_spawned, args=(how.world_size, how.backend, f"file://{store}", cfg, out_dir, status),
                 nprocs=how.world_size, join=True)
        try:
            return int(json.loads(Path(status).read_text())["code"])
        except (OSError, ValueError, KeyError):
            print("asynctp bench: rank 0 ended without a status", file=sys.stderr)
            return 1
