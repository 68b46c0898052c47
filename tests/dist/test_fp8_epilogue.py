"""ASYNCTP_FP8_EPILOGUE=1 (an experiment): on 2 ranks the fp8 reduce-scatter's own blocks add the
received partial in the Triton GEMM's epilogue (asynctp/ops/triton_scaled_mm.py). Here on the cpu
backend, the kernel under Triton's CPU interpreter (TRITON_INTERPRET=1 in the ranks' environment
from their start): the exact grid (small integers, atol=0 against the float64 reference), one row
block and three, and on 3 ranks the warning that the switch does not apply. Skips where Triton
is not installed (the CPU CI installs torch only)."""

import os

import pytest

from tests import cases_float8 as cases
from tests.cases import under_env
from tests.caps import needs_cpu_rowwise
from tests.multiprocess import RankPool

pytest.importorskip("triton")

DEVICE = "cpu"
NUM_GRID_CASES = 4 * 7 * 2  # as tests/dist/test_float8.py


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def pool(request):
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the ranks, set before they import triton
    try:
        p = RankPool(request.param, backend="gloo")
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
    yield p
    p.close()


@needs_cpu_rowwise
@pytest.mark.parametrize("splits", ["1", "3"])
def test_fused_epilogue_matches_reference(pool, splits):
    env = {"ASYNCTP_FP8_EPILOGUE": "1", "ASYNCTP_SPLITS": splits}
    assert pool.run(under_env, env, cases.scaled_matmul_reduce_scatter_grid, DEVICE, "pipeline")[0] == NUM_GRID_CASES
    used = pool.run(under_env, env, cases.fp8_epilogue_used, DEVICE)
    assert all(used) if pool.world_size == 2 else not any(used)
