"""The Triton kernel behind async_input_mm (imported on CUDA only: it needs Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from asynctp.kernels.configs import Config, split_parts
from asynctp.kernels.triton_util import FastLaunch

@triton.jit
def _spin(flag_ptr):
    """Wait until the flag is non-zero (acquire, system scope: a peer's stream write sets it)."""
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while v == 0:
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _tile(t, tiles_per_group, tm, num_pid_n, GROUP_M: tl.constexpr):
    """(group, m-tile within the group, n-tile) of logical tile t: grouped order within a group."""
    g = t // tiles_per_group
    u = t - g * tiles_per_group
    in_group = GROUP_M * num_pid_n
    first_m = (u // in_group) * GROUP_M
    gsize = tl.minimum(tm - first_m, GROUP_M)
    pm = first_m + (u % in_group) % gsize
    pn = (u % in_group) // gsize
    return g, pm, pn


@triton.jit
def _mainloop(a_desc, b_desc, row, off_n, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              B_TRANS: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        off_k = ki * BK
        a = a_desc.load([row, off_k])
        if B_TRANS:
            acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
        else:
            acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
    return acc


@triton.jit
def _split_unit(w, num_dp, k_tiles, SPLIT: tl.constexpr):
    """Work unit w -> (tile, part, k-tile range): units below num_dp are whole tiles; the tiles
    of the last, partial wave are split along K into SPLIT parts (one unit each)."""
    t = w
    part = 0
    k_lo = 0
    k_hi = k_tiles
    if SPLIT > 1:
        if w >= num_dp:
            u = w - num_dp
            t = num_dp + u // SPLIT
            part = u % SPLIT
            k_lo = part * k_tiles // SPLIT
            k_hi = (part + 1) * k_tiles // SPLIT
    return t, part, k_lo, k_hi


@triton.jit
def _fixup(acc, part_ptr, cnt_ptr, slot, part, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Store this part's fp32 sum of a split tile; the part that arrives last adds all SPLIT parts
    in part order (the same rounding whoever arrives last) and resets the tile's counter.
    Returns (the tile's sum where this part is last, is_last)."""
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    base = part_ptr + slot * (SPLIT * BM * BN)
    tl.store(base + part * (BM * BN) + offs, acc, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's partial is written before the release below
    old = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
    last = old == SPLIT - 1
    if last:
        tl.debug_barrier()
        acc = tl.load(base + offs, cache_modifier=".cg")
        for p in tl.static_range(1, SPLIT):
            acc += tl.load(base + p * (BM * BN) + offs, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + slot, 0, sem="relaxed", scope="gpu")
    return acc, last


@triton.jit
def _tile_sum(acc, w, t, part, num_dp, part_ptr, cnt_ptr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(the tile's sum, whether this unit goes on to the tile's epilogue): a whole tile's unit
    always; a part of a split tile only where it is the last to finish (_fixup)."""
    finish = True
    if SPLIT > 1:
        if w >= num_dp:
            acc, finish = _fixup(acc, part_ptr, cnt_ptr, t - num_dp, part, SPLIT, BM, BN)
    return acc, finish


@triton.jit(do_not_specialize=["pivot", "sig_src", "sig_blk"])  # vary per call: one compile
def _ag_mm_kernel(
    a_desc, b_desc, c_desc, a_ptr, a_local_ptr, stride_am,
    sig_ptr, cnt_ptr, a_scale_ptr, a_local_scale_ptr, b_scale_ptr, bias_ptr, part_ptr, tcnt_ptr,
    M, N, K, chunk_rows, rows_per_src, num_chunks, blocks, pivot, local_src,
    sig_src, sig_blk, out_src, out_blk, num_dp,
    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    ALIGNED: tl.constexpr, WAIT: tl.constexpr, RESET: tl.constexpr, LOCAL: tl.constexpr, B_TRANS: tl.constexpr, A_SCALE: tl.constexpr, B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, FLATTEN: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    if ALIGNED:
        tm = chunk_rows // BM
        groups = num_chunks
    else:
        tm = tl.cdiv(M, BM)
        groups = 1
    tiles_per_group = tm * num_pid_n
    num_tiles = groups * tiles_per_group
    waited = -1
    units = num_dp + (num_tiles - num_dp) * SPLIT
    for w in tl.range(pid, units, NUM_SMS, flatten=FLATTEN):
        t, part, k_lo, k_hi = _split_unit(w, num_dp, k_tiles, SPLIT)
        g, pm, pn = _tile(t, tiles_per_group, tm, num_pid_n, GROUP_M)
        c = 0
        src = 0
        blk = 0
        if ALIGNED:
            c = (pivot + g) % num_chunks
            src = c // blocks
            blk = c - src * blocks
            row_a = src * rows_per_src + blk * chunk_rows + pm * BM
            row_out = src * out_src + blk * out_blk + pm * BM
            if WAIT:
                if c != waited:
                    if src != local_src:
                        _spin(sig_ptr + src * sig_src + blk * sig_blk)
                    waited = c
        else:
            mt = ((pivot * chunk_rows) // BM + pm) % tm
            row_a = mt * BM
            row_out = row_a
            if WAIT:
                c_lo = row_a // chunk_rows
                c_hi = (tl.minimum(row_a + BM, M) - 1) // chunk_rows
                for cc in range(c_lo, c_hi + 1):
                    _spin(sig_ptr + cc * sig_src)
        off_n = pn * BN
        if LOCAL:
            # the local source's rows from the caller's tensor (no staging copy): a descriptor
            # made per tile over whichever allocation holds the tile's rows, one mainloop
            is_local = src == local_src
            base = tl.where(is_local, a_local_ptr, a_ptr)
            rows_in = tl.where(is_local, rows_per_src, M)
            row_ld = tl.where(is_local, row_a - local_src * rows_per_src, row_a)
            tile_desc = tl.make_tensor_descriptor(base, shape=[rows_in, K], strides=[stride_am, 1],
                                                  block_shape=[BM, BK])
            acc = _mainloop(tile_desc, b_desc, row_ld, off_n, k_lo, k_hi, BM, BN, BK, B_TRANS)
        else:
            acc = _mainloop(a_desc, b_desc, row_a, off_n, k_lo, k_hi, BM, BN, BK, B_TRANS)
        acc, finish = _tile_sum(acc, w, t, part, num_dp, part_ptr, tcnt_ptr, SPLIT, BM, BN)
        if finish:
            cols = off_n + tl.arange(0, BN)
            if A_SCALE == 1:
                acc = acc * tl.load(a_scale_ptr)
            if A_SCALE == 2:
                rows = tl.arange(0, BM)
                if LOCAL:  # the local source's scales from the caller's tensor too
                    s_base = tl.where(is_local, a_local_scale_ptr, a_scale_ptr)
                    sa = tl.load(s_base + row_ld + rows, mask=row_ld + rows < rows_in, other=0.0)
                else:
                    sa = tl.load(a_scale_ptr + row_a + rows, mask=row_a + rows < M, other=0.0)
                acc = acc * sa[:, None]
            if B_SCALE == 1:
                acc = acc * tl.load(b_scale_ptr)
            if B_SCALE == 2:
                acc = acc * tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            c_desc.store([row_out, off_n], acc.to(c_desc.dtype))
            if RESET:
                if src != local_src:
                    old = tl.atomic_add(cnt_ptr + c, 1, sem="acq_rel", scope="gpu")
                    if old == tiles_per_group - 1:
                        tl.atomic_xchg(cnt_ptr + c, 0, sem="relaxed", scope="gpu")
                        tl.atomic_xchg(sig_ptr + src * sig_src + blk * sig_blk, 0, sem="release", scope="sys")


def _scale_mode(scale: torch.Tensor | None) -> int:
    return 0 if scale is None else (1 if scale.numel() == 1 else 2)


def _kept_per_stream(store: dict, device: int, stream: int, fits, make):
    """make()'s buffers, kept in `store` per device and stream while they fit (launches on one
    stream run one after another: an allocation would cost host time at every launch); a launch
    being captured into a CUDA graph gets its own (the graph's memory)."""
    if torch.cuda.is_current_stream_capturing():
        return make()
    held = store.get((device, stream))
    if held is None or not fits(held):
        held = store[device, stream] = make()
    return held


_tail_state: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_scratch_bufs: dict[tuple[int, int], torch.Tensor] = {}


def tail_scratch(device: torch.device, tail: int, split: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 room for the split tiles' parts and one counter per split tile, kept per stream (the
    counters are zero between launches: the last part resets its tile's)."""
    size = tail * split * bm * bn

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(size, dtype=torch.float32, device=device),
                torch.zeros(max(tail, 256), dtype=torch.int32, device=device))

    if device.type != "cuda":  # (Triton's interpreter)
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kept_per_stream(_tail_state, index, torch._C._cuda_getCurrentRawStream(index),
                            lambda held: held[0].numel() >= size and held[1].numel() >= tail, make)


def _scratch(size: int, alignment: int, stream: int) -> torch.Tensor:
    """Global scratch for descriptors made on the device (tl.make_tensor_descriptor), kept per
    stream (Triton passes the launch's)."""
    device = torch.cuda.current_device()
    return _kept_per_stream(_scratch_bufs, device, stream, lambda held: held.numel() >= size,
                            lambda: torch.empty(size, dtype=torch.int8, device=device))


class OperandError(ValueError):
    """The caller's operands do not fit the kernels (raised before anything is built or launched);
    a Gluon launch that raises it is not taken for a failed build."""


def try_gluon(run, strict: bool, what: str) -> tuple[bool, object, str | None]:
    """run() (a Gluon kernel's launch): (True, its result, None); where it raises, other than for
    the caller's operands (OperandError, raised), and strict is False: a warning (once) and
    (False, None, why) -- the caller runs the Triton kernel instead (Gluon is an experimental
    API: another Triton may not build it)."""
    try:
        return True, run(), None
    except OperandError:  # the caller's operands, not the build: the Triton kernel would refuse them too
        raise
    except Exception as exc:
        if strict:
            raise
        from asynctp.config import warn_once

        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        warn_once(f"gluon:{what}", f"asynctp: {what}'s Gluon GEMM does not build with this Triton ({why}); "
                  "the Triton kernel runs instead")
        return False, None, why


def b_operand(b: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(b as the kernels read it, whether it is nn.Linear's weight.t(): [N, K] row-major underneath,
    read so; any other layout than those two is made row-major [K, N])."""
    b_trans = b.stride(0) == 1 and b.shape[1] > 1
    return (b if b_trans or b.stride(1) == 1 else b.contiguous()), b_trans


def b_descriptor(b: torch.Tensor, b_trans: bool, cfg: Config) -> tuple:
    """b's TMA descriptor arguments (tensor, shape, strides, block) for either layout of b_operand."""
    k, n = b.shape
    bn, bk = cfg.block_n, cfg.block_k
    return (b.t(), [n, k], [b.stride(1), 1], [bn, bk]) if b_trans else (b, [k, n], [b.stride(0), 1], [bk, bn])


def operands(a, b, b_trans, out, n, chunk_rows, cmap, a_local, cfg: Config) -> tuple:
    """(M, N, K, rows per source, out rows per source and per block, b's descriptor arguments:
    tensor, shape, strides, block) of a launch, for either kernel; a_local checked."""
    m_total, k, nn_ = n * chunk_rows, a.shape[1], out.shape[1]
    if a_local is not None and (chunk_rows % cfg.block_m or a_local.stride(0) != a.stride(0)
                                or a_local.data_ptr() % 16):
        raise OperandError(f"async_input_mm: a_local requires chunks of a multiple of {cfg.block_m} rows, a's row "
                           f"stride and 16-byte alignment, got {chunk_rows} rows, strides {a_local.stride(0)} / "
                           f"{a.stride(0)} and address {a_local.data_ptr():#x}")
    rows_per_src = chunk_rows * cmap.blocks
    out_src = rows_per_src if cmap.out_src is None else cmap.out_src
    out_blk = chunk_rows if cmap.out_blk is None else cmap.out_blk
    return m_total, nn_, k, rows_per_src, out_src, out_blk, b_descriptor(b, b_trans, cfg)


def launch(a, b, b_trans, out, signals, n, sig_src, sig_blk, chunk_rows, pivot, cmap, counters, a_scale, b_scale,
           bias, cfg: Config, num_sms: int, a_local=None, a_local_scale=None) -> None:
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_total, nn_, k, rows_per_src, out_src, out_blk, b_args = operands(a, b, b_trans, out, n, chunk_rows, cmap,
                                                                       a_local, cfg)
    aligned = chunk_rows % bm == 0
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [bm, bk])
    if a_local is not None:
        if a.is_cuda:
            triton.set_allocator(_scratch)
        if a_local_scale is None and _scale_mode(a_scale) == 2:  # the local rows' scales within a_scale
            a_local_scale = a_scale.reshape(-1)[cmap.local_src * rows_per_src:]
    b_desc = TensorDescriptor(*b_args)
    c_desc = TensorDescriptor(out, [m_total, nn_], [out.stride(0), 1], [bm, bn])
    tiles = (m_total // bm if aligned else triton.cdiv(m_total, bm)) * triton.cdiv(nn_, bn)
    split = split_parts(tiles, num_sms, triton.cdiv(k, bk)) if cfg.split else 1
    tail = tiles % num_sms if split > 1 else 0
    grid = (max(1, min(num_sms, tiles - tail + tail * split)),)
    dummy = out
    parts, tail_counters = tail_scratch(out.device, tail, split, bm, bn) if split > 1 else (dummy, dummy)
    _ag_launch(grid, (
        a_desc, b_desc, c_desc, a, a_local if a_local is not None else a, a.stride(0),
        signals if signals is not None else dummy, counters if counters is not None else dummy,
        a_scale if a_scale is not None else dummy,
        a_local_scale if a_local_scale is not None else (a_scale if a_scale is not None else dummy),
        b_scale if b_scale is not None else dummy, bias if bias is not None else dummy, parts, tail_counters,
        m_total, nn_, k, chunk_rows, rows_per_src, n, cmap.blocks, pivot, cmap.local_src,
        sig_src, sig_blk, out_src, out_blk, tiles - tail,
        split, bm, bn, bk, cfg.group_m, grid[0],  # SPLIT, BM, BN, BK, GROUP_M, NUM_SMS
        aligned, signals is not None, counters is not None, a_local is not None,  # ALIGNED, WAIT, RESET, LOCAL
        b_trans, _scale_mode(a_scale), _scale_mode(b_scale),  # B_TRANS, A_SCALE, B_SCALE
        bias is not None, cfg.flatten,  # HAS_BIAS, FLATTEN
    ), num_warps=cfg.warps, num_stages=cfg.stages)


_ag_launch = FastLaunch(_ag_mm_kernel)
