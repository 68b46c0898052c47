"""The matmuls next to a TP collective in a post-grad FX graph: the consumers of a gathered
tensor and the producer of a reduce-scatter's input (2-D mm / addmm / _scaled_mm, or reshape ->
mm -> reshape back). Matching only, no edits."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Matmul", "consumer_matmuls", "producer_matmul", "tensor_of", "arg", "RESHAPES", "MATMULS"]

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
MATMULS = (aten.mm.default, aten.addmm.default, aten._scaled_mm.default)


def tensor_of(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


@dataclass
class Matmul:
    """out = a @ b (+ bias): `a` is N-D, `pre` reshapes it to 2-D, `mm` is the 2-D matmul, `post`
    holds reshapes of the product back to a.shape[:-1] + (N,)."""

    mm: fx.Node
    a: fx.Node
    b: fx.Node
    pre: fx.Node | None
    post: list[fx.Node]
    bias: fx.Node | None = None
    scaled: bool = False
    scale_a: fx.Node | None = None
    scale_b: fx.Node | None = None
    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False
    problem: str | None = None  # set when this matmul cannot be folded in
    a_shape: tuple[int, ...] | None = None  # A is 2-D with no N-D source: reshape it to this first

    def arg_nodes(self) -> list[fx.Node]:
        return [n for n in (self.b, self.bias, self.scale_a, self.scale_b) if isinstance(n, fx.Node)]


def _is_flatten_to_2d(node: fx.Node, src: fx.Node) -> bool:
    out, inp = tensor_of(node), tensor_of(src)
    return (
        out is not None and inp is not None and inp.ndim >= 2 and out.ndim == 2
        and out.shape[1] == inp.shape[-1] and out.shape[0] == prod(inp.shape[:-1])
    )


def _matmul_at(mm: fx.Node, a: fx.Node, pre: fx.Node | None, a_shape: tuple[int, ...] | None = None) -> Matmul:
    if mm.target is aten.addmm.default:
        m = Matmul(mm, a, mm.args[2], pre, [], bias=mm.args[0])
        if arg(mm, 3, "beta", 1) != 1 or arg(mm, 4, "alpha", 1) != 1:
            m.problem = "addmm with beta or alpha other than 1"
        bias, b = tensor_of(m.bias), tensor_of(m.b)
        if bias is None or b is None or tuple(bias.shape) != (b.shape[1],):
            m.problem = "the addmm bias is not a 1-D (N,) vector"
    elif mm.target is aten._scaled_mm.default:
        m = Matmul(
            mm, a, mm.args[1], pre, [], bias=arg(mm, 4, "bias"), scaled=True,
            scale_a=mm.args[2], scale_b=mm.args[3], out_dtype=arg(mm, 6, "out_dtype"),
            use_fast_accum=bool(arg(mm, 7, "use_fast_accum", False)),
        )
        if arg(mm, 5, "scale_result") is not None:
            m.problem = "_scaled_mm with a result scale"
    else:
        m = Matmul(mm, a, mm.args[1], pre, [])
    m.a_shape = a_shape
    a_val, out = tensor_of(a), tensor_of(mm)
    if a_val is not None and out is not None:
        want = tuple(a_shape or a_val.shape)[:-1] + (out.shape[1],)
        m.post = [u for u in mm.users if u.target in RESHAPES and tensor_of(u) is not None
                  and tuple(tensor_of(u).shape) == want]
    return m


def _mm_a_index(mm: fx.Node) -> int:
    return 1 if mm.target is aten.addmm.default else 0


def consumer_matmuls(result: fx.Node) -> tuple[list[Matmul], list[str]]:
    """Matmuls whose A is `result` (directly when 2-D, else through a flattening reshape), and a
    note for each matmul that uses `result` in another way."""
    found: list[Matmul] = []
    notes: list[str] = []
    val = tensor_of(result)
    for user in result.users:
        if user.target in MATMULS:
            if user.args[_mm_a_index(user)] is result and val is not None and val.ndim == 2:
                found.append(_matmul_at(user, result, None))
            else:
                notes.append(f"the gathered tensor is B of {user.name}")
        elif user.target in RESHAPES and _is_flatten_to_2d(user, result):
            for mm in user.users:
                if mm.target in MATMULS and mm.args[_mm_a_index(mm)] is user:
                    found.append(_matmul_at(mm, result, user))
    return found, notes


def _unflattened_a_shape(post: fx.Node, a: Any) -> tuple[int, ...] | None:
    """The N-D shape of a 2-D A [M, K] whose product [M, N] is reshaped to lead + (N,) with
    prod(lead) == M (lead keeps the rows in order, so A reshaped to lead + (K,) gives the same
    product), or None."""
    out, a_val = tensor_of(post), tensor_of(a)
    if out is None or a_val is None or a_val.ndim != 2 or out.ndim < 3:
        return None
    if prod(out.shape[:-1]) != a_val.shape[0]:
        return None
    return (*out.shape[:-1], a_val.shape[1])


def producer_matmul(node: fx.Node) -> tuple[Matmul | None, str | None]:
    """The matmul that produced `node` (2-D mm, reshape -> mm -> reshape back, or a 2-D A -> mm
    -> reshape to N-D), or why none."""
    if node.target in MATMULS:
        return _matmul_at(node, node.args[_mm_a_index(node)], None), None
    if node.target in RESHAPES and isinstance(node.args[0], fx.Node) and node.args[0].target in MATMULS:
        mm = node.args[0]
        pre = mm.args[_mm_a_index(mm)]
        if isinstance(pre, fx.Node) and pre.target in RESHAPES and _is_flatten_to_2d(pre, pre.args[0]):
            m = _matmul_at(mm, pre.args[0], pre)
            if node not in m.post:
                return None, "the reshape after the matmul changes its leading dims"
            return m, None
        a_shape = _unflattened_a_shape(node, pre)
        if a_shape is not None:
            return _matmul_at(mm, pre, None, a_shape), None
        return None, "the matmul's 2-D input is not a flattening reshape of an N-D tensor"
    if _rescaled_scaled_mm(node):
        return None, ("the _scaled_mm product is multiplied by scales before the reduction (torchao's rowwise "
                      "recipe without fast accumulation scales after the matmul)")
    return None, f"its input comes from {node.target} (not a matmul)" if node.op == "call_function" else (
        f"its input is a graph {node.op}, not a matmul"
    )


def _rescaled_scaled_mm(node: fx.Node) -> bool:
    """node is reshape / convert_element_type / mul(..., scales) of a _scaled_mm product."""
    passes = RESHAPES + (torch.ops.prims.convert_element_type.default,)
    scaled = False
    for _ in range(4):
        if node.target is aten.mul.Tensor and isinstance(node.args[0], fx.Node):
            scaled = True
        elif node.target not in passes or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
        if node.target is aten._scaled_mm.default:
            return scaled
    return False
