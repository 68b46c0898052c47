"""Rank-side bodies of the reliability tests: faults, mismatched calls, non-finite inputs,
several groups, growth. Faults leave the group out of step, so the tests that inject them use
a pool of their own and throw it away."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import asynctp
from tests.cases import ints, world


def _timed_error(call) -> tuple[str, float]:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever surfaced
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _fault_setup(device: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """One call first, so the workspace exists before a fault, then a 3 s timeout: (rank, world, a, b).
    The call runs under the default timeout: fresh processes reach the workspace's creation
    seconds apart (one rank's CUDA context may come up later)."""
    rank, ws = world()
    asynctp.reset(dist.group.WORLD)
    a = ints((4 * ws, 8), rank, torch.float32, device)
    b = ints((8, 6), 1, torch.float32, device)
    asynctp.all_gather_matmul(a, [b], 0, dist.group.WORLD, strategy="pipeline")
    asynctp.set_timeout(3)
    return rank, ws, a, b


def mismatched_calls_raise_everywhere(device: str) -> list[str]:
    """Calls whose shapes differ across ranks: the same ValueError on every rank, naming the
    field and the ranks (cpu: before any data moves; cuda: the op never passes its opening
    barrier, so this is for the cpu backend), and the group works again after asynctp.reset."""
    rank, ws = world()
    a = ints((4 + (rank == 1), 8), rank, torch.float32, device)  # rank 1 has one row more
    b = ints((8, 6), 1, torch.float32, device)
    message, _ = _timed_error(lambda: asynctp.all_gather_matmul(a, [b], 0, dist.group.WORLD, strategy="pipeline"))
    assert message.startswith("CallMismatchError") and "a_shard.shape" in message and "rank 1" in message, message
    asynctp.reset(dist.group.WORLD)
    ok = ints((4, 8), rank, torch.float32, device)
    a_g, _ = asynctp.all_gather_matmul(ok, [b], 0, dist.group.WORLD)
    assert torch.equal(a_g, torch.cat([ints((4, 8), r, torch.float32, device) for r in range(ws)]))
    return [message]


def nonfinite_inputs_raise_everywhere(device: str) -> str:
    rank, ws = world()
    with asynctp.config.override(check_finite=True):
        a = ints((4 * ws, 8), rank, torch.float32, device)
        if rank == 1:
            a[2, 3] = float("nan")
        b = ints((8, 6), 1, torch.float32, device)
        message, _ = _timed_error(lambda: asynctp.matmul_reduce_scatter(a, b, 0, dist.group.WORLD))
    assert message.startswith("ValueError") and "rank 1" in message and "matmul_reduce_scatter" in message, message
    asynctp.reset(dist.group.WORLD)  # the check raised inside the call
    return message


def _watchdog_log(context: bool = False) -> list[str]:
    """The lines asynctp's logger emits from now on (the watchdog's among them). context: each
    line ends with whether the CUDA context was still alive when it was emitted ("| context
    alive": the current stream's query did not raise)."""
    import logging

    logged: list[str] = []
    stream = torch.cuda.current_stream() if context else None

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            state = ""
            if stream is not None:
                try:
                    stream.query()
                    state = " | context alive"
                except Exception:  # noqa: BLE001  (the CUDA error's type varies by release)
                    state = " | context lost"
            logged.append(record.getMessage() + state)

    logging.getLogger("asynctp").addHandler(Keep())
    return logged


def _first_line(logged: list[str], seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not logged and time.monotonic() < deadline:
        time.sleep(0.1)
    return logged[0] if logged else "nothing logged"


def mismatch_on_device(op: str) -> str:
    """cuda: the last rank makes a different call (more rows). The opening barrier's flags carry
    the call's signature, so no rank passes it: the watchdog names the op, the rank and the
    signature before the context is aborted. Returns the log line (the pool is thrown away)."""

    rank, ws, a, b = _fault_setup("cuda")
    torch.cuda.synchronize()
    logged = _watchdog_log()
    rows = a.shape[0] + 2 * (rank == ws - 1)
    a = ints((rows, a.shape[1]), rank, a.dtype, "cuda")
    asynctp.all_gather_matmul(a, [b], 0, dist.group.WORLD, strategy="pipeline")
    return _first_line(logged, 3 + 8)


def two_groups_interleaved(device: str) -> None:
    """Two process groups over the same ranks, each with its own workspace, used alternately;
    and shapes that grow the workspaces between calls."""
    rank, ws = world()
    other = dist.new_group(list(range(ws)))
    for i, rows in enumerate((2, 8, 4, 64, 16, 256)):
        for group in (dist.group.WORLD, other):
            shards = [ints((rows, 8), 100 * i + r, torch.float32, device) for r in range(ws)]
            b = ints((8, 6), i, torch.float32, device)
            a_g, (o,) = asynctp.all_gather_matmul(shards[rank], [b], 0, group, strategy="pipeline")
            full = torch.cat(shards)
            assert torch.equal(a_g, full) and torch.equal(o, full @ b)
            r = asynctp.matmul_reduce_scatter(full, b, 0, group, strategy="pipeline")
            assert torch.equal(r, ((full @ b) * ws).chunk(ws)[rank])
    assert asynctp.get_workspace(other, device) is not asynctp.get_workspace(dist.group.WORLD, device)
    dist.destroy_process_group(other)


def peer_never_joins_the_workspace(device: str) -> tuple[str, float]:
    """The first call on a group is a collective rendezvous: a rank that never comes must be
    named in a timeout, not hang the others for the process group's 30 minutes."""
    rank, ws = world()
    asynctp.set_timeout(3)
    group = dist.new_group(list(range(ws)))
    a = ints((4 * ws, 8), rank, torch.float32, device)
    b = ints((8, 6), 1, torch.float32, device)
    if rank == ws - 1:
        return "skipped", 0.0
    return _timed_error(lambda: asynctp.all_gather_matmul(a, [b], 0, group, strategy="pipeline"))


def ops_on_two_streams() -> None:
    """Ops queued on two streams with no sync between them are serialized on the workspace:
    results equal the reference (cuda only: on cpu there are no streams)."""
    rank, ws = world()
    g = dist.group.WORLD
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    b = ints((64, 48), 1, torch.bfloat16, "cuda", low=-1, high=2)
    shards = [[ints((32, 64), 10 * i + r, torch.bfloat16, "cuda", low=-1, high=2) for r in range(ws)] for i in range(6)]
    outs = []
    for i in range(6):
        streams[i % 2].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(streams[i % 2]):
            a_g, (o,) = asynctp.all_gather_matmul(shards[i][rank], [b], 0, g, strategy="pipeline")
            r = asynctp.matmul_reduce_scatter(a_g, b, 0, g, strategy="pipeline")
            outs.append((a_g, o, r))
    torch.cuda.synchronize()
    for i, (a_g, o, r) in enumerate(outs):
        full = torch.cat(shards[i])
        assert torch.equal(a_g, full)
        assert torch.equal(o, (full.double() @ b.double()).bfloat16())
        ref = ((full.double() @ b.double()) * ws).chunk(ws)[rank].bfloat16()
        assert torch.equal(r, ref)


def peer_skips_op_cuda(op: str, replay: bool = False, torch_signals: bool = False, caller: bool = False) -> str:
    """cuda backend: the last rank skips the op; the others' device-side wait times out and
    is aborted. Before it is, asynctp's watchdog must log a line naming the op, the rank and the
    wait; after it, a synchronize must raise, not hang. Returns what the watchdog logged and how
    the synchronize ended (the context is lost: the test throws this pool away).
    replay: the op is called three times on every rank first, so the stuck call is replayed
    from asynctp's CUDA graph (runtime/graphs.py). caller: every rank captures the op and then
    the other op (reduce-scatter after an all-gather, all-gather after a reduce-scatter: their
    opening barriers await different signatures on the same flags) in a CUDA graph of its own
    and replays it once; the stuck call is a replay of that graph, stuck at the first op (its
    waits are watched through their beacons, symm/beacons.py). op "ag-fused": the all-gather on
    the single-launch GEMM (bf16, rows it serves), whose kernel spins on the rows' flags."""
    import faulthandler

    from asynctp.bench.timing import capture_graph
    from asynctp.runtime import graphs
    from asynctp.symm import cuda as symm_cuda

    symm_cuda.TORCH_SIGNALS = torch_signals  # before the workspace exists
    rank, ws, a, b = _fault_setup("cuda")

    a16, b16 = ints((512, 256), rank, torch.bfloat16, "cuda", low=-1, high=2), ints((256, 384), 1, torch.bfloat16, "cuda")

    def call() -> None:
        if op == "ag":
            asynctp.all_gather_matmul(a, [b], 0, dist.group.WORLD, strategy="pipeline")
        elif op == "ag-fused":
            asynctp.all_gather_matmul(a16, [b16], 0, dist.group.WORLD, strategy="fused")
        else:
            asynctp.matmul_reduce_scatter(a, b, 0, dist.group.WORLD, reduce_op="avg" if op == "rs-avg" else "sum",
                                          strategy="pipeline")

    def then_the_other() -> None:
        call()
        if op.startswith("ag"):
            asynctp.matmul_reduce_scatter(a, b, 0, dist.group.WORLD, strategy="pipeline")
        else:
            asynctp.all_gather_matmul(a, [b], 0, dist.group.WORLD, strategy="pipeline")

    for _ in range(3 if replay else 0):
        call()
    beacons = asynctp.get_workspace(dist.group.WORLD, "cuda").beacons
    waits = beacons._next if beacons is not None else 0
    if caller:
        graph_replay, _ = capture_graph(then_the_other, torch.device("cuda"))
        graph_replay()
        call = graph_replay
    torch.cuda.synchronize()
    if rank == ws - 1:
        return "skipped"
    workspace = asynctp.get_workspace(dist.group.WORLD, "cuda")
    logged = _watchdog_log(context=torch_signals)  # torch's kernels: named while the context lives
    replays = graphs.stats(workspace)["replayed"]
    # a rank still here after 40 s (the pool gives up at 60) prints where every thread is
    faulthandler.dump_traceback_later(40)
    call()
    if caller:  # the capture's waits took beacons, or it fell back to torch's kernels
        how = "caller graph, beacons" if beacons is not None and beacons._next > waits else "caller graph, none"
    else:
        how = "replayed" if graphs.stats(workspace)["replayed"] > replays else "eager"
    return f"{_named_then_synchronize(logged)} | {how}"


def _named_then_synchronize(logged: list[str]) -> str:
    """The watchdog's first line (within the 3 s timeout and 5 s more), then how a synchronize
    ended: the context is gone, so it must raise, not hang ("nothing logged" otherwise)."""
    import faulthandler

    deadline = time.monotonic() + 3 + 5
    while not logged and time.monotonic() < deadline:
        time.sleep(0.1)
    if not logged:
        faulthandler.cancel_dump_traceback_later()
        return "nothing logged"
    outcome: list[str] = []

    def sync() -> None:
        try:
            torch.cuda.synchronize()
            outcome.append("returned")
        except Exception as exc:  # noqa: BLE001  (the CUDA error's type varies by release)
            outcome.append(f"raised {type(exc).__name__}")

    waiter = threading.Thread(target=sync, daemon=True)
    waiter.start()
    waiter.join(20)
    faulthandler.cancel_dump_traceback_later()
    return f"{logged[0]} | synchronize {outcome[0] if outcome else 'hung'}"


def peer_skips_queued_calls_cuda(calls: int, path: str) -> str:
    """cuda: the last rank skips; the others make `calls` eager all-gathers of different row
    counts, the first stuck and the rest queued behind it (as a training loop's host runs ahead
    of its GPU). Their opening barriers wait on one flag, each for its own call's signature, and
    their signals on the same channels, so the abort's writes (each flag once) cannot release
    the queue: the watchdog must then end the process, or a synchronize must raise; never a
    hang. What the watchdog logs goes to `path`.RANK too (a process it ended returns nothing),
    after a line "first call N" (the stuck call's number)."""
    import faulthandler
    import logging

    rank, ws, a, b = _fault_setup("cuda")
    torch.cuda.synchronize()
    if rank == ws - 1:
        return "skipped"
    with open(f"{path}.{rank}", "w") as f:
        f.write(f"first call {asynctp.get_workspace(dist.group.WORLD, 'cuda').seq + 1}\n")
    logging.getLogger("asynctp").addHandler(logging.FileHandler(f"{path}.{rank}"))
    logged = _watchdog_log()
    faulthandler.dump_traceback_later(40)
    raised = ""
    try:
        for i in range(calls):  # rows 1, 2, ... per rank: new keys (eager), distinct signatures
            shard = ints((1 + i, 8), rank, torch.float32, "cuda")
            asynctp.all_gather_matmul(shard, [b], 0, dist.group.WORLD, strategy="pipeline")
    except Exception as exc:  # noqa: BLE001  (a launch after the abort raises the CUDA error)
        raised = f" | the calls raised {type(exc).__name__}"
    return _named_then_synchronize(logged) + raised


def killed_rank_cuda() -> dict:
    """cuda: the last rank is SIGKILLed inside an op, after the opening barrier; the others' next
    wait is stuck, and the watchdog must name the op, the rank and the peer before the abort."""
    import os
    import signal

    rank, ws, a, b = _fault_setup("cuda")
    torch.cuda.synchronize()
    logged = _watchdog_log()
    if rank == ws - 1:
        workspace = asynctp.get_workspace(dist.group.WORLD, "cuda")
        real = workspace.barrier

        def barrier_then_die(channel: int = 0, timeout: float | None = None) -> None:
            real(channel, timeout)
            torch.cuda.synchronize()
            os.kill(os.getpid(), signal.SIGKILL)

        workspace.barrier = barrier_then_die
    asynctp.matmul_reduce_scatter(a, b, 0, dist.group.WORLD, strategy="pipeline")
    return dict(logged=_first_line(logged, 3 + 8))
