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

import ctypes
from typing import Any

__all__ = ["StreamOps", "load", "unavailable_reason"]

_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ: *addr == value
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a stream-scoped memory fence before the write

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

    def write(self, stream: int, address: int, value: int) -> None:
        """Enqueue on `stream`: *address = value, after everything before it on the stream."""
        rc = self._write(stream, address, value & 0xFFFFFFFF, _WRITE_DEFAULT)
        if rc:
            raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {rc}")

    def wait(self, stream: int, address: int, value: int) -> None:
        """Enqueue on `stream`: wait until *address == value."""
        rc = self._wait(stream, address, value & 0xFFFFFFFF, _WAIT_EQ)
        if rc:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {rc}")


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
