"""all_gather_matmul: all-gather a sharded activation and multiply it by one or more matrices,
overlapping the gather with the matmuls (column-parallel linear with sequence parallelism)."""

from __future__ import annotations

from typing import Any

import torch

from asynctp.ops import graphs, guard, repeat
from asynctp.ops.dispatch import execute
from asynctp.runtime.graphs import tensor_key
from asynctp.ops.layout import GatherLayout, gather_layout, matmul_rows
from asynctp.ops.plan import make_plan
from asynctp.ops.reference import all_gather_matmul_serial, matmul_bias
from asynctp.ops.strategy import eager_call_ok
from asynctp.ops.validate import check_all_gather_matmul
from asynctp.runtime import kernel_path
from asynctp.runtime.collective import all_gather_rows
from asynctp.runtime.transport import Transport
from asynctp.symm import Workspace, resolve_group

__all__ = ["all_gather_matmul", "all_gather_contract"]


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    gather_dim: int,
    group: Any,
    *,
    return_a: bool = True,
    biases: list[torch.Tensor | None] | None = None,
    strategy: str = "auto",
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather `a_shard` along `gather_dim`, then multiply by each b in `bs`.

    Equivalent to the following plain PyTorch code::

        a_gathered = torch.cat(all_gather(a_shard, group), dim=gather_dim)
        outs = [a_gathered @ b + bias for b, bias in zip(bs, biases)]
        return (a_gathered if return_a else None), outs

    Shapes: a_shard [..., s, ..., K'] (any dim may be the gather dim, the last one too: then
    K = R * K' and each b is [K, N_i]); bs[i] [K, N_i] (nn.Linear weight.t()); biases[i] [N_i].
    Several bs share one gather (fused QKV, w1 + w3). Outputs never alias a shared buffer.

    strategy: "auto" (measured per shape), "serial" (collective then matmul), "pipeline"
    (each rank pushes its shard into its peers' symmetric buffers by copy engine, block by block;
    the matmuls read each block where it landed).
    """
    pg = resolve_group(group)
    return repeat.call(
        lambda: (("all_gather_matmul", pg, tensor_key(a_shard), tuple(map(tensor_key, bs)), gather_dim,
                  type(gather_dim), return_a, type(return_a), None if biases is None else tuple(map(tensor_key, biases)),
                  strategy),
                 (a_shard, *bs, *(biases or ()))),
        lambda: _full(a_shard, bs, gather_dim, pg, return_a, biases, strategy))


def _full(a_shard, bs, gather_dim, pg, return_a, biases, strategy):
    """The call with its checks and plan (repeat.call runs it where it cannot replay directly)."""
    dim, bs, biases = check_all_gather_matmul(a_shard, bs, gather_dim, pg.size(), biases, strategy)
    if not isinstance(return_a, bool):
        raise TypeError(f"return_a requires a bool, got {type(return_a).__name__}")
    if eager_call_ok(a_shard, *bs, *biases):
        return _run(a_shard, bs, dim, pg, return_a, biases, strategy)
    a_gathered, outs = torch.ops.asynctp.all_gather_matmul(
        a_shard, bs, gather_dim, pg.group_name, return_a, biases, strategy
    )
    return a_gathered, list(outs)


@torch.library.custom_op(
    "asynctp::all_gather_matmul",
    mutates_args=(),
    schema="(Tensor a_shard, Tensor[] bs, int gather_dim, str group_name, bool return_a, "
    "Tensor?[] biases, str strategy) -> (Tensor?, Tensor[])",
)
def _all_gather_matmul_op(a_shard, bs, gather_dim, group_name, return_a, biases, strategy):
    group = resolve_group(group_name)
    dim, bs, biases = check_all_gather_matmul(a_shard, bs, gather_dim, group.size(), biases, strategy)
    return _run(a_shard, bs, dim, group, return_a, biases, strategy)


@guard.agreed("all_gather_matmul")
def _run(a_shard, bs, dim, group, return_a, biases, strategy):
    """The implementation, on validated arguments (dim normalized)."""
    if guard.enabled():
        meta = dict(a_shard=a_shard, bs=bs, biases=biases, gather_dim=dim, return_a=return_a, strategy=strategy)
        guard.preflight("all_gather_matmul", group, meta, [a_shard, *bs, *biases])
    world = group.size()
    m_total = matmul_rows(a_shard, dim, world, gather=True)
    n_total = sum(b.shape[1] for b in bs)
    shape_key = (str(a_shard.dtype).removeprefix("torch."), m_total, n_total, bs[0].shape[0])
    plan = make_plan("all_gather_matmul", "all_gather_matmul", strategy, group, a_shard.device, shape_key)

    def serial() -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        return all_gather_matmul_serial(gather_layout(a_shard, dim, world), bs, biases, group, return_a)

    lays: list[GatherLayout] = []

    def layout() -> GatherLayout:  # made once, inside the graph cache's body (a copy may be captured)
        if not lays:
            lays.append(gather_layout(a_shard, dim, world, batch_major=True))
        return lays[0]

    def decomposed(transport: Transport) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        return _decomposed(transport, layout(), bs, biases, return_a)

    def fused(ws: Workspace) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        return _fused(ws, layout(), bs, biases, return_a)

    def key() -> tuple:
        return ("all_gather_matmul", tensor_key(a_shard), dim, tuple(map(tensor_key, bs)),
                tuple(map(tensor_key, biases)), return_a, plan.splits, plan.lockstep, plan.strategy, graphs.settings())

    return execute("all_gather_matmul", plan, group, a_shard.device, serial=serial, decomposed=decomposed, key=key,
                   fused=fused)


@_all_gather_matmul_op.register_fake
def _(a_shard, bs, gather_dim, group_name, return_a, biases, strategy):
    world_size = resolve_group(group_name).size()
    dim, bs, biases = check_all_gather_matmul(a_shard, bs, gather_dim, world_size, biases, strategy)
    lay = gather_layout(a_shard, dim, world_size)
    rows = lay.new_rows(lay.shard_2d.shape[1])
    if lay.k_mode:
        outs = [lay.restore(lay.shard_2d.new_empty((lay.m, b.shape[1]))) for b in bs]
    else:
        outs = [lay.restore(lay.new_rows(b.shape[1])) for b in bs]
    return (lay.a_gathered(rows) if return_a else None), outs


def _fused(ws: Workspace, lay: GatherLayout, bs: list[torch.Tensor], biases: list,
           return_a: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
    """The single-launch GEMM (runtime/kernel_path.py) where it serves the call, else None."""
    if kernel_path.gather_available(ws, lay.shard_2d, lay.segment, lay.k_mode, min(b.shape[1] for b in bs)) is not None:
        return None
    rows, out_rows = kernel_path.gather_matmul(ws, lay.shard_2d, bs, biases, segment=lay.segment,
                                               keep_gathered=return_a, runs=lay.gathered_runs)
    return (None if rows is None else lay.a_gathered(rows, placed=True)), [lay.restore(o) for o in out_rows]


def _decomposed(
    transport: Transport, lay: GatherLayout, bs: list[torch.Tensor], biases: list, return_a: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The gathered rows are materialized only for the caller; the workspace's push gather hands
    the consumer its blocks where they landed (the ring receives into rows it makes itself)."""
    rows = lay.new_rows(lay.shard_2d.shape[1]) if return_a else None
    if lay.k_mode:
        outs = _consume_k_blocks(transport, lay, rows, bs, biases)
    else:
        out_rows = [lay.new_rows(b.shape[1]) for b in bs]

        def consume(src: int, lo: int, blocks: list[torch.Tensor]) -> None:
            # one run of output rows, or one per leading index (batch-major)
            for off, row, count in lay.out_runs(src, lo, blocks[0].shape[0]):
                for out, b, bias in zip(out_rows, bs, biases):
                    matmul_bias(blocks[0][off : off + count], b, bias, out=out[row : row + count])

        transport.gather([lay.shard_2d], [rows], consume, alternate=True, lockstep=True, runs=lay.gathered_runs)
        outs = [lay.restore(o) for o in out_rows]
    return (lay.a_gathered(rows, placed=True) if return_a else None), outs


def _consume_k_blocks(
    transport: Transport, lay: GatherLayout, rows: torch.Tensor | None, bs: list[torch.Tensor], biases: list,
) -> list[torch.Tensor]:
    """Gather along K: rank r's block [M, k] multiplies rows r*k:(r+1)*k of b; products are
    accumulated in fp32 (one rounding at the end, with the bias, as one GEMM would)."""
    k = lay.shard_2d.shape[1]
    accs = _sums(lay.shard_2d, [(lay.m, b.shape[1]) for b in bs])

    def consume(src: int, lo: int, blocks: list[torch.Tensor]) -> None:
        hi = lo + blocks[0].shape[0]
        for acc, b in zip(accs, bs):
            _add_product(acc[lo:hi], blocks[0], b[src * k : (src + 1) * k])

    # one stream, no lockstep: the accumulators are shared by every step
    transport.gather([lay.shard_2d], [rows], consume, alternate=False, lockstep=False)
    outs = []
    for acc, bias in zip(accs, biases):
        if bias is not None:
            acc.add_(bias)
        outs.append(lay.restore(acc.to(lay.shard_2d.dtype)))
    return outs


# ---------------------------------------------------------------------- the wgrad contraction

@guard.agreed("all_gather_contract")
def all_gather_contract(
    x_shard: torch.Tensor, gs: list[torch.Tensor], gather_dim: int, group: Any, strategy: str = "auto",
) -> list[torch.Tensor]:
    """[g_i^T @ x_gathered for g_i in gs], x gathered along `gather_dim` (not the last dim), the
    contraction running over the gathered rows: the weight gradients of a column-parallel linear
    that re-gathers its input (x_shard [..., s, ..., K]; g_i [..., R * s, ..., N_i], the output
    gradient; result [N_i, K], contiguous, as nn.Linear's weight). Each arriving block of x is
    multiplied by the matching rows of every g_i (no transposed copy of x or of the result) and
    accumulated in fp32 (a float32 GEMM output on CUDA: one rounding at the end, as one GEMM
    would). Internal (asynctp.nn's backward): arguments are not validated beyond shapes."""
    pg = resolve_group(group)
    world = pg.size()
    dim = gather_dim % x_shard.ndim
    if dim == x_shard.ndim - 1:
        raise ValueError("all_gather_contract requires a gather dim other than the last (K)")
    for g in gs:
        if g.shape[:-1] != (*x_shard.shape[:dim], world * x_shard.shape[dim], *x_shard.shape[dim + 1 : -1]):
            raise ValueError(f"all_gather_contract requires g of shape (gathered x's rows, N), got {tuple(g.shape)} "
                             f"for x_shard {tuple(x_shard.shape)} over {world} ranks")
    k = x_shard.shape[-1]
    rows_total = matmul_rows(x_shard, dim, world, gather=True)
    shape_key = (str(x_shard.dtype).removeprefix("torch."), k, sum(g.shape[-1] for g in gs), rows_total)
    plan = make_plan("all_gather_matmul", "all_gather_matmul", strategy, pg, x_shard.device, shape_key)

    def serial() -> tuple[None, list[torch.Tensor]]:
        lay = gather_layout(x_shard, dim, world)
        rows = lay.new_rows(k)
        all_gather_rows(rows, lay.shard_2d, pg)
        return None, [torch.mm(_rows_like(g, lay).t(), rows) for g in gs]

    def decomposed(transport: Transport) -> tuple[None, list[torch.Tensor]]:  # (None, outputs): the graph cache's result shape
        return None, _contract(transport, gather_layout(x_shard, dim, world, batch_major=True), gs)

    def key() -> tuple:
        return ("all_gather_contract", tensor_key(x_shard), dim, tuple(map(tensor_key, gs)), plan.splits,
                graphs.settings())

    return execute("all_gather_contract", plan, pg, x_shard.device, serial=serial, decomposed=decomposed, key=key)[1]


@torch.library.custom_op(
    "asynctp::all_gather_contract",
    mutates_args=(),
    schema="(Tensor x_shard, Tensor[] gs, int gather_dim, str group_name, str strategy) -> Tensor[]",
)
def _all_gather_contract_op(x_shard, gs, gather_dim, group_name, strategy):
    """all_gather_contract for torch.compile (asynctp.nn's wgrad when traced)."""
    return all_gather_contract(x_shard, list(gs), gather_dim, group_name, strategy)


@_all_gather_contract_op.register_fake
def _(x_shard, gs, gather_dim, group_name, strategy):
    return [x_shard.new_empty((g.shape[-1], x_shard.shape[-1])) for g in gs]


def _rows_like(g: torch.Tensor, lay: GatherLayout) -> torch.Tensor:
    """g [..., R * s, ..., N] as 2-D rows in the order of lay's gathered rows (front order: the
    gather dim moved first, a copy when leading dims have more than one element; batch-major:
    the caller's order, no copy)."""
    if lay.segment or lay.dim == 0:
        return g.reshape(-1, g.shape[-1])
    return g.movedim(lay.dim, 0).reshape(-1, g.shape[-1])


def _contract(transport: Transport, lay: GatherLayout, gs: list[torch.Tensor]) -> list[torch.Tensor]:
    g_rows = [_rows_like(g, lay) for g in gs]
    k = lay.shard_2d.shape[1]
    accs = _sums(lay.shard_2d, [(g.shape[1], k) for g in g_rows])

    def consume(src: int, lo: int, blocks: list[torch.Tensor]) -> None:
        for off, row, count in lay.out_runs(src, lo, blocks[0].shape[0]):
            for acc, g in zip(accs, g_rows):
                _add_product(acc, g[row : row + count].t(), blocks[0][off : off + count])

    # one stream, no lockstep: the accumulators are shared by every step
    transport.gather([lay.shard_2d], [None], consume, alternate=False, lockstep=False)
    return [acc.to(lay.shard_2d.dtype) for acc in accs]


def _sums(like: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Zeroed sums of products of `like`'s dtype: float32 (float64 for float64)."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return [like.new_zeros(shape, dtype=dtype) for shape in shapes]


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b. On CUDA a bf16 / fp16 GEMM writes the float32 sum itself (one rounding at the
    end); elsewhere a product in a's dtype is added (rounded once more per block)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(torch.mm(a, b))
