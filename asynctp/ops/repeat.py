"""Repeat calls: a public op's call that equals one of its recent calls replayed from the graph
cache replays again without its front matter.

Why: host time. A call replayed from asynctp's graph cache (runtime/graphs.py) still validated
its arguments, resolved its plan, built its graph key and set up its transport before the replay;
on 2xH100 (stage timers, fused all-gather at M 4096, isolated calls) that front matter took more
host time than the replay itself. Replayed directly, that call took 103 us of host instead of 317
isolated, 41 instead of 151 back to back (2xH200, one machine; docs/performance.md).

How: each public op keys its call by everything its checks, plan and graph key read: the resolved
process group, every tensor argument's tensor_key (address, shape, strides, dtype) and the scalars
with their types (call()'s `raw`: 0 and 0.0, 1 and True differ for the checks). A call whose raw
key was last seen replaying goes straight to the graph cache's replay of the same graph key
(GraphCache.ready / replay_ready), opened and closed on its group as the full call would be
(Calls.begin_call: numbering, out-of-step refusal, agreement) and counted by dispatch.calls(). It
falls back to the full call (which remembers it again where it replays) unless all of these hold:

  - the settings, the tuning table and the batch-major layout are those it was remembered under
    (any configure(), tuning.record() or forced_splits() forgets it);
  - eager_call_ok: plain tensors, no autograd to record, no tracing or dispatch mode;
  - the graph cache is usable (runtime/graphs.usable: not inside a CUDA-graph capture or under
    torch.compile's tracing);
  - the graph cache holds a graph of the key whose outputs the caller does not hold, in the
    workspace generation it was captured in, and the workspace is open.

Inputs whose contents change between calls are read anew by every replay, as on the full path.
A call whose checks fail never replays, so it is never remembered: it raises on every call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from asynctp.config import get_config
from asynctp.ops import layout, tuning
from asynctp.ops.strategy import eager_call_ok
from asynctp.runtime import graphs

__all__ = ["call", "note_guard", "claim", "MAX_CALLS"]

MAX_CALLS = 256  # raw keys remembered; all are forgotten when more come (a loop's calls come back)

_MISS = object()
_memo: dict[tuple, _Call] = {}
_local = threading.local()  # .note: the _Call of the innermost full call in progress on this thread


class _Call:
    """What a full call learns on its way (its group's agreed fields from guard.agreed; the graph
    it replayed, its op and strategy from dispatch.execute), and, once remembered, the state it
    holds for (settings, tuning epoch, batch-major layout). Remembered, it keeps its cache and
    workspace weakly (`calls` dropped; `opened`: begun on the workspace, not a group of one)."""

    __slots__ = ("guard_op", "calls", "opened", "names", "values", "claimed", "cache", "key", "op", "counts",
                 "strategy", "config", "batch_major", "epoch")

    def __init__(self) -> None:
        self.claimed = False
        self.guard_op = self.calls = self.names = self.values = None
        self.cache = self.key = self.op = self.counts = self.strategy = None


def call(describe: Callable[[], tuple[tuple, tuple]], full: Callable[[], Any]) -> Any:
    """full()'s result, replayed without its front matter where the call was last seen replaying.
    describe() -> (raw, tensors): raw, the op, the resolved group, tensor_key() of every tensor
    argument and the scalars with their types; tensors, every tensor argument. Under
    torch.compile's tracing, or for arguments describe() cannot take (the checks name them):
    full() only."""
    if torch.compiler.is_compiling():
        return full()
    try:
        raw, tensors = describe()
        hit = _memo.get(raw)
    except (AttributeError, TypeError):  # not tensors where tensors go, an unhashable scalar
        return full()
    if hit is not None:
        result = _replay(hit, tensors)
        if result is not _MISS:
            return result
    note, outer = _Call(), getattr(_local, "note", None)
    _local.note = note
    try:
        result = full()
    finally:
        _local.note = outer
    if note.key is not None and note.names is not None:  # replayed, and opened as an agreed call
        _remember(raw, note)
    return result


def note_guard(op: str, calls: Any, names: tuple, values: tuple) -> None:
    """guard.agreed's wrapper: the call of `op` was opened on `calls` with these fields (calls
    None: a group of one, not opened). The outermost agreed call of a full call is the one noted."""
    note = getattr(_local, "note", None)
    if note is not None and note.names is None:
        note.guard_op, note.calls, note.names, note.values = op, calls, names, values


def claim() -> _Call | None:
    """dispatch.execute: the note of the full call this execute serves (the first to claim it),
    to mark the graph it replayed: note.cache, note.key, note.op, and its call counter
    note.counts[note.op, note.strategy]."""
    note = getattr(_local, "note", None)
    if note is None or note.claimed:
        return None
    note.claimed = True
    return note


def _remember(raw: tuple, note: _Call) -> None:
    config = get_config()
    if config.check_finite:  # its preflight reads the inputs at every call
        return
    if note.calls is not None and note.calls is not note.cache.ws:
        return  # opened before the group had its workspace: the full call numbers the next one
    if len(_memo) >= MAX_CALLS:
        _memo.clear()
    note.cache, note.opened, note.calls = weakref.ref(note.cache), note.calls is not None, None
    note.config, note.batch_major, note.epoch = config, layout.BATCH_MAJOR, tuning.epoch()
    _memo[raw] = note


def _replay(hit: _Call, tensors: tuple) -> Any:
    if hit.config is not get_config() or hit.batch_major != layout.BATCH_MAJOR or hit.epoch != tuning.epoch():
        return _MISS
    cache = hit.cache()
    if cache is None or not eager_call_ok(*tensors) or not graphs.usable(cache.ws):
        return _MISS
    entry = cache.ready(hit.key)
    if entry is None:
        return _MISS
    if hit.opened:
        result = cache.ws.run(hit.guard_op, hit.names, hit.values, lambda: cache.replay_ready(hit.op, hit.key, entry))
    else:
        result = cache.replay_ready(hit.op, hit.key, entry)
    hit.counts[hit.op, hit.strategy] += 1
    return result
