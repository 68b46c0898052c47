"""symm.calls: which failures leave a group out of step."""

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
