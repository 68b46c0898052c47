"""Rank-side bodies for repeat calls (asynctp/ops/repeat.py): a call equal to one that replayed from
the graph cache replays again without the op's checks and plan. Shared by tests/dist (the cpu
backend, with a stand-in capture that re-runs the call) and tests/gpu (CUDA graphs)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import asynctp
from asynctp.ops import tuning
from asynctp.runtime import graph_memory, graphs
from asynctp.runtime.keys import flatten
from tests.cases import ints, world

F8 = torch.float8_e4m3fn


def _fake_capture(cache, body):
    """A capture's stand-in on CPU: the 'graph' runs the call again into the outputs it made."""
    result = body()
    outs = flatten(result)[0]

    def replay():
        for out, new in zip(outs, flatten(body())[0]):
            out.copy_(new)

    return replay, result


def _graphs_on(device: str):
    """The graph cache on `device` (on CPU: usable, with the stand-in capture), every key captured at
    its second call."""
    stack = contextlib.ExitStack()
    stack.enter_context(asynctp.config.override(graphs="1"))
    if device == "cpu":
        stack.enter_context(mock.patch.object(graphs, "usable", lambda ws: ws is not None and graphs.enabled()))
        stack.enter_context(mock.patch.object(graphs, "cuda_capture", _fake_capture))
        stack.enter_context(mock.patch.object(graphs, "memory_of", lambda d: graph_memory.GraphMemory(reserved=lambda: 0)))
    return stack


def _calls(device: str) -> tuple[dict, callable]:
    """Each op's call on inputs at fixed addresses, and refresh(i), which writes call i's values."""
    rank, _ = world()
    g = dist.group.WORLD
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.empty((48, 32), dtype=dtype, device=device)
    b = ints((32, 32), 5, dtype, device)
    bias = ints((32,), 6, dtype, device)
    a8 = torch.empty((48, 32), dtype=F8, device=device)
    w8 = ints((32, 32), 7, torch.float32, device).to(F8)
    half = torch.full((), 0.5, device=device)

    def refresh(i: int) -> None:
        a.copy_(ints(a.shape, 100 * i + rank, dtype, device, low=-1, high=2))
        a8.copy_(ints(a8.shape, 100 * i + rank + 1, torch.float32, device, low=-1, high=2).to(F8))

    # dim: 0, or a value equal to it that the checks refuse (a float)
    calls = {
        "all_gather_matmul": lambda s, dim=0: asynctp.all_gather_matmul(a, [b], dim, g, biases=[bias], strategy=s),
        "matmul_reduce_scatter": lambda s, dim=0: asynctp.matmul_reduce_scatter(a, b, dim, g, bias=bias, strategy=s),
    }
    if device == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        # (a new view of w8 at every call: the same address, shape and strides)
        calls["all_gather_scaled_matmul"] = lambda s, dim=0: asynctp.all_gather_scaled_matmul(
            a8, [w8.t()], half, [half], dim, g, out_dtype=torch.bfloat16, strategy=s)
        calls["scaled_matmul_reduce_scatter"] = lambda s, dim=0: asynctp.scaled_matmul_reduce_scatter(
            a8, w8.t(), half, half, dim, g, out_dtype=torch.float32, strategy=s)
    return calls, refresh


def _same(got, want, where) -> None:
    got, want = flatten(got)[0], flatten(want)[0]
    assert len(got) == len(want), where
    for x, y in zip(got, want):
        assert torch.equal(x, y), (where, (x.double() - y.double()).abs().max())


def repeat_calls(device: str, strategy: str) -> dict:
    """Each op called 6 times on inputs changed in place, its results equal to serial's exactly;
    from the third call on, the calls replay directly, but where the caller holds the outputs of
    every graph of the key (then the full call captures another). Then what must not replay
    directly: a call under other settings, or another plan (forced_splits), or arguments the checks
    refuse (they raise, on every call), or after asynctp.reset (a new workspace). Returns the graph
    cache's count changes."""
    calls, refresh = _calls(device)
    workspace = asynctp.get_workspace(dist.group.WORLD, device)
    with _graphs_on(device):
        for call in calls.values():  # the workspace sized for every call (a growth drops the graphs)
            call(strategy)
        graphs.clear(workspace)
        before = graphs.stats(workspace)
        held = []
        for i in range(6):
            refresh(i)
            for name, call in calls.items():
                direct = graphs.stats(workspace)["replayed directly"]
                got = call(strategy)
                replayed_directly = graphs.stats(workspace)["replayed directly"] - direct
                want = call("serial")
                _same(got, want, (name, i))
                # call 4: call 3's outputs are held, so its only graph is not free
                assert replayed_directly == (i in (2, 3, 5)), (name, i, replayed_directly)
                if i == 3:
                    held.append((name, got, want))
                del got, want
        if device == "cuda":
            torch.cuda.synchronize()
        for name, got, want in held:
            _same(got, want, (name, "a held output was overwritten"))
        del held
        counts = {k: graphs.stats(workspace)[k] - before[k] for k in ("eager", "captured", "replayed", "replayed directly")}

        for name, call in calls.items():
            call(strategy)  # (the previous op's forced_splits below made every op's next call a full one)
            direct = graphs.stats(workspace)["replayed directly"]
            call(strategy)  # replays directly
            assert graphs.stats(workspace)["replayed directly"] == direct + 1, name
            with asynctp.config.override(timeout=asynctp.config.get_timeout() + 1):  # a new Config: the full call
                call(strategy)
                assert graphs.stats(workspace)["replayed directly"] == direct + 1, (name, "new settings")
                call(strategy)  # remembered under these settings
                assert graphs.stats(workspace)["replayed directly"] == direct + 2, name
            with tuning.forced_splits(2):  # another plan: the full call (another graph key)
                _same(call(strategy), call("serial"), (name, "forced splits"))
            assert graphs.stats(workspace)["replayed directly"] == direct + 2, (name, "forced splits")
            with pytest.raises(ValueError, match="strategy"):
                call("bogus")
            for _ in range(2):  # a refused argument raises at every call, the group still in step
                with pytest.raises(TypeError, match="dim"):
                    call(strategy, dim=0.0)
            call(strategy)
            call(strategy)
            assert graphs.stats(workspace)["replayed directly"] == direct + 3, (name, "after refused calls")

        asynctp.reset(dist.group.WORLD)  # the workspace closed, its graphs with it: full calls on a new one
        for round_ in range(2):  # (the new workspace may grow at an op's first call, dropping every graph)
            for name, call in calls.items():
                for i in range(3):
                    _same(call(strategy), call("serial"), (name, "after reset", round_, i))
        for name, call in calls.items():  # each call captured at the workspace's final size by now
            direct = graphs.stats()["replayed directly"]
            _same(call(strategy), call("serial"), (name, "after reset"))
            assert graphs.stats()["replayed directly"] == direct + 1, (name, "after reset")
    return counts
