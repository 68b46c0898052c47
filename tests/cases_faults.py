"""Rank-side bodies of the fault table: each fault is injected into one call of a live group;
every rank reports what it raised, how long it took, whether the group then refused calls
(out of step), whether a correct call works after asynctp.reset, and this rank's /dev/shm files."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import asynctp
from asynctp.symm import OutOfStepError
from asynctp.symm import cpu as symm_cpu
from tests.cases import ints, world

TIMEOUT = 2.0
G = None  # the group under test: dist.group.WORLD


def _ag(rank: int, rows: int = 4, k: int = 8, dtype=torch.float32, dim: int = 0, strategy: str = "pipeline"):
    a = ints((rows, k), rank, dtype, "cpu")
    return asynctp.all_gather_matmul(a, [ints((k, 6), 1, dtype, "cpu")], dim, dist.group.WORLD, strategy=strategy)


def _rs(rank: int, world_size: int, rows: int = 4, reduce_op: str = "sum", strategy: str = "pipeline"):
    a = ints((rows * world_size, 8), rank, torch.float32, "cpu")
    return asynctp.matmul_reduce_scatter(a, ints((8, 6), 1, torch.float32, "cpu"), 0, dist.group.WORLD,
                                         reduce_op=reduce_op, strategy=strategy)


def _odd(rank: int, world_size: int) -> bool:
    return rank == world_size - 1


# each fault: fn(rank, world_size) makes the faulty call on every rank (or skips it on one)
def _rows(rank, ws):
    return _ag(rank, rows=4 + _odd(rank, ws))


def _k(rank, ws):
    return _ag(rank, k=16 if _odd(rank, ws) else 8)


def _rs_rows(rank, ws):
    return _rs(rank, ws, rows=2 if _odd(rank, ws) else 4)


def _op_kind(rank, ws):
    x = ints((4 * ws, 8), rank, torch.float32, "cpu")
    if _odd(rank, ws):
        return asynctp.reduce_scatter(x, 0, dist.group.WORLD)
    return asynctp.all_gather(x, 0, dist.group.WORLD)


def _dtype(rank, ws):
    return _ag(rank, dtype=torch.float64 if _odd(rank, ws) else torch.float32)


def _gather_dim(rank, ws):
    a = ints((4, 4, 8), rank, torch.float32, "cpu")
    return asynctp.all_gather_matmul(a, [ints((8, 6), 1, torch.float32, "cpu")], 1 if _odd(rank, ws) else 0,
                                     dist.group.WORLD, strategy="pipeline")


def _reduce_op(rank, ws):
    return _rs(rank, ws, reduce_op="avg" if _odd(rank, ws) else "sum")


def _strategy(rank, ws):
    return _ag(rank, strategy="serial" if _odd(rank, ws) else "pipeline")


def _collective_shape(rank, ws):
    return asynctp.all_gather(ints((4 + _odd(rank, ws), 3), rank, torch.float32, "cpu"), 0, dist.group.WORLD)


def _contract_shape(rank, ws):
    from asynctp.ops.all_gather_matmul import all_gather_contract

    rows = 4 + 2 * _odd(rank, ws)
    x = ints((rows, 8), rank, torch.float32, "cpu")
    return all_gather_contract(x, [ints((ws * rows, 5), 2, torch.float32, "cpu")], 0, dist.group.WORLD)


def _fp8_scale(rank, ws):
    from tests.cases_float8 import E4M3, fp8_ints, weight_t

    one = torch.ones(())
    return asynctp.all_gather_scaled_matmul(fp8_ints((4, 16), rank, E4M3, "cpu"), [weight_t(16, 16, 7, E4M3, "cpu")],
                                            one * (1 + _odd(rank, ws)), [one], 0, dist.group.WORLD, strategy="pipeline")


def _skipped(strategy: str) -> Callable:
    def fault(rank, ws):
        if not _odd(rank, ws):
            return _ag(rank, strategy=strategy)
    return fault


def _straggler(rank, ws):
    if _odd(rank, ws):
        time.sleep(TIMEOUT + 0.5)
    return _ag(rank)


def _interrupt(rank, ws):
    if _odd(rank, ws):
        workspace = asynctp.get_workspace(dist.group.WORLD, "cpu")

        def interrupted(channel: int = 0, timeout: float | None = None) -> None:
            del workspace.barrier  # once
            raise KeyboardInterrupt

        workspace.barrier = interrupted
    return _ag(rank)


def _two_threads(rank, ws):
    """A second thread calls while the first is inside an op: it gets a clear error, the first
    call completes."""
    workspace = asynctp.get_workspace(dist.group.WORLD, "cpu")
    inside, release, errors = threading.Event(), threading.Event(), []
    real = workspace.barrier

    def held(channel: int = 0, timeout: float | None = None) -> None:
        del workspace.barrier
        inside.set()
        release.wait(10)
        real(channel, timeout)

    workspace.barrier = held
    first = threading.Thread(target=lambda: _ag(rank))
    first.start()
    inside.wait(10)
    try:
        _ag(rank)
    except ValueError as exc:
        errors.append(exc)
    release.set()
    first.join(20)
    if errors:
        raise errors[0]


FAULTS: dict[str, Callable] = {
    "rows differ": _rows,
    "K differs": _k,
    "reduce-scatter rows differ": _rs_rows,
    "all_gather vs reduce_scatter": _op_kind,
    "dtype differs": _dtype,
    "gather dim differs": _gather_dim,
    "reduce_op differs": _reduce_op,
    "strategy differs": _strategy,
    "all_gather shapes differ": _collective_shape,
    "all_gather_contract shapes differ": _contract_shape,
    "fp8 tensorwise a_scale differs": _fp8_scale,
    "skipped call (pipeline)": _skipped("pipeline"),
    "skipped call (serial)": _skipped("serial"),
    "skipped call (ring)": _skipped("ring"),
    "straggler past the timeout": _straggler,
    "interrupt inside an op": _interrupt,
    "two threads on one group": _two_threads,
}


def shm_files(pids: list[int]) -> list[str]:
    """asynctp's files in the shared-memory directory made by these processes."""
    prefixes = tuple(f"asynctp-{pid}-" for pid in pids)
    return sorted(f for f in os.listdir(symm_cpu._shm_dir()) if f.startswith(prefixes))


def _group_pids() -> list[int]:
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return pids


def _check_usable(rank: int, ws: int) -> None:
    a_g, (o,) = _ag(rank)
    full = torch.cat([ints((4, 8), r, torch.float32, "cpu") for r in range(ws)])
    assert torch.equal(a_g, full) and torch.equal(o, full @ ints((8, 6), 1, torch.float32, "cpu"))
    out = _rs(rank, ws)
    want = sum(ints((4 * ws, 8), r, torch.float32, "cpu") for r in range(ws)) @ ints((8, 6), 1, torch.float32, "cpu")
    assert torch.equal(out, want.chunk(ws)[rank])
    # the collectives too: their first call through the dispatcher takes seconds under load
    x = ints((2 * ws, 3), rank, torch.float32, "cpu")
    assert asynctp.all_gather(x, 0, dist.group.WORLD).shape == (2 * ws * ws, 3)
    assert asynctp.reduce_scatter(x, 0, dist.group.WORLD).shape == (2, 3)


def inject(name: str) -> dict:
    """Run one fault on every rank; the report this rank gives."""
    rank, ws = world()
    asynctp.configure(timeout=TIMEOUT)
    g = dist.group.WORLD
    asynctp.reset(g)
    pids = _group_pids()
    _check_usable(rank, ws)
    before = shm_files(pids)
    start = time.monotonic()
    try:
        FAULTS[name](rank, ws)
        message = "no error"
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the table records what surfaced
        message = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    refused = ""
    if message != "no error":  # the group must now refuse calls at once on this rank
        t0 = time.monotonic()
        try:
            _ag(rank)
        except Exception as exc:  # noqa: BLE001
            refused = f"{type(exc).__name__}: {exc} ({time.monotonic() - t0:.2f} s)"
    dist.barrier()
    asynctp.reset(g)
    _check_usable(rank, ws)
    after = shm_files(pids)
    asynctp.configure(timeout=300)
    return dict(message=message, seconds=seconds, refused=refused, shm_before=before, shm_after=after)


def die(how: str) -> dict:
    """The last rank dies (SIGKILL) inside an op ("mid-op") or while the workspace grows
    ("growth"); the survivors must raise naming it, and leave no file in /dev/shm."""
    rank, ws = world()
    asynctp.configure(timeout=TIMEOUT)
    asynctp.reset(dist.group.WORLD)
    pids = _group_pids()
    _check_usable(rank, ws)
    if _odd(rank, ws):
        workspace = asynctp.get_workspace(dist.group.WORLD, "cpu")
        if how == "mid-op":
            real = workspace.barrier

            def barrier_then_die(channel: int = 0, timeout: float | None = None) -> None:
                real(channel, timeout)
                os.kill(os.getpid(), signal.SIGKILL)

            workspace.barrier = barrier_then_die
        else:
            real_exchange = symm_cpu.exchange

            def die_in_growth(group, op, value, timeout=None, tag=None):
                if tag == "grow":
                    os.kill(os.getpid(), signal.SIGKILL)  # after this rank made its file
                return real_exchange(group, op, value, timeout, tag)

            symm_cpu.exchange = die_in_growth
    start = time.monotonic()
    try:
        _ag(rank, rows=4 if how == "mid-op" else 1 << 16)
        message = "no error"
    except Exception as exc:  # noqa: BLE001
        message = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 5  # the dead rank's file goes once it is reaped
    while shm_files(pids) and time.monotonic() < deadline:
        symm_cpu.reclaim_stale()
        time.sleep(0.1)
    return dict(message=message, seconds=seconds, shm_after=shm_files(pids))


def group_cycles(cycles: int) -> dict:
    """Create, use and destroy a group `cycles` times, half of them under the same name: no
    mapping is left behind, no stale workspace is reused."""
    rank, ws = world()
    asynctp.configure(timeout=30)

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum("asynctp-" in line for line in f)

    counts = []
    for i in range(cycles):
        group = dist.new_group(list(range(ws)), group_desc=f"cycle{i}")
        a_g, _ = asynctp.all_gather_matmul(ints((1 << 12, 8), rank, torch.float32, "cpu"),
                                           [ints((8, 6), 1, torch.float32, "cpu")], 0, group, strategy="pipeline")
        assert a_g.shape == (ws << 12, 8)
        dist.destroy_process_group(group)
        counts.append(mapped())
    # a new group's first call releases the destroyed ones' workspaces
    asynctp.all_gather(ints((2, 2), rank, torch.float32, "cpu"), 0, dist.group.WORLD)
    return dict(mapped=counts, final=mapped(), workspaces=len(asynctp.symm._workspaces))


def zero_sizes() -> list[str]:
    """Zero-size inputs on every strategy and collective give the empty result of the serial
    reference (nothing travels); returns what each call gave."""
    rank, ws = world()
    g = dist.group.WORLD
    b = ints((8, 6), 1, torch.float32, "cpu")
    seen = []
    for strategy in ("auto", "serial", "pipeline", "ring"):
        for shape, dim in (((0, 8), 0), ((3, 0, 8), 1), ((0, 4, 8), 1)):
            a = torch.zeros(shape)
            a_g, (o,) = asynctp.all_gather_matmul(a, [b], dim, g, strategy=strategy)
            want = list(shape)
            want[dim] *= ws
            assert list(a_g.shape) == want and list(o.shape) == want[:-1] + [6], (strategy, shape, a_g.shape, o.shape)
            r = asynctp.matmul_reduce_scatter(a_g, b, dim, g, strategy=strategy)
            assert list(r.shape) == list(shape[:-1]) + [6], (strategy, shape, r.shape)
            seen.append(f"{strategy} {shape}")
    assert asynctp.all_gather(torch.zeros(0, 3), 0, g).shape == (0, 3)
    assert asynctp.reduce_scatter(torch.zeros(0, 3), 0, g).shape == (0, 3)
    assert asynctp.reduce_scatter(torch.zeros(2 * ws, 0), 0, g).shape == (2, 0)
    return seen


def ring_without_workspace(fault: str) -> dict:
    """A group without a workspace (Config.disable_symm): its calls are compared over a ring of
    send/recv before any data moves, on every strategy, and guarded the same way (out of step,
    reset)."""
    import warnings

    rank, ws = world()
    with asynctp.config.override(disable_symm=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-workspace warning
        g = dist.new_group(list(range(ws)))
        b = ints((8, 6), 1, torch.float32, "cpu")
        a = ints((4 + (fault == "rows differ" and _odd(rank, ws)), 8), rank, torch.float32, "cpu")
        strategy = "serial" if (fault == "strategy differs" and _odd(rank, ws)) else "ring"
        asynctp.configure(timeout=TIMEOUT)
        asynctp.all_gather_matmul(ints((4, 8), rank, torch.float32, "cpu"), [b], 0, g, strategy="ring")
        try:
            if fault == "skipped call" and _odd(rank, ws):
                raise StopIteration
            asynctp.all_gather_matmul(a, [b], 0, g, strategy=strategy)
            message = "no error"
        except StopIteration:
            message = "skipped"
            dist.barrier()  # the others' timeout first
        except Exception as exc:  # noqa: BLE001
            message = f"{type(exc).__name__}: {exc}"
        if message != "skipped" and fault == "skipped call":
            dist.barrier()
        ok = ints((4, 8), rank, torch.float32, "cpu")
        try:
            if message == "skipped":
                raise OutOfStepError("(the skipping rank)")
            asynctp.all_gather_matmul(ok, [b], 0, g, strategy="ring")
            refused = ""
        except Exception as exc:  # noqa: BLE001
            refused = f"{type(exc).__name__}: {exc}"
        if fault == "skipped call":  # a send/recv that timed out leaves the group's own state behind
            dist.destroy_process_group(g)
            g = dist.new_group(list(range(ws)))
        else:
            asynctp.reset(g)
        a_g, (o,) = asynctp.all_gather_matmul(ok, [b], 0, g, strategy="ring")
        full = torch.cat([ints((4, 8), r, torch.float32, "cpu") for r in range(ws)])
        assert torch.equal(a_g, full) and torch.equal(o, full @ b)
        dist.destroy_process_group(g)
    asynctp.configure(timeout=300)
    return dict(message=message, refused=refused)
