"""Errors raised by workspaces: a peer that never arrived, ranks that disagree on a call, a group
out of step, a group no backend can serve."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PeerTimeoutError", "CallMismatchError", "OutOfStepError", "WorkspaceUnavailable", "CaptureGrowthError"]


def _ranks(peers: Sequence[int]) -> str:
    """"rank 3" or "ranks 0, 2"."""
    return f"rank {peers[0]}" if len(peers) == 1 else "ranks " + ", ".join(map(str, peers))


class PeerTimeoutError(TimeoutError):
    """A rank waited longer than the timeout for other ranks (every missing one is named)."""

    def __init__(self, op: str, rank: int, peer: int | Sequence[int], what: str, timeout: float, group_name: str) -> None:
        peers = [peer] if isinstance(peer, int) else sorted(peer)
        self.op, self.rank, self.peers, self.what = op, rank, peers, what
        self.peer = peers[0] if peers else -1
        who = _ranks(peers)
        super().__init__(
            f"asynctp {op}: rank {rank} of group {group_name!r} timed out after {timeout:g} s "
            f"waiting for {what} from {who} (is {who} alive and running the same op? "
            f"ASYNCTP_TIMEOUT sets the limit)"
        )


class CallMismatchError(ValueError):
    """The ranks of a group made different calls (op, shapes, dtypes, dims or modes differ)."""


class OutOfStepError(RuntimeError):
    """An earlier call on the group failed part-way: its ranks may pair different calls."""


class WorkspaceUnavailable(RuntimeError):
    """No symmetric-memory backend can serve this group; ops fall back to serial (with a warning)."""


class CaptureGrowthError(RuntimeError):
    """A call inside a CUDA-graph capture needs a larger workspace. Workspaces are the same size on
    every rank, so every rank raises it at the same point, before anything is exchanged: the
    group stays in step (end_call does not mark it)."""

    in_step = True
