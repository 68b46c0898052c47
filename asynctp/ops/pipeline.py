"""The pipelined collectives over a Workspace, with compute hooked into each chunk.

gather_and_consume (pull-based ring, all-gather -> consumer):

    rank r:  copy shard -> own buffer | barrier(0) | copy stream: pull rank r+1, r+2, ...,
             barrier(1) (peers are done reading r's buffer)
             compute:  consume(r) from the input itself, then consume(r+k) once its pull landed,
                       alternating the caller's stream and a side stream

produce_and_reduce_scatter (push-based, producer -> reduce-scatter):

    rank r:  copy stream: barrier(0) (every rank finished its previous op, slots are free)
             compute:  produce chunk for r+1, r+2, ... into a temporary; the copy stream pushes
                       each into slot r of its owner's buffer; produce own chunk into own slot
             barrier(1) (every push into r's slots landed) | one fp32 reduction of r's slots

The same code runs on the cpu backend, where the Lanes are no-ops and everything is in
program order. Buffer layout is per call, from offset 0 (see symm/workspace.py's contract).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asynctp.symm import Workspace

__all__ = ["gather_and_consume", "produce_and_reduce_scatter"]

_ALIGN = 256  # cuBLAS and the copy engines like 256-byte aligned operands


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def gather_and_consume(
    ws: Workspace,
    shards: list[torch.Tensor],
    gathered: list[torch.Tensor],
    consume: Callable[[int, list[torch.Tensor]], None],
    *,
    alternate: bool = True,
) -> None:
    """All-gather each shard ([m_i, ...], contiguous) into gathered[i] ([R * m_i, ...], rank order)
    and call consume(src_rank, chunks) as each rank's chunks arrive, local rank first.

    consume must only read its chunks; with alternate=True consecutive calls may run on two
    streams at once, so they must write disjoint outputs.
    """
    rank, world = ws.rank, ws.world_size
    offsets, total = [], 0
    for t in shards:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    ws.ensure(total)
    lanes = ws.lanes

    for t, off in zip(shards, offsets):
        ws.get_buffer(rank, t.shape, t.dtype, off).copy_(t)
    ws.barrier(channel=0)
    lanes.fork()

    def chunks_of(src: int) -> list[torch.Tensor]:
        return [g[src * t.shape[0] : (src + 1) * t.shape[0]] for g, t in zip(gathered, shards)]

    arrived = {}
    with lanes.copy():
        for step in range(1, world):
            src = (rank + step) % world
            for dst, t, off in zip(chunks_of(src), shards, offsets):
                dst.copy_(ws.get_buffer(src, t.shape, t.dtype, off))
            arrived[src] = lanes.mark()
        ws.barrier(channel=1)
        # the local chunk is needed only by the caller: copy it after the peers' chunks
        for dst, t in zip(chunks_of(rank), shards):
            dst.copy_(t)

    with lanes.compute(0):
        consume(rank, shards)
    for step in range(1, world):
        src = (rank + step) % world
        with lanes.compute(step if alternate else 0):
            lanes.wait(arrived[src])
            consume(src, chunks_of(src))
    lanes.join()


def produce_and_reduce_scatter(
    ws: Workspace,
    produce: Callable[[int, torch.Tensor], None],
    chunk_shape: tuple[int, int],
    dtype: torch.dtype,
    reduce_op: str,
) -> torch.Tensor:
    """Reduce-scatter of chunks made on the fly: produce(dst_rank, out) writes this rank's partial
    for dst_rank into out ([m, n]). Returns this rank's reduced chunk, a fresh [m, n] tensor."""
    rank, world = ws.rank, ws.world_size
    chunk_bytes = _aligned(chunk_shape[0] * chunk_shape[1] * dtype.itemsize)
    ws.ensure(world * chunk_bytes)
    lanes = ws.lanes

    def slot(owner: int, src: int) -> torch.Tensor:
        return ws.get_buffer(owner, chunk_shape, dtype, src * chunk_bytes)

    # temporaries come from the caller's stream, before the fork, so freeing them after the
    # join is ordered after every use on the side streams
    partials = [torch.empty(chunk_shape, dtype=dtype, device=ws.device) for _ in range(world - 1)]
    lanes.fork()
    with lanes.copy():
        ws.barrier(channel=0)
    for step in range(1, world):
        dst = (rank + step) % world
        with lanes.compute(step - 1):
            produce(dst, partials[step - 1])
            ready = lanes.mark()
        with lanes.copy():
            lanes.wait(ready)
            slot(dst, rank).copy_(partials[step - 1])
    with lanes.compute(world - 1):
        produce(rank, slot(rank, rank))
    lanes.join()
    ws.barrier(channel=1)
    return _reduce(ws.get_buffer(rank, (world, *chunk_shape), dtype, 0) if _packed(chunk_shape, dtype)
                   else torch.stack([slot(rank, src) for src in range(world)]), reduce_op)


def _packed(chunk_shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Slots sit back to back (no alignment padding), so they view as one [R, m, n] tensor."""
    nbytes = chunk_shape[0] * chunk_shape[1] * dtype.itemsize
    return nbytes == _aligned(nbytes)


def _reduce(slots: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Sum (or average) over ranks with one rounding; always a fresh tensor."""
    world = slots.shape[0]
    if world == 2 and reduce_op == "sum":
        return torch.add(slots[0], slots[1])  # computed in fp32, rounded once
    total = torch.sum(slots, dim=0, dtype=torch.float32 if slots.dtype != torch.float64 else None)
    if reduce_op == "avg":
        total.div_(world)
    return total.to(slots.dtype)
