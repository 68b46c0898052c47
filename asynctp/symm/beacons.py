"""Beacons: what lets the watchdog time the waits of a CUDA graph the caller captured.

An eager wait tells the watchdog (watchdog.py) when it was enqueued, and a replay of asynctp's own
graph is timed as one wait. A graph the caller captures (torch.cuda.graph, torch.compile's
"reduce-overhead", torchtitan's graphs) replays whenever the caller says, and the host is not
told. So each wait captured there is bracketed in the graph by two stream memory writes into its
own word of pinned host memory, its beacon: 1 on the wait's stream before the wait, 0 after it.
The writes run on the GPU's front end (no SM, no kernel; torchtitan's step under its graphs kept
its time, docs/performance.md) and the watchdog reads the words in host memory, with no CUDA call,
every half second.

A wait is stuck when its beacon read 1 at every sample for longer than the wait's timeout: a wait
that passes leaves its beacon at 0 until the next replay reaches it, and a sample lands there.
(A rank whose stream does nothing but wait for a far slower peer, minutes on end, would look
stuck: its peer is then at least as slow as the timeout allows anyway.) The watchdog then names
the op, the rank and what the wait awaited, and aborts the context as for an eager stream wait.

Without beacons (no pinned memory the stream writes can reach), a caller's capture keeps using
torch's signal kernels, which time out on their own, and the single-launch GEMM declines there.
"""

from __future__ import annotations

import time

import torch

from asynctp.config import warn_once
from asynctp.symm import watchdog

__all__ = ["Beacons", "make"]

CAPACITY = 1 << 16  # words: 256 KiB of pinned memory per workspace


class _Site:
    """One captured wait: what the watchdog says when it is stuck."""

    __slots__ = ("op", "what", "peer", "timeout")

    def __init__(self, op: str, what, peer: int | None, timeout: float) -> None:
        self.op, self.what, self.peer, self.timeout = op, what, peer, timeout


class Beacons:
    """The beacon words of one workspace and the captured waits they belong to.
    `write(stream, address, value)` enqueues a stream memory write (streamops.StreamOps.write)."""

    def __init__(self, words: torch.Tensor, write) -> None:
        self.words = words  # int32, pinned: the device writes, the host reads
        self._host = words.numpy()
        self._base = words.data_ptr()
        self._write = write
        self.sites: list[_Site | None] = [None] * words.numel()
        self._next = 0
        self.wrapped = False
        self._since: dict[int, float] = {}  # slot -> first sample of its current run of 1s

    def enter(self, stream: int, op: str, what, peer: int | None, timeout: float) -> int:
        """A wait is being captured on `stream`: its slot, with the write of 1 enqueued before it."""
        slot = self._next
        self._next = (slot + 1) % len(self.sites)
        if self._next == 0 and not self.wrapped:
            self.wrapped = True
            warn_once("asynctp-beacons-wrapped", f"asynctp: over {len(self.sites)} waits captured in CUDA graphs of the "
                      "caller's: new ones share beacons with the oldest, whose stuck waits may be misnamed or missed")
        self.sites[slot] = _Site(op, what, peer, timeout)
        self._write(stream, self._base + 4 * slot, 1)
        return slot

    def leave(self, stream: int, slot: int) -> None:
        """The captured wait of `slot` is enqueued: the write of 0 after it."""
        self._write(stream, self._base + 4 * slot, 0)

    def stuck(self, now: float | None = None) -> watchdog.Pending | None:
        """The captured wait whose beacon read 1 at every sample for longer than its timeout,
        as a Pending (issued: its first such sample; abort: a stream wait has no timeout of its
        own), or None. Each call is a sample."""
        now = time.monotonic() if now is None else now
        on = self._host[: len(self.sites) if self.wrapped else self._next].nonzero()[0].tolist()
        self._since = {slot: self._since.get(slot, now) for slot in on}
        for slot in on:
            site = self.sites[slot]
            if site is not None and now - self._since[slot] > site.timeout:
                p = watchdog.Pending(site.op, site.what, site.peer, site.timeout, abort=True)
                p.issued = self._since.pop(slot)
                self.sites[slot] = None  # named once
                return p
        return None


def make(write, device: torch.device) -> tuple[Beacons | None, str | None]:
    """(Beacons, None) where a stream write reaches pinned host memory on `device` (tried once:
    one write and a synchronize), else (None, why)."""
    if torch.cuda.is_current_stream_capturing():
        return None, "the workspace was made during a CUDA-graph capture: call asynctp.reserve(group, nbytes) before it"
    try:
        words = torch.zeros(CAPACITY, dtype=torch.int32, pin_memory=True)
        stream = torch.cuda.Stream(device)
        write(stream.cuda_stream, words.data_ptr(), 1)
        stream.synchronize()
        seen = int(words[0])
        words[0] = 0
    except (RuntimeError, OSError) as exc:
        return None, f"stream writes to pinned host memory failed ({exc})"
    if seen != 1:
        return None, f"a stream write to pinned host memory read back {seen}, not 1"
    return Beacons(words, write), None
