"""torchtitan 0.3's trainer with its dist_gemm TP path running on asynctp's fused ops.

    pip install torchtitan==0.3.0      # and its dependencies (triton, datasets, ...)
    torchrun --nproc-per-node 2 examples/torchtitan/train.py \\
        --module llama3 --config llama3_debugmodel_dist_gemm \\
        --parallelism.tensor_parallel_degree 2 --training.steps 20

Every argument goes to torchtitan (torchtitan.train's --module / --config / --<section>.<key>),
except --asynctp.float8 {tensorwise,rowwise} (fp8 forward and dgrad matmuls) and --asynctp.off
(torchtitan's own dist_gemm, for comparison). The config must select tp_gemm_backend="dist_gemm"
and parallelism.spmd_backend="spmd_types", as torchtitan's llama3_debugmodel_dist_gemm does
(torchtitan 0.3 registers no 8B config with dist_gemm; benchmarks/train_bench.py times that shape).
The trainer needs torchtitan's tokenizer assets and dataset (see torchtitan's README); the CPU test
of this integration (tests/dist/test_integrations.py) runs torchtitan's fused modules directly.
"""

from __future__ import annotations

import sys

import asynctp.integrations.torchtitan as att


def _pop(flag: str, takes_value: bool) -> str | bool | None:
    """Remove `flag` (and its value) from sys.argv; its value, True, or None if absent."""
    for i, arg in enumerate(sys.argv):
        if arg == flag:
            del sys.argv[i]
            return sys.argv.pop(i) if takes_value else True
        if takes_value and arg.startswith(flag + "="):
            del sys.argv[i]
            return arg.split("=", 1)[1]
    return None


def main() -> None:
    float8 = _pop("--asynctp.float8", True)
    if not _pop("--asynctp.off", False):
        att.enable(float8=float8)
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
