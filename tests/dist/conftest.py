"""tests/dist: real multi-process gloo on CPU through the cpu symmetric backend (world sizes 2, 3)."""

import pytest

from tests.multiprocess import RankPool


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def pool(request):
    p = RankPool(request.param, backend="gloo")
    yield p
    p.close()
