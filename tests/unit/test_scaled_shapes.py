"""tests/unit: the fp8 ops' CUDA shape rule (K and N multiples of 16, per rank where the gather or
scatter splits them; M free) is checked before any communication. Fake CUDA tensors (no GPU
needed) carry the device the check keys on; no op runs and no group is needed."""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from asynctp.ops.scales import check_all_gather_scaled_matmul, check_scaled_matmul_reduce_scatter

E4M3 = torch.float8_e4m3fn
R = 2  # world size


def _fake_cuda_mode() -> FakeTensorMode:
    mode = FakeTensorMode()
    try:
        with mode:
            torch.empty(1, device="cuda")
    except (RuntimeError, AssertionError) as exc:  # builds whose fake mode refuses a CUDA device
        pytest.skip(f"no fake CUDA tensors on this build: {exc}")
    return mode


def _ag(m: int, k_shard: int, k: int, n: int, gather_dim: int) -> None:
    a = torch.empty((m, k_shard), dtype=E4M3, device="cuda")
    b = torch.empty((n, k), dtype=E4M3, device="cuda").t()  # column-major, as weight.t()
    s = torch.ones((), device="cuda")
    check_all_gather_scaled_matmul(a, [b], s, [s], gather_dim, R, torch.bfloat16, None, False, True, "auto")


def _rs(m: int, k: int, n: int, scatter_dim: int) -> None:
    a = torch.empty((m, k), dtype=E4M3, device="cuda")
    b = torch.empty((n, k), dtype=E4M3, device="cuda").t()
    s = torch.ones((), device="cuda")
    check_scaled_matmul_reduce_scatter(a, b, s, s, scatter_dim, R, torch.bfloat16, None, "sum", False, "auto")


@pytest.mark.parametrize(
    "call, text",
    [
        (lambda: _ag(4, 8, 8, 16, 0), "K (a_shard's last dim) requires a multiple of 16 (torch._scaled_mm on CUDA), got 8"),
        (lambda: _ag(4, 8, 8 * R, 16, 1), "K per rank (a_shard's last dim, the gather dim) requires a multiple of 16"),
        (lambda: _ag(4, 16, 16, 24, 0), "bs[0]'s N requires a multiple of 16 (torch._scaled_mm on CUDA), got 24"),
        (lambda: _rs(6, 8, 16, 0), "K (a's last dim) requires a multiple of 16 (torch._scaled_mm on CUDA), got 8"),
        (lambda: _rs(6, 16, 8, 0), "N (b's last dim) requires a multiple of 16 (torch._scaled_mm on CUDA), got 8"),
        (lambda: _rs(6, 16, 8 * R, -1), "N per rank (b's N / R, the scatter dim) requires a multiple of 16"),
    ],
    ids=["ag-K", "ag-K-per-rank", "ag-N", "rs-K", "rs-N", "rs-N-per-rank"],
)
def test_cuda_rejects_k_or_n_off_16(call, text):
    with _fake_cuda_mode():
        with pytest.raises(ValueError) as info:
            call()
    assert text in str(info.value)


def test_cuda_takes_any_m():
    """M is free: _scaled_mm has no rule for mat1's rows, and where the ops pass a's rows as
    mat2 (e4m3 x e5m2, computed transposed) they pad them (scaled_gemm._rows_padded)."""
    with _fake_cuda_mode():
        for m in (1, 3, 6, 17):
            _ag(m, 16, 16, 16, 0)
            _ag(m, 16, 16 * R, 32, 1)
            _rs(m * R, 16, 32, 0)
            _rs(m, 16, 16 * R, -1)



def test_cpu_rowwise_without_torch_support_is_computed_with_a_warning(monkeypatch):
    """A torch whose CPU torch._scaled_mm takes tensorwise scales only (2.11): asynctp's scaled
    GEMM computes rowwise / per-column scaled products on CPU itself (fp32 with unit scales,
    then the scales and the bias, one rounding), warns once, and gives the dequantized product
    (exact here: small integers, power-of-two scales)."""
    import warnings

    import asynctp.config as config
    import asynctp.ops.scaled_gemm as scaled_gemm

    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (6, 16), generator=gen).to(E4M3)
    b = torch.randint(-4, 5, (8, 16), generator=gen).to(E4M3).t()
    rows = 2.0 ** torch.randint(-3, 3, (6, 1), generator=gen).float()
    cols = 2.0 ** torch.randint(-3, 3, (1, 8), generator=gen).float()
    bias = torch.randint(-4, 5, (8,), generator=gen).to(torch.bfloat16)
    want = ((a.float() @ b.float()) * rows * cols + bias.float()).to(torch.bfloat16)

    takes_vectors = scaled_gemm.cpu_scaled_mm_takes_vectors  # the real probe
    monkeypatch.setattr(scaled_gemm, "cpu_scaled_mm_takes_vectors", lambda: False)
    monkeypatch.setattr(config, "_warned", set())
    with pytest.warns(RuntimeWarning, match=re.escape(f"torch {torch.__version__}'s CPU torch._scaled_mm takes tensorwise")):
        got = scaled_gemm.scaled_mm(a, b, rows, cols, torch.bfloat16, bias=bias)
    assert torch.equal(got, want)
    out = torch.empty(6, 8, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert scaled_gemm.scaled_mm(a, b, rows, torch.ones(()), torch.bfloat16, out=out) is out
    assert not caught, "warned twice"
    assert torch.equal(out, ((a.float() @ b.float()) * rows).to(torch.bfloat16))
    if takes_vectors():  # torch's own kernel where it has one
        assert torch.equal(torch._scaled_mm(a, b, rows, cols, bias=bias, out_dtype=torch.bfloat16), want)
