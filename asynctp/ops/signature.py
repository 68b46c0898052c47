"""What each op's ranks must agree on: the fields of its call signature, from its arguments.

Only what the exchange depends on: the shapes and dtypes that travel, the gather / scatter dim,
reduce_op, the strategy asked for, fp8 scale modes (and, on CPU where reading it costs no
device sync, the value of a tensorwise a_scale of an all-gather: the gathered rows share it).
Rank-local choices (N of b for a gather, return_a, biases, how many bs) may differ.
Each function returns (group, device, values); NAMES[op] names the values.

The strategy enters as "serial", "ring" or "auto|pipeline": auto resolves to the pipeline where
the pipeline pays, and a CUDA graph captured under one is replayed for the other (its key holds
the resolved strategy), so the two must have one signature.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NAMES", "FIELDS"]

NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_matmul": ("a_shard.shape", "a_shard.dtype", "gather_dim", "strategy"),
    "all_gather_contract": ("x_shard.shape", "x_shard.dtype", "gather_dim", "strategy"),
    "matmul_reduce_scatter": ("a.shape[:-1]", "b.shape[1]", "dtype", "scatter_dim", "reduce_op", "strategy"),
    "all_gather_scaled_matmul": ("a_shard.shape", "a_shard.dtype", "gather_dim", "scale", "a_scale", "strategy"),
    "scaled_matmul_reduce_scatter": ("a.shape[:-1]", "b.shape[1]", "out_dtype", "scatter_dim", "scale", "reduce_op",
                                     "strategy"),
    "all_gather": ("x.shape", "x.dtype", "gather_dim"),
    "reduce_scatter": ("x.shape", "x.dtype", "scatter_dim", "reduce_op"),
}


def _kind(strategy: str) -> str:
    return strategy if strategy in ("serial", "ring") else "auto|pipeline"


def _all_gather_matmul(a_shard, bs, dim, group, return_a, biases, strategy) -> tuple:
    return group, a_shard.device, (tuple(a_shard.shape), a_shard.dtype, dim, _kind(strategy))


def _all_gather_contract(x_shard, gs, gather_dim, group, strategy="auto") -> tuple:
    return group, x_shard.device, (tuple(x_shard.shape), x_shard.dtype, gather_dim % x_shard.ndim, _kind(strategy))


def _matmul_reduce_scatter(a_list, b_list, dim, group, reduce_op, bias, strategy) -> tuple:
    a = a_list[0]
    return group, a.device, (tuple(a.shape[:-1]), b_list[0].shape[1], a.dtype, dim, reduce_op, _kind(strategy))


def _scale_value(a_scale: torch.Tensor, rowwise: bool) -> Any:
    # a device read would be a host sync: on CUDA the scale comes from asynctp.float8's agreed amax
    return float(a_scale.reshape(())) if (not rowwise and a_scale.device.type == "cpu") else None


def _all_gather_scaled_matmul(a_shard, a_scale, checked, group, out_dtype, use_fast_accum, return_a, strategy,
                              return_scale=False) -> tuple:
    dim, rowwise = checked[0], checked[4]
    mode = "rowwise" if rowwise else "tensorwise"
    return group, a_shard.device, (tuple(a_shard.shape), a_shard.dtype, dim, mode, _scale_value(a_scale, rowwise),
                                   _kind(strategy))


def _scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, dim, rowwise, group, out_dtype, bias, reduce_op,
                                  use_fast_accum, strategy) -> tuple:
    mode = "rowwise" if rowwise else "tensorwise"
    return group, a.device, (tuple(a.shape[:-1]), b.shape[1], out_dtype, dim, mode, reduce_op, _kind(strategy))


def _all_gather(x, gather_dim, group_name) -> tuple:
    return group_name, x.device, (tuple(x.shape), x.dtype, gather_dim)


def _reduce_scatter(x, scatter_dim, group_name, reduce_op) -> tuple:
    return group_name, x.device, (tuple(x.shape), x.dtype, scatter_dim, reduce_op)


FIELDS = {
    "all_gather_matmul": _all_gather_matmul,
    "all_gather_contract": _all_gather_contract,
    "matmul_reduce_scatter": _matmul_reduce_scatter,
    "all_gather_scaled_matmul": _all_gather_scaled_matmul,
    "scaled_matmul_reduce_scatter": _scaled_matmul_reduce_scatter,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
}
