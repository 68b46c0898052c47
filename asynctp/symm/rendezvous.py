"""Host-side exchange of small values between the ranks of a group, through the group's store,
with asynctp's timeout (not the process group's, which defaults to 30 min for gloo): workspace
creation and growth must not hang on a rank that never comes."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from asynctp.config import get_timeout
from asynctp.symm.errors import PeerTimeoutError

__all__ = ["exchange"]

_rounds: dict[str, int] = {}


def _store(group: dist.ProcessGroup):
    return c10d._get_process_group_store(group)


def exchange(group: dist.ProcessGroup, op: str, value: Any, timeout: float | None = None) -> list[Any]:
    """Every rank's `value`, in rank order. Collective; raises PeerTimeoutError naming the first
    missing rank when one does not arrive within the timeout."""
    name = group.group_name
    round_ = _rounds.get(name, 0)
    _rounds[name] = round_ + 1
    store = _store(group)
    prefix = f"asynctp/{name}/{round_}"
    store.set(f"{prefix}/{group.rank()}", pickle.dumps(value))
    keys = [f"{prefix}/{r}" for r in range(group.size())]
    limit = get_timeout() if timeout is None else timeout
    deadline = time.monotonic() + limit
    delay = 1e-4
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = next(r for r, k in enumerate(keys) if not store.check([k]))
            raise PeerTimeoutError(op, group.rank(), missing, f"workspace rendezvous (round {round_})", limit, name)
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    # every key exists: get() no longer blocks, whatever the store's own timeout
    store.set_timeout(timedelta(seconds=max(limit, 1.0)))
    return [pickle.loads(store.get(k)) for k in keys]
