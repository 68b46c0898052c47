"""AsyncRowwiseParallel: torch's RowwiseParallel with a sequence-sharded output, served by
linear_reduce_scatter (the reduce-scatter overlapped with the matmul, forward and backward)."""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_module
from torch.distributed.tensor.parallel import RowwiseParallel

from asynctp.nn.row_parallel import run_linear_reduce_scatter
from asynctp.nn.precision import resolve_float8
from asynctp.parallel.placement import check_linear, check_shard, tensor_dim, to_local_input, tp_group

__all__ = ["AsyncRowwiseParallel"]


class AsyncRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output reduce-scatter overlaps the matmul (and whose backward
    overlaps the all-gather of the output gradient with the input-gradient matmul).

    Shape legend: x [B, S, K / R] (input sharded on its last dim), weight shard [D, K / R],
    out_shard [B, S / R, D] (output_layouts=Shard(1)). The bias stays replicated.

    Keyword Args:
        input_layouts: as RowwiseParallel (default Shard(-1), what a column-parallel layer gives).
        output_layouts: Shard(d), the dim the summed output is scattered along (Shard(1) for
            [batch, seq, hidden]). Required: a replicated output needs an all-reduce, which has no
            matmul after it to overlap.
        use_local_output: return a plain tensor (default) or a DTensor sharded on that dim.
        float8: None or an asynctp.float8 recipe (or its name) for the forward and dgrad matmuls.
        strategy: passed to the fused ops ("auto", "serial", "pipeline").
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        float8: Any = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.float8 = float8
        self.strategy = strategy

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        check_linear(name, module, device_mesh)
        scatter = "the dim the summed output is reduce-scattered along; use RowwiseParallel for a replicated output"
        check_shard(name, "output_layouts", self.output_layouts[0], scatter)
        resolve_float8(self.float8)  # a missing fp8 module fails here, not at the first forward
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.forward = types.MethodType(_make_forward(self, device_mesh), module)
        return module


def _make_forward(style: AsyncRowwiseParallel, mesh: DeviceMesh):
    group = tp_group(mesh)
    group_name, world_size = group.group_name, group.size()
    input_placement = style.input_layouts[0]
    output_dim = style.output_layouts[0].dim
    use_local_output = style.use_local_output
    options = dict(float8=resolve_float8(style.float8, keep_buffers=True), strategy=style.strategy)

    def forward(module: nn.Linear, x: Any) -> Any:
        if not isinstance(x, DTensor) and input_placement != Shard(-1):
            x = DTensor.from_local(x, mesh, (input_placement,), run_check=False)
        x_local = to_local_input(x, mesh, Shard(-1))
        weight = module.weight.to_local()
        bias = module.bias.to_local() if module.bias is not None else None
        dim = tensor_dim(output_dim, x_local.ndim)
        out = run_linear_reduce_scatter(group_name, world_size, x_local, weight, bias, scatter_dim=dim, **options)
        if use_local_output:
            return out
        return DTensor.from_local(out, mesh, (Shard(dim),), run_check=False)

    return forward
