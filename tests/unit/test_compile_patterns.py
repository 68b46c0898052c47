"""tests/unit: the graph rewrite on traced graphs (make_fx, fake tensors, a one-process "fake"
group of 2 ranks): each all-gather / reduce-scatter form, and each reason for not fusing.
Nothing runs a collective; the rewritten graph's shapes are checked against the original's."""

from __future__ import annotations

import pytest
import torch

import asynctp.config
from asynctp.compile.rewrite import rewrite_graph
from tests import cases_compile as cc

AG = "asynctp.all_gather_matmul.default"
RS = "asynctp.matmul_reduce_scatter.default"
C10D_AG = "_c10d_functional.all_gather_into_tensor.default"
C10D_RS = "_c10d_functional.reduce_scatter_tensor.default"


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    with cc.fake_group(2) as group:
        yield group


rewrite = cc.rewrite


def fused_node(gm, target):
    (node,) = cc.nodes_of(gm, target)
    return node


# --- all-gather -> matmul ---------------------------------------------------------------------


def test_gather_dim0_2d_mm():
    gm, (rec,) = rewrite(lambda x, w: cc.gather(x, 0) @ w, (4, 8), (8, 6))
    assert rec.fused and rec.op == "asynctp.all_gather_matmul" and rec.dim == 0 and rec.num_matmuls == 1
    node = fused_node(gm, AG)
    assert node.args[2] == 0 and node.args[4] is False  # return_a: nobody reads the gathered A
    assert C10D_AG not in cc.targets(gm) and "aten.mm.default" not in cc.targets(gm)


def test_gather_dim1_of_3d_split_cat_reshape():
    gm, (rec,) = rewrite(lambda x, w: cc.gather(x, 1) @ w, (2, 3, 8), (8, 6))
    assert rec.fused and rec.dim == 1 and rec.shape == (2, 3, 8)
    assert fused_node(gm, AG).args[2] == 1
    assert not {"aten.split.Tensor", "aten.cat.default", "aten.mm.default"} & set(cc.targets(gm))


def test_gather_last_dim():
    gm, (rec,) = rewrite(lambda x, w: cc.gather(x, 2) @ w, (2, 3, 4), (8, 6))
    assert rec.fused and rec.dim == 2
    assert fused_node(gm, AG).args[2] == 2


def test_qkv_share_one_gather_and_a_is_returned():
    def f(x, wq, wk, wv):
        a = cc.gather(x, 1)
        return a @ wq.t(), a @ wk.t(), a @ wv.t(), a  # a also saved, as for backward

    gm, (rec,) = rewrite(f, (2, 3, 8), (8, 8), (4, 8), (4, 8))
    assert rec.fused and rec.num_matmuls == 3
    node = fused_node(gm, AG)
    assert len(node.args[1]) == 3 and node.args[4] is True


def test_addmm_bias_goes_into_the_op():
    gm, (rec,) = rewrite(lambda x, w, b: torch.addmm(b, cc.gather(x, 0), w), (4, 8), (8, 6), (6,))
    assert rec.fused
    node = fused_node(gm, AG)
    assert node.args[5][0] is not None and "aten.addmm.default" not in cc.targets(gm)


def test_linear_3d_with_bias():
    gm, (rec,) = rewrite(lambda x, w, b: torch.nn.functional.linear(cc.gather(x, 0), w, b), (2, 3, 8), (6, 8), (6,))
    assert rec.fused and fused_node(gm, AG).args[5][0] is not None


def test_matmul_output_used_besides_its_reshape():
    def f(x, w):
        y2 = cc.gather(x, 1).reshape(-1, 8) @ w
        return y2.reshape(2, 6, 6), y2 * 2  # the 2-D product is read too

    gm, (rec,) = rewrite(f, (2, 3, 8), (8, 6))
    assert rec.fused and "aten.mm.default" not in cc.targets(gm)


def test_b_depending_on_the_gathered_a_is_not_fused():
    def f(x):
        a = cc.gather(x, 0)
        return a @ a[:8, :8]

    _, (rec,) = rewrite(f, (8, 8))
    assert not rec.fused and "B depends on the gathered A" in rec.reason


def test_gather_feeding_no_matmul():
    _, (rec,) = rewrite(lambda x: torch.relu(cc.gather(x, 0)), (4, 8))
    assert not rec.fused and rec.reason.startswith("gather feeds no matmul") and rec.tp


def test_gathered_weight_is_not_a_tp_collective():
    _, (rec,) = rewrite(lambda x, w: x @ cc.gather(w, 0), (4, 8), (4, 6))
    assert not rec.fused and not rec.tp and "is B of" in rec.reason


def test_no_symmetric_workspace_is_fused_with_a_note():
    with asynctp.config.override(disable_symm=True):  # the op then overlaps over send/recv
        _, (rec,) = rewrite(lambda x, w: cc.gather(x, 0) @ w, (4, 8), (8, 6))
        assert rec.fused and rec.reason.startswith("group has no symmetric workspace") and "ring" in rec.reason
        _, (rec,) = rewrite(lambda a, b: cc.reduce_scatter(a @ b, 0), (4, 8), (8, 6))
    assert rec.fused and rec.reason.startswith("group has no symmetric workspace")


def test_integer_gather_is_not_fused():
    _, (rec,) = rewrite(lambda x, w: cc.gather(x, 0) @ w, (4, 8), (8, 6), dtype=torch.int64)
    assert not rec.fused and "not a float" in rec.reason


# --- matmul -> reduce-scatter -------------------------------------------------------------------


def test_rs_dim0_2d_mm():
    gm, (rec,) = rewrite(lambda a, b: cc.reduce_scatter(a @ b, 0), (4, 8), (8, 6))
    assert rec.fused and rec.op == "asynctp.matmul_reduce_scatter" and rec.dim == 0
    node = fused_node(gm, RS)
    assert node.args[2] == 0 and node.args[4] == "sum"
    assert C10D_RS not in cc.targets(gm) and "aten.mm.default" not in cc.targets(gm)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_rs_3d_reshape_mm_reshape(dim):
    gm, (rec,) = rewrite(lambda a, b: cc.reduce_scatter(a @ b, dim), (2, 4, 8), (8, 6))
    assert rec.fused and rec.dim == dim
    node = fused_node(gm, RS)
    assert node.args[2] == dim and tuple(node.args[0].meta["val"].shape) == (2, 4, 8)


def test_rs_of_a_2d_a_reshaped_after_the_mm():
    """A built in 2-D (no flattening reshape to undo): the op gets A reshaped to the product's dims."""
    gm, (rec,) = rewrite(lambda a, b: cc.reduce_scatter(((a.reshape(-1, 8) * 2) @ b).reshape(2, 4, 6), 1),
                         (2, 4, 8), (8, 6))
    assert rec.fused, rec.describe()
    node = fused_node(gm, RS)
    assert node.args[2] == 1 and tuple(node.args[0].meta["val"].shape) == (2, 4, 8)


def test_rs_avg():
    gm, (rec,) = rewrite(lambda a, b: cc.reduce_scatter(a @ b, 0, "avg"), (4, 8), (8, 6))
    assert rec.fused and fused_node(gm, RS).args[4] == "avg"


def test_rs_with_input_saved_for_backward():
    def f(a, b):
        return cc.reduce_scatter(a @ b, 1), a  # the matmul input is kept (as for the weight grad)

    gm, (rec,) = rewrite(f, (2, 4, 8), (8, 6))
    assert rec.fused


def test_rs_with_unwaited_result_saved():
    gm = cc.trace(lambda a, b: cc.reduce_scatter(a @ b, 0), (4, 8), (8, 6))
    (rs_node,) = cc.nodes_of(gm, C10D_RS)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((out.args[0], rs_node),)  # the collective itself saved, as the partitioner may
    records = rewrite_graph(gm.graph)
    assert records[0].fused and C10D_RS not in cc.targets(gm)


def test_rs_matmul_output_with_two_users():
    def f(a, b):
        p = a @ b
        return cc.reduce_scatter(p, 0), p.sum()

    _, (rec,) = rewrite(f, (4, 8), (8, 6))
    assert not rec.fused and rec.reason.startswith("matmul output has 2 users")


def test_rs_of_a_non_matmul():
    _, (rec,) = rewrite(lambda a: cc.reduce_scatter(a * 2, 0), (4, 8))
    assert not rec.fused and "not a matmul" in rec.reason


def test_rs_bias_before_reduction():
    _, (rec,) = rewrite(lambda a, b, c: cc.reduce_scatter(torch.addmm(c, a, b), 0), (4, 8), (8, 6), (6,))
    assert not rec.fused and "bias" in rec.reason


def test_rs_max_is_not_fused():
    _, (rec,) = rewrite(lambda a, b: cc.reduce_scatter(a @ b, 0, "max"), (4, 8), (8, 6))
    assert not rec.fused and "reduce op 'max'" in rec.reason


def test_mlp_forward_two_fusions_in_order():
    def f(x, w1, w3, w2):
        a = cc.gather(x, 1)
        h = torch.relu(a @ w1.t()) * (a @ w3.t())
        return cc.reduce_scatter(h @ w2.t(), 1)

    gm, records = rewrite(f, (2, 3, 8), (16, 8), (16, 8), (8, 16))
    assert [(r.kind, r.fused, r.num_matmuls) for r in records] == [("all-gather", True, 2), ("reduce-scatter", True, 1)]
    assert not {C10D_AG, C10D_RS, "aten.mm.default"} & set(cc.targets(gm))


def test_an_unforeseen_form_is_reported_not_raised(monkeypatch):
    from asynctp.compile import patterns

    def broken(result):
        raise KeyError("surprise")

    monkeypatch.setattr(patterns, "consumer_matmuls", broken)
    gm, (rec,) = rewrite(lambda x, w: cc.gather(x, 0) @ w, (4, 8), (8, 6))
    assert not rec.fused and "could not analyse this form (KeyError" in rec.reason
    assert C10D_AG in cc.targets(gm)  # the graph is left as it was


def test_slice_cat_forms():
    """Some torch versions reassemble with slices instead of split + getitem."""

    def f(x, w):
        rows = cc.gather(x, 0)  # [2 * 2, 3, 8], rank-major
        a = torch.cat([rows[0:2], rows[2:4]], dim=1)  # gathered along dim 1
        p = a @ w  # [2, 6, 6]
        return cc.reduce_scatter(torch.cat([p[:, 0:3], p[:, 3:6]], dim=0), 0)  # scattered along dim 1

    gm, records = rewrite(f, (2, 3, 8), (8, 6))
    assert [(r.kind, r.fused, r.dim) for r in records] == [("all-gather", True, 1), ("reduce-scatter", False, 1)]
    # the product feeds the reduce-scatter directly: the gather's op took the matmul, so the
    # reduce-scatter has no matmul left to fuse with
    assert "not a matmul" in records[1].reason


def test_slice_cat_reduce_scatter():
    def f(a, b):
        p = a @ b  # [2, 6, 6]
        return cc.reduce_scatter(torch.cat([p[:, 0:3], p[:, 3:6]], dim=0), 0)

    gm, (rec,) = rewrite(f, (2, 6, 8), (8, 6))
    assert rec.fused and rec.dim == 1 and fused_node(gm, RS).args[2] == 1


# --- batch 1: funcol views the gathered rows instead of split + cat ------------------------------


def gather_view(x, dim):
    """cc.gather(x, dim) as funcol writes it when every shard dim before `dim` has size 1: the
    rank-major rows, viewed (no data moves)."""
    shape = list(x.shape)
    shape[dim] *= cc.FAKE_WORLD
    return cc.gather(x, 0).view(shape)


def rewrite_as_inductor(fn, *shapes):
    """rewrite() on the graph as inductor's post-grad passes see it: its view_to_reshape has
    made every aten.view an aten.reshape (the node keeps its name, view_N)."""
    gm = cc.trace(fn, *shapes)
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    before = cc.output_shapes(gm)
    records = rewrite_graph(gm.graph)
    gm.recompile()
    assert cc.output_shapes(gm) == before
    return gm, records


@pytest.mark.parametrize("as_inductor", [False, True], ids=["view", "reshape"])
def test_gather_batch1_view_form(as_inductor):
    f = lambda x, w: torch.nn.functional.linear(gather_view(x, 1), w)  # noqa: E731
    gm, (rec,) = (rewrite_as_inductor if as_inductor else rewrite)(f, (1, 4, 8), (6, 8))
    assert rec.fused and rec.dim == 1 and rec.shape == (1, 4, 8)
    node = fused_node(gm, AG)
    assert node.args[2] == 1 and node.args[4] is False
    assert not {C10D_AG, "aten.mm.default"} & set(cc.targets(gm))


def test_gather_batch1_funcol_as_this_torch_writes_it():
    gm, (rec,) = rewrite(lambda x, w: cc.gather(x, 1) @ w, (1, 4, 8), (8, 6))
    assert rec.fused and rec.dim == 1 and fused_node(gm, AG).args[2] == 1


def test_gather_batch1_last_dim_view_form():
    gm, (rec,) = rewrite(lambda x, w: gather_view(x, 2) @ w, (1, 1, 4), (8, 6))
    assert rec.fused and rec.dim == 2 and fused_node(gm, AG).args[2] == 2


def test_gather_batch1_qkv_with_the_flat_a_saved():
    """The 8B block's forward (batch 1): x gathered into q, k and v (bias on v); the flattened
    gathered x is saved for the weight gradients."""

    def f(x, wq, wk, wv, bv):
        a2 = gather_view(x, 1).reshape(-1, 8)
        q, k, v = a2 @ wq.t(), a2 @ wk.t(), torch.addmm(bv, a2, wv.t())
        return q.reshape(1, 8, 8), k.reshape(1, 8, 4), v.reshape(1, 8, 4), a2

    gm, (rec,) = rewrite_as_inductor(f, (1, 4, 8), (8, 8), (4, 8), (4, 8), (4,))
    assert rec.fused and rec.dim == 1 and rec.num_matmuls == 3
    node = fused_node(gm, AG)
    assert node.args[4] is True and node.args[5][2] is not None
    assert not {C10D_AG, "aten.mm.default", "aten.addmm.default"} & set(cc.targets(gm))


def test_gather_batch1_backward_dgrad_fused_wgrad_reads_a():
    """The 8B block's backward (batch 1): the gathered output grad is A of the input-grad matmul
    and, transposed, of the weight-grad matmul (which reads the op's a_gathered)."""

    def f(dy, w, x2):
        dy2 = gather_view(dy, 1).reshape(-1, 8)
        return (dy2 @ w).reshape(1, 8, 6), dy2.t() @ x2

    gm, (rec,) = rewrite_as_inductor(f, (1, 4, 8), (8, 6), (8, 5))
    assert rec.fused and rec.dim == 1 and rec.num_matmuls == 1
    assert fused_node(gm, AG).args[4] is True
    assert cc.targets(gm).count("aten.mm.default") == 1  # the weight gradient's


def test_view_of_the_rows_with_batch_2_is_not_a_gather():
    """[R * 2, 3, 8] viewed as [2, 6, 8] interleaves the ranks' rows: not a gather along dim 1."""
    _, (rec,) = rewrite(lambda x, w: cc.gather(x, 0).view(2, 6, 8) @ w, (2, 3, 8), (8, 6))
    assert not rec.fused and rec.dim == 0 and rec.reason.startswith("gather feeds no matmul")


def test_gathered_rows_also_read_elsewhere():
    def f(x, w):
        rows = cc.gather(x, 0)
        return rows.view(1, 8, 8) @ w, rows.sum()

    _, (rec,) = rewrite(f, (1, 4, 8), (8, 6))
    assert not rec.fused and "the gathered rows are also used by" in rec.reason
