"""The inductor post-grad pass object and its installation (enable / disable / enabled).

The pass is a CustomGraphPass whose uuid hashes the pass's and the ops' sources plus every
setting that changes its output, so inductor's FX graph cache stays correct. Passes already
installed keep running, before this one: in torch versions that accept a list of passes they
stay in the list, otherwise this pass wraps them (and then caches only if they have a uuid).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from asynctp.config import get_config
from asynctp.compile.report import FusionReport, UnfusedCollectiveError, log, record_graph, snapshot
from asynctp.compile.rewrite import graph_kind, rewrite_graph

__all__ = ["AsyncTPPass", "enable", "disable", "enabled", "fusion_report"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = tuple(sorted(glob.glob(os.path.join(_HERE, "*.py")) + glob.glob(os.path.join(_HERE, "..", "ops", "*.py"))))


@functools.lru_cache(maxsize=1)
def _sources_hash() -> str:
    """What the pass does is in these files (the rewrite and the ops' schemas and checks)."""
    hasher = hashlib.sha256()
    for path in _SOURCES:
        with open(path, "rb") as f:
            hasher.update(f.read())
    return hasher.hexdigest()


def _as_tuple(passes: Any) -> tuple[Any, ...]:
    if passes is None:
        return ()
    if isinstance(passes, (list, tuple)):
        return tuple(passes)
    return (passes,)


def _accepts_lists() -> bool:
    """Whether this inductor runs a list of post-grad passes (newer torch) or only one."""
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


class AsyncTPPass(CustomGraphPass):
    """Rewrites TP all-gather -> matmul and matmul -> reduce-scatter into asynctp's fused ops."""

    def __init__(self, fail_if_unfused: bool = False, wrapped: tuple[Any, ...] = ()) -> None:
        self.fail_if_unfused = fail_if_unfused
        self.wrapped = wrapped  # passes installed before this one (torch without pass lists)

    def __call__(self, graph: fx.Graph) -> None:
        for other in self.wrapped:
            other(graph)
        report = record_graph(graph_kind(graph), rewrite_graph(graph))
        if self.fail_if_unfused and report.unfused_tp:
            raise UnfusedCollectiveError(
                f"asynctp.compile: {len(report.unfused_tp)} TP collective(s) were not fused "
                f"(enable(fail_if_unfused=True)):\n{report}"
            )

    def uuid(self) -> Any:
        wrapped = []
        for other in self.wrapped:
            other_uuid = other.uuid() if isinstance(other, CustomGraphPass) else None
            if other_uuid is None:
                return None  # an opaque pass: caching could replay a stale graph
            wrapped.append(other_uuid)
        settings = f"fail={self.fail_if_unfused};disable_symm={get_config().disable_symm}"
        return (_sources_hash(), settings, torch.__version__, tuple(wrapped))


def enable(fail_if_unfused: bool = False) -> AsyncTPPass:
    """Install the pass for every later torch.compile (inductor) compilation in this process.

    Graphs compile lazily: the forward at a compiled function's first call, the backward at the
    first backward; enable before both. The setting is inductor's process-wide
    post_grad_custom_post_pass (passes already there keep running, before this one).
    fail_if_unfused=True turns an unfused TP collective into an UnfusedCollectiveError carrying
    the graph's fusion report (the compile fails). Calling enable again replaces the settings.
    """
    if not isinstance(fail_if_unfused, bool):
        raise TypeError(f"fail_if_unfused requires a bool, got {type(fail_if_unfused).__name__}")
    if getattr(inductor_config, "_micro_pipeline_tp", False):
        log.warning(
            "asynctp.compile: torch's own async-TP pass (_micro_pipeline_tp) is on; it runs first and "
            "takes the patterns it knows, leaving asynctp only the rest"
        )
    others = _others(inductor_config.post_grad_custom_post_pass)
    for p in others:
        if not callable(p):
            raise TypeError(f"post_grad_custom_post_pass requires callables to chain with, got {p!r}")
    if _accepts_lists():
        ours = AsyncTPPass(fail_if_unfused)
        inductor_config.post_grad_custom_post_pass = [*others, ours] if others else ours
    else:
        ours = AsyncTPPass(fail_if_unfused, others)
        inductor_config.post_grad_custom_post_pass = ours
    return ours


def _others(value: Any) -> tuple[Any, ...]:
    """The installed passes that are not asynctp's (unwrapping a pass that wraps them)."""
    found: list[Any] = []
    for p in _as_tuple(value):
        found.extend(p.wrapped if isinstance(p, AsyncTPPass) else (p,))
    return tuple(found)


def disable() -> None:
    """Remove the pass; passes installed by others stay installed."""
    rest = _others(inductor_config.post_grad_custom_post_pass)
    inductor_config.post_grad_custom_post_pass = None if not rest else rest[0] if len(rest) == 1 else list(rest)


@contextlib.contextmanager
def enabled(fail_if_unfused: bool = False) -> Iterator[AsyncTPPass]:
    """`with asynctp.compile.enabled(): loss = compiled(x); loss.backward()`: the pass is installed
    inside the block only, so the calls that compile (the first forward and backward) must be
    inside it."""
    was = inductor_config.post_grad_custom_post_pass
    try:
        yield enable(fail_if_unfused)
    finally:
        inductor_config.post_grad_custom_post_pass = was


@contextlib.contextmanager
def fresh_compiles() -> Iterator[None]:
    """No inductor / AOTAutograd cache hits inside the block: a graph loaded from a cache is not
    rewritten (nor reported) again, so whoever reads fusion_report() afterwards must compile
    afresh (a warm cache otherwise reports "0 graph(s)" for graphs that are fused)."""
    import torch._functorch.config as functorch_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def fusion_report(clear: bool = False) -> FusionReport:
    """What the pass did to every graph compiled in this process (clear=True: then forget it).

    str() of the report lists, per graph, each all-gather / reduce-scatter, fused or not, and
    why not. Graphs loaded from inductor's FX graph cache were rewritten when first compiled and
    are not listed again.
    """
    return snapshot(clear)
