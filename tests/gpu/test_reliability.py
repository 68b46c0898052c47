"""Reliability on the cuda backend: a 10,000-call soak with random ops, shapes, dims and dtypes
checked against the reference; NaN inputs with the check on; two groups; calls that differ
across ranks (the opening barrier's flags carry the call's signature, so no rank passes it);
a SIGKILLed rank.
Fault injection: a stuck wait (a stream wait aborted by asynctp's watchdog, or torch's signal
kernel, which traps) takes the process's CUDA context down, so the error that surfaces names
nothing; the test checks that asynctp's watchdog logged the op, rank and wait first and that the
process does not hang (each such test uses a pool of its own and throws it away)."""

import os

import pytest

from tests import cases, cases_reliability
from tests.gpu.conftest import NUM_GPUS
from tests.multiprocess import RankPool

DEVICE = "cuda"
SOAK_CALLS = int(os.environ.get("ASYNCTP_SOAK_CALLS", "10000"))


def test_soak_random_calls(pool):
    assert pool.run(cases.random_calls, DEVICE, SOAK_CALLS, 11)[0] == SOAK_CALLS


def test_nonfinite_inputs_raise_everywhere(pool):
    messages = pool.run(cases_reliability.nonfinite_inputs_raise_everywhere, DEVICE)
    assert all(m == messages[0] for m in messages)


def test_two_groups_and_growth(pool):
    pool.run(cases_reliability.two_groups_interleaved, DEVICE)


def test_ops_on_two_streams_are_serialized(pool):
    pool.run(cases_reliability.ops_on_two_streams)


@pytest.mark.parametrize("signals", ["streamops", "torch", "streamops-replay"])
@pytest.mark.parametrize("op", ["ag", "rs", "rs-avg"])
def test_stuck_device_wait_is_named_before_the_trap(op, signals, monkeypatch):
    # streamops: the GPU's front end waits and the watchdog aborts the context; torch: torch's
    # wait kernel traps on its own timeout; streamops-replay: the stuck call is a replay of
    # asynctp's CUDA graph, whose waits the watchdog knows only as "the replay's" (so is ag's
    # stuck call in the other two: the second call of its key, captured and replayed). rs-avg: the
    # reduction after the wait is the fp32 accumulation that 4 ranks use for a sum (its kernels'
    # first launch after a stuck wait hung 4xH200 before they were loaded up front)
    pool = RankPool(NUM_GPUS, backend="nccl", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(cases_reliability.peer_skips_op_cuda, op, signals.endswith("-replay"),
                                     signals.startswith("torch"))
    finally:
        pool.close()
    kind, message = outcomes[0]
    assert kind == "ok", outcomes[0]
    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    parts = [f"asynctp {name}", "rank 0 of group", "the GPU has waited over 3 s", "ASYNCTP_TIMEOUT",
             "synchronize raised"]
    if signals.endswith("-replay"):
        parts += ["CUDA-graph replay", "| replayed"]
    if signals == "torch":  # the line before the kernel's own trap (it is given a longer timeout)
        parts += ["| context alive"]
    for part in parts:
        assert part in message, (part, message)


@pytest.mark.parametrize("op", ["ag", "rs", "ag-fused"])
def test_stuck_wait_in_a_callers_graph_is_named_then_released(op):
    """The stuck call is a replay of a CUDA graph the test captured (the op, then the other op):
    its waits are watched through their beacons; the abort releases the stuck barrier with the
    signature it awaits (not the later op's), so the synchronize raises instead of hanging.
    ag-fused: the single-launch GEMM's kernel spins in the graph too."""
    pool = RankPool(NUM_GPUS, backend="nccl", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(cases_reliability.peer_skips_op_cuda, op, False, False, True)
    finally:
        pool.close()
    kind, message = outcomes[0]
    assert kind == "ok", outcomes[0]
    name = "all_gather_matmul" if op.startswith("ag") else "matmul_reduce_scatter"
    for part in (f"asynctp {name}", "rank 0 of group", "the GPU has waited over 3 s for barrier channel 0 with the "
                 "signature", "in a CUDA graph the caller captured, seen waiting for", "synchronize raised",
                 "| caller graph, beacons"):
        assert part in message, (part, message)


def test_a_queue_of_calls_behind_a_stuck_wait_ends_in_an_error(tmp_path):
    """Three calls, the first stuck and two queued behind it (different signatures on one barrier
    flag, the same signal channels): the watchdog names the first call, then either the
    synchronize after its abort raises or, where the abort cannot release the queue, the
    watchdog says so and ends the process. Never a hang."""
    pool = RankPool(NUM_GPUS, backend="nccl", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(cases_reliability.peer_skips_queued_calls_cuda, 3, str(tmp_path / "log"))
    finally:
        pool.close()
    kind, outcome = outcomes[0]
    first, *lines = (tmp_path / "log.0").read_text().splitlines()
    assert first.startswith("first call ") and lines, (first, lines)
    for part in ("asynctp all_gather_matmul: rank 0 of group", "the GPU has waited over 3 s for barrier channel 0 "
                 "with the signature", f"({first.removeprefix('first ')}: a_shard.shape (1, 8)"):
        assert part in lines[0], (part, lines)
    if kind == "died":
        assert outcome == "signal SIGABRT" and "ending the process" in lines[-1], (outcome, lines)
    else:
        assert kind == "ok" and "synchronize raised" in outcome, outcomes[0]


def test_mismatch_on_device_never_passes_the_opening_barrier():
    """Rank R-1 gathers 2 more rows: every rank's opening barrier waits for its own signature,
    which no peer wrote, so no data moves; the watchdog names the op, the rank and the
    signature (with the call's fields) before it aborts the context."""
    pool = RankPool(NUM_GPUS, backend="nccl", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(cases_reliability.mismatch_on_device, "ag")
    finally:
        pool.close()
    kind, message = outcomes[0]
    assert kind == "ok", outcomes[0]
    for part in ("asynctp all_gather_matmul", "rank 0 of group", "barrier channel 0 with the signature 0x",
                 "a_shard.shape", "from every rank of the group"):
        assert part in message, (part, message)


def test_killed_rank_is_named_by_the_watchdog():
    pool = RankPool(NUM_GPUS, backend="nccl", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(cases_reliability.killed_rank_cuda)
    finally:
        pool.close()
    assert outcomes[-1][0] == "died", outcomes[-1]
    kind, report = outcomes[0]
    assert kind == "ok", outcomes[0]
    assert "asynctp matmul_reduce_scatter" in report["logged"] and "rank 0 of group" in report["logged"], report
    assert f"rank {NUM_GPUS - 1}" in report["logged"], report
