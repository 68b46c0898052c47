"""A pool of rank processes with a live process group, reused by every test of a module.

Spawning ranks costs seconds; a pool is spawned once per (module, world size) and runs test
functions on all ranks at once. A test function is any module-level function: it is pickled by
reference, runs on every rank, and its return values come back as a list indexed by rank. When a
rank raises, its traceback is re-raised here, prefixed with the rank; when a rank dies, the error
names the rank and its exit code or signal; when ranks hang, the call times out and the pool is
torn down (the next test gets a fresh one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


def _worker(rank: int, world_size: int, backend: str, init_method: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo", call_timeout: float = 240.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.call_timeout = call_timeout
        self._start()

    def _start(self) -> None:
        world_size, backend = self.world_size, self.backend
        self.broken = False
        ctx = mp.get_context("spawn")
        fd, self._store_path = tempfile.mkstemp(prefix="asynctp-test-store-")
        os.close(fd)
        os.unlink(self._store_path)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, f"file://{self._store_path}", self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """fn(*args) on every rank; returns the per-rank results."""
        outcomes = self.run_outcomes(fn, *args, timeout=timeout, tolerate=False)
        return [value for _, value in outcomes]

    def run_outcomes(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, tolerate: bool = True
    ) -> list[tuple[str, Any]]:
        """fn(*args) on every rank; per rank ("ok", value), ("raised", traceback) or ("died", how).
        With tolerate=False a raise or death is re-raised here instead. A death breaks the pool
        (the next call starts a fresh one)."""
        if self.broken:  # an earlier test killed or hung the ranks: start afresh
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        deadline = time.monotonic() + (timeout or self.call_timeout)
        got: dict[int, tuple[str, Any]] = {}
        dead = False
        while len(got) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                got[rank] = ("ok" if ok else "raised", value)
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(self._procs):
                if not p.is_alive() and r not in got:
                    code = p.exitcode
                    how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
                    got[r] = ("died", how)
                    dead = True
                    if not tolerate:
                        self._break()
                        raise RuntimeError(f"{fn.__name__}: rank {r} died ({how})")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(got))
                self._break()
                raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish in time (hang?)")
        if dead:
            self._break()
        failures = [f"--- rank {r} ---\n{v}" for r, (kind, v) in sorted(got.items()) if kind != "ok"]
        if failures and not tolerate:
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} rank(s):\n" + "\n".join(failures))
        return [got[r] for r in range(self.world_size)]

    def _break(self) -> None:
        self.broken = True
        self.close()

    def close(self) -> None:
        if not self.broken:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=10 if not self.broken else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        # a queue whose reader is gone would make this process's exit wait for its feeder thread
        for q in (*self._tasks, self._results):
            q.cancel_join_thread()
            q.close()
        if os.path.exists(self._store_path):
            os.unlink(self._store_path)


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a script this repository runs in a subprocess (benchmarks/*.py, the
    interpreter check): the checkout's asynctp first on the path, wherever asynctp is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
