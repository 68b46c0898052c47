"""Faults, mismatched calls, non-finite inputs, several groups: clear errors on every rank,
no hangs (cpu backend, gloo)."""

import pytest

from tests import cases_reliability as cases
from tests.multiprocess import RankPool

DEVICE = "cpu"


@pytest.fixture
def fresh_pool():
    """Faults leave ranks out of step: each fault test gets its own pool."""
    p = RankPool(2, backend="gloo", call_timeout=60)
    yield p
    p.close()


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_peer_that_skips_the_op_surfaces_as_timeout(fresh_pool, op):
    (kind, (message, seconds)), (kind1, value1) = fresh_pool.run_outcomes(cases.peer_skips_op, DEVICE, op)
    assert kind == "ok" and kind1 == "ok"
    assert message.startswith("PeerTimeoutError"), message
    assert "rank 0" in message and "rank 1" in message and ("all_gather_matmul" if op == "ag" else "matmul_reduce_scatter") in message
    assert seconds < 30


def test_peer_that_never_joins_the_workspace_surfaces_as_timeout(fresh_pool):
    (kind, (message, seconds)), _ = fresh_pool.run_outcomes(cases.peer_never_joins_the_workspace, DEVICE)
    assert kind == "ok" and message.startswith("PeerTimeoutError"), message
    assert "workspace rendezvous" in message and "from rank 1" in message and seconds < 30


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_peer_that_dies_mid_op_surfaces_as_timeout(fresh_pool, op):
    outcomes = fresh_pool.run_outcomes(cases.peer_dies_mid_op, DEVICE, op)
    assert outcomes[1][0] == "died"
    kind, (message, seconds) = outcomes[0]
    assert kind == "ok" and message.startswith("PeerTimeoutError"), message
    assert "from rank 1" in message and seconds < 30


def test_mismatched_metadata_raises_the_same_error_everywhere(pool):
    messages = pool.run(cases.mismatched_calls_raise_everywhere, DEVICE)
    assert all(m == messages[0] for m in messages)


def test_nonfinite_inputs_raise_everywhere(pool):
    messages = pool.run(cases.nonfinite_inputs_raise_everywhere, DEVICE)
    assert all(m == messages[0] for m in messages)


def test_two_groups_and_growth(pool):
    pool.run(cases.two_groups_interleaved, DEVICE)
