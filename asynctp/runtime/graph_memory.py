"""GPU memory that asynctp's CUDA graphs reserve on a device, and the auto policy's budget for it.

A graph keeps its outputs (and what its capture freed) in a private memory pool. Where the
caller's activations are a large call's outputs, a graph holds a second copy of memory the
general pool reserves too: in torchtitan's eager loop (2xH200, 8B-shaped, 4 layers, seq 8192)
asynctp's graphs reserved 4.3 GiB beside the 10.3 GiB of the run without them, for no step time
(96.3 vs 95.9 ms). torch keeps a dropped graph's pool reserved until memory runs short or
`empty_cache` is called, so what captures reserved is counted as spent for good.

Under ASYNCTP_GRAPHS=auto a large call is captured only while the graphs' reservations on its
device, with the new graph's outputs, stay within GRAPH_MEMORY_SHARE of the rest of the memory
the process has reserved (the training targets allow asynctp 5% more peak memory than plain TP),
or within GRAPH_MEMORY_FLOOR where that is more (a process that reserves little memory, such as a
benchmark of one op, has it to spare: 2xH100, all_gather_matmul at M 2048 ran eagerly under the
share alone, 769 us a call; 177 replayed with the floor), unless the loop is host-bound
(runtime/graphs.py: BUDGET_BUSY). 2xH100, torchtitan's eager loop (bf16): 11.03 GiB peak
reserved, flat from step 6, against default TP's 10.60.

cuda_capture() captures a call into a CUDA graph, in the memory pool of a dropped graph where the
cache has one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["GRAPH_MEMORY_SHARE", "GRAPH_MEMORY_FLOOR", "GraphMemory", "memory_of", "cuda_capture"]

GRAPH_MEMORY_SHARE = 0.04  # graphs' reservations / the rest of the process's reserved memory (auto)
GRAPH_MEMORY_FLOOR = 256 << 20  # bytes graphs may reserve however little the rest is (the share of 6.4 GiB)
READ_SECONDS = 0.01  # the reserved total read at most this often (a dict built by the allocator)

R = TypeVar("R")


class GraphMemory:
    """What captures on one device reserved (`spent`), against the process's reserved total."""

    def __init__(
        self, reserved: Callable[[], int], clock: Callable[[], float] = time.perf_counter, floor: int = GRAPH_MEMORY_FLOOR
    ) -> None:
        self._reserved = reserved
        self._clock = clock
        self.floor = floor
        self.spent = 0  # bytes the captures' pools reserved (never given back: see the module docstring)
        self._total = 0
        self._read_at = float("-inf")

    def capture(self, fn: Callable[[], R]) -> R:
        """fn() (a capture), its new reservation added to `spent`."""
        before = self._reserved()
        try:
            return fn()
        finally:
            self._total = self._reserved()
            self._read_at = self._clock()
            self.spent += max(0, self._total - before)

    def allows(self, nbytes: int) -> bool:
        """Whether a graph reserving `nbytes` more keeps the graphs within GRAPH_MEMORY_SHARE of the
        rest of the reserved memory, or within the floor."""
        now = self._clock()
        if now - self._read_at > READ_SECONDS:
            self._total, self._read_at = self._reserved(), now
        return self.spent + nbytes <= max(GRAPH_MEMORY_SHARE * (self._total - self.spent), self.floor)


_by_device: dict[int, GraphMemory] = {}


def memory_of(device: Any) -> GraphMemory:
    """The GraphMemory of a CUDA device (one per process: every workspace's captures on it count)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    memory = _by_device.get(index)
    if memory is None:
        memory = _by_device[index] = GraphMemory(lambda: _reserved_bytes(index))
    return memory


def _reserved_bytes(index: int) -> int:
    # the allocator's nested stats (torch.cuda.memory_reserved flattens all of them in Python)
    return torch._C._cuda_memoryStats(index)["reserved_bytes"]["all"]["current"]


def cuda_capture(cache: Any, body: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """Capture body() into a CUDA graph on the cache's capture stream, into the memory pool of a
    dropped graph where the cache has one (cache.donor()); (graph.replay, result)."""
    caller = torch.cuda.current_stream()
    stream = cache.capture_stream()
    stream.wait_stream(caller)
    # the donor lives until the capture ended: torch counts a pool's graphs, and a graph goes only
    # outside a capture; a pool id whose graphs are all gone is not taken (2.11's host allocator asserts)
    graph, donor = torch.cuda.CUDAGraph(), cache.donor()
    with torch.cuda.stream(stream):
        # thread_local: the watchdog thread's event queries must not invalidate the capture
        graph.capture_begin(pool=None if donor is None else donor.__self__.pool(), capture_error_mode="thread_local")
        try:
            with cache.ws.capturing():  # barriers and signals: the stream operations eager calls use
                result = body()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001  (the capture is already invalid)
                pass
            raise
        graph.capture_end()
    return graph.replay, result

