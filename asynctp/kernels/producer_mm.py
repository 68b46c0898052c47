"""producer_mm: one persistent GEMM that makes a reduce-scatter's partial chunks in the order
they must leave, counts each block's finished tiles, and reduces its own chunk in the epilogue.

Shape legend (R = ranks, S = blocks per chunk, rank r; chunk d = the rows rank d owns):
    a          [M, K]        M = R * m, chunk d's block j = rows d * a_dst + j * a_blk (+ br rows)
    b          [K, N]
    partials   [R - 1, m, N] this rank's partials for its peers (slot (d - r) % R - 1), local
    received   [R, m, N]     this rank's receive buffer (slot s: what rank s pushed), symmetric
    out        [m, N]        this rank's reduced chunk: own partial + every received one, fp32,
                             one rounding (bias and avg in the same epilogue)

Work items, in order (`schedule`): the peers' blocks (r + 1, r + 2, ... for block 0, then 1, ...),
and each own block one block behind, so that the peers' pushes of that block have a block's
compute time to land. A peer item's tile is stored, and once its stores are complete a release
increment of the block's counter at system scope follows (the Gluon kernel stores by TMA and
releases a few K-steps into its next tile): when the counter reaches the item's tile count, a
copy stream that waits on it (a stream memory operation) may push the block to its owner with a
copy engine and signal it. An own tile waits for every peer's flag of its block before its
epilogue (the Gluon kernel reads them at the tile's start and, where set, requests the received
partial then); the last own tile of a block resets those flags. Every wait of an own block
depends only on peers' earlier items, which wait for nothing (a pending release is made before
any wait), so the GEMM may hold every SM.

On CPU tensors `producer_mm` runs a plain-torch reference in the same order.
"""

from __future__ import annotations

import torch

from asynctp.kernels.async_input_mm import programs
from asynctp.kernels.configs import Config, gluon_takes, pick_config, whole_tile

__all__ = ["schedule", "producer_mm_reference", "launch_producer"]

PEER, OWN = 0, 1


def schedule(rank: int, world_size: int, blocks: int) -> list[tuple[int, int, int]]:
    """(kind, dst, block) work items of rank `rank`: peers' blocks first, own blocks one behind."""
    items = []
    for j in range(blocks):
        items += [(PEER, (rank + step) % world_size, j) for step in range(1, world_size)]
        if j >= 1:
            items.append((OWN, rank, j - 1))
    items.append((OWN, rank, blocks - 1))
    return items


def producer_mm_reference(
    a: torch.Tensor, b: torch.Tensor, rank: int, world_size: int, blocks: int,
    received: list[torch.Tensor | None], reduce_op: str = "sum",
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The CPU path, in the kernel's item order: (partials for each peer in step order, the own
    chunk reduced with `received`, the peers' partials for this rank, each [m, N])."""
    m = a.shape[0] // world_size
    br = m // blocks
    acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    partials = [a.new_empty((m, b.shape[1])) for _ in range(world_size - 1)]
    out = a.new_empty((m, b.shape[1]))
    for kind, dst, j in schedule(rank, world_size, blocks):
        rows = slice(dst * m + j * br, dst * m + (j + 1) * br)
        prod = a[rows] @ b
        if kind == PEER:
            partials[(dst - rank) % world_size - 1][j * br : (j + 1) * br] = prod
            continue
        acc = prod.to(acc_dtype)
        for step in range(1, world_size):
            acc += received[(rank - step) % world_size][j * br : (j + 1) * br].to(acc_dtype)
        if reduce_op == "avg":
            acc /= world_size
        out[j * br : (j + 1) * br] = acc.to(out.dtype)
    return partials, out


_gluon_failed: str | None = None  # why the Gluon kernel cannot run in this process (None: it may)


def _gluon_serves(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scaled: bool, cfg: Config) -> bool:
    """The Gluon kernel takes the operands (configs.gluon_takes) where it has not failed to build."""
    return gluon_takes(a, b, out, scaled, cfg) and _gluon_failed is None


def launch_producer(
    a: torch.Tensor, b: torch.Tensor, partials: torch.Tensor, received: torch.Tensor, out: torch.Tensor,
    rank: int, world_size: int, blocks: int, a_strides: tuple[int, int],
    signals: torch.Tensor | object, sig_strides: tuple[int, int], counters: torch.Tensor, *,
    reduce_op: str = "sum", a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, config: Config | None = None, gluon: bool | None = None,
) -> tuple[int, Config]:
    """Launch the GEMM on CUDA. counters: int32, zeroed, R * blocks + blocks of them (peer
    blocks by dst * blocks + j, then own blocks); returns (tiles per block, config): a peer
    block is complete when its counter reaches that many.

    Two kernels compute the same values in the same order: a Gluon one (kernels/_rs_gluon.py: its
    own tiles' received partials requested at the tile's start, the next tile's loads issued
    before the epilogue) for 16-bit operands and fp8 ones with b as weight.t(), and the Triton one
    (kernels/_rs_kernel.py) for fp8 with b [K, N] and other tile shapes, or where Gluon fails to
    build (a warning says so, once). gluon=False picks the Triton kernel (tests)."""
    global _gluon_failed
    from asynctp.kernels import _rs_kernel as kern

    m, n = out.shape
    k = a.shape[1]
    # both kernels stage a whole output tile (it receives the peers' partial): a deeper ring of the
    # all-gather's table runs with fewer stages
    cfg = whole_tile(config or pick_config(a.dtype, m * world_size, n, k, m // blocks, scatter=True), a.element_size(),
                     out.element_size())
    items = kern._items(tuple(x for item in schedule(rank, world_size, blocks) for x in item), a.device)
    args = (a, b, partials, received, out, items, rank, world_size, blocks, a_strides, signals, sig_strides, counters,
            reduce_op, a_scale, b_scale, bias, cfg, programs(a.device))
    if gluon is not False and _gluon_serves(a, b, out, a_scale is not None or b_scale is not None, cfg):
        from asynctp.kernels import _rs_gluon
        from asynctp.kernels._ag_kernel import try_gluon

        ran, tiles, _gluon_failed = try_gluon(lambda: _rs_gluon.launch(*args), bool(gluon), "the reduce-scatter")
        if ran:
            return tiles, cfg
    return kern.launch(*args), cfg
