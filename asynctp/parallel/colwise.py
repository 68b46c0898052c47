"""AsyncColwiseParallel: torch's ColwiseParallel for a sequence-sharded input, served by
all_gather_linear (the gather overlapped with the matmul, forward and backward)."""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

from asynctp.nn.column_parallel import run_all_gather_linear
from asynctp.nn.precision import resolve_float8
from asynctp.parallel.placement import check_linear, check_shard, tensor_dim, to_local_input, tp_group

__all__ = ["AsyncColwiseParallel"]


class AsyncColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose input all-gather overlaps the matmul (and whose backward overlaps the
    reduce-scatter of the input gradient and the re-gather for the weight gradient).

    Shape legend: x_shard [B, S / R, D] (input_layouts=Shard(1)), weight shard [N / R, D],
    out [B, S, N / R] (the local output features: output_layouts Shard(-1)).

    Keyword Args:
        input_layouts: Shard(d), the dim the input is sharded on and gathered along (Shard(1) for
            [batch, seq, hidden] activations). Required: a replicated input has nothing to gather.
        output_layouts: Shard(-1) (the default), the only layout a column-parallel matmul gives.
        use_local_output: return a plain tensor (default) or a DTensor sharded on the last dim.
        save_gathered_input: keep the gathered input for the weight gradient instead of
            re-gathering it in backward (R times the activation memory, one gather fewer).
        float8: None or an asynctp.float8 recipe (or its name) for the forward and dgrad matmuls.
        strategy: passed to the fused ops ("auto", "serial", "pipeline").
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        save_gathered_input: bool = False,
        float8: Any = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.save_gathered_input = save_gathered_input
        self.float8 = float8
        self.strategy = strategy

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        check_linear(name, module, device_mesh)
        gather = "the sequence-sharded input it all-gathers; use ColwiseParallel for a replicated input"
        check_shard(name, "input_layouts", self.input_layouts[0], gather)
        check_shard(name, "output_layouts", self.output_layouts[0], "the local output features", last_only=True)
        resolve_float8(self.float8)  # a missing fp8 module fails here, not at the first forward
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.forward = types.MethodType(_make_forward(self, device_mesh), module)
        return module


def _make_forward(style: AsyncColwiseParallel, mesh: DeviceMesh):
    group = tp_group(mesh)
    group_name, world_size = group.group_name, group.size()
    placement = style.input_layouts[0]
    use_local_output = style.use_local_output
    options = dict(float8=resolve_float8(style.float8), save_gathered_input=style.save_gathered_input, strategy=style.strategy)

    def forward(module: nn.Linear, x: Any) -> Any:
        x_shard = to_local_input(x, mesh, placement)
        weight = module.weight.to_local()
        bias = module.bias.to_local() if module.bias is not None else None
        dim = tensor_dim(placement.dim, x_shard.ndim)
        out = run_all_gather_linear(group_name, world_size, x_shard, weight, bias, gather_dim=dim, **options)
        if use_local_output:
            return out
        return DTensor.from_local(out, mesh, (Shard(out.ndim - 1),), run_check=False)

    return forward
