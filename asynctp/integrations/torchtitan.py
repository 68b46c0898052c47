"""torchtitan 0.3: its dist_gemm TP path (tp_gemm_backend="dist_gemm") run on asynctp's fused ops.

    import asynctp.integrations.torchtitan as att
    att.enable()                    # before the model's first forward; float8="rowwise" for fp8
    ... torchtitan's trainer, with tp_gemm_backend="dist_gemm" and parallelism.spmd_backend="spmd_types"

torchtitan's fused modules (AllGatherFusedQKVLinear, RowParallelLinear, AllGatherFusedFeedForward in
torchtitan.models.common.dist_gemm) keep their wiring (sequence-major flattening, fallbacks) and
call three autograd functions. enable() points those three names, in dist_gemm's namespace, at
asynctp's all_gather_linear / linear_reduce_scatter (gather / scatter dim 0, rows sequence-major),
forward and backward; disable() restores torchtitan's. Shapes (R ranks, M sequence-major rows):

    AllGatherLinear       x_shard_m [M / R, K], w_shard_n [N / R, K]        -> y [M, N / R]
    AllGatherLinearMulti  x_shard_m [M / R, K], wa, wb [N / R, K]           -> ya, yb [M, N / R]
    LinearReduceScatter   x_shard_k [M, K / R], w_shard_k [N, K / R], bias [N] -> y_shard_m [M / R, N]

Parameters may arrive as DTensors (torchtitan's parallelize shards them): their local shards are used.

Memory (Llama-3-8B's shape cut to 4 layers, seq 8192, benchmarks/torchtitan_bench.sh): in torchtitan's
eager loop the activations' addresses move between steps, so asynctp's graph cache keeps capturing.
Without a memory budget it held 14.7 GiB reserved against 10.3 with ASYNCTP_GRAPHS=0, at the same step
time (2xH200: 96.3 vs 95.9 ms). With the graphs' budget (runtime/graph_memory.py; 2xH100): bf16 11.03
GiB against default TP's 10.60, flat from step 6. The fp8 rowwise loop's host time is close to its
GPU time: on one machine it looked host-bound, which lifts the budget (17.84 GiB, 118.3 ms a step),
on three others the budget held (12.02-12.22 GiB, 102.8-104.4 ms), so set ASYNCTP_GRAPHS=0 for fp8
in that loop. Under torchtitan's own CUDA graphs the cache sees only the calls before the capture
(2xH200: 12.1 GiB, default TP 12.3).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["enable", "disable", "enabled"]

_NAMES = ("AllGatherLinear", "AllGatherLinearMulti", "LinearReduceScatter")
_saved: dict[str, Any] = {}


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class _Fused:
    """One stand-in for a torchtitan autograd Function: `.apply` with its argument order."""

    def __init__(self, name: str, float8: Any, strategy: str) -> None:
        from asynctp.nn.precision import resolve_float8

        self.name = name
        self.options = dict(float8=resolve_float8(float8, keep_buffers=True), strategy=strategy)

    def apply(self, *args: Any) -> Any:
        from asynctp.nn.column_parallel import run_all_gather_linear
        from asynctp.nn.row_parallel import run_linear_reduce_scatter

        x, *weights, group, group_name = args
        world = group.size()
        if self.name == "LinearReduceScatter":
            weight, bias = weights
            return run_linear_reduce_scatter(group_name, world, x, _local(weight), _local(bias), scatter_dim=0, **self.options)
        if self.name == "AllGatherLinear":
            weight, bias = weights
            return run_all_gather_linear(group_name, world, x, [_local(weight)], [_local(bias)], gather_dim=0,
                                         save_gathered_input=False, **self.options)[0]
        outs = run_all_gather_linear(group_name, world, x, [_local(w) for w in weights], [None] * len(weights),
                                     gather_dim=0, save_gathered_input=False, **self.options)
        return tuple(outs)


def enable(float8: Any = None, strategy: str = "auto") -> None:
    """Run torchtitan's dist_gemm modules on asynctp (float8: None, "tensorwise", "rowwise" or an
    asynctp.float8 recipe, for the forward and dgrad matmuls). Call again to change the settings."""
    try:
        from torchtitan.models.common import dist_gemm
    except ImportError as exc:
        raise ValueError(f"asynctp.integrations.torchtitan requires torchtitan >= 0.3 (models.common.dist_gemm), got {exc}") from None
    missing = [n for n in _NAMES if not hasattr(dist_gemm, n)]
    if missing:
        raise ValueError(f"asynctp.integrations.torchtitan requires dist_gemm to use {', '.join(_NAMES)}, got none of {missing}")
    for name in _NAMES:
        current = getattr(dist_gemm, name)
        if not isinstance(current, _Fused):
            _saved[name] = current
        setattr(dist_gemm, name, _Fused(name, float8, strategy))


def disable() -> None:
    """torchtitan's own autograd functions again."""
    from torchtitan.models.common import dist_gemm

    for name, original in _saved.items():
        setattr(dist_gemm, name, original)
    _saved.clear()


def enabled() -> bool:
    from torchtitan.models.common import dist_gemm

    return all(isinstance(getattr(dist_gemm, n), _Fused) for n in _NAMES)
