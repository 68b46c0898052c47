"""The fp8 scaled ops and recipes on the cpu backend (gloo, world sizes 2 and 3).

Tiers: exact grids (every scale pairing x 2-D/3-D x every dim x bf16/fp32, atol=0 against a
float64 reference of the dequantized inputs), scale-alignment edge cases, bad input, opcheck,
then the recipes on random data (SQNR >= 25 dB, pipeline == serial, tensorwise scale agreement).
"""

import pytest

from tests import cases_float8 as cases

DEVICE = "cpu"
NUM_GRID_CASES = 4 * 7 * 2  # scale pairings x (ndim, dim) x out dtypes


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto"])
def test_all_gather_scaled_matmul(pool, strategy):
    assert pool.run(cases.all_gather_scaled_grid, DEVICE, strategy)[0] == NUM_GRID_CASES


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto"])
def test_scaled_matmul_reduce_scatter(pool, strategy):
    assert pool.run(cases.scaled_matmul_reduce_scatter_grid, DEVICE, strategy)[0] == NUM_GRID_CASES


def test_misaligned_scale_slices(pool):
    assert pool.run(cases.alignment_cases, DEVICE)[0] == 8 * 2 * 4 + 2


def test_bad_inputs_raise_before_communication(pool):
    messages = pool.run(cases.bad_inputs, DEVICE)
    assert all(m == messages[0] for m in messages)  # the same error on every rank


def test_opcheck(pool):
    pool.run(cases.opcheck_ops, DEVICE)


def test_recipes_sqnr_and_scale_agreement(pool):
    sqnrs = pool.run(cases.recipes, DEVICE)
    assert min(min(r.values()) for r in sqnrs) >= 25
