"""The persistent GEMMs of asynctp.kernels alone, on one GPU, in one process: against torch.mm /
torch._scaled_mm, with flags set in advance, set late by stream writes after host-to-device
copies on another stream (the deadlock rule: nothing the GEMM waits for needs an SM), in any
order, from every pivot; the Gluon all-gather kernel against the reference and bit-equal to the
Triton one (the reduce-scatter producer's: test_producer.py)."""

from __future__ import annotations

import importlib
import time

import pytest
import torch

from asynctp.kernels import async_input_mm
from asynctp.kernels.async_input_mm import ChunkMap, launch
from asynctp.kernels.configs import Config
from tests.cases_float8 import sqnr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP8 = torch.float8_e4m3fn
WHOLE = Config(128, 256, 64, split=False)  # the Triton kernel's last wave unsplit: the Gluon kernel's sums
WHOLE8 = Config(128, 256, 128, split=False)  # fp8's
aim = importlib.import_module("asynctp.kernels.async_input_mm")  # the module (the package exports the function)


def _flags(n: int, value: int = 1) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("m,n,k,chunks", [(1024, 512, 256, 4), (1000, 300, 200, 2), (384, 1000, 136, 3),
                                          (4096, 3584, 1024, 2)])
@pytest.mark.parametrize("trans", [False, True])
def test_bf16_against_mm(m, n, k, chunks, trans):
    """Ragged M, N and K too (not multiples of the tile); b row-major and weight.t()."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if trans
         else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
    ref = (a.double() @ b.double())
    for pivot in range(chunks):
        out = async_input_mm(a, b, _flags(chunks), pivot)
        err = (out.double() - ref).norm() / ref.norm()
        assert err < 1e-2, (pivot, err)
        assert not out.isnan().any()


def test_bias_is_added_in_the_epilogue():
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    out = async_input_mm(a, b, _flags(2), 1, bias=bias)
    ref = torch.addmm(bias.double(), a.double(), b.double())
    assert (out.double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_fp8_against_scaled_mm(mode):
    m, n, k = 2048, 1536, 1024
    a = (torch.randn(m, k, device="cuda") * 2).to(FP8)
    w = (torch.randn(n, k, device="cuda") * 2).to(FP8)
    if mode == "tensorwise":
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    else:
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    ref = torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)
    out = async_input_mm(a, w.t(), _flags(4), 3, a_scale=sa, b_scale=sb, out_dtype=torch.bfloat16)
    assert sqnr(ref, out) >= 40


@pytest.mark.parametrize("cfg", [Config(128, 256, 64), Config(128, 128, 64, stages=4, warps=4),
                                 Config(128, 256, 64, flatten=False)])
def test_configs_agree(cfg):
    a = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    out = async_input_mm(a, b, _flags(2), 0, config=cfg)
    ref = a.double() @ b.double()
    assert (out.double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("m", [4096, 512])
def test_split_last_wave(m):
    """The last, partial wave's tiles split along K (split_parts) give the exact product on
    small-integer inputs, as the unsplit kernel does; on random inputs the same result call
    after call (the parts are added in part order, whichever finishes last)."""
    from asynctp.kernels import _ag_kernel

    n, k = 3584, 2048
    a = torch.randint(-3, 4, (m, k), device="cuda").to(torch.bfloat16)
    w = torch.randint(-3, 4, (n, k), device="cuda").to(torch.bfloat16)
    want = (a.double() @ w.double().t()).to(torch.bfloat16)
    def triton_mm(cfg: Config = Config(128, 256, 64)) -> torch.Tensor:  # by name: the Gluon kernel serves these
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        launch(a, w.t(), out, _flags(2), (2, 1, 0), m // 2, 1, ChunkMap(), config=cfg, gluon=False)
        return out

    for split in (True, False):
        assert torch.equal(triton_mm(Config(128, 256, 64, split=split)), want)
    a.normal_()
    first = triton_mm()
    for _ in range(3):
        assert torch.equal(triton_mm(), first)
    ref = a.double() @ w.double().t()
    assert (first.double() - ref).norm() / ref.norm() < 1e-2
    assert all(counters.count_nonzero() == 0 for _, counters in _ag_kernel._tail_state.values())


def test_repeated_launches_of_one_problem():
    """Later launches of a problem (one compile: the pivot is not specialized on): other pivots
    and other operands of the same shape give the right products."""
    a = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(640, 512, device="cuda", dtype=torch.bfloat16).t()
    first = async_input_mm(a, b, _flags(4), 0)
    for pivot in (1, 2, 3, 0):
        a2 = torch.randn_like(a)
        want = a2.double() @ b.double()
        got = async_input_mm(a2, b, _flags(4), pivot)
        assert (got.double() - want).norm() / want.norm() < 1e-2
    assert torch.equal(async_input_mm(a, b, _flags(4), 0), first)


@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("pivot", [0, 1, 2, 3])
def test_late_signals_out_of_order(pivot, programs, monkeypatch):
    """The GEMM is queued first; each chunk's rows arrive 5 ms later by a host-to-device copy on
    another stream, followed by a stream write of its flag, in a shuffled order. Exact: the
    product equals the kernel's own product on rows that were in place from the start. With 3
    programs each runs 8 tiles across chunks (the Gluon kernel's next tile finds its flag unset)."""
    from asynctp.symm import streamops

    if programs:
        monkeypatch.setattr(aim, "sm_count", lambda device: programs)
    ops = streamops.load()
    if ops is None:
        pytest.skip(f"no stream memory operations: {streamops.unavailable_reason()}")
    chunks, rows = 4, 256
    host = torch.randn(chunks * rows, 512, dtype=torch.bfloat16).pin_memory()
    b = torch.randn(512, 640, device="cuda", dtype=torch.bfloat16)
    a = torch.full((chunks * rows, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    flags = _flags(chunks, 0)
    expected = async_input_mm(host.cuda(), b, _flags(chunks), pivot)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    out = async_input_mm(a, b, flags, pivot)  # queued; waits on the GPU
    time.sleep(0.005)
    for c in torch.randperm(chunks).tolist():
        with torch.cuda.stream(producer):
            a[c * rows : (c + 1) * rows].copy_(host[c * rows : (c + 1) * rows], non_blocking=True)
            ops.write(producer.cuda_stream, flags.data_ptr() + 4 * c, 1)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("in_place", [False, True])
def test_chunk_map_and_flags_reset(in_place):
    """The fused all-gather's call: 2 sources x 2 blocks, the local source's flags never awaited
    (its rows are staged), flags and counters reset by the last tile of each chunk."""
    world, blocks, m, k, n = 2, 2, 512, 384, 640
    for local in range(world):
        ws = torch.randn(world * m, k, device="cuda", dtype=torch.bfloat16)
        mine = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        full = ws.clone()
        full[local * m : (local + 1) * m] = mine
        # staged: the own slot holds the own rows; in place: read from their own tensor
        ws[local * m : (local + 1) * m] = float("nan") if in_place else mine
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        flags = torch.zeros(world * blocks, dtype=torch.int32, device="cuda")
        flags.view(blocks, world)[:, 1 - local] = 1  # flag of (src, blk) at src + blk * world
        counters = torch.zeros(world * blocks, dtype=torch.int32, device="cuda")
        out = torch.empty(world * m, n, device="cuda", dtype=torch.bfloat16)
        launch(ws, b, out, flags, (world * blocks, 1, world), m // blocks, local * blocks,
               ChunkMap(blocks=blocks, local_src=local), counters=counters, a_local=mine if in_place else None)
        plain = async_input_mm(full, b, _flags(1), 0)
        assert torch.equal(out, plain)
        assert flags.count_nonzero() == 0 and counters.count_nonzero() == 0


# local source (-1: none, its rows staged), bias, batch-major out rows, fp8 scales (0: bf16, 1: tensorwise, 2: rowwise)
GATHER_MODES = {"waits": (-1, 0, 0, 0), "bias": (-1, 1, 0, 0), "batch-major": (-1, 0, 1, 0), "local": (1, 0, 0, 0),
                "local-bias-batch-major": (0, 1, 1, 0), "fp8 rowwise": (-1, 0, 0, 2), "fp8 tensorwise": (-1, 0, 0, 1),
                "fp8 tensorwise local-bias": (1, 1, 0, 1), "fp8 rowwise local-bias-batch-major": (0, 1, 1, 2)}
GATHER_CASES = [(m, b) for m, s in GATHER_MODES.items() for b in ("weight.t()", "[K, N]")[: 2 - bool(s[3])]]


def _gather_case(mode: str, b_layout: str, world: int = 2, blocks: int = 2, rows: int = 512, n: int = 1200,
                 k: int = 608) -> tuple:
    """(every row, the workspace, the local rows, b, bias, chunk map, fp8 scales: a's, the workspace's, the local
    rows', b's) of a fused all-gather's GEMM: ragged N and K, NaN where read from a_local (a_local_scale)."""
    local, with_bias, batch_major, scaled = GATHER_MODES[mode]
    dt, rw, lo, hi = FP8 if scaled else torch.bfloat16, scaled == 2, local * blocks * rows, (local + 1) * blocks * rows
    full = torch.randn(world * blocks * rows, k, device="cuda").to(dt)
    ws, mine = full.clone(), (full[lo:hi].clone() if local >= 0 else None)
    ws[lo:hi] = float("nan")  # (local -1: an empty slice)
    b = torch.randn(n, k, device="cuda").to(dt).t()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    cmap = ChunkMap(blocks=blocks, local_src=local, out_src=rows if batch_major else None,
                    out_blk=world * rows if batch_major else None)
    sa = torch.rand(full.shape[0] if rw else 1, 1, device="cuda") + 0.5
    sa_mine = sa[lo:hi].clone() if rw and local >= 0 else None  # the workspace's: NaN
    sa_ws = sa if sa_mine is None else sa.index_fill(0, torch.arange(lo, hi, device="cuda"), float("nan"))
    scales = (sa, sa_ws, sa_mine, torch.rand(1, n if rw else 1, device="cuda") + 0.5) if scaled else None
    return full, ws, mine, b if b_layout == "weight.t()" else b.contiguous(), bias, cmap, scales


def _gather(ws, b, mine, bias, cmap: ChunkMap, rows: int, pivot: int, gluon: bool, scales=None,
            gathered: torch.Tensor | None = None, config: Config | None = None) -> tuple:
    """(out, flags, counters) of one launch: every awaited flag set in advance, counters on;
    gathered: the rows to store, which the launch says it stored where it runs the Gluon kernel."""
    world = ws.shape[0] // (cmap.blocks * rows)
    flags = torch.ones(world * cmap.blocks, dtype=torch.int32, device="cuda")  # (src, blk) at src + blk * world
    if cmap.local_src >= 0:
        flags.view(cmap.blocks, world)[:, cmap.local_src] = 0  # never awaited
    counters = torch.zeros_like(flags)
    out = torch.full((ws.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    _, sa, sa_mine, sb = scales or (None,) * 4
    config = config or (WHOLE8 if scales else WHOLE)
    stored = launch(ws, b, out, flags, (flags.numel(), 1, world), rows, pivot, cmap, a_local=mine, counters=counters,
                    bias=bias, a_scale=sa, a_local_scale=sa_mine, b_scale=sb, config=config, gluon=gluon,
                    gathered=gathered)
    assert stored == (gluon and gathered is not None)
    assert not gluon or aim._gluon_failed is None, aim._gluon_failed  # (else the Triton kernel ran)
    assert aim._gluon_serves(ws, b, out, scales is not None, rows, config, aim.sm_count(ws.device))
    return out, flags, counters


@pytest.mark.parametrize("mode,b_layout", GATHER_CASES)
def test_gather_gluon_against_reference(mode, b_layout, monkeypatch):
    """The Gluon kernel on 7 programs (each ~12 tiles across chunks, the next tile's loads issued early), from
    pivot 3: each chunk's product (fp8: torch._scaled_mm's) lands in its output rows; flags and counters reset."""
    monkeypatch.setattr(aim, "sm_count", lambda device: 7)
    full, ws, mine, b, bias, cmap, scales = _gather_case(mode, b_layout, rows=(rows := 512))
    gathered = torch.full_like(full, float("nan"))
    out, flags, counters = _gather(ws, b, mine, bias, cmap, rows, 3, gluon=True, scales=scales, gathered=gathered)
    prod = (full.double() @ b.double() if scales is None
            else torch._scaled_mm(full, b, scales[0], scales[3], out_dtype=torch.bfloat16).double())
    want = torch.empty(out.shape, dtype=torch.float64, device="cuda")
    want_rows = torch.empty_like(full)  # the gathered rows, stored from the a tiles: exact, in out's row order
    for c in range(ws.shape[0] // rows):  # chunk c = (src, blk)
        src, blk = divmod(c, cmap.blocks)
        at = src * (cmap.out_src or cmap.blocks * rows) + blk * (cmap.out_blk or rows)
        want[at : at + rows] = prod[c * rows : (c + 1) * rows]
        want_rows[at : at + rows] = full[c * rows : (c + 1) * rows]
    if bias is not None:
        want += bias.double()
    assert (out.double() - want).norm() / want.norm() < 1e-2 and not out.isnan().any()
    assert flags.count_nonzero() == 0 and counters.count_nonzero() == 0
    assert torch.equal(gathered.view(torch.uint8), want_rows.view(torch.uint8))
    # storing the rows leaves the products as they are
    assert torch.equal(out, _gather(ws, b, mine, bias, cmap, rows, 3, gluon=True, scales=scales)[0])


@pytest.mark.parametrize("programs", [7, None])
@pytest.mark.parametrize("mode,b_layout", GATHER_CASES)
def test_gather_kernels_agree(mode, b_layout, programs, monkeypatch):
    """The Gluon and the Triton kernel (its last wave unsplit) add, scale (fp8) and add bias in the same order:
    bit-equal outputs, and the same flags and counters left behind, on few programs or all SMs."""
    if programs:
        monkeypatch.setattr(aim, "sm_count", lambda device: programs)
    _, ws, mine, b, bias, cmap, scales = _gather_case(mode, b_layout)
    got = [_gather(ws, b, mine, bias, cmap, 512, 1, gluon, scales) for gluon in (True, False)]
    assert all(torch.equal(x, y) for x, y in zip(*got))


@pytest.mark.parametrize("programs", [7, 100, 200])
@pytest.mark.parametrize("mode,b_layout", [("waits", "weight.t()"), ("waits", "[K, N]"),
                                           ("local-bias-batch-major", "weight.t()"),
                                           ("local-bias-batch-major", "[K, N]"),
                                           ("fp8 rowwise local-bias-batch-major", "weight.t()"),
                                           ("fp8 tensorwise", "weight.t()")])
def test_gather_gluon_deeper_ring_is_bit_equal(mode, b_layout, programs, monkeypatch):
    """A 4-stage ring with half an output tile staged (the halves stored in turn) gives the outputs of
    3 stages and a whole tile bit for bit, the gathered rows stored by both, flags and counters reset.
    80 tiles: on 7 programs 77 whole and the last 3 in column halves (6 programs), on 200 all 80 in
    halves, on 100 none (a short last wave only where its halves fit the grid)."""
    monkeypatch.setattr(aim, "sm_count", lambda device: programs)
    full, ws, mine, b, bias, cmap, scales = _gather_case(mode, b_layout)
    fp8 = scales is not None
    got = []
    for stages in (3, 4):
        gathered = torch.full_like(full, float("nan"))
        cfg = Config(128, 256, 128 if fp8 else 64, stages=stages, warps=8, split=False)
        got.append((*_gather(ws, b, mine, bias, cmap, 512, 1, True, scales, gathered, cfg), gathered))
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(*got))
    assert not got[1][0].isnan().any()
    # the Triton kernel takes the deeper ring's config with 3 stages (a whole tile staged)
    triton = _gather(ws, b, mine, bias, cmap, 512, 1, False, scales, None, cfg)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got[0][:3], triton))


def test_gather_falls_back_to_triton(monkeypatch):
    """A Gluon kernel that does not build (another Triton): one warning, and the Triton kernel's
    result from then on; the caller's operand errors raise, and are not taken for a failed build;
    gluon=True raises the build's error."""
    from asynctp import config
    from asynctp.kernels import _ag_gluon

    def broken(*args, **kwargs):
        raise RuntimeError("no such Gluon builtin")

    real = _ag_gluon.launch
    monkeypatch.setattr(_ag_gluon, "launch", broken)
    monkeypatch.setattr(aim, "_gluon_failed", None)
    monkeypatch.setattr(config, "_warned", set())
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="Gluon GEMM does not build"):
        out = async_input_mm(a, b, _flags(2), 1)
    assert aim._gluon_failed.startswith("RuntimeError")
    want = a.double() @ b.double()
    assert (out.double() - want).norm() / want.norm() < 1e-2
    monkeypatch.setattr(aim, "_gluon_failed", None)
    monkeypatch.setattr(_ag_gluon, "launch", real)
    mine = torch.randn(256, 320, device="cuda", dtype=torch.bfloat16)[:, :256]  # row stride 320, a's 256
    with pytest.raises(ValueError, match="a_local requires"):  # the caller's: no fallback
        launch(a, b, out, _flags(2), (2, 1, 0), 256, 0, ChunkMap(local_src=0), a_local=mine)
    assert aim._gluon_failed is None
    monkeypatch.setattr(_ag_gluon, "launch", broken)
    with pytest.raises(RuntimeError, match="no such Gluon builtin"):  # asked for by name: no fallback
        launch(a, b, out, _flags(2), (2, 1, 0), 256, 0, ChunkMap(), gluon=True)


def test_fast_launches_respecialize_on_alignment():
    """Launches after a key's first skip Triton's binding (triton_util.FastLaunch): an operand of
    the same shape at an address that is not 16-byte aligned gets its own compiled kernel, and
    every product stays right."""
    from asynctp.kernels import _ag_gluon, _ag_kernel

    a = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 640, device="cuda", dtype=torch.bfloat16)
    store = torch.randn(641, device="cuda", dtype=torch.bfloat16)
    compiled = lambda: len(_ag_kernel._ag_launch.kernels) + len(_ag_gluon._launch.kernels)  # noqa: E731
    before = compiled()
    for bias in (store[:640], store[1:], store[:640], store[1:]):
        want = a.double() @ b.double() + bias.double()
        got = async_input_mm(a, b, _flags(4), 0, bias=bias)
        assert (got.double() - want).norm() / want.norm() < 1e-2
    assert compiled() - before == 2


def test_batched_barriers_between_two_streams():
    """Two streams stand in for two ranks: each enqueues 50 barriers as the workspace batches
    them (set the other's flag, wait for its own, reset it: one cuStreamBatchMemOp; a flag pair
    per barrier, as the ops' channels keep a reused flag from being set before its reset); the
    second stream starts 5 ms late. Both pass every barrier and leave every flag reset (a batch
    keeps its order and waits on the GPU). No kernel between the barriers: here a kernel launched
    behind a stream wait that only the other stream releases blocked the host, single operations
    as well as batches (a lazy module load is one known cause: runtime/pipeline.py loads its
    reduction kernels before its waits)."""
    from asynctp.symm import streamops
    from asynctp.symm.streamops import WAIT, WRITE

    ops = streamops.load()
    if ops is None or ops._batch is None:
        pytest.skip("no batches of stream memory operations")
    flags = torch.zeros(100, dtype=torch.int32, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for r in (0, 1):
        for i in range(50):
            peer, own = flags.data_ptr() + 4 * (2 * i + 1 - r), flags.data_ptr() + 4 * (2 * i + r)
            ops.batch(streams[r].cuda_stream, ((WRITE, peer, 1), (WAIT, own, 1), (WRITE, own, 0)))
        time.sleep(0.005)
    torch.cuda.synchronize()
    assert not flags.any()
