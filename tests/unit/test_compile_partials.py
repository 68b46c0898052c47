"""tests/unit: the reduce-scatter of a partial built from matmuls (asynctp/compile/partials.py) on
traced graphs over a one-process fake group of 2: sums of sibling input gradients (wq / wk / wv,
w1 / w3), row ops between the product and the collective (transpose, clone, reshape: a
sequence-major layout), and the reasons given when such a partial is left alone; plus the
embedding's collectives, which have no matmul and say so."""

from __future__ import annotations

import pytest
import torch

from tests import cases_compile as cc

from tests.cases_compile import C10D_RS, fake_world  # noqa: F401 - the fixture, used below
from tests.cases_compile import RS_OP as RS

pytestmark = pytest.mark.usefixtures("fake_world")
rewrite = cc.rewrite


def fused_rs(gm):
    (node,) = cc.nodes_of(gm, RS)
    return node


def shape(node):
    return tuple(node.meta["val"].shape)


# --- sums of sibling partials -------------------------------------------------------------------


def test_sum_of_two_dgrads_becomes_one_op_over_the_concatenation():
    """w1 / w3's input gradient under one shared gather: g1 @ w1 + g3 @ w3, reduce-scattered."""
    gm, (rec,) = rewrite(lambda g1, g3, w1, w3: cc.reduce_scatter(g1 @ w1 + g3 @ w3, 1), (2, 4, 6), (2, 4, 6), (6, 8), (6, 8))
    assert rec.fused and rec.op == "asynctp.matmul_reduce_scatter" and rec.num_matmuls == 2, rec.describe()
    node = fused_rs(gm)
    assert node.args[2] == 1 and shape(node.args[0]) == (2, 4, 12) and shape(node.args[1]) == (12, 8)
    assert not {C10D_RS, "aten.mm.default", "aten.add.Tensor"} & set(cc.targets(gm))


def test_sum_of_three_dgrads_nested_adds():
    """wq / wk / wv (GQA: narrower k and v): ((gq @ wq + gk @ wk) + gv @ wv)."""
    def f(gq, gk, gv, wq, wk, wv):
        return cc.reduce_scatter(gq @ wq + gk @ wk + gv @ wv, 1)

    gm, (rec,) = rewrite(f, (2, 4, 8), (2, 4, 4), (2, 4, 4), (8, 6), (4, 6), (4, 6))
    assert rec.fused and rec.num_matmuls == 3, rec.describe()
    node = fused_rs(gm)
    assert shape(node.args[0]) == (2, 4, 16) and shape(node.args[1]) == (16, 6)
    assert cc.targets(gm).count("aten.cat.default") == 2 and "aten.mm.default" not in cc.targets(gm)


def test_sum_with_a_term_read_elsewhere_is_left_with_a_reason():
    def f(g1, g3, w1, w3):
        p1 = g1 @ w1
        return cc.reduce_scatter(p1 + g3 @ w3, 1), p1.sum()

    gm, (rec,) = rewrite(f, (2, 4, 6), (2, 4, 6), (6, 8), (6, 8))
    assert not rec.fused and "read elsewhere" in rec.reason, rec.describe()
    assert C10D_RS in cc.targets(gm)


def test_broadcast_add_is_not_a_sum_of_partials():
    _, (rec,) = rewrite(lambda g, w, c: cc.reduce_scatter(g @ w + c, 1), (2, 4, 6), (6, 8), (8,))
    assert not rec.fused and "broadcast or a scalar" in rec.reason, rec.describe()


def test_sum_with_a_non_matmul_term_says_which():
    _, (rec,) = rewrite(lambda g, w, x: cc.reduce_scatter(g @ w + x * 2, 1), (2, 4, 6), (6, 8), (2, 4, 8))
    assert not rec.fused and "not a matmul" in rec.reason and "aten.mul" in rec.reason, rec.describe()


def test_sum_with_a_bias_term_is_not_fused():
    _, (rec,) = rewrite(lambda g, w, g3, w3, b: cc.reduce_scatter(torch.addmm(b, g, w) + g3 @ w3, 0),
                        (4, 6), (6, 8), (4, 6), (6, 8), (8,))
    assert not rec.fused and "bias" in rec.reason, rec.describe()


# --- sums of reduce-scatters (torch's styles: one collective per linear) -------------------------


def test_summed_reduce_scatters_become_one_op_over_the_concatenation():
    """w1 / w3's input gradient under one ColwiseParallel each: RS(g1 @ w1) + RS(g3 @ w3)."""
    f = lambda g1, g3, w1, w3: cc.reduce_scatter(g1 @ w1, 1) + cc.reduce_scatter(g3 @ w3, 1)  # noqa: E731
    gm, recs = rewrite(f, (2, 4, 6), (2, 4, 6), (6, 8), (6, 8))
    assert [r.fused for r in recs] == [True, True], [r.describe() for r in recs]
    kept, gone = recs
    assert kept.num_matmuls == 2 and f"summed with {kept.node}'s partial" in gone.reason, gone.describe()
    node = fused_rs(gm)
    assert node.args[2] == 1 and shape(node.args[0]) == (2, 4, 12) and shape(node.args[1]) == (12, 8)
    assert not {C10D_RS, "aten.mm.default", "aten.add.Tensor"} & set(cc.targets(gm))


def test_three_summed_reduce_scatters_become_one_op():
    """wq / wk / wv under one ColwiseParallel each (GQA: narrower k and v)."""
    def f(gq, gk, gv, wq, wk, wv):
        return cc.reduce_scatter(gq @ wq, 1) + cc.reduce_scatter(gk @ wk, 1) + cc.reduce_scatter(gv @ wv, 1)

    gm, recs = rewrite(f, (2, 4, 8), (2, 4, 4), (2, 4, 4), (8, 6), (4, 6), (4, 6))
    assert all(r.fused for r in recs) and len(recs) == 3 and recs[0].num_matmuls == 3, [r.describe() for r in recs]
    assert shape(fused_rs(gm).args[0]) == (2, 4, 16) and shape(fused_rs(gm).args[1]) == (16, 6)
    assert C10D_RS not in cc.targets(gm)


def test_reduce_scatters_summed_into_a_running_sum_merge():
    """Autograd's order: the residual's gradient first, then each branch's: (t + RS_1) + RS_3."""
    f = lambda t, g1, g3, w1, w3: t + cc.reduce_scatter(g1 @ w1, 1) + cc.reduce_scatter(g3 @ w3, 1)  # noqa: E731
    gm, recs = rewrite(f, (2, 2, 8), (2, 4, 6), (2, 4, 6), (6, 8), (6, 8))
    assert [r.num_matmuls for r in recs] == [2, 0] and all(r.fused for r in recs), [r.describe() for r in recs]
    (add,) = cc.nodes_of(gm, "aten.add.Tensor")  # t + the one op's result
    assert set(add.args) == {next(n for n in gm.graph.nodes if n.name == "t_1"), fused_rs(gm)}


def test_running_sum_read_elsewhere_is_not_reassociated():
    def f(t, g1, g3, w1, w3):
        partial = t + cc.reduce_scatter(g1 @ w1, 1)
        return partial + cc.reduce_scatter(g3 @ w3, 1), partial

    gm, recs = rewrite(f, (2, 2, 8), (2, 4, 6), (2, 4, 6), (6, 8), (6, 8))
    assert [r.num_matmuls for r in recs] == [1, 1], [r.describe() for r in recs]
    assert len(cc.nodes_of(gm, RS)) == 2


@pytest.mark.parametrize("case", ["other dims", "result read elsewhere"])
def test_summed_reduce_scatters_left_apart(case):
    """Scattered along different dims, or a collective's result read besides the sum: each its own op."""
    if case == "other dims":
        f = lambda p, q, w: cc.reduce_scatter(p @ w, 1) + cc.reduce_scatter(q @ w, 0)  # noqa: E731
        shapes = ((2, 4, 6), (4, 2, 6), (6, 8))
    else:
        def f(p, q, w):
            r = cc.reduce_scatter(p @ w, 1)
            return r + cc.reduce_scatter(q @ w, 1), r.sum()
        shapes = ((2, 4, 6), (2, 4, 6), (6, 8))
    gm, recs = rewrite(f, *shapes)
    assert [r.num_matmuls for r in recs] == [1, 1] and all(r.fused for r in recs), [r.describe() for r in recs]
    assert len(cc.nodes_of(gm, RS)) == 2 and "aten.add.Tensor" in cc.targets(gm)


# --- row ops between the product and the collective ----------------------------------------------


def test_transpose_clone_then_scatter_dim0():
    """A sequence-major layout: [B, S, N] -> [S, B, N] (a contiguous copy), scattered on S."""
    gm, (rec,) = rewrite(lambda a, b: cc.reduce_scatter((a @ b).transpose(0, 1).contiguous(), 0), (2, 4, 6), (6, 8))
    assert rec.fused and rec.num_matmuls == 1 and rec.dim == 0, rec.describe()
    node = fused_rs(gm)
    assert node.args[2] == 0 and shape(node.args[0]) == (4, 2, 6)  # A moved the same way
    assert not {C10D_RS, "aten.mm.default"} & set(cc.targets(gm))


def test_transpose_clone_flatten_then_scatter_rows():
    """Sequence-major rows flattened to 2-D ([S * B, N]) before the reduce-scatter."""
    f = lambda a, b: cc.reduce_scatter((a @ b).transpose(0, 1).contiguous().view(-1, 8), 0)  # noqa: E731
    gm, (rec,) = rewrite(f, (2, 4, 6), (6, 8))
    assert rec.fused, rec.describe()
    assert shape(fused_rs(gm).args[0]) == (8, 6)


def test_sum_behind_a_transpose():
    f = lambda g1, g3, w1, w3: cc.reduce_scatter((g1 @ w1 + g3 @ w3).permute(1, 0, 2).clone(), 0)  # noqa: E731
    gm, (rec,) = rewrite(f, (2, 4, 6), (2, 4, 6), (6, 8), (6, 8))
    assert rec.fused and rec.num_matmuls == 2, rec.describe()
    assert shape(fused_rs(gm).args[0]) == (4, 2, 12)


def test_transposing_the_output_features_is_not_fused():
    _, (rec,) = rewrite(lambda a, b: cc.reduce_scatter((a @ b).transpose(1, 2).contiguous(), 1), (2, 4, 6), (6, 8))
    assert not rec.fused and "output features (the last dim)" in rec.reason, rec.describe()


def test_row_op_source_read_elsewhere():
    def f(a, b):
        p = a @ b
        return cc.reduce_scatter(p.transpose(0, 1).contiguous(), 0), p

    _, (rec,) = rewrite(f, (2, 4, 6), (6, 8))
    assert not rec.fused, rec.describe()


# --- the embedding: no matmul, and the report says whose collective it is -------------------------


def test_embedding_reduce_scatter_names_the_embedding():
    def f(tokens, table):
        index = tokens.long()
        rows = torch.nn.functional.embedding(index.clamp(0, 5), table)  # this rank's vocabulary rows
        return cc.reduce_scatter(rows.masked_fill((index < 0).unsqueeze(-1), 0.0), 1)

    _, (rec,) = rewrite(f, (2, 4), (6, 8))
    assert not rec.fused and rec.tp and "not a matmul" in rec.reason and "embedding" in rec.reason, rec.describe()


def test_embedding_backward_gather_names_the_embedding():
    def f(grad, tokens, table):
        index = tokens.clamp(0, 5).long().flatten()
        return torch.zeros_like(table).index_put([index], cc.gather(grad, 1).reshape(-1, 8), accumulate=True)

    _, (rec,) = rewrite(f, (2, 2, 8), (2, 4), (6, 8))
    assert not rec.fused and "feeds no matmul" in rec.reason and "embedding" in rec.reason, rec.describe()
