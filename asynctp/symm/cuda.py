"""The cuda backend: torch.distributed._symmetric_memory buffers, peer-mapped over NVLink.

Peer buffers are plain device pointers in this process, so `dst.copy_(peer_view)` is a
cudaMemcpyAsync that runs on a copy engine and leaves every SM to the matmuls. Barriers and
signals are torch's stream-ordered signal-pad kernels (one tiny block each). Multicast is never
used.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from asynctp.symm import watchdog
from asynctp.symm.rendezvous import exchange
from asynctp.symm.workspace import Workspace

__all__ = ["CudaWorkspace"]


def _rendezvous(tensor: torch.Tensor, group_name: str):  # -> _SymmetricMemory
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return symm_mem.rendezvous(tensor, group_name)
    except RuntimeError:
        # torch releases that still need the group registered first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        return symm_mem.rendezvous(tensor, group_name)


class CudaWorkspace(Workspace):
    backend = "cuda"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group, torch.device("cuda", torch.cuda.current_device()))
        self._tensor: torch.Tensor | None = None
        self._handle = None
        self._bufs: list[torch.Tensor] = []
        self.pending: watchdog.Pending | None = None  # the last wait enqueued (see watchdog.py)
        self._grow(1 << 20)
        watchdog.watch(self)

    def _grow(self, nbytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if self._handle is not None:
            # Peers may still be reading our old buffer on their streams. Every rank drains its
            # device before the (collective) rendezvous, so once it returns no read is pending.
            torch.cuda.synchronize(self.device)
        tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        exchange(self.group, self.op, nbytes)  # every rank is here (with asynctp's timeout)
        handle = _rendezvous(tensor, self.group_name)
        self._bufs = [handle.get_buffer(r, (nbytes,), torch.uint8, 0) for r in range(self.world_size)]
        self._tensor, self._handle = tensor, handle
        self.nbytes = nbytes

    def _raw(self, rank: int) -> torch.Tensor:
        return self._bufs[rank]

    def _ms(self, timeout: float | None) -> int:
        return int(self._timeout(timeout) * 1000)

    def _watch(self, what: str, peer: int | None, seconds: float) -> None:
        # waits recorded into a CUDA graph run at replay, unseen by the host: not watched
        if not torch.cuda.is_current_stream_capturing():
            self.pending = watchdog.Pending(self.op, what, peer, seconds)

    def barrier(self, channel: int = 0, timeout: float | None = None) -> None:
        seconds = self._timeout(timeout)
        self._watch(f"barrier channel {channel}", None, seconds)
        self._handle.barrier(channel=channel, timeout_ms=int(seconds * 1000))

    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        self._handle.put_signal(dst_rank, channel=channel, timeout_ms=self._ms(None))

    def wait_signal(self, src_rank: int, channel: int = 0, timeout: float | None = None) -> None:
        seconds = self._timeout(timeout)
        self._watch(f"signal channel {channel}", src_rank, seconds)
        self._handle.wait_signal(src_rank, channel=channel, timeout_ms=int(seconds * 1000))
