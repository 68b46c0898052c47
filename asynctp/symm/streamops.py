"""CUDA stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32) through ctypes.

Why: torch's symmetric-memory barrier and signal calls are kernels. Measured on 2xH200 (torch
2.11; docs/performance.md), inside a pipelined call each of those launches blocked the host
for 300-650 us, so a call's host time equalled its device time (616 vs 608 us for the fp8
all-gather at M 4096, whose CUDA-graphed replay takes 213 us). A stream memory operation is
executed by the GPU's front end: the write needs no SM, the wait holds no SM (a spinning wait
kernel does, and cannot start while a persistent GEMM holds them all), and enqueuing either costs
the host a few microseconds. Nothing is compiled: the driver's C entry points are called directly.

The flags live in the workspace's signal pad (peer-mapped, zeroed at allocation), in a region
torch's own signal kernels do not touch. A flag is set (1) by the peer and, once waited for,
reset (0) by its owner, so the same operations replay correctly from a captured CUDA graph (a
counter's values would be baked into the graph) and eager and replayed calls interoperate
across ranks. Set/reset needs every reuse of a flag to be ordered after the owner's reset: the
pipelines guarantee it (each op opens with a barrier and, after it, makes every rank wait for
something each peer did after that barrier; see symm/cuda.py). Two bare barriers in a row on
one channel do not (a fast peer's second set can land before the first reset and be lost).

A stream wait has no timeout of its own: asynctp's watchdog (watchdog.py) enforces it, naming
the wait and then aborting the CUDA context with a device-side assert, as torch's signal kernels
trap on theirs. Capturing these operations into a CUDA graph and replaying them, interleaved
with eager rounds, was checked on 2xH200 (2000 rounds).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

from asynctp.config import warn_once

__all__ = ["StreamOps", "load", "unavailable_reason", "WAIT", "WRITE"]

_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ: *addr == value
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a stream-scoped memory fence before the write
WAIT, WRITE = 1, 2  # CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_MEM_OP_WRITE_VALUE_32: the kinds of a batch's operations
MAX_BATCH = 255  # operations per cuStreamBatchMemOp call ("must be less than 256")


class _Param(ctypes.Structure):
    """CUstreamBatchMemOpParams (a 48-byte union) as its wait and write members lay it out: the
    operation, the address, the value (a 32-bit one in the low half of the 64-bit slot), flags."""

    _fields_ = [("operation", ctypes.c_uint32), ("_pad0", ctypes.c_uint32), ("address", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("_pad1", ctypes.c_uint32),
                ("alias", ctypes.c_uint64), ("_pad2", ctypes.c_uint64)]

_loaded: StreamOps | None = None
_reason: str | None = None


class StreamOps:
    """The two driver calls, each raising RuntimeError on a CUresult other than CUDA_SUCCESS."""

    def __init__(self, lib: Any) -> None:
        self._write = _entry(lib, "cuStreamWriteValue32")
        self._wait = _entry(lib, "cuStreamWaitValue32")
        for fn in (self._write, self._wait):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        try:
            self._batch = _entry(lib, "cuStreamBatchMemOp")
            self._batch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
            self._batch.restype = ctypes.c_int
        except OSError:
            self._batch = None
        self._arrays: dict[tuple, Any] = {}  # a batch's operations -> their parameter array, made once
        self._local = threading.local()  # .pending: (stream, operations) of this thread's open batch

    @contextlib.contextmanager
    def batched(self, stream: int) -> Iterator[None]:
        """write() and wait() on `stream` from this thread inside go to the GPU as one batch()
        when the block ends (also where it raises: what came before was enqueued before too).
        Only these operations belong inside: work that other streams order themselves after
        (an event recorded on `stream`) would be enqueued before them. A block inside another
        one joins it (its operations on the outer block's stream; others are enqueued at once)."""
        if getattr(self._local, "pending", None) is not None:
            yield
            return
        ops: list[tuple[int, int, int]] = []
        self._local.pending = (stream, ops)
        try:
            yield
        finally:
            self._local.pending = None
            if ops:
                self.batch(stream, tuple(ops))

    def write(self, stream: int, address: int, value: int) -> None:
        """Enqueue on `stream`: *address = value, after everything before it on the stream."""
        self._enqueue(stream, WRITE, address, value)

    def wait(self, stream: int, address: int, value: int) -> None:
        """Enqueue on `stream`: wait until *address == value."""
        self._enqueue(stream, WAIT, address, value)

    def _enqueue(self, stream: int, kind: int, address: int, value: int) -> None:
        """One operation: into this thread's open batch on `stream`, else one driver call."""
        pending = getattr(self._local, "pending", None)
        if pending is not None and pending[0] == stream:
            pending[1].append((kind, address, value))
            return
        wait = kind == WAIT
        rc = (self._wait if wait else self._write)(stream, address, value & 0xFFFFFFFF,
                                                   _WAIT_EQ if wait else _WRITE_DEFAULT)
        if rc:
            raise RuntimeError(f"cuStream{'Wait' if wait else 'Write'}Value32 failed with CUresult {rc}")

    def batch(self, stream: int, ops: tuple[tuple[int, int, int], ...]) -> None:
        """Enqueue on `stream`, in their order, the operations (kind, address, value): WAIT until
        *address == value, or WRITE *address = value (after a stream-scoped fence, as write()).
        One driver call, and in a captured CUDA graph one node: a graph's launch costs the host
        1-2 us per memory-operation node, and about as much for a batch's node as for one of
        them (docs/performance.md). One call per operation where the driver has no batches, or
        refused one (once: a warning says so)."""
        if self._batch is not None and 1 < len(ops) <= MAX_BATCH:
            array = self._arrays.get(ops)
            if array is None:
                if len(self._arrays) >= 1024:  # operations of flags that moved (workspaces made again)
                    self._arrays.clear()
                array = self._arrays[ops] = (_Param * len(ops))()
                for param, (kind, address, value) in zip(array, ops):
                    param.operation, param.address, param.value = kind, address, value & 0xFFFFFFFF
                    param.flags = _WAIT_EQ if kind == WAIT else _WRITE_DEFAULT
            rc = self._batch(stream, len(ops), array, 0)
            if not rc:
                return
            warn_once("asynctp-batch-memops", f"asynctp: the CUDA driver refused a batch of stream memory operations "
                      f"(cuStreamBatchMemOp, CUresult {rc}); each is enqueued on its own (more host time per call)")
            self._batch = None
        for op in ops:  # (called inside an open batch on `stream`, they join it)
            self._enqueue(stream, *op)


def _entry(lib: Any, name: str) -> Any:
    # CUDA 12+ exports the unversioned name as the v1 API (which needed a driver option) and the
    # current one as *_v2
    for symbol in (f"{name}_v2", name):
        try:
            return getattr(lib, symbol)
        except AttributeError:
            continue
    raise OSError(f"libcuda has no {name}")


def load() -> StreamOps | None:
    """The stream ops of this process's CUDA driver, or None (see unavailable_reason())."""
    global _loaded, _reason
    if _loaded is None and _reason is None:
        try:
            _loaded = StreamOps(ctypes.CDLL("libcuda.so.1"))
        except OSError as exc:
            _reason = f"the CUDA driver's stream memory operations are unavailable ({exc})"
    return _loaded


def unavailable_reason() -> str | None:
    load()
    return _reason
