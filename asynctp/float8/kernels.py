"""Triton kernels of the float8 quantization: one pass over the high-precision tensor where torch
needs six to eight elementwise kernels (abs, amax, float, divide, clamp, cast, transpose copy).

Semantics are exactly those of the torch code in asynctp.float8.quantize (bit-for-bit: the same
IEEE divisions and round-to-nearest casts; power-of-two scales rounded up with integer ops on
the float's bits), which stays the implementation on CPU and under torch.compile (inductor
fuses it there). Every tensor is handled as a 2-D view [R, C] with arbitrary strides:

    rows kernel   per-row amax over C, fused: scale[r] = f(max_c |x[r, c]|),
                  y[r, c] = fp8(clamp(x[r, c] / scale[r]))   (rowwise activations, forward weights)
    tile kernel   amax given (one value, or one per column, broadcast by strides), y written with
                  any strides (tensorwise; the dgrad weight: per-column scales, column-major y)
    dequant       y = (x_fp8 * scale).to(out dtype), scale broadcast by strides

f(amax) = max(amax, eps) * (1 / fp8_max) (a multiplication by the float32 reciprocal, as torch's
`tensor / python_scalar` computes it on CUDA, written out so CPU and kernels agree), rounded up to a power of two when the recipe asks for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asynctp.kernels.triton_util import FastLaunch

__all__ = ["quantize_rows", "quantize_given_amax", "dequantize"]


@triton.jit
def _scale_of(amax, eps, inv_max, POW2: tl.constexpr):
    s = tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL) * inv_max
    if POW2:
        # s is a positive normal float (eps / fp8_max is far above the subnormals): clear the
        # mantissa and step the exponent up by one unless s already is a power of two
        bits = s.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + 0x00800000
        bits = tl.where((bits & 0x007FFFFF) != 0, up, bits)
        s = bits.to(tl.float32, bitcast=True)
    return s


@triton.jit
def _cast(x, scale, fp8_max, y_ptr):
    y = tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    return y.to(y_ptr.dtype.element_ty)


@triton.jit
def _rows_kernel(
    x_ptr, y_ptr, s_ptr, R, C, sxr, sxc, syr, syc, ssr, eps, inv_max, fp8_max,
    POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_CHUNK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < R
    x_rows = x_ptr + rows[:, None].to(tl.int64) * sxr
    y_rows = y_ptr + rows[:, None].to(tl.int64) * syr
    if ONE_CHUNK:
        # the whole row fits one block: read once
        mask = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_rows + cols[None, :] * sxc, mask=mask, other=0.0).to(tl.float32)
        scale = _scale_of(tl.max(tl.abs(x), axis=1), eps, inv_max, POW2)
        tl.store(y_rows + cols[None, :] * syc, _cast(x, scale[:, None], fp8_max, y_ptr), mask=mask)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cols
            mask = rmask[:, None] & (c[None, :] < C)
            x = tl.load(x_rows + c[None, :] * sxc, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1), propagate_nan=tl.PropagateNan.ALL)
        scale = _scale_of(amax, eps, inv_max, POW2)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cols
            mask = rmask[:, None] & (c[None, :] < C)
            x = tl.load(x_rows + c[None, :] * sxc, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_rows + c[None, :] * syc, _cast(x, scale[:, None], fp8_max, y_ptr), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * ssr, scale, mask=rmask)


@triton.jit
def _tile(x_ptr, R, C, sxr, sxc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile: (row offsets, column offsets, mask, x as float32)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    r64 = rows[:, None].to(tl.int64)
    c64 = cols[None, :].to(tl.int64)
    x = tl.load(x_ptr + r64 * sxr + c64 * sxc, mask=mask, other=0.0).to(tl.float32)
    return r64, c64, mask, x


@triton.jit
def _tile_kernel(
    x_ptr, a_ptr, y_ptr, s_ptr, R, C, sxr, sxc, sar, sac, syr, syc, ssr, ssc, eps, inv_max, fp8_max,
    POW2: tl.constexpr, SCALE_BCAST_R: tl.constexpr, SCALE_BCAST_C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r64, c64, mask, x = _tile(x_ptr, R, C, sxr, sxc, BLOCK_R, BLOCK_C)
    amax = tl.load(a_ptr + r64 * sar + c64 * sac, mask=mask, other=1.0).to(tl.float32)
    scale = _scale_of(amax, eps, inv_max, POW2)
    tl.store(y_ptr + r64 * syr + c64 * syc, _cast(x, scale, fp8_max, y_ptr), mask=mask)
    # each scale is written once: by row 0 where the scale is broadcast over rows (stride 0),
    # by column 0 where it is broadcast over columns
    smask = mask
    if SCALE_BCAST_R:
        smask = smask & (r64 == 0)
    if SCALE_BCAST_C:
        smask = smask & (c64 == 0)
    tl.store(s_ptr + r64 * ssr + c64 * ssc, scale, mask=smask)


@triton.jit
def _dequant_kernel(
    x_ptr, s_ptr, y_ptr, R, C, sxr, sxc, ssr, ssc, syr, syc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r64, c64, mask, x = _tile(x_ptr, R, C, sxr, sxc, BLOCK_R, BLOCK_C)
    s = tl.load(s_ptr + r64 * ssr + c64 * ssc, mask=mask, other=1.0).to(tl.float32)
    tl.store(y_ptr + r64 * syr + c64 * syc, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _inv_max(dtype: torch.dtype) -> float:
    return 1.0 / float(torch.finfo(dtype).max)  # passed as float32: the reciprocal rounded once


def quantize_rows(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, eps: float, pow2: bool) -> None:
    """x, y: [R, C] views; scale: [R] view (float32). Writes y and scale."""
    R, C = x.shape
    if R == 0 or C == 0:
        return
    block_c = min(triton.next_power_of_2(C), 4096)
    block_r = max(1, min(16, 8192 // block_c))
    grid = (triton.cdiv(R, block_r),)
    _rows_launch(grid, (
        x, y, scale, R, C, x.stride(0), x.stride(1), y.stride(0), y.stride(1), scale.stride(0),
        eps, _inv_max(y.dtype), _fp8_max(y.dtype), pow2, block_r, block_c, block_c >= C,  # POW2, BLOCK_R, _C, ONE_CHUNK
    ), num_warps=8 if block_r * block_c >= 8192 else 4)


def quantize_given_amax(
    x: torch.Tensor, amax: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, eps: float, pow2: bool
) -> None:
    """x, y: [R, C] views (any strides); amax, scale: views broadcast to [R, C] (stride 0 where
    they repeat). Writes y and scale (each scale once)."""
    R, C = x.shape
    if R == 0 or C == 0:
        return
    grid = (triton.cdiv(R, 64), triton.cdiv(C, 64))
    _tile_launch(grid, (
        x, amax, y, scale, R, C, x.stride(0), x.stride(1), amax.stride(0), amax.stride(1),
        y.stride(0), y.stride(1), scale.stride(0), scale.stride(1), eps, _inv_max(y.dtype), _fp8_max(y.dtype),
        pow2, scale.stride(0) == 0, scale.stride(1) == 0, 64, 64,  # POW2, SCALE_BCAST_R, _C, BLOCK_R, _C
    ), num_warps=4)


def dequantize(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> None:
    """x, y: [R, C] views; scale: a view broadcast to [R, C]. Writes y = x * scale."""
    R, C = x.shape
    if R == 0 or C == 0:
        return
    grid = (triton.cdiv(R, 32), triton.cdiv(C, 128))
    _dequant_launch(grid, (
        x, scale, y, R, C, x.stride(0), x.stride(1), scale.stride(0), scale.stride(1), y.stride(0), y.stride(1),
        32, 128,  # BLOCK_R, BLOCK_C
    ), num_warps=4)


# launched without Triton's per-call binding after each key's first launch (quantization runs
# several times per layer and step: host time)
_rows_launch, _tile_launch, _dequant_launch = (FastLaunch(_rows_kernel), FastLaunch(_tile_kernel),
                                              FastLaunch(_dequant_kernel))
