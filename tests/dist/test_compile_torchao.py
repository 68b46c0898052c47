"""tests/dist: the torch.compile pass on torchao Float8Linear-converted models (world size 2, gloo,
cpu backend): a sequence-parallel MLP (w1, w3 column-parallel, w2 row-parallel) converted with
the tensorwise or rowwise recipe, compiled by inductor with and without the pass. The fusion
report lists, per collective, what was fused and why not; loss and gradients with the pass equal
those of the vanilla-styles model compiled without it, bit for bit: at world size 2 each
reduction adds exactly two bf16 partials (commutative, rounded once either way), each rank's
matmuls run on the same rows with the same CPU kernel, and both style sets quantize to the same
float8 values (see tests/cases_compile_torchao.py). Two inductor compilations per case and rank.
"""

import pytest

from asynctp.compile.rewrite import HP_GATHER_CAST
from tests import cases_compile_torchao as cases  # imports torchao in the rank processes only
from tests.multiprocess import RankPool

pytest.importorskip("torchao.float8", reason="torchao (float8 training) is not installed: pip install torchao")

AG = "asynctp.all_gather_scaled_matmul"
RS = "asynctp.scaled_matmul_reduce_scatter"
# why the collectives that stay unfused do, by kind (vanilla styles only)
UNFUSED_REASON = {
    # plain ColwiseParallel gathers in bf16 and Float8Linear casts afterwards
    "all-gather": HP_GATHER_CAST,
    # rowwise dgrads run _scaled_mm with unit scales and rescale after it (no fast accumulation)
    "reduce-scatter": "the _scaled_mm product is multiplied by scales before the reduction",
}
# (graph, collective, dim, asynctp op or None, matmuls folded in) per collective, in graph order:
# forward: x gathered for w1 and w3, w2's output reduce-scattered; backward: w2's output gradient
# gathered for its dgrad, the dgrads of w1 and w3 reduce-scattered
CASES = {
    # torchao's Float8ColwiseParallel / Float8RowwiseParallel gather the float8 tensors: all fused
    "tensorwise-float8-styles": ("tensorwise", True, [
        ("forward", "all-gather", 1, AG, 2), ("forward", "reduce-scatter", 1, RS, 1),
        ("backward", "all-gather", 1, AG, 1), ("backward", "reduce-scatter", 1, RS, 1),
        ("backward", "reduce-scatter", 1, RS, 1),
    ]),
    # backward dgrads: A is cast to float8 after flattening (a 2-D A) and still fuses
    "tensorwise-vanilla-styles": ("tensorwise", False, [
        ("forward", "all-gather", 1, None, 0), ("forward", "reduce-scatter", 1, RS, 1),
        ("backward", "all-gather", 1, None, 0), ("backward", "reduce-scatter", 1, RS, 1),
        ("backward", "reduce-scatter", 1, RS, 1),
    ]),
    # torchao gathers float8 tensorwise only: rowwise runs under vanilla styles
    "rowwise-vanilla-styles": ("rowwise", False, [
        ("forward", "all-gather", 1, None, 0), ("forward", "reduce-scatter", 1, RS, 1),
        ("backward", "all-gather", 1, None, 0), ("backward", "reduce-scatter", 1, None, 0),
        ("backward", "reduce-scatter", 1, None, 0),
    ]),
}


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, backend="gloo")
    yield p
    p.close()


@pytest.mark.parametrize("case", list(CASES))
def test_fusion_report_and_same_loss_and_grads(pool, case):
    recipe, float8_styles, expected = CASES[case]
    results = pool.run(cases.compiled_float8_variants, recipe, float8_styles, timeout=600)
    got = results[0]
    assert all(r["text"] == got["text"] for r in results), "ranks disagree on the fusion report"
    for rank, r in enumerate(results):
        # atol 0: see the module docstring for why the pass must not change a single bit here
        assert all(err == 0.0 for err in r["errors"].values()), f"rank {rank}: {r['errors']}\n{got['text']}"
    assert [rec[:5] for rec in got["records"]] == expected, got["text"]
    for _, kind, _, op, _, reason in got["records"]:
        assert op is not None or UNFUSED_REASON[kind] in reason, got["text"]
