"""`asynctp doctor`: what this machine offers and which backend each op would use."""

from __future__ import annotations

import argparse
import os

import torch

__all__ = ["add_arguments", "run", "report"]

_ENV_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "ASYNCTP_TIMEOUT",
             "ASYNCTP_DISABLE_SYMM", "ASYNCTP_TUNING_CACHE")


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
    if n >= 2:
        lines.append("backend: cuda symmetric memory (copy-engine peer copies) for groups of GPUs on this host")
    elif n == 1:
        lines.append("backend: one GPU only: a TP group needs >= 2 ranks; CPU ranks use the cpu (shared-memory) backend")
    else:
        lines.append("backend: cpu (POSIX shared memory between local processes, gloo for collectives)")
    for var in _ENV_VARS:
        lines.append(f"{var}={os.environ.get(var, '(unset)')}")
    from asynctp.ops.tuning import cache_path

    lines.append(f"tuning cache: {cache_path()}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    print("\n".join(report()))
    return 0
