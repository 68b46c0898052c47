"""The cuda backend: torch.distributed._symmetric_memory buffers, peer-mapped over NVLink.

Peer buffers are plain device pointers in this process, so `peer_view.copy_(src)` (or the
reverse) is a cudaMemcpyAsync that runs on a copy engine and leaves every SM to the matmuls. Barriers and
signals are stream memory operations on flags in the signal pad (streamops.py: no SM, a few
microseconds of host time each). asynctp's own graphs (runtime/graphs.py) capture the stream
operations and the watchdog watches their replays; a graph the caller captures gets them too, each
wait bracketed by its beacon (beacons.py), through which the watchdog times it. Where the driver
of any rank of the group lacks them (the ranks agree when the workspace grows), with TORCH_SIGNALS
set, and in a caller's capture without beacons: torch's stream-ordered signal-pad kernels, which
time out and trap on their own (the watchdog names their eager waits and asynctp's replays of
them first; in a caller's capture they are unwatched). Multicast is never used.

Flags are set by the peer and reset by their owner after the wait. A flag's next set must come
after its reset; the pipelines (runtime/pipeline.py) order it so: every op opens with barrier 0, and
after it each rank waits for something every peer issued after its own barrier-0 reset (the
closing barrier 1 of a pull all-gather, the pushed blocks' signals of a push all-gather and of a
reduce-scatter); the next
op's barrier-0 set is issued after those waits, and the signals of the next op after its
barrier 0.

Call agreement: the flags of barrier channel 0 (every op's opening barrier) are set to the
call's signature (Workspace.begin_call: a nonzero 32-bit hash of the op and what its exchange
depends on), and each rank waits for exactly its own signature in every peer's flag. Ranks that
made different calls never pass the barrier, so no data moves and no result is returned: the
watchdog names the op, the rank, the peer and the signature it expected once the timeout
passes, then aborts the CUDA context (as for any stuck wait). All other flags are set to 1.
A graph captured by runtime/graphs.py replays the signature of the call it captured, which is the
signature of every call it serves (its key holds the same fields); a graph the caller captured
replays the signature of the call captured there. The torch signal-kernel fallback does not
compare.

For the single-launch GEMM, which spins on the signal flags itself: `signal_flags(first,
count)` is a flat contiguous torch.uint32 view of this rank's own signal flags for channels
first .. first + count - 1, flag of (channel c, source rank s) at index (c - first) *
world_size + s, and `SIGNAL_VALUE` (1) is what a peer's put_signal writes there. The owner
resets a flag to 0 once it has seen it (as wait_signal does).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from asynctp.config import warn_once
from asynctp.symm import beacons, streamops, watchdog
from asynctp.symm.rendezvous import exchange
from asynctp.symm.workspace import Workspace

__all__ = ["CudaWorkspace"]

# True: torch's signal kernels even in eager mode (a debugging switch, not a setting)
TORCH_SIGNALS = False
FLAG_CHANNELS = 16  # channels per kind (barrier, signal); torch's kernels use the same numbers
SIGNAL_VALUE = 1  # what put_signal (and every barrier flag but channel 0's) writes


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
        self.gate: watchdog.Pending | None = None  # the last opening barrier, until the GPU passed it
        self._gate_passed: torch.cuda.Event | None = None
        self._ops: streamops.StreamOps | None = None  # set by _grow when the flags fit
        self._flags: tuple[list[int], int] | None = None  # (signal pad pointers, our region's offset)
        self._awaited: dict[int, int] = {}  # own flags a wait was enqueued on: address -> value awaited
        self.own_capture = False  # inside capturing() (runtime/graphs.py captures a call)
        self.beacons: beacons.Beacons | None = None  # the waits of the caller's captures (beacons.py)
        self._site: int | None = None  # the beacon of the captured wait being enqueued
        self._abort: tuple[torch.cuda.Stream, torch.Tensor] | None = None
        self._grow(1 << 20)
        self._agree_beacons()
        # made now: when the watchdog needs them, this process's streams may all be stuck
        # (high priority: the assert's kernel gets SMs before a released persistent GEMM's next tiles)
        self._abort = (torch.cuda.Stream(self.device, priority=-1),
                       torch.zeros((), dtype=torch.bool, device=self.device))
        # and the assert's kernel loaded now: CUDA loads a kernel at its first launch
        # (CUDA_MODULE_LOADING=LAZY, torch's default), and a load while a wait is stuck blocks
        with torch.cuda.stream(self._abort[0]):
            torch._assert_async(torch.ones((), dtype=torch.bool, device=self.device))
        watchdog.watch(self)

    def _grow(self, nbytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if self._handle is not None:
            # Peers may still be reading our old buffer on their streams. Every rank drains its
            # device before the (collective) rendezvous, so once it returns no read is pending.
            torch.cuda.synchronize(self.device)
        tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        # every rank is here (with asynctp's timeout), and says whether it has stream memory operations
        have_ops = not TORCH_SIGNALS and streamops.load() is not None
        ranks = exchange(self.group, self.op, (nbytes, have_ops), tag="grow")
        handle = _rendezvous(tensor, self.group_name)
        self._bufs = [handle.get_buffer(r, (nbytes,), torch.uint8, 0) for r in range(self.world_size)]
        self._tensor, self._handle = tensor, handle
        self.nbytes = nbytes
        self._awaited = {}  # a fresh signal pad is zeroed
        if self.beacons is not None:
            self.beacons.forget(self)  # graphs captured before are stale: their flags are the old pad's
        self._flags, why = _flag_region(handle, self.world_size)
        self._ops, why = _agreed_ops(self._flags is not None, [have for _, have in ranks], why)
        if self._ops is None:
            warn_once("torch-signal-kernels", f"asynctp: barriers and signals use torch's signal kernels ({why}); each one "
                      "costs more host time and holds an SM while it waits")

    def _agree_beacons(self) -> None:
        """Beacons on every rank of the group or on none (collective): a rank without them would
        wait inside a caller's capture on torch's kernels, whose flags its peers never set."""
        mine, why = beacons.for_device(self._ops.write, self.device) if self._ops is not None else (None, None)
        ranks = exchange(self.group, self.op, mine is not None, tag="beacons")
        lacking = [r for r, have in enumerate(ranks) if not have]
        if mine is not None and lacking:
            why = f"ranks {lacking} of the group have none"
        self.beacons = mine if not lacking else None
        if lacking and why is not None:
            warn_once("asynctp-beacons", f"asynctp: inside CUDA graphs the caller captures, barriers and signals use "
                      f"torch's signal kernels and the single-launch GEMM declines ({why})")

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The current stream captures a CUDA graph of asynctp's own (runtime/graphs.py), whose
        replays are watched (watch_replay): barriers and signals stay the stream memory operations
        eager calls use."""
        self.own_capture = True
        try:
            yield
        finally:
            self.own_capture = False

    def uses_stream_ops(self) -> bool:
        """Whether the next barrier/signal is a stream memory operation (see streamops.py): in a
        graph the caller captures, where the waits can have beacons (beacons.py)."""
        return self._ops is not None and (self.own_capture or self.beacons is not None
                                          or not torch.cuda.is_current_stream_capturing())

    def abort_device(self) -> None:
        """Kill this process's CUDA context, as torch's signal kernels do when their wait times
        out: the watchdog calls this for a stream wait, which has no timeout of its own. On a
        stream of its own, every flag that a wait of this process's workspaces on this device
        was enqueued on is set, so that no stream stays stuck (a device-side error alone leaves
        a front-end wait, and every synchronize, hanging); then a device-side assert fires,
        microseconds later, long before the work after a wait can finish. Every later CUDA call
        in the process raises. The flags and their values: those of the waits in the caller's
        graphs that are up now (beacons.py), of every wait in those graphs, of every eager wait
        (the value last awaited there), then of the waits up now again, so that a flag several
        waits share with different values (the opening barriers of different ops: each awaits its
        call's signature) is left with the value awaited there now. Returns once the process's
        GPU work has ended (a synchronize raised, or returned): the watchdog ends the process
        where that takes too long (a wait behind the released ones awaits another value)."""
        if self._abort is None:
            return
        stream, false = self._abort
        if self._ops is not None:
            workspaces = [self] + [ws for ws in watchdog.watched() if ws is not self and ws.device == self.device
                                   and getattr(ws, "_ops", None) is not None]
            every, now_up = self.beacons.release_pairs(workspaces) if self.beacons is not None else ([], [])
            # (copies: the caller's thread may be adding to them)
            eager = [pair for ws in workspaces for pair in ws._awaited.copy().items()]
            for address, value in now_up + every + eager + now_up:
                self._ops.write(stream.cuda_stream, address, value)
        with torch.cuda.stream(stream):
            torch._assert_async(false)
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001  (the assert's error, as expected; its type varies by release)
            pass

    def _flag(self, kind: int, channel: int, src: int) -> int:
        """Byte offset in a signal pad of the flag that `src` sets for (kind, channel)."""
        return self._flags[1] + 4 * ((kind * FLAG_CHANNELS + channel) * self.world_size + src)

    def _raw(self, rank: int) -> torch.Tensor:
        return self._bufs[rank]

    @staticmethod
    def _trap_ms(seconds: float) -> int:
        """The timeout of torch's signal kernel for a wait of `seconds`: two of the watchdog's
        periods longer, so that the watchdog names the wait before the kernel's trap takes the
        context down (a process that exits on the CUDA error would never print the line)."""
        return int((seconds + 2 * watchdog.PERIOD) * 1000)

    def _check_channel(self, channel: int) -> None:
        # torch's kernels index their flags by channel too: a larger one would reach ours
        if not 0 <= channel < FLAG_CHANNELS:
            raise ValueError(f"asynctp {self.op}: a channel requires 0 <= channel < {FLAG_CHANNELS}, got {channel}")

    def _watch(self, what: str | Callable[[], str], peer: int | None, seconds: float) -> bool:
        """Record a wait for the watchdog; returns whether it is a stream memory operation.
        A wait captured into a CUDA graph runs at replay: runtime/graphs.py watches the replay of
        its own graphs; in the caller's, the wait's beacon goes up (closed by _leave)."""
        if torch.cuda.is_current_stream_capturing():
            streams = self.uses_stream_ops()
            if self.own_capture or not streams:  # (asynctp's own capture: the replay is watched)
                return streams
            stream = torch._C._cuda_getCurrentRawStream(self.device.index)
            self._site = self.beacons.enter(stream, self, self.op, what, peer, seconds)
            return True
        self._site = None  # (one a failed capture left open)
        self.pending = watchdog.Pending(self.op, what, peer, seconds, abort=self._ops is not None)
        return self._ops is not None

    def _leave(self) -> None:
        """The captured wait just enqueued on the current stream is passed: its beacon goes down."""
        if self._site is not None:
            self.beacons.leave(torch._C._cuda_getCurrentRawStream(self.device.index), self._site)
            self._site = None

    def device_wait_done(self) -> None:
        """The kernel whose spins watch_device_wait announced is launched on the current stream."""
        self._leave()

    def watch_replay(self, op: str) -> None:
        """Tell the watchdog that the GPU now replays a CUDA graph of a call of `op` captured in
        capturing(): its barriers and signals are watched as one wait, named on timeout, and
        aborted where they are stream memory operations (torch's kernels trap on their own). Every
        replay is watched: otherwise the watchdog would still hold an earlier call's wait."""
        self.pending = watchdog.Pending(op, "the barriers and signals of a CUDA-graph replay", None,
                                        self._timeout(None), abort=self._ops is not None)

    def watch_device_wait(self, what: str | Callable[[], str], flags: torch.Tensor, value: int = SIGNAL_VALUE) -> None:
        """Tell the watchdog that the GPU now waits until every 32-bit word of `flags` (a device
        tensor: own signal flags, or a kernel's counters) equals `value`: a timeout names the op,
        the rank and `what`, then writes `value` into each word and aborts the context. For waits
        this workspace does not enqueue itself (a kernel's spins, wait_value)."""
        with self._batched(torch._C._cuda_getCurrentRawStream(self.device.index)):  # (a beacon's two writes)
            self._watch(what, None, self._timeout(None))
        base = flags.data_ptr()
        for i in range(flags.numel()):
            self._awaited_by(base + 4 * i, value)

    def wait_value(self, what: str | Callable[[], str], word: torch.Tensor, value: int, reset: bool) -> None:
        """The current stream waits until `word` (one 32-bit device word) equals `value`, a stream
        memory operation (no SM), watched as watch_device_wait says; reset: then writes 0 into it.
        One batch of stream operations (with the beacon's writes in a caller's capture)."""
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        with self._batched(stream):
            self.watch_device_wait(what, word, value)
            self._ops.wait(stream, word.data_ptr(), value)
            if reset:
                self._ops.write(stream, word.data_ptr(), 0)
            self._leave()

    def _batched(self, stream: int) -> contextlib.AbstractContextManager:
        """The stream memory operations enqueued on `stream` inside go to the GPU as one batch
        (streamops.StreamOps.batched: nothing else may be enqueued there)."""
        return self._ops.batched(stream) if self._ops is not None else contextlib.nullcontext()

    def _awaited_by(self, address: int, value: int) -> None:
        """The wait being enqueued waits until the word at `address` equals `value`: what the
        abort writes to release it (a wait captured in a caller's graph: its beacon's, only)."""
        if self._site is not None:
            self.beacons.awaits(self._site, address, value)
        else:
            self._awaited[address] = value

    def _wait_reset(self, stream: int, address: int, value: int = SIGNAL_VALUE) -> None:
        self._awaited_by(address, value)
        self._ops.wait(stream, address, value)
        self._ops.write(stream, address, 0)

    def signal_flags(self, first: int, count: int) -> torch.Tensor:
        """This rank's own signal flags for channels first .. first + count - 1: a flat
        contiguous torch.uint32 tensor, (channel c, source s) at (c - first) * world_size + s;
        a peer's put_signal writes SIGNAL_VALUE. Requires the stream-operation flags."""
        if self._flags is None:
            raise ValueError("signal_flags requires the stream-operation flags, got torch's signal kernels")
        if not (0 <= first and count >= 0 and first + count <= FLAG_CHANNELS):
            raise ValueError(f"signal_flags requires channels within [0, {FLAG_CHANNELS}), got {first}..{first + count - 1}")
        offset = self._flag(1, first, 0) // 4
        return self._handle.get_signal_pad(self.rank, (count * self.world_size,), torch.uint32, offset)

    def close(self) -> None:
        super().close()
        self._bufs, self._tensor, self._handle, self._ops = [], None, None, None

    def barrier(self, channel: int = 0, timeout: float | None = None) -> None:
        self._check_channel(channel)
        seconds = self._timeout(timeout)
        value = self.signature if channel == 0 else SIGNAL_VALUE
        if channel == 0 and value != SIGNAL_VALUE:
            op, seq, fields = self.op, self.seq, self.call  # (formatted only if the watchdog reports the wait)
            what = lambda: f"barrier channel 0 with the signature 0x{value:08x} of {op} (call {seq}: {_fields(fields)})"  # noqa: E731
        else:
            what = f"barrier channel {channel}"
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        with self._batched(stream):  # (a beacon's writes, the flags' writes and waits: one batch)
            if not self._watch(what, None, seconds):
                self._handle.barrier(channel=channel, timeout_ms=self._trap_ms(seconds))
                return
            # every rank sets its flag in every peer's pad, then waits for each peer's in its own
            ops, (pads, _), rank = self._ops, self._flags, self.rank
            mine = self._flag(0, channel, rank)
            for peer in range(self.world_size):
                if peer != rank:
                    ops.write(stream, pads[peer] + mine, value)
            for peer in range(self.world_size):
                if peer != rank:
                    self._wait_reset(stream, pads[rank] + self._flag(0, channel, peer), value)
            self._leave()
        if channel == 0 and not torch.cuda.is_current_stream_capturing():
            # the watchdog names this barrier, not a later wait, while the GPU has not passed it
            if self._gate_passed is None:
                self._gate_passed = torch.cuda.Event()
            self._gate_passed.record(torch.cuda.current_stream(self.device))
            self.pending.passed = self._gate_passed
            self.gate = self.pending


    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        self._check_channel(channel)
        if not self.uses_stream_ops():
            self._handle.put_signal(dst_rank, channel=channel, timeout_ms=self._trap_ms(self._timeout(None)))
            return
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        self._ops.write(stream, self._flags[0][dst_rank] + self._flag(1, channel, self.rank), 1)

    def wait_signal(self, src_rank: int, channel: int = 0, timeout: float | None = None) -> None:
        self._check_channel(channel)
        seconds = self._timeout(timeout)
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        with self._batched(stream):
            if not self._watch(f"signal channel {channel}", src_rank, seconds):
                self._handle.wait_signal(src_rank, channel=channel, timeout_ms=self._trap_ms(seconds))
                return
            self._wait_reset(stream, self._flags[0][self.rank] + self._flag(1, channel, src_rank))
            self._leave()


def _agreed_ops(flags: bool, ranks_have: list[bool], why: str | None) -> tuple[streamops.StreamOps | None, str | None]:
    """(the stream ops, None) where every rank of the group has them and the flags fit, else
    (None, why): a rank on torch's kernels never sets the flags its peers' stream waits watch."""
    ops = streamops.load() if flags else None
    if ops is None:
        return None, why or streamops.unavailable_reason()
    lacking = [r for r, have in enumerate(ranks_have) if not have]
    if lacking:
        return None, f"ranks {lacking} of the group have no stream memory operations"
    return ops, None


def _fields(call: tuple) -> str:
    """A call's (op, field names, values) as "name value, ..."."""
    _, names, values = call
    return ", ".join(f"{n} {v!r}" for n, v in zip(names, values))


def _flag_region(handle, world_size: int) -> tuple[tuple[list[int], int] | None, str | None]:
    """((signal pad pointer per rank, byte offset of asynctp's flags), None), or (None, why).

    asynctp's flags take the end of each pad: 2 kinds x FLAG_CHANNELS channels x world_size
    uint32. torch's kernels take uint32 number channel * world_size + rank from the start."""
    if TORCH_SIGNALS:
        return None, "asynctp.symm.cuda.TORCH_SIGNALS is set"
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
