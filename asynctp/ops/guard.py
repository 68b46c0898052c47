"""Every public op's call is agreed on by the group's ranks (on by default), and optionally its
inputs checked for NaN/Inf.

`agreed(op)` wraps an op's implementation: it opens the call on the group's workspace
(Workspace.begin_call: refuses a group out of step or a second thread, numbers the call and
compares its signature, signature.py, in the values the ranks exchange anyway) and closes it
(an exception marks the group out of step until asynctp.reset). On CPU the workspace is made on
first use, so every strategy is checked; on CUDA a call is checked once the group has a
workspace (its pipelined calls). A group without a workspace has its calls numbered and guarded
(symm/calls.py: UnsharedCalls); on CPU its ring compares them. Zero-size inputs (judged by agreed
fields) run the serial strategy (nothing to overlap).

Config.check_finite (ASYNCTP_CHECK_FINITE=1): inputs are checked for NaN/Inf before they are
communicated; every rank raises, naming the op and the ranks that had them. It costs one store
round and a host sync per call: a debugging aid, off by default.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from asynctp.config import get_config
from asynctp.ops import repeat
from asynctp.ops.signature import FIELDS, NAMES
from asynctp.symm import calls_of, resolve_group
from asynctp.symm.rendezvous import exchange

__all__ = ["agreed", "enabled", "preflight"]


def agreed(op: str) -> Callable[[Callable], Callable]:
    """Decorate the implementation of `op` (its arguments as signature.FIELDS[op] takes them)."""
    fields, names = FIELDS[op], NAMES[op]

    def wrap(fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        strategy_at = params.index("strategy") if "strategy" in params else None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            group, device, values = fields(*args, **kwargs)
            if strategy_at is not None and strategy_at < len(args) and _empty(values):
                args = (*args[:strategy_at], "serial", *args[strategy_at + 1 :])
            pg = resolve_group(group)
            if pg.size() == 1:
                repeat.note_guard(op, None, names, values)
                return fn(*args, **kwargs)
            calls = calls_of(pg, device.type)
            repeat.note_guard(op, calls, names, values)
            return calls.run(op, names, values, lambda: fn(*args, **kwargs))

        return call

    return wrap


def _empty(values: tuple) -> bool:
    """Whether what the call exchanges is empty, judged by agreed fields only (a rank-local empty
    b must not send one rank to another strategy): the shape in values[0], and a reduce-scatter's
    N in values[1]."""
    return 0 in values[0] or (type(values[1]) is int and values[1] == 0)


def enabled() -> bool:
    return get_config().check_finite


def preflight(op: str, group: dist.ProcessGroup, meta: dict[str, Any], inputs: list[torch.Tensor | None]) -> None:
    """The NaN/Inf check of one call (no-op unless Config.check_finite). `meta` is not compared
    here: every call's signature is, by `agreed`."""
    if not get_config().check_finite:
        return
    bad_inputs = [i for i, t in enumerate(inputs)
                  if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    # through the group's store: a rank that never makes the call is named in a timeout
    everyone = exchange(group, op, bad_inputs, tag="finite")
    nonfinite = [rank for rank, bad in enumerate(everyone) if bad]
    if nonfinite:
        detail = "; ".join(f"rank {r}: inputs {everyone[r]}" for r in nonfinite)
        raise ValueError(f"asynctp {op}: NaN/Inf in inputs before communication ({detail})")
