"""Reliability on the cuda backend: a 10,000-call soak with random ops, shapes, dims and dtypes
checked against the reference; mismatched calls and NaN inputs with the checks on; two groups.
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


def test_mismatched_metadata_raises_everywhere(pool):
    messages = pool.run(cases_reliability.mismatched_calls_raise_everywhere, DEVICE)
    assert all(m == messages[0] for m in messages)


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
    # asynctp's CUDA graph, whose waits the watchdog knows only as "the replay's". rs-avg: the
    # reduction after the wait is the fp32 accumulation that 4 ranks use for a sum (its kernels'
    # first launch after a stuck wait hung 4xH200 before they were loaded up front)
    monkeypatch.setenv("ASYNCTP_SIGNALS", signals.removesuffix("-replay"))
    pool = RankPool(NUM_GPUS, backend="nccl", call_timeout=60)
    try:
        outcomes = pool.run_outcomes(cases_reliability.peer_skips_op_cuda, op, signals.endswith("-replay"))
    finally:
        pool.close()
    kind, message = outcomes[0]
    assert kind == "ok", outcomes[0]
    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    parts = [f"asynctp {name}", "rank 0 of group", "the GPU has waited over 3 s", "ASYNCTP_TIMEOUT",
             "synchronize raised"]
    if signals.endswith("-replay"):
        parts += ["CUDA-graph replay", "| replayed"]
    for part in parts:
        assert part in message, (part, message)
