"""A Gluon (Hopper) version of _ag_kernel's _ag_mm_kernel (imported on CUDA only: it needs Triton >= 3.6).

Same tiles, chunk map, waits, resets and sums as _ag_kernel's kernel with split=False (bit-equal
outputs); the differences are the tile order (every other sweep over the n-tiles backwards:
_rs_gluon._tile) and the pipeline, written out by hand as in _rs_gluon:
- TMA loads into STAGES ring buffers (one mbarrier each) and async wgmma with one in flight; the
  load counter runs on across tiles, so the next tile's first STAGES - 1 K-steps are in flight
  while this tile's last K-steps and epilogue run -- where the next tile needs no wait (its
  chunk already awaited by this program, the local source's, no waits at all) or its flag is
  found set by a non-blocking acquire read just before those loads would be issued. Otherwise
  the next tile spins on its flag at its start (after this tile's store is issued) and loads then;
- the local source's rows (LOCAL) come from a second host descriptor over a_local, chosen per
  load (the compiler makes the branch a select of the descriptor address: one TMA issue);
- out leaves by TMA store from one 128x256 shared buffer (column scales and bias applied in two
  column halves), or, where the ring leaves room for half a tile only (HALF_C: 4 stages of
  128x256 tiles), from a 128x128 one, the halves stored in turn;
- the tail (with HALF_C): where the last wave is short (launch: 2 x its tiles fit the
  grid), its tiles run in column halves, each half on its own program (n128 wgmma), so that the
  wave takes about half a tile's time instead of a whole one's while the other SMs idle (448
  tiles of 128x256 make 3.39 waves on 132 SMs); the halves add the same products in the same
  order (bit-equal);
- STORE_A (the fused all-gather keeps the gathered rows): each row block's tile of the first
  columns also stores every a tile it loads into the gathered rows (TMA, from the ring slot), so
  the gathered rows cost their writes only, not a copy of the workspace beside the GEMM;
- bf16 / fp16 operands (out of their dtype), or fp8 e4m3 with b as weight.t() only (wgmma reads
  fp8 K-major) and the Triton kernel's scales in its order: acc * a_scale (numel 1, or per row,
  the local source's rows' from a_local_scale) * b_scale (numel 1, or per column) + bias, one
  rounding; chunks of whole tiles, no split-K tail (cfg.split is ignored).
Counters count half tiles (a whole tile adds 2), so a chunk's last tile or half resets it.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from asynctp.kernels._ag_kernel import _scale_mode, operands
from asynctp.kernels._rs_gluon import (
    _DTYPES, _GL_DTYPES, FP8, _async_global_fence, _buffers, _col_scale, _finish_half, _load, _row_scale, _spin,
    _step, _tile,
)
from asynctp.kernels.configs import Config, gluon_fits
from asynctp.kernels.triton_util import FastLaunch, memo_key


@functools.cache
def _layout(shape: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(shape), _DTYPES[dtype])


def _desc(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]) -> TensorDescriptor:
    return TensorDescriptor(t, shape, strides, block, _layout(tuple(block), t.dtype))


@gluon.jit
def _coords(t, tiles_per_group, tm, num_pid_n, pivot, num_chunks, blocks, chunk_rows, rows_per_src, local_src,
            out_src, out_blk, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, LOCAL: gl.constexpr):
    """Tile t's (chunk, source, block, whether its rows come from a_local, first row it loads
    (of a_local's rows or the workspace's), first row of out, first column)."""
    g, pm, pn = _tile(t, tiles_per_group, tm, num_pid_n, GROUP_M)
    c = (pivot + g) % num_chunks
    src = c // blocks
    blk = c - src * blocks
    loc = (src == local_src) & LOCAL
    row_ld = gl.where(loc, 0, src * rows_per_src) + blk * chunk_rows + pm * BM
    return c, src, blk, loc, row_ld, src * out_src + blk * out_blk + pm * BM, pn * BN


@gluon.jit
def _ready(want, c, src, blk, waited, local_src, sig_ptr, sig_src, sig_blk, WAIT: gl.constexpr):
    """Whether a (wanted) next tile of chunk c = (src, blk) may be loaded now without a wait: its
    chunk awaited by this program already, the local source's, or its flag found set by one
    acquire read (then fenced against the TMA loads of its rows that follow)."""
    ok = want
    if WAIT:
        if want & (c != waited) & (src != local_src):
            ok = gl.atomic_add(sig_ptr + src * sig_src + blk * sig_blk, 0, sem="acquire", scope="sys") != 0
            _async_global_fence()
    return ok


@gluon.jit
def _begin(c, src, blk, waited, local_src, sig_ptr, sig_src, sig_blk, a_desc, l_desc, b_desc, a_bufs, b_bufs, ready,
           cons, row, loc, off_n, BK: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr, B_TRANS: gl.constexpr,
           LOCAL: gl.constexpr):
    """The start of a tile whose loads were not issued early: its chunk awaited (unless this program
    awaited it already, or it is the local source's), then its first STAGES - 1 K-steps requested."""
    if WAIT:
        if (c != waited) & (src != local_src):
            _spin(sig_ptr + src * sig_src + blk * sig_blk)
    _async_global_fence()
    for s in gl.static_range(STAGES - 1):
        _load(a_desc, l_desc, b_desc, a_bufs, b_bufs, ready, (cons + s) % STAGES, row, loc, off_n, s * BK, True,
              B_TRANS, LOCAL)


@gluon.jit
def _a_scales(loc, a_scale_ptr, l_scale_ptr, A_SCALE: gl.constexpr):
    """a's scales of a tile: rowwise ones of the local source's rows from a_local_scale (indexed
    by `row` as a_local's rows are), every other from a_scale."""
    return gl.where(loc & (A_SCALE == 2), l_scale_ptr, a_scale_ptr)


@gluon.jit
def _half(h, buf, b_scale_ptr, bias_ptr, col, N, B_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Columns [col, col + width) of a tile (a's scales applied): * b_scale, + bias, one rounding,
    into their half of the epilogue buffer."""
    _finish_half(_col_scale(h, b_scale_ptr, col, N, B_SCALE), buf, bias_ptr, col, N, 1, False, HAS_BIAS)


@gluon.jit
def _reset(cnt_ptr, sig_ptr, c, src, local_src, sig_src, sig_blk, blk, halves, tiles_per_group, RESET: gl.constexpr):
    """A tile's (halves 2) or half's (1) count toward its chunk; the chunk's last resets its
    counter and flag for the next call."""
    if RESET:
        if src != local_src:
            old = gl.atomic_add(cnt_ptr + c, halves, sem="acq_rel", scope="gpu")
            if old + halves == 2 * tiles_per_group:
                gl.atomic_xchg(cnt_ptr + c, 0, sem="relaxed", scope="gpu")
                gl.atomic_xchg(sig_ptr + src * sig_src + blk * sig_blk, 0, sem="release", scope="sys")


@gluon.jit(do_not_specialize=["pivot", "sig_src", "sig_blk"])  # vary per call: one compile
def _ag_mm_kernel(
    a_desc, l_desc, b_desc, c_desc, g_desc, bh_desc, sig_ptr, cnt_ptr, a_scale_ptr, l_scale_ptr, b_scale_ptr,
    bias_ptr, N, K, chunk_rows, rows_per_src, num_chunks, blocks, pivot, local_src, sig_src, sig_blk, out_src,
    out_blk, full_tiles,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr,
    STAGES: gl.constexpr, WAIT: gl.constexpr, RESET: gl.constexpr, LOCAL: gl.constexpr, B_TRANS: gl.constexpr,
    A_SCALE: gl.constexpr, B_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, STORE_A: gl.constexpr,
    HALF_C: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    # wgmma accumulator: each warp 16 rows, m64n256 instructions per warpgroup (k16; fp8: k32)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 256 // dtype.primitive_bitwidth])

    a_bufs, b_bufs, c_buf, ready = _buffers(a_desc, b_desc, c_desc, STAGES)

    pid = gl.program_id(0)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)  # >= STAGES - 1 (launch picks STAGES so)
    k_pre = gl.maximum(k_tiles - (STAGES - 1), 0)  # K-steps before the first that loads the next tile
    tm = chunk_rows // BM
    tiles_per_group = tm * num_pid_n
    num_tiles = num_chunks * tiles_per_group
    # whole tiles [0, full_tiles) (a multiple of the grid where a tail follows), then the tail's halves
    my_tiles = gl.maximum(gl.cdiv(full_tiles - pid, NUM_SMS), 0)

    c, src, blk, loc, row, row_out, off_n = _coords(pid, tiles_per_group, tm, num_pid_n, pivot, num_chunks, blocks,
                                                    chunk_rows, rows_per_src, local_src, out_src, out_blk, BM, BN,
                                                    GROUP_M, LOCAL)
    cons = 0  # K-steps consumed by this program (ring slot and phase)
    waited = -1  # the chunk whose flag this program awaited last
    primed = pid < 0  # whether this tile's first STAGES - 1 K-steps are loading already
    for it in range(my_tiles):
        if not primed:
            _begin(c, src, blk, waited, local_src, sig_ptr, sig_src, sig_blk, a_desc, l_desc, b_desc, a_bufs, b_bufs,
                   ready, cons, row, loc, off_n, BK, STAGES, WAIT, B_TRANS, LOCAL)
        waited = c
        has_next = it + 1 < my_tiles
        t_next = pid + gl.where(has_next, it + 1, it) * NUM_SMS
        nc, nsrc, nblk, nloc, nrow, nrow_out, noff_n = _coords(t_next, tiles_per_group, tm, num_pid_n, pivot,
                                                               num_chunks, blocks, chunk_rows, rows_per_src, local_src,
                                                               out_src, out_blk, BM, BN, GROUP_M, LOCAL)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        st = STORE_A & (off_n == 0)  # the row block's tile of the first columns stores its a tiles
        # step 0 loads this tile's K-step STAGES - 1; a K-loop shorter than that loads no next tile's rows
        acc = _step(acc, False, cons, 0, k_tiles, row, loc, off_n, nrow, nloc, noff_n, False, a_desc, l_desc,
                    b_desc, a_bufs, b_bufs, ready, BK, STAGES, B_TRANS, LOCAL, g_desc, row_out, st, STORE_A)
        cons += 1
        tma.store_wait(0)  # under the first wgmma: the previous tile's store has read c_buf
        for ki in range(1, k_pre):
            acc = _step(acc, True, cons, ki, k_tiles, row, loc, off_n, nrow, nloc, noff_n, False, a_desc, l_desc,
                        b_desc, a_bufs, b_bufs, ready, BK, STAGES, B_TRANS, LOCAL, g_desc, row_out, st, STORE_A)
            cons += 1
        # as late as can be: the next tile's flag, read once before the steps that would load its rows
        primed = _ready(has_next & (k_pre > 0), nc, nsrc, nblk, waited, local_src, sig_ptr, sig_src, sig_blk, WAIT)
        for ki in range(gl.maximum(k_pre, 1), k_tiles):
            acc = _step(acc, True, cons, ki, k_tiles, row, loc, off_n, nrow, nloc, noff_n, primed, a_desc, l_desc,
                        b_desc, a_bufs, b_bufs, ready, BK, STAGES, B_TRANS, LOCAL, g_desc, row_out, st, STORE_A)
            cons += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if STORE_A:
            if st:  # the last a tile has left its slot, which the next tile's first step refills
                tma.store_wait(0)

        # the Triton kernel's epilogue, in its order: * a_scale, * b_scale, + bias
        acc = _row_scale(acc, _a_scales(loc, a_scale_ptr, l_scale_ptr, A_SCALE), row, BM, A_SCALE)
        if HALF_C:  # the buffer holds half a tile (a deeper ring fits): each half stored in turn
            h0, h1 = acc.reshape([BM, 2, BN // 2]).permute(0, 2, 1).split()
            _half(h0, c_buf, b_scale_ptr, bias_ptr, off_n, N, B_SCALE, HAS_BIAS)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row_out, off_n], c_buf)
            tma.store_wait(0)
            _half(h1, c_buf, b_scale_ptr, bias_ptr, off_n + BN // 2, N, B_SCALE, HAS_BIAS)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row_out, off_n + BN // 2], c_buf)
        else:
            if HAS_BIAS or B_SCALE != 0:  # in two column halves, as _rs_gluon's own tiles (fewer registers)
                h0, h1 = acc.reshape([BM, 2, BN // 2]).permute(0, 2, 1).split()
                _half(h0, c_buf.slice(0, BN // 2, dim=1), b_scale_ptr, bias_ptr, off_n, N, B_SCALE, HAS_BIAS)
                _half(h1, c_buf.slice(BN // 2, BN // 2, dim=1), b_scale_ptr, bias_ptr, off_n + BN // 2, N, B_SCALE,
                      HAS_BIAS)
            else:
                c_buf.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row_out, off_n], c_buf)
        _reset(cnt_ptr, sig_ptr, c, src, local_src, sig_src, sig_blk, blk, 2, tiles_per_group, RESET)
        c, src, blk, loc, row, row_out, off_n = nc, nsrc, nblk, nloc, nrow, nrow_out, noff_n

    if HALF_C:  # the tail: at most one half tile per program, loaded from its own start (no next tile to prime)
        if pid < 2 * (num_tiles - full_tiles):
            h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                               instr_shape=[16, BN // 2,
                                                                            256 // dtype.primitive_bitwidth])
            # the ring is idle here (no tile primed): its b slots taken as STAGES half-width ones
            bh_bufs = b_bufs._reinterpret(dtype, [STAGES] + bh_desc.block_type.shape, bh_desc.layout)
            c, src, blk, loc, row, row_out, off_n = _coords(full_tiles + pid // 2, tiles_per_group, tm, num_pid_n,
                                                            pivot, num_chunks, blocks, chunk_rows, rows_per_src,
                                                            local_src, out_src, out_blk, BM, BN, GROUP_M, LOCAL)
            off_n += (pid % 2) * (BN // 2)
            _begin(c, src, blk, waited, local_src, sig_ptr, sig_src, sig_blk, a_desc, l_desc, bh_desc, a_bufs,
                   bh_bufs, ready, cons, row, loc, off_n, BK, STAGES, WAIT, B_TRANS, LOCAL)
            hst = STORE_A & (off_n == 0)
            hacc = gl.zeros([BM, BN // 2], gl.float32, h_layout)
            hacc = _step(hacc, False, cons, 0, k_tiles, row, loc, off_n, row, loc, off_n, False, a_desc, l_desc,
                         bh_desc, a_bufs, bh_bufs, ready, BK, STAGES, B_TRANS, LOCAL, g_desc, row_out, hst, STORE_A)
            cons += 1
            tma.store_wait(0)  # the previous tile's store has read c_buf
            for ki in range(1, k_tiles):
                hacc = _step(hacc, True, cons, ki, k_tiles, row, loc, off_n, row, loc, off_n, False, a_desc, l_desc,
                             bh_desc, a_bufs, bh_bufs, ready, BK, STAGES, B_TRANS, LOCAL, g_desc, row_out, hst,
                             STORE_A)
                cons += 1
            hacc = warpgroup_mma_wait(0, deps=(hacc, ))
            hacc = _row_scale(hacc, _a_scales(loc, a_scale_ptr, l_scale_ptr, A_SCALE), row, BM, A_SCALE)
            _half(hacc, c_buf, b_scale_ptr, bias_ptr, off_n, N, B_SCALE, HAS_BIAS)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row_out, off_n], c_buf)
            _reset(cnt_ptr, sig_ptr, c, src, local_src, sig_src, sig_blk, blk, 1, tiles_per_group, RESET)

    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


def launch(a, b, b_trans, out, signals, n, sig_src, sig_blk, chunk_rows, pivot, cmap, counters, a_scale, b_scale,
           bias, cfg: Config, num_sms: int, a_local=None, a_local_scale=None, a_gathered=None) -> None:
    """_ag_kernel.launch's arguments and meaning (a_local_scale defaults as there). a_gathered: the
    gathered rows [R * m, K] in out's row order, stored by the tiles of the first columns from the
    a tiles they load (the rows are read once, by the GEMM; no copy of the workspace). A launch
    of the same arguments as one before is repeated from FastLaunch's memo."""
    memo = memo_key(a, b, b_trans, out, signals, n, sig_src, sig_blk, chunk_rows, pivot, cmap, counters, a_scale,
                    b_scale, bias, cfg, num_sms, a_local, a_local_scale, a_gathered)
    if _launch.again(memo):
        return
    fp8 = a.dtype == FP8
    if (a.dtype not in _DTYPES or b.dtype != a.dtype or out.dtype not in _GL_DTYPES
            or (out.dtype != a.dtype and not fp8) or (fp8 and not b_trans)):
        raise ValueError(f"the Gluon async_input_mm kernel takes bf16 or fp16 operands and out of one dtype, or fp8 "
                         f"e4m3 ones (b as weight.t()) and bf16 or fp16 out, got {a.dtype}, {b.dtype} "
                         f"({'weight.t()' if b_trans else '[K, N]'}) and {out.dtype}")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_total, nn_, k, rows_per_src, out_src, out_blk, b_args = operands(a, b, b_trans, out, n, chunk_rows, cmap,
                                                                       a_local, cfg)
    if chunk_rows % bm:
        raise ValueError(f"the Gluon async_input_mm kernel requires chunks of a multiple of {bm} rows, got {chunk_rows}")
    a_mode, b_mode = _scale_mode(a_scale), _scale_mode(b_scale)
    if a_local is not None and a_local_scale is None and a_mode == 2:  # the local rows' scales within a_scale
        a_local_scale = a_scale.reshape(-1)[cmap.local_src * rows_per_src:]
    a_desc = _desc(a, list(a.shape), [a.stride(0), 1], [bm, bk])
    l_desc = a_desc if a_local is None else _desc(a_local, [rows_per_src, k], [a_local.stride(0), 1], [bm, bk])
    half_c = not gluon_fits(cfg, a.element_size(), out.element_size())  # a deeper ring: half a tile staged
    c_desc = _desc(out, [m_total, nn_], [out.stride(0), 1], [bm, bn // 2 if half_c else bn])
    g_desc = a_desc if a_gathered is None else _desc(a_gathered, list(a_gathered.shape), [a_gathered.stride(0), 1],
                                                     [bm, bk])
    tiles = (m_total // bm) * triton.cdiv(nn_, bn)
    # a short last wave in column halves (with half an output tile staged), 2 x its tiles within the grid
    tail = tiles % num_sms if half_c and 2 * (tiles % num_sms) <= num_sms else 0
    grid = (max(1, min(num_sms, tiles - tail + 2 * tail)), )
    stages = max(2, min(cfg.stages, triton.cdiv(k, bk) + 1))  # the prologue loads STAGES - 1 K-steps of one tile
    b_desc = _desc(*b_args)
    bh_desc = _desc(*b_args[:3], [bn // 2, bk] if b_trans else [bk, bn // 2]) if half_c else b_desc
    dummy = out
    _launch(grid, (
        a_desc, l_desc, b_desc, c_desc, g_desc, bh_desc, signals if signals is not None else dummy,
        counters if counters is not None else dummy, a_scale if a_scale is not None else dummy,
        a_local_scale if a_local_scale is not None else (a_scale if a_scale is not None else dummy),
        b_scale if b_scale is not None else dummy, bias if bias is not None else dummy,
        nn_, k, chunk_rows, rows_per_src, n, cmap.blocks, pivot, cmap.local_src, sig_src, sig_blk, out_src, out_blk,
        tiles - tail, bm, bn, bk, cfg.group_m, grid[0], stages,  # full_tiles, BM, BN, BK, GROUP_M, NUM_SMS, STAGES
        signals is not None, counters is not None, a_local is not None, b_trans, a_mode, b_mode, bias is not None,
        a_gathered is not None, half_c,
    ), memo, num_warps=cfg.warps)  # WAIT, RESET, LOCAL, B_TRANS, A_SCALE, B_SCALE, HAS_BIAS, STORE_A, HALF_C


_launch = FastLaunch(_ag_mm_kernel)
