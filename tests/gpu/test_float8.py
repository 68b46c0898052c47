"""The fp8 scaled ops and recipes on the cuda backend (all local GPUs, >= 2; skipped otherwise):
the CPU tier's exact grids, alignment cases, bad input and opcheck on CUDA (cuBLAS / CUTLASS
kernels, which enforce the alignment and layout rules the CPU tier only asserts), plus random
data at GEMM-sized shapes: pipeline == serial, SQNR >= 25 dB."""

import re

import pytest

from tests import cases_float8 as cases

DEVICE = "cuda"
NUM_GRID_CASES = 4 * 7 * 2  # scale pairings x (ndim, dim) x out dtypes


@pytest.mark.parametrize("strategy", ["pipeline", "ring", "serial", "auto"])
def test_all_gather_scaled_matmul(pool, strategy):
    assert pool.run(cases.all_gather_scaled_grid, DEVICE, strategy)[0] == NUM_GRID_CASES


@pytest.mark.parametrize("strategy", ["pipeline", "ring", "serial", "auto"])
def test_scaled_matmul_reduce_scatter(pool, strategy):
    assert pool.run(cases.scaled_matmul_reduce_scatter_grid, DEVICE, strategy)[0] == NUM_GRID_CASES


@pytest.mark.parametrize("splits", [None, 3], ids=["whole-chunks", "3-row-blocks"])
def test_misaligned_scale_slices(pool, splits):
    assert pool.run(cases.alignment_cases, DEVICE, splits)[0] == 8 * 3 * 4 + 2


def test_bad_inputs_raise_before_communication(pool):
    messages = pool.run(cases.bad_inputs, DEVICE)
    # the device case names each rank's own GPU ("requires device cuda:0" on rank 0)
    same = [[re.sub(r"cuda:\d+", "cuda:N", m) for m in per_rank] for per_rank in messages]
    assert all(m == same[0] for m in same)  # the same errors on every rank (up to its device)


def test_opcheck(pool):
    pool.run(cases.opcheck_ops, DEVICE)


def test_recipes_sqnr_and_scale_agreement(pool):
    sqnrs = pool.run(cases.recipes, DEVICE)
    assert min(min(r.values()) for r in sqnrs) >= 25


def test_large_random_values_match_serial(pool):
    sqnrs = pool.run(cases.large_pipeline_matches_serial, DEVICE)
    assert min(min(r.values()) for r in sqnrs) >= 25


def test_cuda_graph_capture_after_reserve(pool):
    pool.run(cases.cuda_graph_capture)


def test_quantize_kernels_match_torch_bit_for_bit(pool):
    assert min(pool.run(cases.quantize_kernels_exact, DEVICE)) > 1000
