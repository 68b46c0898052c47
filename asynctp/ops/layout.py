"""How an N-D gather/scatter along any dim maps onto 2-D row blocks, and back.

Shape legend (R = world size):
    a_shard   [..., s at gather_dim, ..., K]   this rank's shard
    shard_2d  [m, K]        a_shard with gather_dim moved first, flattened (m = numel / K)
    rows      [R * m, K]    every rank's shard_2d stacked in rank order (what all_gather gives)
Gathering along the last dim (K) is the "k mode": shard_2d is [M, k] and rank r's block of
the gathered matrix is columns r*k:(r+1)*k, which multiplies rows r*k:(r+1)*k of b.

Outputs are fresh tensors, contiguous in the caller's layout (moved_back): the row tensors with
the gather/scatter dim moved back in place, copied when that dim is not already outermost (a
leading dim of size > 1, e.g. batch 2 with a sequence dim 1). Serial and pipelined strategies
and the fake implementations return identical layouts. The batch-major order (BATCH_MAJOR:
auto, the default, where each rank's run of rows is >= BATCH_MAJOR_MIN_ROWS; "1" always; "0"
never) lets the pipelined and ring strategies keep the caller's row order instead of moving the
dim first and back (no copies; one GEMM per run of rows): GatherLayout.out_runs,
ScatterLayout.a_runs. Measured on 2xH200: faster from runs of 512 rows (docs/performance.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asynctp.runtime.transport import Runs

__all__ = ["GatherLayout", "ScatterLayout", "gather_layout", "scatter_layout", "matmul_rows", "moved_back",
           "batch_major_ok", "batch_major_mode", "rank_runs", "BATCH_MAJOR",
           "BATCH_MAJOR_MIN_ROWS"]

BATCH_MAJOR = "auto"  # auto (default) / 1 / 0: gathers / scatters behind leading dims keep the caller's row order


def moved_back(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t (the gather/scatter dim first) with that dim moved back to `dim`, contiguous. The strided
    view alone would be free, but its batch stride smaller than its sequence stride made cuDNN's
    bf16 attention backward return wrong gradients (H200, batch 2; benchmarks/probe_sdpa_strides.py
    shows it on one GPU); callers get the layout torch's own ops give. No copy when every
    dim before `dim` has size 1."""
    return t.movedim(0, dim).contiguous() if dim else t


def rank_runs(rank: int, lo: int, hi: int, m: int, segment: int, world_size: int) -> list[tuple[int, int, int]]:
    """Rows lo:hi of a rank's m rows as runs of the full R * m rows: (row - lo, full row, count)
    each. Front order (segment 0): the rank's rows are one run at rank * m. Batch-major: they
    are runs of `segment` rows, one per leading index l, at (l * R + rank) * segment."""
    if not segment:
        return [(0, rank * m + lo, hi - lo)]
    runs = []
    for lead in range(lo // segment, -(-hi // segment)):
        j0, j1 = max(lo, lead * segment) - lead * segment, min(hi, (lead + 1) * segment) - lead * segment
        runs.append((lead * segment + j0 - lo, (lead * world_size + rank) * segment + j0, j1 - j0))
    return runs


def matmul_rows(a: torch.Tensor, dim: int, world_size: int, gather: bool) -> int:
    """Rows M of the full (gathered / unscattered) 2-D matmul, from shapes alone (no copy)."""
    rows = a.numel() // max(1, a.shape[-1])
    return rows * world_size if gather and dim != a.ndim - 1 else rows


@dataclass(frozen=True)
class GatherLayout:
    """Row order of a gather dim behind leading dims (L = their product > 1): front (default), a
    shard with the gather dim moved first and copied, outputs moved back (another copy); or
    batch-major (segment > 0, see batch_major_ok; pipelined / ring strategies only): shard_2d
    is the shard in the caller's order, no copy, and rank r's rows l * seg + [0, seg) land in
    output rows l * R * seg + r * seg + [0, seg), one GEMM per run (see out_runs)."""

    shard_2d: torch.Tensor  # [m, K] (k mode: [M, k]), contiguous
    dim: int  # normalized gather dim
    k_mode: bool
    world_size: int
    front_shape: tuple[int, ...]  # rows viewed N-D, gather dim first (row mode; batch-major: in place); a_shard.shape[:-1] (k mode)
    segment: int = 0  # batch-major: rows of a shard per leading index (0: front order)

    @property
    def m(self) -> int:
        return self.shard_2d.shape[0]

    def new_rows(self, cols: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh [R * m, cols] tensor (the gathered rows, or row-mode outputs)."""
        return self.shard_2d.new_empty((self.world_size * self.m, cols), dtype=dtype)

    def out_runs(self, src: int, lo: int, count: int) -> list[tuple[int, int, int]]:
        """Rows lo:lo+count of src's shard as runs of the row-mode output: (row in the block,
        output row, count) each (see rank_runs)."""
        return rank_runs(src, lo, lo + count, self.m, self.segment, self.world_size)

    @property
    def gathered_runs(self) -> Runs | None:
        """Where a transport puts the gathered rows so that they need no reordering: out_runs
        (batch-major), None (rank order: front order and k mode already are the caller's)."""
        return self.out_runs if self.segment and not self.k_mode else None

    def a_gathered(self, rows: torch.Tensor, placed: bool = False) -> torch.Tensor:
        """The gathered a from stacked rows [R * m, k]: the serial reference's layout. placed:
        the rows were written where gathered_runs puts them (a view, no reordering copy)."""
        if placed and not self.k_mode:
            return self.restore(rows)
        if self.k_mode:
            lead = self.front_shape
            k = rows.shape[1]
            full = rows.view(self.world_size, self.m, k).permute(1, 0, 2).reshape(self.m, self.world_size * k)
            return full.view(*lead, self.world_size * k)
        if self.segment:  # rank-major runs [R, L, seg, k] -> the caller's order [L, R, seg, k] (a copy)
            k = rows.shape[1]
            per_rank = rows.view(self.world_size, self.m // self.segment, self.segment, k)
            return per_rank.transpose(0, 1).reshape(*self.front_shape, k)
        return self.restore(rows)

    def restore(self, out_2d: torch.Tensor) -> torch.Tensor:
        """A row-mode [R * m, n] result (or k-mode [M, n]) as N-D with the gather dim in place."""
        if self.k_mode or self.segment:
            return out_2d.view(*self.front_shape, out_2d.shape[1])
        return moved_back(out_2d.view(*self.front_shape[:-1], out_2d.shape[1]), self.dim)


def gather_layout(a_shard: torch.Tensor, dim: int, world_size: int, batch_major: bool = False) -> GatherLayout:
    """batch_major: use the batch-major order where batch_major_ok (callers whose outputs are
    written by the pipeline's consumer; the serial all_gather needs the front order)."""
    if dim == a_shard.ndim - 1:
        shard_2d = a_shard.reshape(-1, a_shard.shape[-1]).contiguous()
        return GatherLayout(shard_2d, dim, True, world_size, tuple(a_shard.shape[:-1]))
    if batch_major and batch_major_ok(a_shard, dim, math.prod(a_shard.shape[dim:-1])):
        shard_2d = a_shard.reshape(-1, a_shard.shape[-1]).contiguous()  # the caller's order (no copy when contiguous)
        full = (*a_shard.shape[:dim], world_size * a_shard.shape[dim], *a_shard.shape[dim + 1 : -1])
        return GatherLayout(shard_2d, dim, False, world_size, full,
                            segment=a_shard.shape[dim] * math.prod(a_shard.shape[dim + 1 : -1]))
    front = a_shard.movedim(dim, 0) if dim else a_shard
    front = front.contiguous()
    shard_2d = front.view(-1, front.shape[-1])
    front_shape = (world_size * front.shape[0], *front.shape[1:])
    return GatherLayout(shard_2d, dim, False, world_size, front_shape)


@dataclass(frozen=True)
class ScatterLayout:
    """Shape legend: a [..., S at scatter_dim, ..., K]; a_2d [R * m, K] (n mode: [M, K], b's
    columns are scattered instead); each rank's chunk of a @ b is [m, N] (n mode: [M, N / R]).

    Two row orders for a scatter dim behind leading dims (L = their product > 1):
      front (serial strategy; short runs): a with the scatter dim moved first and copied, so each
          rank's chunk is one run of rows; the output is moved back (another copy).
      batch-major (segment > 0, see batch_major_ok; pipelined / ring strategies only): a_2d is
          a in the caller's order, no copy; rank r's chunk is L runs ("segments") of `segment`
          rows, l * R * segment + r * segment + [0, segment), one GEMM each, and the chunk's rows
          are already the output's order (no copy back)."""

    a_2d: torch.Tensor
    dim: int
    n_mode: bool
    world_size: int
    out_front_shape: tuple[int, ...]  # the output's N-D shape, scatter dim first, minus N (batch-major: in place)
    segment: int = 0  # batch-major: rows per run of a rank's chunk (0: front order)

    def chunk_shape(self, n: int) -> tuple[int, int]:
        if self.n_mode:
            return (self.a_2d.shape[0], n // self.world_size)
        return (self.a_2d.shape[0] // self.world_size, n)

    def a_chunk(self, rank: int) -> torch.Tensor:
        """Rank's chunk of a_2d as one tensor (front order only)."""
        if self.segment:
            raise RuntimeError("a_chunk requires the front order; batch-major chunks are runs (a_runs)")
        m = self.a_2d.shape[0] // self.world_size
        return self.a_2d[rank * m : (rank + 1) * m]

    def a_runs(self, rank: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Rows lo:hi of rank's chunk as runs of a_2d: (chunk row - lo, a_2d row, count) each (see
        rank_runs)."""
        return rank_runs(rank, lo, hi, self.a_2d.shape[0] // self.world_size, self.segment, self.world_size)

    def restore(self, out_2d: torch.Tensor) -> torch.Tensor:
        out = out_2d.view(*self.out_front_shape, out_2d.shape[1])
        return out if (self.n_mode or self.segment) else moved_back(out, self.dim)


BATCH_MAJOR_MIN_ROWS = 512  # auto: the batch-major order where each run has at least this many rows


def batch_major_mode() -> str:
    """BATCH_MAJOR: "auto" (the default), "1" (always where possible) or "0" (never); a tuning
    knob of this module, not a setting."""
    if BATCH_MAJOR not in ("auto", "0", "1"):
        raise ValueError(f"asynctp.ops.layout.BATCH_MAJOR requires 'auto', '0' or '1', got {BATCH_MAJOR!r}")
    return BATCH_MAJOR


def batch_major_ok(a: torch.Tensor, dim: int, run_rows: int) -> bool:
    """Whether gather_layout / scatter_layout(batch_major=True) use the batch-major order for a:
    a gather / scatter dim behind leading dims of more than one element, not the last dim, and
    BATCH_MAJOR "1", or "auto" (the default) with run_rows (a rank's rows of one leading
    index) at least BATCH_MAJOR_MIN_ROWS: shorter runs make many small GEMMs."""
    if not (0 < dim < a.ndim - 1 and math.prod(a.shape[:dim]) > 1):
        return False
    mode = batch_major_mode()
    if mode != "auto":
        return mode == "1"
    return run_rows >= BATCH_MAJOR_MIN_ROWS


def scatter_layout(a: torch.Tensor, dim: int, world_size: int, batch_major: bool = False) -> ScatterLayout:
    """batch_major: use the batch-major order where batch_major_ok (callers whose rows go
    through the pipeline's produce; the serial reduce_scatter needs the front order)."""
    if dim == a.ndim - 1:
        a_2d = a.reshape(-1, a.shape[-1]).contiguous()
        return ScatterLayout(a_2d, dim, True, world_size, tuple(a.shape[:-1]))
    if batch_major and batch_major_ok(a, dim, math.prod(a.shape[dim:-1]) // world_size):
        a_2d = a.reshape(-1, a.shape[-1]).contiguous()  # the caller's order (no copy when contiguous)
        s = a.shape[dim] // world_size
        out_shape = (*a.shape[:dim], s, *a.shape[dim + 1 : -1])
        return ScatterLayout(a_2d, dim, False, world_size, out_shape, segment=s * math.prod(a.shape[dim + 1 : -1]))
    front = a.movedim(dim, 0) if dim else a
    front = front.contiguous()
    a_2d = front.view(-1, front.shape[-1])
    out_front = (front.shape[0] // world_size, *front.shape[1:-1])
    return ScatterLayout(a_2d, dim, False, world_size, out_front)
