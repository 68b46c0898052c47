"""The fused ops as the linears call them: through the public functions in eager mode (their
dispatcher-free fast path), straight through torch.ops.asynctp when torch.compile traces (the
public functions look the group up by name, which dynamo cannot trace)."""

from __future__ import annotations

import torch

from asynctp.ops import all_gather_matmul, matmul_reduce_scatter
from asynctp.ops.matmul_reduce_scatter import concat_terms, matmul_sum_reduce_scatter
from asynctp.ops.all_gather_matmul import all_gather_contract

__all__ = ["gather_matmul", "matmul_scatter", "matmul_sum_scatter", "gather_contract"]


def gather_matmul(
    a_shard: torch.Tensor, bs: list[torch.Tensor], dim: int, group_name: str, return_a: bool,
    biases: list[torch.Tensor | None], strategy: str,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    if torch.compiler.is_compiling():
        a_gathered, outs = torch.ops.asynctp.all_gather_matmul(a_shard, bs, dim, group_name, return_a, biases, strategy)
        return a_gathered, list(outs)
    return all_gather_matmul(a_shard, bs, dim, group_name, return_a=return_a, biases=biases, strategy=strategy)


def matmul_scatter(
    a: torch.Tensor, b: torch.Tensor, dim: int, group_name: str, bias: torch.Tensor | None, strategy: str
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.asynctp.matmul_reduce_scatter(a, b, dim, group_name, "sum", bias, strategy)
    return matmul_reduce_scatter(a, b, dim, group_name, bias=bias, strategy=strategy)


def matmul_sum_scatter(
    a_list: list[torch.Tensor], b_list: list[torch.Tensor], dim: int, group_name: str, strategy: str
) -> torch.Tensor:
    """sum_i a_list[i] @ b_list[i], reduce-scattered; traced as the concatenations' one op
    (inductor fuses the concatenation); eager calls add each term's GEMM into the partial."""
    if torch.compiler.is_compiling():
        return matmul_scatter(*concat_terms(a_list, b_list), dim, group_name, None, strategy)
    return matmul_sum_reduce_scatter(a_list, b_list, dim, group_name, strategy=strategy)


def gather_contract(
    x_shard: torch.Tensor, gs: list[torch.Tensor], dim: int, group_name: str, strategy: str
) -> list[torch.Tensor]:
    if torch.compiler.is_compiling():
        return list(torch.ops.asynctp.all_gather_contract(x_shard, gs, dim, group_name, strategy))
    return all_gather_contract(x_shard, gs, dim, group_name, strategy)
