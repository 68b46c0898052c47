"""How one call runs: the strategy (the user's, or "auto" from the tuning table), the workspace
it runs over, and the pipeline's row blocks and lockstep (ops/tuning.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asynctp.ops.strategy import choose
from asynctp.ops.tuning import plan_for
from asynctp.symm import Workspace

__all__ = ["Plan", "make_plan"]


@dataclass(frozen=True)
class Plan:
    strategy: str  # "serial" | "ring" | "pipeline" | "fused"
    ws: Workspace | None = None  # the group's workspace (pipeline and fused only)
    splits: int = 1  # row blocks per rank chunk of the pipeline
    lockstep: bool = False  # the pipeline's local GEMM waits for the opening barrier


def make_plan(op: str, tuned_as: str, strategy: str, group, device: torch.device, shape_key: tuple) -> Plan:
    """The plan of a call of `op` whose full matmul is shape_key = (dtype, M, N, K). tuned_as:
    the op whose pipeline plan it shares (an fp8 op runs its bf16 op's pipeline)."""
    chosen, ws = choose(op, strategy, group, device, shape_key)
    if ws is None:
        return Plan(chosen)
    splits, lockstep = plan_for(tuned_as, shape_key, ws.world_size)
    return Plan(chosen, ws, splits, lockstep)
