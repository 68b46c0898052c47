"""Low-contention all_gather / reduce_scatter: collectives meant to run beside heavy compute
(e.g. FSDP's gathers beside TP matmuls). Bytes move on copy engines (per-peer copies over the
symmetric workspace, no SMs); the only SM work is reduce_scatter's single fused reduction pass.
Groups without a workspace use the group's own collective."""

from __future__ import annotations

from typing import Any

import torch

from asynctp.ops import guard
from asynctp.ops.layout import moved_back
from asynctp.ops.reference import divide_for_avg
from asynctp.ops.validate import REDUCE_OPS, check_dim, check_tensor
from asynctp.runtime.collective import all_gather_rows, reduce_scatter_rows
from asynctp.runtime.pipeline import gather_and_consume, produce_and_reduce_scatter
from asynctp.symm import get_workspace, resolve_group

__all__ = ["all_gather", "reduce_scatter"]


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    front = x.movedim(dim, 0) if dim else x
    return front.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1) if t.ndim > 1 else t.view(-1, 1)


def all_gather(x: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """Gather `x` from every rank along `gather_dim`.

    Equivalent to the following plain PyTorch code::

        torch.cat(all_gather(x, group), dim=gather_dim)

    The result is a fresh tensor (never a view of a shared buffer).
    """
    pg = resolve_group(group)
    check_tensor("x", x, min_ndim=1)
    dim = check_dim("gather_dim", gather_dim, x.ndim)
    return torch.ops.asynctp.all_gather(x, dim, pg.group_name)


@torch.library.custom_op("asynctp::all_gather", mutates_args=(), schema="(Tensor x, int gather_dim, str group_name) -> Tensor")
@guard.agreed("all_gather")
def _all_gather_op(x, gather_dim, group_name):
    pg = resolve_group(group_name)
    world = pg.size()
    front = _front(x, gather_dim)
    gathered = front.new_empty((world * front.shape[0], *front.shape[1:]))
    if x.numel() == 0:  # nothing to move (every rank agreed on the shape)
        return moved_back(gathered, gather_dim)
    ws = get_workspace(pg, x.device)
    if ws is None:
        all_gather_rows(gathered, front, pg)
    else:
        gather_and_consume(ws, [_rows(front)], [_rows(gathered)], lambda *_: None)
    return moved_back(gathered, gather_dim)


@_all_gather_op.register_fake
def _(x, gather_dim, group_name):
    world = resolve_group(group_name).size()
    front = _front(x, gather_dim)
    gathered = front.new_empty((world * front.shape[0], *front.shape[1:]))
    return moved_back(gathered, gather_dim)


def reduce_scatter(x: torch.Tensor, scatter_dim: int, group: Any, reduce_op: str = "sum") -> torch.Tensor:
    """Reduce `x` over ranks and keep this rank's chunk along `scatter_dim`.

    Equivalent to the following plain PyTorch code::

        reduce_scatter_tensor(x, scatter_dim, reduce_op, group)  # sum or avg, fp32 accumulation

    The size along scatter_dim must be divisible by the world size. Fresh result.
    """
    pg = resolve_group(group)
    check_tensor("x", x, min_ndim=1)
    dim = check_dim("scatter_dim", scatter_dim, x.ndim)
    if x.shape[dim] % pg.size():
        raise ValueError(
            f"scatter_dim {scatter_dim} requires a size divisible by the world size {pg.size()}, got {x.shape[dim]}"
        )
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op requires one of {list(REDUCE_OPS)}, got {reduce_op!r}")
    if not x.is_floating_point():
        raise TypeError(f"x requires a floating dtype (the reduction accumulates in fp32), got {x.dtype}")
    return torch.ops.asynctp.reduce_scatter(x, dim, pg.group_name, reduce_op)


@torch.library.custom_op(
    "asynctp::reduce_scatter", mutates_args=(), schema="(Tensor x, int scatter_dim, str group_name, str reduce_op) -> Tensor"
)
@guard.agreed("reduce_scatter")
def _reduce_scatter_op(x, scatter_dim, group_name, reduce_op):
    pg = resolve_group(group_name)
    world = pg.size()
    front = _front(x, scatter_dim)
    if x.numel() == 0:  # nothing to move or reduce (every rank agreed on the shape)
        return moved_back(front.new_empty((front.shape[0] // world, *front.shape[1:])), scatter_dim)
    rows = _rows(front)
    m = rows.shape[0] // world
    ws = get_workspace(pg, x.device)
    if ws is None:
        out = rows.new_empty((m, rows.shape[1]))
        reduce_scatter_rows(out, rows, pg)
        divide_for_avg(out, reduce_op, world)
    else:

        def produce(dst: int, lo: int, hi: int, out: torch.Tensor, acc: torch.Tensor | None) -> None:
            chunk = rows[dst * m + lo : dst * m + hi]
            if acc is None:
                out.copy_(chunk)
            else:
                torch.add(acc, chunk, out=out)

        out = produce_and_reduce_scatter(ws, produce, (m, rows.shape[1]), x.dtype, reduce_op)
    out = out.view(front.shape[0] // world, *front.shape[1:])
    return moved_back(out, scatter_dim)


@_reduce_scatter_op.register_fake
def _(x, scatter_dim, group_name, reduce_op):
    world = resolve_group(group_name).size()
    front = _front(x, scatter_dim)
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    return moved_back(out, scatter_dim)
