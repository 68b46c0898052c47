"""A Gluon (Hopper) version of _rs_kernel's _rs_mm_kernel (imported on CUDA only: it needs Triton >= 3.6).

Same work items, partials, received, counters and flags as _rs_kernel; the difference is the
pipeline, written out by hand instead of left to Triton's pipeliner:
- TMA loads into STAGES ring buffers (one mbarrier each) and async wgmma with one in flight; the
  load counter runs on across tiles, so the next tile's first STAGES - 1 K-steps are in flight
  while this tile's epilogue runs;
- an own tile checks its peers' flags at its start and, where they are set (the usual case: own
  blocks run one block behind the peers'), requests its first received partial by TMA into the
  epilogue buffer there, waited for only in the epilogue; otherwise it spins and loads in the
  epilogue as _rs_kernel does. Further sources (WORLD > 2) are loaded in the epilogue;
- out and partials leave by TMA store from that one 128x256 buffer; a peer tile's counter is
  released once its store has completed, RELEASE_STEP K-steps into the program's next tile (at
  the end for its last tile), so that the wait for the store to land overlaps the next wgmmas;
- bf16 / fp16 operands (partials and out of their dtype), or fp8 e4m3 with b as weight.t() only
  (wgmma reads fp8 K-major) and the Triton kernel's scales in its order: acc * a_scale (numel 1,
  or per row) * b_scale (numel 1, or per column), then the received partials, avg and bias; no
  split-K tail (cfg.split is ignored).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from asynctp.kernels._ag_kernel import _scale_mode
from asynctp.kernels._rs_kernel import operands
from asynctp.kernels.configs import Config
from asynctp.kernels.triton_util import FastLaunch, memo_key

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
FP8 = torch.float8_e4m3fn
_DTYPES = {**_GL_DTYPES, FP8: gl.float8e4nv}


@gluon.jit
def _async_global_fence():
    """fence.proxy.async.global: orders this thread's generic-proxy accesses to global memory
    (an acquired flag, a completed TMA store) with its async-proxy (TMA) ones."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _store_done():
    """Wait until this thread's TMA stores have completed (their writes performed, not only their
    shared-memory source read, which is all tma.store_wait waits for)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _release(counter_ptr):
    """A peer tile's counter increment (release, system scope) once its TMA store has completed."""
    _store_done()
    _async_global_fence()
    gl.thread_barrier()  # the issuing thread's store is complete before the release below
    gl.atomic_add(counter_ptr, 1, sem="release", scope="sys")


@gluon.jit
def _now(x):
    """x, computed here: the compiler would otherwise defer a source's additions past the next
    source's load and hold both sources' values in registers (spills)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


# _spin and _tile restate _ag_kernel's (a Gluon function cannot call a @triton.jit one); _tile reverses every
# other sweep
@gluon.jit
def _spin(flag_ptr):
    """Wait until the flag is non-zero (acquire, system scope: a peer's stream write sets it)."""
    v = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while v == 0:
        v = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@gluon.jit
def _tile(t, tiles_per_group, tm, num_pid_n, GROUP_M: gl.constexpr):
    """(group, m-tile within the group, n-tile) of logical tile t: grouped order within a group,
    every other sweep of GROUP_M rows over the n-tiles backwards, so that it starts on the b tiles
    the sweep before ended on, still in L2 (_ag_kernel's _tile sweeps forwards only)."""
    g = t // tiles_per_group
    u = t - g * tiles_per_group
    in_group = GROUP_M * num_pid_n
    first_m = (u // in_group) * GROUP_M
    gsize = gl.minimum(tm - first_m, GROUP_M)
    pm = first_m + (u % in_group) % gsize
    pn = (u % in_group) // gsize
    sweep = g * gl.cdiv(tm, GROUP_M) + u // in_group  # the sweeps in the order the grid runs them
    pn = gl.where(sweep % 2 == 1, num_pid_n - 1 - pn, pn)
    return g, pm, pn


@gluon.jit
def _coords(t, items_ptr, tiles_per_item, tm, num_pid_n, br, a_dst, a_blk, BM: gl.constexpr, BN: gl.constexpr,
            GROUP_M: gl.constexpr):
    """Tile t's (kind, dst, block, first row of a, first row within the chunk, first column)."""
    item, pm, pn = _tile(t, tiles_per_item, tm, num_pid_n, GROUP_M)
    kind = gl.load(items_ptr + 3 * item)
    dst = gl.load(items_ptr + 3 * item + 1)
    j = gl.load(items_ptr + 3 * item + 2)
    return kind, dst, j, dst * a_dst + j * a_blk + pm * BM, j * br + pm * BM, pn * BN


@gluon.jit
def _load(a_desc, l_desc, b_desc, a_bufs, b_bufs, ready, slot, row, loc, off_n, k, pred, B_TRANS: gl.constexpr,
          LOCAL: gl.constexpr):
    """One K-step's a and b tiles into ring slot `slot` (its barrier counts their bytes); a's
    from l_desc (the all-gather's own rows) where LOCAL and `loc`."""
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    if LOCAL:
        if loc:
            tma.async_copy_global_to_shared(l_desc, [row, k], bar, a_bufs.index(slot), pred)
        else:
            tma.async_copy_global_to_shared(a_desc, [row, k], bar, a_bufs.index(slot), pred)
    else:
        tma.async_copy_global_to_shared(a_desc, [row, k], bar, a_bufs.index(slot), pred)
    if B_TRANS:
        tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_bufs.index(slot), pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(slot), pred)


@gluon.jit
def _buffers(a_desc, b_desc, c_desc, STAGES: gl.constexpr):
    """Shared memory of a Gluon GEMM: the load ring (STAGES tiles of a and b, one initialized
    mbarrier each) and the one epilogue buffer (a c_desc tile)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    return a_bufs, b_bufs, c_buf, ready


@gluon.jit
def _step(acc, use_acc, cons, ki, k_tiles, row, loc, off_n, nrow, nloc, noff_n, primed, a_desc, l_desc, b_desc,
          a_bufs, b_bufs, ready, BK: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr, LOCAL: gl.constexpr,
          g_desc=None, g_row=0, store=False, STORE: gl.constexpr = False):
    """K-step `ki` of the tile (the program's `cons`-th): wait for its tiles, issue its wgmma, retire
    the previous one, then refill the slot that one read with K-step ki + STAGES - 1, which is the
    next tile's once this tile's run out (issued only where `primed`: there is a next tile and its
    rows may be read now). STORE and `store`: the a tile also leaves the ring for rows g_row of
    g_desc (the all-gather's gathered rows), a TMA store whose read of the slot ends before the
    next K-step refills it (the tile's owner waits for its last one before the next tile)."""
    slot = cons % STAGES
    mbarrier.wait(ready.index(slot), (cons // STAGES) & 1)
    b = b_bufs.index(slot)
    if B_TRANS:
        b = b.permute((1, 0))
    acc = warpgroup_mma(a_bufs.index(slot), b, acc, use_acc=use_acc, is_async=True)
    if STORE:
        if store:
            tma.async_copy_shared_to_global(g_desc, [g_row, ki * BK], a_bufs.index(slot))
    acc = warpgroup_mma_wait(1, deps=(acc, ))
    if STORE:
        if store:
            tma.store_wait(1)  # the previous K-step's a tile has left the slot refilled below
    lk = ki + STAGES - 1
    nxt = lk >= k_tiles
    _load(a_desc, l_desc, b_desc, a_bufs, b_bufs, ready, (cons + STAGES - 1) % STAGES, gl.where(nxt, nrow, row),
          gl.where(nxt, nloc, loc), gl.where(nxt, noff_n, off_n), gl.where(nxt, lk - k_tiles, lk) * BK,
          (lk < k_tiles) | primed, B_TRANS, LOCAL)
    return acc


@gluon.jit
def _row_scale(acc, a_scale_ptr, row, BM: gl.constexpr, A_SCALE: gl.constexpr):
    """acc (rows [row, row + BM) of a tile) * a_scale (numel 1, or per row)."""
    if A_SCALE == 1:
        acc = acc * gl.load(a_scale_ptr)
    if A_SCALE == 2:
        rows = row + gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
        acc = acc * gl.load(a_scale_ptr + rows)[:, None]
    return acc


@gluon.jit
def _col_scale(h, b_scale_ptr, col, N, B_SCALE: gl.constexpr):
    """h (columns [col, col + width) of a tile) * b_scale (numel 1, or per column: loaded as
    _finish_half loads bias)."""
    if B_SCALE == 1:
        h = h * gl.load(b_scale_ptr)
    if B_SCALE == 2:
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        cols = col + gl.arange(0, h.shape[1], layout=flat)
        sb = gl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)
        h = h * gl.convert_layout(sb, gl.SliceLayout(0, h.type.layout))[None, :]
    return h


@gluon.jit
def _finish_half(h, buf, bias_ptr, col, N, WORLD: gl.constexpr, AVG: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Columns [col, col + width) of an own tile, every partial added: avg and bias, one rounding,
    into their half of the epilogue buffer."""
    if AVG:
        h = h / WORLD
    if HAS_BIAS:  # loaded one column a thread, then spread as the tile's columns lie (each thread holds 32)
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        cols = col + gl.arange(0, h.shape[1], layout=flat)
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        h = h + gl.convert_layout(bias, gl.SliceLayout(0, h.type.layout)).to(gl.float32)[None, :]
    buf.store(h.to(buf.dtype))


@gluon.jit
def _rs_mm_kernel(
    a_desc, b_desc, recv_desc, out_desc, part_desc, items_ptr, sig_ptr, cnt_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    N, K, m, br, rank, blocks, a_dst, a_blk, sig_src, sig_blk, num_items,
    WORLD: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_SMS: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr, A_SCALE: gl.constexpr,
    B_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, AVG: gl.constexpr, RELEASE_STEP: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    # wgmma accumulator: each warp 16 rows, m64n256 instructions per warpgroup (k16; fp8: k32)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 256 // dtype.primitive_bitwidth])

    a_bufs, b_bufs, c_buf, ready = _buffers(a_desc, b_desc, out_desc, STAGES)  # c_buf: received in, results out
    recv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(recv_bar, count=1)

    pid = gl.program_id(0)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)  # >= STAGES - 1 (launch picks STAGES so)
    tm = br // BM
    tiles_per_item = tm * num_pid_n
    num_tiles = num_items * tiles_per_item
    my_tiles = gl.cdiv(num_tiles - pid, NUM_SMS)  # the grid has at most num_tiles programs

    kind, dst, j, row_a, row_c, off_n = _coords(pid, items_ptr, tiles_per_item, tm, num_pid_n, br, a_dst, a_blk, BM,
                                                BN, GROUP_M)
    for s in gl.static_range(STAGES - 1):
        _load(a_desc, a_desc, b_desc, a_bufs, b_bufs, ready, s, row_a, False, off_n, s * BK, True, B_TRANS, False)

    cons = 0  # K-steps consumed by this program (ring slot and phase)
    recv_phase = 0
    pending = -1  # the counter a peer tile releases once its TMA store has completed
    recv_src = (rank - 1 + WORLD) % WORLD  # the source received asynchronously (step 1)
    for it in range(my_tiles):
        has_next = it + 1 < my_tiles
        t_next = pid + gl.where(has_next, it + 1, it) * NUM_SMS
        nkind, ndst, nj, nrow_a, nrow_c, noff_n = _coords(t_next, items_ptr, tiles_per_item, tm, num_pid_n, br, a_dst,
                                                          a_blk, BM, BN, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc = _step(acc, False, cons, 0, k_tiles, row_a, False, off_n, nrow_a, False, noff_n, has_next, a_desc,
                    a_desc, b_desc, a_bufs, b_bufs, ready, BK, STAGES, B_TRANS, False)
        cons += 1

        # under the first wgmma: the previous tile's store has read the buffer, and an own tile whose
        # peers' partials have landed requests the first of them into it
        tma.store_wait(0)
        early = kind == 1
        if early:
            for step in gl.static_range(1, WORLD):
                src = (rank - step + WORLD) % WORLD
                flag = gl.atomic_add(sig_ptr + src * sig_src + j * sig_blk, 0, sem="acquire", scope="sys")
                early = early & (flag != 0)
            if early:
                _async_global_fence()
                mbarrier.expect(recv_bar, recv_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(recv_desc, [recv_src * m + row_c, off_n], recv_bar, c_buf)

        k_rel = gl.minimum(k_tiles, RELEASE_STEP)
        for ki in range(1, k_rel):
            acc = _step(acc, True, cons, ki, k_tiles, row_a, False, off_n, nrow_a, False, noff_n, has_next, a_desc,
                    a_desc, b_desc, a_bufs, b_bufs, ready, BK, STAGES, B_TRANS, False)
            cons += 1
        if pending >= 0:  # a few K-steps on, the previous peer tile's store is surely complete: release it
            _release(cnt_ptr + pending)
            pending = -1
        for ki in range(k_rel, k_tiles):
            acc = _step(acc, True, cons, ki, k_tiles, row_a, False, off_n, nrow_a, False, noff_n, has_next, a_desc,
                    a_desc, b_desc, a_bufs, b_bufs, ready, BK, STAGES, B_TRANS, False)
            cons += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = _row_scale(acc, a_scale_ptr, row_a, BM, A_SCALE)  # the Triton kernel's order: a's, b's, the rest

        if kind == 0:
            slot = (dst - rank + WORLD) % WORLD - 1
            if B_SCALE != 0:  # in two column halves (fewer registers)
                h0, h1 = acc.reshape([BM, 2, BN // 2]).permute(0, 2, 1).split()
                c_buf.slice(0, BN // 2, dim=1).store(_col_scale(h0, b_scale_ptr, off_n, N, B_SCALE).to(c_buf.dtype))
                c_buf.slice(BN // 2, BN // 2, dim=1).store(
                    _col_scale(h1, b_scale_ptr, off_n + BN // 2, N, B_SCALE).to(c_buf.dtype))
            else:
                c_buf.store(acc.to(c_buf.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(part_desc, [slot * m + row_c, off_n], c_buf)
            pending = dst * blocks + j
        else:
            if not early:
                for step in gl.static_range(1, WORLD):
                    _spin(sig_ptr + ((rank - step + WORLD) % WORLD) * sig_src + j * sig_blk)
                _async_global_fence()
                mbarrier.expect(recv_bar, recv_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(recv_desc, [recv_src * m + row_c, off_n], recv_bar, c_buf)
            # in two column halves (a whole 128x256 tile with its partial and bias needs ~255 registers)
            h0, h1 = acc.reshape([BM, 2, BN // 2]).permute(0, 2, 1).split()
            if B_SCALE != 0:  # rounded before the additions, as the Triton kernel's (no fused multiply-add)
                h0 = _now(_col_scale(h0, b_scale_ptr, off_n, N, B_SCALE))
                h1 = _now(_col_scale(h1, b_scale_ptr, off_n + BN // 2, N, B_SCALE))
            lo = c_buf.slice(0, BN // 2, dim=1)
            hi = c_buf.slice(BN // 2, BN // 2, dim=1)
            for step in gl.static_range(1, WORLD):  # the peers' partials in step order
                if step > 1:  # a further source, loaded synchronously into the same buffer
                    gl.thread_barrier()  # every thread has read the buffer before TMA overwrites it
                    fence_async_shared()
                    mbarrier.expect(recv_bar, recv_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(recv_desc, [((rank - step + WORLD) % WORLD) * m + row_c, off_n],
                                                    recv_bar, c_buf)
                mbarrier.wait(recv_bar, recv_phase)
                recv_phase ^= 1
                if step < WORLD - 1:
                    h0 = _now(h0 + lo.load(h0.type.layout).to(gl.float32))
                    h1 = _now(h1 + hi.load(h1.type.layout).to(gl.float32))
                else:  # the last one: each half finished and stored in place of its received half
                    _finish_half(h0 + lo.load(h0.type.layout).to(gl.float32), lo, bias_ptr, off_n, N, WORLD, AVG,
                                 HAS_BIAS)
                    _finish_half(h1 + hi.load(h1.type.layout).to(gl.float32), hi, bias_ptr, off_n + BN // 2, N, WORLD,
                                 AVG, HAS_BIAS)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [row_c, off_n], c_buf)
            own = cnt_ptr + WORLD * blocks + j
            if gl.atomic_add(own, 1, sem="acq_rel", scope="gpu") == tiles_per_item - 1:
                gl.atomic_xchg(own, 0, sem="relaxed", scope="gpu")
                for step in gl.static_range(1, WORLD):
                    src = (rank - step + WORLD) % WORLD
                    gl.atomic_xchg(sig_ptr + src * sig_src + j * sig_blk, 0, sem="release", scope="sys")
        kind, dst, j, row_a, row_c, off_n = nkind, ndst, nj, nrow_a, nrow_c, noff_n

    if pending >= 0:
        _release(cnt_ptr + pending)
    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    mbarrier.invalidate(recv_bar)


@functools.cache
def _layout(shape: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(shape), _DTYPES[dtype])


def _desc(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]) -> TensorDescriptor:
    return TensorDescriptor(t, shape, strides, block, _layout(tuple(block), t.dtype))


def launch(a, b, partials, received, out, items, rank, world, blocks, a_strides, signals, sig_strides,
           counters, reduce_op, a_scale, b_scale, bias, cfg: Config, num_sms: int) -> int:
    memo = memo_key(a, b, partials, received, out, items, rank, world, blocks, a_strides, signals, sig_strides,
                    counters, reduce_op, a_scale, b_scale, bias, cfg, num_sms)
    tiles = (out.shape[0] // blocks // cfg.block_m) * triton.cdiv(out.shape[1], cfg.block_n)  # per block
    if _launch.again(memo):  # the same arguments as a launch before
        return tiles
    fp8 = a.dtype == FP8
    m, n, k, br, b_args, b_trans = operands(a, b, out, blocks, cfg)
    if (a.dtype not in _DTYPES or b.dtype != a.dtype or out.dtype not in _GL_DTYPES or partials.dtype != out.dtype
            or (out.dtype != a.dtype and not fp8) or (fp8 and not b_trans)
            or (not fp8 and (a_scale is not None or b_scale is not None))):
        raise ValueError(f"the Gluon producer_mm kernel takes bf16 or fp16 operands and out of one dtype without "
                         f"scales, or fp8 e4m3 ones (b as weight.t()) and bf16 or fp16 out, got {a.dtype}, {b.dtype} "
                         f"({'weight.t()' if b_trans else '[K, N]'}) and {out.dtype}")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    a_desc = _desc(a, list(a.shape), [a.stride(0), 1], [bm, bk])
    b_desc = _desc(*b_args)
    recv_desc = _desc(received, [world * m, n], [n, 1], [bm, bn])  # source s's rows from s * m
    part_desc = _desc(partials, [(world - 1) * m, n], [n, 1], [bm, bn])  # slot's rows from slot * m
    out_desc = _desc(out, [m, n], [n, 1], [bm, bn])
    num_items = items.numel() // 3
    grid = (max(1, min(num_sms, num_items * tiles)), )
    stages = max(2, min(cfg.stages, triton.cdiv(k, bk) + 1))  # the prologue loads STAGES - 1 K-steps of one tile
    dummy = out
    _launch(grid, (
        a_desc, b_desc, recv_desc, out_desc, part_desc, items, signals, counters,
        a_scale if a_scale is not None else dummy, b_scale if b_scale is not None else dummy,
        bias if bias is not None else dummy,
        n, k, m, br, rank, blocks, a_strides[0], a_strides[1], sig_strides[0], sig_strides[1], num_items,
        world, bm, bn, bk, cfg.group_m, grid[0], stages, b_trans,  # WORLD, BM, BN, BK, GROUP_M, NUM_SMS, STAGES,
        _scale_mode(a_scale), _scale_mode(b_scale), bias is not None, reduce_op == "avg", 4,
    ), memo, num_warps=cfg.warps)  # B_TRANS, A_SCALE, B_SCALE, HAS_BIAS, AVG, RELEASE_STEP
    return tiles


_launch = FastLaunch(_rs_mm_kernel)
