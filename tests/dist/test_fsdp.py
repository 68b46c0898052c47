"""FSDP2 x TP on CPU (gloo, 4 ranks: dp 2 x tp 2): fully_shard over dp around the demo's Llama
with asynctp's TP styles gives the loss and gradients of vanilla 2-D parallelism, eager and
compiled."""

from __future__ import annotations

import pytest

from tests import cases_fsdp
from tests.multiprocess import RankPool


@pytest.fixture(scope="module")
def pool():
    p = RankPool(4, backend="gloo")
    yield p
    p.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fsdp_tp_matches_vanilla(pool, compiled):
    worst = pool.run(cases_fsdp.fsdp_tp_matches_vanilla, "cpu", compiled, timeout=600)
    assert max(worst) <= 1e-5, worst
