"""`asynctp doctor`: what this machine offers and which backend each op would use."""

from __future__ import annotations

import argparse
import os

import torch

__all__ = ["add_arguments", "run", "report"]

_ENV_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")  # torch's and NCCL's; asynctp's: Config


def report() -> list[str]:
    lines = [f"torch {torch.__version__}"]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed (needed only on GPU)")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(f"CUDA GPUs: {n}")
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    if n > 1:
        lines.append("peer access (row can read column):")
        for i in range(n):
            row = " ".join("-" if i == j else ("Y" if torch.cuda.can_device_access_peer(i, j) else "n") for j in range(n))
            lines.append(f"  cuda:{i}  {row}")
    lines += _backend_lines(n)
    lines.append(_fp8_quantization_line(n))
    for var in _ENV_VARS:
        lines.append(f"{var}={os.environ.get(var, '(unset)')}")
    from asynctp.config import get_config

    lines.append(f"asynctp settings: {get_config()}")
    lines.append("NVLink multicast: never used by asynctp (no multimem/multicast calls), whatever the variables above say")
    from asynctp.ops.tuning import cache_path, load

    table = load()
    name = torch.cuda.get_device_name(0) if n else "cpu"
    known = sum(1 for key in table if f"|{name}|" in key)
    lines.append(f"tuning: {cache_path()} over the shipped tables; {known} measured shapes for {name}")
    return lines


def _fp8_quantization_line(n: int) -> str:
    """How asynctp.float8 quantizes here: Triton kernels on CUDA, torch ops otherwise."""
    if n == 0:
        return "fp8 quantization: torch ops (CPU)"
    try:
        import asynctp.float8.kernels  # noqa: F401
    except ImportError as exc:
        return f"fp8 quantization: torch ops, the Triton kernels cannot load ({exc}); a warning says so at first use"
    return "fp8 quantization: Triton kernels on CUDA (one pass per tensor), torch ops under torch.compile"


def _backend_lines(n: int) -> list[str]:
    """Which backend and strategy each op would use on this machine, and why."""
    ops = "all_gather_matmul, matmul_reduce_scatter, all_gather_scaled_matmul, scaled_matmul_reduce_scatter"
    if n == 0:
        return [
            "backend: cpu (POSIX shared memory between local processes; gloo for collectives)",
            f"  {ops}: strategy auto -> pipeline (the same code the GPU runs, in program order)",
        ]
    p2p = all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)
    if n >= 2 and p2p:
        return [
            "backend: cuda symmetric memory for groups of these GPUs (every pair has peer access)",
            f"  {ops}: strategy auto -> fused or pipeline where the tuning table says it wins (for an",
            "    unmeasured shape, from the M 2048 x 3584 x 8192 seed shape's FLOPs up), else serial",
            "  all_gather, reduce_scatter: copy-engine copies over the workspace",
            "  groups spanning hosts: no workspace -> strategy ring (NCCL send/recv) or serial, with a warning",
        ]
    if n >= 2:
        return [
            "backend: none for groups of these GPUs (some pair has no peer access)",
            f"  {ops}: strategy auto -> ring (NCCL send/recv on a side stream) for large matmuls, else serial",
        ]
    return ["backend: one GPU: a TP group needs >= 2 ranks (CPU ranks would use the cpu backend)"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    print("\n".join(report()))
    return 0
