"""The cpu backend: POSIX shared memory between the processes of one host.

Each rank maps every rank's segment, so reads and writes of peer buffers are real one-sided
accesses and the pipelines run unchanged under gloo (CI, CPU-only machines). Segments live in
/dev/shm; their names travel over the process group, and each creator unlinks its file once
every peer has mapped it, so nothing is left behind when a process dies.

Signal pad (a separate, never-resized segment per rank): int64 counters laid out as
[channel][kind][source rank], kind 0 = barrier epoch, kind 1 = signals sent. Only the source
rank writes its slot, so plain stores suffice (x86 keeps stores in order; copies done by glibc's
memcpy end with a store fence).
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

from asynctp.symm.errors import PeerTimeoutError, WorkspaceUnavailable
from asynctp.symm.rendezvous import exchange
from asynctp.symm.workspace import NUM_CHANNELS, Workspace

__all__ = ["CpuWorkspace"]

_BARRIER, _SIGNAL = 0, 1


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Segment:
    """One mapped shared-memory file."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.words = memoryview(self.mmap).cast("q")  # int64 view for the signal pad


class CpuWorkspace(Workspace):
    backend = "cpu"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group, torch.device("cpu"))
        self._pads = self._exchange(NUM_CHANNELS * 2 * self.world_size * 8)
        self._bufs: list[_Segment] = []
        self._epoch = [0] * NUM_CHANNELS
        self._sent = [[0] * NUM_CHANNELS for _ in range(self.world_size)]
        self._received = [[0] * NUM_CHANNELS for _ in range(self.world_size)]

    def _exchange(self, nbytes: int) -> list[_Segment]:
        """Collectively create one segment per rank and map all of them."""
        path = os.path.join(_shm_dir(), f"asynctp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        own = _Segment(path, nbytes, create=True)
        try:
            infos = exchange(self.group, self.op, (_host_id(), path))
            hosts = {host for host, _ in infos}
            if len(hosts) > 1:
                raise WorkspaceUnavailable(
                    f"the cpu backend needs every rank on one host, group {self.group_name!r} "
                    f"spans {len(hosts)} hosts"
                )
            segs = [own if r == self.rank else _Segment(p, nbytes, create=False) for r, (_, p) in enumerate(infos)]
            # every rank has mapped every segment before any file disappears
            exchange(self.group, self.op, None)
        finally:
            os.unlink(path)
        return segs

    def _grow(self, nbytes: int) -> None:
        self._bufs = self._exchange(nbytes)
        self.nbytes = nbytes

    def _raw(self, rank: int) -> torch.Tensor:
        return self._bufs[rank].tensor

    def _slot(self, channel: int, kind: int, src: int) -> int:
        return (channel * 2 + kind) * self.world_size + src

    def _wait_for(self, index: int, value: int, what: str, peer: int, timeout: float | None) -> None:
        words = self._pads[self.rank].words
        if words[index] >= value:
            return
        limit = self._timeout(timeout)
        deadline = time.monotonic() + limit
        delay = 1e-6
        while words[index] < value:
            if time.monotonic() > deadline:
                raise PeerTimeoutError(self.op, self.rank, peer, what, limit, self.group_name)
            # back off: with more ranks than cores a busy spin starves the peer we wait for
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def barrier(self, channel: int = 0, timeout: float | None = None) -> None:
        self._epoch[channel] += 1
        epoch = self._epoch[channel]
        mine = self._slot(channel, _BARRIER, self.rank)
        for pad in self._pads:
            pad.words[mine] = epoch
        for peer in range(self.world_size):
            what = f"barrier (channel {channel}, epoch {epoch})"
            self._wait_for(self._slot(channel, _BARRIER, peer), epoch, what, peer, timeout)

    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        self._sent[dst_rank][channel] += 1
        self._pads[dst_rank].words[self._slot(channel, _SIGNAL, self.rank)] = self._sent[dst_rank][channel]

    def wait_signal(self, src_rank: int, channel: int = 0, timeout: float | None = None) -> None:
        self._received[src_rank][channel] += 1
        count = self._received[src_rank][channel]
        what = f"signal #{count} on channel {channel}"
        self._wait_for(self._slot(channel, _SIGNAL, src_rank), count, what, src_rank, timeout)
