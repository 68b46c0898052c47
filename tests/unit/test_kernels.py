"""asynctp.kernels on CPU: the references keep the kernels' chunk order and are exact; the
reduce-scatter producer's schedule never makes a block wait for work queued behind it; with
Triton installed, the kernels themselves run in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from asynctp.kernels import async_input_mm, chunk_order
from asynctp.kernels.producer_mm import OWN, PEER, producer_mm_reference, schedule


def test_chunk_order_starts_at_the_pivot():
    assert chunk_order(4, 0) == [0, 1, 2, 3]
    assert chunk_order(4, 3) == [3, 0, 1, 2]


@pytest.mark.parametrize("pivot", [0, 1, 2])
def test_reference_is_exact(pivot):
    a = torch.randint(-4, 5, (48, 20)).float()
    b = torch.randint(-4, 5, (20, 12)).float()
    bias = torch.randint(-4, 5, (12,)).float()
    flags = torch.ones(3, dtype=torch.int32)
    assert torch.equal(async_input_mm(a, b, flags, pivot), a @ b)
    assert torch.equal(async_input_mm(a, b, flags, pivot, bias=bias), a @ b + bias)


def test_reference_scales_rowwise():
    a = torch.randint(-4, 5, (16, 8)).float()
    b = torch.randint(-4, 5, (8, 6)).float()
    sa, sb = torch.rand(16, 1), torch.rand(1, 6)
    out = async_input_mm(a, b, torch.ones(2, dtype=torch.int32), 1, a_scale=sa, b_scale=sb, out_dtype=torch.float32)
    torch.testing.assert_close(out, (a @ b) * sa * sb)


def test_bad_arguments_raise():
    a, b = torch.zeros(10, 4), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="divisible by the number of chunk signals"):
        async_input_mm(a, b, torch.ones(3, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="pivot"):
        async_input_mm(a, b, torch.ones(2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\]"):
        async_input_mm(a, torch.zeros(5, 3), torch.ones(2, dtype=torch.int32), 0)


@pytest.mark.parametrize("world,blocks", [(2, 1), (2, 3), (3, 2), (4, 2), (8, 1)])
def test_schedule_cannot_deadlock(world, blocks):
    """Own block j of rank r waits for item (PEER, r, j) of every peer. It must be possible to
    finish every item in order on every rank: a wait only on items that precede it nowhere
    behind a waiting item (induction over the ranks' positions)."""
    scheds = [schedule(r, world, blocks) for r in range(world)]
    for sched in scheds:
        assert sorted(x for x in sched if x[0] == OWN) == [(OWN, sched[-1][1], j) for j in range(blocks)]
        assert len([x for x in sched if x[0] == PEER]) == (world - 1) * blocks
    pos = [0] * world
    done = [set() for _ in range(world)]
    progress = True
    while progress:
        progress = False
        for r in range(world):
            while pos[r] < len(scheds[r]):
                kind, dst, j = scheds[r][pos[r]]
                if kind == OWN and not all((PEER, r, j) in done[p] for p in range(world) if p != r):
                    break
                done[r].add((kind, dst, j))
                pos[r] += 1
                progress = True
    assert all(p == len(s) for p, s in zip(pos, scheds))


def test_producer_reference_is_the_reduce_scatter():
    world, blocks, m = 3, 2, 4
    a = [torch.randint(-3, 4, (world * m, 5)).float() for _ in range(world)]
    b = [torch.randint(-3, 4, (5, 6)).float() for _ in range(world)]
    zeros = [torch.zeros(m, 6)] * world
    parts = [producer_mm_reference(a[r], b[r], r, world, blocks, zeros)[0] for r in range(world)]
    for r in range(world):
        received = [None if s == r else parts[s][(r - s) % world - 1] for s in range(world)]
        _, out = producer_mm_reference(a[r], b[r], r, world, blocks, received)
        want = sum(a[s][r * m : (r + 1) * m] @ b[s] for s in range(world))
        assert torch.equal(out, want)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_kernels_in_triton_interpreter():
    """The Triton kernels themselves, run by TRITON_INTERPRET=1 in a fresh process."""
    script = os.path.join(os.path.dirname(__file__), "_kernels_interpreted.py")
    from tests.multiprocess import script_env

    env = script_env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    if "only 0-dimensional arrays can be converted" in res.stderr:  # (numpy >= 2.4's message; Triton 3.6's interpreter)
        pytest.skip("this Triton's interpreter does not run with this numpy (numpy < 2.4 runs it)")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok"), res.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler)")
def test_gluon_kernels_compile_for_hopper():
    """The Gluon kernels compile for sm_90 without a GPU (Triton's compiler and ptxas), through the
    launch functions the ops call: the all-gather GEMM storing the gathered rows and not, with a
    4-stage ring (half an output tile staged), the reduce-scatter producer, bf16 and fp8 rowwise and tensorwise (in a fresh process: the script
    replaces Triton's driver)."""
    script = os.path.join(os.path.dirname(__file__), "_gluon_compiled.py")
    from tests.multiprocess import script_env

    res = subprocess.run([sys.executable, script], env=script_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("compiled") == 13 and res.stdout.strip().endswith("ok"), res.stdout


def test_unmeasured_shapes_start_the_bf16_ops_on_the_single_launch_path():
    from asynctp.ops import tuning

    big = ("bfloat16", 8192, 3584, 8192)
    assert tuning._rule("matmul_reduce_scatter", big) == "fused"
    assert tuning._rule("matmul_reduce_scatter", ("bfloat16", 2048, 3584, 8192)) == "fused"
    assert tuning._rule("scaled_matmul_reduce_scatter", ("float8_e4m3fn-rowwise", 8192, 3584, 8192)) == "pipeline"
    assert tuning._rule("all_gather_matmul", big) == "fused"
    assert tuning._rule("all_gather_matmul", ("bfloat16", 4096, 3584, 8192)) == "fused"
    assert tuning._rule("all_gather_matmul", ("bfloat16", 2048, 3584, 8192)) == "pipeline"
    assert tuning._rule("all_gather_scaled_matmul", ("float8_e4m3fn-rowwise", 8192, 3584, 8192)) == "pipeline"
    assert tuning._rule("matmul_reduce_scatter", ("bfloat16", 256, 256, 256)) == "serial"


def test_tuner_times_once_keeps_the_fastest_and_persists(tmp_path):
    from asynctp.kernels import configs

    path = str(tmp_path / "kernels.json")
    timed = []

    def time_us(cfg):
        timed.append(cfg)
        if cfg.block_m == 64:
            raise RuntimeError("does not fit")  # skipped, not chosen
        return 100.0 if cfg.flatten else 90.0

    shape = (torch.bfloat16, 4096, 3584, 8192)
    best = configs.tune(*shape, 2048, time_us, path=path)
    assert not best.flatten and best.block_m == 128
    assert len(timed) == len(configs.candidates(torch.bfloat16))
    assert configs.tune(*shape, 2048, time_us, path=path) == best and len(timed) == len(configs.candidates(torch.bfloat16))
    assert configs.pick_config(*shape, 2048) == best
    configs._tuned.clear()  # another process: reads the file instead of timing
    assert configs.tune(*shape, 2048, lambda cfg: 1 / 0, path=path) == best
    # a tile that does not divide the chunks is never timed
    configs._tuned.clear()
    timed.clear()
    configs.tune(torch.bfloat16, 192, 64, 64, 64, time_us)
    assert all(64 % c.block_m == 0 for c in timed)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_reduce_scatter_tunes_apart_on_whole_tile_configs(dtype, tmp_path):
    """The table's deeper ring (the all-gather's Gluon GEMM, half an output tile staged) runs
    with 3 stages in the kernels that stage a whole tile, is never timed for the reduce-scatter's
    producer, and the producer's pick for a problem does not replace the all-gather's."""
    from asynctp.kernels import configs

    deep = [c for c in configs.candidates(dtype) if configs.whole_tile(c, dtype.itemsize) != c]
    assert [(c.block_m, c.block_n, c.stages, c.split) for c in deep] == [(128, 256, 4, False)]
    assert configs.whole_tile(deep[0], dtype.itemsize) == dataclasses.replace(deep[0], stages=3)
    assert all(configs.gluon_fits(c, dtype.itemsize, half_out=True) for c in configs.candidates(dtype))
    assert configs.candidates(dtype, whole=True) == [c for c in configs.candidates(dtype) if c not in deep]

    configs._tuned.clear()
    path = str(tmp_path / "kernels.json")
    shape = (dtype, 4096, 3584, 8192)
    timed = []

    def time_us(cfg):
        timed.append(cfg)
        return 80.0 if cfg == deep[0] else 100.0 - len(timed)

    assert configs.tune(*shape, 2048, time_us, path=path) == deep[0]
    timed.clear()
    rs = configs.tune(*shape, 2048, time_us, path=path, scatter=True)
    assert deep[0] not in timed and len(timed) == len(configs.candidates(dtype)) - 1 and rs == timed[-1]
    assert configs.pick_config(*shape, 2048) == deep[0] and configs.pick_config(*shape, 2048, scatter=True) == rs
    configs._tuned.clear()  # another process reads both back
    assert configs.pick_config(*shape, 2048, scatter=True) == configs.candidates(dtype)[0]
    assert configs.tune(*shape, 2048, lambda cfg: 1 / 0, path=path, scatter=True) == rs
    assert configs.tune(*shape, 2048, lambda cfg: 1 / 0, path=path) == deep[0]
    configs._tuned.clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_producer_is_timed_as_its_call_runs_it(dtype, monkeypatch):
    """The reduce-scatter's tile is timed on the producer itself, as rank 0 of the op's world:
    its chunk in blocks of the call's rows, every peer's flag set and the counters zeroed before
    each run (a run clears and counts them), b as weight.t(), unit scales for fp8; operands made
    once per problem, at the first timing."""
    from asynctp.kernels import configs, tune_timers

    world, m, n, k, rows = 4, 1024, 96, 64, 128
    seen = []

    def fake_launch(a, b, partials, received, out, rank, world_, blocks, a_strides, flags, sig_strides, counters, *,
                    a_scale, b_scale, config):
        assert (rank, world_, blocks, a_strides, sig_strides) == (0, world, 2, (256, 128), (1, world))
        assert a.shape == (m, k) and b.shape == (k, n) and b.stride(0) == 1 and a.dtype == b.dtype == dtype
        assert out.shape == (256, n) and partials.shape == (world - 1, 256, n) and received.shape == (world, 256, n)
        assert out.dtype == torch.bfloat16 and (a_scale is None) == (dtype == torch.bfloat16) == (b_scale is None)
        assert flags.eq(1).all() and flags.numel() == world * 2
        assert counters.eq(0).all() and counters.numel() == world * 2 + 2
        flags[1:].zero_()  # as the own tiles leave the peers' flags
        counters[:2].fill_(7)  # as the peer tiles count
        seen.append((config, a.data_ptr()))

    def fake_median(run, reset, device):
        for _ in range(3):
            reset()
            run()
        return 10.0 + len(seen)

    monkeypatch.setattr(tune_timers, "launch_producer", fake_launch)
    monkeypatch.setattr(tune_timers, "_median_us", fake_median)
    time_us = tune_timers.producer(dtype, m, n, k, rows, torch.device("cpu"), world)
    assert not seen  # nothing made before the first timing
    whole = configs.candidates(dtype, whole=True)
    assert [time_us(c) for c in whole[:2]] == [13.0, 16.0]
    assert [c for c, _ in seen] == [whole[0]] * 3 + [whole[1]] * 3 and len({p for _, p in seen}) == 1


def test_the_kernel_tuner_times_each_kernel_as_it_runs(monkeypatch, tmp_path):
    """kernel_path._config times the reduce-scatter's producer (with the op's world size) and
    the all-gather's GEMM, each under its own key; a problem already tuned times nothing."""
    from asynctp.kernels import configs, tune_timers
    from asynctp.runtime import kernel_path

    made, timed = [], []

    def timer(kind):
        def make(dtype, m, n, k, rows, device, world):
            made.append((kind, m, n, k, rows, world))

            def time_us(cfg):
                timed.append(kind)
                return 5.0 if cfg == configs.candidates(dtype, whole=True)[-1] else 9.0
            return time_us
        return make

    monkeypatch.setattr(tune_timers, "producer", timer("producer"))
    monkeypatch.setattr(tune_timers, "gather", timer("gather"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernel_path, "_kernels_cache", lambda: str(tmp_path / "kernels.json"))
    configs._tuned.clear()
    dt = torch.bfloat16
    rs = kernel_path._config(dt, 4096, 3584, 8192, 1024, torch.device("cpu"), True, 4)
    ag = kernel_path._config(dt, 4096, 3584, 8192, 1024, torch.device("cpu"), False, 4)
    assert made == [("producer", 4096, 3584, 8192, 1024, 4), ("gather", 4096, 3584, 8192, 1024, 4)]
    assert timed == ["producer"] * len(configs.candidates(dt, whole=True)) + ["gather"] * len(configs.candidates(dt))
    assert rs == configs.candidates(dt, whole=True)[-1] and ag == rs
    assert kernel_path._config(dt, 4096, 3584, 8192, 1024, torch.device("cpu"), True, 4) == rs
    assert len(timed) == len(configs.candidates(dt, whole=True)) + len(configs.candidates(dt))
    assert configs.pick_config(dt, 4096, 3584, 8192, scatter=True) == rs
    configs._tuned.clear()


@pytest.mark.parametrize(
    "tiles, sms, k_tiles, parts",
    [
        (448, 132, 128, 2),  # 4096 x 3584 in 128x256 tiles on an H100: 52 tiles in the fourth wave
        (448, 112, 128, 1),  # four full waves: nothing to split
        (896, 132, 128, 1),  # 104 of 132 SMs busy in the last wave: splitting cannot pay
        (20, 132, 128, 2),  # one partial wave: at most 2 parts
        (20, 132, 8, 2),  # every part keeps 4 K-tiles
        (20, 132, 7, 1),
    ],
)
def test_the_last_partial_wave_is_split_along_k(tiles, sms, k_tiles, parts):
    from asynctp.kernels.configs import split_parts

    assert split_parts(tiles, sms, k_tiles) == parts
    if parts > 1:  # one part per program: no program waits on another's part
        assert tiles % sms * parts <= sms



@pytest.mark.parametrize("stages,block_k,itemsize,fits", [(3, 128, 1, True), (4, 128, 1, False), (3, 64, 2, True),
                                                         (4, 64, 2, False)])
def test_gluon_ring_and_epilogue_buffer_fit_shared_memory(stages, block_k, itemsize, fits):
    """128x256 tiles: 3 stages of fp8 128-deep or 16-bit 64-deep K-steps and a bf16 output tile fit
    227 KiB (208 KiB), 4 do not (256 KiB); 4 with half an output tile do (224 KiB), 5 do not."""
    from asynctp.kernels.configs import Config, gluon_fits

    assert gluon_fits(Config(128, 256, block_k, stages=stages), itemsize) is fits
    assert gluon_fits(Config(128, 256, block_k, stages=stages), itemsize, half_out=True)
    assert not gluon_fits(Config(128, 256, block_k, stages=5), itemsize, half_out=True)


def _fast_launch(monkeypatch, kernel) -> tuple:
    """A FastLaunch over a stand-in @triton.jit function whose launches through Triton are
    recorded and return `kernel` (the compiled kernel), on a stand-in current stream 7."""
    from asynctp.kernels.triton_util import FastLaunch

    through_triton = []

    class Fn:
        def __getitem__(self, grid):
            return lambda *args, **options: through_triton.append(args) or kernel

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return FastLaunch(Fn()), through_triton


def test_fast_launch_keys_hooks_and_fallback(monkeypatch):
    """FastLaunch: a key's first launch goes through Triton, later ones through the compiled
    kernel's launcher; another alignment or value is another key; a launch hook, or a launcher
    that refuses its arguments, sends launches through Triton."""
    pytest.importorskip("triton")
    direct = []

    class Kernel:
        function = packed_metadata = None
        refuse = False

        def run(self, *args):
            if Kernel.refuse:
                raise TypeError("bad arguments")
            direct.append(args)

    launch, through_triton = _fast_launch(monkeypatch, Kernel())
    store = torch.zeros(9, dtype=torch.int16)
    launch((4,), (store[:8], 3, True), num_warps=4)
    launch((4,), (store[:8], 3, True), num_warps=4)
    assert len(through_triton) == 1 and len(direct) == 1
    grid_and_stream, args = direct[0][:4], direct[0][9:]
    assert grid_and_stream == (4, 1, 1, 7) and args[0].data_ptr() == store.data_ptr() and args[1:] == (3, True)
    launch((4,), (store[1:], 3, True), num_warps=4)  # 2 bytes off 16-byte alignment: a new key
    launch((4,), (store[:8], 4, True), num_warps=4)  # another value: a new key
    assert len(through_triton) == 3 and len(direct) == 1
    runtime = launch._runtime
    hook = lambda *a, **k: None  # noqa: E731
    if hasattr(runtime.launch_enter_hook, "add"):  # Triton >= 3.5: a chain of hooks
        runtime.launch_enter_hook.add(hook)
        undo = lambda: runtime.launch_enter_hook.remove(hook)  # noqa: E731
    else:
        old = runtime.launch_enter_hook
        runtime.launch_enter_hook = hook
        undo = lambda: setattr(runtime, "launch_enter_hook", old)  # noqa: E731
    try:
        launch((4,), (store[:8], 3, True), num_warps=4)
    finally:
        undo()
    assert len(through_triton) == 4 and len(direct) == 1
    Kernel.refuse = True
    with pytest.warns(RuntimeWarning, match="refused a direct launch"):
        launch((4,), (store[:8], 3, True), num_warps=4)
    assert not launch.fast and len(through_triton) == 5


def test_direct_launches_and_their_memo(monkeypatch):
    """Where the compiled launcher is Triton's CUDA one, later launches call its C function with the
    arguments its wrapper would make, each descriptor encoded once per address; a launch with a
    memo repeats from again(memo), tensors as addresses (not under a launch hook); a descriptor
    that fails Triton's checks raises and launches nothing; a launcher of another layout is
    launched through its wrapper, with a warning."""
    pytest.importorskip("triton")
    from triton.backends.nvidia import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not hasattr(driver, "wrap_handle_tensordesc"):
        pytest.skip("this Triton's launcher is not the one the direct launches know")

    from asynctp.kernels.triton_util import memo_key

    calls, encoded = [], []
    monkeypatch.setattr(driver, "make_tensordesc_arg", lambda d, meta: encoded.append(d) or [("map", d.base.data_ptr()),
                                                                                              *d.shape, *d.strides])

    class CudaLauncher:  # Triton's: its launch wraps the C function (wrap_handle_tensordesc)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def __init__(self):
            signature = {0: "tensordesc<bf16[8, 8]>", 1: "*i32", 2: "i32"}
            self.launch = driver.wrap_handle_tensordesc(lambda *final: calls.append(final), signature, [{"swizzle": 0}])

    class Kernel:
        function, packed_metadata, run = 11, ("meta",), CudaLauncher()

    launch, through_triton = _fast_launch(monkeypatch, Kernel())
    base, flags = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32)
    desc = lambda t: TensorDescriptor(t, list(t.shape), [8, 1], [8, 8])  # noqa: E731
    memo = memo_key(base, flags, 3)
    for _ in range(3):
        launch((2,), (desc(base), flags, 3), memo, num_warps=4)
    assert len(through_triton) == 1 and len(calls) == 2 and len(encoded) == 1
    head = (2, 1, 1, 7, 11, False, False, None, None, ("meta",), None, None, None)
    assert calls[0][:13] == head and calls[0][13:15] == (("map", base.data_ptr()), 16) and calls[0][-2:] == (flags, 3)
    assert launch.again(memo) and calls[-1][:13] == head and calls[-1][-2:] == (flags.data_ptr(), 3)
    assert not launch.again(memo_key(base, flags, 4)) and len(calls) == 3
    runtime = launch._runtime
    if hasattr(runtime.launch_enter_hook, "add"):
        hook = lambda *a, **k: None  # noqa: E731
        runtime.launch_enter_hook.add(hook)
        try:
            assert not launch.again(memo)
        finally:
            runtime.launch_enter_hook.remove(hook)
    off = torch.zeros(16 * 8 + 1, dtype=torch.bfloat16)[1:].view(16, 8)  # 2 bytes off 16-byte alignment
    with pytest.raises(AssertionError, match="16-byte aligned"):
        launch((2,), (desc(off), flags, 3), num_warps=4)
    assert len(through_triton) == 1 and len(calls) == 3
    Kernel.run.launch = lambda *final: None  # a wrapper of another layout: through it, said once
    other, _ = _fast_launch(monkeypatch, Kernel())
    with pytest.warns(RuntimeWarning, match="not the CUDA one asynctp calls directly"):
        other((2,), (flags, 3), num_warps=4)


def test_kernel_path_declines_a_cpu_workspace_without_cuda_queries():
    """On a CPU workspace the single-launch path names why it declines, twice (the second from
    its per-problem answer), without a CUDA query (on a CPU-only torch those raise)."""
    from asynctp.runtime import kernel_path

    class Ws:
        device, world_size = torch.device("cpu"), 2

    ws, a = Ws(), torch.zeros(256, 64)
    for _ in range(2):
        assert kernel_path.gather_available(ws, a, 0, False, 64) == "the single-launch GEMM runs on CUDA"
        assert kernel_path.scatter_available(ws, a, 64, 0, False) == "the single-launch GEMM runs on CUDA"
