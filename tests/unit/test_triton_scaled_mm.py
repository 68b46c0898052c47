"""asynctp/ops/triton_scaled_mm.py under Triton's CPU interpreter: the checks in
_triton_scaled_mm_checks.py, in a process started with TRITON_INTERPRET=1. Skips where Triton is
not installed (the CPU CI installs torch only). Its speed is measured on a GPU by
benchmarks/probe_fp8_epilogue.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_scaled_mm_add_under_the_interpreter():
    checks = Path(__file__).with_name("_triton_scaled_mm_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
