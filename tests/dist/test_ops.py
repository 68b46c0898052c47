"""The fused bf16/fp32 ops on the cpu backend: every dim, dtype and strategy against the plain
reference (atol=0), aliasing, bad input, opcheck, and a long run of random calls."""

import pytest

from tests import cases, cases_repeat

DEVICE = "cpu"


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto", "ring"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_gather_matmul(pool, dtype, strategy):
    counts = pool.run(cases.all_gather_matmul_grid, DEVICE, dtype, strategy)
    assert counts[0] == 28


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto", "ring"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_reduce_scatter(pool, dtype, strategy):
    counts = pool.run(cases.matmul_reduce_scatter_grid, DEVICE, dtype, strategy)
    assert counts[0] == 28


@pytest.mark.parametrize("strategy", ["pipeline", "serial", "auto", "ring"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_sum_reduce_scatter(pool, dtype, strategy):
    assert pool.run(cases.matmul_sum_reduce_scatter_grid, DEVICE, dtype, strategy)[0] == 18


def test_matmul_sum_reduce_scatter_plans(pool):
    """Three row blocks per chunk, the batch-major order: exact too."""
    for env in ({"splits": 3}, {"ASYNCTP_BATCH_MAJOR": "1", "splits": 3}):
        assert pool.run(cases.under_env, env, cases.matmul_sum_reduce_scatter_grid, DEVICE, "float32", "pipeline")[0] == 18


# the default plan is one row block (shapes this small): several row blocks per chunk must give
# the same exact results
@pytest.mark.parametrize("env", [{"splits": 3}], ids=["3-blocks"])
def test_pipeline_plans_match_reference(pool, env):
    assert pool.run(cases.under_env, env, cases.all_gather_matmul_grid, DEVICE, "float32", "pipeline")[0] == 28
    if "splits" in env:
        assert pool.run(cases.under_env, env, cases.matmul_reduce_scatter_grid, DEVICE, "float32", "pipeline")[0] == 28


@pytest.mark.parametrize("strategy", ["pipeline", "ring"])
@pytest.mark.parametrize("splits", ["1", "3"])
def test_batch_major_order_matches_reference(pool, strategy, splits):
    """ASYNCTP_BATCH_MAJOR=1: a gather / scatter dim behind leading dims keeps the caller's row
    order (a rank's rows in runs, one GEMM each; 3 row blocks straddle the runs): exact as the
    default."""
    env = {"ASYNCTP_BATCH_MAJOR": "1", "splits": int(splits)}
    assert pool.run(cases.under_env, env, cases.all_gather_matmul_grid, DEVICE, "float32", strategy)[0] == 28
    assert pool.run(cases.under_env, env, cases.matmul_reduce_scatter_grid, DEVICE, "float32", strategy)[0] == 28


def test_batch_major_is_the_default_for_long_runs(pool):
    assert pool.run(cases.batch_major_by_default, DEVICE)[0] == 4


def test_outputs_do_not_alias_workspace(pool):
    pool.run(cases.outputs_do_not_alias, DEVICE)


def test_bad_inputs_raise_before_communication(pool):
    messages = pool.run(cases.bad_inputs, DEVICE)
    assert all(m == messages[0] for m in messages)  # the same error on every rank


def test_opcheck(pool):
    pool.run(cases.opcheck_ops, DEVICE)


def test_200_random_calls(pool):
    assert pool.run(cases.random_calls, DEVICE, 200, 7)[0] == 200


def test_group_without_workspace_warns_and_uses_the_ring(pool):
    pool.run(cases.no_workspace_fallback, DEVICE)


def test_low_contention_collectives(pool):
    assert pool.run(cases.low_contention_collectives, DEVICE)[0] == 10


@pytest.fixture(scope="module")
def pool4():
    from tests.multiprocess import RankPool

    p = RankPool(4, backend="gloo")
    yield p
    p.close()


@pytest.mark.parametrize("strategy", ["pipeline", "ring"])
def test_world_size_4(pool4, strategy):
    """Every dim of both ops at 4 ranks (more peers than the 2-3 above: ring order, signals
    per source, pushes to several owners)."""
    assert pool4.run(cases.all_gather_matmul_grid, DEVICE, "float32", strategy)[0] == 28
    assert pool4.run(cases.matmul_reduce_scatter_grid, DEVICE, "bfloat16", strategy)[0] == 28


def test_fused_without_the_gemm_runs_the_decomposition_and_is_counted(pool):
    counts = pool.run(cases.fused_on_cpu_counted_as_decomposed, DEVICE)
    assert counts == [{"all_gather_matmul fused": 1, "all_gather_matmul fused: decomposed": 1}] * pool.world_size


@pytest.mark.parametrize("strategy", ["pipeline", "auto"])
def test_repeat_calls_replay_directly(pool, strategy):
    """A call equal to one that replayed from the graph cache replays without the op's checks and
    plan (asynctp/ops/repeat.py; a stand-in capture on CPU), exact, and falls back to the full
    call wherever that could differ."""
    counts = pool.run(cases_repeat.repeat_calls, DEVICE, strategy)
    assert counts[0]["replayed directly"] == 3 * 4 and counts[0]["captured"] == 2 * 4, counts
