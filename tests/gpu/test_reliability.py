"""Reliability on the cuda backend: a 10,000-call soak with random ops, shapes, dims and dtypes
checked against the reference; mismatched calls and NaN inputs with the checks on; two groups.
(Fault injection runs on the cpu backend only: a timeout inside a CUDA signal kernel traps and
takes the process's CUDA context down, which a test pool cannot recover from.)"""

import os

from tests import cases, cases_reliability

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
