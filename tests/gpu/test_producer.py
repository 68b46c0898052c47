"""The reduce-scatter producer GEMM alone, on one GPU, in one process: its partials, counters,
flags and reduced chunk against the reference, the Gluon and the Triton kernel bit-equal (bf16 and
fp8 e4m3 with either scaling), and the fallback to the Triton kernel."""

from __future__ import annotations

import pytest
import torch

from asynctp.kernels import producer_mm
from asynctp.kernels.configs import Config
from asynctp.kernels.producer_mm import launch_producer, producer_mm_reference
from tests.cases_float8 import sqnr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize("world,blocks,m,n,k", [(2, 1, 512, 640, 384), (2, 2, 512, 640, 384), (4, 2, 512, 640, 384),
                                                 (2, 2, 3072, 1024, 1024)])
def test_producer_against_reference(world, blocks, m, n, k, gluon):
    """Partials, the reduced chunk, the counters and flags left behind, by either kernel. The
    last shape has a partial last wave that the Triton kernel splits along K (192 tiles on 132
    SMs: 60 in two parts each)."""
    for rank in range(world):
        a = torch.randn(world * m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        received = torch.randn(world, m, n, device="cuda", dtype=torch.bfloat16)
        partials = torch.empty(world - 1, m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        flags = torch.ones(world * blocks, dtype=torch.int32, device="cuda")  # (src, blk) at src + blk * world
        counters = torch.zeros(world * blocks + blocks, dtype=torch.int32, device="cuda")
        tiles, _ = launch_producer(a, b, partials, received, out, rank, world, blocks, (m, m // blocks), flags,
                                   (1, world), counters, gluon=gluon)
        ref_parts, ref_out = producer_mm_reference(a.double(), b.double(), rank, world, blocks,
                                                   [r.double() for r in received])
        for got, ref in zip(partials, ref_parts):
            assert (got.double() - ref).norm() / ref.norm() < 1e-2
        assert (out.double() - ref_out).norm() / ref_out.norm() < 1e-2
        done = counters[: world * blocks].view(world, blocks)
        assert done[rank].count_nonzero() == 0
        assert (done[[d for d in range(world) if d != rank]] == tiles).all()
        assert counters[world * blocks :].count_nonzero() == 0
        own = flags.view(blocks, world)
        assert own[:, rank].eq(1).all() and own[:, [s for s in range(world) if s != rank]].eq(0).all()


@pytest.mark.parametrize("operands", ["bf16 weight.t()", "bf16 [K, N]", "fp8 rowwise", "fp8 tensorwise"])
def test_producer_kernels_agree(operands):
    """The Gluon and the Triton kernel scale (fp8: a's, then b's) and add in the same order:
    bit-equal partials and chunks (sum; avg with a bias), and the same counters and flags left
    behind (the Triton kernel's last wave unsplit: its K-parts would add in another order); fp8's
    partials match torch._scaled_mm."""
    world, blocks, m, n, k = 2, 2, 1024, 768, 640
    fp8 = operands.startswith("fp8")
    whole = Config(128, 256, 128 if fp8 else 64, split=False)
    deep = Config(128, 256, 128 if fp8 else 64, stages=4, split=False)  # the all-gather's ring: 3 stages here
    dt = FP8 if fp8 else torch.bfloat16
    a = (torch.randn(world * m, k, device="cuda") * 2).to(dt)
    b = ((torch.randn(k, n, device="cuda") * 2).to(dt) if operands == "bf16 [K, N]"
         else (torch.randn(n, k, device="cuda") * 2).to(dt).t())
    rowwise = operands == "fp8 rowwise"
    sa = (torch.rand(world * m, 1, device="cuda") + 0.5 if rowwise else torch.tensor(0.7, device="cuda")) if fp8 else None
    sb = (torch.rand(1, n, device="cuda") + 0.5 if rowwise else torch.tensor(1.3, device="cuda")) if fp8 else None
    received = torch.randn(world, m, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for reduce_op, bias_ in (("sum", None), ("avg", bias)):
        got = []
        for gluon, cfg in ((True, whole), (False, whole), (True, deep), (False, deep)):
            partials = torch.full((world - 1, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            flags = torch.ones(world * blocks, dtype=torch.int32, device="cuda")
            counters = torch.zeros(world * blocks + blocks, dtype=torch.int32, device="cuda")
            _, ran = launch_producer(a, b, partials, received, out, 1, world, blocks, (m, m // blocks), flags,
                                     (1, world), counters, reduce_op=reduce_op, a_scale=sa, b_scale=sb, bias=bias_,
                                     gluon=gluon, config=cfg)
            assert ran == whole
            got.append((partials, out, flags, counters))
        assert producer_mm._gluon_failed is None and producer_mm._gluon_serves(a, b, out, fp8, whole)
        assert all(torch.equal(x, y) for other in got[1:] for x, y in zip(got[0], other))
        if fp8:  # rank 1's peer block: rank 0's rows
            want = torch._scaled_mm(a[:m], b, sa[:m] if rowwise else sa, sb, out_dtype=torch.bfloat16)
            assert sqnr(want, got[0][0][0]) >= 40


def test_producer_falls_back_to_triton(monkeypatch, capsys):
    """A Gluon kernel that does not build (another Triton): one warning, and the Triton kernel's
    result from then on; operands the kernels cannot take raise, and are not taken for a failed
    build."""
    from asynctp import config
    from asynctp.kernels import _rs_gluon, producer_mm

    def broken(*args):
        raise RuntimeError("no such Gluon builtin")

    real = _rs_gluon.launch
    monkeypatch.setattr(_rs_gluon, "launch", broken)
    monkeypatch.setattr(producer_mm, "_gluon_failed", None)
    monkeypatch.setattr(config, "_warned", set())
    world, blocks, m, n, k = 2, 1, 256, 512, 256
    a = torch.randn(world * m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    received = torch.randn(world, m, n, device="cuda", dtype=torch.bfloat16)
    partials = torch.empty(world - 1, m, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="Gluon GEMM does not build"):
        launch_producer(a, b, partials, received, out, 0, world, blocks, (m, m), torch.ones(world, dtype=torch.int32,
                        device="cuda"), (1, world), torch.zeros(world + 1, dtype=torch.int32, device="cuda"))
    assert producer_mm._gluon_failed.startswith("RuntimeError")
    want = a[m:].double() @ b.double()
    assert (partials[0].double() - want).norm() / want.norm() < 1e-2
    monkeypatch.setattr(producer_mm, "_gluon_failed", None)
    monkeypatch.setattr(_rs_gluon, "launch", real)
    with pytest.raises(ValueError, match="blocks of a multiple of 128 rows, got 64"):  # the caller's: no fallback
        launch_producer(a, b, partials, received, out, 0, world, 4, (m, m // 4), torch.ones(4 * world, dtype=torch.int32,
                        device="cuda"), (1, world), torch.zeros(5 * world, dtype=torch.int32, device="cuda"),
                        config=Config(128, 256, 64))  # (without it, a 64-row tile is picked for such blocks)
    assert producer_mm._gluon_failed is None
    monkeypatch.setattr(_rs_gluon, "launch", broken)
    with pytest.raises(RuntimeError, match="no such Gluon builtin"):  # asked for by name: no fallback
        monkeypatch.setattr(producer_mm, "_gluon_failed", None)
        launch_producer(a, b, partials, received, out, 0, world, blocks, (m, m), torch.ones(world, dtype=torch.int32,
                        device="cuda"), (1, world), torch.zeros(world + 1, dtype=torch.int32, device="cuda"), gluon=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_the_tuner_times_the_producer(dtype):
    """The kernel tuner's timer of the reduce-scatter runs the producer itself with each of its
    candidates (the Gluon kernel for 128 x 256 tiles, the Triton one for the others), flags and
    counters reset before each run: every run completes (a run that found its flags cleared would
    wait for ever) and takes a positive time."""
    from asynctp.kernels import configs, tune_timers

    time_us = tune_timers.producer(dtype, 2048, 1024, 512, 512, torch.device("cuda"), 2)
    for cfg in configs.candidates(dtype, whole=True):
        assert 0 < time_us(cfg) < 1e5, cfg
