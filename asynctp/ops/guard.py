"""Optional pre-flight checks of a call, agreed over the group before any data moves.

ASYNCTP_CHECK_CONSISTENCY=1: ranks compare the call's metadata (op, shapes, dtypes, dims,
strategy, modes); a mismatch raises the same ValueError on every rank instead of a hang or
garbage. ASYNCTP_CHECK_FINITE=1: inputs are checked for NaN/Inf before they are communicated;
every rank raises, naming the op and the ranks that had them. Both cost one small collective
and a host sync per call: debugging aids, off by default.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from asynctp.symm.rendezvous import exchange

__all__ = ["enabled", "preflight"]

_CONSISTENCY_ENV = "ASYNCTP_CHECK_CONSISTENCY"
_FINITE_ENV = "ASYNCTP_CHECK_FINITE"


def _on(var: str) -> bool:
    return os.environ.get(var, "0") not in ("", "0")


def enabled() -> bool:
    return _on(_CONSISTENCY_ENV) or _on(_FINITE_ENV)


def _describe(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return (tuple(t.shape), str(t.dtype))
    if isinstance(t, (list, tuple)):
        return tuple(_describe(x) for x in t)
    return t


def preflight(op: str, group: dist.ProcessGroup, meta: dict[str, Any], inputs: list[torch.Tensor | None]) -> None:
    """Run the enabled checks for one call (no-op when none is enabled)."""
    consistency, finite = _on(_CONSISTENCY_ENV), _on(_FINITE_ENV)
    if not (consistency or finite):
        return
    described = {k: _describe(v) for k, v in meta.items()} if consistency else None
    bad_inputs = []
    if finite:
        for i, t in enumerate(inputs):
            if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad_inputs.append(i)
    # through the group's store: no numpy (torch's *_object collectives need it), and a rank
    # that never makes the call is named in a timeout instead of hanging the others
    everyone = exchange(group, op, (op, described, bad_inputs))
    nonfinite = [rank for rank, (_, _, bad) in enumerate(everyone) if bad]
    if nonfinite:
        detail = "; ".join(f"rank {r}: inputs {everyone[r][2]}" for r in nonfinite)
        raise ValueError(f"asynctp {op}: NaN/Inf in inputs before communication ({detail})")
    if consistency:
        reference = everyone[0][:2]
        for rank, (other_op, other_meta, _) in enumerate(everyone):
            if (other_op, other_meta) != reference:
                diffs = _diff(reference, (other_op, other_meta))
                raise ValueError(
                    f"asynctp {op}: call metadata differs across ranks (rank 0 vs rank {rank}: {diffs}); "
                    f"every rank of the group must make the same call"
                )


def _diff(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return f"op {a[0]!r} vs {b[0]!r}"
    keys = sorted(set(a[1]) | set(b[1]))
    return ", ".join(f"{k} {a[1].get(k)!r} vs {b[1].get(k)!r}" for k in keys if a[1].get(k) != b[1].get(k))
