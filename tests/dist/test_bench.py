"""tests/dist: `asynctp bench` on gloo CPU ranks (tiny shapes, 1-2 iterations): the same code
paths as a GPU run, minus CUDA events and graphs. Rank-side bodies first, then the tests."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import asynctp

from asynctp.bench import cases
from asynctp.bench.measure import BenchConfig, pipelined_strategies, run_benchmark
from tests.caps import needs_cpu_rowwise

DEVICE = torch.device("cpu")


def _config(**kw) -> BenchConfig:
    base = dict(ops=tuple(cases.CASES), shape_sets=("tiny",), iters=2, warmup=1, command="pytest")
    base.update(kw)
    return BenchConfig(**base)


def _use_cache(path: str) -> None:
    from asynctp.ops import tuning

    import asynctp

    asynctp.configure(tuning_cache=path)
    tuning.forget()  # any cache loaded from another path by an earlier test


def bench_all_ops(cache: str) -> list[dict]:
    _use_cache(cache)
    return run_benchmark(_config(ops=("all_gather_matmul", "matmul_reduce_scatter")), dist.group.WORLD, DEVICE)


def bench_tuned(cache: str) -> list[dict]:
    _use_cache(cache)
    return run_benchmark(_config(ops=("matmul_reduce_scatter",), tune=True, iters=1, warmup=0), dist.group.WORLD, DEVICE)


def _wrong_pipeline(shape, dtype, group, device, seed):
    """all_gather_matmul whose pipelined result is off by one on rank 1 only."""
    problem = cases.CASES["all_gather_matmul"].build(shape, dtype, group, device, seed)
    real = problem.asynctp

    def run(strategy):
        a_gathered, outs = real(strategy)
        if strategy == "pipeline" and group.rank() == 1:
            outs = [o + 1 for o in outs]
        return a_gathered, outs

    problem.asynctp = run
    return problem


def bench_with_wrong_results() -> list[dict]:
    cases.register("_wrong_pipeline_for_test", "gather")(_wrong_pipeline)
    try:
        cfg = _config(ops=("_wrong_pipeline_for_test", "matmul_reduce_scatter"), iters=1, warmup=0)
        return run_benchmark(cfg, dist.group.WORLD, DEVICE)
    finally:
        del cases.CASES["_wrong_pipeline_for_test"]


def bench_float8(cache: str) -> list[dict]:
    _use_cache(cache)
    ops = tuple(name for name in cases.CASES if "scaled" in name)
    return run_benchmark(_config(ops=ops, iters=1, warmup=0), dist.group.WORLD, DEVICE)


# -- tests ----------------------------------------------------------------------------------

_ROW_KEYS = {
    "op", "shape_set", "layer", "shape", "m", "n", "k", "num_bs", "dtype", "world_size", "device", "hardware",
    "torch", "triton", "date", "command", "iters", "warmup", "tuned", "times_us", "skipped", "bound_us",
    "efficiency", "auto_strategy", "tuned_strategy", "tune_rounds_us", "auto_vs_serial", "error", "graph_calls", "isolated_us",
    "host_us",
}


def test_rows_have_every_time_and_reason(pool, tmp_path):
    per_rank = pool.run(bench_all_ops, str(tmp_path / "tuning.json"))
    rows = per_rank[0]
    world = pool.world_size
    assert [(r["op"], r["shape"]) for r in rows] == [
        ("all_gather_matmul", "96x64x32"), ("all_gather_matmul", "192x64x32"),
        ("matmul_reduce_scatter", "96x64x32"), ("matmul_reduce_scatter", "192x64x32"),
    ]
    strategies = pipelined_strategies(cases.CASES["all_gather_matmul"])
    timed = {"compute_bound", "comm_bound", "serial", "serial_paired", "asynctp_auto", "asynctp_auto_paired",
             "compute_paired"} | {
        f"asynctp_{s}" for s in strategies}
    for row in rows:
        assert set(row) == _ROW_KEYS and row["error"] is None
        assert row["world_size"] == world and row["hardware"] == f"{world}xcpu" and row["device"] == "cpu"
        assert row["torch"] == torch.__version__ and row["command"] == "pytest" and row["dtype"] == "bfloat16"
        # torch's fused ops have CUDA kernels only; graphs need CUDA: reasons, not times
        skipped = {"torch_fused", "torch_fused_graph", "asynctp_auto_graph"}
        assert set(row["skipped"]) == skipped and set(row["times_us"]) == timed | skipped
        assert all(row["times_us"][k] > 0 for k in timed) and all(row["times_us"][k] is None for k in skipped)
        assert "CPU" in row["skipped"]["torch_fused"]
        assert row["bound_us"] == max(row["times_us"]["compute_bound"], row["times_us"]["comm_bound"])
        assert row["efficiency"]["asynctp_auto"] == row["bound_us"] / row["times_us"]["asynctp_auto"]
        # serial / auto from the same alternating rounds, not from the standalone columns
        assert row["auto_vs_serial"] == row["times_us"]["serial_paired"] / row["times_us"]["asynctp_auto_paired"]
        assert row["auto_strategy"] == "pipeline"  # the cpu backend always pipelines
        # per asynctp variant, its calls through the graph cache: none on CPU
        untimed_calls = {"compute_bound", "comm_bound", "serial_paired", "compute_paired"}
        assert row["graph_calls"] == {k: {} for k in timed - untimed_calls}
        # auto's efficiency from its rounds with the local matmul
        t = row["times_us"]
        assert row["efficiency"]["asynctp_auto_paired"] == max(t["compute_paired"], t["comm_bound"]) / t["asynctp_auto_paired"]
    assert rows[1]["num_bs"] == 2
    # times are maxima over ranks: every rank holds the same numbers
    for other in per_rank[1:]:
        assert [r["times_us"] for r in other] == [r["times_us"] for r in rows]
    assert set(rows[0]["efficiency"]) == timed - {"compute_bound", "comm_bound", "compute_paired"}
    # every variant timed back to back was also timed in isolated calls, with its host time
    for row in rows:
        iso = timed - {"serial_paired", "asynctp_auto_paired", "compute_paired"}
        assert set(row["isolated_us"]) == set(row["host_us"]) == iso
        assert all(row["isolated_us"][k] > 0 and row["host_us"][k] > 0 for k in iso)


def test_tune_records_the_same_choice_on_every_rank(pool, tmp_path):
    cache = tmp_path / "tuning.json"
    per_rank = pool.run(bench_tuned, str(cache))
    choices = [[r["tuned_strategy"] for r in rows] for rows in per_rank]
    assert all(c == choices[0] for c in choices)
    assert all(c in ("serial", *pipelined_strategies(cases.CASES["matmul_reduce_scatter"])) for c in choices[0])
    table = json.loads(cache.read_text())
    for row, choice in zip(per_rank[0], choices[0]):
        key = f"matmul_reduce_scatter|cpu|R{pool.world_size}|bfloat16|{row['m']}|{row['k']}|{row['n']}"
        assert table[key] == choice
        assert row["tuned"] and row["times_us"]["asynctp_auto"] > 0


def test_a_wrong_result_fails_its_row_loudly_and_the_run_goes_on(pool):
    rows = pool.run(bench_with_wrong_results)[0]
    wrong = [r for r in rows if r["op"] == "_wrong_pipeline_for_test"]
    assert len(wrong) == 2
    for row in wrong:
        assert "results differ from serial" in row["error"] and "rank 1" in row["error"]
        assert "strategy 'pipeline'" in row["error"] and row["times_us"] == {}
    assert all(r["error"] is None and r["times_us"] for r in rows if r["op"] == "matmul_reduce_scatter")


def test_cli_spawns_ranks_and_writes_results(tmp_path, monkeypatch):
    """The whole command: 2 spawned gloo ranks, table on stdout, JSON/markdown/README on disk."""
    from asynctp.cli import main

    monkeypatch.setenv("ASYNCTP_TUNING_CACHE", str(tmp_path / "tuning.json"))
    code = main(["bench", "--op", "all_gather_matmul", "--shapes", "tiny", "--iters", "1", "--warmup", "0",
                 "--out", str(tmp_path)])
    assert code == 0
    path = tmp_path / "all_gather_matmul_2xcpu.json"  # named by op and hardware; rows carry the date
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 and rows[0]["command"].startswith("asynctp bench --op all_gather_matmul --shapes tiny")
    assert path.with_suffix(".md").exists()
    assert "all_gather_matmul on 2xcpu" in (tmp_path / "README.md").read_text()


@pytest.mark.skipif(not hasattr(asynctp, "all_gather_scaled_matmul"), reason="asynctp has no fp8 ops yet")
@needs_cpu_rowwise
def test_float8_rows_for_both_recipes(pool, tmp_path):
    rows = pool.run(bench_float8, str(tmp_path / "tuning.json"))[0]
    assert sorted({r["op"] for r in rows}) == [
        "all_gather_scaled_matmul_rowwise", "all_gather_scaled_matmul_tensorwise",
        "scaled_matmul_reduce_scatter_rowwise", "scaled_matmul_reduce_scatter_tensorwise",
    ]
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["times_us"]["asynctp_auto"] > 0 and "torch_fused" in row["skipped"]


def checks_measured() -> dict:
    from asynctp.bench.checks import measure

    return measure("cpu", iters=200, warmup=5)


def test_checks_cost_is_measured_in_alternating_rounds(pool):
    per_rank = pool.run(checks_measured)
    for got in per_rank:
        assert {"agreement_us", "matmul_checks_on_us", "matmul_checks_off_us", "checks_cost_us",
                "checks_cost_pct"} <= set(got), got
        assert got["matmul_checks_on_us"] > 0 and got["matmul_checks_off_us"] > 0
        assert got["checks_cost_pct"] == pytest.approx(100 * got["checks_cost_us"] / got["matmul_checks_off_us"])
