"""Names a stuck device-side wait, and enforces the timeout of the waits that have none.

On the cuda backend a barrier or signal wait is either a stream memory operation (streamops.py:
the GPU's front end waits, with no timeout of its own) or, where those are missing, torch's kernel
that spins and traps after its timeout, which kills the CUDA context with an error that names
nothing (its timeout is the wait's plus two of this thread's periods: the line below comes
first). Each wait records, on the host, what it waits for (op, kind, peer, channel, when it was
issued); a daemon thread checks every workspace with a wait in flight and, once a wait is older
than its timeout while the op's completion event has not fired, writes one line to stderr (and
the log) naming the op, the rank, the peer and the signal. For a stream wait it first aborts the
CUDA context itself (CudaWorkspace.abort_device: every awaited flag set, so no stream stays
stuck, then a device-side assert), as the kernel would trap: every later CUDA call in the
process raises instead of hanging. Where that abort fails, or has not released the GPU within
GRACE seconds, the thread names the reason and ends the process (SIGABRT, as torch's NCCL
watchdog does): a stream wait of a later call may await a value the abort did not write (calls
queued behind the stuck one reuse its flags), and a CUDA call of the process that loads a kernel
while a wait is stuck holds the driver until the GPU is idle, the abort's launches with it.

A call replayed from asynctp's own CUDA graph (runtime/graphs.py) is watched as one wait, "the
barriers and signals of a CUDA-graph replay", with the same abort where they are stream waits. A
wait in a graph the caller captured is watched through its beacon (beacons.py: words of pinned
memory the graph sets while the GPU waits there), with the same message and abort; without
beacons, torch's kernels are used there, which trap on their own. On GPUs:
tests/gpu/test_reliability.py's test_stuck_device_wait_is_named_before_the_trap and, for the
caller's graphs, test_stuck_wait_in_a_callers_graph_is_named_then_released; the logic is tested
on fakes in tests/unit/test_watchdog.py.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Pending", "watch", "watched", "check", "report"]

log = logging.getLogger("asynctp")


class Pending:
    """One wait in flight: set by the workspace when it enqueues the wait. `what` is its
    description, or a function that makes it (called only when the description is read: most
    waits finish unread, and formatting costs host time every call)."""

    __slots__ = ("op", "_what", "peer", "issued", "timeout", "abort", "passed")

    def __init__(self, op: str, what: str | Callable[[], str], peer: int | None, timeout: float,
                 abort: bool = False) -> None:
        self.op, self._what, self.peer, self.timeout = op, what, peer, timeout
        self.abort = abort  # the wait has no timeout of its own: the watchdog aborts the context
        self.issued = time.monotonic()
        self.passed = None  # a gate's: an event (query()) recorded on the stream right after the wait

    @property
    def what(self) -> str:
        if callable(self._what):
            self._what = self._what()
        return self._what


PERIOD = 0.5  # seconds between the thread's checks
GRACE = 10.0  # seconds a device abort has to release this process's GPU before the process ends
_end = os.abort  # how the process ends (tests replace it)
_watched: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def watch(ws: Any) -> None:
    """Watch a workspace: it exposes `pending` (a Pending or None), `lanes._done` (an event with
    query(), recorded when an op finished), `lanes.started` / `lanes.joined` (op counts: unequal
    while an op is being queued), `rank` and `group_name`."""
    global _thread
    with _lock:
        _watched.add(ws)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="asynctp-watchdog", daemon=True)
            _thread.start()


def watched() -> list:
    """The workspaces watched now (watch), this process's."""
    with _lock:
        return list(_watched)


def _waiting(ws: Any) -> Any:
    """The wait a stuck call of ws is stuck at, or None: its opening barrier (`ws.gate`, a
    Pending with `passed`) while the GPU has not passed it (the call's later waits are queued
    behind it), else the last wait enqueued (`ws.pending`)."""
    p, g = ws.pending, getattr(ws, "gate", None)
    if p is None or g is None:
        return p
    try:
        passed = g.passed.query()
    except Exception:  # noqa: BLE001  (after a device trap the context is gone: it never passed)
        passed = False
    if passed:
        ws.gate = None
        return p
    return g


def _forget(ws: Any, p: Any) -> None:
    """Drop the call's waits once `p` (its last wait, or its gate) is settled or reported."""
    if ws.pending is p or getattr(ws, "gate", None) is p:
        ws.pending = ws.gate = None


def check(ws: Any, now: float | None = None) -> str | None:
    """The message for ws's stuck wait (see _waiting), if it has one (and forget that wait);
    None otherwise."""
    return _check(ws, _waiting(ws), now)


def _stuck(ws: Any, now: float | None) -> tuple[Any, str | None]:
    """(the stuck wait, its message): an eager wait or replay (_waiting), else a wait of a graph
    the caller captured (ws.beacons, where ws has them), else (None, None)."""
    p = _waiting(ws)
    message = _check(ws, p, now)
    if message is None and getattr(ws, "beacons", None) is not None:
        p = ws.beacons.stuck(ws, now)
        if p is not None:
            now = time.monotonic() if now is None else now
            message = _message(ws, p, f"in a CUDA graph the caller captured, seen waiting for {now - p.issued:.0f} s")
    return p, message


def _check(ws: Any, p: Any, now: float | None) -> str | None:
    if p is None:
        return None
    lanes = ws.lanes
    if getattr(lanes, "started", 0) != getattr(lanes, "joined", 0):
        # the host is still queuing the op that enqueued the wait (or is blocked in it: on
        # 4xH200 a launch after a wait for a peer that never came blocked the host): the
        # completion event is the previous op's, so the wait is unfinished
        finished = False
    else:
        done = lanes._done
        if done is None:  # the last op was captured into a CUDA graph: nothing to go by, drop it
            _forget(ws, p)
            return None
        try:
            finished = done.query()
        except Exception:  # noqa: BLE001  (after a device trap the context is gone)
            finished = False
    now = time.monotonic() if now is None else now
    if finished and now - p.issued > 1.0:  # the op (or a later one) completed: nothing stuck
        _forget(ws, p)
        return None
    if now - p.issued <= p.timeout:
        return None
    _forget(ws, p)
    return _message(ws, p, f"enqueued {now - p.issued:.0f} s ago")


def _message(ws: Any, p: Any, when: str) -> str:
    source = f"from rank {p.peer}" if p.peer is not None else "from every rank of the group"
    hint = f"is rank {p.peer} alive" if p.peer is not None else "are all ranks alive"
    message = (
        f"asynctp {p.op}: rank {ws.rank} of group {ws.group_name!r}: the GPU has waited over "
        f"{p.timeout:g} s for {p.what} {source} ({when}); the "
        f"device-side wait will now abort this process with a CUDA error. {hint.capitalize()} and "
        f"running the same ops in the same order? (ASYNCTP_TIMEOUT sets the limit)"
    )
    return message


def report(ws: Any, now: float | None = None) -> str | None:
    """ws's stuck wait (_stuck) is logged, and when it has no timeout of its own (Pending.abort)
    ws's device abort runs first (_abort): once the line is out, a synchronize is sure to raise
    (logging first let one that started in between return when the released waits finished
    before the abort's assert was even launched). An abort that raised, or has not returned
    within GRACE, ends the process after a second line that says why."""
    p, message = _stuck(ws, now)
    if message is None:
        return None
    failure = _abort(ws) if p.abort else None
    _emit(message)
    if failure is not None:
        _emit(f"asynctp {p.op}: rank {ws.rank} of group {ws.group_name!r}: the abort {failure}; ending the process")
        _end()
    return message


def _abort(ws: Any) -> str | None:
    """ws.abort_device() (which returns once the process's GPU work has ended: a synchronize
    returned or raised) on a thread of its own: None where it returned within GRACE, else
    what went wrong."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            ws.abort_device()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (reported by the watchdog's thread)
            outcome.append(exc)

    thread = threading.Thread(target=run, name="asynctp-abort", daemon=True)
    thread.start()
    thread.join(GRACE)
    if not outcome:
        return (f"has not released this process's GPU within {GRACE:g} s (a wait queued behind the stuck one "
                f"awaits a value the abort did not write, or a CUDA call of this process, such as a kernel's "
                f"first load, holds the driver until the GPU is idle)")
    if outcome[0] is not None:
        return f"failed ({type(outcome[0]).__name__}: {outcome[0]})"
    return None


def _emit(line: str) -> None:
    log.error(line)
    print(line, file=sys.stderr, flush=True)


def _run() -> None:
    while True:
        time.sleep(PERIOD)
        workspaces = watched()
        for ws in workspaces:
            try:
                report(ws)
            except Exception:  # noqa: BLE001  (the thread must go on watching the other workspaces)
                log.exception("asynctp watchdog: checking a workspace of group %r failed",
                              getattr(ws, "group_name", "?"))
