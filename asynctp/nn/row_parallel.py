"""linear_reduce_scatter: the row-parallel linear with sequence parallelism, as an autograd function
whose forward and backward both overlap their communication with matmuls.

Shape legend (R = world size, scatter dim s, here the sequence dim of [B, S, D] activations):
    x              [B, S, K]         every token, this rank's slice of the input features
    weight         [N, K]            this rank's columns of an nn.Linear weight
    out_shard      [B, S / R, N]     reduce_scatter(x @ weight.t()) + bias, this rank's tokens

    forward   out_shard = matmul_reduce_scatter(x, weight.t(), s, bias=bias)
    dgrad     grad_gathered, grad_x = all_gather_matmul(grad_out_shard, [weight], s, return_a=True)
    wgrad     grad_weight = grad_gathered^T @ x; grad_bias = grad_gathered summed over tokens
              (the full gradient of the replicated bias, identical on every rank: no extra
              collective)

Saved for backward: x and weight, the caller's tensors; never a workspace view.
"""

from __future__ import annotations

from typing import Any

import torch

from asynctp.nn.precision import Float8Matmuls, resolve_float8
from asynctp.nn.fused import gather_matmul, matmul_scatter
from asynctp.symm import resolve_group

__all__ = ["linear_reduce_scatter", "run_linear_reduce_scatter"]


def linear_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: Any,
    scatter_dim: int = 0,
    float8: Any = None,
    strategy: str = "auto",
) -> torch.Tensor:
    """Apply a row-parallel linear, sum over ranks and keep this rank's chunk (autograd).

    Equivalent to the following plain PyTorch code::

        partial = x @ weight.t()                          # [..., S, ..., N]
        out = reduce_scatter(partial, scatter_dim, group) + bias

    weight: an nn.Linear weight (N, K), this rank's shard of its input features; bias (N,),
    replicated, added once after the reduction (its gradient is the full one, the same on every
    rank). scatter_dim may be any dim of x, the last one too (then the output features are
    scattered and N must divide by R). float8: None or a recipe from asynctp.float8 (or its name).
    """
    pg = resolve_group(group)
    return run_linear_reduce_scatter(
        pg.group_name, pg.size(), x, weight, bias, scatter_dim=scatter_dim, float8=resolve_float8(float8), strategy=strategy
    )


def run_linear_reduce_scatter(
    group_name: str,
    world_size: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    scatter_dim: int,
    float8: Float8Matmuls | None,
    strategy: str,
) -> torch.Tensor:
    """linear_reduce_scatter with the group and the fp8 recipe already resolved (asynctp.parallel
    resolves them once at parallelize time: no process-group lookup in a compiled forward)."""
    dim = _check(x, weight, bias, scatter_dim, world_size)
    return _LinearReduceScatter.apply(group_name, dim, strategy, float8, x, weight, bias)


class _Config:
    def __init__(self, group_name: str, dim: int, strategy: str, float8) -> None:
        self.group_name = group_name
        self.dim = dim
        self.strategy = strategy
        self.float8: Float8Matmuls | None = float8


def _check(x: Any, weight: Any, bias: Any, scatter_dim: Any, world_size: int) -> int:
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x requires a tensor with at least 2 dims, got {got}")
    if isinstance(scatter_dim, bool) or not isinstance(scatter_dim, int):
        raise TypeError(f"scatter_dim requires an int, got {type(scatter_dim).__name__}")
    if not -x.ndim <= scatter_dim < x.ndim:
        raise ValueError(f"scatter_dim requires a dim in [{-x.ndim}, {x.ndim - 1}], got {scatter_dim}")
    k = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[1] != k:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight requires an nn.Linear weight of shape (N, {k}), got {got}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias requires shape ({weight.shape[0]},), got {got}")
    dim = scatter_dim % x.ndim
    size = weight.shape[0] if dim == x.ndim - 1 else x.shape[dim]
    if size % world_size:
        raise ValueError(f"scatter_dim {scatter_dim} requires a size divisible by the world size {world_size}, got {size}")
    return dim


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group_name: str, dim: int, strategy: str, float8: Float8Matmuls | None,
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    ) -> torch.Tensor:
        config = _Config(group_name, dim, strategy, float8)
        if config.float8 is not None:
            out = config.float8.linear_reduce_scatter(x, weight, bias, config)
        else:
            out = matmul_scatter(x, weight.t(), dim, group_name, bias, strategy)
        ctx.config = config
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out_shard: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        config: _Config = ctx.config
        x, weight = ctx.saved_tensors
        if config.float8 is not None:
            grad_gathered, grad_x = config.float8.dgrad_all_gather(grad_out_shard, weight, config)
        else:
            grad_gathered, (grad_x,) = gather_matmul(
                grad_out_shard, [weight], config.dim, config.group_name, True, [None], config.strategy
            )
        grad_2d = grad_gathered.reshape(-1, grad_gathered.shape[-1])
        needs = ctx.needs_input_grad
        grad_w = grad_2d.t() @ x.reshape(-1, x.shape[-1]) if needs[5] else None
        grad_b = grad_2d.sum(0) if ctx.has_bias and needs[6] else None
        return None, None, None, None, grad_x if needs[4] else None, grad_w, grad_b
