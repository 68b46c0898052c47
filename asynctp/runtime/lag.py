"""How far the GPU runs behind the host: the measure behind the graph cache's auto policy.

A replay saves host time, which is worth something only where the GPU waits for the host. Lag
records CUDA events on the caller's stream (at most one every MARK_SECONDS) with the host time of
each; the GPU is "behind" while work queued LAG_SECONDS ago is unfinished. Why 10 ms, not less: a
queue a few ms deep hides a few eager calls, not a backward pass of them. With 1 ms (2xH200,
8B-shaped block, eager, one machine) the batch-1 step's backward calls looked behind and stayed
eager (31 of 34 calls a step), each costing ~1-2 ms of host time, and the GPU starved later in the
backward: 67.6 ms a step against 59.7 with 10 ms (every call replayed), for 3.6 GiB more allocated
(12.8 vs 9.1). At batch 2 the queue is tens of ms deep: 10 ms leaves the backward eager, the step
time equal (112-115 ms), and costs 1.2-2 GiB allocated.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Lag", "LAG_SECONDS", "MARK_SECONDS", "BUSY_WEIGHT"]

# the GPU is "behind" while work queued this long ago is unfinished
LAG_SECONDS = 0.010
MARK_SECONDS = 2.5e-4  # at most one lag mark (a CUDA event) this often
_MARKS = int(LAG_SECONDS / MARK_SECONDS) + 12  # marks kept: enough to reach back LAG_SECONDS
BUSY_WEIGHT = 1 / 64  # each mark's weight in Lag.busy (an average over about the last 64 marks)


class Lag:
    """How far the GPU runs behind the host: CUDA events recorded on the caller's stream, each with
    the host time it was recorded at (at most one every MARK_SECONDS, enough kept to reach back
    LAG_SECONDS). `busy`: the share of recent marks at which the GPU was behind, 1 until marks
    tell otherwise (a loop near 0 is host-bound: the GPU waits for the host).

    A caller that records an event anyway (a replay's completion, Lanes.replay) records the mark
    in that one record: lend() gives the event, add() takes it back recorded. An old mark's
    event is recorded again only once the caller no longer holds it (`held`: whether it does,
    as its last op's completion, which the next op may wait for)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, held: Callable[[Any], bool] | None = None,
                 new: Callable[[], Any] | None = None) -> None:
        self._marks: deque = deque(maxlen=_MARKS)  # (host time, event), oldest first
        self._new = new or torch.cuda.Event  # a new (unrecorded) event for a mark
        self._clock = clock
        self._held = held or (lambda event: False)
        self._last = float("-inf")
        self.busy = 1.0

    def mark(self) -> None:
        """A mark now, recorded on the current stream (none where one was made lately)."""
        event = self.lend()
        if event is not None:
            event.record()
            self.add(event)

    def lend(self) -> Any | None:
        """For a caller that records an event on its stream anyway: the event to record as a mark
        now, or None where no mark is due. Hand it to add() once recorded."""
        if not self._due():
            return None
        event = self._recycled()
        return event if event is not None else self._new()

    def add(self, event: Any) -> None:
        """A mark's event, recorded on the caller's stream since the mark fell due."""
        self._marks.append((self._last, event))

    def behind(self) -> bool:
        """Work queued more than LAG_SECONDS ago is unfinished (the newest mark that old tells)."""
        now = self._clock()
        for stamp, event in reversed(self._marks):
            if now - stamp > LAG_SECONDS:
                return not event.query()
        return False  # no mark that old: no sign of a queue

    def _due(self) -> bool:
        """A mark is due (none made in the last MARK_SECONDS); then `busy` takes this mark's reading."""
        now = self._clock()
        if now - self._last < MARK_SECONDS:
            return False
        self._last = now
        self.busy += BUSY_WEIGHT * (self.behind() - self.busy)
        return True

    def _recycled(self) -> Any | None:
        """The oldest mark's event, to record again, where enough marks are kept and the caller
        does not hold it; else None (a new one is made)."""
        if len(self._marks) < self._marks.maxlen:
            return None
        event = self._marks.popleft()[1]
        return None if self._held(event) else event
