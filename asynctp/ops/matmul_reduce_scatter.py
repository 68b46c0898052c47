"""matmul_reduce_scatter: multiply, then reduce-scatter the product, with each rank's partial
chunk sent while the next one is computed (row-parallel linear with sequence parallelism)."""

from __future__ import annotations

from typing import Any

import torch

from asynctp.ops import graphs, guard, repeat
from asynctp.ops.dispatch import execute
from asynctp.ops.layout import ScatterLayout, matmul_rows, scatter_layout
from asynctp.ops.plan import make_plan
from asynctp.ops.reference import bias_chunk, matmul_reduce_scatter_serial
from asynctp.ops.strategy import eager_call_ok
from asynctp.ops.validate import check_matmul_reduce_scatter
from asynctp.runtime import kernel_path
from asynctp.runtime.graphs import tensor_key
from asynctp.runtime.transport import Transport
from asynctp.symm import Workspace, resolve_group

__all__ = ["matmul_reduce_scatter", "matmul_sum_reduce_scatter", "concat_terms"]


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
    return repeat.call(
        lambda: (("matmul_reduce_scatter", pg, tensor_key(a), tensor_key(b), scatter_dim, type(scatter_dim), reduce_op,
                  tensor_key(bias), strategy), (a, b, bias)),
        lambda: _full(a, b, scatter_dim, pg, reduce_op, bias, strategy))


def _full(a, b, scatter_dim, pg, reduce_op, bias, strategy):
    """The call with its checks and plan (repeat.call runs it where it cannot replay directly)."""
    dim = check_matmul_reduce_scatter(a, b, scatter_dim, pg.size(), reduce_op, bias, strategy)
    if eager_call_ok(a, b, bias):
        return _run_terms([a], [b], dim, pg, reduce_op, bias, strategy)
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
    return _run_terms([a], [b], dim, group, reduce_op, bias, strategy)


def matmul_sum_reduce_scatter(
    a_list: list[torch.Tensor],
    b_list: list[torch.Tensor],
    scatter_dim: int,
    group: Any,
    *,
    reduce_op: str = "sum",
    bias: torch.Tensor | None = None,
    strategy: str = "auto",
) -> torch.Tensor:
    """sum_i a_list[i] @ b_list[i], reduce-scattered: matmul_reduce_scatter of the concatenations
    (a's along K, b's along rows) without building them.

    Equivalent to::

        matmul_reduce_scatter(torch.cat(a_list, -1), torch.cat(b_list, 0), scatter_dim, group, ...)

    up to rounding: each term after the first is added into the partial by a GEMM with beta = 1,
    which rounds the partial to a's dtype once per term (the concatenated GEMM rounds once;
    vanilla TP's separate linears round each product and each sum of the input gradients).
    Why: the column-parallel linear's dgrad for weights sharing one gather (QKV, w1 + w3)
    concatenated both the output gradients and the weights every backward (2xH200, 8B-shaped
    block, batch 1: 0.9 ms of copies a step); the step time did not measurably change (A/B on
    one machine, docs/performance.md). The a's share every dim but the last; the
    b's are [K_i, N] with one N. Callers under torch.compile concatenate instead (inductor fuses
    the concatenation into its producers); under autograd or tracing this function does too.
    """
    if not isinstance(a_list, (list, tuple)) or not isinstance(b_list, (list, tuple)):
        raise TypeError(f"matmul_sum_reduce_scatter requires lists a_list and b_list, got "
                        f"{type(a_list).__name__} and {type(b_list).__name__}")
    if len(a_list) != len(b_list) or not a_list:
        raise ValueError(f"matmul_sum_reduce_scatter requires two non-empty lists of equal length, got "
                         f"{len(a_list)} and {len(b_list)} tensors")
    pg = resolve_group(group)
    dims = [check_matmul_reduce_scatter(a, b, scatter_dim, pg.size(), reduce_op, bias, strategy) for a, b in zip(a_list, b_list)]
    a0, b0 = a_list[0], b_list[0]
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        if a.shape[:-1] != a0.shape[:-1] or a.dtype != a0.dtype or a.device != a0.device:
            raise ValueError(f"a_list[{i}] requires shape (*{tuple(a0.shape[:-1])}, K), {a0.dtype} on {a0.device} "
                             f"like a_list[0], got {tuple(a.shape)}, {a.dtype} on {a.device}")
        if b.shape[1] != b0.shape[1]:
            raise ValueError(f"b_list[{i}] requires {b0.shape[1]} columns like b_list[0], got {tuple(b.shape)}")
    if not eager_call_ok(*a_list, *b_list, bias):
        a_cat, b_cat = concat_terms(a_list, b_list)
        return matmul_reduce_scatter(a_cat, b_cat, scatter_dim, pg, reduce_op=reduce_op, bias=bias, strategy=strategy)
    return _run_terms(list(a_list), list(b_list), dims[0], pg, reduce_op, bias, strategy)


def concat_terms(a_list: list[torch.Tensor], b_list: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The one matmul equal to sum_i a_list[i] @ b_list[i]: the a's concatenated along K, the b's
    along rows (a single term as it is, no copy)."""
    if len(a_list) == 1:
        return a_list[0], b_list[0]
    return torch.cat(list(a_list), dim=-1), torch.cat(list(b_list), dim=0)


@guard.agreed("matmul_reduce_scatter")
def _run_terms(a_list, b_list, dim, group, reduce_op, bias, strategy):
    """sum_i a_list[i] @ b_list[i], reduce-scattered, on validated arguments (dim normalized)."""
    a, b = a_list[0], b_list[0]
    if guard.enabled():
        meta = dict(a=a_list, b=b_list, bias=bias, scatter_dim=dim, reduce_op=reduce_op, strategy=strategy)
        guard.preflight("matmul_reduce_scatter", group, meta, [*a_list, *b_list, bias])
    world = group.size()
    k = sum(t.shape[0] for t in b_list)  # the concatenated problem's K: its tuned plan
    shape_key = (str(a.dtype).removeprefix("torch."), matmul_rows(a, dim, world, gather=False), b.shape[1], k)
    plan = make_plan("matmul_reduce_scatter", "matmul_reduce_scatter", strategy, group, a.device, shape_key)

    def serial() -> torch.Tensor:
        return matmul_reduce_scatter_serial([scatter_layout(t, dim, world) for t in a_list], b_list, reduce_op, bias, group)

    lays: list[ScatterLayout] = []

    def layouts() -> list[ScatterLayout]:  # made once, inside the graph cache's body (a copy may be captured)
        if not lays:
            lays.extend(scatter_layout(t, dim, world, batch_major=True) for t in a_list)
        return lays

    def decomposed(transport: Transport) -> torch.Tensor:
        return _decomposed(transport, layouts(), b_list, reduce_op, bias)

    def fused(ws: Workspace) -> torch.Tensor | None:
        return _fused(ws, layouts(), b_list, reduce_op, bias)

    def key() -> tuple:
        return ("matmul_reduce_scatter", *map(tensor_key, a_list), *map(tensor_key, b_list), tensor_key(bias), dim,
                reduce_op, plan.splits, plan.strategy, graphs.settings())

    return execute("matmul_reduce_scatter", plan, group, a.device, serial=serial, decomposed=decomposed, key=key,
                   fused=fused)


@_matmul_reduce_scatter_op.register_fake
def _(a, b, scatter_dim, group_name, reduce_op, bias, strategy):
    world_size = resolve_group(group_name).size()
    dim = check_matmul_reduce_scatter(a, b, scatter_dim, world_size, reduce_op, bias, strategy)
    lay = scatter_layout(a, dim, world_size)
    return lay.restore(a.new_empty(lay.chunk_shape(b.shape[1])))


def _fused(ws: Workspace, lays: list[ScatterLayout], bs: list[torch.Tensor], reduce_op: str,
           bias: torch.Tensor | None) -> torch.Tensor | None:
    """The single-launch GEMM where it serves the call (one term), else None."""
    lay = lays[0]
    if len(bs) != 1 or kernel_path.scatter_available(ws, lay.a_2d, bs[0].shape[1], lay.segment, lay.n_mode) is not None:
        return None
    bias_n = None if bias is None else bias_chunk(lay, bias, ws.rank)
    return lay.restore(kernel_path.matmul_scatter(ws, lay.a_2d, bs[0], reduce_op, bias_n, segment=lay.segment))


def _decomposed(
    transport: Transport, lays: list[ScatterLayout], bs: list[torch.Tensor], reduce_op: str, bias: torch.Tensor | None,
) -> torch.Tensor:
    """lays[i] @ bs[i] summed (one term: a plain matmul), reduce-scattered over the transport; the
    layouts share their row structure (same leading shape and dim)."""
    world, rank = transport.world_size, transport.rank
    lay = lays[0]
    n = bs[0].shape[1] // world

    def produce(dst: int, lo: int, hi: int, out: torch.Tensor, acc: torch.Tensor | None) -> None:
        if lay.n_mode:
            runs, b_cols = [(0, lo, hi - lo)], [b[:, dst * n : (dst + 1) * n] for b in bs]
        else:
            runs, b_cols = lay.a_runs(dst, lo, hi), bs  # one run, or one per leading index (batch-major)
        for off, row, count in runs:
            o = out[off : off + count]
            first = lay.a_2d[row : row + count]
            if acc is None:
                torch.mm(first, b_cols[0], out=o)
            else:
                torch.addmm(acc[off : off + count], first, b_cols[0], out=o)
            for lay_i, b_i in zip(lays[1:], b_cols[1:]):
                o.addmm_(lay_i.a_2d[row : row + count], b_i)

    out = transport.reduce_scatter(produce, lay.chunk_shape(bs[0].shape[1]), lay.a_2d.dtype, reduce_op, fused_acc=True)
    if bias is not None:
        out.add_(bias_chunk(lay, bias, rank))
    return lay.restore(out)
