"""`asynctp demo` end to end on its CPU path (it spawns its own 2 gloo processes): a few steps of
both runs, the table, and the JSON record with identical float32 loss curves."""

import json

import pytest

from asynctp.cli import main


def test_demo_cpu_path_writes_json(tmp_path, capsys):
    assert main(["demo", "--cpu", "--steps", "4", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "final loss" in printed
    (path,) = tmp_path.glob("demo_2xcpu*.json")
    record = json.loads(path.read_text())
    vanilla, fused = record["runs"]
    assert record["model"] == "tiny" and record["backend"] == "gloo"
    assert len(vanilla["losses"]) == len(fused["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(vanilla["losses"], fused["losses"])) <= 1e-5
    assert vanilla["tokens_per_s"] > 0 and fused["step_time_s"] > 0
    assert record["comparison"]["asynctp"]["max_rel_loss_diff"] <= 1e-5
    # which strategy served asynctp's calls (the cpu backend runs the pipeline); vanilla makes none
    assert not vanilla["op_calls"] and fused["op_calls"], (vanilla["op_calls"], fused["op_calls"])
    assert set(fused["op_calls"]) >= {"all_gather_matmul pipeline", "matmul_reduce_scatter pipeline"}, fused["op_calls"]
    assert "asynctp calls (rank 0), by op and strategy: " in printed


def test_demo_refuses_gpu_only_flags_on_cpu(capsys):
    assert main(["demo", "--cpu", "--profile"]) == 2
    assert "--profile requires >= 2 GPUs" in capsys.readouterr().err
    assert main(["demo", "--cpu", "--profile-gpu", "--trace"]) == 2
    assert "--profile-gpu requires >= 2 GPUs" in capsys.readouterr().err


def test_demo_extra_runs_serial_baseline_control_and_asynctp_pass(tmp_path, capsys):
    """--serial-baseline (asynctp's styles, nothing overlapped), --control (1-ulp init change)
    and --asynctp-pass (vanilla styles compiled with asynctp's pass): all run, asynctp is also
    compared with the serial baseline, the pass reports what it fused, the curves stay with
    vanilla's (float32)."""
    assert main(["demo", "--cpu", "--steps", "2", "--serial-baseline", "--control", "--asynctp-pass",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "(control: rounding alone)" in printed and "asynctp vs asynctp, not overlapped: speed-up" in printed
    (path,) = tmp_path.glob("demo_2xcpu*.json")
    record = json.loads(path.read_text())
    names = [r["name"] for r in record["runs"]]
    assert names == ["vanilla TP", "asynctp", "asynctp, not overlapped", "vanilla TP, 1-ulp init change",
                     "vanilla TP + asynctp pass (compiled)"]
    assert record["comparison"]["asynctp, not overlapped"]["max_rel_loss_diff"] <= 1e-5
    assert "asynctp vs asynctp, not overlapped" in record["comparison"]
    passed = record["runs"][4]
    assert passed["fusion_report"].startswith("asynctp fusion report:") and " 0 fused" not in passed["fusion_report"]
    assert record["comparison"]["vanilla TP + asynctp pass (compiled)"]["max_rel_loss_diff"] <= 1e-5


def test_demo_compiled_runs_each_compile_their_own_graphs(tmp_path):
    """With --compile every run is compiled; each run must compile its own graphs (the pass run
    fusing, asynctp's styles calling asynctp), not reuse those dynamo cached for another run
    (same forward code), one after the other and in turn (--interleave): the same loss curves."""
    curves = {}
    for mode, extra in (("sequential", []), ("interleaved", ["--interleave"])):
        out = tmp_path / mode
        assert main(["demo", "--cpu", "--steps", "2", "--compile", "--asynctp-pass", *extra, "--out", str(out)]) == 0
        (path,) = out.glob("demo_2xcpu*.json")
        runs = json.loads(path.read_text())["runs"]
        assert [r["name"] for r in runs] == ["vanilla TP", "asynctp", "vanilla TP + asynctp pass (compiled)"]
        report = runs[-1]["fusion_report"]
        assert " 0 fused" not in report and " 0 graph(s)" not in report, (mode, report)
        assert not runs[0]["op_calls"] and runs[1]["op_calls"] and runs[2]["op_calls"], mode
        curves[mode] = {r["name"]: r["losses"] for r in runs}
    assert curves["interleaved"] == curves["sequential"]


def test_demo_interleaved_and_unsynced_runs_give_the_sequential_curves(tmp_path, capsys):
    """--interleave (step i of every run, then step i + 1) and --sync-every (timed steps queued
    back to back, the host waiting after the last) train the same models: each loss curve is bit
    for bit the one of the runs one after the other, step by step; a stretch's steps share its
    time; a non-positive --sync-every is refused by the CLI."""
    curves = {}
    modes = {"sequential": [], "interleaved": ["--interleave"], "sequential, sync every 2": ["--sync-every", "2"],
             "interleaved, sync every 3": ["--interleave", "--sync-every", "3"]}
    for mode, extra in modes.items():
        out = tmp_path / mode.replace(" ", "_").replace(",", "")
        assert main(["demo", "--cpu", "--steps", "6", "--serial-baseline", *extra, "--out", str(out)]) == 0
        assert ("note: step times are each stretch of" in capsys.readouterr().out) == ("--sync-every" in extra)
        (path,) = out.glob("demo_2xcpu*.json")
        record = json.loads(path.read_text())
        assert record["settings"]["interleave"] == ("--interleave" in extra)
        every = int(extra[-1]) if "--sync-every" in extra else 1
        assert record["settings"]["sync_every"] == every
        curves[mode] = {r["name"]: r["losses"] for r in record["runs"]}
        for r in record["runs"]:  # warm-up steps 0-2 alone, then stretches of `every` steps
            times, hosts = r["step_times_s"], r["host_times_s"]
            assert len(times) == len(hosts) == 6
            stretches = [times[3:5], times[5:]] if every == 2 else [times[3:]]
            if every > 1:
                assert all(len(set(t)) == 1 for t in stretches), times
    assert list(curves["interleaved"]) == ["vanilla TP", "asynctp", "asynctp, not overlapped"]
    for mode in modes:
        assert curves[mode] == curves["sequential"], mode
    capsys.readouterr()
    assert main(["demo", "--cpu", "--sync-every", "0"]) == 2
    assert "--sync-every requires a positive number, got 0" in capsys.readouterr().err


def test_demo_windows_queue_warm_up_steps_alone():
    """The stretches a run's host queues before it waits: warm-up steps one at a time, then
    sync_every steps at a time, the last one shorter; a non-positive sync_every is refused."""
    from asynctp.demo.model import SIZES
    from asynctp.demo.train import TrainSettings, windows

    def of(steps, every, warmup=3):
        return windows(TrainSettings(cfg=SIZES["tiny"], steps=steps, dtype=None, lr=0.0, warmup=warmup, sync_every=every))

    assert of(6, 1) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]
    assert of(10, 3) == [(0, 1), (1, 1), (2, 1), (3, 3), (6, 3), (9, 1)]
    assert of(2, 4) == [(0, 1), (1, 1)]
    assert of(5, 10, warmup=0) == [(0, 5)]
    with pytest.raises(ValueError, match="sync_every requires a positive number of steps, got 0"):
        of(5, 0)


def test_demo_batch_size_flag(tmp_path, capsys):
    """--batch-size overrides the model size's sequences per step (recorded in the JSON's config);
    a non-positive one is refused before any process starts."""
    assert main(["demo", "--cpu", "--steps", "1", "--batch-size", "3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("demo_2xcpu*.json")
    record = json.loads(path.read_text())
    assert record["config"]["batch_size"] == 3
    assert all(len(r["losses"]) == 1 for r in record["runs"])
    capsys.readouterr()
    assert main(["demo", "--cpu", "--batch-size", "0"]) == 2
    assert "--batch-size requires a positive number, got 0" in capsys.readouterr().err


def test_demo_no_comm_baseline_skips_the_collectives(tmp_path, capsys):
    """--no-comm-baseline adds vanilla TP over a fake process group: its collectives do not
    communicate (its losses part from vanilla's at once), it is left out of the loss comparisons
    and the PNG, and every other run is credited against vanilla's step time minus its own."""
    assert main(["demo", "--cpu", "--steps", "3", "--no-comm-baseline", "--interleave", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "vanilla TP, no communication:" in printed and "so communication costs vanilla TP" in printed
    (path,) = tmp_path.glob("demo_2xcpu*.json")
    record = json.loads(path.read_text())
    runs = {r["name"]: r for r in record["runs"]}
    assert list(runs) == ["vanilla TP", "asynctp", "vanilla TP, no communication"]
    assert runs["vanilla TP, no communication"]["no_comm"] is True
    assert runs["vanilla TP, no communication"]["losses"][0] != runs["vanilla TP"]["losses"][0]
    assert list(record["comparison"]) == ["asynctp"]
    c = record["comparison"]["asynctp"]
    cost = (runs["vanilla TP"]["step_time_s"] - runs["vanilla TP, no communication"]["step_time_s"]) * 1000
    assert c["vanilla_comm_cost_ms"] == pytest.approx(cost)
    assert c["max_rel_loss_diff"] <= 1e-5


def test_train_bench_runs_at_toy_size(tmp_path):
    """benchmarks/train_bench.py end to end on CPU (eager configuration only: compiling takes minutes),
    its variants in turn (--interleave, passed to the demo)."""
    import subprocess
    import sys

    cmd = [sys.executable, "benchmarks/train_bench.py", "--cpu", "--steps", "2", "--sync-every", "1",
           "--batch-sizes", "2", "--configs", "eager", "--interleave", "--out", str(tmp_path)]
    from tests.multiprocess import script_env

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=script_env())
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout[done.stdout.rindex("config"):]
    assert "vanilla TP, no communication" in table and "asynctp" in table, table
    (record,) = tmp_path.rglob("demo_*.json")
    assert json.loads(record.read_text())["settings"]["interleave"]
