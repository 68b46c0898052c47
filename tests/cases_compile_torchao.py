"""Rank-side bodies for the torch.compile pass on torchao Float8Linear-converted models.

A sequence-parallel SwiGLU-like MLP (w1, w3 column-parallel, w2 row-parallel, bf16), converted
with torchao.float8.convert_to_float8_training (tensorwise or rowwise recipe) and parallelized
with DTensor styles: torchao's Float8ColwiseParallel / Float8RowwiseParallel (the activation is
cast to float8 before its gather: tensorwise only) or vanilla ColwiseParallel / RowwiseParallel
(gathered in bf16, cast after). Each variant is compiled by inductor with and without the pass;
the reference is always the vanilla-styles model compiled without the pass, since gloo cannot
all-gather float8 ("Invalid scalar type"): the float8-styles model runs only where the pass
fused all its gathers. Both style sets compute the same float8 values: a tensorwise scale is the
amax of the whole activation (amax of the gathered tensor, or the all-reduced amax of the
shards), and the elementwise cast commutes with the gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests import cases_compile as cc

DIM, HIDDEN = 32, 64  # per rank at world 2: K 32, N 32 (column-parallel), K 32 (row-parallel)


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)) * self.w3(x))


def build_mlp(recipe: str, float8_styles: bool) -> nn.Module:
    """TinyMLP (same weights on every rank and call), float8-converted, sequence-parallel on dim 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    torch.manual_seed(0)
    mlp = TinyMLP().to(torch.bfloat16)
    convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe_name(recipe))
    col, row = (Float8ColwiseParallel, Float8RowwiseParallel) if float8_styles else (ColwiseParallel, RowwiseParallel)
    plan = {"w1": col(input_layouts=Shard(1)), "w3": col(input_layouts=Shard(1)), "w2": row(output_layouts=Shard(1))}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(mlp, mesh, plan)


def run_mlp(mlp: nn.Module) -> dict[str, torch.Tensor]:
    """Loss and every local gradient (fp32) of one compiled forward/backward on this rank's shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(2, 8 * world, DIM, generator=g).to(torch.bfloat16)
    cotangent = torch.randn(2, 8 * world, DIM, generator=g).chunk(world, dim=1)[rank]
    x = x_full.chunk(world, dim=1)[rank].clone().requires_grad_()
    out = torch.compile(mlp)(x)
    loss = (out.float() * cotangent).sum()
    loss.backward()
    grads = {name: p.grad.to_local().float() for name, p in mlp.named_parameters()}
    grads["input"] = x.grad.float()
    grads["loss"] = loss.detach()
    return grads


def _records(report: Any) -> list[tuple[Any, ...]]:
    """(graph kind, collective kind, dim, fused op or None, matmuls, reason) per collective."""
    return [(g.kind, r.kind, r.dim, r.op if r.fused else None, r.num_matmuls, r.reason)
            for g in report.graphs for r in g.records]


def _max_rel_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |got - ref| / max |ref| per tensor."""
    return {name: ((got[name] - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for name, r in ref.items()}


def compiled_float8_variants(recipe: str, float8_styles: bool) -> dict[str, Any]:
    """Rank body: the reference (vanilla styles, no pass), then the model with the pass (float8 or
    vanilla styles); returns the fusion report's records and the relative errors against the
    reference. With float8 styles every collective must fuse (gloo would refuse an unfused float8
    gather with an error that names nothing); with vanilla styles some stay unfused by design."""
    import torch._dynamo

    import asynctp.compile

    torch._dynamo.reset()
    with cc.fresh_compiles():
        ref = run_mlp(build_mlp(recipe, float8_styles=False))
        torch._dynamo.reset()
        asynctp.compile.fusion_report(clear=True)
        with asynctp.compile.enabled(fail_if_unfused=float8_styles):
            got = run_mlp(build_mlp(recipe, float8_styles))
        torch._dynamo.reset()
    report = asynctp.compile.fusion_report(clear=True)
    return {"records": _records(report), "errors": _max_rel_errors(got, ref), "text": str(report)}
