"""The message for ranks that made different calls: the same text on every rank."""

from __future__ import annotations

from typing import Any

__all__ = ["describe_mismatch"]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _split(values: dict[int, Any]) -> str:
    """'X on rank 0 vs Y on ranks 1, 2' for one field, grouped by value in rank order."""
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(repr(value), []).append(rank)
    return " vs ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())


def describe_mismatch(group_name: str, seq: int, calls: list[tuple[str, tuple, tuple]]) -> str:
    """calls[r] = (op, field names, field values) of rank r. Names the op of every rank if they
    differ, else every field whose value differs, with the ranks holding each value."""
    ops = {rank: op for rank, (op, _, _) in enumerate(calls)}
    head = f"asynctp {calls[0][0]}: the ranks of group {group_name!r} made different calls (call {seq})"
    if len(set(ops.values())) > 1:
        detail = f"op {_split(ops)}"
    else:
        fields: dict[str, dict[int, Any]] = {}
        for rank, (_, names, values) in enumerate(calls):
            for name, value in zip(names, values):
                fields.setdefault(name, {})[rank] = value
        differ = [f"{name} {_split(v)}" for name, v in fields.items() if len(set(map(repr, v.values()))) > 1
                  or len(v) < len(calls)]
        detail = "; ".join(differ) or "signatures differ (a rank has ASYNCTP_CHECK_CALLS off?)"
    return (f"{head}: {detail}. Every rank of the group must make the same calls in the same order; "
            f"call asynctp.reset(group) on every rank to go on")
