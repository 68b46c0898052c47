"""all_gather_scaled_matmul: all-gather a float8 activation (with its rowwise scale, if any) and
multiply it by float8 matrices with torch._scaled_mm, overlapping the gather with the matmuls."""

from __future__ import annotations

from typing import Any

import torch

from asynctp.ops import graphs, guard, repeat
from asynctp.ops.dispatch import execute
from asynctp.runtime.graphs import tensor_key
from asynctp.ops.layout import GatherLayout, gather_layout, matmul_rows
from asynctp.ops.plan import make_plan
from asynctp.ops.scaled_gemm import KBlockAccumulator, all_gather_scaled_matmul_serial, scaled_mm
from asynctp.ops.scales import aligned, check_all_gather_scaled_matmul, column_major, expand_cols, expand_rows
from asynctp.ops.strategy import eager_call_ok
from asynctp.runtime import kernel_path
from asynctp.runtime.transport import Transport
from asynctp.symm import Workspace, resolve_group

__all__ = ["all_gather_scaled_matmul", "all_gather_scaled_matmul_with_scale"]


def all_gather_scaled_matmul(
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    a_scale: torch.Tensor,
    b_scales: list[torch.Tensor],
    gather_dim: int,
    group: Any,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    biases: list[torch.Tensor | None] | None = None,
    use_fast_accum: bool = False,
    return_a: bool = True,
    strategy: str = "auto",
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather float8 `a_shard` along `gather_dim`, then a scaled matmul with each b in `bs`.

    Equivalent to the following plain PyTorch code::

        a_gathered = torch.cat(all_gather(a_shard, group), dim=gather_dim)
        scale = torch.cat(all_gather(a_scale, group), dim=gather_dim) if rowwise else a_scale
        a_2d, scale_2d = (a_gathered, scale) with gather_dim moved first, flattened to 2-D
        outs = [torch._scaled_mm(a_2d, b, scale_2d, b_scale, bias=bias, out_dtype=out_dtype,
                                 use_fast_accum=use_fast_accum) reshaped back
                for b, b_scale, bias in zip(bs, b_scales, biases)]
        return (a_gathered if return_a else None), outs

    Shapes: a_shard [..., s, ..., K'] float8_e4m3fn or float8_e5m2 (any dim may be the gather
    dim, the last one too: then K = R * K'); bs[i] [K, N_i] float8 (weight_fp8.t(), column-major
    on CUDA); biases[i] [N_i] of out_dtype. Scales are float32 dequantization multipliers:
    a_scale numel 1 (tensorwise: it must be identical on every rank, which asynctp.float8's
    quantize_activation guarantees by agreeing on the amax over the group; on CPU its value is
    part of the call's signature, so ranks whose values differ raise; on CUDA it is not read,
    which would be a host sync: take it from asynctp.float8) or a_shard.shape[:-1] + (1,)
    (rowwise: gathered with its rows in the same pipeline); b_scales[i] numel 1 or (1, N_i).
    Gathering along K with rowwise scales gives each row one scale per rank's K block: each
    block's product is scaled by its own scale and the blocks are summed in fp32 (there is no
    single _scaled_mm for it).
    out_dtype: torch.bfloat16 or torch.float32. Outputs never alias a shared buffer.

    strategy: "auto" (measured per shape), "serial" (collective then matmul), "pipeline"
    (each rank pushes its shard into its peers' symmetric buffers by copy engine, block by block;
    the matmuls read each block where it landed), "fused" (the same pushes, one persistent GEMM
    that waits per block: asynctp.kernels; bf16 outputs on sm_90+, else as pipeline), "ring"
    (send/recv, for groups without peer memory; a rowwise scale is all-gathered up front).
    """
    pg = resolve_group(group)
    return repeat.call(
        lambda: (("all_gather_scaled_matmul", pg, tensor_key(a_shard), tuple(map(tensor_key, bs)), tensor_key(a_scale),
                  tuple(map(tensor_key, b_scales)), gather_dim, type(gather_dim), out_dtype,
                  None if biases is None else tuple(map(tensor_key, biases)), use_fast_accum, type(use_fast_accum),
                  return_a, type(return_a), strategy),
                 (a_shard, a_scale, *bs, *b_scales, *(biases or ()))),
        lambda: _full(a_shard, bs, a_scale, b_scales, gather_dim, pg, out_dtype, biases, use_fast_accum, return_a,
                      strategy))


def _full(a_shard, bs, a_scale, b_scales, gather_dim, pg, out_dtype, biases, use_fast_accum, return_a, strategy):
    """The call with its checks and plan (repeat.call runs it where it cannot replay directly)."""
    checked = check_all_gather_scaled_matmul(
        a_shard, bs, a_scale, b_scales, gather_dim, pg.size(), out_dtype, biases, use_fast_accum, return_a, strategy
    )
    _, bs, b_scales, biases, _ = checked
    if eager_call_ok(a_shard, a_scale, *bs, *b_scales, *biases):
        return _run(a_shard, a_scale, checked, pg, out_dtype, use_fast_accum, return_a, strategy)
    a_gathered, outs = torch.ops.asynctp.all_gather_scaled_matmul(
        a_shard, bs, a_scale, b_scales, gather_dim, pg.group_name, out_dtype, biases, use_fast_accum, return_a, strategy
    )
    return a_gathered, list(outs)


def all_gather_scaled_matmul_with_scale(
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    a_scale: torch.Tensor,
    b_scales: list[torch.Tensor],
    gather_dim: int,
    group: Any,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    strategy: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """all_gather_scaled_matmul(return_a=True) with a rowwise a_scale that also returns the
    gathered scale, which its gather moves anyway: (a_gathered, a_scale_gathered, outs), the
    scale shaped a_gathered.shape[:-1] + (1,). Internal (asynctp.nn's fp8 row-parallel backward
    dequantizes the gathered output grad with it, instead of all-gathering the scales again);
    eager only, a gather dim other than the last, no bias, no fast accumulation."""
    pg = resolve_group(group)
    checked = check_all_gather_scaled_matmul(
        a_shard, bs, a_scale, b_scales, gather_dim, pg.size(), out_dtype, None, False, True, strategy
    )
    dim, bs, b_scales, biases, rowwise = checked
    if not rowwise or dim == a_shard.ndim - 1:
        raise ValueError("all_gather_scaled_matmul_with_scale requires a rowwise a_scale and a gather dim other than "
                         f"the last, got a_scale of shape {tuple(a_scale.shape)} and gather_dim {gather_dim}")
    if not eager_call_ok(a_shard, a_scale, *bs, *b_scales):
        raise ValueError("all_gather_scaled_matmul_with_scale requires eager plain tensors without autograd "
                         "(it has no custom op for torch.compile)")
    a_gathered, outs = _run(a_shard, a_scale, checked, pg, out_dtype, False, True, strategy, return_scale=True)
    return a_gathered, outs[-1], list(outs[:-1])


@torch.library.custom_op(
    "asynctp::all_gather_scaled_matmul",
    mutates_args=(),
    schema="(Tensor a_shard, Tensor[] bs, Tensor a_scale, Tensor[] b_scales, int gather_dim, str group_name, "
    "ScalarType out_dtype, Tensor?[] biases, bool use_fast_accum, bool return_a, str strategy) -> (Tensor?, Tensor[])",
)
def _all_gather_scaled_matmul_op(
    a_shard, bs, a_scale, b_scales, gather_dim, group_name, out_dtype, biases, use_fast_accum, return_a, strategy
):
    group = resolve_group(group_name)
    checked = check_all_gather_scaled_matmul(
        a_shard, bs, a_scale, b_scales, gather_dim, group.size(), out_dtype, biases, use_fast_accum, return_a, strategy
    )
    return _run(a_shard, a_scale, checked, group, out_dtype, use_fast_accum, return_a, strategy)


@guard.agreed("all_gather_scaled_matmul")
def _run(a_shard, a_scale, checked, group, out_dtype, use_fast_accum, return_a, strategy, return_scale=False):
    """The implementation, on validated arguments (`checked`: what the check returned).
    return_scale (rowwise, internal): the gathered a_scale is appended to the outputs."""
    dim, bs, b_scales, biases, rowwise = checked
    world = group.size()
    if guard.enabled():
        _preflight(a_shard, a_scale, checked, group, out_dtype, use_fast_accum, return_a, strategy)
    mode = "rowwise" if rowwise else "tensorwise"
    shape_key = (f"{str(a_shard.dtype).removeprefix('torch.')}-{mode}", matmul_rows(a_shard, dim, world, gather=True),
                 sum(b.shape[1] for b in bs), bs[0].shape[0])
    plan = make_plan("all_gather_scaled_matmul", "all_gather_matmul", strategy, group, a_shard.device, shape_key)

    def args(batch_major: bool = True):
        # batch-major (where asked for and it applies) for the consumer-driven strategies; the
        # serial all_gather needs the front order
        lay = gather_layout(a_shard, dim, world, batch_major)
        # the scale goes through a's own layout, so scale row i is the scale of a_2d row i
        scale_2d = gather_layout(a_scale, dim, world, batch_major).shard_2d if rowwise else None
        return (lay, a_scale, scale_2d, [column_major(b) for b in bs], b_scales, biases, out_dtype, use_fast_accum,
                return_a, return_scale)

    def serial() -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        lay, _, scale_2d, bs_cm, *_ = args(batch_major=False)
        return all_gather_scaled_matmul_serial(
            lay, a_scale, scale_2d, bs_cm, b_scales, biases, out_dtype, use_fast_accum, group, return_a, return_scale
        )

    def decomposed(transport: Transport) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        return _decomposed(transport, *args())

    def fused(ws: Workspace) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        lay, _, scale_2d, bs_cm, *_ = args()
        return _fused(ws, lay, a_scale, scale_2d, bs_cm, b_scales, biases, out_dtype, return_a, return_scale)

    def key() -> tuple:
        return ("all_gather_scaled_matmul", tensor_key(a_shard), tensor_key(a_scale), dim, tuple(map(tensor_key, bs)),
                tuple(map(tensor_key, b_scales)), tuple(map(tensor_key, biases)), out_dtype, use_fast_accum, return_a,
                return_scale, plan.splits, plan.lockstep, plan.strategy, graphs.settings())

    return execute("all_gather_scaled_matmul", plan, group, a_shard.device, serial=serial, decomposed=decomposed,
                   key=key, fused=fused)


def _fused(ws: Workspace, lay: GatherLayout, a_scale, scale_2d, bs, b_scales, biases, out_dtype, return_a,
           return_scale) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
    """The single-launch GEMM (runtime/kernel_path.py) where it serves the call, else None: the
    scales and the bias in its epilogue, fp32 accumulation (use_fast_accum asks for no less)."""
    if return_scale or out_dtype != torch.bfloat16:
        return None  # the gathered scale rows, and fp32 tiles (twice the epilogue's shared memory)
    n_min = min(b.shape[1] for b in bs)
    if kernel_path.gather_available(ws, lay.shard_2d, lay.segment, lay.k_mode, n_min) is not None:
        return None
    rowwise = scale_2d is not None
    rows, out_rows = kernel_path.gather_matmul(
        ws, lay.shard_2d, bs, biases, segment=lay.segment, keep_gathered=return_a,
        a_scale=None if rowwise else a_scale.reshape(1).float(),
        scale_rows=scale_2d.reshape(-1).float().contiguous() if rowwise else None,
        b_scales=[s.reshape(-1).float().contiguous() for s in b_scales], out_dtype=out_dtype, runs=lay.gathered_runs)
    return (None if rows is None else lay.a_gathered(rows, placed=True)), [lay.restore(o) for o in out_rows]


def _preflight(a_shard, a_scale, checked, group, out_dtype, use_fast_accum, return_a, strategy) -> None:
    """guard's optional checks; a tensorwise a_scale must also be the same value on every rank."""
    dim, bs, b_scales, biases, rowwise = checked
    meta = dict(a_shard=a_shard, bs=bs, a_scale=a_scale, b_scales=b_scales, biases=biases, gather_dim=dim,
                out_dtype=str(out_dtype), use_fast_accum=use_fast_accum, return_a=return_a, strategy=strategy,
                a_scale_value=None if rowwise else float(a_scale.reshape(())))
    # isfinite has no float8 kernel: check the fp8 operands upcast (a debugging aid, off by default)
    inputs = [a_shard.float(), a_scale, *(b.float() for b in bs), *b_scales, *biases]
    guard.preflight("all_gather_scaled_matmul", group, meta, inputs)


@_all_gather_scaled_matmul_op.register_fake
def _(a_shard, bs, a_scale, b_scales, gather_dim, group_name, out_dtype, biases, use_fast_accum, return_a, strategy):
    world = resolve_group(group_name).size()
    dim, bs, *_ = check_all_gather_scaled_matmul(
        a_shard, bs, a_scale, b_scales, gather_dim, world, out_dtype, biases, use_fast_accum, return_a, strategy
    )
    lay = gather_layout(a_shard, dim, world)
    if lay.k_mode:
        outs = [lay.restore(lay.shard_2d.new_empty((lay.m, b.shape[1]), dtype=out_dtype)) for b in bs]
    else:
        outs = [lay.restore(lay.new_rows(b.shape[1], dtype=out_dtype)) for b in bs]
    return (lay.a_gathered(lay.new_rows(lay.shard_2d.shape[1])) if return_a else None), outs


def _decomposed(
    transport: Transport,
    lay: GatherLayout,
    a_scale: torch.Tensor,
    scale_2d: torch.Tensor | None,
    bs: list[torch.Tensor],
    b_scales: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    return_a: bool,
    return_scale: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """One gather over the transport moves a's rows (as bytes) and, when rowwise, the scale rows.
    return_scale
    (rowwise, row mode): each block's scale rows are also copied out, and the gathered scale is
    appended to the outputs."""
    m, world = lay.m, lay.world_size
    # the gathered rows only for the caller: the consumer reads each block where it landed (the
    # ring's gather makes its own receive buffer when given None)
    rows = lay.new_rows(lay.shard_2d.shape[1]) if return_a else None
    shards, gathered = [lay.shard_2d.view(torch.uint8)], [None if rows is None else rows.view(torch.uint8)]
    if scale_2d is not None:
        shards.append(scale_2d)
        gathered.append(None)
    # pair the scales once, not per chunk: _scaled_mm takes rowwise only with per-column
    any_rowwise = scale_2d is not None or any(s.numel() != 1 for s in b_scales)
    a_fixed = expand_rows(a_scale, m) if (any_rowwise and scale_2d is None) else a_scale
    b_fixed = [expand_cols(s, b.shape[1]) if (any_rowwise and s.numel() == 1) else s for s, b in zip(b_scales, bs)]

    def block_scale(blocks: list[torch.Tensor], off: int = 0, count: int | None = None) -> torch.Tensor:
        """The scale of rows off:off+count of a block (all of it by default)."""
        count = blocks[0].shape[0] - off if count is None else count
        if scale_2d is not None:
            # a block's scale rows start 4 * (src * m + lo) bytes in: off cuBLAS's 16-byte
            # alignment unless that row index is a multiple of 4
            return aligned(blocks[1][off : off + count])
        # an expanded tensorwise scale has equal rows: its first ones serve any block
        return a_fixed[:count] if any_rowwise else a_scale

    if lay.k_mode:
        acc = KBlockAccumulator(m, world, bs, b_fixed, use_fast_accum)

        def consume_block(src: int, lo: int, blocks: list[torch.Tensor]) -> None:
            acc.add(src, lo, blocks[0].view(lay.shard_2d.dtype), block_scale(blocks))

        # one stream: the accumulators are shared by every step (the plan's lockstep still applies)
        transport.gather(shards, gathered, consume_block, alternate=False, lockstep=True)
        outs = [lay.restore(o) for o in acc.finish(biases, out_dtype)]
    else:
        out_rows = [lay.new_rows(b.shape[1], dtype=out_dtype) for b in bs]
        if return_scale:
            out_rows.append(lay.new_rows(1, dtype=scale_2d.dtype))  # the scale rows, in the outputs' order

        def consume(src: int, lo: int, blocks: list[torch.Tensor]) -> None:
            a_block = blocks[0].view(lay.shard_2d.dtype)
            # one run of output rows, or one per leading index (batch-major)
            for off, row, count in lay.out_runs(src, lo, a_block.shape[0]):
                s_run = block_scale(blocks, off, count)
                for out, b, b_scale, bias in zip(out_rows, bs, b_fixed, biases):
                    scaled_mm(a_block[off : off + count], b, s_run, b_scale, out_dtype, bias=bias,
                              use_fast_accum=use_fast_accum, out=out[row : row + count])
                if return_scale:
                    out_rows[-1][row : row + count].copy_(blocks[1][off : off + count])

        transport.gather(shards, gathered, consume, alternate=True, lockstep=True, runs=lay.gathered_runs)
        outs = [lay.restore(o) for o in out_rows]
    return (lay.a_gathered(rows, placed=True) if return_a else None), outs
