"""The soak's short version (benchmarks/soak.py): random calls on 2 CPU ranks, 5% of them
faulted; no silent wrong result, no hang, no leaked file or store key, every error clear."""

import json
import subprocess
import sys
from pathlib import Path

from tests.multiprocess import script_env

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--calls", "150", "--fault-rate", "0.06",
           "--timeout", "0.5", "--deadline", "90", "--seed", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=script_env())
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sum(result["faults_injected"].values()) > 0, result
    for key in ("silent_wrong_results", "hangs", "leaked_segments", "unclear_errors", "errors_on_unfaulted_calls",
                "faulted_calls_that_returned"):
        assert result[key] == 0, (key, result)
    assert result["leaked_store_keys"] <= 0, result  # (fewer than at the start: the set-up's were deleted)
    assert result["slowest_error_s"] < 4 * result["timeout_s"] + 1, result
