"""Which implementation serves a call: the user's choice, or "auto" from measured costs."""

from __future__ import annotations

import torch

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
    """(strategy to run, workspace or None). Without a workspace (warned once by get_workspace),
    "auto" overlaps over the send/recv ring where that pays and runs serially elsewhere."""
    if strategy in ("serial", "ring"):
        return strategy, None
    if strategy == "auto":
        # host time is what host-bound (small) calls are made of: a memoized "serial" answer
        # costs auto one dict lookup more than strategy="serial"
        memo = _serial_memo.get((op, group.group_name, device, shape_key))
        if memo is not None and memo == _tuning_epoch():
            return "serial", None
    ws = get_workspace(group, device)
    if ws is None:
        from asynctp.ops.tuning import ring_pays

        return ("ring" if strategy == "auto" and ring_pays(device, shape_key) else "serial"), None
    if strategy == "auto":
        from asynctp.ops.tuning import pick

        strategy = pick(op, ws, device, shape_key)
        if strategy == "serial":
            _serial_memo[(op, group.group_name, device, shape_key)] = _tuning_epoch()
    return strategy, ws


_serial_memo: dict[tuple, int] = {}


def _tuning_epoch() -> int:
    from asynctp.ops import tuning

    return tuning.epoch
