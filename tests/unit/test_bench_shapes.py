"""tests/unit: the benchmark's shape sets, options and registry (no process group)."""

from __future__ import annotations

import argparse

import pytest

from asynctp.bench import cases, cli, launch
from asynctp.bench.shapes import GPU_SETS, SHAPE_SETS, Shape, expand_sets, shapes_for


def test_seed_and_small_rows_are_the_issue_sizes():
    for kind in ("gather", "scatter"):
        seed = shapes_for("seed", kind, 2)
        assert [(s.m, s.n, s.k) for s in seed] == [(2048, 3584, 8192), (4096, 3584, 8192), (8192, 3584, 8192)]
        assert [s.m for s in shapes_for("small", kind, 2)] == [256, 512, 1024]
    assert shapes_for("seed", "gather", 2)[0].label == "2048x3584x8192"
    assert shapes_for("seed", "gather", 2)[0].flop == 2 * 2048 * 3584 * 8192


def test_llama8b_tp2():
    qkv, w13 = shapes_for("llama8b", "gather", 2)
    assert (qkv.layer, qkv.m, qkv.n, qkv.k, qkv.num_bs) == ("qkv", 8192, (4096 + 2 * 1024) // 2, 4096, 1)
    assert (w13.layer, w13.n, w13.k, w13.num_bs) == ("w13", 14336, 4096, 2)  # two [4096, 7168] shards
    wo, w2 = shapes_for("llama8b", "scatter", 2)
    assert (wo.layer, wo.m, wo.n, wo.k) == ("wo", 8192, 2048, 4096)
    assert (w2.layer, w2.n, w2.k) == ("w2", 7168, 4096)
    assert qkv.label == "qkv 8192x3072x4096"


def test_llama70b_follows_the_world_size():
    for world in (2, 4, 8):
        qkv, w13 = shapes_for("llama70b", "gather", world)
        assert qkv.n == (8192 + 2 * 1024) // world and qkv.k == 8192
        assert w13.n == 2 * 28672 // world
        wo, w2 = shapes_for("llama70b", "scatter", world)
        assert (wo.n, wo.k, w2.n, w2.k) == (8192 // world, 8192, 28672 // world, 8192)


def test_tiny_divides_small_world_sizes_and_has_a_two_b_row():
    for world in (2, 3, 4):
        rows = shapes_for("tiny", "gather", world)
        assert all(s.m % world == 0 for s in rows)
        assert any(s.num_bs == 2 for s in rows)
        assert all(s.num_bs == 1 for s in shapes_for("tiny", "scatter", world))


def test_bad_shape_requests():
    with pytest.raises(ValueError, match="shape set 'llama8b' requires a world size dividing"):
        shapes_for("llama8b", "gather", 3)
    with pytest.raises(ValueError, match="shape set requires one of"):
        shapes_for("huge", "gather", 2)
    with pytest.raises(ValueError, match="shape kind requires one of"):
        shapes_for("seed", "allreduce", 2)
    with pytest.raises(ValueError, match="--shapes requires one of"):
        expand_sets("huge")


def test_all_means_the_gpu_sets():
    assert expand_sets("all") == GPU_SETS and "tiny" not in GPU_SETS
    assert set(SHAPE_SETS) == set(GPU_SETS) | {"tiny"}
    assert expand_sets("tiny") == ("tiny",)


def test_registry_has_both_ops_and_rejects_duplicates():
    assert cases.CASES["all_gather_matmul"].kind == "gather"
    assert cases.CASES["matmul_reduce_scatter"].kind == "scatter"
    with pytest.raises(ValueError, match="new op name"):
        cases.register("all_gather_matmul", "gather")(lambda *a: None)
    with pytest.raises(ValueError, match="register requires a kind"):
        cases.register("x", "broadcast")


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_cli_defaults_to_tiny_without_gpus(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "_has_gpus", lambda: False)
    cfg = cli.config_from_args(_args())
    assert cfg.shape_sets == ("tiny",) and cfg.ops == tuple(cases.CASES)
    assert cfg.iters == 50 and cfg.warmup == 10 and cfg.graph and not cfg.tune
    assert cfg.command.startswith("asynctp bench --op all --shapes tiny --dtype bfloat16 --iters 50")
    cfg = cli.config_from_args(_args(op="matmul_reduce_scatter", shapes="all", no_graph=True, tune=True))
    assert cfg.ops == ("matmul_reduce_scatter",) and cfg.shape_sets == GPU_SETS
    assert not cfg.graph and cfg.tune and "--no-graph --tune" in cfg.command
    with pytest.raises(ValueError, match="--iters requires a positive count, got 0"):
        cli.config_from_args(_args(iters=0))
    cfg = cli.config_from_args(_args(contention=True, contention_mb=64))
    assert cfg.contention == (8192, 64)
    assert cfg.command == "asynctp bench --contention --contention-size 8192 --contention-mb 64"
    assert cli.run(_args(contention=True)) == 2  # needs GPUs


def test_launch_plan(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert launch.plan(None) == launch.Plan("gloo", 2, False)
    assert launch.plan(3) == launch.Plan("gloo", 3, False)
    with pytest.raises(ValueError, match="--nproc requires at least 2 ranks"):
        launch.plan(1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch.plan(None) == launch.Plan("gloo", 4, True)
    assert launch.SAFE_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def test_shape_is_hashable_and_frozen():
    s = Shape("seed", "", 2048, 3584, 8192)
    with pytest.raises(AttributeError):
        s.m = 1  # type: ignore[misc]
    assert {s: 1}[Shape("seed", "", 2048, 3584, 8192)] == 1
