"""Eager pipelined calls replayed from CUDA graphs, captured per call signature.

Why: an eager pipelined call issues 10-40 launches (copies, GEMMs, events, stream switches,
barriers). On 2xH200 that took the host 340-550 us per call, longer than the GPU work it issued
(200-370 us at M 4096), so the eager pipeline lost to serial although its graphed replay beat
serial by 1.3-1.5x. Replaying a captured graph costs the host about 10 us.

How: a call's key is its op, every input tensor's address, shape, strides and dtype, its scalars
and the settings that shape the pipeline. A key's first call runs eagerly (warming cuBLAS, sizing
the workspace); its second (auto: see When) is captured on a capture stream and replayed; later
calls replay. A replay reads the inputs' current contents and writes its outputs into a private
pool. Outputs are never overwritten while the caller holds them: a graph is replayed only when no
tensor outside the cache shares its outputs' storage (torch's storage use count); otherwise another
graph is captured for the key (up to MAX_PER_KEY), or the call runs eagerly. A public op's call
equal to one that replayed replays directly, without its checks (ops/repeat.py).

Safe across ranks: barriers and signals are the same flags, set and reset, whether eager or
replayed (symm/cuda.py), so a rank may replay while its peer runs eagerly or captures. A workspace
that grows drops its graphs; every rank grows at the same call.

Not used: on CPU, inside the caller's own capture, under torch.compile's tracing, with
ASYNCTP_GRAPHS=0. Memory: each graph keeps its intermediates and outputs. A graph whose key has not
come back for twice its period (a loop whose activations moved) is dropped at the next capture,
which takes its memory pool: torch keeps a dropped graph's pool reserved, so a loop whose addresses
churn would otherwise reserve more at every capture. The last MAX_DONORS dropped graphs stay until
a capture takes their pool (torch frees a pool under memory pressure only once its graphs are
gone). At most MAX_GRAPHS (64) graphs per workspace, least recently used dropped first; clear()
drops them all, and a workspace's go when it is closed (asynctp.reset) or collected. A shape with
WASTED_PER_SHAPE graphs never replayed or dropped before PAYBACK_REPLAYS replays is no longer
captured, with one warning: a capture costs milliseconds of host time.

When (ASYNCTP_GRAPHS=auto, the default): where the GPU runs behind the host (training steps of large
matmuls), an eager call's host time is hidden and a graph only holds memory (2xH200, 8B-shaped
block, batch 2: 129.8 ms a step with and without graphs; peak reserved 33.9 GiB with, 17.6 without).
So a key is captured only once the GPU was less than LAG_SECONDS (10 ms, runtime/lag.py) behind the
host at CAPTURE_SIGHTINGS of its sightings in a row: a loop that waits for the GPU every few steps
sees its keys idle once per wait, and graphs would only hold memory (compiled 8B-shaped stack, batch
1, a wait every 10 steps: 34 graphs, 1.16x vanilla's peak). A key found behind at DECIDE_SIGHTINGS
sightings runs eagerly ("gpu-bound", as do the sightings before a capture) until it is seen idle at
DECIDE_SIGHTINGS sightings in a row (the calls turned host-bound). A large key is captured only
within the graphs' memory budget (runtime/graph_memory.py: their reservations within
GRAPH_MEMORY_SHARE of the rest, or GRAPH_MEMORY_FLOOR; else "memory"), unless the loop is host-bound
(the GPU behind at under BUDGET_BUSY of the lag marks: there graphs buy step time; 2xH100, compiled
fp8 8B-shaped stack, the budget held: 94.5 ms a step vs 63.4). Keys under SMALL_CALL_BYTES of inputs
and outputs are captured at their second call regardless: little memory, and at a run's start one
rank's compilation stalls make its peer look "behind" (2xH200, a tiny fp8 model: 21 of 23 calls of
one rank left eager). ASYNCTP_GRAPHS=1 captures every key at its second call; 0 never captures.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from asynctp.config import get_config, warn_once
from asynctp.runtime.graph_memory import GraphMemory, cuda_capture, memory_of
from asynctp.runtime.keys import Entry, flatten, strip, tensor_key, tensor_keys
from asynctp.runtime.lag import Lag
from asynctp.runtime.moves import Moves

__all__ = ["mode", "enabled", "usable", "tensor_key", "call", "replayed", "clear", "stats", "GraphCache"]

MAX_GRAPHS = 64  # per workspace
DECIDE_SIGHTINGS = 3  # sightings found behind before a key runs eagerly for good (auto)
CAPTURE_SIGHTINGS = 3  # auto: sightings in a row on an idle GPU (the first included) before a large key is captured
SMALL_CALL_BYTES = 32 << 20  # auto: a key with fewer bytes of inputs + outputs is captured regardless of the queue
MAX_PER_KEY = 4  # graphs of one key whose outputs are all held by the caller
WASTED_PER_SHAPE = 8  # graphs of a shape dropped unpaid, or never replayed: then that shape runs eagerly
MAX_DONORS = 8  # dropped graphs kept (never replayed) until a capture takes their memory pool
PAYBACK_REPLAYS = 8  # a graph dropped after fewer replays did not pay for its capture (milliseconds of host time)
BUDGET_BUSY = 0.1  # auto: the graphs' memory budget holds where the GPU was behind at this share of lag marks or more
_SEEN_KEYS = 512  # keys seen but not captured yet, least recent forgotten

_REASONS = ("new key", "outputs held", "shape off", "gpu-bound", "memory")  # why calls ran eagerly (GraphCache)


def mode() -> str:
    """Config.graphs (ASYNCTP_GRAPHS): "auto" (default), "1" (capture every recurring call), "0"."""
    return get_config().graphs


def enabled() -> bool:
    return mode() != "0"


def usable(ws: Any) -> bool:
    """Whether this call may go through the graph cache of `ws`."""
    return (ws is not None and ws.backend == "cuda" and enabled()
            and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling())


class GraphCache:
    """The captured calls of one workspace (see the module docstring). It holds the workspace
    weakly: the caches are kept per workspace, and a workspace's goes when it is collected."""

    def __init__(self, ws: Any, capture: Callable | None = None, lag: Lag | None = None,
                 memory: GraphMemory | None = None) -> None:
        self._ws = weakref.ref(ws)
        self._capture = capture or cuda_capture
        self._memory = memory  # its device's (graph_memory.memory_of), once a capture needs it
        self._donors: list[Callable[[], None]] = []  # dropped graphs (their replay), whose pools the next captures take
        self.lag = lag or Lag(held=lambda event, ref=self._ws: (w := ref()) is not None and w.lanes.holds(event))
        self._generation = ws.generation
        self._entries: OrderedDict[tuple, list[Entry]] = OrderedDict()
        # key -> ((bytes of inputs + first outputs, of outputs), sightings in a row on an idle GPU (auto), call last seen)
        self._seen: OrderedDict[tuple, tuple[tuple[int, int], int, int]] = OrderedDict()
        self._calls = 0  # calls through this cache
        self._dropped: dict[tuple, int] = {}  # shape -> its graphs dropped before PAYBACK_REPLAYS replays
        self._off: set[tuple] = set()  # shapes that run eagerly from now on
        self._behind: OrderedDict[tuple, int] = OrderedDict()  # key -> sightings behind (auto); DECIDE: eager
        self._idle: dict[tuple, int] = {}  # gpu-bound key -> sightings in a row on an idle GPU since
        self._stream: torch.cuda.Stream | None = None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}
        self.replayed: tuple | None = None  # the key of the last call, where its result came from a graph
        self.direct = 0  # replays of ops/repeat.py (replay_ready: the op's checks and plan skipped)
        self.closed = False  # its workspace was closed (asynctp.reset): it takes no more calls
        # why calls ran eagerly: "new key" (inputs at addresses not seen lately), "outputs held" (every
        # graph of the key has outputs the caller holds, and the key has MAX_PER_KEY), "shape off" (too
        # many graphs of the shape wasted, or its capture failed), "gpu-bound" (auto: the GPU ran behind
        # the host at its sightings, or has not been idle at CAPTURE_SIGHTINGS of them in a row yet),
        # "memory" (auto: a large key's graph would exceed the graphs' memory budget)
        self.eager_reasons = dict.fromkeys(_REASONS, 0)
        self.moves = Moves()  # the new keys' inputs at new addresses, per op and tensor

    @property
    def ws(self) -> Any:
        return self._ws()

    @property
    def memory(self) -> GraphMemory:
        if self._memory is None:
            self._memory = memory_of(self.ws.device)
        return self._memory

    def capture_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.ws.device)
            # cuBLAS(Lt) sets up a stream's workspace on its first GEMM there: not during capture
            with torch.cuda.stream(self._stream):
                x = torch.zeros((16, 16), device=self.ws.device, dtype=torch.bfloat16)
                torch.mm(x, x)
                if torch.cuda.get_device_capability(self.ws.device) >= (8, 9):
                    f8 = x.to(torch.float8_e4m3fn)
                    one = torch.ones((), device=self.ws.device)
                    try:
                        torch._scaled_mm(f8, f8.t(), one, one, out_dtype=torch.bfloat16)
                    except RuntimeError:  # no fp8 GEMM in this build: no fp8 op will be captured
                        pass
            torch.cuda.current_stream(self.ws.device).wait_stream(self._stream)
        return self._stream

    def donor(self) -> Callable[[], None] | None:
        """A dropped graph (its replay) whose memory pool the next capture takes, reusing its memory:
        torch keeps a dropped graph's own pool reserved. None: the capture gets a pool of its own."""
        return self._donors.pop() if self._donors else None

    def clear(self) -> None:
        self._entries.clear()
        self._donors.clear()
        self._seen.clear()
        self._dropped.clear()
        self._off.clear()
        self._behind.clear()
        self._idle.clear()

    def _stale(self, shape: tuple) -> int:
        """Graphs of `shape` never replayed although more calls came since their capture than
        there are graphs (+4): a loop that calls each of its keys once per iteration brings a key
        back within that many calls (two alternating address sets too: both are captured by then)."""
        horizon = self._count() + 4
        return sum(1 for entries in self._entries.values() for e in entries
                   if e.shape == shape and e.replays == 0 and self._calls - e.born > horizon)

    def _count(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def call(self, op: str, key: tuple, body: Callable[[], Any]) -> Any:
        """body()'s result, from a replay where possible. op: the call's op, named in warnings
        and by the watchdog; key: everything the call depends on (tensor_key() of each input,
        scalars, settings)."""
        ws = self.ws
        if ws.generation != self._generation:  # the buffers (and flags) were replaced
            self.clear()
            self._generation = ws.generation
        entry = self.ready(key)
        if entry is not None:
            return self.replay_ready(op, key, entry, direct=False)
        self._calls += 1
        auto = mode() == "auto"
        if auto:
            self.lag.mark()
        entries = self._entries.get(key)  # (every graph of it holds outputs the caller holds)
        if entries is not None:
            self._entries.move_to_end(key)
        elif auto and self._behind.get(key, 0) >= DECIDE_SIGHTINGS:
            self._behind.move_to_end(key)
            # decided gpu-bound; the GPU idle at DECIDE_SIGHTINGS sightings in a row (the calls
            # now start on an idle GPU: the host is the bottleneck) undoes the decision
            idle = 0 if self.lag.behind() else self._idle.get(key, 0) + 1
            if idle < DECIDE_SIGHTINGS:
                self._idle[key] = idle
                return self._eager(body, "gpu-bound")
            del self._behind[key]
            self._idle.pop(key, None)
            self._seen[key] = (self._seen.get(key, ((0, 0),))[0], CAPTURE_SIGHTINGS, 0)  # captured now
        shape = strip(key)  # (not on the replay path above: it walks the whole key)
        if shape in self._off or (entries is None and key not in self._seen) or (
            entries is not None and len(entries) >= MAX_PER_KEY
        ):
            reason = "shape off" if shape in self._off else ("new key" if entries is None else "outputs held")
            idle = reason == "new key" and auto and not self.lag.behind()  # (the queue the call starts behind)
            result = self._eager(body, reason)
            if reason == "new key":  # (a shape that is off never comes back to be captured)
                tensors = tensor_keys(key)
                out_bytes = sum(t.numel() * t.element_size() for t in flatten(result)[0])
                nbytes = (sum(t[1].numel() * t[3].itemsize for t in tensors) + out_bytes, out_bytes)
                self._seen[key] = (nbytes, int(idle), self._calls)
                self.moves.note(op, shape, [t[0] for t in tensors])
                if len(self._seen) > _SEEN_KEYS:
                    self._seen.popitem(last=False)
            return result
        nbytes, idle_run, sighted = self._seen.pop(key, ((0, 0), 0, 0))
        if entries:  # another graph of the key (the caller holds the others' outputs)
            nbytes = entries[0].nbytes
        large = auto and nbytes[0] >= SMALL_CALL_BYTES
        if large and entries is None:
            if self.lag.behind():  # an eager call's host time is hidden behind the GPU's queue
                self._behind[key] = self._behind.get(key, 0) + 1
                self._behind.move_to_end(key)
                if len(self._behind) > _SEEN_KEYS:
                    self._idle.pop(self._behind.popitem(last=False)[0], None)
                idle_run = -1
            if idle_run + 1 < CAPTURE_SIGHTINGS:  # no graph (yet); its next sighting comes back here
                self._seen[key] = (nbytes, idle_run + 1, self._calls)
                return self._eager(body, "gpu-bound")
        self._sweep()
        # auto: within the graphs' memory budget (graph_memory.py); a dropped graph's pool, which this
        # capture takes, holds what the dropped outputs held
        if large and self.lag.busy >= BUDGET_BUSY and not self.memory.allows(0 if self._donors else nbytes[1]):
            if entries is None:  # its next sighting asks again
                self._seen[key] = (nbytes, idle_run, self._calls)
            return self._eager(body, "memory")
        wasted = self._dropped.get(shape, 0) + self._stale(shape)
        if wasted >= WASTED_PER_SHAPE:
            self._off.add(shape)
            for k in [k for k, entries in self._entries.items() if entries[0].shape == shape]:
                for e in self._entries.pop(k):
                    self._retire(e)
            warn_once(
                f"graphs-off:{shape}",
                f"asynctp {op}: {wasted} CUDA graphs of shape {shape[1:]} were never replayed "
                f"(their inputs did not come back at the same addresses, or more calls had distinct inputs "
                f"than asynctp.runtime.graphs.MAX_GRAPHS={MAX_GRAPHS}): calls of this shape run eagerly from now on (host-bound at "
                f"small sizes); keep such inputs in persistent buffers, raise MAX_GRAPHS, or set ASYNCTP_GRAPHS=0",
            )
            return self._eager(body, "shape off")
        try:
            replay, result = self.memory.capture(lambda: self._capture(self, body))
        except Exception as exc:  # noqa: BLE001
            self._off.add(shape)
            warn_once(f"graphs-failed:{op}",
                      f"asynctp {op}: capturing the pipelined call into a CUDA graph failed ({exc!r}); calls of this "
                      f"shape run eagerly (host-bound at small sizes); ASYNCTP_GRAPHS=0 skips capture")
            return self._eager(body, "shape off")
        outs, spec = flatten(result)
        del result
        # its key's period: since its last sighting, or (another graph for held outputs) its first graph's
        gap = entries[0].gap if entries else self._calls - sighted
        entry = Entry(replay, outs, spec, shape, born=self._calls, gap=gap, nbytes=nbytes)
        self._entries.setdefault(key, []).append(entry)
        self._entries.move_to_end(key)
        self.counts["captured"] += 1
        while self._count() > MAX_GRAPHS:
            oldest, old = next(iter(self._entries.items()))
            self._retire(old.pop(0))
            if not old:
                del self._entries[oldest]
        return self._replay(op, key, entry, captured=True)

    def ready(self, key: tuple) -> Entry | None:
        """A graph of `key` a call may replay now (outputs free, workspace generation current), or None."""
        if self.closed or (ws := self.ws) is None or ws.generation != self._generation:
            return None
        return next((entry for entry in self._entries.get(key, ()) if entry.free()), None)

    def replay_ready(self, op: str, key: tuple, entry: Entry, direct: bool = True) -> Any:
        """A call of `key` replayed from `entry` (just from ready(key)); direct: by ops/repeat.py."""
        self._calls += 1
        self.direct += direct
        self._entries.move_to_end(key)
        return self._replay(op, key, entry, mark=mode() == "auto")

    def _sweep(self) -> None:
        """Drop the graphs whose key has not come back for twice its period (+ the graphs held + 4
        calls), before each capture: the capture may take a dropped graph's memory pool."""
        now, slack = self._calls, self._count() + 4
        for key, entries in list(self._entries.items()):
            for e in [e for e in entries if now - e.last > 2 * e.gap + slack]:
                entries.remove(e)
                self._retire(e)
            if not entries:
                del self._entries[key]

    def _retire(self, entry: Entry) -> None:
        """A dropped graph: it lends its pool to a later capture (the last MAX_DONORS dropped); replayed
        fewer than PAYBACK_REPLAYS times, it counts as wasted for its shape (WASTED_PER_SHAPE)."""
        if entry.replays < PAYBACK_REPLAYS:
            self._dropped[entry.shape] = self._dropped.get(entry.shape, 0) + 1
        self._donors.append(entry.replay)
        del self._donors[:-MAX_DONORS]
        entry.replay = None

    def _eager(self, body: Callable[[], Any], reason: str) -> Any:
        self.eager_reasons[reason] += 1
        self.counts["eager"] += 1
        result = body()
        self.replayed = None  # (after the body: a call inside it may have replayed)
        return result

    def _replay(self, op: str, key: tuple, entry: Entry, captured: bool = False, mark: bool = False) -> Any:
        ws = self.ws
        if ws.lanes.is_cuda:
            lent = self.lag.lend() if mark else None  # a lag mark due: the replay's completion event is it
            ws.lanes.replay(entry.replay, done=lent)  # ordered after the previous op on ws, as Lanes.fork orders ops
            if lent is not None:
                self.lag.add(lent)
            ws.watch_replay(op)
        else:
            if mark:
                self.lag.mark()
            entry.replay()
        if not captured:  # the replay right after the capture is the capturing call's own
            entry.replays += 1
            entry.gap, entry.last = max(entry.gap, self._calls - entry.last), self._calls
            self.counts["replayed"] += 1
        self.replayed = key
        return entry.result()


_caches_by_ws: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # workspace -> its GraphCache


def cache_of(ws: Any) -> GraphCache:
    cache = _caches_by_ws.get(ws)
    if cache is None:
        cache = _caches_by_ws[ws] = GraphCache(ws)
        ws.on_close(_forget)
    return cache


def _forget(ws: Any) -> None:
    """A closed workspace's graphs go with it (asynctp.reset releases their memory at once)."""
    cache = _caches_by_ws.pop(ws, None)
    if cache is not None:
        cache.closed = True


def call(ws: Any, op: str, key: tuple, body: Callable[[], Any]) -> Any:
    """body() of a pipelined call of `op` over ws, through ws's graph cache where usable(ws) (see
    the module docstring)."""
    if not usable(ws):
        return body()
    return cache_of(ws).call(op, key, body)


def replayed(ws: Any, key: tuple) -> GraphCache | None:
    """ws's graph cache if its last call, of this very `key` object, came from a graph; else None."""
    cache = _caches_by_ws.get(ws)
    return cache if cache is not None and cache.replayed is key else None


def _caches(ws: Any | None) -> list[GraphCache]:
    return list(_caches_by_ws.values()) if ws is None else [c for c in (_caches_by_ws.get(ws),) if c is not None]


def clear(ws: Any | None = None) -> None:
    """Drop the captured graphs (of one workspace, or of every one this process made)."""
    for cache in _caches(ws):
        cache.clear()


def stats(ws: Any | None = None) -> dict[str, int]:
    """Calls run eagerly / captured / replayed through the graph cache of ws (or of every
    workspace this process made), of the replays those whose op's checks and plan were skipped
    ("replayed directly": ops/repeat.py), the graphs held, and the eager calls by reason ("eager: new
    key", "eager: outputs held", "eager: shape off", "eager: gpu-bound", "eager: memory"; see
    GraphCache), and the new keys' inputs at new addresses ("moved: <op> tensor <i>",
    runtime/moves.py)."""
    total = dict.fromkeys(["eager", "captured", "replayed", "replayed directly", "graphs"] +
                          [f"eager: {r}" for r in _REASONS], 0)
    for cache in _caches(ws):
        for k, v in {**cache.counts, "replayed directly": cache.direct, "graphs": cache._count(),
                     **{f"eager: {r}": n for r, n in cache.eager_reasons.items()},
                     **{f"moved: {m}": n for m, n in cache.moves.summary().items()}}.items():
            total[k] = total.get(k, 0) + v
    return total
