"""Cases of the single-launch GPU path (strategy="fused") at sizes it serves: rows per rank a
multiple of the GEMM's tiles. Small-integer inputs make every product exact, so the path must
equal the serial reference bit for bit (atol=0) where no cross-rank reduction is reordered."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import asynctp
from tests.cases import ints, world

BF16 = torch.bfloat16


@contextlib.contextmanager
def kernel_path_calls() -> Iterator[list[str]]:
    """Inside the block, every call of runtime/kernel_path.py's gather_matmul / matmul_scatter
    appends its name to the list (the single-launch path served a call)."""
    from asynctp.runtime import kernel_path

    calls: list[str] = []
    originals = {name: getattr(kernel_path, name) for name in ("gather_matmul", "matmul_scatter")}

    def counting(name, fn):
        def run(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return run

    for name, fn in originals.items():
        setattr(kernel_path, name, counting(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(kernel_path, name, fn)


def fused_all_gather_exact() -> int:
    """Front order (dim 0) and batch-major (dim 1 of a batch of 2), one and two weights, with
    and without the gathered rows, with a bias: equal to serial; repeated calls too."""
    rank, ws = world()
    g = dist.group.WORLD
    checked = 0
    for shape, dim in (((1024, 256), 0), ((2, 512, 256), 1), ((512, 256), 0)):
        a = ints(shape, 10 + rank, BF16, "cuda", low=-1, high=2)
        bs = [ints((256, 384), 3, BF16, "cuda"), ints((384, 256), 4, BF16, "cuda").t()]
        biases = [ints((384,), 5, BF16, "cuda"), None]
        for return_a in (True, False):
            want_a, want = asynctp.all_gather_matmul(a, bs, dim, g, biases=biases, strategy="serial")
            for _ in range(2):
                got_a, got = asynctp.all_gather_matmul(a, bs, dim, g, biases=biases, return_a=return_a,
                                                       strategy="fused")
                assert (got_a is None) != return_a
                assert got_a is None or torch.equal(got_a, want_a), (shape, "gathered")
                for o, w in zip(got, want):
                    assert o.is_contiguous() and torch.equal(o, w), (shape, dim, (o.double() - w.double()).abs().max())
                checked += 1
    return checked


def fused_reduce_scatter_matches_serial() -> int:
    """Sum and avg, with a bias, dims 0 and 1: within one bf16 rounding of serial (the partials
    are added in fp32 and rounded once, serial rounds per step); exact where every rank holds
    the same small integers scaled by powers of two."""
    rank, ws = world()
    g = dist.group.WORLD
    checked = 0
    for shape, dim in (((1024 * ws, 256), 0), ((2, 512 * ws, 256), 1)):
        a = ints(shape, 20 + rank, BF16, "cuda", low=-1, high=2)
        b = ints((256, 320), 7, BF16, "cuda")
        bias = ints((320,), 8, BF16, "cuda")
        for reduce_op in ("sum", "avg"):
            want = asynctp.matmul_reduce_scatter(a, b, dim, g, reduce_op=reduce_op, bias=bias, strategy="serial")
            for _ in range(2):
                got = asynctp.matmul_reduce_scatter(a, b, dim, g, reduce_op=reduce_op, bias=bias, strategy="fused")
                assert got.shape == want.shape and got.is_contiguous()
                assert torch.equal(got, want), (shape, reduce_op, (got.double() - want.double()).abs().max())
                checked += 1
    return checked


def fused_random_bf16_close_to_serial() -> int:
    """Random bf16 at seed-like sizes: equal to serial up to GEMM rounding."""
    rank, ws = world()
    g = dist.group.WORLD
    torch.manual_seed(7 + rank)
    a = torch.randn(2048, 1024, device="cuda", dtype=BF16)
    torch.manual_seed(3)
    b = torch.randn(1024, 768, device="cuda", dtype=BF16) / 32
    a_f, (o_f,) = asynctp.all_gather_matmul(a, [b], 0, g, strategy="fused")
    a_s, (o_s,) = asynctp.all_gather_matmul(a, [b], 0, g, strategy="serial")
    assert torch.equal(a_f, a_s)
    torch.testing.assert_close(o_f, o_s, rtol=2e-2, atol=2e-2)
    w = b.t().contiguous()
    r_f = asynctp.matmul_reduce_scatter(o_f, w, 0, g, strategy="fused")
    r_s = asynctp.matmul_reduce_scatter(o_f, w, 0, g, strategy="serial")
    torch.testing.assert_close(r_f, r_s, rtol=2e-2, atol=5e-2)
    return 2


def fused_scaled_reduce_scatter_exact() -> int:
    """fp8 e4m3, tensorwise and rowwise scales (powers of two), dims 0 and 1: entries in
    {-1, 0, 1} over K 256 keep every partial an integer bf16 holds exactly, so both paths round
    the same exact sum once and fused equals serial bit for bit; with a bias, serial rounds once
    more (after the reduction), so that case is compared to one bf16 rounding."""
    rank, ws = world()
    g = dist.group.WORLD
    f8 = torch.float8_e4m3fn
    checked = 0
    for shape, dim in (((1024 * ws, 256), 0), ((2, 512 * ws, 256), 1)):
        a = ints(shape, 30 + rank, torch.float32, "cuda", low=-1, high=2).to(f8)
        w = ints((320, 256), 9, torch.float32, "cuda", low=-1, high=2).to(f8)
        bias = ints((320,), 8, BF16, "cuda")
        rows = shape[:-1] + (1,)
        for a_scale, b_scale in ((torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")),
                                 (2.0 ** ints(rows, 31 + rank, torch.float32, "cuda", low=-2, high=1),
                                  2.0 ** ints((1, 320), 32, torch.float32, "cuda", low=-2, high=1))):
            for with_bias in (False, True):
                kw = dict(bias=bias if with_bias else None)
                want = asynctp.scaled_matmul_reduce_scatter(a, w.t(), a_scale, b_scale, dim, g, strategy="serial", **kw)
                got = asynctp.scaled_matmul_reduce_scatter(a, w.t(), a_scale, b_scale, dim, g, strategy="fused", **kw)
                assert got.shape == want.shape, (got.shape, want.shape)
                if with_bias:
                    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)
                else:
                    assert torch.equal(got, want), (shape, a_scale.numel(), (got.double() - want.double()).abs().max())
                checked += 1
    return checked


def fused_scaled_all_gather_exact() -> int:
    """fp8 e4m3 all-gather -> scaled matmul on the single-launch GEMM: tensorwise (own rows read
    in place) and rowwise (rows and scales staged, scales pushed with the rows), powers-of-two
    scales, entries in {-1, 0, 1}: fp32 sums are exact, both paths round once, fused equals
    serial bit for bit; two weights, with and without the gathered rows; the GEMM must run."""
    rank, ws = world()
    g = dist.group.WORLD
    f8 = torch.float8_e4m3fn
    checked = 0
    with kernel_path_calls() as launched:
        for shape, dim in (((1024, 256), 0), ((2, 512, 256), 1)):
            a = ints(shape, 40 + rank, torch.float32, "cuda", low=-1, high=2).to(f8)
            ws_ = [ints((n, 256), 41 + n, torch.float32, "cuda", low=-1, high=2).to(f8) for n in (384, 256)]
            bs = [w.t() for w in ws_]
            rows = shape[:-1] + (1,)
            for a_scale, b_scales in ((torch.tensor(0.5, device="cuda"), [torch.tensor(2.0, device="cuda")] * 2),
                                      (2.0 ** ints(rows, 42 + rank, torch.float32, "cuda", low=-2, high=1),
                                       [2.0 ** ints((1, w.shape[0]), 43, torch.float32, "cuda", low=-2, high=1)
                                        for w in ws_])):
                for return_a in (True, False):
                    want_a, want = asynctp.all_gather_scaled_matmul(a, bs, a_scale, b_scales, dim, g,
                                                                    strategy="serial")
                    before = len(launched)
                    got_a, got = asynctp.all_gather_scaled_matmul(a, bs, a_scale, b_scales, dim, g,
                                                                  return_a=return_a, strategy="fused")
                    assert len(launched) == before + 1, "the single-launch GEMM did not serve the call"
                    assert got_a is None or torch.equal(got_a.view(torch.uint8), want_a.view(torch.uint8))
                    for o, w in zip(got, want):
                        assert torch.equal(o, w), (shape, a_scale.numel(), (o.double() - w.double()).abs().max())
                    checked += 1
    return checked


def fused_all_gather_gemm_stores_rows() -> int:
    """The Gluon GEMM (its tiles forced to whole 128x256 ones, unsplit) stores the gathered rows
    from the a tiles it loads: bf16 and fp8 rowwise, front order (4 blocks a rank) and
    batch-major, equal to serial bit for bit; every call launched it with the rows to store, so
    nothing was copied out of the workspace."""
    import sys

    from asynctp.kernels import _ag_gluon, configs
    from asynctp.runtime import kernel_path

    aim = sys.modules["asynctp.kernels.async_input_mm"]  # (the package's async_input_mm is the function)

    rank, ws = world()
    g = dist.group.WORLD
    f8 = torch.float8_e4m3fn
    real = _ag_gluon.launch
    stored: list[bool] = []

    def launch(*args, **kwargs):
        stored.append(kwargs.get("a_gathered") is not None)
        return real(*args, **kwargs)

    def whole(dtype, *args):
        return configs.Config(128, 256, 128 if dtype.itemsize == 1 else 64, stages=3, warps=8, split=False)

    saved = (aim.pick_config, kernel_path._config)
    _ag_gluon.launch, aim.pick_config, kernel_path._config = launch, whole, whole
    checked = 0
    try:
        for shape, dim in (((1024, 256), 0), ((2, 512, 256), 1)):
            a = ints(shape, 60 + rank, BF16, "cuda", low=-1, high=2)
            b = ints((384, 256), 61, BF16, "cuda").t()
            want_a, want = asynctp.all_gather_matmul(a, [b], dim, g, strategy="serial")
            got_a, got = asynctp.all_gather_matmul(a, [b], dim, g, strategy="fused")
            assert stored and stored[-1] and aim._gluon_failed is None, (shape, stored, aim._gluon_failed)
            assert torch.equal(got_a, want_a) and torch.equal(got[0], want[0]), (shape, "bf16")
            a8 = ints(shape, 62 + rank, torch.float32, "cuda", low=-1, high=2).to(f8)
            w8 = ints((384, 256), 63, torch.float32, "cuda", low=-1, high=2).to(f8)
            sa = 2.0 ** ints(shape[:-1] + (1,), 64 + rank, torch.float32, "cuda", low=-2, high=1)
            sb = 2.0 ** ints((1, 384), 65, torch.float32, "cuda", low=-2, high=1)
            want_a, want = asynctp.all_gather_scaled_matmul(a8, [w8.t()], sa, [sb], dim, g, strategy="serial")
            before = len(stored)
            got_a, got = asynctp.all_gather_scaled_matmul(a8, [w8.t()], sa, [sb], dim, g, strategy="fused")
            assert len(stored) == before + 1 and stored[-1], (shape, "fp8: the Gluon GEMM did not store the rows")
            assert torch.equal(got_a.view(torch.uint8), want_a.view(torch.uint8)), (shape, "fp8 gathered")
            assert torch.equal(got[0], want[0]), (shape, "fp8")
            checked += 2
    finally:
        _ag_gluon.launch = real
        aim.pick_config, kernel_path._config = saved
    return checked


def fused_graph_replays() -> dict:
    """The single-launch path captured into asynctp's own CUDA graphs (ASYNCTP_GRAPHS=1) and
    replayed, bf16 and fp8 rowwise, all-gather and reduce-scatter: inputs at fixed addresses,
    changed in place between calls, are read anew; every result equals serial bit for bit
    (small integers, powers-of-two scales); the kernel path served the captures.
    Returns the graph cache's counts."""
    from asynctp.runtime import graphs

    rank, ws = world()
    g = dist.group.WORLD
    a_ag = torch.empty((512, 256), dtype=BF16, device="cuda")
    b_ag = ints((256, 384), 3, BF16, "cuda")
    a_rs = torch.empty((512 * ws, 256), dtype=BF16, device="cuda")
    b_rs = ints((256, 320), 4, BF16, "cuda")
    # fp8 rowwise: powers-of-two scales, fp32 sums exact, one rounding on both paths
    f8 = torch.float8_e4m3fn
    a8_rs = torch.empty((512 * ws, 256), dtype=f8, device="cuda")
    s8_rs = torch.empty((512 * ws, 1), dtype=torch.float32, device="cuda")
    w8 = ints((320, 256), 5, torch.float32, "cuda", low=-1, high=2).to(f8)
    ws8 = 2.0 ** ints((1, 320), 6, torch.float32, "cuda", low=-2, high=1)
    a8_ag = torch.empty((512, 256), dtype=f8, device="cuda")
    s8_ag = torch.empty((512, 1), dtype=torch.float32, device="cuda")
    workspace = asynctp.get_workspace(g, "cuda")
    with kernel_path_calls() as served, asynctp.config.override(graphs="1"):
        before = graphs.stats(workspace)
        for i in range(6):
            a_ag.copy_(ints(a_ag.shape, 50 + 10 * i + rank, BF16, "cuda", low=-1, high=2))
            a_rs.copy_(ints(a_rs.shape, 51 + 10 * i + rank, BF16, "cuda", low=-1, high=2))
            a8_rs.copy_(ints(a8_rs.shape, 52 + 10 * i + rank, torch.float32, "cuda", low=-1, high=2).to(f8))
            s8_rs.copy_(2.0 ** ints(s8_rs.shape, 53 + 10 * i + rank, torch.float32, "cuda", low=-2, high=1))
            a8_ag.copy_(ints(a8_ag.shape, 54 + 10 * i + rank, torch.float32, "cuda", low=-1, high=2).to(f8))
            s8_ag.copy_(2.0 ** ints(s8_ag.shape, 55 + 10 * i + rank, torch.float32, "cuda", low=-2, high=1))
            got_a, (got,) = asynctp.all_gather_matmul(a_ag, [b_ag], 0, g, strategy="fused")
            want_a, (want,) = asynctp.all_gather_matmul(a_ag, [b_ag], 0, g, strategy="serial")
            assert torch.equal(got_a, want_a) and torch.equal(got, want), ("all-gather", i)
            got = asynctp.matmul_reduce_scatter(a_rs, b_rs, 0, g, strategy="fused")
            want = asynctp.matmul_reduce_scatter(a_rs, b_rs, 0, g, strategy="serial")
            assert torch.equal(got, want), ("reduce-scatter", i, (got.double() - want.double()).abs().max())
            got8 = asynctp.scaled_matmul_reduce_scatter(a8_rs, w8.t(), s8_rs, ws8, 0, g, strategy="fused")
            want8 = asynctp.scaled_matmul_reduce_scatter(a8_rs, w8.t(), s8_rs, ws8, 0, g, strategy="serial")
            assert torch.equal(got8, want8), ("fp8 reduce-scatter", i, (got8.double() - want8.double()).abs().max())
            _, (got8_ag,) = asynctp.all_gather_scaled_matmul(a8_ag, [w8.t()], s8_ag, [ws8], 0, g, return_a=False,
                                                          strategy="fused")
            _, (want8_ag,) = asynctp.all_gather_scaled_matmul(a8_ag, [w8.t()], s8_ag, [ws8], 0, g, return_a=False,
                                                           strategy="serial")
            assert torch.equal(got8_ag, want8_ag), ("fp8 all-gather", i)
            del got_a, got, got8, got8_ag  # the outputs let go: the next call may replay into them
        after = graphs.stats(workspace)
    counts = {k: after[k] - before[k] for k in ("eager", "captured", "replayed")}
    assert {"gather_matmul", "matmul_scatter"} <= set(served), served
    # per op (4): eager, capture, replays
    assert counts["captured"] >= 4 and counts["replayed"] >= 4 * 4, counts
    return counts


def fused_in_a_caller_graph() -> int:
    """The single-launch path captured in a CUDA graph of the caller's (torch.cuda.graph, not
    asynctp's cache), bf16 and fp8 rowwise, all-gather and reduce-scatter: the kernel path serves
    the capture (its waits are watched through beacons, symm/beacons.py), and replays with new
    inputs written in place equal serial bit for bit. Returns the replays checked."""
    rank, ws = world()
    g = dist.group.WORLD
    f8 = torch.float8_e4m3fn
    beacons = asynctp.get_workspace(g, "cuda").beacons
    assert beacons is not None
    a_ag = torch.empty((512, 256), dtype=BF16, device="cuda")
    b_ag = ints((256, 384), 3, BF16, "cuda")
    a_rs = torch.empty((512 * ws, 256), dtype=BF16, device="cuda")
    b_rs = ints((256, 320), 4, BF16, "cuda")
    a8 = torch.empty((512, 256), dtype=f8, device="cuda")
    s8 = torch.empty((512, 1), dtype=torch.float32, device="cuda")
    w8 = ints((320, 256), 5, torch.float32, "cuda", low=-1, high=2).to(f8)
    ws8 = 2.0 ** ints((1, 320), 6, torch.float32, "cuda", low=-2, high=1)

    def fill(i: int) -> None:
        a_ag.copy_(ints(a_ag.shape, 60 + 10 * i + rank, BF16, "cuda", low=-1, high=2))
        a_rs.copy_(ints(a_rs.shape, 61 + 10 * i + rank, BF16, "cuda", low=-1, high=2))
        a8.copy_(ints(a8.shape, 62 + 10 * i + rank, torch.float32, "cuda", low=-1, high=2).to(f8))
        s8.copy_(2.0 ** ints(s8.shape, 63 + 10 * i + rank, torch.float32, "cuda", low=-2, high=1))

    def step():
        got_a, (got,) = asynctp.all_gather_matmul(a_ag, [b_ag], 0, g, strategy="fused")
        rs = asynctp.matmul_reduce_scatter(a_rs, b_rs, 0, g, strategy="fused")
        _, (got8,) = asynctp.all_gather_scaled_matmul(a8, [w8.t()], s8, [ws8], 0, g, return_a=False, strategy="fused")
        return got_a, got, rs, got8

    fill(0)
    for _ in range(3):  # warm-up: tuning and compiles happen outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    first = beacons._next
    with kernel_path_calls() as served, torch.cuda.graph(graph, capture_error_mode="thread_local"):
        got_a, got, rs, got8 = step()
    assert served == ["gather_matmul", "matmul_scatter", "gather_matmul"], served
    # every wait of the capture took a beacon: the copy streams' barriers and waits, the kernels' spins
    sites = beacons.sites[first : beacons._next]
    assert len(sites) >= 6 and sum("single-launch GEMM" in s.what() for s in sites if callable(s.what)) == 3
    replay = graph.replay
    checked = 0
    for i in range(1, 4):
        fill(i)
        replay()
        want_a, (want,) = asynctp.all_gather_matmul(a_ag, [b_ag], 0, g, strategy="serial")
        assert torch.equal(got_a, want_a) and torch.equal(got, want), ("all-gather", i)
        want = asynctp.matmul_reduce_scatter(a_rs, b_rs, 0, g, strategy="serial")
        assert torch.equal(rs, want), ("reduce-scatter", i, (rs.double() - want.double()).abs().max())
        _, (want8,) = asynctp.all_gather_scaled_matmul(a8, [w8.t()], s8, [ws8], 0, g, return_a=False,
                                                       strategy="serial")
        assert torch.equal(got8, want8), ("fp8 all-gather", i)
        # after the replay every beacon of the capture is down again (each wait left)
        assert not beacons.words[first : beacons._next].any(), beacons.words[first : beacons._next]
        checked += 1
    torch.cuda.synchronize()
    return checked
