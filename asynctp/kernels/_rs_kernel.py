"""The Triton kernel behind producer_mm (imported on CUDA only: it needs Triton)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from asynctp.kernels._ag_kernel import (
    OperandError, _mainloop, _scale_mode, _spin, _split_unit, _tile, _tile_sum, b_descriptor, b_operand, tail_scratch,
)
from asynctp.kernels.configs import Config, split_parts
from asynctp.kernels.triton_util import FastLaunch


@triton.jit
def _own_epilogue(acc, recv_desc, out_desc, bias_ptr, rank, row_c, col, N, WORLD: tl.constexpr, AVG: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr):
    """An own tile's columns [col, col + BW): the peers' partials added in step order (fp32), then
    avg and bias, one rounding, stored."""
    for step in tl.static_range(1, WORLD):
        src = (rank - step + WORLD) % WORLD
        acc = acc + recv_desc.load([src, row_c, col]).reshape(BM, BW).to(tl.float32)
    if AVG:
        acc = acc / WORLD
    if HAS_BIAS:
        c = col + tl.arange(0, BW)
        acc = acc + tl.load(bias_ptr + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
    out_desc.store([row_c, col], acc.to(out_desc.dtype))


@triton.jit
def _rs_mm_kernel(
    a_desc, b_desc, recv_desc, out_desc, part_ptr, items_ptr,
    sig_ptr, cnt_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, split_ptr, split_cnt_ptr,
    N, K, m, br, rank, blocks, a_dst, a_blk, sig_src, sig_blk, num_items, num_dp,
    WORLD: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, B_TRANS: tl.constexpr, A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, AVG: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tm = br // BM
    tiles_per_item = tm * num_pid_n
    num_tiles = num_items * tiles_per_item
    units = num_dp + (num_tiles - num_dp) * SPLIT  # the last, partial wave's tiles in SPLIT K-parts
    for w in range(pid, units, NUM_SMS):
        t, part, k_lo, k_hi = _split_unit(w, num_dp, k_tiles, SPLIT)
        item, pm, pn = _tile(t, tiles_per_item, tm, num_pid_n, GROUP_M)
        kind = tl.load(items_ptr + 3 * item)
        dst = tl.load(items_ptr + 3 * item + 1)
        j = tl.load(items_ptr + 3 * item + 2)
        row_a = dst * a_dst + j * a_blk + pm * BM
        row_c = j * br + pm * BM  # within the chunk
        off_n = pn * BN
        acc = _mainloop(a_desc, b_desc, row_a, off_n, k_lo, k_hi, BM, BN, BK, B_TRANS)
        acc, finish = _tile_sum(acc, w, t, part, num_dp, split_ptr, split_cnt_ptr, SPLIT, BM, BN)
        if finish:
            cols = off_n + tl.arange(0, BN)
            if A_SCALE == 1:
                acc = acc * tl.load(a_scale_ptr)
            if A_SCALE == 2:
                acc = acc * tl.load(a_scale_ptr + row_a + tl.arange(0, BM))[:, None]
            if B_SCALE == 1:
                acc = acc * tl.load(b_scale_ptr)
            if B_SCALE == 2:
                acc = acc * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if kind == 0:
                slot = (dst - rank + WORLD) % WORLD - 1
                offs = (row_c + tl.arange(0, BM))[:, None] * N + cols[None, :]
                tl.store(part_ptr + slot * m * N + offs, acc.to(part_ptr.dtype.element_ty),
                         mask=(cols < N)[None, :])
                tl.debug_barrier()  # every thread's stores are done before the release below
                tl.atomic_add(cnt_ptr + dst * blocks + j, 1, sem="release", scope="sys")
            else:
                for step in tl.static_range(1, WORLD):
                    _spin(sig_ptr + ((rank - step + WORLD) % WORLD) * sig_src + j * sig_blk)
                # the epilogue in two column halves, stored by TMA: a whole 128x256 tile with its
                # partials and per-element pointers took 255 registers and 448 bytes of stack a thread
                h0, h1 = acc.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
                _own_epilogue(h0, recv_desc, out_desc, bias_ptr, rank, row_c, off_n, N, WORLD, AVG, HAS_BIAS, BM,
                              BN // 2)
                _own_epilogue(h1, recv_desc, out_desc, bias_ptr, rank, row_c, off_n + BN // 2, N, WORLD, AVG,
                              HAS_BIAS, BM, BN // 2)
                own = cnt_ptr + WORLD * blocks + j
                if tl.atomic_add(own, 1, sem="acq_rel", scope="gpu") == tiles_per_item - 1:
                    tl.atomic_xchg(own, 0, sem="relaxed", scope="gpu")
                    for step in tl.static_range(1, WORLD):
                        src = (rank - step + WORLD) % WORLD
                        tl.atomic_xchg(sig_ptr + src * sig_src + j * sig_blk, 0, sem="release", scope="sys")


@functools.cache
def _items(items_host: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(items_host, dtype=torch.int32, device=device)


def operands(a, b, out, blocks: int, cfg: Config) -> tuple:
    """(m, n, k, rows per block, b's descriptor arguments: tensor, shape, strides, block; whether
    b is nn.Linear's weight.t()) of a launch, for either kernel."""
    m, n = out.shape
    k = a.shape[1]
    br = m // blocks
    if br % cfg.block_m:
        raise OperandError(f"producer_mm requires blocks of a multiple of {cfg.block_m} rows, got {br}")
    b, b_trans = b_operand(b)
    return m, n, k, br, b_descriptor(b, b_trans, cfg), b_trans


def launch(a, b, partials, received, out, items, rank, world, blocks, a_strides, signals, sig_strides,
           counters, reduce_op, a_scale, b_scale, bias, cfg: Config, num_sms: int) -> int:
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m, n, k, br, b_args, b_trans = operands(a, b, out, blocks, cfg)
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(*b_args)
    bw = bn // 2  # the own tiles' epilogue works in two column halves
    recv_desc = TensorDescriptor(received, [world, m, n], [m * n, n, 1], [1, bm, bw])
    out_desc = TensorDescriptor(out, [m, n], [n, 1], [bm, bw])
    num_items = items.numel() // 3
    tiles = (br // bm) * triton.cdiv(n, bn)
    all_tiles = num_items * tiles
    split = split_parts(all_tiles, num_sms, triton.cdiv(k, bk)) if cfg.split else 1
    tail = all_tiles % num_sms if split > 1 else 0
    grid = (max(1, min(num_sms, all_tiles - tail + tail * split)),)
    dummy = out
    parts, tail_counters = tail_scratch(out.device, tail, split, bm, bn) if split > 1 else (dummy, dummy)
    _rs_launch(grid, (
        a_desc, b_desc, recv_desc, out_desc, partials, items, signals, counters,
        a_scale if a_scale is not None else dummy, b_scale if b_scale is not None else dummy,
        bias if bias is not None else dummy, parts, tail_counters,
        n, k, m, br, rank, blocks, a_strides[0], a_strides[1], sig_strides[0], sig_strides[1], num_items,
        all_tiles - tail,
        world, split, bm, bn, bk, cfg.group_m, grid[0], b_trans,  # WORLD, SPLIT, BM, BN, BK, GROUP_M, NUM_SMS, B_TRANS
        _scale_mode(a_scale), _scale_mode(b_scale), bias is not None,  # A_SCALE, B_SCALE, HAS_BIAS
        reduce_op == "avg",  # AVG
    ), num_warps=cfg.warps, num_stages=cfg.stages)
    return tiles


_rs_launch = FastLaunch(_rs_mm_kernel)
