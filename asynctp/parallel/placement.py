"""What the async styles accept: a 1-D mesh, nn.Linear modules, and the placements that map onto
all_gather_linear / linear_reduce_scatter; checked at parallelize time, with the fix in the message."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

__all__ = ["check_linear", "check_shard", "tp_group", "to_local_input", "tensor_dim"]


def check_linear(style: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"{style} requires an nn.Linear module, got {type(module).__name__} "
            f"(embeddings have no matmul to overlap: use torch's ColwiseParallel / RowwiseParallel for them)"
        )
    if mesh.ndim != 1:
        raise ValueError(f"{style} requires a 1-D DeviceMesh (the tensor-parallel axis; slice it: mesh['tp']), got {mesh.ndim}-D")


def check_shard(style: str, argument: str, placement: Placement, why: str, last_only: bool = False) -> int:
    """The Shard dim of `placement`; ValueError for any other placement."""
    ok = isinstance(placement, Shard) and (not last_only or placement.dim == -1)
    if not ok:
        wanted = "Shard(-1)" if last_only else "Shard(d)"
        raise ValueError(f"{style} requires {argument}={wanted} ({why}), got {placement}")
    return placement.dim


def tp_group(mesh: DeviceMesh) -> Any:
    return mesh.get_group()


def tensor_dim(dim: int, ndim: int) -> int:
    return dim % ndim


def to_local_input(x: Any, mesh: DeviceMesh, placement: Placement) -> torch.Tensor:
    """This rank's shard of the module input: a plain tensor is taken as already laid out by
    `placement` (as torch's styles do); a DTensor is redistributed to it first if needed."""
    if not isinstance(x, DTensor):
        return x
    want = Shard(placement.dim % x.ndim) if isinstance(placement, Shard) else placement
    if tuple(x.placements) != (want,):
        x = x.redistribute(mesh, (want,))
    return x.to_local()
