"""AsyncColwiseParallel: torch's ColwiseParallel for a sequence-sharded input, served by
all_gather_linear (the gather overlapped with the matmul, forward and backward)."""

from __future__ import annotations

import types
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

from asynctp.nn.column_parallel import run_all_gather_linear
from asynctp.nn.precision import resolve_float8
from asynctp.parallel.shared_gather import SharedGather
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
        shared_gather: a SharedGather given to the styles of sibling linears fed the same input
            (wq / wk / wv, w1 / w3): one gather (and one backward reduce-scatter) for all of them.
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
        shared_gather: SharedGather | None = None,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.save_gathered_input = save_gathered_input
        self.float8 = float8
        self.strategy = strategy
        if shared_gather is not None and not isinstance(shared_gather, SharedGather):
            raise TypeError(f"shared_gather requires an asynctp.parallel.SharedGather, got {type(shared_gather).__name__}")
        self.shared_gather = shared_gather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        check_linear(name, module, device_mesh)
        gather = "the sequence-sharded input it all-gathers; use ColwiseParallel for a replicated input"
        check_shard(name, "input_layouts", self.input_layouts[0], gather)
        check_shard(name, "output_layouts", self.output_layouts[0], "the local output features", last_only=True)
        resolve_float8(self.float8)  # a missing fp8 module fails here, not at the first forward
        if self.save_gathered_input and self.float8 is not None:
            raise ValueError(f"{name} requires save_gathered_input=False with float8 (the fp8 forward gathers fp8 data), got True")
        distribute_module(module, device_mesh, self._partition_linear_fn)
        if self.shared_gather is not None:
            options = (self.input_layouts, device_mesh, self.float8, self.save_gathered_input, self.strategy)
            self.shared_gather.register(module, options)
        module.forward = types.MethodType(_make_forward(self, device_mesh), module)
        return module


def _make_forward(style: AsyncColwiseParallel, mesh: DeviceMesh):
    group = tp_group(mesh)
    group_name, world_size = group.group_name, group.size()
    placement = style.input_layouts[0]
    use_local_output = style.use_local_output
    options = dict(float8=resolve_float8(style.float8, keep_buffers=True), save_gathered_input=style.save_gathered_input, strategy=style.strategy)
    shared = style.shared_gather
    warned = [False]

    def warn_if_gathered(module: nn.Linear, x: Any) -> None:
        # a PrepareModuleInput(... Replicate()) above gathered already: correct, one gather too many
        if not warned[0] and isinstance(x, DTensor) and isinstance(x.placements[0], Replicate):
            warned[0] = True
            warnings.warn(
                f"AsyncColwiseParallel on {type(module).__name__}({module.in_features}, ...) requires its input "
                f"sharded as input_layouts={placement}, got a Replicate DTensor: a PrepareModuleInput above gathers "
                "it already and this style gathers again (use asynctp.parallel.make_async on the plan)",
                UserWarning, stacklevel=3,
            )

    def linears(modules: list[nn.Module], x: Any) -> list[torch.Tensor]:
        x_shard = to_local_input(x, mesh, placement)
        weights = [m.weight.to_local() for m in modules]
        biases = [m.bias.to_local() if m.bias is not None else None for m in modules]
        dim = tensor_dim(placement.dim, x_shard.ndim)
        return run_all_gather_linear(group_name, world_size, x_shard, weights, biases, gather_dim=dim, **options)

    def forward(module: nn.Linear, x: Any) -> Any:
        warn_if_gathered(module, x)
        if shared is None:
            out = linears([module], x)[0]
        else:
            out = shared.take(module, x)
            if out is None:
                out = shared.start(module, x, linears(shared.modules, x))
        if use_local_output:
            return out
        return DTensor.from_local(out, mesh, (Shard(out.ndim - 1),), run_check=False)

    return forward
