"""The cuda backend: torch.distributed._symmetric_memory buffers, peer-mapped over NVLink.

Peer buffers are plain device pointers in this process, so `dst.copy_(peer_view)` is a
cudaMemcpyAsync that runs on a copy engine and leaves every SM to the matmuls. Barriers and
signals are stream memory operations on flags in the signal pad (streamops.py: no SM, a few
microseconds of host time each); during CUDA-graph capture, and where the driver lacks them or
ASYNCTP_SIGNALS=torch, torch's stream-ordered signal-pad kernels. Multicast is never used.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from asynctp.config import warn_once
from asynctp.symm import streamops, watchdog
from asynctp.symm.rendezvous import exchange
from asynctp.symm.workspace import Workspace

__all__ = ["CudaWorkspace"]

_SIGNALS_ENV = "ASYNCTP_SIGNALS"  # "torch": torch's signal kernels even in eager mode
FLAG_CHANNELS = 16  # channels per kind (barrier, signal); torch's kernels use the same numbers


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
        self._ops: streamops.StreamOps | None = None  # set by _grow when the flags fit
        self._flags: tuple[list[int], int] | None = None  # (signal pad pointers, our region's offset)
        # the last value written to each peer flag / awaited on each own flag, by address
        self._sent: dict[int, int] = {}
        self._awaited: dict[int, int] = {}
        self._abort: tuple[torch.cuda.Stream, torch.Tensor] | None = None
        self._grow(1 << 20)
        # made now: when the watchdog needs them, this process's streams may all be stuck
        self._abort = (torch.cuda.Stream(self.device), torch.zeros((), dtype=torch.bool, device=self.device))
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
        # a fresh signal pad is zeroed: every flag's count starts again (all ranks grow together)
        self._sent, self._awaited = {}, {}
        self._flags, why = _flag_region(handle, self.world_size)
        self._ops = streamops.load() if self._flags is not None else None
        if self._ops is None:
            why = why or streamops.unavailable_reason()
            warn_once("torch-signal-kernels", f"asynctp: barriers and signals use torch's signal kernels ({why}); each one "
                      "costs more host time and holds an SM while it waits")

    def uses_stream_ops(self) -> bool:
        """Whether the next barrier/signal is a stream memory operation (see streamops.py)."""
        return self._ops is not None and not torch.cuda.is_current_stream_capturing()

    def abort_device(self) -> None:
        """Kill this process's CUDA context, as torch's signal kernels do when their wait times
        out: the watchdog calls this for a stream wait, which has no timeout of its own. On a
        stream of its own, every flag of this rank's pad that a wait was enqueued on is set to the
        last value awaited, so no stream stays stuck (a device-side error alone leaves a
        front-end wait, and every synchronize, hanging), then a device-side assert fires,
        microseconds later, long before the work after a wait can finish. Every later CUDA call
        in the process raises."""
        if self._abort is None:
            return
        stream, false = self._abort
        if self._ops is not None:
            for address, value in list(self._awaited.items()):
                self._ops.write(stream.cuda_stream, address, value)
        with torch.cuda.stream(stream):
            torch._assert_async(false)

    def _flag(self, kind: int, channel: int, src: int) -> int:
        """Byte offset in a signal pad of the flag that `src` sets for (kind, channel)."""
        return self._flags[1] + 4 * ((kind * FLAG_CHANNELS + channel) * self.world_size + src)

    @staticmethod
    def _next(counts: dict[int, int], address: int) -> int:
        """The flag at `address`'s next value (every write to a flag is matched by one wait on it,
        so both sides count alike)."""
        value = counts[address] = counts.get(address, 0) + 1
        return value

    def _raw(self, rank: int) -> torch.Tensor:
        return self._bufs[rank]

    def _ms(self, timeout: float | None) -> int:
        return int(self._timeout(timeout) * 1000)

    def _check_channel(self, channel: int) -> None:
        # torch's kernels index their flags by channel too: a larger one would reach ours
        if not 0 <= channel < FLAG_CHANNELS:
            raise ValueError(f"asynctp {self.op}: a channel requires 0 <= channel < {FLAG_CHANNELS}, got {channel}")

    def _watch(self, what: str, peer: int | None, seconds: float) -> bool:
        """Record a wait for the watchdog; returns whether it is a stream memory operation.
        Waits recorded into a CUDA graph run at replay, unseen by the host: not watched."""
        if torch.cuda.is_current_stream_capturing():
            return False
        self.pending = watchdog.Pending(self.op, what, peer, seconds, abort=self._ops is not None)
        return self._ops is not None

    def barrier(self, channel: int = 0, timeout: float | None = None) -> None:
        self._check_channel(channel)
        seconds = self._timeout(timeout)
        if not self._watch(f"barrier channel {channel}", None, seconds):
            self._handle.barrier(channel=channel, timeout_ms=int(seconds * 1000))
            return
        # every rank sets its flag in every peer's pad, then waits for each peer's in its own
        ops, (pads, _), rank = self._ops, self._flags, self.rank
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        mine = self._flag(0, channel, rank)
        for peer in range(self.world_size):
            if peer != rank:
                ops.write(stream, pads[peer] + mine, self._next(self._sent, pads[peer] + mine))
        for peer in range(self.world_size):
            if peer != rank:
                address = pads[rank] + self._flag(0, channel, peer)
                ops.wait(stream, address, self._next(self._awaited, address))

    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        self._check_channel(channel)
        if not self.uses_stream_ops():
            self._handle.put_signal(dst_rank, channel=channel, timeout_ms=self._ms(None))
            return
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        address = self._flags[0][dst_rank] + self._flag(1, channel, self.rank)
        self._ops.write(stream, address, self._next(self._sent, address))

    def wait_signal(self, src_rank: int, channel: int = 0, timeout: float | None = None) -> None:
        self._check_channel(channel)
        seconds = self._timeout(timeout)
        if not self._watch(f"signal channel {channel}", src_rank, seconds):
            self._handle.wait_signal(src_rank, channel=channel, timeout_ms=int(seconds * 1000))
            return
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        address = self._flags[0][self.rank] + self._flag(1, channel, src_rank)
        self._ops.wait(stream, address, self._next(self._awaited, address))


def _flag_region(handle, world_size: int) -> tuple[tuple[list[int], int] | None, str | None]:
    """((signal pad pointer per rank, byte offset of asynctp's flags), None), or (None, why).

    asynctp's flags take the end of each pad: 2 kinds x FLAG_CHANNELS channels x world_size
    uint32. torch's kernels take uint32 number channel * world_size + rank from the start."""
    if os.environ.get(_SIGNALS_ENV, "") == "torch":
        return None, f"{_SIGNALS_ENV}=torch"
    from torch._C._distributed_c10d import _SymmetricMemory

    try:
        pads = [int(p) for p in handle.signal_pad_ptrs]
        pad_bytes = int(_SymmetricMemory.signal_pad_size)
    except (AttributeError, RuntimeError) as exc:
        return None, f"this torch does not expose the signal pads ({exc})"
    ours = 2 * FLAG_CHANNELS * world_size * 4
    torchs = FLAG_CHANNELS * world_size * 4
    if ours + torchs > pad_bytes:
        return None, f"the signal pad ({pad_bytes} bytes) is too small for {world_size} ranks"
    return (pads, pad_bytes - ours), None
