"""The group's own collectives (NCCL, gloo) under this torch's current names: the serial
reference's all-gather and reduce-scatter, and the ring's side data."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_rows", "reduce_scatter_rows"]

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning per call)
# for the *_single names, which older torch lacks: take whichever this torch has, without warning
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """dist.all_gather_into_tensor(out, shard, group=group), under this torch's current name."""
    _ALL_GATHER(out, shard, group=group)


def reduce_scatter_rows(out: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup) -> None:
    """dist.reduce_scatter_tensor(out, rows, op=SUM, group=group), under this torch's current name."""
    _REDUCE_SCATTER(out, rows, op=dist.ReduceOp.SUM, group=group)
