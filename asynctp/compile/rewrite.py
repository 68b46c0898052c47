"""The graph rewrite: all-gather -> matmuls becomes asynctp.all_gather_matmul, matmul ->
reduce-scatter becomes asynctp.matmul_reduce_scatter, and every collective gets a record.

A gather is fused with every matmul that takes the gathered tensor as A (several: QKV, w1 + w3);
other users of the gathered tensor (a transposed copy for the weight gradient, a value saved for
backward) read the op's returned a_gathered. A reduce-scatter is fused with the matmul producing
its input when nothing else reads that product, or with the matmuls whose products are summed
(sibling input gradients) or regrouped by row ops (transpose / clone / reshape) into its input
(partials.py). A group without a symmetric workspace is still fused (the ops then overlap over
a send/recv ring) and its record says so. New nodes get fake values (meta["val"]) from the ops'
fake implementations, and the graph is re-sorted so every node follows its inputs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

import asynctp.ops.all_gather_scaled_matmul  # noqa: F401 - registers torch.ops.asynctp.all_gather_scaled_matmul
import asynctp.ops.scaled_matmul_reduce_scatter  # noqa: F401 - registers its op too
from asynctp.compile import partials
from asynctp.compile import patterns as pt
from asynctp.compile.report import CollectiveRecord

__all__ = ["rewrite_graph", "graph_kind"]

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
AG_OP = "asynctp.all_gather_matmul"
RS_OP = "asynctp.matmul_reduce_scatter"
AG_SCALED_OP = "asynctp.all_gather_scaled_matmul"
RS_SCALED_OP = "asynctp.scaled_matmul_reduce_scatter"
NO_SCALED_OP = "asynctp has no fused scaled op in this version"
HP_GATHER_CAST = (
    "cast to float8 after a high-precision gather, then fed to _scaled_mm (torchao's Float8Linear under "
    "plain ColwiseParallel); asynctp fuses float8 gathers (torchao's Float8ColwiseParallel, tensorwise)"
)
# without a workspace the ops still overlap, over a send/recv ring: fusing never hurts
RING_NOTE = "the op overlaps over the send/recv ring where that pays, else runs serially"


def graph_kind(graph: fx.Graph) -> str:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(name.startswith("tangents") for name in names):
        return "backward"
    if names and all(name.startswith("primals") for name in names):
        return "forward"
    return "inference"


def workspace_problem(group_name: str, device: torch.device | None) -> str | None:
    """Why calls on this group would run the serial fallback (known without communicating)."""
    from asynctp.symm import resolve_group, unavailable_reason

    try:
        group = resolve_group(group_name)
    except ValueError:
        return f"group {group_name!r} is not a process group of this process"
    device_type = device.type if device is not None else "cpu"
    reason = unavailable_reason(group, device_type)
    return f"group has no symmetric workspace ({reason})" if reason else None


def _ring_note(group_name: str, val: torch.Tensor | None) -> str | None:
    problem = workspace_problem(group_name, val.device if val is not None else None)
    return f"{problem}: {RING_NOTE}" if problem else None


def _scaled_op(name: str) -> Any | None:
    """torch.ops.asynctp.<name> (registered by the imports above), or None if it has none."""
    return getattr(torch.ops.asynctp, name, None)


class _Rewriter:
    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.erased: set[fx.Node] = set()
        self.cursor: fx.Node | None = None
        self.mutated = False
        self.gathers: dict[fx.Node, pt.Gather] = {}  # by result node
        self.absorbed: dict[fx.Node, str] = {}  # rowwise-scale gathers folded into a fused op
        vals = [n.meta.get("val") for n in graph.nodes]
        from torch._guards import detect_fake_mode

        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])

    # -- new nodes carry fake values, so later passes (and later matches here) see shapes
    def call(self, target: Any, args: tuple, before: fx.Node | None = None) -> fx.Node:
        """A new node before `before`, or (None) right after the previous new node: insertion
        points are always live nodes, even while pattern nodes are being erased."""
        where = self.graph.inserting_before(before) if before is not None else self.graph.inserting_after(self.cursor)
        with where:
            node = self.graph.call_function(target, args)
        self.mutated = True
        node.meta["val"] = self._fake_value(target, args)
        self.cursor = node
        return node

    def guarded(self, kind: str, node: fx.Node, rewrite: Any, item: Any) -> CollectiveRecord:
        """rewrite(item), or an unfused record when matching fails on an unforeseen graph form;
        an error after the graph was edited cannot be undone and propagates."""
        self.mutated = False
        try:
            return rewrite(item)
        except Exception as exc:  # noqa: BLE001 - the report must say why, not crash the compile
            if self.mutated:
                raise
            reason = pt.unforeseen(exc)
            return CollectiveRecord(kind=kind, node=node.name, dim=None, shape=None,
                                    group_name=str(node.args[-1]), fused=False, reason=reason)

    def _fake_value(self, target: Any, args: tuple) -> Any:
        def val(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return a.meta.get("val")
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        values = val(args)
        if target is operator.getitem:
            return values[0][values[1]]
        if self.fake_mode is None:
            return None
        with self.fake_mode:
            return target(*values)

    def reshape(self, node: fx.Node, shape: Any) -> fx.Node:
        return self.call(aten.reshape.default, (node, list(shape)))

    def erase_unused(self, nodes: list[fx.Node]) -> None:
        for node in reversed(nodes):
            if node.op == "call_function" and node not in self.erased and not node.users:
                self.graph.erase_node(node)
                self.erased.add(node)

    # -- all-gather -> matmuls
    def gather(self, g: pt.Gather) -> CollectiveRecord:
        shard = pt.tensor_of(g.shard)
        record = dict(kind="all-gather", node=g.ag.name, dim=g.gather_dim, group_name=g.group_name,
                      shape=tuple(shard.shape) if shard is not None else None)
        if g.problem:
            return CollectiveRecord(fused=False, reason=g.problem, **record)
        matmuls, notes = pt.consumer_matmuls(g.result)
        if not matmuls:
            reason = notes[0] if notes else "gather feeds no matmul"
            if _is_scale_gather(g):
                reason = "it gathers the rowwise A scale of a scaled matmul whose A gather was not fused"
            elif not notes and pt.reaches_scaled_mm_a(g.result):
                reason = HP_GATHER_CAST
            users = ", ".join(sorted(u.name for u in g.result.users))
            hint = pt.embedding_hint(g.result, upward=False) if not notes else ""
            return CollectiveRecord(fused=False, reason=f"{reason} (users: {users}){hint}", tp=not notes, **record)
        problem = self._gather_problem(g, matmuls)
        if problem:
            return CollectiveRecord(fused=False, reason=problem, num_matmuls=len(matmuls), **record)
        kept = [m for m in matmuls if not m.problem and g.result not in _arg_ancestors(m)]
        left_out = [m for m in matmuls if m not in kept]
        if not kept:
            m = left_out[0]
            reason = m.problem or "B depends on the gathered A"
            return CollectiveRecord(fused=False, reason=f"{reason} ({m.mm.name})", num_matmuls=len(matmuls), **record)
        if any(m.scaled for m in kept):
            op = _scaled_op("all_gather_scaled_matmul")
            if op is None:
                return CollectiveRecord(fused=False, reason=NO_SCALED_OP, num_matmuls=len(kept), **record)
            from asynctp.compile.scaled import fuse_scaled_gather

            reason, scale_gather = fuse_scaled_gather(self, g, kept, op, self.gathers)
            if reason:
                return CollectiveRecord(fused=False, reason=reason, num_matmuls=len(kept), **record)
            if scale_gather is not None:
                self.absorbed[scale_gather.ag] = g.ag.name
            note = _ring_note(g.group_name, pt.tensor_of(g.result))
            return CollectiveRecord(fused=True, op=AG_SCALED_OP, num_matmuls=len(kept), reason=note, **record)
        problem = self._fuse_gather(g, kept)
        if problem:
            return CollectiveRecord(fused=False, reason=problem, num_matmuls=len(kept), **record)
        notes = [_ring_note(g.group_name, pt.tensor_of(g.result))]
        if left_out:
            notes.append(f"{len(left_out)} matmul(s) left outside: {left_out[0].problem or 'B depends on the gathered A'}")
        note = "; ".join(n for n in notes if n) or None
        return CollectiveRecord(fused=True, op=AG_OP, num_matmuls=len(kept), reason=note, **record)

    def _gather_problem(self, g: pt.Gather, matmuls: list[pt.Matmul]) -> str | None:
        result = pt.tensor_of(g.result)
        if result is None:
            return "the graph carries no shapes (meta['val']) for the gathered tensor"
        if any(m.scaled for m in matmuls) != all(m.scaled for m in matmuls):
            return "the gathered tensor feeds both scaled (fp8) and plain matmuls"
        if not matmuls[0].scaled and result.dtype not in _FLOATS:
            return f"the gathered dtype {result.dtype} is not a float asynctp multiplies"
        return None

    def _fuse_gather(self, g: pt.Gather, matmuls: list[pt.Matmul]) -> str | None:
        """Fuse; returns why not (the op's own checks), or None."""
        args = (g.shard, [m.b for m in matmuls], g.gather_dim, g.group_name, True, [m.bias for m in matmuls], "auto")
        problem = self.rejects(torch.ops.asynctp.all_gather_matmul.default, args)
        if problem:
            return problem
        first = self.earliest([m.pre or m.mm for m in matmuls])
        fused = self.call(torch.ops.asynctp.all_gather_matmul.default, args, first)
        outs = self.call(operator.getitem, (fused, 1))
        for i, m in enumerate(matmuls):
            self.replace_product(m, self.call(operator.getitem, (outs, i)))
        self.finish_gather(g, fused)
        return None

    def replace_product(self, m: pt.Matmul, out: fx.Node) -> None:
        for post in m.post:
            post.replace_all_uses_with(out)
        if [u for u in m.mm.users if u not in m.post]:
            m.mm.replace_all_uses_with(self.reshape(out, pt.tensor_of(m.mm).shape))
        _views_to_reshapes(out)
        self.erase_unused(([m.pre] if m.pre is not None else []) + [m.mm] + m.post)

    def finish_gather(self, g: pt.Gather, fused: fx.Node) -> None:
        if g.result.users:  # a transposed copy for the weight gradient, a value saved for backward
            a_gathered = self.call(operator.getitem, (fused, 0))
            g.result.replace_all_uses_with(a_gathered)
            _views_to_reshapes(a_gathered)
        else:
            names = [a.name for a in fused.target._schema.arguments]
            fused.update_arg(names.index("return_a"), False)
            fused.meta["val"] = self._fake_value(fused.target, fused.args)
        self.erase_unused(g.nodes)
        assert g.ag in self.erased, f"{g.ag.name} is still read after its fusion (it would run twice)"

    def rejects(self, target: Any, args: tuple) -> str | None:
        """Why the op's own checks (its fake implementation) refuse these arguments, if they do."""
        try:
            self._fake_value(target, args)
        except (TypeError, ValueError, RuntimeError) as exc:
            return f"{target} refuses the matched arguments: {exc}"
        return None

    def earliest(self, nodes: list[fx.Node]) -> fx.Node:
        return min(nodes, key=_order(self.graph))

    # -- matmul -> reduce-scatter
    def reduce_scatter(self, r: pt.ReduceScatter) -> CollectiveRecord:
        val = pt.tensor_of(r.input)
        record = dict(kind="reduce-scatter", node=r.rs.name, dim=r.scatter_dim, group_name=r.group_name,
                      shape=tuple(val.shape) if val is not None else None)
        if r.problem:
            return CollectiveRecord(fused=False, reason=r.problem, **record)
        if not isinstance(r.input, fx.Node):
            return CollectiveRecord(fused=False, reason="the reduce-scatter input is not a graph value", **record)
        m, why = pt.producer_matmul(r.input)
        if m is None:
            return self._reduce_scatter_partial(r, why, record)
        problem = self._rs_problem(r, m)
        if problem:
            return CollectiveRecord(fused=False, reason=problem, num_matmuls=1, **record)
        if m.scaled:
            op = _scaled_op("scaled_matmul_reduce_scatter")
            if op is None:
                return CollectiveRecord(fused=False, reason=NO_SCALED_OP, num_matmuls=1, **record)
            from asynctp.compile.scaled import fuse_scaled_reduce_scatter

            reason = fuse_scaled_reduce_scatter(self, r, m, op)
            if reason:
                return CollectiveRecord(fused=False, reason=reason, num_matmuls=1, **record)
            return CollectiveRecord(fused=True, op=RS_SCALED_OP, num_matmuls=1,
                                    reason=_ring_note(r.group_name, val), **record)
        a = self.matmul_a(m, r.wait)
        args = (a, m.b, r.scatter_dim, r.group_name, r.reduce_op, None, "auto")
        problem = self.rejects(torch.ops.asynctp.matmul_reduce_scatter.default, args)
        if problem:
            self.erase_unused([a] if a is not m.a else [])
            return CollectiveRecord(fused=False, reason=problem, num_matmuls=1, **record)
        fused = self.call(torch.ops.asynctp.matmul_reduce_scatter.default, args, r.wait)
        self.finish_reduce_scatter(r, m, fused)
        return CollectiveRecord(fused=True, op=RS_OP, num_matmuls=1, reason=_ring_note(r.group_name, val), **record)

    def _reduce_scatter_partial(self, r: pt.ReduceScatter, why: str | None, record: dict) -> CollectiveRecord:
        """The input is a sum of matmul products and/or row ops after one (see partials.py)."""
        between: list[fx.Node] = []
        terms, deeper = partials.match_terms(r.input, between)
        if terms is None:
            reason = deeper if r.input.target in partials.FOLDED else why
            return CollectiveRecord(fused=False, reason=f"reduce-scatter input is not a matmul: {reason}"
                                    f"{pt.embedding_hint(r.input)}", **record)
        problem = partials.terms_problem(terms)
        if problem is None and r.reduce_op not in ("sum", "avg"):
            problem = f"reduce op {r.reduce_op!r} (asynctp fuses sum and avg)"
        problem = problem or partials.fuse_terms(self, r, terms, between)
        if problem:
            return CollectiveRecord(fused=False, reason=problem, num_matmuls=len(terms), **record)
        note = _ring_note(r.group_name, pt.tensor_of(r.input))
        return CollectiveRecord(fused=True, op=RS_OP, num_matmuls=len(terms), reason=note, **record)

    def _rs_problem(self, r: pt.ReduceScatter, m: pt.Matmul) -> str | None:
        if m.problem:
            return m.problem
        if m.bias is not None and not m.scaled:
            return "the matmul adds a bias before the reduction (it would be summed over ranks)"
        producers = [m.mm] + ([r.input] if r.input is not m.mm else [])
        for node in producers:
            users = [u for u in node.users if u not in r.nodes and u is not r.input]
            if users:
                others = ", ".join(u.name for u in users)
                return f"matmul output has {len(users) + 1} users ({others} besides the reduce-scatter)"
        if r.reduce_op not in ("sum", "avg"):
            return f"reduce op {r.reduce_op!r} (asynctp fuses sum and avg)"
        a = pt.tensor_of(m.a)
        if a is None:
            return "the graph carries no shapes (meta['val']) for the matmul input"
        if a.dtype not in _FLOATS and not m.scaled:
            return f"the matmul dtype {a.dtype} is not a float asynctp multiplies"
        return None

    def matmul_a(self, m: pt.Matmul, before: fx.Node) -> fx.Node:
        """The matmul's A in the N-D shape the op scatters (a 2-D A is reshaped to the product's
        leading dims: the same rows in the same order)."""
        if m.a_shape is None:
            return m.a
        return self.call(aten.reshape.default, (m.a, list(m.a_shape)), before)

    def finish_reduce_scatter(self, r: pt.ReduceScatter, m: pt.Matmul, fused: fx.Node) -> None:
        # the un-waited collective may be saved for backward too: it holds the same values
        r.wait.replace_all_uses_with(fused)
        r.rs.replace_all_uses_with(fused)
        chain = [n for n in ([m.pre] if m.pre is not None else []) + [m.mm] + m.post if n not in r.nodes]
        self.erase_unused(chain + r.nodes)


def _views_to_reshapes(node: fx.Node) -> None:
    """The fused ops return views with the gather dim moved back (not always contiguous): a
    strict aten.view on them may fail where aten.reshape copies."""
    for user in node.users:
        if user.target is aten.view.default:
            user.target = aten.reshape.default


def _arg_ancestors(m: pt.Matmul) -> set[fx.Node]:
    found: set[fx.Node] = set()
    for node in m.arg_nodes():
        found |= pt.ancestors(node)
    return found


def _order(graph: fx.Graph) -> Any:
    index = {node: i for i, node in enumerate(graph.nodes)}
    return lambda node: index[node]


def _is_scale_gather(g: pt.Gather) -> bool:
    """Its result only feeds _scaled_mm's A scale (possibly through a reshape)."""
    users = [u for r in g.result.users for u in ([r] if r.target not in pt.RESHAPES else list(r.users))]
    return bool(users) and all(u.target is aten._scaled_mm.default and u.args[2] in (g.result, *g.result.users)
                               for u in users)


def rewrite_graph(graph: fx.Graph) -> list[CollectiveRecord]:
    """Fuse what can be fused in `graph` (in place); one record per collective, in graph order."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    rewriter = _Rewriter(graph)
    gathers = pt.find_gathers(graph)
    rewriter.gathers = {g.result: g for g in gathers}
    # rowwise-scale gathers last: the gather of their A may fold them in
    order = sorted(range(len(gathers)), key=lambda i: _is_scale_gather(gathers[i]))
    found: dict[int, CollectiveRecord] = {}
    for i in order:
        g = gathers[i]
        if g.ag in rewriter.absorbed:
            found[i] = CollectiveRecord(
                kind="all-gather", node=g.ag.name, dim=g.gather_dim, group_name=g.group_name,
                shape=tuple(pt.tensor_of(g.shard).shape) if pt.tensor_of(g.shard) is not None else None,
                fused=True, op=AG_SCALED_OP,
                reason=f"the rowwise A scale, gathered with A by {rewriter.absorbed[g.ag]}",
            )
        else:
            found[i] = rewriter.guarded("all-gather", g.ag, rewriter.gather, g)
    records = [found[i] for i in range(len(gathers))]
    scatters = pt.find_reduce_scatters(graph)
    rewriter.mutated = False
    try:  # sums of reduce-scatters become one reduce-scatter of the summed partials first
        scatters, merged = partials.merge_summed(rewriter, scatters)
    except Exception:  # noqa: BLE001 - an unforeseen form is left as it is, unless it was edited
        if rewriter.mutated:
            raise
        merged = {}
    left = {r.rs: rewriter.guarded("reduce-scatter", r.rs, rewriter.reduce_scatter, r) for r in scatters}
    records += [*left.values(), *partials.merged_records(merged, left)]
    if merged or any(r.fused for r in records):
        stable_topological_sort(graph)
        graph.lint()
    return records
