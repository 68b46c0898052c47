"""The fp8 scaled ops and recipes on the cpu backend (gloo, world sizes 2 and 3).

Tiers: exact grids (every scale pairing x 2-D/3-D x every dim x bf16/fp32, atol=0 against a
float64 reference of the dequantized inputs), scale-alignment edge cases, bad input, opcheck,
then the recipes on random data (SQNR >= 25 dB, pipeline == serial, tensorwise scale agreement).
"""

import pytest

from tests import cases_float8 as cases
from tests.cases import under_env
from tests.caps import needs_cpu_rowwise

DEVICE = "cpu"
NUM_GRID_CASES = 4 * 7 * 2  # scale pairings x (ndim, dim) x out dtypes


@needs_cpu_rowwise
@pytest.mark.parametrize("strategy", ["pipeline", "ring", "serial"])  # auto: in the recipes test
def test_all_gather_scaled_matmul(pool, strategy):
    assert pool.run(cases.all_gather_scaled_grid, DEVICE, strategy)[0] == NUM_GRID_CASES


@needs_cpu_rowwise
@pytest.mark.parametrize("strategy", ["pipeline", "ring", "serial"])  # auto: in the recipes test
def test_scaled_matmul_reduce_scatter(pool, strategy):
    assert pool.run(cases.scaled_matmul_reduce_scatter_grid, DEVICE, strategy)[0] == NUM_GRID_CASES


@needs_cpu_rowwise
@pytest.mark.parametrize("env", [{"splits": 3}, {"splits": 3, "ASYNCTP_BATCH_MAJOR": "1"}],
                         ids=["3-blocks", "3-blocks-batch-major"])
def test_pipeline_plans_match_reference(pool, env):
    """Several row blocks, the reduce-scatter's batch-major row order: exact as the default."""
    assert pool.run(under_env, env, cases.all_gather_scaled_grid, DEVICE, "pipeline")[0] == NUM_GRID_CASES
    if "splits" in env:
        assert pool.run(under_env, env, cases.scaled_matmul_reduce_scatter_grid, DEVICE, "pipeline")[0] == NUM_GRID_CASES


@needs_cpu_rowwise
def test_batch_major_ring(pool):
    env = {"ASYNCTP_BATCH_MAJOR": "1"}
    assert pool.run(under_env, env, cases.all_gather_scaled_grid, DEVICE, "ring")[0] == NUM_GRID_CASES
    assert pool.run(under_env, env, cases.scaled_matmul_reduce_scatter_grid, DEVICE, "ring")[0] == NUM_GRID_CASES


@needs_cpu_rowwise
@pytest.mark.parametrize("splits", [None, 3], ids=["whole-chunks", "3-row-blocks"])
def test_misaligned_scale_slices(pool, splits):
    assert pool.run(cases.alignment_cases, DEVICE, splits)[0] == 8 * 3 * 4 + 2


@needs_cpu_rowwise
def test_gather_that_returns_the_scales(pool):
    assert pool.run(cases.with_scale_cases, DEVICE)[0] == 12


def test_bad_inputs_raise_before_communication(pool):
    messages = pool.run(cases.bad_inputs, DEVICE)
    assert all(m == messages[0] for m in messages)  # the same error on every rank


@needs_cpu_rowwise
def test_opcheck(pool):
    pool.run(cases.opcheck_ops, DEVICE)


@needs_cpu_rowwise
def test_recipes_sqnr_and_scale_agreement(pool):
    sqnrs = pool.run(cases.recipes, DEVICE)
    assert min(min(r.values()) for r in sqnrs) >= 25


# -- no process group needed ---------------------------------------------------------------------


def test_recipe_config():
    import dataclasses

    import torch

    from asynctp.float8 import Float8Recipe

    rowwise, tensorwise = Float8Recipe.from_name("rowwise"), Float8Recipe.from_name("tensorwise")
    assert (rowwise.scaling, rowwise.power_of_2_scales) == ("rowwise", True)
    assert (tensorwise.scaling, tensorwise.activation_dtype) == ("tensorwise", torch.float8_e4m3fn)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rowwise.scaling = "tensorwise"
    with pytest.raises(TypeError):
        Float8Recipe("rowwise")  # keyword-only
    bad = [
        (ValueError, "scaling requires one of", dict(scaling="blockwise")),
        (ValueError, "activation_dtype requires one of", dict(activation_dtype=torch.bfloat16)),
        (ValueError, "no e5m2 x e5m2 GEMM", dict(weight_dtype=torch.float8_e5m2)),
        (ValueError, "amax_eps requires a positive finite float", dict(amax_eps=0.0)),
        (TypeError, "use_fast_accum requires a bool", dict(use_fast_accum=1)),
    ]
    for exc, text, kwargs in bad:
        with pytest.raises(exc, match=text):
            Float8Recipe(**kwargs)
    with pytest.raises(ValueError, match="from_name requires one of"):
        Float8Recipe.from_name("delayed")


def test_quantize_conventions():
    """scale is the dequantization multiplier; the fp8 tensor saturates; rowwise shapes."""
    import torch

    from asynctp.float8 import Float8Recipe, quantize_activation, quantize_weight

    x = torch.tensor([[1.0, -448.0 * 4, 3072.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    x_fp8, x_scale = quantize_activation(x, Float8Recipe.from_name("rowwise"), None)
    assert x_scale.shape == (2, 1) and x_scale.dtype == torch.float32
    assert torch.equal(x_fp8.float() * x_scale, x.float())  # power-of-two scale: exact round trip
    assert x_scale[0, 0] == 8.0 and x_scale[1, 0] > 0  # amax 3072 -> 8 * 448 (next power of two); all-zero row: eps, not 0
    from asynctp.float8.quantize import to_float8

    saturated = to_float8(x, torch.tensor(1.0), torch.float8_e4m3fn)
    assert float(saturated.float().abs().max()) == 448.0  # fp8_max: clamped, never nan
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_weight(w, Float8Recipe.from_name("tensorwise"))
    assert w_scale.shape == () and w_fp8.shape == (32, 64)
    assert float((w_fp8.float() * w_scale).abs().max()) == pytest.approx(float(w.float().abs().max()), rel=1e-2)
    with pytest.raises(TypeError, match="recipe requires a Float8Recipe"):
        quantize_weight(w, "rowwise")
    with pytest.raises(TypeError, match="x_hp requires a dtype in"):
        quantize_activation(w_fp8, Float8Recipe.from_name("rowwise"), None)


def test_mismatched_tensorwise_scale_caught_by_consistency_check(pool):
    messages = pool.run(cases.mismatched_tensorwise_scale_is_caught, DEVICE)
    assert all(m == messages[0] for m in messages)
