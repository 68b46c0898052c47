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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wgrad_contraction(pool, dtype):
    assert pool.run(cases_nn.contract_cases, DEVICE, dtype)[0] == 12


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_recipes_by_sqnr(pool, recipe):
    worst = pool.run(cases_nn.float8_linears, DEVICE, recipe, "bfloat16")[0]
    assert worst["out"] >= 25, worst
    assert min(worst.values()) >= 18, worst


@needs_style_world
@pytest.mark.parametrize("asynchronous", [False, True], ids=["vanilla", "async"])
def test_sharded_model_matches_single_process(pool, asynchronous):
    assert pool.run(cases_nn.styles_match_single_process, DEVICE, asynchronous)[0] == 21


@pytest.mark.skipif(NUM_GPUS not in (2, 4, 8), reason="the 128-wide-head model shards over 2, 4 or 8 GPUs")
@pytest.mark.parametrize("batch", [1, 2])
def test_bfloat16_grads_at_batch_sizes(pool, batch):
    """bf16 gradients of both plans track the float32 model alike at batch 1 and 2 (a batch-2 bug
    gave the async plan's attention gradients a relative error of ~1.5)."""
    worst = pool.run(cases_nn.bf16_grads_track_float32, DEVICE, batch)[0]
    assert worst["vanilla"] <= 0.05, worst
    assert worst["async"] <= 0.05, worst


@needs_style_world
def test_bfloat16_loss_curves_agree(pool):
    vanilla, fused = pool.run(cases_nn.loss_curves, DEVICE, 30, "bfloat16", None, 3e-3)[0]
    assert vanilla[-1] < vanilla[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(vanilla, fused)) <= 1e-2, (vanilla, fused)


# fp8 vs bf16 training, 30 steps of the 2-layer test model (dim 192) on 2 x 12-token batches.
# Smoothed (mean of the last 10 losses): published fp8-vs-bf16 gaps on smoothed curves are under 1%
# (DeepSeek-V3: < 0.25% relative loss error; torchao / torchtitan Llama 3 curves overlap), and the
# CPU emulation of both recipes on this model (same code, 6 init seeds) stays under 0.25%; 3% is
# margin for a 30-step toy model, and still fails a recipe that learns at half bf16's speed (the
# whole drop here is ~0.3 nats, ~7%).
FP8_SMOOTHED_GAP = 3e-2
# Per step: two different trajectories scored on one tiny batch. The first AdamW steps move every
# weight by ~lr whatever its gradient's size, so e5m2 gradients (2 mantissa bits) flip the updates
# of the small ones, a 24-token loss amplifies the difference, and the max over 30 steps keeps the
# worst. 2xH200 measured 6.5% with both recipes (the CPU emulation: <= 2%, so a GPU rerun should
# look at the curves this prints). Scale bugs are the SQNR test's job: AdamW divides a gradient's
# scale away, so a loss curve barely sees one.
FP8_STEP_GAP = 1e-1


def _curves(vanilla: list[float], fused: list[float]) -> str:
    """Both curves and their per-step relative gap, one step a line (pytest would elide a repr)."""
    rows = [f"{i:3d} {a:.4f} {b:.4f} {abs(a - b) / abs(a):.4f}" for i, (a, b) in enumerate(zip(vanilla, fused))]
    return "\nstep bf16 fp8 gap\n" + "\n".join(rows)


@needs_style_world
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_training_follows_bfloat16(pool, recipe):
    vanilla, fused = pool.run(cases_nn.loss_curves, DEVICE, 30, "bfloat16", recipe, 1e-3)[0]
    curves = _curves(vanilla, fused)
    assert fused[-1] < fused[0] - 0.2, curves
    tail_bf16, tail_fp8 = sum(vanilla[-10:]) / 10, sum(fused[-10:]) / 10
    assert abs(tail_fp8 - tail_bf16) / tail_bf16 <= FP8_SMOOTHED_GAP, curves
    assert max(abs(a - b) / abs(a) for a, b in zip(vanilla, fused)) <= FP8_STEP_GAP, curves


@needs_style_world
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_training_replays_and_paths_agree(pool, recipe):
    counts = pool.run(cases_nn.float8_training_paths_agree, DEVICE, recipe)
    assert all(c["default"]["replayed"] > 0 for c in counts)


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
