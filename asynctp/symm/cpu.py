"""The cpu backend: POSIX shared memory between the processes of one host.

Each rank maps every rank's segment, so reads and writes of peer buffers are real one-sided
accesses and the pipelines run unchanged under gloo (CI, CPU-only machines). Segments live in
/dev/shm; their names travel over the process group, and each creator unlinks its file once
every peer has mapped it, so nothing is left behind when a process dies.

Signal pad (a separate, never-resized segment per rank): int64 counters laid out as
[channel][kind][source rank], kind 0 = barrier epoch, kind 1 = signals sent, then the call words
[source rank][seq parity][seq, signature] that begin_call compares (a peer can be one call
ahead, never two: it needs this rank in the call before). Only the source rank writes its slot,
so plain stores suffice (x86 keeps stores in order; copies done by glibc's memcpy end with a
store fence).

Files are named asynctp-<pid>-<random>; a file whose process is gone (killed while creating a
workspace) is removed by the next process that creates one. Every rank unlinks every file of
an exchange once all are mapped (or it gave up), so a creator that dies leaves nothing behind
its survivors. Files are allocated (posix_fallocate), never sparse: a full /dev/shm raises
here instead of SIGBUS at a later write.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

from asynctp.symm.errors import CallMismatchError, PeerTimeoutError, WorkspaceUnavailable, _ranks
from asynctp.symm.mismatch import describe_mismatch
from asynctp.symm.rendezvous import exchange
from asynctp.symm.workspace import NUM_CHANNELS, Workspace

__all__ = ["CpuWorkspace"]

_BARRIER, _SIGNAL = 0, 1
_SPIN_S = 50e-6


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


_PREFIX = "asynctp-"
_reclaimed = False


def reclaim_stale(directory: str | None = None) -> list[str]:
    """Remove asynctp files whose creating process no longer exists; returns their paths."""
    directory = directory or _shm_dir()
    removed = []
    for name in os.listdir(directory):
        parts = name.split("-")
        if not name.startswith(_PREFIX) or len(parts) != 3 or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # not ours to signal: then not ours to remove either
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class _Segment:
    """One mapped shared-memory file."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError:
                    os.unlink(path)
                    raise
            self.mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.words = memoryview(self.mmap).cast("q")  # int64 view for the signal pad

    def close(self) -> None:
        self.words.release()
        del self.tensor
        try:
            self.mmap.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


class CpuWorkspace(Workspace):
    backend = "cpu"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group, torch.device("cpu"))
        global _reclaimed
        if not _reclaimed:
            _reclaimed = True
            reclaim_stale()
        self._call_base = NUM_CHANNELS * 2 * self.world_size  # first call word of the signal pad
        self._pads = self._exchange((self._call_base + 4 * self.world_size) * 8, "pads")
        self._call_words = [pad.words for pad in self._pads]
        self._peers = [p for p in range(self.world_size) if p != self.rank]
        # where each peer's (seq, signature) lands in this rank's pad, per call parity
        self._call_slots = [[self._call_base + 2 * parity + 4 * p for p in self._peers] for parity in (0, 1)]
        self._bufs: list[_Segment] = []
        self._epoch = [0] * NUM_CHANNELS
        self._sent = [[0] * NUM_CHANNELS for _ in range(self.world_size)]
        self._received = [[0] * NUM_CHANNELS for _ in range(self.world_size)]

    def _exchange(self, nbytes: int, tag: str) -> list[_Segment]:
        """Collectively create one segment per rank and map all of them."""
        path = os.path.join(_shm_dir(), f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        own = _Segment(path, nbytes, create=True)
        paths = [path]
        try:
            infos = exchange(self.group, self.op, (_host_id(), path), tag=tag)
            paths = [p for _, p in infos]
            hosts = {host for host, _ in infos}
            if len(hosts) > 1:
                raise WorkspaceUnavailable(
                    f"the cpu backend needs every rank on one host, group {self.group_name!r} "
                    f"spans {len(hosts)} hosts"
                )
            segs = [own if r == self.rank else _Segment(p, nbytes, create=False) for r, (_, p) in enumerate(infos)]
            # every rank has mapped every segment before any file disappears
            exchange(self.group, self.op, None, tag=tag)
        except BaseException:
            own.close()
            reclaim_stale()  # a peer killed while it made its file leaves it behind otherwise
            raise
        finally:
            for p in paths:  # every rank removes every file: a creator that died leaves none
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        return segs

    def _grow(self, nbytes: int) -> None:
        old, self._bufs = self._bufs, []
        for seg in old:
            seg.close()
        self._bufs = self._exchange(nbytes, "grow")
        self.nbytes = nbytes

    def close(self) -> None:
        super().close()
        self._call_words = []
        for seg in [*self._bufs, *self._pads]:
            seg.close()
        self._bufs, self._pads, self.nbytes = [], [], 0

    def _raw(self, rank: int) -> torch.Tensor:
        return self._bufs[rank].tensor

    def _slot(self, channel: int, kind: int, src: int) -> int:
        return (channel * 2 + kind) * self.world_size + src

    def _wait_all(self, indices: list[int], value: int, what: str, peers: list[int], timeout: float | None,
                  gave_up: bool = False) -> None:
        """Wait until words[i] >= value for every i (one per peer); a timeout names every peer
        still missing. gave_up: a word of -value means that peer gave up: stop waiting."""
        words = self._pads[self.rank].words
        waiting = [i for i in indices if words[i] < value]
        # spin briefly first: the shortest sleep is ~60 us (timer slack), longer than the wait
        # for a peer that is in step
        spin_until = time.perf_counter() + _SPIN_S
        while waiting and time.perf_counter() < spin_until:
            waiting = [i for i in waiting if words[i] < value]
        if not waiting:
            return
        limit = self._timeout(timeout)
        deadline = time.monotonic() + limit
        delay = 1e-6
        while waiting:
            # a peer that came to this call and gave up (its word is -value) will not come again
            if time.monotonic() > deadline or (gave_up and any(words[i] == -value for i in waiting)):
                missing = [p for p, i in zip(peers, indices) if 0 <= words[i] < value]
                left = [p for p, i in zip(peers, indices) if words[i] == -value]
                if left:
                    what += f" ({_ranks(left)} came and gave up waiting)"
                raise PeerTimeoutError(self.op, self.rank, missing or left, what, limit, self.group_name)
            # back off: with more ranks than cores a busy spin starves the peer we wait for
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
            waiting = [i for i in waiting if words[i] < value]

    def _wait_for(self, index: int, value: int, what: str, peer: int, timeout: float | None) -> None:
        self._wait_all([index], value, what, [peer], timeout)

    def barrier(self, channel: int = 0, timeout: float | None = None) -> None:
        self._epoch[channel] += 1
        epoch = self._epoch[channel]
        mine = self._slot(channel, _BARRIER, self.rank)
        for pad in self._pads:
            pad.words[mine] = epoch
        peers = list(range(self.world_size))
        what = f"barrier (channel {channel}, epoch {epoch})"
        self._wait_all([self._slot(channel, _BARRIER, p) for p in peers], epoch, what, peers, timeout)

    def _agree(self) -> None:
        """Publish (seq, signature) in every pad, wait for every peer's, compare. A mismatch
        raises the same CallMismatchError on every rank (they all see it) before data moves.
        (Host time per call is what this costs: no string is built unless something fails.)"""
        seq, sig = self.seq, self.signature
        parity = seq & 1
        mine = self._call_base + 2 * parity + 4 * self.rank
        pads = self._call_words
        for words in pads:
            words[mine + 1] = sig  # before the seq, which is what peers wait for
            words[mine] = seq
        words, slots = pads[self.rank], self._call_slots[parity]
        for i in slots:
            if words[i] != seq or words[i + 1] != sig:
                break
        else:
            return  # every peer is here with the same call: the common case
        try:
            self._wait_all(slots, seq, f"the start of call {seq}", self._peers, None, gave_up=True)
        except BaseException:
            # withdrawn: a peer that comes later must not take this call for its partner
            for w in pads:
                w[mine] = -seq
            raise
        ahead = {p: words[i] for p, i in zip(self._peers, slots) if words[i] != seq}
        if ahead:
            raise CallMismatchError(
                f"asynctp {self.op} requires every rank of group {self.group_name!r} at the same call, got call "
                f"{seq} on rank {self.rank} and " + ", ".join(f"call {s} on rank {p}" for p, s in sorted(ahead.items()))
                + "; call asynctp.reset(group) on every rank"
            )
        if any(words[i + 1] != sig for i in slots):
            # only now: every rank's fields, to name them (all ranks are here, they all saw it)
            everyone = exchange(self.group, self.op, self.call, tag=f"mismatch-{seq}")
            raise CallMismatchError(describe_mismatch(self.group_name, seq, everyone))

    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        self._sent[dst_rank][channel] += 1
        self._pads[dst_rank].words[self._slot(channel, _SIGNAL, self.rank)] = self._sent[dst_rank][channel]

    def wait_signal(self, src_rank: int, channel: int = 0, timeout: float | None = None) -> None:
        self._received[src_rank][channel] += 1
        count = self._received[src_rank][channel]
        what = f"signal #{count} on channel {channel}"
        self._wait_for(self._slot(channel, _SIGNAL, src_rank), count, what, src_rank, timeout)
