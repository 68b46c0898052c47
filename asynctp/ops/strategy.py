"""Which implementation serves a call: the user's choice, or "auto" from measured costs."""

from __future__ import annotations

import torch

from asynctp.symm import Workspace, get_workspace

__all__ = ["choose"]


def choose(op: str, strategy: str, group, device: torch.device, shape_key: tuple) -> tuple[str, Workspace | None]:
    """(strategy to run, workspace or None). Falls back to "serial" (warned once by get_workspace)
    when the group has no workspace."""
    if strategy == "serial":
        return "serial", None
    ws = get_workspace(group, device)
    if ws is None:
        return "serial", None
    if strategy == "auto":
        from asynctp.ops.tuning import pick

        strategy = pick(op, ws, device, shape_key)
    return strategy, ws
