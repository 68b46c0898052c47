"""tests/unit: the benchmark run's settings and helpers that need no process group."""

from __future__ import annotations

import pytest

from asynctp.bench import measure
from asynctp.bench.cases import check_close, check_sqnr


def test_new_strategies_are_measured_without_a_harness_change(monkeypatch):
    from asynctp.bench.cases import CASES
    from asynctp.ops import scales, validate

    ag, ag_fp8 = CASES["all_gather_matmul"], CASES["all_gather_scaled_matmul_rowwise"]
    assert "pipeline" in measure.pipelined_strategies(ag)
    assert not {"auto", "serial"} & set(measure.pipelined_strategies(ag))
    monkeypatch.setattr(validate, "STRATEGIES", ("auto", "serial", "pipeline", "async_input"))
    monkeypatch.setattr(scales, "STRATEGIES", ("auto", "serial", "pipeline"), raising=False)
    assert measure.pipelined_strategies(ag) == ["pipeline", "async_input"]
    assert measure.pipelined_strategies(ag_fp8) == ["pipeline"]  # each op its own list
    assert measure.variant("async_input") == "asynctp_async_input" and measure.variant("serial") == "serial"


def test_config_checks():
    cfg = measure.BenchConfig(ops=("all_gather_matmul",), shape_sets=("tiny",))
    assert cfg.iters == 50 and cfg.warmup == 10 and cfg.graph and not cfg.tune
    with pytest.raises(ValueError, match="ops requires names from"):
        measure.BenchConfig(ops=("all_gather",), shape_sets=("tiny",))
    with pytest.raises(ValueError, match="dtype requires one of"):
        measure.BenchConfig(ops=("all_gather_matmul",), shape_sets=("tiny",), dtype="int8")
    with pytest.raises(ValueError, match="iters requires at least 1, got 0"):
        measure.BenchConfig(ops=("all_gather_matmul",), shape_sets=("tiny",), iters=0)
    with pytest.raises(TypeError):
        measure.BenchConfig(("all_gather_matmul",), ("tiny",))  # keyword-only


def test_failure_descriptions_stay_short():
    long = "Could not run 'x' with arguments from the 'CPU' backend. " + "blah " * 100
    text = measure._describe(NotImplementedError(long))
    assert text == "NotImplementedError: Could not run 'x' with arguments from the 'CPU' backend."
    assert len(measure._describe(RuntimeError("y" * 1000))) < 260
    assert measure._describe(ValueError("")) == "ValueError: "


def test_result_checks():
    import torch

    want = torch.randn(64, 32).bfloat16()
    check_close("out", want.clone(), want)
    with pytest.raises(AssertionError, match="out differs from serial"):
        check_close("out", want + 1, want)
    with pytest.raises(AssertionError, match=r"got \(64, 31\)"):
        check_close("out", want[:, :31], want)
    check_sqnr("out", want + 1e-3 * torch.randn(64, 32).bfloat16(), want)
    with pytest.raises(AssertionError, match="SQNR"):
        check_sqnr("out", torch.randn(64, 32).bfloat16(), want)


def test_paired_timing_flips_which_variant_goes_first_every_round(monkeypatch):
    """Neither variant may always run straight after the other's block (a warmer GPU then)."""
    import torch

    from asynctp.bench import timing

    monkeypatch.setattr(timing, "align_ranks", lambda group, device: None)
    monkeypatch.setattr(timing, "max_over_ranks", lambda value, group, device: value)
    calls: list[str] = []
    a, b = timing.rounds_us([lambda: calls.append("a"), lambda: calls.append("b")], iters=8, warmup=1, group=None,
                            device=torch.device("cpu"), rounds=4)
    assert calls[:2] == ["a", "b"]  # warmup
    blocks = ["".join(calls[i : i + 2]) for i in range(2, len(calls), 2)]
    assert blocks == ["aa", "bb", "bb", "aa", "aa", "bb", "bb", "aa"]
    assert a >= 0 and b >= 0
    calls.clear()  # an odd number of rounds asked for: one fewer, so each goes first equally often
    timing.rounds_us([lambda: calls.append("a"), lambda: calls.append("b")], iters=10, warmup=0, group=None,
                     device=torch.device("cpu"), rounds=5)
    blocks = ["".join(calls[i : i + 2]) for i in range(0, len(calls), 2)]
    assert blocks == ["aa", "bb", "bb", "aa", "aa", "bb", "bb", "aa"]


def test_rounds_of_three_put_each_variant_at_each_position_after_each_other(monkeypatch):
    """The local matmul, serial and auto in one set of rounds: every order of the three once."""
    import torch

    from asynctp.bench import timing

    monkeypatch.setattr(timing, "align_ranks", lambda group, device: None)
    monkeypatch.setattr(timing, "max_over_ranks", lambda value, group, device: value)
    calls: list[str] = []
    times = timing.rounds_us([lambda x=x: calls.append(x) for x in "abc"], iters=12, warmup=0, group=None,
                             device=torch.device("cpu"), rounds=7)
    assert len(times) == 3
    blocks = ["".join(calls[i : i + 2]) for i in range(0, len(calls), 2)]
    orders = ["".join(b[0] for b in blocks[i : i + 3]) for i in range(0, len(blocks), 3)]
    assert orders == ["abc", "bca", "cab", "cba", "acb", "bac"]


@pytest.mark.parametrize("blocks, rounds, picked, head", [
    ({"pipeline": 100.0, "fused": 104.0}, [101.0, 98.0], "fused", True),  # within 5%: the rounds decide
    ({"pipeline": 100.0, "fused": 104.0}, [98.0, 101.0], "pipeline", True),
    ({"pipeline": 100.0, "fused": 110.0}, None, "pipeline", False),  # apart: the blocks decide
    ({"pipeline": 130.0, "fused": 131.0}, [120.0, 119.0], "serial", True),  # neither beats serial's 120 by 1%
])
def test_tune_decides_close_strategies_head_to_head(blocks, rounds, picked, head, monkeypatch):
    from types import SimpleNamespace

    from asynctp.ops import tuning

    recorded, timed = [], []

    def rounds_us(fns, iters, warmup, group, device):
        timed.append(len(fns))
        return rounds

    monkeypatch.setattr(measure, "rounds_us", rounds_us)
    monkeypatch.setattr(measure, "exchange", lambda group, what, value: [value])
    monkeypatch.setattr(tuning, "record", lambda *args: recorded.append(args[-1]))
    times = {measure.variant(s): t for s, t in blocks.items()} | {"serial": 120.0}
    row = SimpleNamespace(times=times, say=lambda what: None, problem=SimpleNamespace(op="op", shape_key=()),
                          cfg=measure.BenchConfig(ops=("all_gather_matmul",), shape_sets=("tiny",)), group=None,
                          device=None)
    best, got = measure._tune(row, ["pipeline", "fused"], 2)
    assert best == picked and recorded == [picked]
    assert timed == ([2] if head else []) and bool(got) == head
    if head:
        assert got == {"asynctp_pipeline": rounds[0], "asynctp_fused": rounds[1]}
