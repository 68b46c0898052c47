"""tests/dist: the torch.compile pass end to end on gloo (world size 2, cpu backend): a tiny
sequence-parallel Llama-style block (causal attention + MLP) built with DTensor's ColwiseParallel /
RowwiseParallel, compiled by inductor with and without the pass, gives the same loss and
gradients, and the fusion report lists every expected fusion in forward and backward; and
the fp8 forms (type-erased gather with rowwise scales, scaled matmul -> reduce-scatter).
Two inductor compilations per test and rank: slow on CPU, so few tests."""

import pytest

from tests import cases_compile
from tests.caps import needs_cpu_rowwise


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["world2"])
def test_compiled_block_same_loss_and_grads(pool):
    results = pool.run(cases_compile.compiled_block_matches, "cpu", timeout=900)
    got = results[0]
    assert all(r["text"] == got["text"] for r in results), "ranks disagree on the fusion report"
    assert got["graphs"] == ["forward", "backward"], got["text"]
    assert got["unfused"] == [], got["text"]
    # forward: x -> q, k, v (one gather, 3 matmuls), h -> w1, w3 (2); wo and w2 reduce-scatter.
    # backward: the output grads of wo and w2 are gathered (dgrad), and the input grads of the five
    # column-parallel linears, one reduce-scatter each, are summed: merged into one op for wq / wk
    # / wv (3 matmuls) and one for w1 / w3 (2), the three others folded into them (0)
    assert got["ag"] == 4 and got["rs"] == 7, got["text"]
    assert got["matmuls"] == [1, 1, 2, 3], got["text"]
    assert got["rs_matmuls"] == [0, 0, 0, 1, 1, 2, 3], got["text"]


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["world2"])
def test_compiled_block_batch1_same_loss_and_grads(pool):
    """Batch 1 (as in the 8B timing): funcol gathers the sequence as a view of the rows."""
    got = pool.run(cases_compile.compiled_block_matches, "cpu", 1, timeout=900)[0]
    assert got["unfused"] == [], got["text"]
    assert got["ag"] == 4 and got["rs"] == 7, got["text"]
    assert got["matmuls"] == [1, 1, 2, 3] and got["rs_matmuls"] == [0, 0, 0, 1, 1, 2, 3], got["text"]


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["world2"])
def test_compiled_demo_model_grads_match_without_the_pass(pool):
    """The demo model (GQA, RoPE, batch 4), one step compiled with the pass against without it:
    every gradient equal to float32 rounding (torch's own pass is wrong here at batch 2 on GPUs)."""
    got = pool.run(cases_compile.demo_model_grads_match, "cpu", timeout=900)[0]
    # all but the embedding's reduce-scatter and its backward gather (no matmul there)
    assert got["fused"] > 0 and len(got["unfused"]) == 2, got["text"]
    assert all("not a matmul" in u or "feeds no matmul" in u for u in got["unfused"]), got["text"]
    assert got["max_rel"] <= 1e-5, got
    assert got["loss_diff"] <= 1e-4, got  # a loss near 4: float32 rounding


@needs_cpu_rowwise
@pytest.mark.parametrize("pool", [2], indirect=True, ids=["world2"])
def test_compiled_fp8_same_result(pool):
    got = pool.run(cases_compile.compiled_fp8_matches, "cpu", timeout=600)[0]
    assert got["graphs"] == 1, got["text"]  # one graph: no break kept a gather out of the pass
    assert got["unfused"] == [], got["text"]
    # the rowwise scale's gather is folded into A's: 2 gathers, 1 op
    assert got["ag"] == 2 and got["rs"] == 1, got["text"]


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["world2"])
def test_classic_plan_compiled_per_block(pool):
    """The classic plan (one gather per parent) compiled block by block: every collective of every
    block fuses, the summed input gradients of wq / wk / wv and w1 / w3 included, and loss and
    gradients equal the blocks compiled without the pass."""
    from tests import cases_compile_blocks

    got = pool.run(cases_compile_blocks.per_block_classic_matches, "cpu", timeout=900)[0]
    # one forward and one backward graph, which both blocks run: forward 2 gathers + 2
    # reduce-scatters; backward 2 gathers (wo, w2 dgrads) and 2 reduce-scatters of summed dgrads
    assert got["graphs"] == ["forward", "backward"], got["text"]
    assert got["unfused"] == [] and got["collectives"] == 8, got["text"]
    assert got["ag"] == 4 and got["rs"] == 4 and got["summed"] == [2, 3], got["text"]
    assert got["loss_diff"] <= 1e-5 and got["max_rel"] <= 1e-5, got
