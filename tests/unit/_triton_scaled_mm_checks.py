"""Checks of asynctp/ops/triton_scaled_mm.py (the fp8 GEMM with an addition in its epilogue) under
Triton's CPU interpreter, run by test_triton_scaled_mm.py in a process started with
TRITON_INTERPRET=1 (the interpreter runs only kernels decorated after it was set, triton's own
helpers included): scales tensorwise / rowwise / per column, with and without the addend, ragged
tiles, strided operands, against fp32 math on the same fp8 values."""

import pytest
import torch

E4M3 = torch.float8_e4m3fn
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}  # several tiles, ragged edges


@pytest.fixture(scope="module")
def kernel():
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_scaled_mm.py"
    import asynctp.ops.triton_scaled_mm as mod

    return mod


def reference(a, b, sa, sb, addend, out_dtype):
    full = a.float() @ b.float() * sa * sb
    return (full if addend is None else full + addend.float()).to(out_dtype)


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("scales", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("with_add", [True, False])
def test_matches_fp32_math_on_the_same_fp8_values(kernel, scales, with_add, tma):
    g = torch.Generator().manual_seed(0)
    m, n, k = 37, 70, 80  # no dim a multiple of the tiles (k: rows of 16-byte multiples, for TMA)
    a = torch.randn(m, k, generator=g).to(E4M3)
    b = torch.randn(n, k, generator=g).to(E4M3).t()  # column-major, as torch._scaled_mm takes it
    if scales == "rowwise":
        sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    else:
        sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    addend = torch.randn(m, n, generator=g).bfloat16() if with_add else None
    out = torch.empty(m, n, dtype=torch.bfloat16)
    kernel.scaled_mm_add(a, b, sa, sb, addend, out, config={**SMALL, "TMA": tma})
    want = reference(a, b, sa, sb, addend, torch.bfloat16)
    # fp32 sums in another order, one rounding to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_inner_dim_a_multiple_of_the_tile(kernel):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(33, 64, generator=g).to(E4M3)  # K = 2 tiles: the unmasked loop
    b = torch.randn(40, 64, generator=g).to(E4M3).t()
    sa, sb = torch.rand(33, 1, generator=g) + 0.5, torch.tensor(0.5)
    addend = torch.randn(33, 40, generator=g).bfloat16()
    out = torch.empty(33, 40, dtype=torch.bfloat16)
    kernel.scaled_mm_add(a, b, sa, sb, addend, out, config=SMALL)
    torch.testing.assert_close(out.float(), reference(a, b, sa, sb, addend, torch.bfloat16).float(), rtol=2**-7, atol=1e-3)


def test_strided_addend_and_output_and_fp32_out(kernel):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(20, 64, generator=g).to(E4M3)
    b = torch.randn(48, 64, generator=g).to(E4M3).t()
    sa, sb = torch.rand(20, 1, generator=g) + 0.5, torch.rand(1, 48, generator=g) + 0.5
    addend = torch.randn(48, 20, generator=g).t()  # column-major fp32
    out = torch.zeros(20, 96)[:, ::2]  # every other column
    kernel.scaled_mm_add(a, b, sa, sb, addend, out, config=SMALL)
    torch.testing.assert_close(out, reference(a, b, sa, sb, addend, torch.float32), rtol=1e-5, atol=1e-5)


def test_bad_operands_raise(kernel):
    a = torch.zeros(4, 8).to(E4M3)
    b = torch.zeros(8, 16).to(E4M3)
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    one = torch.ones(())
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\]"):
        kernel.scaled_mm_add(a, b.t(), one, one, None, out)
    with pytest.raises(TypeError, match="float8 a and b"):
        kernel.scaled_mm_add(a.float(), b, one, one, None, out)
    with pytest.raises(ValueError, match=r"b_scale of numel 1 or shape \(1, 16\)"):
        kernel.scaled_mm_add(a, b, one, torch.ones(16, 1), None, out)
    with pytest.raises(TypeError, match="float32 a_scale"):
        kernel.scaled_mm_add(a, b, one.double(), one, None, out)
    with pytest.raises(ValueError, match="with TMA requires a row-major a and a column-major b"):
        kernel.scaled_mm_add(a, b, one, one, None, out, config={**SMALL, "TMA": 1})  # b row-major
    huge = torch.empty_strided((2, 16), (2**31, 1), dtype=torch.bfloat16, device="meta")  # rows 2^31 apart
    with pytest.raises(ValueError, match="out to span under 2\\^31 elements"):
        kernel.scaled_mm_add(a[:2], b, one, one, None, huge)
    with pytest.raises(ValueError, match=r"PROMOTE_K in \[0, BLOCK_K\] or None, got 64"):
        kernel.scaled_mm_add(a, b, one, one, None, out, config={**SMALL, "PROMOTE_K": 64})  # BLOCK_K 32
    with pytest.raises(ValueError, match=r"out and addend of shape \(4, 16\)"):
        kernel.scaled_mm_add(a, b, one, one, torch.zeros(4, 8), out)


@pytest.mark.parametrize("promote", [None, 0, 16])
def test_every_accumulation_setting_compiles_and_computes(kernel, promote):
    """PROMOTE_K reaches tl.dot (the interpreter sums in fp32 whatever it says; its effect on
    Hopper's precision is measured by benchmarks/probe_fp8_epilogue.py)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(20, 64, generator=g).to(E4M3)
    b = torch.randn(40, 64, generator=g).to(E4M3).t()
    sa, sb = torch.tensor(0.5), torch.rand(1, 40, generator=g) + 0.5
    addend = torch.randn(20, 40, generator=g).bfloat16()
    out = torch.empty(20, 40, dtype=torch.bfloat16)
    kernel.scaled_mm_add(a, b, sa, sb, addend, out, config={**SMALL, "PROMOTE_K": promote})
    torch.testing.assert_close(out.float(), reference(a, b, sa, sb, addend, torch.bfloat16).float(), rtol=2**-7, atol=1e-3)
