"""Host-side exchange of small values between the ranks of a group, through the group's store,
with asynctp's timeout (not the process group's, which defaults to 30 min for gloo): workspace
creation and growth must not hang on a rank that never comes.

Keys are asynctp/<group>/<generation>/<tag>/<round>/<rank>: one round counter per (group, tag),
and a generation bumped by reset() (a failed exchange leaves the counters out of step). The
last rank to read a round deletes its keys: no key outlives its exchange. The store's own
timeout is never changed (it is shared with the process group)."""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from asynctp.config import get_timeout
from asynctp.symm.errors import PeerTimeoutError

__all__ = ["exchange", "new_generation"]

_rounds: dict[tuple[str, str], int] = {}
_generations: dict[str, int] = {}


def new_generation(group_name: str) -> None:
    """Start the group's exchanges afresh (after a failure; every rank must do the same)."""
    _generations[group_name] = _generations.get(group_name, 0) + 1
    for key in [k for k in _rounds if k[0] == group_name]:
        del _rounds[key]


def exchange(group: dist.ProcessGroup, op: str, value: Any, timeout: float | None = None, tag: str | None = None) -> list[Any]:
    """Every rank's `value`, in rank order. Collective; raises PeerTimeoutError naming every
    missing rank when they do not arrive within the timeout. tag: which exchange this is
    (default: op); ranks pair the n-th exchange of a tag."""
    name, rank, world = group.group_name, group.rank(), group.size()
    tag = (tag or op).replace("/", "_")
    round_ = _rounds.get((name, tag), 0)
    _rounds[(name, tag)] = round_ + 1
    store = c10d._get_process_group_store(group)
    prefix = f"asynctp/{name}/{_generations.get(name, 0)}/{tag}/{round_}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], pickle.dumps(value))
    limit = get_timeout() if timeout is None else timeout
    deadline = time.monotonic() + limit
    delay = 1e-4
    try:
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise PeerTimeoutError(op, rank, missing, f"the {tag} exchange (round {round_})", limit, name)
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
    except BaseException:
        _delete(store, [keys[rank]])  # nobody will read it
        raise
    # every key exists: get() no longer blocks
    values = [pickle.loads(store.get(k)) for k in keys]
    if store.add(f"{prefix}/read", 1) == world:  # the last reader cleans up
        _delete(store, [*keys, f"{prefix}/read"])
    return values


def _delete(store: Any, keys: list[str]) -> None:
    for key in keys:
        try:
            store.delete_key(key)
        except (RuntimeError, NotImplementedError):  # a store without deletion keeps the key
            pass
