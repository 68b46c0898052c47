"""The graph cache's bookkeeping (asynctp/runtime/graphs.py, lag.py) on CPU tensors, with a fake capture: the
"graph" re-runs the body and copies its result into the outputs made at capture, as a CUDA graph
writes into its own output memory. The CUDA capture itself is covered by tests/gpu."""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from asynctp import config
from asynctp.runtime import graph_memory, graphs, lag as lags
from asynctp.runtime.keys import flatten, strip, tensor_keys
from asynctp.symm import Workspace
from asynctp.symm.workspace import Lanes


DONORS = []  # (cache, the dropped graph each fake capture took a pool from, or None)


def fake_capture(cache, body):
    DONORS.append((cache, cache.donor()))
    result = body()
    outs, _ = flatten(result)

    def replay():
        for out, new in zip(outs, flatten(body())[0]):
            out.copy_(new)

    return replay, result


class FakeEvent:
    """A CUDA event's stand-in: done once the test says the GPU got there."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def record(self, stream=None):
        self.done = False


class FakeLag(lags.Lag):
    """Lag over a settable clock and fake events; gpu_done() finishes every mark so far."""

    def __init__(self):
        self.now = 0.0
        self.events: list[FakeEvent] = []
        # a new event for every mark (an old one is never recorded again: every event is "held")
        super().__init__(clock=lambda: self.now, held=lambda event: True, new=self._new_fake)

    def _new_fake(self):
        event = FakeEvent()
        self.events.append(event)
        return event

    def gpu_done(self):
        for e in self.events:
            e.done = True


class FakeWorkspace(SimpleNamespace):
    """What a cache reads of its workspace (a subclass: a cache holds its workspace weakly)."""


WORKSPACES = []  # the fake workspaces of this module's caches, kept alive


def make_cache(lag=None, capture=fake_capture, memory=None):
    WORKSPACES.append(FakeWorkspace(generation=0, lanes=SimpleNamespace(is_cuda=False), backend="cpu"))
    memory = memory or graph_memory.GraphMemory(reserved=lambda: 1 << 40)  # a budget no test reaches
    return graphs.GraphCache(WORKSPACES[-1], capture=capture, lag=lag or FakeLag(), memory=memory)


def op(cache, x, w):
    """A pipelined call's stand-in: (gathered, [x @ w]), keyed like the real ops."""
    key = ("op", graphs.tensor_key(x), graphs.tensor_key(w))
    return cache.call("op", key, lambda: (torch.cat([x, x]), [torch.cat([x, x]) @ w]))


def test_first_call_eager_second_captured_then_replayed_with_the_inputs_current_contents():
    cache, x, w = make_cache(), torch.ones(2, 3), torch.eye(3)
    for i in range(4):
        x.fill_(i)  # same address, new contents: a replay must read them
        gathered, (out,) = op(cache, x, w)
        assert torch.equal(out, torch.full((4, 3), float(i))) and torch.equal(gathered, torch.full((4, 3), float(i)))
        del gathered, out
    assert cache.counts == {"eager": 1, "captured": 1, "replayed": 2}


def test_outputs_the_caller_holds_are_never_overwritten():
    cache, x, w = make_cache(), torch.ones(2, 3), torch.eye(3)
    op(cache, x, w)  # eager
    held = []
    for i in range(graphs.MAX_PER_KEY + 2):
        x.fill_(i)
        held.append(op(cache, x, w)[1][0])
    for i, out in enumerate(held):  # each one still holds its own call's result
        assert torch.equal(out, torch.full((4, 3), float(i)))
    assert cache.counts["captured"] == graphs.MAX_PER_KEY and cache.counts["eager"] == 1 + 2
    assert cache.eager_reasons == {"new key": 1, "outputs held": 2, "shape off": 0, "gpu-bound": 0, "memory": 0}
    assert len({o.data_ptr() for o in held}) == len(held)


def test_a_released_output_is_reused_and_returned_tensors_are_not_views():
    cache, x, w = make_cache(), torch.ones(2, 3), torch.eye(3)
    op(cache, x, w)
    first = op(cache, x, w)[1][0]
    ptr = first.data_ptr()
    assert first._base is None
    del first
    x.fill_(7)
    again = op(cache, x, w)[1][0]
    assert again.data_ptr() == ptr and torch.equal(again, torch.full((4, 3), 7.0))
    assert cache.counts["replayed"] == 1 and cache.counts["captured"] == 1


def test_a_view_of_an_output_keeps_it_held():
    cache, x, w = make_cache(), torch.ones(2, 3), torch.eye(3)
    op(cache, x, w)
    view = op(cache, x, w)[1][0][1:]  # only a slice survives
    x.fill_(5)
    op(cache, x, w)
    assert torch.equal(view, torch.ones(3, 3)) and cache.counts["captured"] == 2


def test_a_grown_workspace_drops_its_graphs():
    cache, x, w = make_cache(), torch.ones(2, 3), torch.eye(3)
    op(cache, x, w), op(cache, x, w)
    cache.ws.generation += 1
    op(cache, x, w)
    assert cache.counts == {"eager": 2, "captured": 1, "replayed": 0}


def test_inputs_at_new_addresses_on_every_call_are_never_captured():
    cache, w = make_cache(), torch.eye(3)
    keep = []
    for _ in range(20):
        keep.append(torch.ones(2, 3))
        op(cache, keep[-1], w)
    assert cache.counts == {"eager": 20, "captured": 0, "replayed": 0}
    assert cache.eager_reasons == {"new key": 20, "outputs held": 0, "shape off": 0, "gpu-bound": 0, "memory": 0}


def test_a_shape_whose_graphs_are_dropped_unreplayed_stops_being_captured(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 4)
    cache, w = make_cache(), torch.eye(3)
    xs = [torch.ones(2, 3) for _ in range(4 + graphs.WASTED_PER_SHAPE + 3)]
    with pytest.warns(RuntimeWarning, match="were never replayed") as record:
        for _ in range(2):  # a cycle longer than the cache: every graph is dropped before its replay
            for x in xs:
                op(cache, x, w)
    assert len([r for r in record if "never replayed" in str(r.message)]) == 1
    captured = cache.counts["captured"]
    assert captured == 4 + graphs.WASTED_PER_SHAPE and cache.counts["replayed"] == 0
    for x in xs[:3]:
        for _ in range(2):
            op(cache, x, w)
    assert cache.counts["captured"] == captured and cache._count() == 0  # that shape runs eagerly now
    assert cache.eager_reasons["shape off"] >= 6 + 1  # the calls above, and the one that turned it off


def test_inputs_whose_addresses_recur_only_now_and_then_stop_being_captured():
    # as fp8 tensors quantized afresh at every call: an address comes back once, never again
    cache, w = make_cache(), torch.eye(5)  # a shape of its own: warnings are once per shape
    keep = []
    with pytest.warns(RuntimeWarning, match="were never replayed"):
        for _ in range(60):
            keep.append(torch.ones(2, 5))
            op(cache, keep[-1], w)
            op(cache, keep[-1], w)  # its second call: captured, and never called again
    captured = cache.counts["captured"]
    assert captured < 30 and cache.counts["replayed"] == 0
    x = torch.ones(2, 5)
    for _ in range(3):
        op(cache, x, w)
    assert cache.counts["captured"] == captured


def test_many_keys_of_one_shape_that_come_back_every_step_keep_replaying():
    cache, w = make_cache(), torch.eye(3)
    layers = [torch.ones(2, 3) for _ in range(3 * graphs.WASTED_PER_SHAPE)]  # a deep model's layers
    for _ in range(6):  # steps
        for x in layers:
            op(cache, x, w)
    n = len(layers)
    assert cache.counts == {"eager": n, "captured": n, "replayed": 4 * n}


def test_two_alternating_address_sets_keep_replaying():
    cache, w = make_cache(), torch.eye(3)
    sets = [[torch.ones(2, 3) for _ in range(12)] for _ in range(2)]  # step i uses set i % 2
    for step in range(8):
        for x in sets[step % 2]:
            op(cache, x, w)
    assert cache.counts == {"eager": 24, "captured": 24, "replayed": 48}


def test_a_failed_capture_warns_and_runs_eagerly():
    def broken(cache, body):
        raise RuntimeError("operation not permitted when stream is capturing")

    cache, x, w = make_cache(capture=broken), torch.ones(2, 3), torch.eye(3)
    op(cache, x, w)
    with pytest.warns(RuntimeWarning, match="capturing the pipelined call into a CUDA graph failed"):
        out = op(cache, x, w)[1][0]
    assert torch.equal(out, torch.ones(4, 3))
    op(cache, x, w)
    assert cache.counts == {"eager": 3, "captured": 0, "replayed": 0}


def test_the_number_of_graphs_is_bounded_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 8)
    cache, w = make_cache(), torch.eye(3)
    xs = [torch.ones(2, 3) for _ in range(12)]
    for _ in range(2):  # a loop over 12 keys: seen, then captured
        for x in xs:
            op(cache, x, w)
    assert cache._count() == 8 and cache.counts["captured"] == 12
    op(cache, xs[-1], w)  # still held: replayed
    op(cache, xs[0], w)  # dropped: seen again, eagerly
    assert cache.counts["replayed"] == 1 and cache.counts["eager"] == 13
    # captures 10-12 took the pools of the graphs dropped after captures 9-11; the last waits
    donors = [d for c, d in DONORS if c is cache]
    assert donors[:9] == [None] * 9 and None not in donors[9:] and len(cache._donors) == 1


def test_graphs_whose_key_stopped_coming_back_are_dropped_and_their_pools_reused():
    # a training loop whose activations move now and then (torchtitan eager): without the sweep
    # every moved activation's graph stays, and each capture reserves a pool of its own
    cache, w3, w4 = make_cache(), torch.eye(3), torch.eye(4)
    layers = [torch.ones(2, 3) for _ in range(4)]  # at the same addresses every step
    moving = [torch.ones(2, 4) for _ in range(16)]  # moves every 4 steps: seen, captured, replayed twice
    held = []
    with pytest.warns(RuntimeWarning, match="were never replayed"):
        for step in range(4 * len(moving)):
            for x in layers:
                op(cache, x, w3)
            op(cache, moving[step // 4], w4)
            held.append(cache._count())
    off = sum(1 for k in cache._entries if k[1][1] == moving[0].shape)
    assert off == 0 and (moving[0].shape, (4, 1), torch.float32) in {s[1] for s in cache._off}
    assert max(held) <= len(layers) + 3
    donors = [d for c, d in DONORS if c is cache]
    pools = donors.count(None)  # captures that took a new pool
    assert len(donors) >= len(layers) + graphs.WASTED_PER_SHAPE and pools <= len(layers) + 3
    assert cache.counts["replayed"] >= len(layers) * (4 * len(moving) - 2)  # the layers never stopped


def test_a_single_tensor_result_round_trips():
    cache, a = make_cache(), torch.arange(6.0).view(2, 3)
    key = ("rs", graphs.tensor_key(a))
    for _ in range(3):
        out = cache.call("rs", key, lambda: a.sum(0))
        assert isinstance(out, torch.Tensor) and torch.equal(out, torch.tensor([3.0, 5.0, 7.0]))
        del out


def test_keys_lose_only_the_addresses():
    x = torch.ones(2, 3)
    key = ("op", graphs.tensor_key(x), 0, (graphs.tensor_key(x), None), "sum")
    assert strip(key) == ("op", (torch.Size([2, 3]), (3, 1), torch.float32), 0,
                                  ((torch.Size([2, 3]), (3, 1), torch.float32), None), "sum")


class BareWorkspace(Workspace):
    """A workspace without buffers: its lifetime is all these tests use."""

    backend = "cpu"
    _grow = _raw = barrier = put_signal = wait_signal = None  # never reached


def bare_workspace():
    return BareWorkspace(SimpleNamespace(group_name="g", rank=lambda: 0, size=lambda: 2), torch.device("cpu"))


def test_a_workspaces_cache_goes_when_it_is_closed_or_collected():
    ws = bare_workspace()
    cache = graphs.cache_of(ws)
    assert graphs.cache_of(ws) is cache and cache.ws is ws
    ws.close()  # asynctp.reset: the captured graphs are released at once
    assert graphs.stats(ws)["graphs"] == 0 and graphs.cache_of(ws) is not cache
    collected = weakref.ref(graphs.cache_of(bare_workspace()))
    gc.collect()
    assert collected() is None


def test_disabled_by_the_setting(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config(graphs="0"))
    assert not graphs.usable(SimpleNamespace(backend="cuda"))
    assert not graphs.usable(None)


def test_auto_captures_only_where_the_gpu_kept_up_with_the_host(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config())  # the default: auto
    monkeypatch.setattr(graphs, "SMALL_CALL_BYTES", 0)  # these tensors count as large
    x, w = torch.ones(2, 3), torch.eye(3)
    lag = FakeLag()
    cache = make_cache(lag)
    # a deep queue: every mark stays unfinished while the host moves on twice LAG_SECONDS a call
    for _ in range(2 + graphs.DECIDE_SIGHTINGS + 3):
        lag.now += 2 * lags.LAG_SECONDS
        op(cache, x, w)
    assert cache.counts == {"eager": 2 + graphs.DECIDE_SIGHTINGS + 3, "captured": 0, "replayed": 0}
    assert cache.eager_reasons["gpu-bound"] == 1 + graphs.DECIDE_SIGHTINGS + 3 and cache._count() == 0
    lag.gpu_done()  # decided: the key stays eager although the GPU caught up now
    lag.now += lags.LAG_SECONDS
    op(cache, x, w)
    assert cache.counts["captured"] == 0
    # ... the GPU behind again before the decision is undone: the count starts over
    lag.now += 2 * lags.LAG_SECONDS
    op(cache, x, w)
    for _ in range(graphs.DECIDE_SIGHTINGS - 1):  # idle, but not DECIDE_SIGHTINGS in a row yet
        lag.gpu_done()
        lag.now += lags.LAG_SECONDS
        op(cache, x, w)
    assert cache.counts["captured"] == 0
    # ... idle at DECIDE_SIGHTINGS sightings in a row: the calls are host-bound now, captured
    lag.gpu_done()
    lag.now += lags.LAG_SECONDS
    op(cache, x, w)
    assert cache.counts["captured"] == 1 and cache._count() == 1
    lag.gpu_done()
    lag.now += lags.LAG_SECONDS
    op(cache, x, w)
    assert cache.counts["replayed"] == 1

    # the GPU keeps up (every mark is finished before the next call): captured at the
    # CAPTURE_SIGHTINGS-th call
    assert graphs.CAPTURE_SIGHTINGS == 3
    lag2 = FakeLag()
    cache2 = make_cache(lag2)
    for _ in range(5):
        lag2.now += lags.LAG_SECONDS
        lag2.gpu_done()
        op(cache2, x, w)
    assert cache2.counts == {"eager": 2, "captured": 1, "replayed": 2}

    # a loop that waits for the GPU every third call: each key is seen idle once per wait, never
    # CAPTURE_SIGHTINGS times in a row: no graph (it would only hold memory)
    lag3 = FakeLag()
    cache3 = make_cache(lag3)
    for i in range(12):
        lag3.now += 2 * lags.LAG_SECONDS
        if i % 3 == 0:
            lag3.gpu_done()
        op(cache3, x, w)
    assert cache3.counts == {"eager": 12, "captured": 0, "replayed": 0}
    assert cache3.eager_reasons == {"new key": 1, "outputs held": 0, "shape off": 0, "gpu-bound": 11, "memory": 0}
    # ... then the host waits at every call (host-bound): captured at the third idle sighting
    for _ in range(4):
        lag3.now += 2 * lags.LAG_SECONDS
        lag3.gpu_done()
        op(cache3, x, w)
    assert cache3.counts == {"eager": 14, "captured": 1, "replayed": 1}


def test_auto_captures_small_calls_regardless_of_the_queue(monkeypatch):
    """Inputs + first outputs under SMALL_CALL_BYTES: captured at the second call even while the
    GPU is behind (a run's first steps, a peer's GPU waiting at a signal, look that way); one
    byte over: left eager, then eager for good."""
    monkeypatch.setattr(config, "_current", config.Config())
    x, w = torch.ones(2, 3), torch.eye(3)
    nbytes = (x.numel() + w.numel() + 2 * 12) * 4  # x, w; gathered [4, 3] and out [4, 3]
    for limit, counts in ((nbytes + 1, {"eager": 1, "captured": 1, "replayed": 4}),
                          (nbytes, {"eager": 6, "captured": 0, "replayed": 0})):
        monkeypatch.setattr(graphs, "SMALL_CALL_BYTES", limit)
        lag = FakeLag()
        cache = make_cache(lag)
        for _ in range(6):
            lag.now += 2 * lags.LAG_SECONDS  # a deep queue: no mark ever finishes
            op(cache, x, w)
        assert cache.counts == counts, limit
    assert cache._behind[next(iter(cache._behind))] >= graphs.DECIDE_SIGHTINGS


def test_graphs_setting_one_captures_regardless_of_the_queue(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config(graphs="1"))
    lag, x, w = FakeLag(), torch.ones(2, 3), torch.eye(3)
    cache = make_cache(lag)
    for _ in range(4):
        lag.now += lags.LAG_SECONDS
        op(cache, x, w)
    assert cache.counts == {"eager": 1, "captured": 1, "replayed": 2} and lag.events == []


def test_lag_marks_are_rate_limited_and_read_from_the_newest_old_enough_mark():
    lag = FakeLag()
    lag.mark()
    lag.now += lags.MARK_SECONDS / 2
    lag.mark()  # too soon: no second event
    assert len(lag.events) == 1
    assert not lag.behind()  # the only mark is younger than LAG_SECONDS
    lag.now += lags.LAG_SECONDS
    assert lag.behind()  # queued over LAG_SECONDS ago, unfinished
    lag.mark()  # a newer mark, still young: the old one decides
    assert lag.behind() and len(lag.events) == 2
    lag.events[0].done = True
    assert not lag.behind()


def test_lag_keeps_marks_back_to_lag_seconds_at_the_busiest_marking_rate():
    """Marks at every MARK_SECONDS for twice LAG_SECONDS, none finished: the queue is deep, and
    the mark that tells so (queued LAG_SECONDS ago) must still be kept."""
    lag = FakeLag()
    for _ in range(int(2 * lags.LAG_SECONDS / lags.MARK_SECONDS)):
        lag.mark()
        lag.now += lags.MARK_SECONDS
    assert lag.behind()
    for event in lag.events[-int(lags.LAG_SECONDS / lags.MARK_SECONDS) + 2 :]:
        event.done = True  # only marks younger than LAG_SECONDS finished: still behind
    assert lag.behind()


class RecordedEvent(FakeEvent):
    """A fake event that counts its records (Lanes and Lag record on 'the stream')."""

    made: list = []  # every one made

    def __init__(self):
        super().__init__()
        self.records = 0
        RecordedEvent.made.append(self)

    def record(self, stream=None):
        super().record(stream)
        self.records += 1


def test_a_replay_records_its_lag_mark_in_its_completion_event(monkeypatch):
    """auto: where a lag mark is due, a replay's completion event (Lanes.replay's `done`) is the
    mark: one record for both; an old mark's event is recorded again for a new mark, but never
    while the lanes hold it as their last op's completion (the next op may wait for it)."""
    monkeypatch.setattr(config, "_current", config.Config())
    lanes = Lanes(torch.device("cpu"))  # the real bookkeeping; the stream and events faked
    lanes.is_cuda, lanes.current, lanes._own_done = True, lambda: "stream", RecordedEvent()
    WORKSPACES.append(FakeWorkspace(generation=0, lanes=lanes, backend="cpu", watch_replay=lambda op: None))
    now = [0.0]
    lag = lags.Lag(clock=lambda: now[0], held=lanes.holds, new=RecordedEvent)
    cache = graphs.GraphCache(WORKSPACES[-1], capture=fake_capture, lag=lag,
                              memory=graph_memory.GraphMemory(reserved=lambda: 1 << 40))
    x, w = torch.ones(2, 3), torch.eye(3)
    RecordedEvent.made = []
    replays = lags._MARKS + 10
    for _ in range(2 + replays):
        now[0] += 2 * lags.MARK_SECONDS  # a mark due at every call
        op(cache, x, w)
        if cache.counts["replayed"]:
            assert lag._marks[-1][1] is lanes._done  # the replay's completion is the newest mark
    assert cache.counts == {"eager": 1, "captured": 1, "replayed": replays}
    # the lanes' own event: the capture's completion only; the marks' events: the eager and the
    # capturing call's marks, then one record a replay, old ones recorded again (fewer made than replays)
    assert lanes._own_done.records == 1 and len(lag._marks) == lags._MARKS
    assert sum(e.records for e in RecordedEvent.made) == 2 + replays and len(RecordedEvent.made) < replays
    held = lanes._done  # the last replay's completion, a lent mark
    before = held.records
    for _ in range(lags._MARKS + 1):  # marks of calls that leave the lanes alone: the held mark ages out
        now[0] += 2 * lags.MARK_SECONDS
        lag.mark()
    assert lanes._done is held and held.records == before  # not recorded again while held
    assert all(e is not held for _, e in lag._marks)


def test_graphs_setting_is_checked():
    with pytest.raises(ValueError, match="ASYNCTP_GRAPHS requires auto, 0 or 1, got 'sometimes'"):
        config.Config.from_env({"ASYNCTP_GRAPHS": "sometimes"})


def test_new_keys_name_the_inputs_that_moved(monkeypatch):
    """A loop whose weights stay put and whose activations come at new addresses every step:
    the new keys are counted against the activation (tensor 0), not the weights (tensor 1), and
    stats() reports them per op and tensor."""
    monkeypatch.setattr(config, "_current", config.Config(graphs="1"))
    cache = make_cache()
    weights = [torch.eye(3) for _ in range(4)]  # four layers' weights: four addresses, all recurring
    held = []
    for step in range(3):
        for w in weights:
            x = torch.ones(2, 3) * step
            held.append(x)  # (kept alive: a freed tensor's address could come back)
            op(cache, x, w)
        if step == 0:  # the first key of the shape counts nothing; the other layers' weights are new once
            assert cache.moves.summary() == {"op tensor 1": 3, "op tensor 0": 3}
    assert cache.eager_reasons["new key"] == 12
    # later steps: every key new, each for its activation only
    assert cache.moves.summary() == {"op tensor 0": 11, "op tensor 1": 3}
    monkeypatch.setattr(graphs, "_caches", lambda ws: [cache])
    total = graphs.stats()
    assert total["moved: op tensor 0"] == 11 and total["moved: op tensor 1"] == 3


def test_moves_remember_a_bounded_number_of_addresses():
    from asynctp.runtime import moves

    m = moves.Moves()
    for address in range(moves.ADDRESSES + 1):
        m.note("op", ("s",), [address])
    m.note("op", ("s",), [0])  # forgotten (the oldest of ADDRESSES + 1): counted again
    m.note("op", ("s",), [moves.ADDRESSES])  # remembered
    assert m.counts[("op", 0)] == moves.ADDRESSES + 1
    x = torch.ones(1)  # the addresses the cache hands it: its key's tensors, in order
    assert [t[0] for t in tensor_keys(("op", graphs.tensor_key(x), 3, (None,)))] == [x.data_ptr()]


def test_a_second_graph_for_held_outputs_is_dropped_with_its_key():
    # the graph captured because the caller held the first one's outputs takes its key's period
    # (not the calls since the cache began: it would outlive its key by that many calls)
    cache, w = make_cache(), torch.eye(3)
    z = torch.ones(2, 3)
    for _ in range(100):  # the cache has seen many calls
        op(cache, z, w)
    x = torch.ones(2, 3)
    op(cache, x, w)
    held = [op(cache, x, w)[1][0], op(cache, x, w)[1][0]]  # captured, then another graph: outputs held
    key = ("op", graphs.tensor_key(x), graphs.tensor_key(w))
    assert len(cache._entries[key]) == 2
    for _ in range(12):  # the loop moves on: new keys, captured at their second call
        y = torch.ones(2, 3)
        held.append(y)
        op(cache, y, w)
        op(cache, y, w)
    assert key not in cache._entries


class Reserved:
    """The allocator's reserved bytes as a test sets them; a capture adds `per_capture` unless it
    took a dropped graph's pool."""

    def __init__(self, total, per_capture):
        self.total, self.per_capture, self.donors = total, per_capture, []

    def __call__(self):
        return self.total

    def capture(self, cache, body):
        self.donors.append(cache._donors[-1] if cache._donors else None)
        if not cache._donors:
            self.total += self.per_capture
        return fake_capture(cache, body)


def test_auto_keeps_large_graphs_within_the_memory_budget(monkeypatch):
    """A large key's graph duplicates its outputs (activations) in its own pool: under auto the
    graphs' reservations stay within GRAPH_MEMORY_SHARE of the rest; a dropped graph's pool is
    taken without reserving more."""
    monkeypatch.setattr(config, "_current", config.Config())  # auto
    monkeypatch.setattr(graphs, "SMALL_CALL_BYTES", 0)  # these tensors count as large
    out_bytes = 2 * 4 * 3 * 4  # gathered [4, 3] and out [4, 3], float32
    # 10_000 bytes reserved outside graphs: a budget of 400; the first graph reserves 350
    reserved = Reserved(10_000, 350)
    clock = iter(range(0, 10**6)).__next__  # the total is read afresh at every question
    memory = graph_memory.GraphMemory(reserved, clock=lambda: clock() * graph_memory.READ_SECONDS, floor=0)
    lag, w = FakeLag(), torch.eye(3)
    cache = make_cache(lag, capture=reserved.capture, memory=memory)

    def call(x):
        lag.now += lags.LAG_SECONDS
        lag.gpu_done()  # the GPU keeps up: only the budget keeps a key eager
        return op(cache, x, w)

    a, b = torch.ones(2, 3), torch.ones(2, 3)
    for _ in range(3):  # captured at its CAPTURE_SIGHTINGS-th idle sighting: 0 + 96 <= 400
        call(a)
    assert cache.counts["captured"] == 1 and memory.spent == 350
    for _ in range(4):  # 350 + 96 > 0.04 * 10_000: eager, asking again at each sighting
        call(b)
    assert cache.counts["captured"] == 1 and cache.eager_reasons["memory"] == 2
    assert 350 + out_bytes > graph_memory.GRAPH_MEMORY_SHARE * 10_000 >= out_bytes
    for _ in range(4):  # a stopped coming back: the sweep drops its graph; b takes its pool
        call(b)
    assert cache.counts["captured"] == 2 and reserved.donors[1] is not None and memory.spent == 350
    assert torch.equal(call(b)[1][0], torch.ones(4, 3)) and cache.counts["replayed"] >= 1
    assert "eager: memory" in graphs.stats(None)  # a reason stats() reports
    # a host-bound loop (the GPU caught up at every lag mark): graphs buy step time, the budget is lifted
    c = torch.ones(2, 3)
    assert lag.busy >= graphs.BUDGET_BUSY
    while lag.busy >= graphs.BUDGET_BUSY:
        call(b)
    for _ in range(3):
        call(c)
    assert cache.counts["captured"] == 3 and memory.spent == 700

    # ASYNCTP_GRAPHS=1 captures every recurring key: no budget
    monkeypatch.setattr(config, "_current", config.Config(graphs="1"))
    reserved = Reserved(10_000, 350)
    memory = graph_memory.GraphMemory(reserved)
    cache = make_cache(capture=reserved.capture, memory=memory)
    for x in (a, a, b, b):
        op(cache, x, w)
    assert cache.counts["captured"] == 2 and memory.spent == 700


def test_graph_memory_counts_growth_only_and_reads_the_total_at_most_every_read_seconds():
    now, totals = [0.0], [1000]
    memory = graph_memory.GraphMemory(lambda: totals[0], clock=lambda: now[0], floor=0)
    assert memory.allows(40) and not memory.allows(41)  # 0.04 * 1000
    totals[0] = 2000  # read again only after READ_SECONDS
    assert not memory.allows(41)
    now[0] += 2 * graph_memory.READ_SECONDS
    assert memory.allows(80)

    def grow():
        totals[0] += 100
        return "result"

    assert memory.capture(grow) == "result" and memory.spent == 100
    totals[0] -= 500  # memory given back while capturing (a cache emptied): no negative spending
    assert memory.capture(lambda: None) is None and memory.spent == 100
    assert memory.allows(int(0.04 * (1600 - 100)) - 100) and not memory.allows(int(0.04 * 1500) - 99)
    # a process that reserves little: the floor, not the share, bounds the graphs
    memory.floor = 300
    assert memory.allows(200) and not memory.allows(201)
    totals[0], now[0] = 10_100, now[0] + 2 * graph_memory.READ_SECONDS
    assert memory.allows(300) and not memory.allows(301)  # 0.04 * 10_000 - 100 spent


def test_lag_busy_is_the_recent_share_of_marks_at_which_the_gpu_was_behind():
    lag = FakeLag()
    assert lag.busy == 1.0  # no marks yet: taken for GPU-bound
    for _ in range(400):  # the GPU finishes everything before the next mark
        lag.now += 2 * lags.LAG_SECONDS
        lag.gpu_done()
        lag.mark()
    assert lag.busy < 0.01
    for i in range(400):  # behind at every other mark
        lag.now += 2 * lags.LAG_SECONDS
        if i % 2:
            lag.gpu_done()
        lag.mark()
    assert abs(lag.busy - 0.5) < 0.02


def test_ready_offers_a_graph_only_where_call_would_replay_it():
    """ready(key) (ops/repeat.py's direct replays) gives the graph call() would replay: none for an
    unknown key, while the caller holds its outputs, after the workspace's buffers were replaced
    (generation), or once the workspace was closed; replay_ready counts the replay as call() does."""
    cache, x, w = make_cache(), torch.ones(2, 3), torch.eye(3)
    key = ("op", graphs.tensor_key(x), graphs.tensor_key(w))
    assert cache.ready(key) is None
    op(cache, x, w)
    op(cache, x, w)  # captured
    entry = cache.ready(key)
    assert entry is not None and cache.ready(("op", None)) is None
    x.fill_(3)
    gathered, (out,) = cache.replay_ready("op", key, entry)
    assert torch.equal(out, torch.full((4, 3), 3.0)) and cache.replayed is key
    assert cache.counts == {"eager": 1, "captured": 1, "replayed": 1} and cache.direct == 1
    assert cache.ready(key) is None  # the caller holds the outputs
    del gathered, out
    assert cache.ready(key) is entry
    cache.ws.generation += 1  # the buffers replaced: the graph reads freed memory
    assert cache.ready(key) is None
    cache.ws.generation -= 1
    assert cache.ready(key) is entry
    cache.closed = True
    assert cache.ready(key) is None


def test_every_replay_on_a_gpu_workspace_is_watched_whatever_its_waits():
    """A replay tells the watchdog of the op it replays (CudaWorkspace.watch_replay), also where
    the graph's waits are torch's signal kernels: the watchdog must not keep an earlier call's
    wait for the replay's."""
    watched = []
    lanes = SimpleNamespace(is_cuda=True, replay=lambda replay, done=None: replay())
    WORKSPACES.append(FakeWorkspace(generation=0, lanes=lanes, backend="cuda", uses_stream_ops=lambda: False,
                                    watch_replay=watched.append))
    cache = graphs.GraphCache(WORKSPACES[-1], capture=fake_capture, lag=FakeLag(),
                              memory=graph_memory.GraphMemory(reserved=lambda: 1 << 40))
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    for _ in range(4):
        op(cache, x, w)
    assert cache.counts["replayed"] == 2 and watched == ["op"] * 3  # the capture's own replay, then two
