"""Where the bytes live: one symmetric Workspace per (process group, device type), cached.

`get_workspace(group, device)` returns the group's workspace, creating it collectively on first
use, or None when no backend can serve the group (ranks on several hosts, no peer access, or
Config.disable_symm); then ops use the send/recv ring or their serial reference, and warn
once why. Every rank reaches the same answer: the checks that decide it are exchanged over the
group.

Lifetime: a workspace is released by `reset(group)` (also the way out of step, see
workspace.py), when its group has been destroyed (noticed when any workspace is created), and
when a group of the same name is created anew (noticed at its first call).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asynctp.config import get_config, warn_once
from asynctp.symm.calls import Calls, UnsharedCalls
from asynctp.symm.errors import CallMismatchError, OutOfStepError, PeerTimeoutError, WorkspaceUnavailable
from asynctp.symm.rendezvous import exchange, new_generation
from asynctp.symm.workspace import Lanes, Workspace, group_name_of, resolve_group

__all__ = [
    "Workspace",
    "Lanes",
    "PeerTimeoutError",
    "CallMismatchError",
    "OutOfStepError",
    "WorkspaceUnavailable",
    "get_workspace",
    "lookup",
    "calls_of",
    "reset",
    "unavailable_reason",
    "reserve",
    "resolve_group",
    "group_name_of",
]

_workspaces: dict[tuple[str, str], Workspace | None] = {}
_reasons: dict[tuple[str, str], str] = {}
_unshared: dict[tuple[str, str], UnsharedCalls] = {}  # the calls of groups without a workspace


def _local_reason(group: dist.ProcessGroup, device_type: str) -> str | None:
    """Why this rank cannot join a workspace for the group (None: it can)."""
    if get_config().disable_symm:
        return "ASYNCTP_DISABLE_SYMM is set (Config.disable_symm)"
    if device_type == "cuda":
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as exc:
            return f"torch.distributed._symmetric_memory is unavailable ({exc})"
    elif device_type != "cpu":
        return f"no symmetric-memory backend for device type {device_type!r}"
    return None


def _cuda_peer_reason(group: dist.ProcessGroup) -> str | None:
    from asynctp.symm.cpu import _host_id

    me = (_host_id(), torch.cuda.current_device())
    everyone = exchange(group, "workspace creation", me)
    if len({host for host, _ in everyone}) > 1:
        return "its ranks are on more than one host (no peer memory access)"
    for host, dev in everyone:
        if dev != me[1] and not torch.cuda.can_device_access_peer(me[1], dev):
            return f"GPU {me[1]} cannot access GPU {dev} (no P2P)"
    return None


def _agree(group: dist.ProcessGroup, reason: str | None) -> str | None:
    """Every rank adopts the first rank's reason (if any rank has one)."""
    reasons = exchange(group, "workspace creation", reason)
    for rank, r in enumerate(reasons):
        if r is not None:
            return f"rank {rank}: {r}"
    return None


def _create(group: dist.ProcessGroup, device_type: str) -> Workspace:
    reason = _agree(group, _local_reason(group, device_type))
    if reason is None and device_type == "cuda":
        reason = _agree(group, _cuda_peer_reason(group))
    if reason is not None:
        raise WorkspaceUnavailable(reason)
    if device_type == "cuda":
        from asynctp.symm.cuda import CudaWorkspace

        return CudaWorkspace(group)
    from asynctp.symm.cpu import CpuWorkspace

    return CpuWorkspace(group)


def _release(key: tuple[str, str]) -> None:
    ws = _workspaces.pop(key, None)
    _reasons.pop(key, None)
    if ws is not None:
        ws.close()


def _release_destroyed() -> None:
    """Release the workspaces of groups that torch.distributed no longer knows."""
    live = set(getattr(dist.distributed_c10d._world, "pg_map", {}))
    for key, ws in list(_workspaces.items()):
        if ws is not None and ws.group not in live:
            _release(key)


def lookup(pg: dist.ProcessGroup, device_type: str, create: bool = True) -> Workspace | None:
    """The group's workspace (created collectively unless create=False), or None; no warning."""
    key = (pg.group_name, device_type)
    ws = _workspaces.get(key, False)
    if ws is not False and ws is not None and ws.group is not pg:
        _release(key)  # a group of the same name made anew: the old one's workspace is stale
        ws = False
    if ws is False:
        if not create:
            return None
        _release_destroyed()
        try:
            ws = _workspaces[key] = _create(pg, device_type)
        except WorkspaceUnavailable as exc:
            ws = _workspaces[key] = None
            _reasons[key] = str(exc)
        else:
            unshared = _unshared.get(key)
            if unshared is not None and unshared.in_call():
                ws.op = unshared.op  # made by a call begun without it (cuda): its waits name that call's op
    return ws


def calls_of(pg: dist.ProcessGroup, device_type: str) -> Calls:
    """Where the group's calls are numbered and agreed on: its workspace (made on first use on
    CPU; on CUDA only once a pipelined call made it), else its UnsharedCalls."""
    ws = lookup(pg, device_type, create=device_type == "cpu")
    if ws is not None:
        return ws
    calls = _unshared.get((pg.group_name, device_type))
    if calls is None or calls.group is not pg:
        calls = _unshared[(pg.group_name, device_type)] = UnsharedCalls(pg, device_type)
    return calls


def reset(group: Any) -> None:
    """Bring a group that is out of step (a call failed part-way: timeout, interrupt, ranks that
    disagreed) back: its workspaces are released and its next call creates them afresh, with
    fresh call numbers. Call it on every rank of the group, between calls."""
    pg = resolve_group(group)
    for key in [k for k in _workspaces if k[0] == pg.group_name]:
        _release(key)
    for key in [k for k in _unshared if k[0] == pg.group_name]:
        del _unshared[key]
    new_generation(pg.group_name)


def get_workspace(group: Any, device: torch.device | str) -> Workspace | None:
    """The group's workspace for tensors on `device`, or None (after one warning) if unavailable."""
    pg = resolve_group(group)
    device_type = torch.device(device).type
    key = (pg.group_name, device_type)
    ws = lookup(pg, device_type)
    if ws is None:
        warn_once(
            f"no-workspace:{key}",
            f"asynctp: process group {pg.group_name!r} has no symmetric workspace on {device_type} "
            f"({_reasons[key]}); the fused ops overlap over a ring of send/recv (strategy 'ring') "
            f"where that pays, and run their serial reference (collective, then matmul) elsewhere",
        )
    return ws


def unavailable_reason(group: Any, device: torch.device | str) -> str | None:
    """Why the group has, or would have, no workspace, known without communicating: this rank's
    own reason (a setting, no backend for the device), else the one its creation agreed on; None
    if neither (it has one, or was never asked for and this rank could join one)."""
    pg, device_type = resolve_group(group), torch.device(device).type
    return _local_reason(pg, device_type) or _reasons.get((pg.group_name, device_type))


def reserve(group: Any, nbytes: int, device: torch.device | str | None = None) -> None:
    """Size the group's workspace up front (collective). Needed before CUDA-graph capture.

    nbytes: the most any captured op needs. A pipelined all-gather needs R x its shard's bytes
    (plus R x 4 bytes a row for a rowwise fp8 scale), a reduce-scatter R x its output chunk's
    bytes, each part rounded up to 256 bytes (R: the group's size). An op that finds the
    workspace too small during capture raises with the number to pass here."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ws = get_workspace(group, device)
    if ws is not None:
        ws.reserve(nbytes)
