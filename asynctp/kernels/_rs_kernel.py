"""The Triton kernel behind producer_mm (imported on CUDA only: it needs Triton)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from asynctp.kernels._ag_kernel import _mainloop, _scale_mode, _spin, _tile
from asynctp.kernels.configs import Config
from asynctp.kernels.triton_util import FastLaunch


@triton.jit
def _rs_mm_kernel(
    a_desc, b_desc, recv_desc, part_ptr, out_ptr, items_ptr,
    sig_ptr, cnt_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    N, K, m, br, rank, world, blocks, a_dst, a_blk, sig_src, sig_blk, num_items,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    B_TRANS: tl.constexpr, A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    AVG: tl.constexpr, FLATTEN: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tm = br // BM
    tiles_per_item = tm * num_pid_n
    num_tiles = num_items * tiles_per_item
    for t in tl.range(pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        item, pm, pn = _tile(t, tiles_per_item, tm, num_pid_n, GROUP_M)
        kind = tl.load(items_ptr + 3 * item)
        dst = tl.load(items_ptr + 3 * item + 1)
        j = tl.load(items_ptr + 3 * item + 2)
        row_a = dst * a_dst + j * a_blk + pm * BM
        row_c = j * br + pm * BM  # within the chunk
        off_n = pn * BN
        acc = _mainloop(a_desc, b_desc, row_a, off_n, 0, k_tiles, BM, BN, BK, B_TRANS)
        rows = tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        if A_SCALE == 1:
            acc = acc * tl.load(a_scale_ptr)
        if A_SCALE == 2:
            acc = acc * tl.load(a_scale_ptr + row_a + rows)[:, None]
        if B_SCALE == 1:
            acc = acc * tl.load(b_scale_ptr)
        if B_SCALE == 2:
            acc = acc * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        offs = (row_c + rows)[:, None] * N + cols[None, :]
        mask = (cols < N)[None, :]
        if kind == 0:
            slot = (dst - rank + world) % world - 1
            tl.store(part_ptr + slot * m * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.debug_barrier()  # every thread's stores are done before the release below
            tl.atomic_add(cnt_ptr + dst * blocks + j, 1, sem="release", scope="sys")
        else:
            for step in range(1, world):
                src = (rank - step + world) % world
                _spin(sig_ptr + src * sig_src + j * sig_blk)
                part = recv_desc.load([src, row_c, off_n]).reshape(BM, BN)
                acc = acc + part.to(tl.float32)
            if AVG:
                acc = acc / world
            if HAS_BIAS:
                acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            own = cnt_ptr + world * blocks + j
            old = tl.atomic_add(own, 1, sem="acq_rel", scope="gpu")
            if old == tiles_per_item - 1:
                tl.atomic_xchg(own, 0, sem="relaxed", scope="gpu")
                for step in range(1, world):
                    src = (rank - step + world) % world
                    tl.atomic_xchg(sig_ptr + src * sig_src + j * sig_blk, 0, sem="release", scope="sys")


@functools.cache
def _items(items_host: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(items_host, dtype=torch.int32, device=device)


def launch(a, b, partials, received, out, items, rank, world, blocks, a_strides, signals, sig_strides,
           counters, reduce_op, a_scale, b_scale, bias, cfg: Config, num_sms: int) -> int:
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m, n = out.shape
    k = a.shape[1]
    br = m // blocks
    if br % bm:
        raise ValueError(f"producer_mm requires blocks of a multiple of {bm} rows, got {br}")
    b_trans = b.stride(0) == 1 and b.shape[1] > 1  # nn.Linear's weight.t()
    if not b_trans and b.stride(1) != 1:
        b = b.contiguous()
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(b.t() if b_trans else b, [n, k] if b_trans else [k, n], [b.stride(1), 1] if b_trans else
                              [b.stride(0), 1], [bn, bk] if b_trans else [bk, bn])
    recv_desc = TensorDescriptor(received, [world, m, n], [m * n, n, 1], [1, bm, bn])
    num_items = items.numel() // 3
    tiles = (br // bm) * triton.cdiv(n, bn)
    grid = (max(1, min(num_sms, num_items * tiles)),)
    dummy = out
    _rs_launch(grid, (
        a_desc, b_desc, recv_desc, partials, out, items, signals, counters,
        a_scale if a_scale is not None else dummy, b_scale if b_scale is not None else dummy,
        bias if bias is not None else dummy,
        n, k, m, br, rank, world, blocks, a_strides[0], a_strides[1], sig_strides[0], sig_strides[1], num_items,
        bm, bn, bk, cfg.group_m, grid[0], b_trans,  # BM, BN, BK, GROUP_M, NUM_SMS, B_TRANS
        _scale_mode(a_scale), _scale_mode(b_scale), bias is not None,  # A_SCALE, B_SCALE, HAS_BIAS
        reduce_op == "avg", False,  # AVG, FLATTEN (the reduction loops defeat Triton's loop fusion)
    ), num_warps=cfg.warps, num_stages=cfg.stages)
    return tiles


_rs_launch = FastLaunch(_rs_mm_kernel)
