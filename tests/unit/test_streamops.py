"""Stream memory operations (asynctp/symm/streamops.py) and the flag region in the signal pad
(asynctp/symm/cuda.py), on fakes: the GPU behaviour is covered by tests/gpu."""

import contextlib
import ctypes
import threading
from types import SimpleNamespace

import pytest
import torch

from asynctp.symm import streamops


def fake_lib(rc: int = 0):
    calls = []

    def entry(name):
        def fn(stream, address, value, flags):
            calls.append((name, stream, address, value, flags))
            return rc

        return fn

    lib = SimpleNamespace(cuStreamWriteValue32_v2=entry("write_v2"), cuStreamWaitValue32_v2=entry("wait_v2"),
                          cuStreamWriteValue32=entry("write_v1"), cuStreamWaitValue32=entry("wait_v1"))
    return lib, calls


def test_the_v2_entry_points_are_used_with_an_equality_wait_and_a_fenced_write():
    lib, calls = fake_lib()
    ops = streamops.StreamOps(lib)
    ops.write(7, 4096, 1)
    ops.wait(7, 4100, 1)
    assert calls == [("write_v2", 7, 4096, 1, 0), ("wait_v2", 7, 4100, 1, 1)]  # fenced write, EQ wait


def test_a_batch_enqueues_its_operations_in_order_in_one_driver_call():
    """batched(): this thread's operations on its stream go in one cuStreamBatchMemOp call, each
    as the single calls would make it (EQ waits, fenced writes); another stream's, and another
    thread's, go at once; the parameter array is made once per set of operations; a batch of
    one is the single call."""
    lib, calls = fake_lib()
    batches = []

    def batch(stream, count, array, flags):
        params = ctypes.cast(array, ctypes.POINTER(streamops._Param * count)).contents
        batches.append((stream, [(p.operation, p.address, p.value, p.flags) for p in params], flags, id(array)))
        return 0

    lib.cuStreamBatchMemOp_v2 = batch
    ops = streamops.StreamOps(lib)
    for _ in range(2):
        with ops.batched(7):
            ops.write(7, 4096, 5)
            ops.write(9, 64, 1)  # another stream: at once
            worker = threading.Thread(target=ops.write, args=(7, 128, 1))  # another thread: at once
            worker.start()
            worker.join()
            with ops.batched(7):  # joins the outer block
                ops.wait(7, 4100, 0xFFFFFFFF)
            ops.write(7, 4100, 0)
    want = [(streamops.WRITE, 4096, 5, 0), (streamops.WAIT, 4100, 0xFFFFFFFF, 1), (streamops.WRITE, 4100, 0, 0)]
    assert [(b[0], b[1], b[2]) for b in batches] == [(7, want, 0)] * 2 and batches[0][3] == batches[1][3]
    assert calls == [("write_v2", 9, 64, 1, 0), ("write_v2", 7, 128, 1, 0)] * 2
    with ops.batched(7):
        ops.wait(7, 256, 1)
    assert calls[-1] == ("wait_v2", 7, 256, 1, 1) and len(batches) == 2
    lib.cuStreamBatchMemOp_v2 = lambda *args: batches.append(args) or 1  # a driver that refuses batches
    ops = streamops.StreamOps(lib)
    with pytest.warns(RuntimeWarning, match="refused a batch"):
        ops.batch(7, ((streamops.WRITE, 8, 1), (streamops.WAIT, 12, 2)))
    ops.batch(7, ((streamops.WRITE, 8, 1), (streamops.WAIT, 12, 2)))
    assert len(batches) == 3 and calls[-4:] == [("write_v2", 7, 8, 1, 0), ("wait_v2", 7, 12, 2, 1)] * 2


class RecordingOps:
    """Records what would be enqueued; batches: the spans of calls made inside batched() blocks."""

    def __init__(self):
        self.calls, self.batches, self._open = [], [], False

    @contextlib.contextmanager
    def batched(self, stream):
        if self._open:
            yield
            return
        self._open, start = True, len(self.calls)
        try:
            yield
        finally:
            self._open = False
            self.batches.append((start, len(self.calls)))

    def write(self, stream, address, value):
        self.calls.append(("write", address, value))

    def wait(self, stream, address, value):
        self.calls.append(("wait", address, value))


def fake_workspace(monkeypatch, rank=0, world=3, own_capture=False, capturing=False, beacons=None):
    """A CudaWorkspace with its flags at pad addresses 1000 * (r + 1), offset 0, and stream ops
    that record what they would enqueue (no CUDA needed)."""
    cuda = pytest.importorskip("asynctp.symm.cuda")
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    ws = object.__new__(cuda.CudaWorkspace)
    ws.gate, ws._gate_passed = None, SimpleNamespace(record=lambda stream: None)
    ws.rank, ws.world_size, ws.op, ws.pending = rank, world, "test", None
    ws.device = SimpleNamespace(index=0)
    ws._ops, ws._flags, ws._awaited, ws.own_capture = RecordingOps(), ([1000, 2000, 3000], 0), {}, own_capture
    ws.signature, ws.seq, ws.call = 1, 0, ("test", (), ())
    ws.beacons, ws._site = beacons, None
    ws._handle = SimpleNamespace(barrier=lambda **kw: ws._ops.calls.append(("torch barrier", kw["channel"])))
    return ws, cuda


def test_a_barrier_sets_each_peers_flag_then_waits_for_and_resets_its_own(monkeypatch):
    ws, cuda = fake_workspace(monkeypatch, rank=1)
    ws.barrier(channel=1)
    flag = lambda src: 4 * ((0 * cuda.FLAG_CHANNELS + 1) * 3 + src)  # noqa: E731
    assert ws._ops.calls == [
        ("write", 1000 + flag(1), 1), ("write", 3000 + flag(1), 1),  # rank 1's flag in 0's and 2's pads
        ("wait", 2000 + flag(0), 1), ("write", 2000 + flag(0), 0),  # own pad: 0's flag, reset
        ("wait", 2000 + flag(2), 1), ("write", 2000 + flag(2), 0),
    ]
    assert ws._awaited == {2000 + flag(0): 1, 2000 + flag(2): 1} and ws.pending.what == "barrier channel 1"


def test_the_opening_barrier_carries_the_call_signature(monkeypatch):
    """Barrier 0's flags hold the call's signature and each rank waits for exactly its own: a
    peer that made another call never releases the wait, and the watchdog names the call."""
    ws, cuda = fake_workspace(monkeypatch, rank=0, world=2)
    from asynctp.symm.calls import signature_of

    ws.op, ws.call, ws.seq = "all_gather_matmul", ("all_gather_matmul", ("a_shard.shape",), ((4, 8),)), 5
    ws.signature = signature_of("all_gather_matmul", ((4, 8),))
    ws.barrier(channel=0)
    flag = lambda src: 4 * (0 * cuda.FLAG_CHANNELS * 2 + src)  # noqa: E731
    sig = ws.signature
    assert sig not in (0, 1) and signature_of("all_gather_matmul", ((5, 8),)) != sig
    assert ws._ops.calls == [("write", 2000 + flag(0), sig), ("wait", 1000 + flag(1), sig), ("write", 1000 + flag(1), 0)]
    assert ws._awaited == {1000 + flag(1): sig}  # what an abort releases the wait with
    assert f"signature 0x{sig:08x} of all_gather_matmul (call 5: a_shard.shape (4, 8))" in ws.pending.what
    assert ws.gate is ws.pending and ws.gate.passed is ws._gate_passed  # named while the GPU has not passed it


def test_signal_flags_view_for_the_single_launch_gemm(monkeypatch):
    import torch

    ws, cuda = fake_workspace(monkeypatch, rank=1, world=2)
    got = {}

    def get_signal_pad(rank, shape, dtype, offset):
        got.update(rank=rank, shape=shape, dtype=dtype, offset=offset)
        return torch.zeros(shape, dtype=torch.int32)

    ws._handle = SimpleNamespace(get_signal_pad=get_signal_pad)
    ws.signal_flags(2, 4)
    assert got == dict(rank=1, shape=(8,), dtype=torch.uint32, offset=ws._flag(1, 2, 0) // 4)
    assert cuda.SIGNAL_VALUE == 1
    with pytest.raises(ValueError, match="signal_flags requires channels within"):
        ws.signal_flags(15, 2)


def test_a_signal_is_a_set_and_its_wait_resets_it(monkeypatch):
    ws, cuda = fake_workspace(monkeypatch, rank=0)
    ws.put_signal(2, channel=3)
    ws.wait_signal(1, channel=3)
    flag = lambda src: 4 * ((1 * cuda.FLAG_CHANNELS + 3) * 3 + src)  # noqa: E731
    assert ws._ops.calls == [("write", 3000 + flag(0), 1), ("wait", 1000 + flag(1), 1), ("write", 1000 + flag(1), 0)]
    assert ws.pending.peer == 1


def test_torchs_signal_kernels_trap_after_the_watchdog_named_their_wait(monkeypatch):
    """Without stream memory operations, a wait is torch's kernel, which traps on its own timeout:
    it gets two of the watchdog's periods more than the watchdog allows the wait, so the line that
    names the wait comes before the trap takes the context down."""
    from asynctp.symm import watchdog

    ws, _ = fake_workspace(monkeypatch, rank=0)
    ws._ops, calls = None, []
    ws._handle = SimpleNamespace(**{name: (lambda name: lambda *a, **kw: calls.append((name, kw["timeout_ms"])))(name)
                                    for name in ("barrier", "put_signal", "wait_signal")})
    ws.barrier(channel=1, timeout=3)
    assert ws.pending.timeout == 3 and not ws.pending.abort  # the kernel's own trap aborts
    ws.wait_signal(1, channel=3, timeout=3)
    assert ws.pending.timeout == 3
    ws.put_signal(1, channel=3)
    trap_ms = int((3 + 2 * watchdog.PERIOD) * 1000)
    assert calls[:2] == [("barrier", trap_ms), ("wait_signal", trap_ms)] and calls[2][0] == "put_signal"
    assert calls[2][1] > ws._timeout(None) * 1000


@pytest.mark.parametrize("stream_ops", [True, False])
def test_every_replay_of_asynctps_graph_is_watched(monkeypatch, stream_ops):
    """A replay replaces the earlier call's wait (else a stuck replay went unnamed, or was named
    as that call's wait with its timeout); the watchdog aborts it only where its waits are stream
    memory operations (torch's signal kernels trap on their own)."""
    ws, _ = fake_workspace(monkeypatch, rank=0)
    if not stream_ops:
        ws._ops = None
        ws._handle = SimpleNamespace(wait_signal=lambda *a, **kw: None)
    ws.wait_signal(1, channel=3, timeout=120)
    earlier = ws.pending
    ws.watch_replay("all_gather_matmul")
    assert ws.pending is not earlier and ws.pending.op == "all_gather_matmul"
    assert ws.pending.what == "the barriers and signals of a CUDA-graph replay" and ws.pending.abort is stream_ops


def test_asynctps_own_capture_uses_the_stream_ops_and_a_callers_capture_torchs_kernels(monkeypatch):
    ws, _ = fake_workspace(monkeypatch, capturing=True, own_capture=True)
    ws.barrier(channel=0)
    assert [c[0] for c in ws._ops.calls] == ["write", "write", "wait", "write", "wait", "write"]
    assert ws.pending is None  # a captured wait runs at replay: graphs.py watches the replay
    ws, _ = fake_workspace(monkeypatch, capturing=True, own_capture=False)  # no beacons
    ws.barrier(channel=0)
    assert ws._ops.calls == [("torch barrier", 0)] and ws.pending is None and not ws.uses_stream_ops()


def test_a_callers_capture_brackets_each_stream_wait_with_its_beacon(monkeypatch):
    from asynctp.symm.beacons import Beacons

    ops = RecordingOps()
    b = Beacons(torch.zeros(8, dtype=torch.int32), ops.write)  # 4 waits: up words, then marks
    up = lambda slot: b.words.data_ptr() + 4 * slot  # noqa: E731
    mark = lambda slot: b.words.data_ptr() + 4 * (4 + slot)  # noqa: E731
    ws, cuda = fake_workspace(monkeypatch, rank=0, world=2, capturing=True, beacons=b)
    ws._ops = ops
    assert ws.uses_stream_ops()
    ws.barrier(channel=1)
    ws.wait_signal(1, channel=3)
    # the flag that rank `src` sets for (kind, channel) in rank `pad`'s signal pad
    flag = lambda pad, kind, channel, src: 1000 * (pad + 1) + 4 * ((kind * cuda.FLAG_CHANNELS + channel) * 2 + src)  # noqa: E731
    assert ops.calls == [
        ("write", mark(0), 0), ("write", up(0), 1), ("write", flag(1, 0, 1, 0), 1),
        ("wait", flag(0, 0, 1, 1), 1), ("write", flag(0, 0, 1, 1), 0), ("write", up(0), 0),
        ("write", mark(1), 0), ("write", up(1), 1),
        ("wait", flag(0, 1, 3, 1), 1), ("write", flag(0, 1, 3, 1), 0), ("write", up(1), 0),
    ]
    assert ops.batches == [(0, 6), (6, 11)]  # each wait with its beacon's writes: one batch (one graph node)
    assert ws.pending is None and [b.sites[i].what for i in (0, 1)] == ["barrier channel 1", "signal channel 3"]
    assert b.sites[1].peer == 1 and b.sites[0].op == "test" and b.sites[0].owner() is ws
    assert b.sites[0].awaited == [(flag(0, 0, 1, 1), 1)] and b.sites[1].awaited == [(flag(0, 1, 3, 1), 1)]


def test_a_counter_wait_is_watched_and_enqueued_as_one_batch(monkeypatch):
    """wait_value (the kernel path's waits on a GEMM's tile counters): in a caller's capture its
    beacon's writes, the wait and the reset are one batch, and the beacon names what it awaits."""
    from asynctp.symm.beacons import Beacons

    ops = RecordingOps()
    b = Beacons(torch.zeros(8, dtype=torch.int32), ops.write)
    up = lambda slot: b.words.data_ptr() + 4 * slot  # noqa: E731
    mark = lambda slot: b.words.data_ptr() + 4 * (4 + slot)  # noqa: E731
    ws, _ = fake_workspace(monkeypatch, rank=0, world=2, capturing=True, beacons=b)
    ws._ops = ops
    counter = torch.zeros(1, dtype=torch.int32)
    ws.wait_value("rank 1's block 0", counter, 12, reset=True)
    word = counter.data_ptr()
    assert ops.calls == [("write", mark(0), 0), ("write", up(0), 1), ("wait", word, 12), ("write", word, 0),
                         ("write", up(0), 0)]
    assert ops.batches == [(0, 5)] and b.sites[0].what == "rank 1's block 0" and b.sites[0].awaited == [(word, 12)]


def test_an_abort_releases_a_captured_wait_with_the_value_it_awaits(monkeypatch):
    """Two ops in one caller's graph: each opening barrier awaits its own call's signature on the
    same flags. A rank stuck at the first one is left with the first signature, not with the last
    one enqueued there, nor with an eager call's."""
    import contextlib

    from asynctp.symm.beacons import Beacons

    ops = RecordingOps()
    b = Beacons(torch.zeros(8, dtype=torch.int32), ops.write)
    ws, cuda = fake_workspace(monkeypatch, rank=0, world=2, capturing=True, beacons=b)
    ws._ops = ops
    for signature in (0x1111, 0x2222):
        ws.signature = signature
        ws.barrier(channel=0)
    flag = 1000 + 4 * 1  # rank 1's flag of barrier channel 0 in rank 0's pad
    assert ws._awaited == {} and [b.sites[i].awaited for i in (0, 1)] == [[(flag, 0x1111)], [(flag, 0x2222)]]
    ws._awaited = {flag: 0x3333}  # an eager call's opening barrier
    b.words[0] = 1  # a replay is stuck at the first barrier
    asserted = []
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch, "_assert_async", lambda t: asserted.append(True))
    ws._abort = (SimpleNamespace(cuda_stream=9), None)
    ops.calls.clear()
    ws.abort_device()
    # the stuck wait's value, every captured wait's, the eager waits', the stuck wait's again
    assert ops.calls == [("write", flag, v) for v in (0x1111, 0x1111, 0x2222, 0x3333, 0x1111)] and asserted == [True]
    b.words[0] = 0  # no captured wait up (an eager one is stuck): the eager value is left
    ops.calls.clear()
    ws.abort_device()
    assert ops.calls[-1] == ("write", flag, 0x3333)
    b.forget(ws)  # the workspace grew: its captured flags are stale, an abort leaves them alone
    ops.calls.clear()
    ws.abort_device()
    assert ops.calls == [("write", flag, 0x3333)]


def test_a_driver_error_raises_naming_the_call():
    lib, _ = fake_lib(rc=1)
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed with CUresult 1"):
        streamops.StreamOps(lib).wait(0, 0, 1)


def test_flags_take_the_end_of_the_pad_and_leave_torchs_channels_alone(monkeypatch):
    cuda = pytest.importorskip("asynctp.symm.cuda")
    from torch._C._distributed_c10d import _SymmetricMemory

    monkeypatch.setattr(cuda, "TORCH_SIGNALS", False)
    monkeypatch.setattr(_SymmetricMemory, "signal_pad_size", 2048, raising=False)
    handle = SimpleNamespace(signal_pad_ptrs=[1 << 20, 2 << 20])
    (pads, base), why = cuda._flag_region(handle, 2)
    assert why is None and pads == [1 << 20, 2 << 20]
    ours = 2 * cuda.FLAG_CHANNELS * 2 * 4
    assert base == 2048 - ours and base >= cuda.FLAG_CHANNELS * 2 * 4  # torch: channel * world + rank
    region, why = cuda._flag_region(handle, 16)  # 16 ranks do not fit 2 KiB: torch's kernels, and why
    assert region is None and "too small for 16 ranks" in why
    monkeypatch.setattr(cuda, "TORCH_SIGNALS", True)
    assert cuda._flag_region(handle, 2) == (None, "asynctp.symm.cuda.TORCH_SIGNALS is set")


@pytest.mark.parametrize("peers_have", [True, False])
def test_the_ranks_of_a_group_agree_on_beacons(monkeypatch, peers_have):
    """A rank without beacons would wait on torch's kernels in a caller's capture while its peers
    wait on the stream-operation flags: every rank has them or none does."""
    import warnings

    ws, cuda = fake_workspace(monkeypatch, rank=0, world=3)
    mine = object()
    monkeypatch.setattr(cuda.beacons, "for_device", lambda write, device: (mine, None))
    exchanged = []

    def exchange(group, op, value, tag=None):
        exchanged.append((value, tag))
        return [value, peers_have, True]

    monkeypatch.setattr(cuda, "exchange", exchange)
    monkeypatch.setattr(cuda, "warn_once", lambda key, message: warnings.warn(message, RuntimeWarning))
    ws.group = None
    if peers_have:
        ws._agree_beacons()
        assert ws.beacons is mine
    else:
        with pytest.warns(RuntimeWarning, match=r"torch's signal kernels .*\(ranks \[1\] of the group have none\)"):
            ws._agree_beacons()
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert ws.beacons is None and not ws.uses_stream_ops()  # a caller's capture: torch's kernels
    assert exchanged == [(True, "beacons")]


def test_the_ranks_of_a_group_agree_on_stream_operations(monkeypatch):
    """A rank on torch's kernels never sets the flags its peers' stream waits watch (and sets
    torch's, which they never read): every rank uses the stream operations or none does."""
    cuda = pytest.importorskip("asynctp.symm.cuda")
    ops = object()
    monkeypatch.setattr(streamops, "load", lambda: ops)
    assert cuda._agreed_ops(True, [True, True], None) == (ops, None)
    assert cuda._agreed_ops(True, [True, False, True], None) == (None, "ranks [1] of the group have no stream memory operations")
    assert cuda._agreed_ops(False, [False, True], "asynctp.symm.cuda.TORCH_SIGNALS is set") == (
        None, "asynctp.symm.cuda.TORCH_SIGNALS is set")
    monkeypatch.setattr(streamops, "load", lambda: None)
    monkeypatch.setattr(streamops, "unavailable_reason", lambda: "no driver")
    assert cuda._agreed_ops(True, [False, False], None) == (None, "no driver")


@pytest.mark.parametrize("peer_has", [True, False])
def test_a_workspace_agrees_on_stream_operations_when_it_grows(monkeypatch, peer_has):
    """The grow exchange carries whether each rank has the stream operations; a workspace uses
    them only where every rank does (the signal pads and the rendezvous are fakes here)."""
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    ws, cuda = fake_workspace(monkeypatch, rank=0, world=2)
    ops, exchanged = object(), []
    monkeypatch.setattr(streamops, "load", lambda: ops)
    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.empty(n, dtype=dtype))
    handle = SimpleNamespace(signal_pad_ptrs=[1 << 20, 2 << 20],
                             get_buffer=lambda r, shape, dtype, offset: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(cuda, "_rendezvous", lambda tensor, name: handle)

    def exchange(group, op, value, tag=None):
        exchanged.append((value, tag))
        return [value, (value[0], peer_has)]

    monkeypatch.setattr(cuda, "exchange", exchange)
    monkeypatch.setattr(cuda, "warn_once", lambda key, message: warnings.warn(message, RuntimeWarning))
    ws._handle, ws.group, ws.group_name = None, None, "g"
    if peer_has:
        ws._grow(4096)
        assert ws._ops is ops and ws._flags is not None
    else:
        with pytest.warns(RuntimeWarning, match=r"torch's signal kernels \(ranks \[1\] of the group have no stream"):
            ws._grow(4096)
        assert ws._ops is None and not ws.uses_stream_ops()
    assert exchanged == [((4096, True), "grow")] and ws.nbytes == 4096
