"""The state of a group's calls: numbered, agreed on by signature, refused once out of step.

Workspace (workspace.py) carries it for groups with a symmetric workspace; UnsharedCalls for
groups without one (their ring carries the signature; serial calls are not compared).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from asynctp.config import get_config
from asynctp.symm.errors import OutOfStepError, PeerTimeoutError

__all__ = ["Calls", "UnsharedCalls", "signature_of", "UNCHECKED"]

UNCHECKED = 1  # the signature of a call whose agreement is not checked
_signatures: dict[tuple, int] = {}  # (op, field values) -> signature: a dict hit costs less than a hash


def signature_of(op: str, values: tuple) -> int:
    """A nonzero 32-bit hash of the call's op and fields, equal on every rank for equal calls
    (crc32 of their repr: Python's own hash of a str differs between processes)."""
    key = (op, values)
    sig = _signatures.get(key)
    if sig is None:
        if len(_signatures) > 4096:
            _signatures.clear()
        sig = _signatures[key] = zlib.crc32(repr(key).encode()) or 2
    return sig


class Calls:
    """Call numbering, signature and out-of-step state of one group on this rank."""

    group_name: str
    op: str

    def _init_calls(self) -> None:
        self.seq = 0  # calls begun on this group (the same on every rank while in step)
        self.signature = UNCHECKED  # 32-bit signature of the call in progress (never 0)
        self.call: tuple = ("none", (), ())  # (op, field names, field values) of that call
        self.broken: str | None = None  # why the group is out of step (None: in step)
        self._calling = threading.Lock()  # held by the thread whose call is in progress
        self._caller: int | None = None
        self._depth = 0

    def begin_call(self, op: str, names: tuple[str, ...], values: tuple) -> None:
        """Open a call: refuse it if the group is out of step or another thread is in a call,
        number it, and (Config.check_calls) agree on its signature with the other ranks. A call
        made from inside another on the same thread (an op built on an op) is part of it."""
        me = threading.get_ident()
        if self._caller == me:
            self._depth += 1
            return
        if self.broken is not None:
            raise OutOfStepError(self.broken)
        if not self._calling.acquire(blocking=False):
            raise ValueError(
                f"asynctp {op} requires no other call in progress on group {self.group_name!r}, got one from "
                f"another thread ({self.op}); ops on one group must be called from one thread at a time"
            )
        self._caller, self._depth = me, 1
        self.op = op
        self.seq += 1
        self.call = (op, names, values)
        if get_config().check_calls:
            self.signature = signature_of(op, values)
            try:
                self._agree()
            except BaseException as exc:
                self.end_call(exc)
                raise
        else:
            self.signature = UNCHECKED

    def run(self, op: str, names: tuple[str, ...], values: tuple, fn: Callable[[], Any]) -> Any:
        """fn() inside a call opened by begin_call and closed by end_call (with fn's exception, if any)."""
        self.begin_call(op, names, values)
        try:
            result = fn()
        except BaseException as exc:
            self.end_call(exc)
            raise
        self.end_call()
        return result

    def in_call(self) -> bool:
        """Whether this thread is inside a call begun on this group."""
        return self._caller == threading.get_ident()

    def end_call(self, exc: BaseException | None = None) -> None:
        """Close the call begun last on this thread; an exception marks the group out of step."""
        if not self.in_call():
            return
        self._depth -= 1
        if self._depth > 0:
            return
        # an error every rank raises before any exchange (CaptureGrowthError) leaves it in step
        if exc is not None and self.broken is None and not getattr(exc, "in_step", False):
            self.broken = (
                f"group {self.group_name!r} is out of step since {self.op} (call {self.seq}) failed with "
                f"{type(exc).__name__}: {exc}; call asynctp.reset(group) on every rank or re-create the group"
            )
        self._caller = None
        self._calling.release()

    def _agree(self) -> None:
        """Compare the call's signature with the other ranks' (backends where it is done on the
        host); the cuda backend compares in its opening barrier instead."""



class UnsharedCalls(Calls):
    """The calls of a group without a symmetric workspace. On CPU, every rank's (seq, signature)
    goes once around a ring of send/recv before the call's data moves (world - 1 messages of 16
    bytes each way); on CUDA that would need a host sync: calls are numbered and guarded, not
    compared."""

    def __init__(self, group, device_type: str) -> None:
        self.group, self.group_name, self.rank, self.op = group, group.group_name, group.rank(), "none"
        self.device_type = device_type
        self._init_calls()

    def _agree(self) -> None:
        if self.device_type != "cpu":
            return
        import torch
        import torch.distributed as dist

        from asynctp.symm.errors import CallMismatchError
        from asynctp.symm.mismatch import describe_mismatch
        from asynctp.symm.rendezvous import exchange

        group, world, rank = self.group, self.group.size(), self.rank
        nxt, prv = (dist.get_global_rank(group, (rank + d) % world) for d in (1, -1))
        words = torch.zeros((world, 2), dtype=torch.int64)
        words[rank, 0], words[rank, 1] = self.seq, self.signature
        limit = get_config().timeout
        for step in range(1, world):
            ops = [dist.P2POp(dist.isend, words[(rank - step + 1) % world], nxt, group),
                   dist.P2POp(dist.irecv, words[(rank - step) % world], prv, group)]
            for req in dist.batch_isend_irecv(ops):
                try:
                    req.wait(timedelta(seconds=limit))
                except RuntimeError as exc:  # gloo's timeout (or a peer's closed connection)
                    raise PeerTimeoutError(self.op, rank, (rank - 1) % world, f"the start of call {self.seq} "
                                           f"over the ring ({exc})", limit, self.group_name) from None
        rows = words.tolist()
        if any(row != rows[rank] for row in rows):
            # every rank saw every row: all are here; name the fields
            everyone = exchange(group, self.op, self.call, tag=f"mismatch-{self.seq}")
            raise CallMismatchError(describe_mismatch(self.group_name, self.seq, everyone))
