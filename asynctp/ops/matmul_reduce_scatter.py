"""matmul_reduce_scatter: multiply, then reduce-scatter the product, with each rank's partial
chunk sent while the next one is computed (row-parallel linear with sequence parallelism)."""

from __future__ import annotations

from typing import Any

import torch

from asynctp.ops import graphs, guard
from asynctp.ops.graphs import tensor_key
from asynctp.ops.layout import ScatterLayout, matmul_rows, scatter_layout
from asynctp.ops.pipeline import produce_and_reduce_scatter
from asynctp.ops.ring import ring_produce_and_reduce_scatter
from asynctp.ops.reference import bias_chunk, matmul_reduce_scatter_serial
from asynctp.ops.strategy import choose, eager_call_ok
from asynctp.ops.tuning import plan_for
from asynctp.ops.validate import check_matmul_reduce_scatter
from asynctp.symm import Workspace, resolve_group

__all__ = ["matmul_reduce_scatter"]


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    group: Any,
    *,
    reduce_op: str = "sum",
    bias: torch.Tensor | None = None,
    strategy: str = "auto",
) -> torch.Tensor:
    """Multiply, reduce over ranks, keep this rank's chunk along `scatter_dim`.

    Equivalent to the following plain PyTorch code::

        partial = a @ b                                   # [..., S, ..., N]
        out = reduce_scatter(partial, scatter_dim, reduce_op, group)
        return out + bias (this rank's slice of it when scatter_dim is the last dim)

    Shapes: a [..., S, ..., K] (any dim may be the scatter dim, the last one too: then b's
    columns are scattered); b [K, N]; bias [N], added once after the reduction. The scattered
    size must be divisible by the world size R. The reduction accumulates in fp32 and rounds
    once. The result never aliases a shared buffer.

    strategy: "auto" (measured per shape), "serial" (matmul then collective), "pipeline"
    (each rank's partial pushed over the symmetric workspace while the next is computed).
    """
    pg = resolve_group(group)
    dim = check_matmul_reduce_scatter(a, b, scatter_dim, pg.size(), reduce_op, bias, strategy)
    if eager_call_ok(a, b, bias):
        return _run(a, b, dim, pg, reduce_op, bias, strategy)
    return torch.ops.asynctp.matmul_reduce_scatter(a, b, scatter_dim, pg.group_name, reduce_op, bias, strategy)


@torch.library.custom_op(
    "asynctp::matmul_reduce_scatter",
    mutates_args=(),
    schema="(Tensor a, Tensor b, int scatter_dim, str group_name, str reduce_op, Tensor? bias, "
    "str strategy) -> Tensor",
)
def _matmul_reduce_scatter_op(a, b, scatter_dim, group_name, reduce_op, bias, strategy):
    group = resolve_group(group_name)
    dim = check_matmul_reduce_scatter(a, b, scatter_dim, group.size(), reduce_op, bias, strategy)
    return _run(a, b, dim, group, reduce_op, bias, strategy)


def _run(a, b, dim, group, reduce_op, bias, strategy):
    """The implementation, on validated arguments (dim normalized)."""
    if guard.enabled():
        meta = dict(a=a, b=b, bias=bias, scatter_dim=dim, reduce_op=reduce_op, strategy=strategy)
        guard.preflight("matmul_reduce_scatter", group, meta, [a, b, bias])
    world = group.size()
    shape_key = (str(a.dtype).removeprefix("torch."), matmul_rows(a, dim, world, gather=False), b.shape[1], b.shape[0])
    chosen, ws = choose("matmul_reduce_scatter", strategy, group, a.device, shape_key)
    if chosen == "serial":
        return matmul_reduce_scatter_serial(scatter_layout(a, dim, world), b, reduce_op, bias, group)
    if chosen == "ring":
        return _pipelined(group, scatter_layout(a, dim, world, batch_major=True), b, reduce_op, bias, 1, ring=True)
    ws.op = "matmul_reduce_scatter"
    splits, _ = plan_for("matmul_reduce_scatter", shape_key, ws.world_size)

    def body():
        return _pipelined(ws, scatter_layout(a, dim, world, batch_major=True), b, reduce_op, bias, splits)

    key = ("matmul_reduce_scatter", tensor_key(a), tensor_key(b), tensor_key(bias), dim, reduce_op, splits,
           graphs.settings())
    return graphs.call(ws, key, body)


@_matmul_reduce_scatter_op.register_fake
def _(a, b, scatter_dim, group_name, reduce_op, bias, strategy):
    world_size = resolve_group(group_name).size()
    dim = check_matmul_reduce_scatter(a, b, scatter_dim, world_size, reduce_op, bias, strategy)
    lay = scatter_layout(a, dim, world_size)
    return lay.restore(a.new_empty(lay.chunk_shape(b.shape[1])))


def _pipelined(
    ws: Workspace | Any, lay: ScatterLayout, b: torch.Tensor, reduce_op: str, bias: torch.Tensor | None,
    splits: int, ring: bool = False,
) -> torch.Tensor:
    """ws: the workspace, or the process group when ring=True."""
    world, rank = (ws.size(), ws.rank()) if ring else (ws.world_size, ws.rank)
    n = b.shape[1] // world

    def produce(dst: int, lo: int, hi: int, out: torch.Tensor, acc: torch.Tensor | None) -> None:
        if lay.n_mode:
            runs, b_cols = [(0, lo, hi - lo)], b[:, dst * n : (dst + 1) * n]
        else:
            runs, b_cols = lay.a_runs(dst, lo, hi), b  # one run, or one per leading index (batch-major)
        for off, row, count in runs:
            a_rows, o = lay.a_2d[row : row + count], out[off : off + count]
            if acc is None:
                torch.mm(a_rows, b_cols, out=o)
            else:
                torch.addmm(acc[off : off + count], a_rows, b_cols, out=o)

    chunk_shape = lay.chunk_shape(b.shape[1])
    if ring:
        out = ring_produce_and_reduce_scatter(ws, produce, chunk_shape, lay.a_2d.dtype, lay.a_2d.device, reduce_op)
    else:
        out = produce_and_reduce_scatter(ws, produce, chunk_shape, lay.a_2d.dtype, reduce_op, splits=splits)
    if bias is not None:
        out.add_(bias_chunk(lay, bias, rank))
    return lay.restore(out)
