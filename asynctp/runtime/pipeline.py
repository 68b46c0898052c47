"""The pipelined collectives over a Workspace, with compute hooked into each block.

Each rank's chunk is cut into `splits` row blocks, so the first remote matmul starts after one
block has landed, not a whole chunk.

gather_and_consume (push-based, all-gather -> consumer), rank r:

    copy stream:  barrier(0): every rank finished its previous op, slots are free | push each
                  block of the shard into slot r of r+1, r+2, ..., then signal that peer |
                  local shard -> output | each received block slot -> output once it arrived
    compute:      after barrier(0), consume(r) straight from the input, then each block of
                  r-1, r-2, ... straight from its slot in r's own buffer, after its signal
  No staging copy of the shard before the barrier and, when the caller does not keep the
  gathered tensor, no copy out of the buffer at all; every push is matched by a wait on its
  signal, so no closing barrier is needed. (Pushing beat pulling: docs/performance.md.)

produce_and_reduce_scatter (push-based, producer -> reduce-scatter), rank r:

    copy stream:  barrier(0): every rank finished its previous op, slots are free |
                  push each produced block into slot r of its owner, then signal the owner
    compute:      produce the blocks for r+1, r+2, ... first, own blocks last. With 2 ranks
                  and a GEMM that can accumulate (addmm: bf16, fp16, fp32), an own block's GEMM waits for
                  the peer's signal and adds onto the received partial in its epilogue.
                  Otherwise (fp8's scaled GEMM, more ranks) the own block's GEMM runs at once,
                  and its reduction (one addition, or one fp32 sum over the slots) waits for the
                  peers' signals (fp8: on a side stream, under the next own block's GEMM)
No closing barrier is needed: every push is matched by a wait on its signal.

The same code runs on the cpu backend, where the Lanes are no-ops and work runs in program
order. Buffer layout is per call, from offset 0 (see symm/workspace.py's contract).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from asynctp.runtime.carveout import sm_carveout
from asynctp.runtime.transport import Runs, place, rank_order
from asynctp.symm import Workspace

__all__ = ["SymmTransport", "gather_and_consume", "produce_and_reduce_scatter", "row_blocks"]

_ALIGN = 256  # cuBLAS and the copy engines like 256-byte aligned operands
_SIGNAL_BASE = 2  # signal channels start after the two barrier channels


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def row_blocks(rows: int, splits: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of `splits` near-equal blocks (fewer if rows < splits)."""
    splits = max(1, min(splits, rows))
    bounds = [rows * i // splits for i in range(splits + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(splits)]


def gather_and_consume(
    ws: Workspace,
    shards: list[torch.Tensor],
    gathered: list[torch.Tensor | None],
    consume: Callable[[int, int, list[torch.Tensor]], None],
    *,
    splits: int = 1,
    alternate: bool = True,
    lockstep: bool = False,
    runs: Runs | None = None,
) -> None:
    """All-gather each shard ([m, ...], contiguous, same m) into gathered[i] ([R * m, ...], rank
    order or runs' order (Transport.gather); None: the caller does not keep it) and call
    consume(src_rank, row_lo, blocks) as blocks arrive: first the whole local shard (row_lo 0),
    then each peer's row blocks. consume must only read its blocks (they may be views of the
    workspace: never keep or return them); with alternate=True consecutive calls may run on two
    streams at once (disjoint outputs only). lockstep: the local consume waits for the opening
    barrier (see _push_gather_and_consume)."""
    with sm_carveout(ws.device, "pipeline"), _settled(ws):
        _push_gather_and_consume(ws, shards, gathered, consume, splits, alternate, lockstep, runs)


@contextlib.contextmanager
def _settled(ws: Workspace) -> Iterator[None]:
    """An op that raises between its fork and join is marked abandoned (Lanes.abandon): the
    watchdog would otherwise take its waits for ones still being queued."""
    try:
        yield
    except BaseException:
        ws.lanes.abandon()
        raise


def _slots(shards: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of each shard within one rank's slot, and the slot's size (aligned)."""
    offsets, total = [], 0
    for t in shards:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    return offsets, total


def _push_gather_and_consume(ws, shards, gathered, consume, splits, alternate, lockstep, runs) -> None:
    rank, world = ws.rank, ws.world_size
    m = shards[0].shape[0]
    runs = runs or rank_order(m)
    offsets, total = _slots(shards)
    ws.ensure(world * total)  # slot s of a rank's buffer: what rank s pushed to it
    lanes = ws.lanes
    blocks = row_blocks(m, splits)
    keep = any(g is not None for g in gathered)

    def slot(owner: int, src: int) -> list[torch.Tensor]:
        return [ws.get_buffer(owner, t.shape, t.dtype, src * total + off) for t, off in zip(shards, offsets)]

    lanes.fork()
    with lanes.copy():
        ws.barrier(channel=0)
        in_step = lanes.mark() if lockstep else None
    # lockstep: the local GEMM waits for the barrier although it needs nothing from anyone.
    # Started early on the rank that finished its previous op first, a long GEMM holds every SM
    # (cuBLAS GEMMs are persistent) when that rank's remote data lands, and the ranks fall out
    # of step by a GEMM's length each call (2xH200, M 8192: 830-890 us instead of 750).
    with lanes.compute(0):
        lanes.wait(in_step)
        consume(rank, 0, shards)
    with lanes.copy():
        for step in range(1, world):
            dst = (rank + step) % world
            theirs = slot(dst, rank)
            for b, (lo, hi) in enumerate(blocks):
                for p, t in zip(theirs, shards):
                    p[lo:hi].copy_(t[lo:hi])
                ws.put_signal(dst, channel=_SIGNAL_BASE + b)
        for g, t in zip(gathered, shards):
            if g is not None:
                place(g, runs, rank, 0, t)
    i = 0
    for step in range(1, world):
        src = (rank - step) % world  # the peer whose first push goes to this rank at this step
        mine = slot(rank, src)
        for b, (lo, hi) in enumerate(blocks):
            with lanes.compute(i + 1 if alternate else 0):
                ws.wait_signal(src, channel=_SIGNAL_BASE + b)
                landed = lanes.mark() if keep else None  # the copy out need not wait for consume
                consume(src, lo, [p[lo:hi] for p in mine])
            if keep:
                with lanes.copy():
                    lanes.wait(landed)
                    for g, p in zip(gathered, mine):
                        if g is not None:
                            place(g, runs, src, lo, p[lo:hi])
            i += 1
    lanes.join()


def produce_and_reduce_scatter(
    ws: Workspace,
    produce: Callable[[int, int, int, torch.Tensor, torch.Tensor | None], None],
    chunk_shape: tuple[int, int],
    dtype: torch.dtype,
    reduce_op: str,
    *,
    splits: int = 1,
    fused_acc: bool = True,
) -> torch.Tensor:
    """Reduce-scatter of partials made on the fly. produce(dst_rank, lo, hi, out, acc) writes this
    rank's partial for rows lo:hi of dst_rank's chunk into out ([hi - lo, n]); when acc is given
    it must write acc + partial instead (one rounding: the GEMM epilogue). fused_acc=False: the
    producer has no such epilogue (acc is never given); each own block's reduction then runs on
    the side stream, under the next block's GEMM, and only the last one adds to the tail.
    Returns this rank's reduced chunk, a fresh [m, n] tensor."""
    with sm_carveout(ws.device, "pipeline"), _settled(ws):
        return _produce_and_reduce_scatter(ws, produce, chunk_shape, dtype, reduce_op, splits, fused_acc)


def _produce_and_reduce_scatter(ws, produce, chunk_shape, dtype, reduce_op, splits, fused_acc) -> torch.Tensor:
    rank, world = ws.rank, ws.world_size
    m, n = chunk_shape
    chunk_bytes = _aligned(m * n * dtype.itemsize)
    ws.ensure(world * chunk_bytes)
    lanes = ws.lanes
    blocks = row_blocks(m, splits)

    def slot(owner: int, src: int) -> torch.Tensor:
        return ws.get_buffer(owner, chunk_shape, dtype, src * chunk_bytes)

    # everything the side streams touch is allocated here, on the caller's stream, before the
    # fork: freeing it after the join is then ordered after every use
    out = torch.empty(chunk_shape, dtype=dtype, device=ws.device)
    partials = torch.empty((world - 1, m, n), dtype=dtype, device=ws.device)
    one_add = world == 2 and reduce_op == "sum"  # the reduction is one addition of two parts
    epilogue = fused_acc and one_add  # ... done by the GEMM onto the received partial
    first_fused = 0 if epilogue else len(blocks)  # the blocks from this one on reduce in the epilogue
    own_partial = (torch.empty(chunk_shape, dtype=dtype, device=ws.device)
                   if (world == 2 and first_fused > 0) else None)
    # the fp32 (fp64) accumulator of any other reduction, allocated before any wait (as is
    # everything else here): a host blocked in an allocation or a kernel's first load behind a
    # stuck wait cannot run the watchdog's abort (4xH200; _load_reduce_kernels)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = None if one_add else torch.empty(chunk_shape, dtype=acc_dtype, device=ws.device)
    own = slot(rank, rank)

    def own_block(lo: int, hi: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(where the own GEMM writes rows lo:hi, the parts their reduction sums)"""
        if own_partial is not None:  # received + own, as the epilogue
            return own_partial[lo:hi], [slot(rank, 1 - rank)[lo:hi], own_partial[lo:hi]]
        return own[lo:hi], [slot(rank, src)[lo:hi] for src in range(world)]

    own_blocks = [own_block(lo, hi) for lo, hi in blocks[:first_fused]]
    if ws.device.type == "cuda":
        for (lo, hi), (_, parts) in zip(blocks, own_blocks):
            _load_reduce_kernels(out[lo:hi], parts, reduce_op, None if acc is None else acc[lo:hi])
    lanes.fork()
    with lanes.copy():
        ws.barrier(channel=0)
    # One compute stream: a block that shares the SMs with the next one finishes later, and
    # every push (and so every peer's reduction) waits for it.
    for b, (lo, hi) in enumerate(blocks):
        for step in range(1, world):
            dst = (rank + step) % world
            produce(dst, lo, hi, partials[step - 1, lo:hi], None)
            ready = lanes.mark()
            with lanes.copy():
                lanes.wait(ready)
                slot(dst, rank)[lo:hi].copy_(partials[step - 1, lo:hi])
                ws.put_signal(dst, channel=_SIGNAL_BASE + b)

    def peers_landed(b: int) -> None:  # on the current stream: every peer's block b is in our slots
        for step in range(1, world):
            ws.wait_signal((rank - step) % world, channel=_SIGNAL_BASE + b)

    # without a GEMM epilogue, each own block's reduction goes under the next block's GEMM, and
    # only the reduction waits for the peers: the own GEMM runs while their pushes are in flight
    # (and absorbs the ranks' skew) instead of after them
    # (a GEMM that could accumulate, on more than 2 ranks or reducing otherwise, reduces inline)
    side_reduce = first_fused > 0 and (one_add or not fused_acc)
    for b, (lo, hi) in enumerate(blocks):
        if b >= first_fused:
            peers_landed(b)
            produce(rank, lo, hi, out[lo:hi], slot(rank, 1 - rank)[lo:hi])
            continue
        target, parts = own_blocks[b]
        produce(rank, lo, hi, target, None)
        block_acc = None if acc is None else acc[lo:hi]
        if not side_reduce:
            peers_landed(b)
            _reduce_into(out[lo:hi], parts, reduce_op, block_acc)
            continue
        produced = lanes.mark()
        with lanes.compute(1):
            lanes.wait(produced)
            peers_landed(b)
            _reduce_into(out[lo:hi], parts, reduce_op, block_acc)
    lanes.join()
    return out


class SymmTransport:
    """runtime.transport.Transport over a symmetric Workspace: the schedules above, with the
    plan's row blocks per chunk and lockstep."""

    def __init__(self, ws: Workspace, splits: int, lockstep: bool) -> None:
        self.ws, self.splits, self.lockstep = ws, splits, lockstep
        self.rank, self.world_size = ws.rank, ws.world_size

    def gather(self, shards: list[torch.Tensor], gathered: list[torch.Tensor | None],
               consume: Callable[[int, int, list[torch.Tensor]], None], *, alternate: bool, lockstep: bool,
               runs: Runs | None = None) -> None:
        gather_and_consume(self.ws, shards, gathered, consume, splits=self.splits, alternate=alternate,
                           lockstep=lockstep and self.lockstep, runs=runs)

    def reduce_scatter(self, produce: Callable[[int, int, int, torch.Tensor, torch.Tensor | None], None],
                       chunk_shape: tuple[int, int], dtype: torch.dtype, reduce_op: str, *,
                       fused_acc: bool) -> torch.Tensor:
        return produce_and_reduce_scatter(self.ws, produce, chunk_shape, dtype, reduce_op, splits=self.splits,
                                          fused_acc=fused_acc)


_loaded: set[tuple] = set()  # reductions whose kernels this process has launched (_load_reduce_kernels)


def _load_reduce_kernels(out: torch.Tensor, parts: list[torch.Tensor], reduce_op: str, acc: torch.Tensor | None) -> None:
    """Run _reduce_into once on small scratch tensors aligned as the real ones are, before any
    wait on a peer is enqueued. CUDA loads a kernel at its first launch (CUDA_MODULE_LOADING=LAZY,
    torch's default), and a load while a wait is stuck blocks the host, and with it the
    watchdog's abort (4xH200: the stuck-peer reduce-scatter hung in `acc.add_`, its first launch
    of a mixed-dtype add, until the test gave up). Elementwise kernels are picked by dtype and by
    the pointers' alignment (vector width), so that is what the scratch tensors copy."""
    real = [out, *parts] + ([] if acc is None else [acc])
    key = (out.device, reduce_op, *((t.dtype, t.data_ptr() % 16) for t in real))  # kernels load per device
    if key in _loaded:
        return

    def scratch(t: torch.Tensor) -> torch.Tensor:
        shift = t.data_ptr() % 16 // t.element_size()
        return torch.zeros(64 + shift, dtype=t.dtype, device=t.device)[shift:]

    _reduce_into(scratch(out), [scratch(p) for p in parts], reduce_op, None if acc is None else scratch(acc))
    _loaded.add(key)


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], reduce_op: str, acc: torch.Tensor | None) -> None:
    """out = sum (or mean) of parts, accumulated in fp32, rounded once. acc: an fp32 (fp64 for
    fp64 parts) tensor of out's shape; None for a sum of two parts (added straight into out). This
    runs after waits for peers: nothing is allocated here, and its kernels were launched before
    those waits (_load_reduce_kernels)."""
    world = len(parts)
    if acc is None:  # one addition of two parts
        torch.add(parts[0], parts[1], out=out)  # elementwise in fp32, one rounding
        return
    acc.copy_(parts[0])
    for part in parts[1:]:
        acc.add_(part)
    if reduce_op == "avg":
        acc.div_(world)
    out.copy_(acc)
