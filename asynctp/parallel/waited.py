"""WaitedRowwiseParallel: torch's RowwiseParallel for a vocabulary-parallel embedding, its output
redistribution completed before the module returns (a plain tensor, never an AsyncCollectiveTensor)."""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import RowwiseParallel

__all__ = ["WaitedRowwiseParallel"]


class WaitedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output reduce-scatter (or all-reduce) is waited inside the style.

    Why: torch's style returns the un-waited AsyncCollectiveTensor. When the next module is compiled
    on its own (per-block torch.compile, as torchtitan compiles), that tensor is a compiled
    region's input; AOTAutograd waits it on entry and the backward then hands the embedding's
    Redistribute a plain tensor gradient instead of a DTensor (AttributeError: 'Tensor' object has
    no attribute '_local_tensor', torch 2.13). The lookup has no matmul to overlap the collective
    with, and the first block reads its output at once, so waiting here costs nothing.
    Same arguments as RowwiseParallel; make_async puts it on nn.Embedding entries.
    """

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Placement, use_local_output: bool, mod: Any, outputs: DTensor, device_mesh: DeviceMesh
    ) -> Any:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs
