"""The training layer on the cuda backend (all local GPUs, NCCL): the autograd functions exactly
against the serial reference, layers in a row, fp8 recipes by SQNR, the parallel styles against
one unsharded model, bf16 / fp8 loss curves of the vanilla and async plans, and the demo."""

import json

import pytest

from tests import cases_nn
from tests.gpu.conftest import NUM_GPUS

DEVICE = "cuda"
# the test model's head counts (12 / 6), ffn and vocab divide by 2, 3 and 6 only
STYLE_WORLDS = (2, 3, 6)
needs_style_world = pytest.mark.skipif(NUM_GPUS not in STYLE_WORLDS, reason=f"test model shards over {STYLE_WORLDS} GPUs")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", ["auto", "pipeline", "serial"])
def test_linears_match_serial_reference(pool, dtype, strategy):
    assert pool.run(cases_nn.linear_grid, DEVICE, dtype, strategy)[0] == 18


@pytest.mark.parametrize("save", [False, True], ids=["regather", "saved"])
def test_two_layers_in_a_row(pool, save):
    pool.run(cases_nn.two_layers_in_a_row, DEVICE, save)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_recipes_by_sqnr(pool, recipe):
    worst = pool.run(cases_nn.float8_linears, DEVICE, recipe, "bfloat16")[0]
    assert worst["out"] >= 25, worst
    assert min(worst.values()) >= 18, worst


@needs_style_world
@pytest.mark.parametrize("asynchronous", [False, True], ids=["vanilla", "async"])
def test_sharded_model_matches_single_process(pool, asynchronous):
    assert pool.run(cases_nn.styles_match_single_process, DEVICE, asynchronous)[0] == 21


@needs_style_world
def test_bfloat16_loss_curves_agree(pool):
    vanilla, fused = pool.run(cases_nn.loss_curves, DEVICE, 30, "bfloat16", None, 3e-3)[0]
    assert vanilla[-1] < vanilla[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(vanilla, fused)) <= 1e-2, (vanilla, fused)


@needs_style_world
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_training_follows_bfloat16(pool, recipe):
    vanilla, fused = pool.run(cases_nn.loss_curves, DEVICE, 30, "bfloat16", recipe, 1e-3)[0]
    assert fused[-1] < fused[0] - 0.2
    assert max(abs(a - b) / abs(a) for a, b in zip(vanilla, fused)) <= 5e-2, (vanilla, fused)


def test_bad_plans(pool):
    pool.run(cases_nn.bad_plans, DEVICE)


def test_demo_small(tmp_path):
    from asynctp.cli import main

    assert main(["demo", "--model", "small", "--steps", "8", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("demo_*.json")
    record = json.loads(path.read_text())
    vanilla, fused = record["runs"]
    assert max(abs(a - b) / abs(a) for a, b in zip(vanilla["losses"], fused["losses"])) <= 1e-2
    assert fused["peak_memory_bytes"] > 0
