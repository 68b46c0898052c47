"""benchmarks/trace_kernels.py: GPU kernel time per step side by side, and which host ops launched
the copy kernels."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tests.scripts import load


def _module():
    return load("trace_kernels")


def _trace(path: Path, copy_us: float, gemm_us: float) -> None:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::reshape", "pid": 1, "tid": 2, "ts": 10, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 2, "ts": 12, "dur": 10,
         "args": {"Input Dims": [[2, 3], [2, 3]]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 2, "ts": 13, "dur": 2,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 2, "ts": 50, "dur": 2,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 60, "dur": gemm_us,
         "args": {"correlation": 8}},
    ]
    if copy_us:
        events.append({"ph": "X", "cat": "kernel", "name": "direct_copy_kernel", "pid": 0, "tid": 7, "ts": 30,
                       "dur": copy_us, "args": {"correlation": 7}})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_kernels_per_step_and_launchers(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "trace_a_rank0.json.gz", tmp_path / "trace_b_rank0.json.gz"
    _trace(a, copy_us=3000, gemm_us=8000)
    _trace(b, copy_us=0, gemm_us=6000)
    mod = _module()
    by_name, chains = mod.summarize(str(a), ["copy"])
    assert by_name == {"gemm": 8000, "direct_copy_kernel": 3000}
    assert chains == {("direct_copy_kernel", ("aten::reshape", "aten::copy_", "[[2, 3], [2, 3]]")): 3000}
    monkeypatch.setattr("sys.argv", ["trace_kernels.py", str(a), str(b), "--steps", "2"])
    mod.main()
    out = capsys.readouterr().out
    assert "ms a step: a | b" in out and "total: 5.50 | 3.00" in out
    lines = out.splitlines()
    # the kernel whose time moved most between the traces comes first (1.5 ms a step, then 1.0)
    assert lines[2].split() == ["1.500", "|", "0.000", "direct_copy_kernel"]
    assert lines[3].split() == ["4.000", "|", "3.000", "gemm"]
    assert "1.500  direct_copy_kernel  <-  aten::reshape > aten::copy_ > [[2, 3], [2, 3]]" in out


def _ranked(path: Path, base_ns: int, kernels: list[tuple[str, float, float]]) -> None:
    events = [{"ph": "X", "cat": "kernel", "name": n, "pid": 0, "tid": 7, "ts": ts, "dur": dur}
              for n, ts, dur in kernels]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events, "baseTimeNanoseconds": base_ns}, f)


def test_skew_pairs_the_ranks_calls_on_the_host_clock(tmp_path, capsys, monkeypatch):
    """--skew: the n-th call of a name on rank 0 with the n-th on rank 1, on the host's clock
    (each trace's base time): a call that starts before its peer's waits until the peer starts
    (at most its own duration); names without a --match word are left out."""
    r0, r1 = tmp_path / "trace_asynctp_rank0.json.gz", tmp_path / "trace_asynctp_rank1.json.gz"
    # rank 1's trace counts from 1000 us later: its ts 0 is rank 0's 1000
    _ranked(r0, 5_000_000, [("_rs_mm_kernel", 1000, 500), ("_rs_mm_kernel", 3000, 400), ("gemm", 0, 9)])
    _ranked(r1, 6_000_000, [("_rs_mm_kernel", 300, 200), ("_rs_mm_kernel", 1900, 450), ("gemm", 0, 9)])
    mod = _module()
    got = mod.skew(str(r0), str(r1), ["_rs_mm"])
    # first calls: rank 0 at 1000, rank 1 at 1300: rank 0 waits 300; second: rank 1 at 2900, 100 before rank 0
    assert got == {"_rs_mm_kernel": {"calls": [2, 2], "us": [900, 650], "skew": [300, 100]}}
    monkeypatch.setattr("sys.argv", ["trace_kernels.py", "--skew", str(r0), str(r1), "--steps", "1",
                                     "--match", "_rs_mm"])
    mod.main()
    assert capsys.readouterr().out.splitlines()[1].split() == ["0.90", "0.30", "0.60", "|", "0.65", "0.10", "0.55",
                                                                "_rs_mm_kernel"]


def test_host_profile_timeline_puts_both_ranks_on_one_clock(tmp_path):
    """host_profile --gpu-trace: each rank's activities per call, from rank 0's main-kernel start,
    with the traces' host-clock bases applied (rank 1's trace counts from 40 us later)."""
    paths = []
    for rank, base_ns, lag in ((0, 1_000_000, 0.0), (1, 1_040_000, -30.0)):  # rank 1 starts 10 us after rank 0
        events = []
        for i in range(6):
            t = 1000.0 * i + lag
            events.append({"ph": "X", "cat": "kernel", "name": "_rs_mm_kernel", "ts": t, "dur": 800.0,
                           "args": {"stream": 7}})
            events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": t + 300, "dur": 90.0,
                           "args": {"stream": 9}})
        events += [{"ph": "X", "cat": "kernel", "name": "nvjet_gemm<x>", "ts": 7000.0 + 700 * i, "dur": 650.0}
                   for i in range(6)]
        path = tmp_path / f"t_rank{rank}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events, "baseTimeNanoseconds": base_ns}, f)
        paths.append(str(path))
    text = load("host_profile").timeline(paths, "_mm_kernel")
    rows = [line.split() for line in text.splitlines()[2:] if not line.startswith("after")]
    got = {(int(r[0]), r[6]): (float(r[2]), float(r[4]), int(r[5])) for r in rows}
    assert text.startswith("4 calls, period 1000.0 us")
    assert got == {(0, "_rs_mm_kernel"): (0.0, 800.0, 4), (1, "_rs_mm_kernel"): (10.0, 800.0, 4),
                   (0, "Memcpy"): (300.0, 90.0, 4), (1, "Memcpy"): (310.0, 90.0, 4)}
    assert "after the calls, rank 0: 6 x 650.0 us  nvjet_gemm" in text


def test_gaps_name_the_activity_that_ended_each(tmp_path, capsys, monkeypatch):
    """The GPU's idle gaps on the busiest device (overlapping activities on two streams merged), each
    named by the activity that ended it; a gap under 5 us is busy-adjacent noise, not listed."""
    path = tmp_path / "trace_x_rank0.json.gz"
    acts = [("kernel", "gemm", 7, 0, 100), ("kernel", "rs_kernel", 9, 50, 100),  # overlap: busy 0..150
            ("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 8, 152, 48),  # a 2 us gap: not listed
            ("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 8, 1250, 50),  # 1050 us idle before
            ("kernel", "gemm", 7, 1400, 100)]  # 100 us idle before
    events = [{"ph": "X", "cat": c, "name": n, "pid": 0, "tid": s, "ts": ts, "dur": d} for c, n, s, ts, d in acts]
    events.append({"ph": "X", "cat": "kernel", "name": "other_device", "pid": 1, "tid": 3, "ts": 5000, "dur": 10})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    mod = _module()
    g = mod.gaps(str(path))
    assert g["span"] == 1500 and g["busy"] == 150 + 48 + 50 + 100
    assert g["gaps"] == [(1050, "Memcpy PtoP (Device -> Device)", 8), (100, "gemm", 7)]
    monkeypatch.setattr("sys.argv", ["trace_kernels.py", "--gaps", str(path), "--steps", "1"])
    mod.main()
    out = capsys.readouterr().out
    assert "span 1.50, busy 0.35, idle 1.15 in 2 gaps (>= 5 us), 1.0 of them >= 1 ms" in out
    lines = out.splitlines()
    assert lines[2].split()[:3] == ["1.05", "1.0", "1050"] and "Memcpy PtoP" in lines[2] and "(stream 8)" in lines[2]
    assert lines[3].split()[:3] == ["0.10", "1.0", "100"] and "gemm (stream 7)" in lines[3]
