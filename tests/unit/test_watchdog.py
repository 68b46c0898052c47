"""The watchdog that names a stuck device-side wait (cuda backend) before the device traps."""

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asynctp.symm import watchdog


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def fake_ws(done: bool, pending):
    return SimpleNamespace(rank=1, group_name="tp", pending=pending, lanes=SimpleNamespace(_done=FakeEvent(done)))


def test_a_wait_older_than_its_timeout_is_named_once():
    p = watchdog.Pending("all_gather_matmul", "signal channel 2", 0, timeout=5.0)
    ws = fake_ws(False, p)
    assert watchdog.check(ws, now=p.issued + 4.0) is None  # not yet
    message = watchdog.check(ws, now=p.issued + 6.0)
    for part in ("all_gather_matmul", "rank 1", "'tp'", "signal channel 2", "from rank 0", "ASYNCTP_TIMEOUT"):
        assert part in message, (part, message)
    assert ws.pending is None and watchdog.check(ws, now=p.issued + 7.0) is None


def test_a_barrier_names_the_group():
    p = watchdog.Pending("matmul_reduce_scatter", "barrier channel 0", None, timeout=1.0)
    message = watchdog.check(fake_ws(False, p), now=p.issued + 2.0)
    assert "barrier channel 0 from every rank of the group" in message


def test_a_finished_op_clears_its_wait():
    p = watchdog.Pending("all_gather_matmul", "barrier channel 1", None, timeout=1.0)
    ws = fake_ws(True, p)
    assert watchdog.check(ws, now=p.issued + 5.0) is None
    assert ws.pending is None


def test_after_a_graph_capture_nothing_is_reported():
    # a captured op leaves no completion event (Lanes.join): its waits run at replay, unseen
    p = watchdog.Pending("all_gather_matmul", "barrier channel 0", None, timeout=1.0)
    ws = fake_ws(False, p)
    ws.lanes._done = None
    assert watchdog.check(ws, now=p.issued + 2.0) is None and ws.pending is None


def test_a_stuck_stream_wait_is_aborted_then_logged(capsys):
    # a stream memory wait has no timeout of its own: the watchdog enforces it. The abort is
    # enqueued before the line is out: a synchronize started on seeing the line must raise
    calls = []
    p = watchdog.Pending("matmul_reduce_scatter", "signal channel 3", 1, timeout=1.0, abort=True)
    ws = fake_ws(False, p)
    ws.abort_device = lambda: calls.append(capsys.readouterr().err)  # what was printed by then
    assert watchdog.report(ws, now=p.issued + 0.5) is None and calls == []
    message = watchdog.report(ws, now=p.issued + 2.0)
    assert calls == [""] and message in capsys.readouterr().err  # aborted first, named after


def test_the_line_is_out_even_when_the_abort_fails(monkeypatch, capsys):
    # the waits may still be stuck: the process ends, after a second line that says why
    ended = []
    monkeypatch.setattr(watchdog, "_end", lambda: ended.append(capsys.readouterr().err))
    p = watchdog.Pending("all_gather_matmul", "barrier channel 1", None, timeout=1.0, abort=True)
    ws = fake_ws(False, p)
    ws.abort_device = lambda: (_ for _ in ()).throw(RuntimeError("CUDA error"))
    watchdog.report(ws, now=p.issued + 2.0)
    assert len(ended) == 1 and "barrier channel 1" in ended[0], ended
    assert "the abort failed (RuntimeError: CUDA error); ending the process" in ended[0]


def test_an_abort_that_does_not_release_the_gpu_ends_the_process(monkeypatch, capsys):
    # a wait queued behind the stuck one awaiting another value, or a kernel's first load holding
    # the driver, leaves the abort (its synchronize) stuck: both lines are out, then the process ends
    ended, release = [], threading.Event()
    monkeypatch.setattr(watchdog, "GRACE", 0.2)
    monkeypatch.setattr(watchdog, "_end", lambda: ended.append(capsys.readouterr().err))
    p = watchdog.Pending("all_gather_matmul", "barrier channel 0", None, timeout=1.0, abort=True)
    ws = fake_ws(False, p)
    ws.abort_device = release.wait
    try:
        message = watchdog.report(ws, now=p.issued + 2.0)
    finally:
        release.set()
    assert len(ended) == 1 and message in ended[0], ended
    for part in ("asynctp all_gather_matmul: rank 1 of group 'tp': the abort has not released this process's GPU "
                 "within 0.2 s", "ending the process"):
        assert part in ended[0], (part, ended[0])


def test_an_abort_that_returns_leaves_the_process(monkeypatch):
    monkeypatch.setattr(watchdog, "_end", lambda: pytest.fail("the process must not end"))
    p = watchdog.Pending("all_gather_matmul", "barrier channel 0", None, timeout=1.0, abort=True)
    ws = fake_ws(False, p)
    ws.abort_device = lambda: time.sleep(0.05)
    assert "barrier channel 0" in watchdog.report(ws, now=p.issued + 2.0)


def test_a_stuck_kernel_wait_is_only_logged():
    # torch's wait kernel traps on its own timeout: nothing to abort
    p = watchdog.Pending("all_gather_matmul", "barrier channel 0", None, timeout=1.0)
    ws = fake_ws(False, p)
    ws.abort_device = lambda: (_ for _ in ()).throw(AssertionError("must not abort"))
    assert "barrier channel 0" in watchdog.report(ws, now=p.issued + 2.0)


def test_an_unpassed_opening_barrier_is_named_before_later_waits():
    # ranks that disagree never pass the opening barrier: the signal waits queued behind it are
    # not what is stuck
    gate = watchdog.Pending("all_gather_matmul", "barrier channel 0 with the signature 0x1234abcd", None,
                            timeout=1.0, abort=True)
    gate.passed = FakeEvent(False)
    later = watchdog.Pending("all_gather_matmul", "signal channel 2", 1, timeout=1.0, abort=True)
    ws = fake_ws(False, later)
    ws.gate = gate
    ws.abort_device = lambda: None
    message = watchdog.report(ws, now=gate.issued + 2.0)
    assert "barrier channel 0 with the signature 0x1234abcd from every rank" in message, message
    assert ws.pending is None and ws.gate is None


def test_a_passed_opening_barrier_leaves_the_last_wait_named():
    gate = watchdog.Pending("all_gather_matmul", "barrier channel 0", None, timeout=1.0)
    gate.passed = FakeEvent(True)
    later = watchdog.Pending("all_gather_matmul", "signal channel 2", 1, timeout=1.0)
    ws = fake_ws(False, later)
    ws.gate = gate
    assert "signal channel 2 from rank 1" in watchdog.check(ws, now=later.issued + 2.0)
    assert ws.gate is None


@pytest.mark.parametrize("done", [FakeEvent(True), None], ids=["previous-op-finished", "after-a-capture"])
def test_a_wait_of_an_op_still_being_queued_is_named(done):
    # the host blocked inside the op after the wait (4xH200: a launch after a wait for a peer
    # that never came): the completion event is still the previous op's and must not count
    p = watchdog.Pending("matmul_reduce_scatter", "signal channel 2", 3, timeout=1.0)
    ws = fake_ws(False, p)
    ws.lanes = SimpleNamespace(_done=done, started=5, joined=4)
    assert watchdog.check(ws, now=p.issued + 0.5) is None and ws.pending is p
    assert "signal channel 2 from rank 3" in watchdog.check(ws, now=p.issued + 2.0)


def test_lanes_count_ops_and_an_abandoned_op_settles():
    import torch

    from asynctp.symm.workspace import Lanes

    lanes = Lanes(torch.device("cpu"))
    lanes.fork()
    assert (lanes.started, lanes.joined) == (1, 0)
    lanes.join()
    assert (lanes.started, lanes.joined) == (1, 1)
    lanes.fork()
    lanes.abandon()
    assert lanes.started == lanes.joined == 2


def fake_beacons(waits: int = 8):
    """Beacons over a plain CPU tensor, whose "stream writes" land at once."""
    from asynctp.symm.beacons import Beacons

    t = torch.zeros(2 * waits, dtype=torch.int32)
    base = t.data_ptr()

    def write(stream, address, value):
        t[(address - base) // 4] = value

    return Beacons(t, write)


class Workspace(SimpleNamespace):
    """A fake workspace that beacons can refer to weakly."""


def beacon_ws(b):
    ws = Workspace(**vars(fake_ws(False, None)))
    ws.beacons, ws.aborts = b, []
    ws.abort_device = lambda: ws.aborts.append(b.release_pairs([ws]))  # (every captured wait's, those up)
    return ws


def test_a_captured_wait_up_in_one_pass_past_its_timeout_is_named_and_aborted(capsys):
    b = fake_beacons()
    ws = beacon_ws(b)
    b.leave(0, b.enter(0, ws, "all_gather_matmul", "barrier channel 1", None, 5.0))  # passed
    slot = b.enter(0, ws, "matmul_reduce_scatter", lambda: "signal channel 3", 1, 5.0)
    b.awaits(slot, 4096, 1)
    for t in (100.0, 102.0, 104.0):  # the first sample marks the pass, the others find the mark
        assert watchdog.report(ws, now=t) is None
    message = watchdog.report(ws, now=106.0)
    for part in ("asynctp matmul_reduce_scatter", "rank 1", "signal channel 3 from rank 1",
                 "in a CUDA graph the caller captured, seen waiting for 6 s", "over 5 s"):
        assert part in message, (part, message)
    # every captured wait released with what it awaits, the stuck one last
    assert ws.aborts == [([(4096, 1)], [(4096, 1)])] and message in capsys.readouterr().err
    assert watchdog.report(ws, now=120.0) is None  # named once


def test_each_pass_of_a_replayed_wait_is_timed_on_its_own():
    # replays back to back: the wait is up at every sample, but each pass clears the mark
    b = fake_beacons()
    ws = beacon_ws(b)
    slot = b.enter(0, ws, "all_gather_matmul", "barrier channel 0", None, 5.0)
    up, mark = b.words[slot:slot + 1], b.words[8 + slot:9 + slot]
    for t in range(100, 130):
        assert b.stuck(ws, now=float(t)) is None
        up[0], mark[0], up[0] = 0, 0, 1  # the GPU leaves the wait and reaches it again
    assert b.stuck(ws, now=130.0) is None and b.stuck(ws, now=135.5) is not None  # one pass: 130 to 135.5


def test_a_wait_seen_down_starts_over_and_other_workspaces_are_not_named():
    b = fake_beacons()
    ws, other = beacon_ws(b), beacon_ws(b)
    slot = b.enter(0, ws, "all_gather_matmul", "barrier channel 0", None, 5.0)
    b.enter(0, other, "all_gather_matmul", "barrier channel 0", None, 5.0)
    assert b.stuck(ws, now=100.0) is None
    b.words[slot] = 0  # passed; the next pass has not come yet
    assert b.stuck(ws, now=103.0) is None
    b.words[8 + slot], b.words[slot] = 0, 1
    assert b.stuck(ws, now=104.0) is None and b.stuck(ws, now=108.0) is None
    p = b.stuck(ws, now=109.5)
    assert p is not None and p.issued == 104.0 and p.abort and p.what == "barrier channel 0"
    assert b.stuck(other, now=100.0) is None and b.stuck(other, now=200.0) is not None  # its own clock


def test_beacons_reuse_the_oldest_words_when_full():
    b = fake_beacons(waits=2)
    ws = beacon_ws(b)
    with pytest.warns(RuntimeWarning, match="share beacons with the oldest"):
        assert [b.enter(0, ws, "op", f"wait {i}", None, 1.0) for i in range(3)] == [0, 1, 0]
    assert b.wrapped and b.sites[0].what == "wait 2"


def test_no_beacons_where_a_stream_write_cannot_reach_pinned_memory(monkeypatch):
    from asynctp.symm import beacons

    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: real_zeros(*a, **k))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: SimpleNamespace(cuda_stream=7, synchronize=lambda: None))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(beacons, "_pools", {})
    device = torch.device("cuda", 0)

    def failing(stream, address, value):
        raise RuntimeError("cuStreamWriteValue32 failed with CUresult 1")

    made, why = beacons.for_device(failing, device)
    assert made is None and why == "stream writes to pinned host memory failed (cuStreamWriteValue32 failed with CUresult 1)"
    made, why = beacons.for_device(lambda stream, address, value: None, device)  # the write never lands
    assert made is None and why == "a stream write to pinned host memory read back 0, not 1"

    def lands(stream, address, value):
        torch.from_numpy(np.ctypeslib.as_array((ctypes.c_int32 * 1).from_address(address)))[0] = value

    made, why = beacons.for_device(lands, device)
    assert made is not None and why is None and int(made.words[0]) == 0  # the probe's word set back
    assert beacons.for_device(failing, device)[0] is made  # one per device, kept
    monkeypatch.setattr(beacons, "_pools", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made, why = beacons.for_device(lands, device)
    assert made is None and "asynctp.reserve" in why, why
