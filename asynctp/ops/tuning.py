"""The tuning cache behind strategy="auto": measured best strategy per (op, device, world size,
dtype, shape), kept as JSON under the user's cache dir ($ASYNCTP_TUNING_CACHE overrides the path).

`asynctp bench --tune` fills it; tables measured on our hardware ship in asynctp/ops/tuned/ and
the user's cache overrides them. A shape in neither gets a size rule: below a few tens of
microseconds of matmul per rank, the fixed costs of a pipeline (barriers, extra launches) exceed
what overlap can hide, so serial wins.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from asynctp.config import get_config

__all__ = ["cache_path", "pick", "record", "load", "plan_for", "ring_pays", "forced_splits", "epoch", "forget"]

_MAX_SPLITS = 8  # the signal channels of the blocks must fit the workspace's flags
_forced: int | None = None  # row blocks per rank chunk set by forced_splits (tests of multi-block plans)
# Total matmul FLOPs under which a pipeline is not assumed to pay, without a tuning entry. On
# 2xH200 with eager calls replayed from CUDA graphs (runtime/graphs.py) the pipeline
# beat serial at every seed shape from M 2048 (N 3584, K 8192), bf16 and fp8; before those
# graphs, eager calls were host-bound and fp8 lost everywhere.
_MIN_PIPELINE_FLOP = 2 * 2048 * 3584 * 8192
_table: dict[str, str] | None = None
_picked: dict[tuple, str] = {}  # pick() results, cleared when the table changes
_epoch = 0  # plans made before a change of the table or of forced_splits differ from later ones


def cache_path() -> Path:
    path = get_config().tuning_cache
    if path:
        return Path(path)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asynctp" / "tuning.json"


def _shipped() -> dict[str, str]:
    """Tables measured by `asynctp bench --tune` on the hardware we had (asynctp/ops/tuned/)."""
    table: dict[str, str] = {}
    for path in sorted((Path(__file__).parent / "tuned").glob("*.json")):
        try:
            table.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return table


def load() -> dict[str, str]:
    """The shipped tables overlaid by the user's cache (the user's own measurements win)."""
    global _table
    if _table is None:
        _table = _shipped()
        try:
            _table.update(json.loads(cache_path().read_text()))
        except (OSError, ValueError):
            pass
    return _table


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _key(op: str, world_size: int, device: torch.device, shape_key: tuple) -> str:
    return "|".join([op, _device_name(device), f"R{world_size}", *map(str, shape_key)])


def record(op: str, world_size: int, device: torch.device, shape_key: tuple, strategy: str) -> None:
    """Remember the measured best strategy for a shape (written through to the cache file)."""
    global _epoch
    key = _key(op, world_size, device, shape_key)
    load()[key] = strategy
    _picked.clear()
    _epoch += 1
    path = cache_path()
    try:
        own = json.loads(path.read_text())
    except (OSError, ValueError):
        own = {}
    own[key] = strategy
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(own, indent=1, sort_keys=True))
    os.replace(tmp, path)


def pick(op: str, world_size: int, device: torch.device, shape_key: tuple) -> str:
    """shape_key = (dtype, M, N, K) of the full (gathered / unscattered) matmul."""
    if device.type != "cuda":
        return "pipeline"  # the cpu backend exists to run the pipeline; CI exercises it via auto
    memo = (op, world_size, device, shape_key)
    choice = _picked.get(memo)
    if choice is None:
        choice = load().get(_key(op, world_size, device, shape_key))
        if choice is None:
            choice = _rule(op, shape_key)
        _picked[memo] = choice
    return choice


# ops whose single-launch GEMM measured at least as fast as the decomposition: unmeasured shapes
# from this many times _MIN_PIPELINE_FLOP start there (docs/performance.md, 2xH100). The bf16
# reduce-scatter at every seed shape; the bf16 all-gather from the seed's M 4096 (M 2048: fused
# 192 us against 176 pipelined; the 8B-shaped training stack, batch 2: 115.5 ms a step fused
# against 119.7). Not the fp8 reduce-scatter (its partials' push takes as long as its GEMM: fused
# 388-486 us against 133-434 pipelined) nor the fp8 all-gathers (pipelined as fast at M 4096).
_FUSED_FROM = {"matmul_reduce_scatter": 1, "all_gather_matmul": 2}


def _rule(op: str, shape_key: tuple) -> str:
    """The choice for a shape nobody measured: from the M 2048 seed shape's FLOPs up, the
    decomposition, or the single-launch GEMM where it measured as fast (_FUSED_FROM; it falls
    back to the decomposition where it cannot serve a call); serial below."""
    _, m, n, k = shape_key
    flop = 2 * m * n * k
    if flop < _MIN_PIPELINE_FLOP:
        return "serial"
    return "fused" if op in _FUSED_FROM and flop >= _FUSED_FROM[op] * _MIN_PIPELINE_FLOP else "pipeline"


def ring_pays(device: torch.device, shape_key: tuple) -> bool:
    """Whether the send/recv ring should serve a group that has no workspace."""
    if device.type != "cuda":
        return True  # CI exercises the ring through auto when ASYNCTP_DISABLE_SYMM is set
    _, m, n, k = shape_key
    return 2 * m * n * k >= _MIN_PIPELINE_FLOP


def plan_for(op: str, shape_key: tuple, world_size: int) -> tuple[int, bool]:
    """(row blocks per rank chunk, lockstep) for the pipelined strategy.

    Row blocks: the first remote GEMM starts after one block landed, not a whole chunk; for
    reduce-scatter with 2 ranks the push of one block overlaps the GEMM of the next. Lockstep
    (all-gather): the local GEMM waits for the opening barrier, so a rank that finished its
    previous op early does not start a persistent GEMM that then holds the SMs when its remote
    data lands. Measured on 2xH200 (bf16, N 3584, K 8192): lockstep 750 us vs 830-890 at M 8192;
    two blocks best for the reduce-scatter from 2048 rows per rank; one block best for the push
    all-gather at M 4096 and 8192 (bf16 M 4096 356 vs 374 us with two, fp8 rowwise M 8192 373
    vs 402). 4xH200, M 8192: one block for the all-gather (bf16 725 vs 780 us), two for the
    reduce-scatter (bf16 838 vs 866, fp8 rowwise 591 vs 629). docs/performance.md has the tables.
    """
    _, m_total, _, _ = shape_key
    rows = m_total // world_size
    lockstep = op == "all_gather_matmul" and rows >= 2048
    if _forced is not None:
        return _forced, lockstep
    if op == "all_gather_matmul":
        return 1, lockstep
    return (2 if rows >= 2048 else 1), lockstep


@contextlib.contextmanager
def forced_splits(splits: int) -> Iterator[None]:
    """Within the block, every pipelined call cuts each rank chunk into `splits` row blocks
    (tests: multi-block plans must give the same exact results as the default's)."""
    global _forced, _epoch
    if not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"forced_splits requires 1 to {_MAX_SPLITS} row blocks, got {splits}")
    before, _forced = _forced, splits
    _epoch += 1
    try:
        yield
    finally:
        _forced = before
        _epoch += 1


def epoch() -> int:
    """Changes whenever a plan made now may differ from one made before (ops/repeat.py)."""
    return _epoch


def forget() -> None:
    """Drop the loaded table (the next pick reads the shipped tables and the cache file again)."""
    global _table, _epoch
    _table = None
    _picked.clear()
    _epoch += 1

