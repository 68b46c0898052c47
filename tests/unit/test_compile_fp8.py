"""tests/unit: the fp8 graph rewrite (make_fx, fake tensors, a "fake" group of 2 ranks):
type-erased (uint8) and plain float8 gathers into _scaled_mm, tensorwise and rowwise scales,
and _scaled_mm -> reduce-scatter; the forms torchao's Float8Linear leaves under plain DTensor styles
(A cast to float8 after flattening; a high-precision gather cast afterwards; a product rescaled
after the matmul). Where this asynctp has no fused scaled ops, each is reported unfused with that
reason."""

from __future__ import annotations

import importlib

import pytest
import torch

import asynctp.config
from asynctp.compile.rewrite import HP_GATHER_CAST, NO_SCALED_OP
from tests import cases_compile as cc

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _has_scaled_ops() -> bool:
    try:
        importlib.import_module("asynctp.ops.all_gather_scaled_matmul")
        importlib.import_module("asynctp.ops.scaled_matmul_reduce_scatter")
    except ImportError:
        return False
    return True


HAS_SCALED = _has_scaled_ops()


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    with cc.fake_group(2) as group:
        yield group


rewrite = cc.rewrite


def check_fused(rec, op: str) -> None:
    if HAS_SCALED:
        assert rec.fused and rec.op == op, rec.describe()
    else:
        assert not rec.fused and rec.reason == NO_SCALED_OP


def test_type_erased_gather_tensorwise():
    def f(x, w, sa, sb):
        a = cc.gather(x.to(F8).view(torch.uint8), 0).view(F8)
        return torch._scaled_mm(a.reshape(-1, 16), w.to(F8).t(), sa, sb, out_dtype=BF16)

    gm, (rec,) = rewrite(f, (2, 4, 16), (16, 16), (), ())
    check_fused(rec, "asynctp.all_gather_scaled_matmul")
    if HAS_SCALED:
        (node,) = cc.nodes_of(gm, "asynctp.all_gather_scaled_matmul.default")
        assert node.args[0].meta["val"].dtype == F8  # the float8 shard, not its uint8 view
        assert "aten._scaled_mm.default" not in cc.targets(gm)


def test_rowwise_scale_gathered_with_a():
    def f(x, w, s, sb):
        a = cc.gather(x.to(F8), 1)
        scale = cc.gather(s, 1)
        out = torch._scaled_mm(a.reshape(-1, 16), w.to(F8).t(), scale.reshape(-1, 1), sb, out_dtype=BF16)
        return out.reshape(2, 8, 16)

    gm, records = rewrite(f, (2, 4, 16), (16, 16), (2, 4, 1), (1, 16))
    check_rowwise_gather_fused(gm, records)


def check_rowwise_gather_fused(gm, records) -> None:
    """A rowwise-scaled gather: two records (A's gather fused, its scale's gather folded into it)
    and no gather left in the graph."""
    assert len(records) == 2
    check_fused(records[0], "asynctp.all_gather_scaled_matmul")
    if HAS_SCALED:
        assert records[1].fused and "rowwise A scale" in records[1].reason
        assert "_c10d_functional.all_gather_into_tensor.default" not in cc.targets(gm)


def test_scaled_mm_reduce_scatter_rowwise_3d():
    def f(x, w, s, sb):
        out = torch._scaled_mm(x.to(F8).reshape(-1, 16), w.to(F8).t(), s.reshape(-1, 1), sb, out_dtype=BF16)
        return cc.reduce_scatter(out.reshape(2, 8, 16), 1)

    gm, (rec,) = rewrite(f, (2, 8, 16), (16, 16), (2, 8, 1), (1, 16))
    check_fused(rec, "asynctp.scaled_matmul_reduce_scatter")
    if HAS_SCALED:
        (node,) = cc.nodes_of(gm, "asynctp.scaled_matmul_reduce_scatter.default")
        assert node.args[4] == 1 and tuple(node.args[2].meta["val"].shape) == (2, 8, 1)


def test_scaled_mm_reduce_scatter_tensorwise_2d():
    def f(x, w, s, sb):
        return cc.reduce_scatter(torch._scaled_mm(x.to(F8), w.to(F8).t(), s, sb, out_dtype=BF16), 0)

    _, (rec,) = rewrite(f, (8, 16), (16, 16), (), ())
    check_fused(rec, "asynctp.scaled_matmul_reduce_scatter")


def test_summed_scaled_reduce_scatters_fuse_one_by_one():
    """A sum of two scaled products' reduce-scatters is not merged (the fused op takes a scaled
    product only directly): each is fused on its own."""
    def f(x, y, w, s, sb):
        rs = [cc.reduce_scatter(torch._scaled_mm(t.to(F8), w.to(F8).t(), s, sb, out_dtype=BF16), 0) for t in (x, y)]
        return rs[0] + rs[1]

    gm, recs = rewrite(f, (8, 16), (8, 16), (16, 16), (), ())
    assert len(recs) == 2 and all(r.num_matmuls == 1 for r in recs), [r.describe() for r in recs]
    for rec in recs:
        check_fused(rec, "asynctp.scaled_matmul_reduce_scatter")
    assert "aten.add.Tensor" in cc.targets(gm)


@pytest.mark.skipif(not HAS_SCALED, reason="this asynctp has no fused scaled ops")
def test_rowwise_scale_not_gathered_is_not_fused():
    def f(x, w, s, sb):
        a = cc.gather(x.to(F8), 0)
        return torch._scaled_mm(a, w.to(F8).t(), s, sb, out_dtype=BF16)  # scale of the gathered A, from elsewhere

    _, (rec,) = rewrite(f, (4, 16), (16, 16), (8, 1), (1, 16))
    assert not rec.fused and "not an all-gather of the shards' scales" in rec.reason


def test_type_erased_gather_dim1_bias_and_two_matmuls():
    def f(x, w1, w3, sa, sb1, sb3, bias):
        a = cc.gather(x.to(F8).view(torch.uint8), 1).view(F8)
        a2 = a.reshape(-1, 16)
        h1 = torch._scaled_mm(a2, w1.to(F8).t(), sa, sb1, bias=bias.to(BF16), out_dtype=BF16)
        h3 = torch._scaled_mm(a2, w3.to(F8).t(), sa, sb3, out_dtype=BF16)
        return h1.reshape(2, 8, 16), h3.reshape(2, 8, 32)

    gm, (rec,) = rewrite(f, (2, 4, 16), (16, 16), (32, 16), (), (), (), (16,))
    check_fused(rec, "asynctp.all_gather_scaled_matmul")
    if HAS_SCALED:
        assert rec.dim == 1 and rec.num_matmuls == 2
        (node,) = cc.nodes_of(gm, "asynctp.all_gather_scaled_matmul.default")
        assert node.args[4] == 1 and node.args[7][0] is not None and node.args[7][1] is None


@pytest.mark.skipif(not HAS_SCALED, reason="this asynctp has no fused scaled ops")
def test_no_symmetric_workspace_is_fused_with_a_note():
    def f(x, w, sa, sb):
        return torch._scaled_mm(cc.gather(x.to(F8), 0), w.to(F8).t(), sa, sb, out_dtype=BF16)

    with asynctp.config.override(disable_symm=True):  # the scaled ops then overlap over send/recv
        _, (rec,) = rewrite(f, (4, 16), (16, 16), (), ())
    assert rec.fused and rec.reason.startswith("group has no symmetric workspace") and "ring" in rec.reason


@pytest.mark.parametrize("dtype_view", ["after", "before"])
def test_type_erased_gather_batch1_view_form_rowwise(dtype_view):
    """Batch 1: funcol views the gathered rows (no split + cat), for the uint8 A and its scale;
    the view back to float8 may come after that view or before it."""

    def f(x, w, s, sb):
        rows = cc.gather(x.to(F8).view(torch.uint8), 0)
        a = rows.view(1, 8, 16).view(F8) if dtype_view == "after" else rows.view(F8).view(1, 8, 16)
        scale = cc.gather(s, 0).view(1, 8, 1)
        out = torch._scaled_mm(a.reshape(-1, 16), w.to(F8).t(), scale.reshape(-1, 1), sb, out_dtype=BF16)
        return out.reshape(1, 8, 16)

    gm, records = rewrite(f, (1, 4, 16), (16, 16), (1, 4, 1), (1, 16))
    check_rowwise_gather_fused(gm, records)
    if HAS_SCALED:
        assert records[0].dim == 1
        (node,) = cc.nodes_of(gm, "asynctp.all_gather_scaled_matmul.default")
        assert node.args[0].meta["val"].dtype == F8 and node.args[4] == 1


# --- torchao Float8Linear under plain ColwiseParallel / RowwiseParallel --------------------------


def _cast_2d(x):
    """torchao's backward: flatten the gradient first, then cast it to float8."""
    return (x.reshape(-1, x.shape[-1]) * 2).to(F8)


@pytest.mark.parametrize(
    "dim, sa, sb, sa_fused", [(0, (), (), ()), (1, (), (), ()), (1, (16, 1), (1, 16), (2, 8, 1))],
    ids=["tensorwise-dim0", "tensorwise-dim1", "rowwise-dim1"],
)
def test_scaled_mm_of_a_2d_cast_reduce_scattered(dim, sa, sb, sa_fused):
    def f(x, w, sa, sb):
        out = torch._scaled_mm(_cast_2d(x), w.to(F8).t(), sa, sb, out_dtype=BF16)
        return cc.reduce_scatter(out.reshape(2, 8, 16), dim)

    gm, (rec,) = rewrite(f, (2, 8, 16), (16, 16), sa, sb)
    check_fused(rec, "asynctp.scaled_matmul_reduce_scatter")
    if HAS_SCALED:
        (node,) = cc.nodes_of(gm, "asynctp.scaled_matmul_reduce_scatter.default")
        assert tuple(node.args[0].meta["val"].shape) == (2, 8, 16) and node.args[4] == dim
        assert tuple(node.args[2].meta["val"].shape) == sa_fused  # a rowwise scale follows A's rows
        assert "aten._scaled_mm.default" not in cc.targets(gm)


def test_high_precision_gather_cast_afterwards_says_so():
    def f(x, w, sb):
        a = cc.gather(x, 1)
        scale = 448.0 / a.abs().max()
        a_fp8 = (a * scale).clamp(-448.0, 448.0).to(F8)
        return torch._scaled_mm(a_fp8.reshape(-1, 16), w.to(F8).t(), scale.reciprocal(), sb, out_dtype=BF16)

    _, (rec,) = rewrite(f, (2, 4, 16), (16, 16), ())
    assert not rec.fused and rec.tp and rec.reason.startswith(HP_GATHER_CAST), rec.describe()


def test_rescaled_scaled_mm_before_reduce_scatter_says_so():
    def f(x, w, sa, sb):
        one = torch.ones((), dtype=torch.float32)
        out = torch._scaled_mm(x.to(F8).reshape(-1, 16), w.to(F8).t(), one, one, out_dtype=BF16)
        # torchao: output *= a_inverse_scale * b_inverse_scale, with the cast as inductor writes it
        rescaled = torch.ops.prims.convert_element_type(out * (sa * sb), BF16)
        return cc.reduce_scatter(rescaled.reshape(2, 8, 16), 1)

    _, (rec,) = rewrite(f, (2, 8, 16), (16, 16), (16, 1), (1, 16))
    assert not rec.fused and "multiplied by scales before the reduction" in rec.reason, rec.describe()
