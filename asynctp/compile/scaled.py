"""The fp8 rewrites: all-gather -> _scaled_mm becomes asynctp.all_gather_scaled_matmul, and
_scaled_mm -> reduce-scatter becomes asynctp.scaled_matmul_reduce_scatter.

Scales (torch._scaled_mm's dequantization multipliers): a tensorwise A scale (numel 1) passes
through. A rowwise A scale of the gathered A ([M, 1]) must itself be an all-gather of the
shards' scales along the same dim: the op then gathers the shard scale with its rows, and that
second gather is folded into the op too. A fp8 gather may be "type-erased" (sent as uint8 and
viewed back as float8): the op receives the float8 shard.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from asynctp.compile import patterns as pt

__all__ = ["fuse_scaled_gather", "fuse_scaled_reduce_scatter", "scale_gather_of"]

aten = torch.ops.aten


def scale_gather_of(node: Any, gathers: dict[fx.Node, pt.Gather]) -> pt.Gather | None:
    """The gather whose result (possibly flattened to [M, 1]) is `node`, if any."""
    if not isinstance(node, fx.Node):
        return None
    if node.target in pt.RESHAPES and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return gathers.get(node)


def _float8_shard(rw: Any, g: pt.Gather) -> fx.Node:
    """The shard as float8 (a type-erased gather sends a uint8 view of it)."""
    shard = g.shard
    if g.erased_dtype is None:
        return shard
    if shard.target is aten.view.dtype and pt.tensor_of(shard.args[0]) is not None:
        if pt.tensor_of(shard.args[0]).dtype == g.erased_dtype:
            return shard.args[0]
    return rw.call(aten.view.dtype, (shard, g.erased_dtype), g.ag)


def _common(matmuls: list[pt.Matmul], attr: str) -> tuple[bool, Any]:
    values = {getattr(m, attr) for m in matmuls}
    return len(values) == 1, next(iter(values))


def fuse_scaled_gather(rw: Any, g: pt.Gather, matmuls: list[pt.Matmul], op: Any,
                       gathers: dict[fx.Node, pt.Gather]) -> tuple[str | None, pt.Gather | None]:
    """Fuse; returns (why not, or None) and the rowwise-scale gather folded in (if any)."""
    for attr, what in (("scale_a", "A scale"), ("out_dtype", "out_dtype"), ("use_fast_accum", "use_fast_accum")):
        same, _ = _common(matmuls, attr)
        if not same:
            return f"the scaled matmuls on this gather differ in {what}", None
    scale_a = matmuls[0].scale_a
    scale_val = pt.tensor_of(scale_a)
    result = pt.tensor_of(g.result)
    if scale_val is None or result is None:
        return "the graph carries no shapes (meta['val']) for the scales", None
    scale_gather = None
    if scale_val.numel() != 1 or scale_val.ndim == 2 and scale_val.shape[0] != 1:
        scale_gather = scale_gather_of(scale_a, gathers)
        if scale_gather is None or scale_gather.problem or scale_gather.group_name != g.group_name:
            return "the rowwise A scale is not an all-gather of the shards' scales", None
        if scale_gather.gather_dim != g.gather_dim or g.gather_dim == result.ndim - 1:
            return "the rowwise A scale is gathered along another dim than A", None
        a_scale = scale_gather.shard
    else:
        a_scale = scale_a
    shard = _float8_shard(rw, g)
    biases = [m.bias for m in matmuls]
    out_dtype = matmuls[0].out_dtype or torch.bfloat16
    args = (shard, [m.b for m in matmuls], a_scale, [m.scale_b for m in matmuls], g.gather_dim, g.group_name,
            out_dtype, biases, matmuls[0].use_fast_accum, True, "auto")
    problem = rw.rejects(op.default, args)
    if problem:
        rw.erase_unused([shard] if shard is not g.shard else [])
        return problem, None
    first = rw.earliest([m.pre or m.mm for m in matmuls])
    fused = rw.call(op.default, args, first)
    outs = rw.call(operator.getitem, (fused, 1))
    for i, m in enumerate(matmuls):
        rw.replace_product(m, rw.call(operator.getitem, (outs, i)))
    rw.finish_gather(g, fused)
    rw.erase_unused([g.shard])  # the uint8 view of a type-erased gather
    if scale_gather is None:
        return None, None
    rw.erase_unused([scale_a] if scale_a is not scale_gather.result else [])
    rw.erase_unused(scale_gather.nodes)
    # a scale still read elsewhere keeps its own gather
    return None, scale_gather if scale_gather.ag in rw.erased else None


def fuse_scaled_reduce_scatter(rw: Any, r: pt.ReduceScatter, m: pt.Matmul, op: Any) -> str | None:
    """Fuse; returns why not, or None."""
    if m.bias is not None:
        return "the scaled matmul adds a bias before the reduction (it would be summed over ranks)"
    a, scale = pt.tensor_of(m.a), pt.tensor_of(m.scale_a)
    if a is None or scale is None:
        return "the graph carries no shapes (meta['val']) for the scales"
    a_node = rw.matmul_a(m, r.wait)
    a_shape = m.a_shape or tuple(a.shape)
    a_scale = m.scale_a
    if scale.numel() != 1 or (scale.ndim == 2 and scale.shape[0] == a_shape[0] and len(a_shape) == 2):
        # rowwise [M, 1] for the flattened A: the op wants a.shape[:-1] + (1,)
        want = (*a_shape[:-1], 1)
        if tuple(scale.shape) != want:
            a_scale = rw.call(aten.reshape.default, (m.scale_a, list(want)), r.wait)
    out_dtype = m.out_dtype or torch.bfloat16
    args = (a_node, m.b, a_scale, m.scale_b, r.scatter_dim, r.group_name, out_dtype, None, r.reduce_op,
            m.use_fast_accum, "auto")
    problem = rw.rejects(op.default, args)
    if problem:
        rw.erase_unused([n for n in (a_scale, a_node) if n not in (m.scale_a, m.a)])
        return problem
    fused = rw.call(op.default, args, r.wait)
    rw.finish_reduce_scatter(r, m, fused)
    return None
