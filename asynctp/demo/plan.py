"""The demo model's tensor-parallel plans: vanilla sequence-parallel TP, and the same plan with the
column / row styles swapped for asynctp's (nothing else changes)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from asynctp.demo.model import Transformer
from asynctp.parallel import AsyncColwiseParallel, AsyncRowwiseParallel, SharedGather

__all__ = ["tp_plan", "parallelize"]


def tp_plan(
    num_layers: int, asynchronous: bool, float8: Any = None, save_gathered_input: bool = False, share_gathers: bool = True,
    strategy: str = "auto",
) -> dict[str, ParallelStyle]:
    """{module path: style} for Transformer: activations between blocks are [B, S / R, D]
    (sequence-sharded), norms run on sequence shards, linears gather / reduce-scatter the sequence.

    The output head leaves logits sharded over the vocabulary (loss_parallel computes the loss).
    save_gathered_input (async only): column-parallel layers keep their gathered input for the
    weight gradient, as vanilla TP does, instead of re-gathering it in backward.
    share_gathers (async only): wq / wk / wv, and w1 / w3, share one gather per block
    (SharedGather); False gathers once per linear, as the vanilla plan does.
    strategy (async only): the fused ops' strategy ("serial": the same ops, nothing overlapped).
    """
    if asynchronous:
        def colwise(shared_gather: SharedGather | None = None, **kw: Any) -> ParallelStyle:
            shared = shared_gather if share_gathers else None
            return AsyncColwiseParallel(**kw, float8=float8, save_gathered_input=save_gathered_input, shared_gather=shared,
                                        strategy=strategy)

        rowwise = lambda **kw: AsyncRowwiseParallel(**kw, float8=float8, strategy=strategy)  # noqa: E731
    else:
        if float8 is not None:
            raise ValueError(f"the vanilla plan requires float8=None (fp8 is asynctp's), got {float8!r}")
        rowwise = RowwiseParallel

        def colwise(shared_gather: SharedGather | None = None, **kw: Any) -> ParallelStyle:
            return ColwiseParallel(**kw)

    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": colwise(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(num_layers):
        block = f"layers.{i}"
        plan[f"{block}.attention_norm"] = SequenceParallel()
        plan[f"{block}.ffn_norm"] = SequenceParallel()
        for group in (("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3")):
            shared = SharedGather()  # one per block and input: the siblings read the same activation
            for name in group:
                plan[f"{block}.{name}"] = colwise(input_layouts=Shard(1), shared_gather=shared)
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"{block}.{name}"] = rowwise(output_layouts=Shard(1))
    return plan


def parallelize(
    model: Transformer, mesh: DeviceMesh, asynchronous: bool, float8: Any = None,
    save_gathered_input: bool = False, share_gathers: bool = True, strategy: str = "auto", src_data_rank: int | None = 0,
) -> nn.Module:
    """Shard `model` in place over the 1-D `mesh` with the vanilla or the async plan. src_data_rank:
    the rank whose parameters are scattered (None: each rank splits its own, as parallelize_module)."""
    model.cfg.check_tp(mesh.size())
    plan = tp_plan(model.cfg.num_layers, asynchronous, float8, save_gathered_input, share_gathers, strategy)
    return parallelize_module(model, mesh, plan, src_data_rank=src_data_rank)
