"""Which implementation serves a call: the user's choice, or "auto" from measured costs."""

from __future__ import annotations

import torch

from asynctp.ops.tuning import pick, ring_pays
from asynctp.symm import Workspace, get_workspace

__all__ = ["choose", "eager_call_ok"]


def eager_call_ok(*tensors: torch.Tensor | None) -> bool:
    """True when a call can skip the dispatcher and run the implementation directly: plain
    tensors, no tracing or dispatch mode, and no autograd to record (the custom ops have no
    autograd formula; through the dispatcher, backward raises instead of being silently wrong).
    The dispatcher costs tens of microseconds per call; in eager mode host time per call decides
    whether the GPU idles between ops."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return False
    return True


def choose(op: str, strategy: str, group, device: torch.device, shape_key: tuple) -> tuple[str, Workspace | None]:
    """(strategy to run, workspace or None). "auto" asks the tuning table first, so a shape it
    keeps serial costs no more host time than strategy="serial" (small calls are host-bound).
    Without a workspace (warned once by get_workspace), "auto" overlaps over the send/recv ring
    where that pays and runs serially elsewhere."""
    if strategy in ("serial", "ring"):
        return strategy, None
    requested = strategy
    if strategy == "auto":
        strategy = pick(op, group.size(), device, shape_key)
        if strategy == "serial":
            return "serial", None
    ws = get_workspace(group, device)
    if ws is None:
        return ("ring" if requested == "auto" and ring_pays(device, shape_key) else "serial"), None
    return strategy, ws
