"""The CUDA-graph cache as the fused ops use it: what of a call keys its graph (asynctp.runtime.graphs
captures and replays; this module adds the settings that shape an op's pipeline)."""

from __future__ import annotations

from asynctp.config import get_config
from asynctp.ops import layout
from asynctp.runtime.graphs import GraphCache, call, clear, enabled, mode, stats, tensor_key, usable

__all__ = ["settings", "tensor_key", "call", "clear", "stats", "enabled", "mode", "usable", "GraphCache"]

def settings() -> tuple:
    """The settings a pipelined call reads while it is captured: a change of either must not
    replay a graph captured without it."""
    return get_config().sm_carveout, layout.BATCH_MAJOR
