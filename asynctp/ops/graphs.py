"""The CUDA-graph cache as the fused ops use it: what of a call keys its graph (asynctp.runtime.graphs
captures and replays; this module adds the settings that shape an op's pipeline)."""

from __future__ import annotations

import os

from asynctp.runtime.graphs import GraphCache, call, clear, enabled, mode, stats, tensor_key, usable

__all__ = ["settings", "tensor_key", "call", "clear", "stats", "enabled", "mode", "usable", "GraphCache"]

# read while a call is captured, so a change of either must not replay a graph captured without it
_KEYED_ENV = ("ASYNCTP_SM_CARVEOUT", "ASYNCTP_BATCH_MAJOR")


def settings() -> tuple:
    """The environment settings a pipelined call reads while it is captured."""
    return tuple(os.environ.get(name) for name in _KEYED_ENV)
