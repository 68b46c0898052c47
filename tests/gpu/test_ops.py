"""The fused ops on the cuda backend (all local GPUs): the CPU tier's checks, plus CUDA graphs
and random-valued inputs against the serial strategy."""

import re

import pytest

from tests import cases, cases_repeat

DEVICE = "cuda"


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto", "ring"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_gather_matmul(pool, dtype, strategy):
    assert pool.run(cases.all_gather_matmul_grid, DEVICE, dtype, strategy)[0] == 28


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto", "ring"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_reduce_scatter(pool, dtype, strategy):
    assert pool.run(cases.matmul_reduce_scatter_grid, DEVICE, dtype, strategy)[0] == 28


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto", "ring"])
def test_matmul_sum_reduce_scatter(pool, strategy):
    assert pool.run(cases.matmul_sum_reduce_scatter_grid, DEVICE, "bfloat16", strategy)[0] == 18


def test_matmul_sum_reduce_scatter_large_and_replayed(pool):
    pool.run(cases.large_sum_pipeline_matches_cat)


def test_outputs_do_not_alias_workspace(pool):
    pool.run(cases.outputs_do_not_alias, DEVICE)


def test_bad_inputs_raise_before_communication(pool):
    messages = pool.run(cases.bad_inputs, DEVICE)
    same = [[re.sub(r"cuda:\d", "cuda:N", m) for m in per_rank] for per_rank in messages]
    assert all(m == same[0] for m in same)  # the same errors on every rank (up to its device)


def test_opcheck(pool):
    pool.run(cases.opcheck_ops, DEVICE)


def test_200_random_calls(pool):
    assert pool.run(cases.random_calls, DEVICE, 200, 7)[0] == 200


def test_large_random_values_match_serial(pool):
    pool.run(cases.large_pipeline_matches_serial)


def test_cuda_graph_capture_after_reserve(pool):
    pool.run(cases.cuda_graph_capture)


def test_group_without_workspace_warns_and_uses_the_ring(pool):
    pool.run(cases.no_workspace_fallback, DEVICE)


def test_low_contention_collectives(pool):
    assert pool.run(cases.low_contention_collectives, DEVICE)[0] == 10


@pytest.mark.parametrize("strategy", ["pipeline", "fused"])
def test_repeat_calls_replay_directly(pool, strategy):
    """A call equal to one that replayed from a CUDA graph replays without the op's checks and plan
    (asynctp/ops/repeat.py), exact, and falls back to the full call wherever that could differ."""
    counts = pool.run(cases_repeat.repeat_calls, DEVICE, strategy)
    assert counts[0]["replayed directly"] == 3 * 4 and counts[0]["captured"] == 2 * 4, counts


def test_pipelined_calls_replayed_from_cuda_graphs(pool):
    counts = pool.run(cases.graph_replays)
    print(counts)
