"""The fusion report: every TP collective the graph pass saw, fused or not, and why not.

Users keep reporting "async TP had no effect"; this is the answer to "why": one record per
all-gather / reduce-scatter per compiled graph, kept for the process and logged at INFO on the
"asynctp.compile" logger as each graph is compiled. A collective that dynamo leaves out of the
compiled graphs (a graph break: torch 2.11 breaks at funcol's gather along dim > 0 when called
directly, pytorch/pytorch#179722) runs eagerly, never reaches the pass and is not listed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

__all__ = ["CollectiveRecord", "GraphReport", "FusionReport", "UnfusedCollectiveError", "record_graph", "snapshot"]

log = logging.getLogger("asynctp.compile")


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective found in a graph."""

    kind: str  # "all-gather" or "reduce-scatter"
    node: str  # name of the collective's node in the graph (before the rewrite)
    dim: int | None  # gather / scatter dim of the activation (None: not recognized)
    shape: tuple[int, ...] | None  # the shard (all-gather) or the full partial (reduce-scatter)
    group_name: str
    fused: bool
    op: str | None = None  # the asynctp op it became
    num_matmuls: int = 0  # matmuls folded into the op
    reason: str | None = None  # why it was not fused (if fused: a note, e.g. what stayed outside)
    tp: bool = True  # False: not a TP activation collective (e.g. a parameter gather); never raises

    def describe(self) -> str:
        where = f"dim {self.dim}" if self.dim is not None else "dim ?"
        shape = f" of {self.shape}" if self.shape is not None else ""
        head = f"{self.kind} {self.node} ({where}{shape}, group {self.group_name!r})"
        if self.fused:
            mms = f"{self.num_matmuls} matmul{'s' if self.num_matmuls != 1 else ''}"
            note = f"; {self.reason}" if self.reason else ""
            return f"{head}: fused into {self.op} with {mms}{note}"
        tag = "not fused" if self.tp else "not fused (not a TP collective)"
        return f"{head}: {tag}: {self.reason}"


@dataclass
class GraphReport:
    """The collectives of one compiled graph."""

    index: int  # order in which the pass saw the graph in this process
    kind: str  # "forward", "backward" or "inference"
    records: list[CollectiveRecord] = field(default_factory=list)

    @property
    def fused(self) -> list[CollectiveRecord]:
        return [r for r in self.records if r.fused]

    @property
    def unfused(self) -> list[CollectiveRecord]:
        return [r for r in self.records if not r.fused]

    @property
    def unfused_tp(self) -> list[CollectiveRecord]:
        return [r for r in self.records if not r.fused and r.tp]

    def __str__(self) -> str:
        head = f"graph {self.index} ({self.kind}): {len(self.fused)} fused, {len(self.unfused)} not fused"
        if not self.records:
            return f"{head} (no all-gather or reduce-scatter)"
        return "\n".join([head] + [f"  {r.describe()}" for r in self.records])


@dataclass
class FusionReport:
    """Every graph the pass rewrote in this process (graphs loaded from inductor's FX graph cache
    were rewritten when first compiled and do not appear here)."""

    graphs: list[GraphReport] = field(default_factory=list)

    @property
    def records(self) -> list[CollectiveRecord]:
        return [r for g in self.graphs for r in g.records]

    @property
    def fused(self) -> list[CollectiveRecord]:
        return [r for r in self.records if r.fused]

    @property
    def unfused(self) -> list[CollectiveRecord]:
        return [r for r in self.records if not r.fused]

    def count(self, op: str) -> int:
        """How many collectives were fused into `op` (e.g. "asynctp.all_gather_matmul")."""
        return sum(1 for r in self.fused if r.op == op)

    def __str__(self) -> str:
        head = (
            f"asynctp fusion report: {len(self.graphs)} graph(s), {len(self.records)} collective(s), "
            f"{len(self.fused)} fused, {len(self.unfused)} not fused"
        )
        return "\n".join([head] + [str(g) for g in self.graphs])


class UnfusedCollectiveError(RuntimeError):
    """Raised by the pass (enable(fail_if_unfused=True)) when a TP collective stays unfused."""


_lock = threading.Lock()
_graphs: list[GraphReport] = []


def record_graph(kind: str, records: list[CollectiveRecord]) -> GraphReport:
    """Keep one graph's records and log them at INFO."""
    with _lock:
        report = GraphReport(len(_graphs), kind, list(records))
        _graphs.append(report)
    log.info("asynctp.compile: %s", report)
    return report


def snapshot(clear: bool = False) -> FusionReport:
    with _lock:
        report = FusionReport(list(_graphs))
        if clear:
            _graphs.clear()
    return report
