"""SharedGather: column-parallel linears that read the same input (wq / wk / wv, w1 / w3) and
share one all-gather, one fused backward reduce-scatter and one weight-gradient gather.

The first member called with an input computes every member's output in one
all_gather_linear([w_a, w_b, ...]); the others, called next with the same input object, take
theirs. An input that is a different object (or a member called twice) starts a new round, so
a model that does not call every member, or calls them in another order, stays correct; it only
loses the sharing. Under torch.compile dynamo traces the rounds like any Python state (the
members' outputs of a round are kept on this object between the calls), so a compiled model
shares as an eager one does: one fused call per group, not one per member (the members' own
calls had run the small wk / wv ones serially, with layout copies: 8 serial gathers and 8
serial reduce-scatters a step in the compiled 8B block at batch 2, 2xH200).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SharedGather"]


class SharedGather:
    """Pass one instance to the AsyncColwiseParallel styles of linears that share their input:

        qkv = SharedGather()
        plan = {f"attention.{n}": AsyncColwiseParallel(input_layouts=Shard(1), shared_gather=qkv)
                for n in ("wq", "wk", "wv")}
    """

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []
        self._options: tuple | None = None
        self._input: Any = None  # the input object of the current round
        self._pending: dict[int, torch.Tensor] = {}  # id(member) -> its output, not yet taken

    def register(self, module: nn.Module, options: tuple) -> None:
        """Called by AsyncColwiseParallel._apply; members must agree on how they are run."""
        if self._options is not None and options != self._options:
            raise ValueError(
                f"SharedGather requires every member's style to have the same input_layouts, mesh, float8, "
                f"save_gathered_input and strategy, got {options} after {self._options}"
            )
        if self.modules and module.in_features != self.modules[0].in_features:
            raise ValueError(
                f"SharedGather requires linears with one in_features ({self.modules[0].in_features}), got {module.in_features}"
            )
        self._options = options
        self.modules.append(module)

    def take(self, module: nn.Module, x: Any) -> torch.Tensor | None:
        """This member's output from the current round, if x is that round's input."""
        if x is not self._input or id(module) not in self._pending:
            return None
        out = self._pending.pop(id(module))
        if not self._pending:
            self._input = None
        return out

    def start(self, module: nn.Module, x: Any, outs: list[torch.Tensor]) -> torch.Tensor:
        """Keep the other members' outputs of a new round; return this member's."""
        by_member = {id(m): o for m, o in zip(self.modules, outs)}
        mine = by_member.pop(id(module))
        self._input, self._pending = (x, by_member) if by_member else (None, {})
        return mine
