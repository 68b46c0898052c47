"""asynctp.all_gather_linear / linear_reduce_scatter on the cpu backend: outputs and every grad
against the float64 serial reference (small integers, atol=0), layers in a row, bad input."""

import pytest

from tests import cases_nn

DEVICE = "cpu"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linears_match_serial_reference(pool, dtype):
    assert pool.run(cases_nn.linear_grid, DEVICE, dtype)[0] == 18


def test_linears_serial_strategy(pool):
    assert pool.run(cases_nn.linear_grid, DEVICE, "float32", "serial")[0] == 18


@pytest.mark.parametrize("save", [False, True], ids=["regather", "saved"])
def test_two_layers_in_a_row(pool, save):
    pool.run(cases_nn.two_layers_in_a_row, DEVICE, save)


def test_wgrad_contraction(pool):
    assert pool.run(cases_nn.contract_cases, DEVICE)[0] == 12


def test_compiled_regather_wgrad(pool):
    assert pool.run(cases_nn.compiled_regather_matches_eager, DEVICE, timeout=600)[0] == 3


def test_bad_inputs(pool):
    messages = pool.run(cases_nn.bad_linear_inputs, DEVICE)
    assert all(m == messages[0] for m in messages)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_recipes_by_sqnr(pool, recipe):
    worst = pool.run(cases_nn.float8_linears, DEVICE, recipe, "float32")[0]
    assert worst["out"] >= 25, worst
    assert min(worst.values()) >= 18, worst
