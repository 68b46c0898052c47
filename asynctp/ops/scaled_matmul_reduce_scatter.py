"""scaled_matmul_reduce_scatter: a float8 scaled matmul whose product is reduce-scattered, each
rank's partial chunk sent while the next one is computed (row-parallel linear, fp8)."""

from __future__ import annotations

from typing import Any

import torch

from asynctp.ops import graphs, guard, repeat
from asynctp.ops.dispatch import execute
from asynctp.ops.layout import ScatterLayout, matmul_rows, scatter_layout
from asynctp.ops.plan import make_plan
from asynctp.ops.reference import bias_chunk
from asynctp.ops.scaled_gemm import scaled_matmul_reduce_scatter_serial, scaled_mm
from asynctp.ops.scales import aligned, check_scaled_matmul_reduce_scatter, column_major, expand_cols, expand_rows
from asynctp.ops.strategy import eager_call_ok
from asynctp.runtime import kernel_path
from asynctp.runtime.graphs import tensor_key
from asynctp.runtime.transport import Transport
from asynctp.symm import Workspace, resolve_group

__all__ = ["scaled_matmul_reduce_scatter"]


def scaled_matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    scatter_dim: int,
    group: Any,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    reduce_op: str = "sum",
    use_fast_accum: bool = False,
    strategy: str = "auto",
) -> torch.Tensor:
    """Scaled matmul of float8 a and b, reduced over ranks, this rank's chunk along `scatter_dim`.

    Equivalent to the following plain PyTorch code::

        a_2d, scale_2d = (a, a_scale) flattened to 2-D (N-D a: leading dims merged)
        partial = torch._scaled_mm(a_2d, b, scale_2d, b_scale, out_dtype=out_dtype,
                                   use_fast_accum=use_fast_accum) reshaped to [..., S, ..., N]
        out = reduce_scatter(partial, scatter_dim, reduce_op, group)
        return out + bias (this rank's slice of it when scatter_dim is the last dim)

    Shapes: a [..., S, ..., K] float8_e4m3fn or float8_e5m2 (any dim may be the scatter dim,
    the last one too: then b's columns are scattered); b [K, N] float8 (weight_fp8.t(),
    column-major on CUDA); bias [N] of out_dtype, added once after the reduction. Scales are
    float32 dequantization multipliers: a_scale numel 1 or a.shape[:-1] + (1,) (rowwise; it
    follows a's rows into each rank's chunk); b_scale numel 1 or (1, N). The partials are
    rounded to out_dtype (bfloat16 or float32), then reduced in fp32 with one rounding.
    The scattered size must be divisible by the world size R. The result never aliases a
    shared buffer.

    strategy: "auto" (measured per shape), "serial" (matmul then collective), "pipeline"
    (each rank's partial pushed over the symmetric workspace while the next is computed), "ring"
    (send/recv of running sums, for groups without peer memory).
    """
    pg = resolve_group(group)
    return repeat.call(
        lambda: (("scaled_matmul_reduce_scatter", pg, tensor_key(a), tensor_key(b), tensor_key(a_scale),
                  tensor_key(b_scale), scatter_dim, type(scatter_dim), out_dtype, tensor_key(bias), reduce_op,
                  use_fast_accum, type(use_fast_accum), strategy), (a, b, a_scale, b_scale, bias)),
        lambda: _full(a, b, a_scale, b_scale, scatter_dim, pg, out_dtype, bias, reduce_op, use_fast_accum, strategy))


def _full(a, b, a_scale, b_scale, scatter_dim, pg, out_dtype, bias, reduce_op, use_fast_accum, strategy):
    """The call with its checks and plan (repeat.call runs it where it cannot replay directly)."""
    dim, rowwise = check_scaled_matmul_reduce_scatter(
        a, b, a_scale, b_scale, scatter_dim, pg.size(), out_dtype, bias, reduce_op, use_fast_accum, strategy
    )
    if eager_call_ok(a, b, a_scale, b_scale, bias):
        return _run(a, b, a_scale, b_scale, dim, rowwise, pg, out_dtype, bias, reduce_op, use_fast_accum, strategy)
    return torch.ops.asynctp.scaled_matmul_reduce_scatter(
        a, b, a_scale, b_scale, scatter_dim, pg.group_name, out_dtype, bias, reduce_op, use_fast_accum, strategy
    )


@torch.library.custom_op(
    "asynctp::scaled_matmul_reduce_scatter",
    mutates_args=(),
    schema="(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, int scatter_dim, str group_name, "
    "ScalarType out_dtype, Tensor? bias, str reduce_op, bool use_fast_accum, str strategy) -> Tensor",
)
def _scaled_matmul_reduce_scatter_op(
    a, b, a_scale, b_scale, scatter_dim, group_name, out_dtype, bias, reduce_op, use_fast_accum, strategy
):
    group = resolve_group(group_name)
    dim, rowwise = check_scaled_matmul_reduce_scatter(
        a, b, a_scale, b_scale, scatter_dim, group.size(), out_dtype, bias, reduce_op, use_fast_accum, strategy
    )
    return _run(a, b, a_scale, b_scale, dim, rowwise, group, out_dtype, bias, reduce_op, use_fast_accum, strategy)


@guard.agreed("scaled_matmul_reduce_scatter")
def _run(a, b, a_scale, b_scale, dim, rowwise, group, out_dtype, bias, reduce_op, use_fast_accum, strategy):
    """The implementation, on validated arguments (dim normalized)."""
    world = group.size()
    if guard.enabled():
        meta = dict(a=a, b=b, a_scale=a_scale, b_scale=b_scale, bias=bias, scatter_dim=dim, out_dtype=str(out_dtype),
                    reduce_op=reduce_op, use_fast_accum=use_fast_accum, strategy=strategy)
        # isfinite has no float8 kernel: check the fp8 operands upcast (a debugging aid, off by default)
        guard.preflight("scaled_matmul_reduce_scatter", group, meta, [a.float(), b.float(), a_scale, b_scale, bias])
    mode = "rowwise" if rowwise else "tensorwise"
    shape_key = (f"{str(a.dtype).removeprefix('torch.')}-{mode}", matmul_rows(a, dim, world, gather=False), b.shape[1],
                 b.shape[0])
    plan = make_plan("scaled_matmul_reduce_scatter", "matmul_reduce_scatter", strategy, group, a.device, shape_key)

    def args(batch_major: bool = True):
        # batch-major (where asked for and it applies) for the produce-driven strategies; the
        # serial reduce_scatter needs the front order
        lay = scatter_layout(a, dim, world, batch_major)
        # the scale goes through a's own layout, so scale row i is the scale of a_2d row i
        a_scale_2d = scatter_layout(a_scale, dim, world, batch_major).a_2d if rowwise else a_scale
        return (lay, a_scale_2d, column_major(b), b_scale, out_dtype, reduce_op, bias, use_fast_accum)

    def serial() -> torch.Tensor:
        return scaled_matmul_reduce_scatter_serial(*args(batch_major=False), group)

    def decomposed(transport: Transport) -> torch.Tensor:
        return _decomposed(transport, *args())

    def fused(ws: Workspace) -> torch.Tensor | None:
        lay, a_scale_2d, b_cm, *_ = args()
        if kernel_path.scatter_available(ws, lay.a_2d, b.shape[1], lay.segment, lay.n_mode) is not None:
            return None
        # the producer GEMM applies the scales and the bias in its epilogue, fp32 accumulation
        return lay.restore(kernel_path.matmul_scatter(
            ws, lay.a_2d, b_cm, reduce_op, bias, segment=lay.segment, out_dtype=out_dtype,
            a_scale=a_scale_2d.reshape(-1).contiguous(), b_scale=b_scale.reshape(-1).contiguous()))

    def key() -> tuple:
        return ("scaled_matmul_reduce_scatter", tensor_key(a), tensor_key(b), tensor_key(a_scale), tensor_key(b_scale),
                tensor_key(bias), dim, out_dtype, reduce_op, use_fast_accum, plan.splits, plan.strategy,
                graphs.settings())

    return execute("scaled_matmul_reduce_scatter", plan, group, a.device, serial=serial, decomposed=decomposed,
                   key=key, fused=fused)


@_scaled_matmul_reduce_scatter_op.register_fake
def _(a, b, a_scale, b_scale, scatter_dim, group_name, out_dtype, bias, reduce_op, use_fast_accum, strategy):
    world = resolve_group(group_name).size()
    dim, _ = check_scaled_matmul_reduce_scatter(
        a, b, a_scale, b_scale, scatter_dim, world, out_dtype, bias, reduce_op, use_fast_accum, strategy
    )
    lay = scatter_layout(a, dim, world)
    return lay.restore(a.new_empty(lay.chunk_shape(b.shape[1]), dtype=out_dtype))


def _decomposed(
    transport: Transport,
    lay: ScatterLayout,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    reduce_op: str,
    bias: torch.Tensor | None,
    use_fast_accum: bool,
) -> torch.Tensor:
    """The scaled product reduce-scattered over the transport. a_scale: numel 1, or rowwise laid
    out like lay.a_2d ([rows, 1]). produce never gets a partial to add (fused_acc=False):
    _scaled_mm has no accumulate epilogue, the transport reduces after the GEMM."""
    chunk_shape = lay.chunk_shape(b.shape[1])
    n = chunk_shape[1]
    a_rowwise = a_scale.numel() != 1 or tuple(a_scale.shape) == (lay.a_2d.shape[0], 1)
    # pair the scales once, not per block: _scaled_mm takes rowwise only with per-column
    any_rowwise = a_rowwise or b_scale.numel() != 1
    a_fixed = expand_rows(a_scale, lay.a_2d.shape[0]) if (any_rowwise and not a_rowwise) else a_scale
    if any_rowwise and tuple(b_scale.shape) != (1, b.shape[1]):
        b_scale = expand_cols(b_scale, b.shape[1])

    def a_rows_scale(row_lo: int, row_hi: int) -> torch.Tensor:
        if a_rowwise:
            # a block's scale rows start 4 * row_lo bytes in: off cuBLAS's 16-byte alignment
            # unless row_lo is a multiple of 4
            return aligned(a_fixed[row_lo:row_hi])
        # an expanded tensorwise scale has equal rows: its first ones serve any block
        return a_fixed[: row_hi - row_lo] if any_rowwise else a_fixed

    def gemm(a_rows, b_cols, a_s, b_s, out):
        return scaled_mm(a_rows, b_cols, a_s, b_s, out_dtype, use_fast_accum=use_fast_accum, out=out)

    def partial(dst: int, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """out = this rank's partial for rows lo:hi of dst's chunk."""
        if lay.n_mode:
            cols = slice(dst * n, (dst + 1) * n)
            b_s = aligned(b_scale[:, cols]) if b_scale.numel() != 1 else b_scale
            return gemm(lay.a_2d[lo:hi], b[:, cols], a_rows_scale(lo, hi), b_s, out)
        # one run of a's rows, or one per leading index (batch-major)
        for off, row, count in lay.a_runs(dst, lo, hi):
            gemm(lay.a_2d[row : row + count], b, a_rows_scale(row, row + count), b_scale, out[off : off + count])
        return out

    def produce(dst: int, lo: int, hi: int, out: torch.Tensor, acc: torch.Tensor | None) -> None:
        assert acc is None, "the fp8 pipeline reduces after the GEMM (fused_acc=False)"
        partial(dst, lo, hi, out)

    out = transport.reduce_scatter(produce, chunk_shape, out_dtype, reduce_op, fused_acc=False)
    if bias is not None:
        out.add_(bias_chunk(lay, bias, transport.rank))
    return lay.restore(out)

