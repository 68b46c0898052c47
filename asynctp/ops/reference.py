"""The serial reference: one plain collective, then the matmul. It defines the ops' semantics and
is strategy="serial" (NCCL/gloo + cuBLAS/CPU BLAS)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from asynctp.ops.layout import GatherLayout, ScatterLayout
from asynctp.runtime.collective import all_gather_rows, reduce_scatter_rows

__all__ = [
    "matmul_bias",
    "all_gather_matmul_serial",
    "matmul_reduce_scatter_serial",
    "reduce_scatter_product",
    "divide_for_avg",
    "bias_chunk",
]


def matmul_bias(a_2d: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None):
    """a_2d @ b (+ bias, added inside the GEMM as nn.Linear does)."""
    if bias is None:
        return torch.mm(a_2d, b, out=out)
    return torch.addmm(bias, a_2d, b, out=out)


def all_gather_matmul_serial(
    lay: GatherLayout,
    bs: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    group: dist.ProcessGroup,
    return_a: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    rows = lay.new_rows(lay.shard_2d.shape[1])
    all_gather_rows(rows, lay.shard_2d, group)
    a_gathered = lay.a_gathered(rows)
    if lay.k_mode:
        a_2d = a_gathered.view(lay.m, -1)
        outs = [lay.restore(matmul_bias(a_2d, b, bias)) for b, bias in zip(bs, biases)]
    else:
        outs = [lay.restore(matmul_bias(rows, b, bias)) for b, bias in zip(bs, biases)]
    return (a_gathered if return_a else None), outs


def divide_for_avg(out: torch.Tensor, reduce_op: str, world_size: int) -> torch.Tensor:
    return out.div_(world_size) if reduce_op == "avg" else out


def matmul_reduce_scatter_serial(
    lays: list[ScatterLayout],
    bs: list[torch.Tensor],
    reduce_op: str,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """reduce_scatter(sum_i lays[i].a_2d @ bs[i]): one term is the plain matmul; each further
    term is added into the product by a GEMM with beta = 1 (matmul_sum_reduce_scatter)."""
    full = torch.mm(lays[0].a_2d, bs[0])
    for lay, b in zip(lays[1:], bs[1:]):
        full.addmm_(lay.a_2d, b)
    return reduce_scatter_product(lays[0], full, reduce_op, bias, group)


def reduce_scatter_product(
    lay: ScatterLayout, full: torch.Tensor, reduce_op: str, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """The serial tail shared by the bf16 and fp8 references: reduce_scatter the 2-D product
    (sum; avg divides after), then add the bias once."""
    world, rank = lay.world_size, group.rank()
    out = full.new_empty(lay.chunk_shape(full.shape[1]))
    if lay.n_mode:
        m, n = full.shape[0], full.shape[1] // world
        full = full.view(m, world, n).transpose(0, 1).reshape(world * m, n)
    # gloo has no AVG: sum, then divide (NCCL's AVG rounds the same way for R = 2)
    reduce_scatter_rows(out, full, group)
    divide_for_avg(out, reduce_op, world)
    if bias is not None:
        out.add_(bias_chunk(lay, bias, rank))
    return lay.restore(out)


def bias_chunk(lay: ScatterLayout, bias: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of a (N,) bias that lands on this rank's output chunk."""
    if not lay.n_mode:
        return bias
    n = bias.shape[0] // lay.world_size
    return bias[rank * n : (rank + 1) * n]
