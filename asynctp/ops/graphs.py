"""What of an op's call keys its CUDA graph beyond its tensors and scalars: the settings that
shape its pipeline while it is captured (runtime/graphs.py captures and replays)."""

from __future__ import annotations

from asynctp.config import get_config
from asynctp.ops import layout

__all__ = ["settings"]


def settings() -> tuple:
    """The settings a pipelined call reads while it is captured: a change of either must not
    replay a graph captured without it."""
    return get_config().sm_carveout, layout.BATCH_MAJOR
