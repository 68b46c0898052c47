"""all_gather_linear: the column-parallel linear with sequence parallelism, as an autograd function
whose forward and backward both overlap their communication with matmuls.

Shape legend (R = world size, gather dim g, here the sequence dim of [B, S, D] activations):
    x_shard     [B, S / R, K]     this rank's slice of the sequence
    weight_i    [N_i, K]          this rank's rows of an nn.Linear weight (its output features)
    out_i       [B, S, N_i]       x_gathered @ weight_i.t() + bias_i, every token, local features

    forward   out_i = all_gather_matmul(x_shard, [w_i.t()...])        one gather for every weight
    dgrad     grad_x_shard = reduce_scatter(sum_i grad_out_i @ w_i) (matmul_sum_reduce_scatter, g)   one collective
    wgrad     grad_w_i = grad_out_i^T @ x_gathered: x re-gathered by all_gather_contract (the
              gather overlapped with the wgrad matmuls, each block of x times the matching rows
              of grad_out_i, fp32 accumulation, [N_i, K] results: no transposed copies), or saved
              from the forward (save_gathered_input=True: R times the memory of x_shard, no
              second gather). For a gather along K: all_gather_matmul.

Saved for backward: x_shard (or a fresh x_gathered) and the weights; never a workspace view.
"""

from __future__ import annotations

from typing import Any

import torch

from asynctp.nn.precision import Float8Matmuls, resolve_float8
from asynctp.nn.fused import gather_contract, gather_matmul, matmul_sum_scatter
from asynctp.ops.matmul_reduce_scatter import concat_terms
from asynctp.symm import resolve_group

__all__ = ["all_gather_linear", "run_all_gather_linear"]


def all_gather_linear(
    x_shard: torch.Tensor,
    weight: torch.Tensor | list[torch.Tensor],
    bias: torch.Tensor | list[torch.Tensor | None] | None = None,
    *,
    group: Any,
    gather_dim: int = 0,
    float8: Any = None,
    save_gathered_input: bool = False,
    strategy: str = "auto",
) -> torch.Tensor | list[torch.Tensor]:
    """All-gather `x_shard` along `gather_dim`, then apply one or several linears (autograd).

    Equivalent to the following plain PyTorch code::

        x = torch.cat(all_gather(x_shard, group), dim=gather_dim)
        return F.linear(x, weight, bias)            # or [F.linear(x, w, b) for w, b in ...]

    weight: an nn.Linear weight (N, K), this rank's shard, or a list of them sharing one gather
    (fused QKV, w1 + w3; the result is then a list). bias: None, a tensor (N,), or a list with
    one entry (tensor or None) per weight. gather_dim may be any dim of x_shard, the last too
    (then K = R * x_shard.shape[-1]). float8: None or a recipe from asynctp.float8 (or its name,
    "rowwise" / "tensorwise"): forward and dgrad matmuls in fp8, wgrad in x_shard's dtype.
    The gradient of x_shard is the full gradient of this rank's shard (reduce-scattered over
    the group); weight and bias gradients are those of the local shards. save_gathered_input: keep the gathered input for wgrad instead of re-gathering it.
    """
    pg = resolve_group(group)
    return run_all_gather_linear(
        pg.group_name, pg.size(), x_shard, weight, bias, gather_dim=gather_dim,
        float8=resolve_float8(float8), save_gathered_input=save_gathered_input, strategy=strategy,
    )


def run_all_gather_linear(
    group_name: str,
    world_size: int,
    x_shard: torch.Tensor,
    weight: torch.Tensor | list[torch.Tensor],
    bias: torch.Tensor | list[torch.Tensor | None] | None,
    *,
    gather_dim: int,
    float8: Float8Matmuls | None,
    save_gathered_input: bool,
    strategy: str,
) -> torch.Tensor | list[torch.Tensor]:
    """all_gather_linear with the group and the fp8 recipe already resolved (asynctp.parallel
    resolves them once at parallelize time: no process-group lookup in a compiled forward)."""
    weights, biases, is_list = _as_lists(weight, bias)
    dim = _check(x_shard, weights, biases, gather_dim, world_size)
    if not isinstance(save_gathered_input, bool):
        raise TypeError(f"save_gathered_input requires a bool, got {type(save_gathered_input).__name__}")
    if save_gathered_input and float8 is not None:
        raise ValueError("save_gathered_input=True requires float8=None (the fp8 forward gathers fp8 data), got a recipe")
    outs = _AllGatherLinear.apply(group_name, dim, len(weights), save_gathered_input, strategy, float8, x_shard, *weights, *biases)
    return list(outs) if is_list else outs[0]


class _Config:
    """What backward needs besides tensors."""

    def __init__(self, group_name: str, dim: int, num_weights: int, save_gathered: bool, strategy: str, float8) -> None:
        self.group_name = group_name
        self.dim = dim
        self.num_weights = num_weights
        self.save_gathered = save_gathered
        self.strategy = strategy
        self.float8: Float8Matmuls | None = float8


def _as_lists(weight: Any, bias: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None], bool]:
    is_list = isinstance(weight, (list, tuple))
    weights = list(weight) if is_list else [weight]
    if not weights:
        raise ValueError("weight requires at least one (N, K) tensor, got an empty list")
    if bias is None:
        biases: list[torch.Tensor | None] = [None] * len(weights)
    elif isinstance(bias, (list, tuple)):
        biases = list(bias)
    else:
        biases = [bias]
    if len(biases) != len(weights):
        raise ValueError(f"bias requires one entry per weight ({len(weights)}), got {len(biases)}")
    return weights, biases, is_list


def _check(x_shard: Any, weights: list, biases: list, gather_dim: Any, world_size: int) -> int:
    if not isinstance(x_shard, torch.Tensor) or x_shard.ndim < 2:
        got = tuple(x_shard.shape) if isinstance(x_shard, torch.Tensor) else type(x_shard).__name__
        raise ValueError(f"x_shard requires a tensor with at least 2 dims, got {got}")
    if isinstance(gather_dim, bool) or not isinstance(gather_dim, int):
        raise TypeError(f"gather_dim requires an int, got {type(gather_dim).__name__}")
    if not -x_shard.ndim <= gather_dim < x_shard.ndim:
        raise ValueError(f"gather_dim requires a dim in [{-x_shard.ndim}, {x_shard.ndim - 1}], got {gather_dim}")
    dim = gather_dim % x_shard.ndim
    k = x_shard.shape[-1] * (world_size if dim == x_shard.ndim - 1 else 1)
    for i, (w, b) in enumerate(zip(weights, biases)):
        if not isinstance(w, torch.Tensor) or w.ndim != 2 or w.shape[1] != k:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"weight[{i}] requires an nn.Linear weight of shape (N, {k}), got {got}")
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[0],)):
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"bias[{i}] requires shape ({w.shape[0]},), got {got}")
    return dim


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group_name: str, dim: int, num_weights: int, save_gathered: bool, strategy: str,
        float8: Float8Matmuls | None, x_shard: torch.Tensor, *params: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        config = _Config(group_name, dim, num_weights, save_gathered, strategy, float8)
        weights = list(params[: config.num_weights])
        biases = list(params[config.num_weights :])
        return_a = config.save_gathered
        if config.float8 is not None:
            x_gathered, outs = config.float8.all_gather_linear(x_shard, weights, biases, config)
        else:
            x_gathered, outs = gather_matmul(x_shard, [w.t() for w in weights], dim, group_name, return_a, biases, strategy)
        ctx.config = config
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x_gathered if return_a else x_shard, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        config: _Config = ctx.config
        x_saved, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = _dgrad(config, grad_outs, weights) if needs[6] else None
        num = config.num_weights
        want_w = any(needs[7 : 7 + num])
        grad_ws = _wgrad(config, x_saved, grad_outs) if want_w else [None] * num
        grad_bs = [
            g.reshape(-1, g.shape[-1]).sum(0) if has and needs[7 + num + i] else None
            for i, (g, has) in enumerate(zip(grad_outs, ctx.has_bias))
        ]
        return (None,) * 6 + (grad_x, *grad_ws, *grad_bs)


def _dgrad(config: _Config, grad_outs: tuple[torch.Tensor, ...], weights: list[torch.Tensor]) -> torch.Tensor:
    """grad_x_shard = reduce_scatter(sum_i grad_out_i @ w_i): one collective for all weights
    (bf16: each term's GEMM accumulates into the partial, no concatenated copies; fp8: the
    concatenation is quantized as one matrix)."""
    if config.float8 is not None:
        return config.float8.dgrad_reduce_scatter(*concat_terms(grad_outs, weights), config)
    return matmul_sum_scatter(list(grad_outs), weights, config.dim, config.group_name, config.strategy)


def _wgrad(config: _Config, x_saved: torch.Tensor, grad_outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """grad_w_i = grad_out_i^T @ x_gathered, [N_i, K] each."""
    if config.save_gathered:
        x_2d = x_saved.reshape(-1, x_saved.shape[-1])
        return [g.reshape(-1, g.shape[-1]).t() @ x_2d for g in grad_outs]
    x_shard, dim = x_saved, config.dim
    if dim != x_shard.ndim - 1:
        # x re-gathered along rows, each block contracted with the matching grad rows into [N_i, K]
        return gather_contract(x_shard, list(grad_outs), dim, config.group_name, config.strategy)
    # x gathered along K: x_gathered^T [K, M] stacks the ranks' [k, M] blocks (row mode); the
    # [K, N_i] products are transposed back
    x_t = x_shard.reshape(-1, x_shard.shape[-1]).t()
    grads_2d = [g.reshape(-1, g.shape[-1]) for g in grad_outs]
    _, wgrads_t = gather_matmul(x_t, grads_2d, 0, config.group_name, False, [None] * len(grads_2d), config.strategy)
    return [w.t() for w in wgrads_t]
