"""Overlap without peer memory: the pipelines as a ring of point-to-point sends and receives
(NCCL or gloo, batched isend/irecv on a side stream), in row blocks, ahead of the compute.

All-gather (rank r, step s = 1 .. R-1): pass on the chunk received last step (first: r's own)
to r+1 and receive chunk r-s from r-1, block by block; each block is consumed once it arrived.

Reduce-scatter (ring of partial sums, step s = 0 .. R-1, chunk c_s = r-s-1): compute this
rank's partial of c_s; from step 1 on add the running sum received from r-1; send it to r+1,
except at the last step, where c = r and the sum is the result. Block by block: a block's
partial travels while the next block is computed. Sums travel in the output dtype (rounded at each hop, like
NCCL's ring), so with bf16 and more than 2 ranks results differ from serial by rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from asynctp.runtime.carveout import sm_carveout
from asynctp.runtime.collective import all_gather_rows
from asynctp.runtime.pipeline import row_blocks
from asynctp.runtime.transport import Runs, place
from asynctp.symm import Lanes

__all__ = ["RingTransport", "ring_gather_and_consume", "ring_produce_and_reduce_scatter"]

_lanes: dict[str, Lanes] = {}
SPLITS: int | None = None  # row blocks per chunk for every call (None: by size, below); experiments


def ring_splits(rows: int, device: torch.device) -> int:
    """Row blocks per chunk: each block's send/receive is its own NCCL call, so the matmul of a
    block starts as soon as it has arrived (and, for reduce-scatter, a block's partial travels
    while the next is computed). Measured on 2xH200 with peer access off (NCCL_P2P_DISABLE=1,
    16 SMs carved out, N 3584, K 8192), all-gather:
    M 4096 (2048 rows per rank) 1647 / 1582 / 1619 / 1734 us at 1 / 2 / 4 / 8 blocks (serial
    1661); M 8192 3412 / 3175 / 3130 / 3221 (serial 3269); reduce-scatter alike."""
    if SPLITS is not None:
        return SPLITS
    if device.type != "cuda":
        return 2 if rows >= 2 else 1  # CI covers the block path
    return 4 if rows >= 2048 else (2 if rows >= 512 else 1)


def _lanes_for(device: torch.device) -> Lanes:
    key = str(device)
    if key not in _lanes:
        _lanes[key] = Lanes(device)
    return _lanes[key]


def _neighbours(group: dist.ProcessGroup, rank: int, world: int) -> tuple[int, int]:
    """The global ranks of rank+1 and rank-1 in the group (looked up once per call)."""
    return dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peers: tuple[int, int], group: dist.ProcessGroup) -> None:
    """send to rank+1, receive from rank-1; returns once the active stream (or host) has them."""
    nxt, prv = peers
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def ring_gather_and_consume(
    group: dist.ProcessGroup,
    shard: torch.Tensor,
    gathered: torch.Tensor,
    consume: Callable[[int, int, list[torch.Tensor]], None],
) -> None:
    """gathered ([R * m, ...]) receives every rank's shard ([m, ...]) in rank order; consume(src,
    lo, [rows]) runs first for the local shard, then as each row block arrives (same contract as
    pipeline.gather_and_consume)."""
    with sm_carveout(shard.device, "ring"):
        _ring_gather(group, shard, gathered, consume)


def _ring_gather(group, shard, gathered, consume) -> None:
    rank, world = group.rank(), group.size()
    peers = _neighbours(group, rank, world)
    m = shard.shape[0]
    lanes = _lanes_for(shard.device)
    blocks = row_blocks(m, ring_splits(m, shard.device))

    def chunk(i: int) -> torch.Tensor:
        return gathered[i * m : (i + 1) * m]

    lanes.fork()
    # Every send/receive is queued on the copy stream up front, block by block and step by step
    # (a step forwards what the one before brought), and before the local matmul: NCCL's
    # kernels then hold their SMs before a persistent GEMM takes the rest.
    arrived = []
    with lanes.copy():
        for step in range(1, world):
            src = (rank - step) % world
            send = shard if step == 1 else chunk((rank - step + 1) % world)
            for lo, hi in blocks:
                _exchange(send[lo:hi], chunk(src)[lo:hi], peers, group)
                arrived.append((src, lo, hi, lanes.mark()))
        chunk(rank).copy_(shard)
    consume(rank, 0, [shard])
    for src, lo, hi, event in arrived:
        lanes.wait(event)
        consume(src, lo, [chunk(src)[lo:hi]])
    lanes.join()


def ring_produce_and_reduce_scatter(
    group: dist.ProcessGroup,
    produce: Callable[[int, int, int, torch.Tensor, torch.Tensor | None], None],
    chunk_shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    reduce_op: str,
) -> torch.Tensor:
    """This rank's reduced chunk (fresh [m, n]); produce as in pipeline.produce_and_reduce_scatter
    (called with acc=None only)."""
    with sm_carveout(device, "ring"):
        return _ring_reduce_scatter(group, produce, chunk_shape, dtype, device, reduce_op)


def _ring_reduce_scatter(group, produce, chunk_shape, dtype, device, reduce_op) -> torch.Tensor:
    rank, world = group.rank(), group.size()
    peers = _neighbours(group, rank, world)
    m = chunk_shape[0]
    lanes = _lanes_for(device)
    blocks = row_blocks(m, ring_splits(m, device))
    bufs = torch.empty((3, *chunk_shape), dtype=dtype, device=device)  # partial, sum out, sum in
    out = torch.empty(chunk_shape, dtype=dtype, device=device)
    lanes.fork()
    done: list = [None] * len(blocks)  # per block: its last send/receive has completed
    for step in range(world):
        c = (rank - step - 1) % world
        partial = bufs[0] if step < world - 1 else out
        for b, (lo, hi) in enumerate(blocks):
            produce(c, lo, hi, partial[lo:hi], None)  # overlaps the sends/receives queued before
            if step > 0:
                lanes.wait(done[b])
                partial[lo:hi].add_(bufs[2][lo:hi])
            if step < world - 1:
                if done[b] is not None:
                    lanes.wait(done[b])  # the previous send is done reading bufs[1]
                bufs[1][lo:hi].copy_(partial[lo:hi])
                ready = lanes.mark()
                with lanes.copy():
                    lanes.wait(ready)
                    _exchange(bufs[1][lo:hi], bufs[2][lo:hi], peers, group)
                    done[b] = lanes.mark()
    if reduce_op == "avg":
        out.div_(world)
    lanes.join()
    return out


class RingTransport:
    """runtime.transport.Transport over send/recv (no workspace). The ring moves one tensor, the
    first shard's rows; further shards (a rowwise fp8 scale: 4 bytes a row) are all-gathered up
    front and each block is handed its rows of them. Its own row blocks: ring_splits."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank, self.world_size = group.rank(), group.size()

    def gather(self, shards: list[torch.Tensor], gathered: list[torch.Tensor | None],
               consume: Callable[[int, int, list[torch.Tensor]], None], *, alternate: bool, lockstep: bool,
               runs: Runs | None = None) -> None:
        m, world = shards[0].shape[0], self.world_size
        extras = []
        for shard in shards[1:]:
            rows = shard.new_empty((world * m, *shard.shape[1:]))
            all_gather_rows(rows, shard, self.group)
            extras.append(rows)

        def with_extras(src: int, lo: int, blocks: list[torch.Tensor]) -> None:
            hi = src * m + lo + blocks[0].shape[0]
            consume(src, lo, [blocks[0], *(rows[src * m + lo : hi] for rows in extras)])

        # the ring receives into the gathered rows in rank order: made here when the caller does
        # not keep them or wants another order (then placed once the ring is done)
        keep = gathered[0]
        into = keep if keep is not None and runs is None else shards[0].new_empty((world * m, *shards[0].shape[1:]))
        ring_gather_and_consume(self.group, shards[0], into, with_extras if extras else consume)
        if keep is not None and runs is not None:
            for src in range(world):
                place(keep, runs, src, 0, into[src * m : (src + 1) * m])

    def reduce_scatter(self, produce: Callable[[int, int, int, torch.Tensor, torch.Tensor | None], None],
                       chunk_shape: tuple[int, int], dtype: torch.dtype, reduce_op: str, *,
                       fused_acc: bool) -> torch.Tensor:
        return ring_produce_and_reduce_scatter(self.group, produce, chunk_shape, dtype, self.device, reduce_op)
