"""The one interface a decomposed fused op runs on: an all-gather that hands each arrived row
block to a consumer, and a reduce-scatter of partials that a producer makes block by block.

An op's body (ops/*: which matmul a block gets) is written once against this interface; the
schedules implement it: the symmetric-memory pipeline (runtime/pipeline.py: SymmTransport, the
same code on CUDA and on the cpu backend) and the send/recv ring for groups without peer memory
(runtime/ring.py: RingTransport). The serial reference and the single-launch kernels
(runtime/kernel_path.py) run whole calls and are chosen beside them by ops/dispatch.py.

consume(src_rank, row_lo, blocks): blocks[i] holds rows row_lo : row_lo + len(blocks[0]) of
rank src_rank's shards[i]; it must only read them (they may be views of a shared buffer).
produce(dst_rank, lo, hi, out, acc): writes this rank's partial of rows lo:hi of dst_rank's
chunk into out, or acc + partial when acc is given (one rounding: the GEMM's epilogue).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["Transport", "Consume", "Produce", "Runs", "rank_order", "place"]

Consume = Callable[[int, int, list[torch.Tensor]], None]
Runs = Callable[[int, int, int], list[tuple[int, int, int]]]
Produce = Callable[[int, int, int, torch.Tensor, "torch.Tensor | None"], None]


class Transport(Protocol):
    """Moves one call's rows between the ranks of a group, the compute hooked into each block."""

    rank: int
    world_size: int

    def gather(
        self,
        shards: list[torch.Tensor],
        gathered: list[torch.Tensor | None],
        consume: Consume,
        *,
        alternate: bool,
        lockstep: bool,
        runs: Runs | None = None,
    ) -> None:
        """All-gather each shard ([m, ...], same m) into gathered[i] ([R * m, ...], rank order;
        None: not kept) and consume every block once it arrived, the local shard first.
        alternate: consecutive consumes may run on two streams (disjoint outputs only).
        lockstep: the plan's lockstep may apply (False: the consumer shares state across blocks).
        runs: where gathered rows go instead of rank order: runs(src, lo, count) lists rows lo :
        lo + count of rank src's shard as (offset from lo, gathered row, count) runs (the
        caller's order: GatherLayout.gathered_runs; no reordering copy afterwards)."""
        ...

    def reduce_scatter(
        self,
        produce: Produce,
        chunk_shape: tuple[int, int],
        dtype: torch.dtype,
        reduce_op: str,
        *,
        fused_acc: bool,
    ) -> torch.Tensor:
        """This rank's reduced chunk (a fresh [m, n] tensor) of the partials produce makes.
        fused_acc: produce can write acc + partial (False: it is never given acc)."""
        ...


def rank_order(m: int) -> Runs:
    """The gathered rows' default order: rank src's m rows at src * m, one run."""
    return lambda src, lo, count: [(0, src * m + lo, count)]


def place(gathered: torch.Tensor, runs: Runs, src: int, lo: int, block: torch.Tensor) -> None:
    """Copy block (rows lo : lo + len(block) of rank src's shard) into gathered, run by run
    (each run a contiguous copy: a copy engine's, no SM kernel)."""
    for off, row, count in runs(src, lo, block.shape[0]):
        gathered[row : row + count].copy_(block[off : off + count])
