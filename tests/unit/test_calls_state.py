"""symm.calls: which failures leave a group out of step, and which op a workspace names."""

from __future__ import annotations


def test_a_capture_that_needs_a_larger_workspace_leaves_the_group_in_step():
    """Every rank raises CaptureGrowthError at the same point, before any exchange: the group
    stays usable (a CUDA-graph capture sized too small is a user error, not a desync)."""
    from asynctp.config import override
    from asynctp.symm.calls import Calls
    from asynctp.symm.errors import CaptureGrowthError

    calls = Calls()
    calls._init_calls()
    calls.group_name, calls.op = "g", "all_gather_matmul"
    with override(check_calls=False):
        calls.begin_call("all_gather_matmul", (), ())
        calls.end_call(CaptureGrowthError("needs 64 MiB"))
        assert calls.broken is None
        calls.begin_call("all_gather_matmul", (), ())
        calls.end_call(RuntimeError("failed part-way"))
    assert calls.broken is not None and "out of step" in calls.broken


def test_a_workspace_made_during_a_call_names_that_calls_op(monkeypatch):
    """cuda: a group's first pipelined call is begun on its UnsharedCalls and makes the workspace;
    the workspace's waits and errors name that call's op. One made outside a call names none."""
    from types import SimpleNamespace

    from asynctp import symm

    pg = SimpleNamespace(group_name="g", rank=lambda: 0, size=lambda: 2)
    made = [SimpleNamespace(group=pg, op="workspace") for _ in range(2)]
    monkeypatch.setattr(symm, "_workspaces", {})
    monkeypatch.setattr(symm, "_unshared", {})
    monkeypatch.setattr(symm, "_create", lambda group, device_type: made.pop(0))
    calls = symm.calls_of(pg, "cuda")
    calls.begin_call("all_gather_matmul", (), ())
    ws = symm.lookup(pg, "cuda")
    calls.end_call()
    assert ws is not calls and ws.op == "all_gather_matmul"
    symm._workspaces.clear()
    assert symm.lookup(pg, "cuda").op == "workspace"
