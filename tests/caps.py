"""What this torch can run on CPU, as pytest markers for the tests that need it."""

import pytest

from asynctp.ops.scaled_gemm import cpu_scaled_mm_takes_vectors

# torch 2.11's CPU torch._scaled_mm takes tensorwise scales only (2.13's takes rowwise and
# per-column ones too): the CPU tests of rowwise fp8 compute their references with it, so they
# need it; asynctp itself computes such products without it, with a warning
# (tests/unit/test_scaled_shapes.py)
needs_cpu_rowwise = pytest.mark.skipif(
    not cpu_scaled_mm_takes_vectors(),
    reason="this torch's CPU torch._scaled_mm takes tensorwise scales only (rowwise on CPU: torch 2.13)",
)
