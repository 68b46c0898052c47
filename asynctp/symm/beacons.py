"""Beacons: what lets the watchdog time the waits of a CUDA graph the caller captured.

An eager wait tells the watchdog (watchdog.py) when it was enqueued, and a replay of asynctp's own
graph is timed as one wait. A graph the caller captures (torch.cuda.graph, torch.compile's
"reduce-overhead", torchtitan's graphs) replays whenever the caller says, and the host is not
told. So each wait captured there has a beacon, two words of pinned host memory, and is bracketed
in the graph by stream memory writes: before the wait, 0 into its mark and 1 into its up word;
after it, 0 into its up word. The writes run on the GPU's front end (no SM, no kernel;
torchtitan's step under its graphs kept its time, docs/performance.md) and the watchdog reads and
writes the words in host memory, with no CUDA call, every half second.

Mark and check: the first sample that finds a wait up sets its mark to 1 and notes the time. The
GPU clears the mark each time it reaches the wait again, so a later sample that finds the wait up
with the mark still set knows it is the same pass of the wait; a pass that is up longer than the
wait's timeout is stuck. (A sample that reads "up" just before the GPU leaves and re-enters the
wait and then sets the mark can take the new pass for the old one by less than one sampling
period: a wait is named at most that much early, never for a pass shorter than its timeout less
that.) The watchdog then names the op, the rank and what the wait awaited, writes into the flags
of the process's captured waits the values they await (release_pairs), and aborts the context, as
for an eager stream wait.

The words are the process's, per device, and never freed: a graph may outlive the workspace whose
waits it captured. Every rank of a group has beacons or none (agreed when its workspace is made):
without them, a caller's capture keeps using torch's signal kernels, which time out on their own,
and the single-launch GEMM declines there.
"""

from __future__ import annotations

import time
import weakref

import torch

from asynctp.config import warn_once
from asynctp.symm import watchdog

__all__ = ["Beacons", "for_device"]

CAPACITY = 1 << 18  # waits per device: 2 MiB of pinned memory (up words, then marks)

_pools: dict[int, Beacons] = {}  # device index -> its beacons, for the process's lifetime


class _Site:
    """One captured wait: its workspace (weakly), what the watchdog says when it is stuck, and the
    (flag address, value) pairs it waits for (what an abort writes to release it)."""

    __slots__ = ("owner", "op", "what", "peer", "timeout", "awaited")

    def __init__(self, owner, op: str, what, peer: int | None, timeout: float) -> None:
        self.owner, self.op, self.what, self.peer, self.timeout = weakref.ref(owner), op, what, peer, timeout
        self.awaited: list[tuple[int, int]] = []


class Beacons:
    """The beacons of one device: `words` (int32, pinned, 2 x capacity: the up words, then the
    marks) and the captured waits they belong to. `write(stream, address, value)` enqueues a
    stream memory write (streamops.StreamOps.write)."""

    def __init__(self, words: torch.Tensor, write) -> None:
        capacity = words.numel() // 2
        self.words = words
        host = words.numpy()
        self._up, self._mark = host[:capacity], host[capacity:]
        self._base = words.data_ptr()
        self._mark_base = self._base + 4 * capacity
        self._write = write
        self.sites: list[_Site | None] = [None] * capacity
        self._next = 0
        self.wrapped = False
        self._marked: dict[int, float] = {}  # slot -> when a sample set its mark
        self._named: set[int] = set()

    def enter(self, stream: int, owner, op: str, what, peer: int | None, timeout: float) -> int:
        """A wait of `owner` (a workspace) is being captured on `stream`: its slot, with the
        writes that clear its mark and set it up enqueued before it."""
        slot = self._next
        self._next = (slot + 1) % len(self.sites)
        if self._next == 0 and not self.wrapped:
            self.wrapped = True
            warn_once("asynctp-beacons-wrapped", f"asynctp: over {len(self.sites)} waits captured in CUDA graphs of the "
                      "caller's: new ones share beacons with the oldest, whose stuck waits may be misnamed or missed")
        self.sites[slot] = _Site(owner, op, what, peer, timeout)
        self._write(stream, self._mark_base + 4 * slot, 0)
        self._write(stream, self._base + 4 * slot, 1)
        return slot

    def awaits(self, slot: int, address: int, value: int) -> None:
        """The wait of `slot` waits until the 32-bit word at `address` equals `value`."""
        self.sites[slot].awaited.append((address, value))

    def leave(self, stream: int, slot: int) -> None:
        """The captured wait of `slot` is enqueued: the write that sets it down, after it."""
        self._write(stream, self._base + 4 * slot, 0)

    def _up_slots(self) -> list[int]:
        return self._up[: len(self.sites) if self.wrapped else self._next].nonzero()[0].tolist()

    def stuck(self, owner, now: float | None = None) -> watchdog.Pending | None:
        """A wait of `owner` up in one pass for longer than its timeout (mark and check, above),
        as a Pending (issued: the sample that marked it; abort: a stream wait has no timeout of
        its own), named once; or None. Each call is a sample."""
        now = time.monotonic() if now is None else now
        up = self._up_slots()
        current = set(up)
        self._marked = {slot: t for slot, t in self._marked.items() if slot in current}
        self._named &= current
        for slot in up:
            site = self.sites[slot]
            if site is None or site.owner() is not owner or slot in self._named:
                continue
            if slot not in self._marked or not self._mark[slot]:
                self._mark[slot] = 1
                self._marked[slot] = now
            elif now - self._marked[slot] > site.timeout:
                self._named.add(slot)
                p = watchdog.Pending(site.op, site.what, site.peer, site.timeout, abort=True)
                p.issued = self._marked[slot]
                return p
        return None

    def release_pairs(self, owners) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (address, value) pairs that release the captured waits of `owners` (workspaces):
        (every wait's, those of the waits up now). Every wait's, since the ones after a stuck wait
        in its graph must not stop the stream again before the abort's assert lands; those up now
        apart, to be written last (see CudaWorkspace.abort_device)."""
        every, now_up = [], []
        up = set(self._up_slots())
        for slot, site in enumerate(self.sites):
            if site is not None and any(site.owner() is owner for owner in owners):
                every.extend(site.awaited)
                if slot in up:
                    now_up.extend(site.awaited)
        return every, now_up

    def forget(self, owner) -> None:
        """Drop the captured waits of `owner`: its flags moved (a grown workspace), the graphs
        that hold them are stale, and an abort must not write where they were."""
        for slot, site in enumerate(self.sites):
            if site is not None and site.owner() is owner:
                self.sites[slot] = None


def for_device(write, device: torch.device) -> tuple[Beacons | None, str | None]:
    """(the device's Beacons, None), made at the first call outside a capture where a stream
    write reaches pinned host memory (tried with one write and a synchronize), else (None, why)."""
    held = _pools.get(device.index)
    if held is not None:
        return held, None
    if torch.cuda.is_current_stream_capturing():
        return None, "the workspace was made during a CUDA-graph capture: call asynctp.reserve(group, nbytes) before it"
    try:
        words = torch.zeros(2 * CAPACITY, dtype=torch.int32, pin_memory=True)
        stream = torch.cuda.Stream(device)
        write(stream.cuda_stream, words.data_ptr(), 1)
        stream.synchronize()
        seen = int(words[0])
        words[0] = 0
    except (RuntimeError, OSError) as exc:
        return None, f"stream writes to pinned host memory failed ({exc})"
    if seen != 1:
        return None, f"a stream write to pinned host memory read back {seen}, not 1"
    held = _pools[device.index] = Beacons(words, write)
    return held, None
