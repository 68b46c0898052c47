"""torch._scaled_mm for the fused fp8 ops: one 2-D call that hides _scaled_mm's limits, and the
serial references (plain collective, then scaled matmul) that define the ops' semantics.

_scaled_mm's limits handled here (the same on CPU and CUDA, so CI runs the CUDA code path):
- it pairs tensorwise with tensorwise and rowwise with per-column only: a mixed pair is expanded;
- bias is refused with a float32 output (cuBLAS): the bias is added after, in float32;
- rowwise scales with a float32 output are missing from some releases' CUTLASS kernel: the
  product is taken unscaled in float32 and scaled after (the epilogue's own arithmetic);
- the CUTLASS rowwise kernel (torch builds before cuBLAS 12.9) takes float8_e5m2 only as its first
  operand: e4m3 a x e5m2 b is computed transposed (the bias then added after, rounded twice); a's
  rows are then mat2's columns, which CUDA wants a multiple of 16 like K and N, so they are
  zero-padded (a pipeline's row block has any size: the user's K and N are checked, M never is);
- scale slices off cuBLAS's 16-byte alignment are copied (scales.aligned).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from asynctp.config import warn_once
from asynctp.ops.layout import GatherLayout, ScatterLayout
from asynctp.ops.reference import reduce_scatter_product
from asynctp.ops.scales import CUDA_DIM_MULTIPLE, aligned, expand_cols, expand_rows
from asynctp.runtime.collective import all_gather_rows

__all__ = [
    "scaled_mm",
    "KBlockAccumulator",
    "all_gather_scaled_matmul_serial",
    "scaled_matmul_reduce_scatter_serial",
]


def _pair(a_scale: torch.Tensor, b_scale: torch.Tensor, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        return a_scale, b_scale
    if tuple(a_scale.shape) != (m, 1):
        a_scale = expand_rows(a_scale, m)
    if tuple(b_scale.shape) != (1, n):
        b_scale = expand_cols(b_scale, n)
    return aligned(a_scale), aligned(b_scale)


def _rows_padded(a_fp8: torch.Tensor, a_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a_fp8 [m, K] and its scale [m, 1] with zero rows (scale 1) appended up to a multiple of 16
    rows; the padded rows' products are zero and are sliced off."""
    m = a_fp8.shape[0]
    m_pad = -(-m // CUDA_DIM_MULTIPLE) * CUDA_DIM_MULTIPLE
    if m_pad == m:
        return a_fp8, a_scale
    # through the bytes (the zero byte is +0 in both float8 formats): no float8 fill kernel needed
    padded = torch.zeros((m_pad, a_fp8.shape[1]), dtype=torch.uint8, device=a_fp8.device)
    padded[:m].copy_(a_fp8.view(torch.uint8))
    scale = torch.ones((m_pad, 1), dtype=torch.float32, device=a_scale.device)
    scale[:m].copy_(a_scale)
    return padded.view(a_fp8.dtype), scale


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_takes_vectors() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes rowwise / per-column scales. 2.13's does;
    2.11's asserts that both scales have one element ("only supports per-tensor scaling for CPU
    backend"); scaled_mm then computes such products itself (with a warning)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def scaled_mm(
    a_fp8: torch.Tensor,
    b_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch._scaled_mm(a_fp8, b_fp8, a_scale, b_scale, bias=bias, out_dtype=out_dtype), 2-D.

    a_fp8 [m, K] row-major; b_fp8 [K, n] (column-major on CUDA); a_scale numel 1 or [m, 1];
    b_scale numel 1 or [1, n]; bias [n] of out_dtype; out [m, n] of out_dtype (written, returned).
    """
    m, n = a_fp8.shape[0], b_fp8.shape[1]
    a_scale, b_scale = _pair(a_scale, b_scale, m, n)
    rowwise = a_scale.numel() != 1 or b_scale.numel() != 1
    if rowwise and out_dtype != torch.float32 and a_fp8.device.type == "cpu" and not cpu_scaled_mm_takes_vectors():
        warn_once("cpu-rowwise-scaled-mm", (
            f"torch {torch.__version__}'s CPU torch._scaled_mm takes tensorwise scales only: asynctp computes rowwise / "
            f"per-column scaled fp8 matmuls on CPU as a float32 product with unit scales, then scales, bias and one "
            f"rounding to {out_dtype} (torch 2.13 runs them directly; the result may differ in the last bit)"))
        full = scaled_mm(a_fp8, b_fp8, a_scale, b_scale, torch.float32, use_fast_accum=use_fast_accum)
        if bias is not None:
            full.add_(bias)
        return full.to(out_dtype) if out is None else out.copy_(full)
    if out_dtype == torch.float32 and rowwise:
        one = torch.ones((), dtype=torch.float32, device=a_fp8.device)
        out = torch._scaled_mm(a_fp8, b_fp8, one, one, out_dtype=out_dtype, use_fast_accum=use_fast_accum, out=out)
        out.mul_(a_scale).mul_(b_scale)
    elif out_dtype == torch.float32:
        out = torch._scaled_mm(
            a_fp8, b_fp8, a_scale, b_scale, out_dtype=out_dtype, use_fast_accum=use_fast_accum, out=out
        )
    elif rowwise and b_fp8.dtype == torch.float8_e5m2:
        # the CUTLASS rowwise kernel takes e5m2 only as its first operand: out.t() = b.t() @ a.t()
        a_pad, a_scale_pad = _rows_padded(a_fp8, a_scale)
        out_t = torch._scaled_mm(
            b_fp8.t(), a_pad.t(), b_scale.reshape(n, 1), a_scale_pad.reshape(1, a_pad.shape[0]),
            out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        )[:, :m]
        out = out_t.t().contiguous() if out is None else out.copy_(out_t.t())
    else:
        return torch._scaled_mm(
            a_fp8, b_fp8, a_scale, b_scale, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum, out=out
        )
    if bias is not None:
        out.add_(bias)
    return out


class KBlockAccumulator:
    """Gather along K: rank r's block [M, k] multiplies rows r*k:(r+1)*k of b, each block with its
    own scales (a rowwise scale differs per rank's block). Products accumulate in fp32 and round
    once at the end, with the bias, as one GEMM's epilogue would."""

    def __init__(
        self, m: int, world_size: int, bs: list[torch.Tensor], b_scales: list[torch.Tensor], use_fast_accum: bool
    ) -> None:
        self.bs, self.b_scales, self.use_fast_accum = bs, b_scales, use_fast_accum
        self.k = bs[0].shape[0] // world_size
        self.accs = [b.new_zeros((m, b.shape[1]), dtype=torch.float32) for b in bs]

    def add(self, src: int, lo: int, block_fp8: torch.Tensor, block_scale: torch.Tensor) -> None:
        """Rows lo:lo+len(block) of rank src's K block."""
        k, hi = self.k, lo + block_fp8.shape[0]
        for acc, b, b_scale in zip(self.accs, self.bs, self.b_scales):
            product = scaled_mm(block_fp8, b[src * k : (src + 1) * k], block_scale, b_scale, torch.float32,
                                use_fast_accum=self.use_fast_accum)
            acc[lo:hi].add_(product)

    def finish(self, biases: list[torch.Tensor | None], out_dtype: torch.dtype) -> list[torch.Tensor]:
        outs = []
        for acc, bias in zip(self.accs, biases):
            if bias is not None:
                acc.add_(bias)
            outs.append(acc.to(out_dtype))
        return outs


def all_gather_scaled_matmul_serial(
    lay: GatherLayout,
    a_scale: torch.Tensor,
    scale_2d: torch.Tensor | None,
    bs: list[torch.Tensor],
    b_scales: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    group: dist.ProcessGroup,
    return_a: bool,
    return_scale: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """all_gather(a) (and a rowwise scale, row for row), then one scaled matmul per b.
    scale_2d: the rowwise scale laid out like lay.shard_2d ([m, 1]), or None (tensorwise).
    return_scale (rowwise, row mode): the gathered scale is appended to the outputs."""
    world = lay.world_size
    rows = lay.new_rows(lay.shard_2d.shape[1])
    # byte copies: not every backend's all-gather knows float8
    all_gather_rows(rows.view(torch.uint8), lay.shard_2d.view(torch.uint8), group)
    scale_rows = None
    if scale_2d is not None:
        scale_rows = scale_2d.new_empty((world * scale_2d.shape[0], 1))
        all_gather_rows(scale_rows, scale_2d, group)
    a_gathered = lay.a_gathered(rows) if (return_a or lay.k_mode) else None
    if lay.k_mode and scale_rows is not None:
        acc = KBlockAccumulator(lay.m, world, bs, b_scales, use_fast_accum)
        for src in range(world):
            acc.add(src, 0, rows[src * lay.m : (src + 1) * lay.m], aligned(scale_rows[src * lay.m : (src + 1) * lay.m]))
        outs = acc.finish(biases, out_dtype)
    else:
        a_2d = a_gathered.reshape(lay.m, -1) if lay.k_mode else rows
        a_s = scale_rows if scale_rows is not None else a_scale
        outs = [scaled_mm(a_2d, b, a_s, s, out_dtype, bias=bias, use_fast_accum=use_fast_accum)
                for b, s, bias in zip(bs, b_scales, biases)]
    if return_scale:
        outs.append(scale_rows)
    return (a_gathered if return_a else None), [lay.restore(o) for o in outs]


def scaled_matmul_reduce_scatter_serial(
    lay: ScatterLayout,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    reduce_op: str,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """One scaled matmul, then reduce_scatter (sum; avg divides after), then the bias once.
    a_scale: numel 1, or the rowwise scale laid out like lay.a_2d ([rows, 1])."""
    full = scaled_mm(lay.a_2d, b, a_scale, b_scale, out_dtype, use_fast_accum=use_fast_accum)
    return reduce_scatter_product(lay, full, reduce_op, bias, group)
