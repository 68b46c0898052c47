"""ASYNCTP_FP8_EPILOGUE's choice of GEMM for the fp8 reduce-scatter's own blocks, and
asynctp.ops.cublaslt's argument checks, which run before any CUDA call (the GEMM itself is a GPU
test: tests/gpu/test_float8.py)."""

import pytest
import torch

from asynctp import config
from asynctp.ops import cublaslt
from asynctp.ops.scaled_matmul_reduce_scatter import _epilogue_kernel

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def fresh_warnings():
    saved = set(config._warned)
    config._warned.clear()
    yield
    config._warned.clear()
    config._warned.update(saved)


@pytest.mark.parametrize("raw", ["", "0"])
def test_epilogue_off_by_default(monkeypatch, raw, recwarn):
    monkeypatch.setenv("ASYNCTP_FP8_EPILOGUE", raw)
    assert _epilogue_kernel(2, "sum", torch.device("cuda", 0)) is None
    assert not recwarn.list


@pytest.mark.parametrize(("raw", "world", "op", "device", "why"), [
    ("bogus", 2, "sum", CPU, "it takes 1, triton or cublaslt, got 'bogus'"),
    ("cublaslt", 3, "sum", CPU, "it applies to 2 ranks summing, got 3 ranks, reduce_op 'sum'"),
    ("cublaslt", 2, "avg", CPU, "it applies to 2 ranks summing, got 2 ranks, reduce_op 'avg'"),
    ("cublaslt", 2, "sum", CPU, "cublaslt needs a CUDA device, got cpu"),
])
def test_epilogue_that_cannot_be_used_warns_and_runs_the_default(monkeypatch, raw, world, op, device, why):
    monkeypatch.setenv("ASYNCTP_FP8_EPILOGUE", raw)
    with pytest.warns(RuntimeWarning, match=f"ASYNCTP_FP8_EPILOGUE={raw} ignored: {why}".replace("(", r"\(").replace(")", r"\)")):
        assert _epilogue_kernel(world, op, device) is None


def test_triton_epilogue_named_either_way(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for raw in ("1", "triton"):
        monkeypatch.setenv("ASYNCTP_FP8_EPILOGUE", raw)
        assert _epilogue_kernel(2, "sum", CPU) == "triton"


def _operands(m=8, k=16, n=4):
    a = torch.ones(m, k).to(E4M3)
    b = torch.ones(n, k).to(E4M3).t()  # column-major, as _scaled_mm takes it
    one = torch.ones(())
    return a, b, one, torch.empty(m, n, dtype=torch.bfloat16)


def test_scaled_mm_lt_checks_its_arguments_first():
    a, b, one, out = _operands()
    with pytest.raises(TypeError, match="requires float8 a and b, got torch.bfloat16"):
        cublaslt.scaled_mm_lt(a.bfloat16(), b, one, one, None, out)
    with pytest.raises(ValueError, match="requires a \\[M, K\\] row-major and b \\[K, N\\] column-major"):
        cublaslt.scaled_mm_lt(a, b.contiguous(), one, one, None, out)
    with pytest.raises(TypeError, match="requires out of bfloat16 or float32, got torch.float16"):
        cublaslt.scaled_mm_lt(a, b, one, one, None, out.half())
    with pytest.raises(ValueError, match="requires c a contiguous torch.bfloat16 \\[8, 4\\], got torch.bfloat16 \\(4, 8\\)"):
        cublaslt.scaled_mm_lt(a, b, one, one, out.t(), out)
    with pytest.raises(ValueError, match="requires out a contiguous"):
        cublaslt.scaled_mm_lt(a, b, one, one, None, torch.empty(8, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="requires c apart from out"):
        cublaslt.scaled_mm_lt(a, b, one, one, out, out)
    with pytest.raises(ValueError, match="requires rowwise scales of 8 and 4 contiguous elements, got 3 and 4"):
        cublaslt.scaled_mm_lt(a, b, torch.ones(3, 1), torch.ones(1, 4), None, out)


def test_available_says_why_not_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cublaslt.available() == "it needs a CUDA device, got none"
