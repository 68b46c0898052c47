"""A reduce-scatter's partial built from matmuls: a sum of sibling products and row ops between
the products and the collective, folded into one asynctp.matmul_reduce_scatter.

Forms (P_i = A_i @ B_i, each read by nothing else):

    sum of siblings:  add(P_q, add(P_k, P_v)) -> reduce-scatter   (the input gradient of wq / wk / wv,
                      or of w1 / w3, when they share one gather: vanilla TP sums the partials first)
    row ops:          P -> transpose / permute / clone / reshape -> reduce-scatter   (a sequence-major
                      layout such as torchtitan 0.3's: [B, S, N] -> [S, B, N] -> scattered on S)
    summed collectives: add(RS(P_q), RS(P_k)) -> RS(add(P_q, P_k)) first (merge_summed), then the
                      sum of siblings: a plan with one ColwiseParallel per linear (torch's styles)
                      gathers once for wq / wk / wv under compile but reduce-scatters each input
                      gradient in the backward and sums the shards; merged, one collective carries
                      what three did. The reduction is linear (sum, avg), so the result is the same
                      up to rounding: the products are summed in fp32 inside one GEMM instead of
                      rounded per collective and added after.

Why this is exact: every op kept here moves or regroups whole rows and leaves the last dim alone,
so applying it to A instead of P gives the same product (row i of op(A) @ B is row i of op(P));
a sum of products is one product of the A's concatenated along K with the B's stacked along K
(matmul_sum_reduce_scatter's identity; under compile inductor fuses the concatenations into
their producers). The fused op then scatters the product directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from asynctp.compile import patterns as pt
from asynctp.compile.report import CollectiveRecord

__all__ = ["Term", "match_terms", "terms_problem", "fuse_terms", "merge_summed", "merged_records", "ROW_OPS", "FOLDED"]

aten = torch.ops.aten
# ops that regroup rows and keep the last dim: they commute with a matmul's B
ROW_OPS = (aten.transpose.int, aten.permute.default, aten.clone.default, *pt.RESHAPES)
FOLDED = (aten.add.Tensor, *ROW_OPS)  # a partial through these is analysed term by term
MAX_DEPTH = 32  # a deeper chain is not a TP layer's partial


@dataclass
class Term:
    """One product of the sum: m.a (N-D) @ m.b, then `chain` (row ops, innermost first)."""

    m: pt.Matmul
    chain: list[fx.Node] = field(default_factory=list)


def _same_shape(node: Any, other: fx.Node) -> bool:
    a, b = pt.tensor_of(node), pt.tensor_of(other)
    return a is not None and b is not None and tuple(a.shape) == tuple(b.shape)


def _row_op_problem(node: fx.Node) -> str | None:
    """Why `node` (one of ROW_OPS) is not a pure regrouping of whole rows, or None."""
    src, out = pt.tensor_of(node.args[0]), pt.tensor_of(node)
    if src is None or out is None:
        return "the graph carries no shapes (meta['val']) for the partial"
    last = src.ndim - 1
    if node.target is aten.transpose.int:
        if {d % src.ndim for d in node.args[1:3]} & {last}:
            return f"{node.name} transposes the matmul's output features (the last dim)"
    elif node.target is aten.permute.default:
        if [d % src.ndim for d in node.args[1]][-1] != last:
            return f"{node.name} moves the matmul's output features (the last dim)"
    elif node.target in pt.RESHAPES:
        if out.ndim < 1 or src.ndim < 1 or out.shape[-1] != src.shape[-1]:
            return f"{node.name} reshapes the matmul's output features (the last dim)"
    return None


def _adds(node: Any) -> bool:
    """node is a plain sum of two tensors (no alpha)."""
    return (isinstance(node, fx.Node) and node.target is aten.add.Tensor and len(node.args) == 2
            and node.kwargs.get("alpha", 1) == 1)


def match_terms(node: fx.Node, between: list[fx.Node], depth: int = 0) -> tuple[list[Term] | None, str]:
    """The matmul products that sum to `node` through adds and row ops, or (None, why not).
    between: collects the adds met on the way (erased with the products)."""
    if depth > MAX_DEPTH:
        return None, "the partial is too deep a chain of adds and row ops"
    m, why = pt.producer_matmul(node)
    if m is not None:
        return [Term(m)], ""
    if _adds(node):
        terms: list[Term] = []
        for part in node.args:
            if not isinstance(part, fx.Node) or not _same_shape(part, node):
                return None, f"{node.name} adds a broadcast or a scalar (not a sum of sibling partials)"
            if len(part.users) != 1:
                return None, f"{part.name}, a term of the summed partial, is read elsewhere too"
            found, why = match_terms(part, between, depth + 1)
            if found is None:
                return None, why
            terms += found
        between.append(node)
        return terms, ""
    if node.target in ROW_OPS and isinstance(node.args[0], fx.Node):
        problem = _row_op_problem(node)
        if problem:
            return None, problem
        src = node.args[0]
        if len(src.users) != 1:
            return None, f"{src.name}, before {node.name}, is read elsewhere too"
        found, why = match_terms(src, between, depth + 1)
        if found is None:
            return None, why
        for term in found:
            term.chain.append(node)
        return found, ""
    return None, why


def _a_through(rw: Any, term: Term, before: fx.Node) -> fx.Node:
    """The term's A with its chain applied (reshapes keep A's last dim, K)."""
    a = rw.matmul_a(term.m, before)
    for op in term.chain:
        if op.target is aten.clone.default:
            continue  # the op reads A in any layout
        if op.target in pt.RESHAPES:
            out = pt.tensor_of(op)
            a = rw.call(aten.reshape.default, (a, [*out.shape[:-1], pt.tensor_of(a).shape[-1]]), before)
        else:
            a = rw.call(op.target, (a, *op.args[1:]), before)
    return a


def terms_problem(terms: list[Term]) -> str | None:
    """Why these products cannot become one matmul_reduce_scatter, or None."""
    for term in terms:
        m = term.m
        if m.problem:
            return m.problem
        if m.scaled:
            return "a scaled (fp8) matmul behind a sum or row ops before the reduction (asynctp fuses it only directly)"
        if m.bias is not None:
            return "the matmul adds a bias before the reduction (it would be summed over ranks)"
        if len([u for u in m.mm.users if u not in m.post]) > (0 if m.post else 1) or any(len(p.users) > 1 for p in m.post):
            return f"matmul output {m.mm.name} is read besides the reduction"
    a_vals = [pt.tensor_of(t.m.a) for t in terms]
    if any(a is None for a in a_vals):
        return "the graph carries no shapes (meta['val']) for a matmul input"
    if len({a.dtype for a in a_vals}) != 1:
        return f"the summed matmuls differ in dtype ({sorted({str(a.dtype) for a in a_vals})})"
    return None


def fuse_terms(rw: Any, r: pt.ReduceScatter, terms: list[Term], between: list[fx.Node]) -> str | None:
    """Replace the reduce-scatter (and the products it sums) by one matmul_reduce_scatter; returns
    why not (the op's own checks), or None."""
    target = torch.ops.asynctp.matmul_reduce_scatter.default
    existing = set(rw.graph.nodes)
    a_list = [_a_through(rw, t, r.wait) for t in terms]
    b_list = [t.m.b for t in terms]
    a = a_list[0] if len(a_list) == 1 else rw.call(aten.cat.default, (a_list, -1), r.wait)
    b = b_list[0] if len(b_list) == 1 else rw.call(aten.cat.default, (b_list, 0), r.wait)
    args = (a, b, r.scatter_dim, r.group_name, r.reduce_op, None, "auto")
    problem = rw.rejects(target, args)
    if problem:
        rw.erase_unused([node for node in rw.graph.nodes if node not in existing])
        return problem
    fused = rw.call(target, args, r.wait)
    r.wait.replace_all_uses_with(fused)
    r.rs.replace_all_uses_with(fused)
    replaced = set(between)
    for t in terms:
        replaced |= {*([t.m.pre] if t.m.pre is not None else []), t.m.mm, *t.m.post, *t.chain}
    rw.erase_unused(r.nodes)
    # graph order: erase_unused walks it backwards, so a node's users go before it
    index = {node: i for i, node in enumerate(rw.graph.nodes)}
    rw.erase_unused(sorted(replaced, key=index.__getitem__))
    return None


def _summed_pair(node: fx.Node, by_wait: dict[fx.Node, pt.ReduceScatter]) -> tuple[Any, Any, Any, Any] | None:
    """(first, second, inner, rest): two reduce-scatters whose results `node` adds: add(RS_a, RS_b)
    (inner and rest None), or add(inner, RS_b) with inner = add(rest, RS_a), in either order of
    arguments (a gradient summed into a running sum, as autograd does); where merging them is
    sound and the merged partial is a sum of products the fused op takes."""
    if not _adds(node):
        return None
    inner = rest = None
    first, second = (by_wait.get(arg) if isinstance(arg, fx.Node) else None for arg in node.args)
    if (first is None) != (second is None):  # one side a running sum that ends in a reduce-scatter
        inner = node.args[0] if first is None else node.args[1]
        if not _adds(inner) or len(inner.users) != 1:
            return None
        for i, arg in enumerate(inner.args):
            if isinstance(arg, fx.Node) and arg in by_wait:
                rest = inner.args[1 - i]
                first, second = (by_wait[arg], second) if first is None else (first, by_wait[arg])
                break
    if first is None or second is None or first is second:
        return None
    vals = [pt.tensor_of(r.input) for r in (first, second)]
    if vals[0] is None or vals[1] is None or (vals[0].shape, vals[0].dtype) != (vals[1].shape, vals[1].dtype):
        return None
    a, b = first, second
    if (a.group_name, a.reduce_op, a.scatter_dim) != (b.group_name, b.reduce_op, b.scatter_dim):
        return None
    if a.reduce_op not in ("sum", "avg"):  # linear reductions only
        return None
    if any(len(r.wait.users) != 1 or set(r.rs.users) != {r.wait} for r in (a, b)):
        return None
    # merged only where the sum then fuses: scaled (fp8) products fuse one by one, not summed
    terms = [match_terms(r.input, [])[0] for r in (a, b)]
    if terms[0] is None or terms[1] is None or terms_problem(terms[0] + terms[1]) is not None:
        return None
    return a, b, inner, rest


def merge_summed(rw: Any, scatters: list[pt.ReduceScatter]) -> tuple[list[pt.ReduceScatter], dict[fx.Node, Any]]:
    """Fold each add of two reduce-scatters' results into one reduce-scatter of the added partials
    (see the module's docstring): (the reduce-scatters left, {the collective node of each one
    merged away: (the one it now sums into, itself)}). The later collective is kept, reading the
    sum; a running sum add(add(rest, RS_a), RS_b) becomes add(rest, RS(a + b))."""
    by_wait = {r.wait: r for r in scatters if not r.problem and r.wait is not None and isinstance(r.input, fx.Node)}
    merged: dict[fx.Node, Any] = {}
    changed = True
    while changed:
        changed = False
        order = {node: i for i, node in enumerate(rw.graph.nodes)}
        for node in list(rw.graph.nodes):
            pair = _summed_pair(node, by_wait)
            if pair is None:
                continue
            first, second, inner, rest = pair
            keep, gone = (first, second) if order[first.rs] > order[second.rs] else (second, first)
            start = min(keep.nodes, key=order.__getitem__)
            if order[gone.input] >= order[start]:
                continue  # (the graph's order would not allow the sum there)
            total = rw.call(aten.add.Tensor, (first.input, second.input), start)
            for user in keep.nodes:
                user.replace_input_with(keep.input, total)
            keep.input = total
            if inner is None:
                node.replace_all_uses_with(keep.wait)
                rw.graph.erase_node(node)
            else:
                node.args = (rest, keep.wait)
                rw.graph.erase_node(inner)
            rw.erase_unused(sorted(gone.nodes, key=order.__getitem__))
            del by_wait[gone.wait]
            merged[gone.rs] = (keep, gone)
            changed = True
            break
    return [r for r in scatters if r.rs not in merged], merged


def merged_records(merged: dict[fx.Node, Any], records: dict[fx.Node, CollectiveRecord]) -> list[CollectiveRecord]:
    """A record per reduce-scatter merge_summed folded away, fused as the one it sums into is
    (records: by collective node, of the reduce-scatters left)."""
    out = []
    for rs, (keep, gone) in merged.items():
        while keep.rs in merged:
            keep = merged[keep.rs][0]
        into = records[keep.rs]
        val = pt.tensor_of(gone.input)
        why = f"summed with {keep.rs.name}'s partial before one reduce-scatter"
        out.append(CollectiveRecord(
            kind="reduce-scatter", node=rs.name, dim=gone.scatter_dim, group_name=gone.group_name,
            shape=tuple(val.shape) if val is not None else None, fused=into.fused, op=into.op,
            reason=why if into.fused else f"{why}, which was not fused: {into.reason}"))
    return out
