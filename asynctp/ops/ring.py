"""Overlap without peer memory: the pipelines as a ring of point-to-point sends and receives
(NCCL or gloo, batched isend/irecv on a side stream), one chunk ahead of the compute.

All-gather (rank r, step s = 1 .. R-1): pass on the chunk received last step (first: r's own)
to r+1 and receive chunk r-s from r-1, while the chunk received last step is consumed.

Reduce-scatter (ring of partial sums, step s = 0 .. R-1, chunk c_s = r-s-1): compute this
rank's partial of c_s; from step 1 on add the running sum received from r-1; send it to r+1,
except at the last step, where c = r and the sum is the result. The next partial is computed
while the current sum travels. Sums travel in the output dtype (rounded at each hop, like
NCCL's ring), so with bf16 and more than 2 ranks results differ from serial by rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from asynctp.symm import Lanes

__all__ = ["ring_gather_and_consume", "ring_produce_and_reduce_scatter"]

_lanes: dict[str, Lanes] = {}


def _lanes_for(device: torch.device) -> Lanes:
    key = str(device)
    if key not in _lanes:
        _lanes[key] = Lanes(device)
    return _lanes[key]


def _exchange(send: torch.Tensor, recv: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup) -> None:
    """send to rank+1, receive from rank-1; returns once the active stream (or host) has them."""
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
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
    0, [chunk]) runs as each chunk arrives (same contract as pipeline.gather_and_consume)."""
    rank, world = group.rank(), group.size()
    m = shard.shape[0]
    lanes = _lanes_for(shard.device)

    def chunk(i: int) -> torch.Tensor:
        return gathered[i * m : (i + 1) * m]

    lanes.fork()
    with lanes.copy():
        chunk(rank).copy_(shard)
    consume(rank, 0, [shard])
    for step in range(1, world):
        src = (rank - step) % world
        with lanes.copy():
            _exchange(chunk((rank - step + 1) % world), chunk(src), rank, world, group)
            arrived = lanes.mark()
        lanes.wait(arrived)
        consume(src, 0, [chunk(src)])
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
    rank, world = group.rank(), group.size()
    m = chunk_shape[0]
    lanes = _lanes_for(device)
    bufs = torch.empty((3, *chunk_shape), dtype=dtype, device=device)  # partial, sum out, sum in
    out = torch.empty(chunk_shape, dtype=dtype, device=device)
    lanes.fork()
    sent = received = None
    for step in range(world):
        c = (rank - step - 1) % world
        partial = bufs[0] if step < world - 1 else out
        produce(c, 0, m, partial, None)  # overlaps the previous step's send/receive
        if step > 0:
            lanes.wait(received)
            partial.add_(bufs[2])
        if step < world - 1:
            if sent is not None:
                lanes.wait(sent)  # the previous send is done reading bufs[1]
            bufs[1].copy_(partial)
            ready = lanes.mark()
            with lanes.copy():
                lanes.wait(ready)
                _exchange(bufs[1], bufs[2], rank, world, group)
                received = sent = lanes.mark()
    if reduce_op == "avg":
        out.div_(world)
    lanes.join()
    return out
