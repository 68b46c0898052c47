"""The Workspace protocol: symmetric buffers and signals of one process group, and its cache.

Workspace contract (every op that touches a workspace keeps it; the pipelines rely on it):

- Each rank owns one byte buffer of the same size; `get_buffer(peer, ...)` views any rank's.
  Offsets are in bytes. Buffers grow on demand (`ensure`), collectively: every rank calls the
  same op with the same shapes, so they grow at the same call. Growth during CUDA-graph capture
  is an error: call `reserve(nbytes)` before capturing.
- Between two ops no rank has a remote access to any workspace pending. An op opens its remote
  accesses after a barrier that every rank entered after finishing its previous op, and closes
  them before it returns: with a barrier, or by waiting for the signal that follows every write
  a peer made into its buffer. Local writes at an op's start are therefore safe.
- Ops called on different streams are serialized on the workspace (the second waits for the
  first: they would share its bytes). For real concurrency, use one process group per stream.
  A call from a second host thread while one is in progress on the group raises ValueError.
- Every public op opens with `begin_call(op, names, values)` and closes with `end_call(exc)`.
  begin_call numbers the call and hashes its signature (the op and what the exchange depends
  on); the ranks compare it where their values already meet: on cpu in the signal pad before
  any data moves, on cuda as the value of the opening barrier's flags (cuda.py). A call that
  fails part-way (timeout, interrupt, mismatch) marks the workspace out of step: every later
  call raises OutOfStepError until asynctp.reset(group) on every rank.
- Results never alias the buffer: ops copy or compute out of it into fresh tensors.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from asynctp.config import get_timeout
from asynctp.symm.calls import Calls
from asynctp.symm.errors import CaptureGrowthError

__all__ = ["Workspace", "Lanes", "resolve_group", "group_name_of"]

NUM_CHANNELS = 64  # 2 barrier channels + one signal channel per row block
def resolve_group(group: Any) -> dist.ProcessGroup:
    """A ProcessGroup from a ProcessGroup, its name, a 1-D DeviceMesh, a (DeviceMesh, dim name)
    pair, or None (the default group, as torch.distributed's group=None); TypeError otherwise."""
    if isinstance(group, dist.ProcessGroup):  # (before the import below: every call resolves its group)
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, str):
        try:
            return c10d._resolve_process_group(group)
        except Exception as exc:  # torch raises several types for unknown names
            raise ValueError(f"group requires a known process group name, got {group!r}") from exc
    if group is None:
        if not dist.is_initialized():
            raise ValueError("group=None requires an initialized default process group, got none")
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group requires a 1-D DeviceMesh (or (mesh, dim name)), got a {group.ndim}-D mesh")
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, axis = group
        names = mesh.mesh_dim_names or ()
        if axis not in names:
            raise ValueError(f"group requires a dim name of the mesh {names}, got {axis!r}")
        return mesh.get_group(axis)
    raise TypeError(
        "group requires a torch.distributed.ProcessGroup or its name (str), a 1-D DeviceMesh, "
        f"a (DeviceMesh, dim name) pair or None, got {type(group).__name__}"
    )


def group_name_of(group: Any) -> str:
    """The name under which custom ops carry a group."""
    return resolve_group(group).group_name


class _Switch:
    """Make `stream` current for a block of work, then return to the caller's stream. Cheaper
    than torch.cuda.stream(): no torch.cuda.current_stream() query (tens of microseconds each)."""

    def __init__(self, lanes: Lanes, stream: torch.cuda.Stream) -> None:
        self.lanes, self.stream = lanes, stream

    def __enter__(self) -> None:
        self.lanes.active = self.stream
        _set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        self.lanes.active = self.lanes.caller
        _set_stream(self.lanes.caller)


def _set_stream(stream: torch.cuda.Stream) -> None:
    """torch.cuda.set_stream without its Python wrappers."""
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)


class Lanes:
    """The streams of one pipelined call: the caller's, a second compute stream, a copy stream.

    On CPU every method is a no-op and work runs in program order, so the same pipeline code
    serves both backends. Stream switches and events are made once and reused: the pipelines
    run in eager mode, where host time per call decides whether the GPU ever idles.
    """

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self._null = contextlib.nullcontext()
        self._events: list[Any] = []
        self._next_event = 0
        self.caller: Any = None  # the caller's stream, set by fork()
        self.active: Any = None  # the stream work is being queued on
        self._done: Any = None  # recorded on the caller's stream when an op has finished
        self._own_done: Any = None  # this object's completion event (_done is a lent one after some replays)
        # ops forked and ops joined (or abandoned): unequal while the host is still queuing an op,
        # when _done is the previous op's event and says nothing about this one's waits
        self.started = 0
        self.joined = 0
        if self.is_cuda:
            with torch.cuda.device(device):
                # High priority: otherwise CUDA may start the next matmul before the copy the
                # matmul after it needs, and the pipeline stalls on that copy.
                self.copy_stream = torch.cuda.Stream(priority=-1)
                self.side_stream = torch.cuda.Stream()
            self._copy = _Switch(self, self.copy_stream)
            self._side = _Switch(self, self.side_stream)
            self._sync_events = [torch.cuda.Event() for _ in range(3)]  # forked, copy joined, side joined
        self._index = device.index if device.index is not None else 0
        self._streams: dict[tuple, Any] = {}  # (id, device, type) -> its Stream object, made once
        self._forked_side = True

    def current(self) -> torch.cuda.Stream:
        """The current stream of the device (torch.cuda.current_stream() makes a new Stream object
        at every call; the same stream is the same object here)."""
        data = torch._C._cuda_getCurrentStream(self._index)
        stream = self._streams.get(data)
        if stream is None:
            if len(self._streams) > 64:
                self._streams.clear()
            stream = self._streams[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1],
                                                             device_type=data[2])
        return stream

    def fork(self, side: bool = True) -> None:
        """Side streams start after everything queued so far on the caller's stream, and after
        the previous op on this workspace if that one was queued on another stream: two ops in
        flight on different streams would share the workspace's bytes, so they are serialized.
        side=False: the op uses the copy stream only (the side stream is left out of fork and
        join). Events are made once and re-recorded: host time per call counts."""
        self._next_event = 0
        self.started += 1
        self._forked_side = side
        if self.is_cuda:
            previous = self.caller
            self.caller = self.active = self.current()
            # (not during CUDA-graph capture: waiting there on work recorded outside it is an
            # error, and capture starts after a device sync anyway)
            if self._done is not None and self.caller is not previous and not torch.cuda.is_current_stream_capturing():
                self.caller.wait_event(self._done)
            forked = self._sync_events[0]
            forked.record(self.caller)
            self.copy_stream.wait_event(forked)
            if side:
                self.side_stream.wait_event(forked)

    def join(self) -> None:
        """The caller's stream continues after all side work."""
        if self.is_cuda:
            copied, sided = self._sync_events[1], self._sync_events[2]
            copied.record(self.copy_stream)
            self.caller.wait_event(copied)
            if self._forked_side:
                sided.record(self.side_stream)
                self.caller.wait_event(sided)
            if torch.cuda.is_current_stream_capturing():
                self._done = None  # a captured op is ordered by the graph's replays, not by this event
            else:
                self._record_done(self.caller)
        self.joined = self.started  # after the record: the watchdog reads the counts, then _done

    def abandon(self) -> None:
        """An op raised between fork and join: no completion event is coming for it."""
        self.joined = self.started

    def replay(self, run: Callable[[], None], done: Any = None) -> None:
        """run() (a CUDA-graph replay of a whole op) on the current stream, ordered as fork and
        join order ops: after the previous op on this workspace, and the next op after it.
        done: the event to record as the op's completion (a lag mark's, runtime/lag.py), which
        this object then records no more (held while it is the last op's: holds())."""
        caller = self.current()
        if self._done is not None and self.caller is not None and caller is not self.caller:
            caller.wait_event(self._done)
        run()
        self.caller = self.active = caller
        self._record_done(caller, done)

    def holds(self, event: Any) -> bool:
        """`event` is the last op's completion, which the next op may wait for."""
        return event is self._done

    def _record_done(self, stream: Any, event: Any = None) -> None:
        """The op's completion: `event` recorded on `stream`, or else this object's own event."""
        if event is None:
            if self._own_done is None:
                self._own_done = torch.cuda.Event()
            event = self._own_done
        event.record(stream)
        self._done = event

    def copy(self) -> contextlib.AbstractContextManager:
        return self._copy if self.is_cuda else self._null

    def compute(self, step: int) -> contextlib.AbstractContextManager:
        """Even steps on the caller's stream, odd ones on the side stream."""
        return self._side if (self.is_cuda and step % 2 == 1) else self._null

    def mark(self) -> Any:
        """An event recorded on the active stream (None on CPU). Events are reused from call to
        call: a wait already enqueued is not affected by a later record."""
        if not self.is_cuda:
            return None
        if self._next_event == len(self._events):
            self._events.append(torch.cuda.Event())
        event = self._events[self._next_event]
        self._next_event += 1
        event.record(self.active)
        return event

    def wait(self, event: Any) -> None:
        """The active stream waits for `event`."""
        if event is not None:
            self.active.wait_event(event)


class Workspace(Calls, abc.ABC):
    """Symmetric buffers and signal pads shared by the ranks of one process group (and the
    state of its calls, calls.py)."""

    backend: str = "abstract"

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.group_name = group.group_name
        self.rank = group.rank()
        self.world_size = group.size()
        self.device = device
        self.lanes = Lanes(device)
        self.op = "workspace"  # the op of the call in progress (begin_call), named in timeout errors
        self.nbytes = 0
        self._views: dict[tuple, torch.Tensor] = {}  # get_buffer results, dropped on growth
        self.generation = 0  # bumped when the buffers are replaced (captured graphs go stale)
        self._on_close: list[Callable[[Workspace], None]] = []
        self._init_calls()

    def on_close(self, release: Callable[[Workspace], None]) -> None:
        """Call release(self) when the workspace is closed: what a layer above keeps per
        workspace (captured graphs) goes with it."""
        self._on_close.append(release)

    def close(self) -> None:
        """Release the buffers (the workspace is unusable afterwards)."""
        self._views.clear()
        releases, self._on_close = self._on_close, []
        for release in releases:
            release(self)

    # -- buffers ------------------------------------------------------------------------
    @abc.abstractmethod
    def _grow(self, nbytes: int) -> None:
        """Collectively replace every rank's buffer by one of `nbytes` bytes."""

    @abc.abstractmethod
    def _raw(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s whole buffer as a flat uint8 tensor addressable from here."""

    def ensure(self, nbytes: int) -> None:
        """Grow (collectively) so that every buffer holds at least `nbytes` bytes."""
        if nbytes <= self.nbytes:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CaptureGrowthError(
                f"asynctp {self.op}: the workspace of group {self.group_name!r} needs {nbytes} "
                f"bytes but holds {self.nbytes}, and it cannot grow during CUDA-graph capture; "
                f"call asynctp.reserve(group, {nbytes}) before capturing"
            )
        # Round up so a run of slowly growing shapes does not rendezvous at every call.
        self._views.clear()
        self._grow(max(nbytes, 2 * self.nbytes, 1 << 20))
        self.generation += 1

    def reserve(self, nbytes: int) -> None:
        """Size the buffers up front (needed before CUDA-graph capture). Collective."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"reserve requires a non-negative int of bytes, got {nbytes!r}")
        self.ensure(nbytes)

    def get_buffer(
        self, rank: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, offset: int = 0
    ) -> torch.Tensor:
        """A view of `rank`'s buffer: `shape` elements of `dtype` starting `offset` bytes in."""
        key = (rank, tuple(shape), dtype, offset)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._view(rank, shape, dtype, offset)
        return view

    def _view(self, rank: int, shape, dtype: torch.dtype, offset: int) -> torch.Tensor:
        itemsize = dtype.itemsize
        numel = 1
        for s in shape:
            numel *= int(s)
        if offset % itemsize:
            raise ValueError(f"get_buffer requires an offset aligned to {itemsize} bytes, got {offset}")
        end = offset + numel * itemsize
        if end > self.nbytes:
            raise ValueError(
                f"get_buffer requires {end} bytes, the workspace holds {self.nbytes}; call ensure() first"
            )
        return self._raw(rank)[offset:end].view(dtype).view(tuple(shape))

    # -- synchronization ------------------------------------------------------------------
    @abc.abstractmethod
    def barrier(self, channel: int = 0, timeout: float | None = None) -> None:
        """All ranks reach this point (stream-ordered on CUDA, blocking on CPU)."""

    @abc.abstractmethod
    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        """Tell `dst_rank` that what this rank wrote before this call is visible."""

    @abc.abstractmethod
    def wait_signal(self, src_rank: int, channel: int = 0, timeout: float | None = None) -> None:
        """Wait for one put_signal from `src_rank` on `channel`."""

    def _timeout(self, timeout: float | None) -> float:
        return get_timeout() if timeout is None else timeout
