"""Where the TP collectives and their matmuls are in a post-grad FX graph: matching only, no edits.

Forms recognized (R = group size, as the functional collectives and DTensor emit them):

    gather dim 0:   shard -> all_gather_into_tensor -> wait_tensor
    gather dim d>0: ... -> wait_tensor -> split(s, 0) -> getitem x R (or slice x R) -> cat(dim=d)
    gather dim d>0, every shard dim before d of size 1 (batch 1 sequence parallel): ... -> wait_tensor
                    -> view / reshape to the gathered shape (funcol's view instead of split + cat)
    fp8 type-erased: the above on a uint8 view of the shard, then view(float8) (per chunk or once)
    scatter dim 0:  x -> reduce_scatter_tensor -> wait_tensor
    scatter dim d>0: x -> split(s, d) -> getitem x R (or slice x R) -> cat(dim=0) -> reduce_scatter ...
    matmul:         mm / addmm / _scaled_mm on a 2-D A, or reshape(A, [-1, K]) -> mm -> reshape(back)
    matmul(s) -> reduce-scatter through adds of sibling products and row ops: partials.py
    matmul -> reduce-scatter, A built in 2-D (torchao's Float8Linear casts a gradient to float8
                    after flattening it): mm -> reshape to N-D; the rewrite reshapes A to match
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
import torch.fx as fx

from asynctp.compile.matmuls import MATMULS, RESHAPES, Matmul, consumer_matmuls, producer_matmul, tensor_of
from asynctp.compile.matmuls import arg as _arg

__all__ = [
    "Gather",
    "ReduceScatter",
    "Matmul",
    "find_gathers",
    "find_reduce_scatters",
    "consumer_matmuls",
    "producer_matmul",
    "reaches_scaled_mm_a",
    "ancestors",
    "tensor_of",
    "unforeseen",
    "embedding_hint",
]

aten = torch.ops.aten
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def _c10d() -> Any:
    return torch.ops._c10d_functional


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` depends on (itself included)."""
    seen = {node}
    todo = [node]
    while todo:
        for inp in todo.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                todo.append(inp)
    return seen


@dataclass
class Gather:
    """An all-gather as the graph sees it: `result` holds the gathered tensor (cat along
    `gather_dim` of every rank's `shard`)."""

    ag: fx.Node
    wait: fx.Node
    result: fx.Node
    shard: fx.Node  # what the collective sends (a uint8 view when type-erased)
    gather_dim: int  # normalized to the result's ndim
    group_name: str
    nodes: list[fx.Node] = field(default_factory=list)  # the pattern, in graph order
    erased_dtype: torch.dtype | None = None  # the real dtype of a type-erased (uint8) gather
    problem: str | None = None  # set when the form is not one asynctp can replace


@dataclass
class ReduceScatter:
    rs: fx.Node
    wait: fx.Node | None
    input: fx.Node  # the full partial, before the split/cat that moves the scatter dim first
    scatter_dim: int
    reduce_op: str
    group_name: str
    nodes: list[fx.Node] = field(default_factory=list)
    problem: str | None = None


def _chunks_in_order(parts: Any, source: fx.Node, num: int, dim: int) -> bool:
    """parts are the `num` equal chunks of `source` along `dim`, in order (getitem(split) or slice)."""
    if not isinstance(parts, (list, tuple)) or len(parts) != num:
        return False
    src = tensor_of(source)
    if src is None or src.shape[dim] % num:
        return False
    size = src.shape[dim] // num
    for i, part in enumerate(parts):
        if not isinstance(part, fx.Node):
            return False
        if part.target is operator.getitem:
            split = part.args[0]
            if not (isinstance(split, fx.Node) and split.target in SPLITS and split.args[0] is source):
                return False
            sizes = split.args[1]
            split_dim = _arg(split, 2, "dim", 0)
            even = sizes == size or (isinstance(sizes, (list, tuple)) and list(sizes) == [size] * num)
            if not even or split_dim % src.ndim != dim or part.args[1] != i:
                return False
        elif part.target is aten.slice.Tensor:
            if part.args[0] is not source or _arg(part, 1, "dim", 0) % src.ndim != dim:
                return False
            start, end = _arg(part, 2, "start", 0), _arg(part, 3, "end", None)
            if start != i * size or end not in ((i + 1) * size,) + ((None,) if i == num - 1 else ()):
                return False
        else:
            return False
    return True


def _pattern_nodes(parts: list[fx.Node]) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    for part in parts:
        if part.target is operator.getitem and part.args[0] not in nodes:
            nodes.append(part.args[0])
    return nodes + list(parts)


def _strip_dtype_views(parts: list[Any]) -> tuple[list[Any], torch.dtype | None]:
    dtypes = {p.args[1] for p in parts if isinstance(p, fx.Node) and p.target is aten.view.dtype}
    if len(dtypes) == 1 and all(isinstance(p, fx.Node) and p.target is aten.view.dtype for p in parts):
        return [p.args[0] for p in parts], dtypes.pop()
    return parts, None


_CHUNK_OPS = SPLITS + (operator.getitem, aten.slice.Tensor, aten.view.dtype)


def _cat_below(wait: fx.Node) -> fx.Node | None:
    """The one cat reached from `wait` through chunking ops (split, getitem, slice, view.dtype)."""
    cats: set[fx.Node] = set()
    todo, seen = list(wait.users), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target is aten.cat.default:
            cats.add(node)
        elif node.target in _CHUNK_OPS:
            todo.extend(node.users)
    return cats.pop() if len(cats) == 1 else None


def _match_gather(ag: fx.Node) -> Gather:
    shard = ag.args[0]
    num = int(_arg(ag, 1, "group_size"))
    group_name = str(_arg(ag, 2, "group_name"))
    waits = [u for u in ag.users if u.target is _c10d().wait_tensor.default]
    g = Gather(ag, waits[0] if waits else ag, ag, shard, 0, group_name, [ag])
    if len(waits) != 1:
        g.problem = "the all-gather has no single wait_tensor"
        return g
    if len(ag.users) != 1:
        g.problem = f"the un-waited all-gather result has {len(ag.users)} users"
        return g
    g.nodes.append(g.wait)
    g.result = g.wait
    # dim > 0: the gathered rows (rank-major on dim 0) are chunked and concatenated along dim d
    cat = _cat_below(g.wait)
    cat_val = tensor_of(cat) if cat is not None else None
    if cat is not None and cat_val is not None:
        dim = _arg(cat, 1, "dim", 0) % cat_val.ndim
        parts, chunk_dtype = _strip_dtype_views(list(cat.args[0]))
        if dim and _chunks_in_order(parts, g.wait, num, 0):
            pieces = _pattern_nodes(parts) + ([p for p in cat.args[0]] if chunk_dtype is not None else [])
            outside = [u for p in [g.wait, *pieces] for u in p.users if u not in pieces and u is not cat]
            if outside:
                g.problem = f"pieces of the gathered tensor are also used by {outside[0].name}"
                return g
            g.nodes += pieces + [cat]
            g.erased_dtype = chunk_dtype
            g.result, g.gather_dim = cat, dim
    if cat is None:
        _match_gathered_view(g, num)
        if g.problem:
            return g
    users = list(g.result.users)
    if len(users) == 1 and users[0].target is aten.view.dtype:
        g.erased_dtype = users[0].args[1]
        g.result = users[0]
        g.nodes.append(users[0])
    if cat is not None and g.result is g.wait:
        g.problem = "the gathered chunks are reassembled in a form asynctp does not recognize"
    return g


def _gathered_view_dim(view: fx.Node, shard: Any, num: int) -> int | None:
    """The dim d > 0 that `view` of the rank-major rows gathers along, or None. The rows are
    already the gathered tensor when every shard dim before d has size 1 (and only then)."""
    out, src = tensor_of(view), tensor_of(shard)
    if out is None or src is None or out.ndim != src.ndim:
        return None
    changed = [d for d in range(src.ndim) if out.shape[d] != src.shape[d]]
    if len(changed) != 1 or changed[0] == 0:
        return None
    dim = changed[0]
    if out.shape[dim] != num * src.shape[dim] or prod(src.shape[:dim]) != 1:
        return None
    return dim


def _match_gathered_view(g: Gather, num: int) -> None:
    """funcol's gather along d > 0 of a shard whose dims before d are all 1 (batch 1): a view of
    the rows, no split + cat (inductor then turns it into a reshape). A fp8 gather's
    view(dtype) may stand before that view (one after it is _match_gather's)."""
    chain: list[fx.Node] = []
    node = g.wait
    if len(node.users) == 1 and next(iter(node.users)).target is aten.view.dtype:
        node = next(iter(node.users))
        chain.append(node)
    views = [(u, d) for u in node.users if u.target in RESHAPES and (d := _gathered_view_dim(u, g.shard, num))]
    if len(views) != 1:
        return
    view, dim = views[0]
    outside = [u for u in node.users if u is not view]
    if outside:
        g.problem = f"the gathered rows are also used by {outside[0].name}"
        return
    g.nodes += chain + [view]
    g.result, g.gather_dim = view, dim
    if chain:
        g.erased_dtype = chain[0].args[1]


def reaches_scaled_mm_a(result: fx.Node, max_nodes: int = 64) -> bool:
    """Whether `result` reaches the A of a _scaled_mm through elementwise and shape ops (a
    high-precision gather cast to float8 afterwards: torchao's Float8Linear under plain
    ColwiseParallel). The walk stops at matmuls and collectives and after max_nodes nodes."""
    todo, seen = list(result.users), {result}
    while todo and len(seen) < max_nodes:
        node = todo.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target not in MATMULS and "_c10d_functional" not in str(node.target):
            todo.extend(node.users)
    return any(n.target is aten._scaled_mm.default and n.args[0] in seen for n in seen)


_EMBEDDING_OPS = ("embedding", "index_put", "index_select", "_unsafe_masked_index")
EMBEDDING_HINT = "; it belongs to the embedding (a row lookup or its scatter-add: no matmul to overlap with)"


def embedding_hint(node: fx.Node, upward: bool = True, max_nodes: int = 16) -> str:
    """Names the vocabulary-parallel embedding when `node` is close to one (its inputs when
    upward, else its users): the embedding's reduce-scatter and its backward gather have no
    matmul in the graph, so nothing can be fused with them."""
    todo, seen = [node], set()
    while todo and len(seen) < max_nodes:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        name = str(current.target)
        if any(op in name for op in _EMBEDDING_OPS):
            return EMBEDDING_HINT
        if current.op == "call_function" and current.target not in MATMULS and "_c10d_functional" not in name:
            todo.extend(current.all_input_nodes if upward else current.users)
    return ""


def unforeseen(exc: Exception) -> str:
    return f"asynctp could not analyse this form ({type(exc).__name__}: {exc})"


def find_gathers(graph: fx.Graph) -> list[Gather]:
    found = []
    for node in [n for n in graph.nodes if n.target is _c10d().all_gather_into_tensor.default]:
        try:
            found.append(_match_gather(node))
        except Exception as exc:  # noqa: BLE001 - reported as unfused, never a crashed compile
            found.append(Gather(node, node, node, node.args[0], 0, str(node.args[-1]), problem=unforeseen(exc)))
    return found


def _match_reduce_scatter(rs: fx.Node) -> ReduceScatter:
    inp = rs.args[0]
    reduce_op = str(_arg(rs, 1, "reduce_op"))
    num = int(_arg(rs, 2, "group_size"))
    group_name = str(_arg(rs, 3, "group_name"))
    waits = [u for u in rs.users if u.target is _c10d().wait_tensor.default]
    r = ReduceScatter(rs, waits[0] if len(waits) == 1 else None, inp, 0, reduce_op, group_name, [rs])
    if r.wait is None:
        r.problem = "the reduce-scatter has no single wait_tensor"
        return r
    r.nodes.append(r.wait)
    if isinstance(inp, fx.Node) and inp.target is aten.cat.default and _arg(inp, 1, "dim", 0) == 0:
        parts = list(inp.args[0])
        first = parts[0] if parts and isinstance(parts[0], fx.Node) else None
        source = first.args[0] if first is not None else None
        if first is not None and first.target is operator.getitem:
            source = source.args[0] if isinstance(source, fx.Node) else None
        src = tensor_of(source) if isinstance(source, fx.Node) else None
        if src is not None:
            for dim in range(1, src.ndim):
                if _chunks_in_order(parts, source, num, dim):
                    pieces = _pattern_nodes(parts)
                    if any(u not in pieces + [inp] for p in pieces for u in p.users) or len(inp.users) != 1:
                        break
                    r.nodes = pieces + [inp] + r.nodes
                    r.input, r.scatter_dim = source, dim
                    break
    return r


def find_reduce_scatters(graph: fx.Graph) -> list[ReduceScatter]:
    found = []
    for node in [n for n in graph.nodes if n.target is _c10d().reduce_scatter_tensor.default]:
        try:
            found.append(_match_reduce_scatter(node))
        except Exception as exc:  # noqa: BLE001 - reported as unfused, never a crashed compile
            found.append(ReduceScatter(node, None, node.args[0], 0, "", str(node.args[-1]), problem=unforeseen(exc)))
    return found


