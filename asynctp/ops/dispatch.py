"""The one skeleton of every fused op: after the op validated its arguments, agreed on the call
(ops/guard.py) and made its plan (ops/plan.py), run the plan on its transport.

    serial     the op's serial reference (one collective, one matmul)
    ring       the op's decomposed body over send/recv (runtime/ring.py: RingTransport)
    pipeline   the body over the symmetric workspace (runtime/pipeline.py: SymmTransport), inside
               the workspace's CUDA-graph cache (runtime/graphs.py)
    fused      the single-launch GEMM (runtime/kernel_path.py) where it serves the call, else
               as pipeline

The op supplies what is computed (serial, decomposed(transport), fused(ws)) and the graph key
of a call; this module decides how it is executed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from asynctp.ops import repeat
from asynctp.ops.plan import Plan
from asynctp.runtime import graphs
from asynctp.runtime.pipeline import SymmTransport
from asynctp.runtime.ring import RingTransport
from asynctp.runtime.transport import Transport
from asynctp.symm import Workspace

__all__ = ["execute", "calls"]

R = TypeVar("R")
_calls: Counter = Counter()  # (op, how) -> calls in this process


def calls() -> dict[str, int]:
    """Calls per "op strategy" in this process, eager and replayed alike; "op fused: decomposed"
    counts the eager or captured calls the single-launch GEMM declined (the decomposition ran)."""
    return {f"{op} {how}": n for (op, how), n in _calls.items()}


def execute(
    op: str,
    plan: Plan,
    group: Any,
    device: torch.device,
    *,
    serial: Callable[[], R],
    decomposed: Callable[[Transport], R],
    key: Callable[[], tuple],
    fused: Callable[[Workspace], R | None] | None = None,
) -> R:
    """The call's result. fused(ws) returns None where the kernel path cannot serve the call.
    key(): everything a captured graph of the call depends on, the strategy included (built only
    where one may be)."""
    _calls[op, plan.strategy] += 1
    if plan.strategy == "serial":
        return serial()
    if plan.strategy == "ring":
        return decomposed(RingTransport(group, device))
    ws = plan.ws
    assert ws is not None, f"{op}: strategy {plan.strategy!r} requires a workspace"
    kernel = fused if plan.strategy == "fused" else None
    transport = SymmTransport(ws, plan.splits, plan.lockstep)

    def body() -> R:
        if kernel is not None:
            result = kernel(ws)
            if result is not None:
                return result
            _calls[op, "fused: decomposed"] += 1
        return decomposed(transport)

    note, graph_key = repeat.claim(), key()  # (claimed before the body: an op it calls has its own)
    result = graphs.call(ws, op, graph_key, body)
    cache = graphs.replayed(ws, graph_key) if note is not None else None
    if cache is not None:  # ops/repeat.py may replay the op's next equal call directly
        note.cache, note.key, note.op, note.counts, note.strategy = cache, graph_key, op, _calls, plan.strategy
    return result
