"""The fault table (cpu backend, gloo, world sizes 2 and 3): every fault gives a clear error
within the timeout on every rank, naming the ranks; the group refuses calls until
asynctp.reset and works after it; /dev/shm holds no more asynctp files than before.
Also: dead ranks, group lifetimes, non-finite inputs, several groups."""

import pytest

from tests import cases_faults as faults
from tests import cases_reliability as cases
from tests.multiprocess import RankPool

DEVICE = "cpu"
MISMATCHES = [name for name in faults.FAULTS if "differ" in name or " vs " in name]
TIMEOUTS = [name for name in faults.FAULTS if name.startswith(("skipped", "straggler", "interrupt"))]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def table_pool(request):
    p = RankPool(request.param, backend="gloo", call_timeout=60)
    yield p
    p.close()


@pytest.mark.parametrize("name", MISMATCHES)
def test_mismatch_raises_the_same_error_everywhere(table_pool, name):
    reports = table_pool.run(faults.inject, name)
    messages = [r["message"] for r in reports]
    assert all(m == messages[0] for m in messages), messages
    assert messages[0].startswith("CallMismatchError"), messages[0]
    last = table_pool.world_size - 1
    assert f"rank {last}" in messages[0] or f"ranks {last}" in messages[0] or f", {last}" in messages[0], messages[0]
    for r in reports:
        assert r["seconds"] < faults.TIMEOUT, r
        assert r["refused"].startswith("OutOfStepError") and "asynctp.reset(group)" in r["refused"], r
        assert r["shm_after"] == r["shm_before"], r


@pytest.mark.parametrize("name", TIMEOUTS)
def test_timeout_faults_name_the_ranks_and_recover(table_pool, name):
    reports = table_pool.run(faults.inject, name)
    last = table_pool.world_size - 1
    for rank, r in enumerate(reports):
        assert r["shm_after"] == r["shm_before"], r
        if name.startswith("skipped") and rank == last:
            assert r["message"] == "no error"
            continue
        if name.startswith("interrupt") and rank == last:
            assert r["message"].startswith("KeyboardInterrupt"), r
        else:
            assert r["message"].startswith("PeerTimeoutError"), r
            assert f"rank {rank} of group" in r["message"]
            # every missing rank is named (the straggler names all of the others)
            missing = [last] if rank != last else list(range(last))
            who = f"rank {missing[0]}" if len(missing) == 1 else "ranks " + ", ".join(map(str, missing))
            assert f"from {who}" in r["message"], r["message"]
            assert r["seconds"] < 2 * faults.TIMEOUT + 1, r
        assert r["refused"].startswith("OutOfStepError") and "since" in r["refused"], r


def test_two_threads_on_one_group_get_a_clear_error(table_pool):
    for r in table_pool.run(faults.inject, "two threads on one group"):
        assert r["message"].startswith("ValueError") and "another thread" in r["message"], r
        assert r["shm_after"] == r["shm_before"], r


@pytest.mark.parametrize("how", ["mid-op", "growth"])
def test_killed_rank_is_named_and_leaves_no_file(how):
    pool = RankPool(2, backend="gloo", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(faults.die, how)
    finally:
        pool.close()
    assert outcomes[1][0] == "died"
    kind, report = outcomes[0]
    assert kind == "ok", outcomes[0]
    assert report["message"].startswith("PeerTimeoutError") and "from rank 1" in report["message"], report
    assert report["seconds"] < 2 * faults.TIMEOUT + 1
    assert report["shm_after"] == [], report


@pytest.fixture
def fresh_pool():
    """Faults leave ranks out of step: each fault test gets its own pool."""
    p = RankPool(2, backend="gloo", call_timeout=60)
    yield p
    p.close()


def test_peer_that_never_joins_the_workspace_surfaces_as_timeout(fresh_pool):
    (kind, (message, seconds)), _ = fresh_pool.run_outcomes(cases.peer_never_joins_the_workspace, DEVICE)
    assert kind == "ok" and message.startswith("PeerTimeoutError"), message
    assert "workspace creation" in message and "from rank 1" in message and seconds < 30


def test_groups_destroyed_and_recreated_release_their_workspaces(fresh_pool):
    reports = fresh_pool.run(faults.group_cycles, 5)
    for r in reports:
        assert r["final"] <= r["mapped"][0], r  # nothing accumulates across the cycles
        assert r["workspaces"] == 1, r  # only WORLD's


def test_mismatched_metadata_raises_the_same_error_everywhere(pool):
    messages = pool.run(cases.mismatched_calls_raise_everywhere, DEVICE)
    assert all(m == messages[0] for m in messages)


def test_nonfinite_inputs_raise_everywhere(pool):
    messages = pool.run(cases.nonfinite_inputs_raise_everywhere, DEVICE)
    assert all(m == messages[0] for m in messages)


def test_two_groups_and_growth(pool):
    pool.run(cases.two_groups_interleaved, DEVICE)


def test_zero_size_inputs_give_empty_results_on_every_strategy(pool):
    pool.run(faults.zero_sizes)


@pytest.mark.parametrize("fault", ["rows differ", "strategy differs"])
def test_group_without_workspace_compares_the_call(pool, fault):
    reports = pool.run(faults.ring_without_workspace, fault)
    messages = [r["message"] for r in reports]
    assert all(m == messages[0] for m in messages), messages
    assert messages[0].startswith("CallMismatchError"), messages[0]
    assert ("a_shard.shape" if fault == "rows differ" else "strategy") in messages[0]
    assert all(r["refused"].startswith("OutOfStepError") for r in reports), reports


def test_group_without_workspace_times_out_naming_the_rank(pool):
    reports = pool.run(faults.ring_without_workspace, "skipped call")
    last = pool.world_size - 1
    assert reports[last]["message"] == "skipped"
    for r in reports[:last]:
        assert r["message"].startswith("PeerTimeoutError") and "the start of call" in r["message"], r
        assert r["refused"].startswith("OutOfStepError"), r
