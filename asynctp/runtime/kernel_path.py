"""The single-launch GPU path of the fused ops: copy-engine pushes and stream-written signals
on the copy stream, ONE persistent GEMM on the caller's stream that waits per chunk on the GPU.

all-gather -> matmul, rank r of R (chunk = a block of one rank's rows, or a batch-major run):
    copy stream:  barrier(0) | push the shard into slot r of r-1, r-2, ...,
                  then put_signal(that peer, block) | when the caller keeps the gathered rows
                  and the GEMM does not store them: each source's rows copied out of the
                  workspace once its last flag is set
    caller:       async_input_mm over the workspace rows, pivot = r's own first block (read
                  from the caller's shard in place), then r's other blocks, r+1, r+2, ... as
                  their flags arrive; the Gluon GEMM stores the gathered rows from the a tiles
                  it loads; further weights of the same gather: the same GEMM without waits;
                  every flag zeroed after the join
matmul -> reduce-scatter, rank r:
    caller:       producer GEMM: the peers' blocks first (r+1, r+2, ...), then the own chunk,
                  whose epilogue waits for the peers' pushed partials and adds them (fp32, one
                  rounding, bias and avg there too)
    copy stream:  barrier(0) | for each peer block: wait for its tile counter (a stream memory
                  operation), push it into slot r of its owner, put_signal(owner, block)
Nothing a spinning GEMM waits for needs an SM (copy engines, stream memory operations), so the
GEMM may hold every SM. Both use the workspace as the decomposition does (see symm/workspace.py's
contract): slots by source rank from offset 0, the opening barrier, every push matched by a wait.
"""

from __future__ import annotations

import os
import weakref

import torch

from asynctp.config import get_config
from asynctp.kernels import tune_timers
from asynctp.kernels.async_input_mm import ChunkMap, launch
from asynctp.kernels.configs import Config, tune
from asynctp.kernels.producer_mm import launch_producer
from asynctp.kernels.triton_util import RawPointer, triton_available
from asynctp.runtime.transport import Runs, place, rank_order

__all__ = ["gather_available", "gather_matmul", "scatter_available", "matmul_scatter"]

_SIGNAL_BASE = 2  # signal channels after the two barrier channels (as the decomposition's)
_MAX_BLOCKS = 8  # signal channels the kernel path uses at most
_GATHER_SPLITS = 4  # blocks of a rank's rows in the all-gather (front order)
_MIN_BLOCK_ROWS = 256  # ... each at least this many rows (two 128-row tiles)
# per workspace (asynctp.reset makes a new one, and with it zeroed counters)
_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_served: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ws -> {problem: why not, or None}
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ws -> {problem: its workspace views}


_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def _kernels_cache() -> str:
    """Where the tuned tile configurations live: beside the strategy tuning table."""
    table = get_config().tuning_cache
    if table:
        return os.path.join(os.path.dirname(os.path.abspath(table)), "kernels.json")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "asynctp", "kernels.json")


def _config(dtype: torch.dtype, m: int, n: int, k: int, rows: int, device: torch.device, scatter: bool,
            world: int) -> Config:
    """The tile configuration of a problem: timed once per shape on this machine (the table's
    candidates on random operands, kept in _kernels_cache()), then looked up. Each kernel is timed
    as its call runs it: the all-gather's GEMM with the gathered rows kept (as training does),
    stored by the GEMM where it can, else copied out beside it on another stream; the
    reduce-scatter's producer (scatter) as rank 0 of `world`, every peer's partial already there."""
    if torch.cuda.is_current_stream_capturing():  # a graph of a call seen before: its shape is tuned
        return tune(dtype, m, n, k, rows, _not_now, scatter=scatter)
    time_us = tune_timers.producer if scatter else tune_timers.gather
    return tune(dtype, m, n, k, rows, time_us(dtype, m, n, k, rows, device, world), path=_kernels_cache(),
                scatter=scatter)


def _not_now(cfg: Config) -> float:
    raise RuntimeError("no timing during CUDA-graph capture")


def _device_ready(ws, dtype: torch.dtype) -> str | None:
    """Why the GEMM cannot run on ws's device for operands of `dtype` (None: it can)."""
    if ws.device.type != "cuda":
        return "the single-launch GEMM runs on CUDA"
    if dtype not in _DTYPES:
        return f"the single-launch GEMM takes bf16, fp16 or fp8 operands, got {dtype}"  # fp32 would run as tf32
    if not triton_available():
        return "Triton is not installed"
    if torch.cuda.get_device_capability(ws.device) < (9, 0):
        return "the single-launch GEMM needs TMA (sm_90 or newer)"
    return None


def _wait_counter(ws, counter: torch.Tensor, value: int, what: str) -> None:
    """The current stream waits until `counter` (int32 on this device) equals `value`, then
    zeroes it: stream memory operations, no SM."""
    ws.wait_value(what, counter, value, reset=True)


def _counter(ws, n: int) -> torch.Tensor:
    """Zeroed int32 counters of this workspace's kernels (the kernels and the copy stream leave
    them zeroed)."""
    per_ws = _counters.setdefault(ws, {})
    t = per_ws.get(n)
    if t is None:
        t = per_ws[n] = torch.zeros(n, dtype=torch.int32, device=ws.device)
    return t


def _scatter_blocks(m: int, segment: int) -> tuple[int, int]:
    """(blocks per rank, rows per block) of the reduce-scatter: one per batch-major run, else two
    where each holds whole 128-row tiles (the own blocks reduce one block behind the peers')."""
    if segment:
        return m // segment, segment
    return (2, m // 2) if m % 256 == 0 else (1, m)


def _serves(ws, a: torch.Tensor, m_total: int, n: int, blocks: int, rows: int, scatter: bool) -> str | None:
    """Why the GEMM cannot serve a problem of a ([rows, K] operand), m_total x n cut into
    `blocks` blocks of `rows` rows per rank (None: it can). Kept per workspace and problem (asked
    at every call; the problem's tile is tuned on first use), except the stream-operation check
    (a capture may be under way)."""
    key = (a.dtype, m_total, n, a.shape[1], a.stride(1), blocks, rows, scatter)
    per_ws = _served.setdefault(ws, {})
    why = per_ws.get(key, False)
    if why is False:
        why = _device_ready(ws, a.dtype) or _shape_served(ws, a, m_total, n, blocks, rows, scatter)
        if ws.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # (a capture cannot tune)
            per_ws[key] = why
    if why is None and not ws.uses_stream_ops():
        return ("its waits need stream memory operations (not torch's signal kernels, nor a caller's graph capture "
                "without beacons)")
    return why


def _shape_served(ws, a: torch.Tensor, m_total: int, n: int, blocks: int, rows: int, scatter: bool) -> str | None:
    if blocks > _MAX_BLOCKS:
        return f"{blocks} blocks per rank exceed {_MAX_BLOCKS}"
    k = a.shape[1]
    if (k * a.element_size()) % 16 or (n * 2) % 16 or a.stride(1) != 1:
        return "rows must be 16-byte aligned for TMA"
    cfg = _config(a.dtype, m_total, n, k, rows, ws.device, scatter, ws.world_size)
    if rows % cfg.block_m:
        return f"blocks of {rows} rows are not a multiple of the {cfg.block_m}-row tile"
    return None


def gather_available(ws, shard_2d: torch.Tensor, segment: int, k_mode: bool, n_min: int) -> str | None:
    """None where gather_matmul serves this call, else why not (the decomposition does)."""
    if k_mode:
        return "gathering along K is accumulated per block"
    m = shard_2d.shape[0]
    return _serves(ws, shard_2d, m * ws.world_size, n_min, *_gather_blocks(m, segment), scatter=False)


def _gather_blocks(m: int, segment: int) -> tuple[int, int]:
    """(blocks per rank, rows per block) of the all-gather: one per batch-major run, else up to
    _GATHER_SPLITS of at least _MIN_BLOCK_ROWS rows (the GEMM starts after the first own block)."""
    if segment:
        return m // segment, segment
    for blocks in range(_GATHER_SPLITS, 1, -1):
        if m % blocks == 0 and (m // blocks) % _MIN_BLOCK_ROWS == 0:
            return blocks, m // blocks
    return 1, m


def _peers(world: int, rank: int) -> list[int]:
    return [r for r in range(world) if r != rank]


def _wait_flag(ws, flag: torch.Tensor, what: str) -> None:
    """The current stream waits until `flag` (one uint32 of the signal pad) is set; it is not
    reset here (gather_matmul zeroes every flag once the GEMM and the copies are done)."""
    ws.wait_value(what, flag, 1, reset=False)


def gather_matmul(ws, shard_2d: torch.Tensor, bs: list[torch.Tensor], biases: list, *, segment: int = 0,
                  keep_gathered: bool, a_scale: torch.Tensor | None = None, scale_rows: torch.Tensor | None = None,
                  b_scales: list | None = None, out_dtype: torch.dtype | None = None, runs: Runs | None = None):
    """(gathered rows [R * m, K] rank-major (runs: in runs' order, as Transport.gather) or None,
    outputs [R * m, N_i] in the caller's row order (front order: rank-major; batch-major: run l of
    rank s at (l * R + s) * segment)). fp8:
    a_scale tensorwise (agreed, numel 1), or scale_rows [m] fp32 (rowwise: pushed with the rows).

    The GEMM reads the own rows (and rowwise scales) where they are. The copy stream pushes the
    rows (and scales) to the peers. When the caller keeps the gathered rows, the Gluon GEMM
    stores them from the a tiles it loads (where they lie in the outputs' row order: runs None
    in front order, the outputs' runs in batch-major); otherwise the copy stream copies each
    source's rows out of the workspace beside the GEMM (copy engines: the GEMM that waits may
    hold every SM). Every flag is zeroed after the join (the GEMM and the copy stream both read
    them)."""
    world, rank = ws.world_size, ws.rank
    m, k = shard_2d.shape
    scaled = scale_rows is not None
    g = _views_of(ws, ("gather", m, k, shard_2d.dtype, segment, scaled),
                  lambda: _GatherViews(ws, m, k, shard_2d.dtype, segment, scaled))
    blocks, rows, all_rows, all_scales, flags = g.blocks, g.rows, g.all_rows, g.all_scales, g.flags
    out_dtype = out_dtype or shard_2d.dtype
    outs = [shard_2d.new_empty((world * m, b.shape[1]), dtype=out_dtype) for b in bs]
    gathered = shard_2d.new_empty((world * m, k)) if keep_gathered else None
    lanes = ws.lanes
    lanes.fork(side=False)
    with lanes.copy():
        ws.barrier(channel=0)
        own = [shard_2d[j * rows : (j + 1) * rows] for j in range(blocks)] if blocks > 1 else [shard_2d]
        for dst, theirs, their_scales in g.peers:  # rank r+1's rows reach r first: its GEMM's next chunk
            for j in range(blocks):
                theirs[j].copy_(own[j])
                if their_scales is not None:
                    their_scales[j].copy_(scale_rows[j * rows : (j + 1) * rows])
                ws.put_signal(dst, channel=_SIGNAL_BASE + j)
    scales = b_scales or [None] * len(bs)
    a_scale_ws = all_scales if scaled else a_scale
    stored = False  # whether the GEMM wrote the gathered rows
    gemm_gathered = gathered if (runs is None) == (not segment) else None  # rows in the outputs' order
    ws.watch_device_wait(lambda: f"the rows of ranks {_peers(world, rank)} (single-launch GEMM)", flags)
    try:
        for i, (b, bias, b_scale) in enumerate(zip(bs, biases, scales)):
            stored |= launch(all_rows, b, outs[i], flags if i == 0 else None, g.sig, rows, rank * blocks, g.cmap,
                             a_scale=a_scale_ws, b_scale=b_scale, bias=bias, a_local=shard_2d,
                             a_local_scale=scale_rows, gathered=gemm_gathered if i == 0 else None)
    finally:  # (inside a caller's capture: its beacon goes down after the launches, even a failed one)
        ws.device_wait_done()
    if gathered is not None and not stored:
        with lanes.copy():
            runs = runs or rank_order(m)
            place(gathered, runs, rank, 0, shard_2d)
            for step in range(1, world):
                # a source's blocks and flags come in order from one stream: its last flag
                # means all its rows are here, copied out at once (one copy per run)
                src = (rank + step) % world
                _wait_flag(ws, flags[(blocks - 1) * world + src], f"rank {src}'s rows")
                place(gathered, runs, src, 0, all_rows[src * m : (src + 1) * m])
    lanes.join()
    g.flags_int.zero_()  # after every reader (stream-ordered); the next call's signals come later
    return gathered, outs


class _GatherViews:
    """What gather_matmul needs of the workspace for one problem, made once per problem and
    workspace generation (views cost host time at every call)."""

    def __init__(self, ws, m: int, k: int, dtype: torch.dtype, segment: int, scaled: bool) -> None:
        world, rank = ws.world_size, ws.rank
        self.blocks, self.rows = blocks, rows = _gather_blocks(m, segment)
        slot = m * k * dtype.itemsize
        scale_off = -(-world * slot // 256) * 256
        ws.ensure(scale_off + (world * m * 4 if scaled else 0))
        self.generation = ws.generation
        self.all_rows = ws.get_buffer(rank, (world * m, k), dtype, 0)
        self.all_scales = ws.get_buffer(rank, (world * m,), torch.float32, scale_off) if scaled else None
        self.flags = ws.signal_flags(_SIGNAL_BASE, blocks)  # (block j, source s) at j * world + s
        self.flags_int = self.flags.view(torch.int32)
        self.peers = []  # (dst, its slot's blocks, its scale slot's blocks), in push order
        for step in range(1, world):
            dst = (rank - step) % world
            theirs = ws.get_buffer(dst, (m, k), dtype, rank * slot)
            scales = ws.get_buffer(dst, (m,), torch.float32, scale_off + rank * m * 4) if scaled else None
            self.peers.append((dst, [theirs[j * rows : (j + 1) * rows] for j in range(blocks)],
                               None if scales is None else [scales[j * rows : (j + 1) * rows] for j in range(blocks)]))
        # the GEMM reads the own rows and scales in place (a descriptor per tile)
        self.cmap = ChunkMap(blocks=blocks, local_src=rank, out_src=segment or None, out_blk=world * segment or None)
        self.sig = (world * blocks, 1, world)


def _views_of(ws, key: tuple, make):
    """The views object of one problem (key) on ws, made by make() once per workspace
    generation: the views of replaced buffers are stale."""
    per_ws = _views.setdefault(ws, {})
    v = per_ws.get(key)
    if v is None or v.generation != ws.generation:
        if len(per_ws) >= 64:
            per_ws.clear()
        v = per_ws[key] = make()
    return v


def scatter_available(ws, a_2d: torch.Tensor, n: int, segment: int, n_mode: bool) -> str | None:
    """None where matmul_scatter serves this call, else why not."""
    if n_mode:
        return "scattering along N is a column split"
    return _serves(ws, a_2d, a_2d.shape[0], n, *_scatter_blocks(a_2d.shape[0] // ws.world_size, segment),
                   scatter=True)


def matmul_scatter(ws, a_2d: torch.Tensor, b: torch.Tensor, reduce_op: str, bias: torch.Tensor | None, *,
                   segment: int = 0, a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's reduced chunk [m, N] of a_2d @ b (rows in the chunk's order)."""
    world, rank = ws.world_size, ws.rank
    m = a_2d.shape[0] // world
    n = b.shape[1]
    out_dtype = out_dtype or (torch.bfloat16 if a_2d.element_size() == 1 else a_2d.dtype)
    v = _views_of(ws, ("scatter", m, n, out_dtype, segment), lambda: _ScatterViews(ws, m, n, out_dtype, segment))
    blocks, rows = v.blocks, v.rows
    out = a_2d.new_empty((m, n), dtype=out_dtype)
    partials = a_2d.new_empty((max(1, world - 1), m, n), dtype=out_dtype)
    lanes = ws.lanes
    lanes.fork(side=False)
    with lanes.copy():
        ws.barrier(channel=0)
    ws.watch_device_wait(lambda: f"the partials of ranks {_peers(world, rank)} (single-launch GEMM)", v.flags)
    try:
        tiles, _ = launch_producer(a_2d, b, partials, v.received, out, rank, world, blocks, v.a_strides, v.flag_ptr,
                                   (1, world), v.counters, reduce_op=reduce_op, a_scale=a_scale, b_scale=b_scale,
                                   bias=bias)
    finally:
        ws.device_wait_done()
    with lanes.copy():
        for j, step, dst, counter, theirs in v.pushes:
            _wait_counter(ws, counter, tiles, f"the GEMM's tiles of rank {dst}'s block {j}")
            theirs.copy_(partials[step - 1, j * rows : (j + 1) * rows])
            ws.put_signal(dst, channel=_SIGNAL_BASE + j)
    lanes.join()
    return out


class _ScatterViews:
    """What matmul_scatter needs of the workspace for one problem, made once per problem and
    workspace generation."""

    def __init__(self, ws, m: int, n: int, out_dtype: torch.dtype, segment: int) -> None:
        world, rank = ws.world_size, ws.rank
        self.blocks, self.rows = blocks, rows = _scatter_blocks(m, segment)
        self.a_strides = (segment, world * segment) if segment else (m, rows)
        chunk = m * n * out_dtype.itemsize
        ws.ensure(world * chunk)
        self.generation = ws.generation
        self.received = ws.get_buffer(rank, (world, m, n), out_dtype, 0)
        self.flags = ws.signal_flags(_SIGNAL_BASE, blocks)
        self.flag_ptr = RawPointer(self.flags.data_ptr())
        self.counters = _counter(ws, world * blocks + blocks)
        # (block, step, owner, the GEMM's tile counter of that block, the block's rows in the owner's slot)
        self.pushes = []
        for j in range(blocks):
            for step in range(1, world):
                dst = (rank + step) % world
                slot = ws.get_buffer(dst, (m, n), out_dtype, rank * chunk)
                self.pushes.append((j, step, dst, self.counters[dst * blocks + j], slot[j * rows : (j + 1) * rows]))

