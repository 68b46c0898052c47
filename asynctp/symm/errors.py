"""Errors raised by workspaces: a peer that never arrived, a group no backend can serve."""

from __future__ import annotations

__all__ = ["PeerTimeoutError", "WorkspaceUnavailable"]


class PeerTimeoutError(TimeoutError):
    """A rank waited longer than the timeout for another rank."""

    def __init__(self, op: str, rank: int, peer: int, what: str, timeout: float, group_name: str) -> None:
        self.op, self.rank, self.peer, self.what = op, rank, peer, what
        super().__init__(
            f"asynctp {op}: rank {rank} of group {group_name!r} timed out after {timeout:g} s "
            f"waiting for {what} from rank {peer} (is rank {peer} alive and running the same op? "
            f"set ASYNCTP_TIMEOUT to change the limit)"
        )


class WorkspaceUnavailable(RuntimeError):
    """No symmetric-memory backend can serve this group; ops fall back to serial (with a warning)."""
