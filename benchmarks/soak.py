"""Soak: many random calls on CPU ranks (gloo, the cpu backend), a random fault in a fraction of
them; counts silent wrong results, hangs and leaked /dev/shm files or store keys. Writes JSON.

    python benchmarks/soak.py --calls 3000 --fault-rate 0.01 --out benchmarks/results/soak_cpu.json

Every rank draws the same calls (op, shape, dims, dtype, strategy) from one seed; inputs are small
integers, so every result is compared exactly with a reference computed locally. Faults, always on
the last rank: mismatch (different rows, dtype or op), straggler (enters after the timeout),
interrupt (KeyboardInterrupt inside the op), skip (does not make the call; the others' call is
then unpaired and must time out). After a fault every rank meets at a gloo barrier and calls
asynctp.reset. A call that returns on any rank must be exact; a faulted call must raise on the
ranks that took part in it, within twice the timeout, with a message naming a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAULTS = ("mismatch", "straggler", "interrupt", "skip")
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather", "reduce_scatter")
STRATEGIES = ("auto", "serial", "pipeline", "ring")


def _ints(shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, tuple(shape), generator=g).to(dtype)


def _draw(rng: random.Random, world: int) -> dict:
    ndim = rng.choice((2, 3))
    dim = rng.randrange(ndim - 1)  # not the last (K) dim: the references below stay simple
    shape = [rng.choice((1, 2, 3)) for _ in range(ndim - 1)] + [rng.choice((4, 8))]
    shape[dim] = rng.choice((0, 1, 2, 5)) if rng.random() < 0.1 else rng.choice((1, 2, 5, 16, 64))
    return dict(op=rng.choice(OPS), shape=shape, dim=dim, n=rng.choice((3, 6)),
                dtype=rng.choice((torch.float32, torch.float64)), strategy=rng.choice(STRATEGIES),
                reduce_op=rng.choice(("sum", "avg")), seed=rng.randrange(1 << 20))


def _call(spec: dict, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(result, exact reference) of the call `spec` on this rank."""
    import asynctp

    g, op, dim, dtype = dist.group.WORLD, spec["op"], spec["dim"], spec["dtype"]
    shape = list(spec["shape"])
    b = _ints((shape[-1], spec["n"]), spec["seed"], dtype)
    if op in ("all_gather_matmul", "all_gather"):
        shards = [_ints(shape, spec["seed"] + 1 + r, dtype) for r in range(world)]
        full = torch.cat(shards, dim)
        if op == "all_gather":
            return asynctp.all_gather(shards[rank], dim, g), full
        a_g, (o,) = asynctp.all_gather_matmul(shards[rank], [b], dim, g, strategy=spec["strategy"])
        return torch.cat([a_g.flatten(), o.flatten()]), torch.cat([full.flatten(), (full @ b).flatten()])
    shape[dim] *= world
    parts = [_ints(shape, spec["seed"] + 1 + r, dtype) for r in range(world)]
    if op == "reduce_scatter":
        total = sum(parts)
        out = asynctp.reduce_scatter(parts[rank], dim, g, spec["reduce_op"])
    else:
        total = sum(p @ b for p in parts)
        out = asynctp.matmul_reduce_scatter(parts[rank], b, dim, g, reduce_op=spec["reduce_op"],
                                            strategy=spec["strategy"])
    if spec["reduce_op"] == "avg":
        total = total / world
    return out, total.chunk(world, dim)[rank]


def _faulty(spec: dict, fault: str, rng: random.Random) -> dict:
    """The last rank's version of a mismatched call."""
    spec = dict(spec)
    what = rng.choice(("rows", "dtype", "op"))
    if what == "rows":
        spec["shape"] = list(spec["shape"])
        spec["shape"][spec["dim"]] += 1
    elif what == "dtype":
        spec["dtype"] = torch.float32 if spec["dtype"] == torch.float64 else torch.float64
    else:
        spec["op"] = OPS[(OPS.index(spec["op"]) + 1) % len(OPS)]
    return spec


def _interrupt_once(ws) -> None:
    def interrupted(channel: int = 0, timeout: float | None = None) -> None:
        del ws.barrier
        raise KeyboardInterrupt

    ws.barrier = interrupted


def _shm_files(pids: list[int]) -> list[str]:
    from asynctp.symm.cpu import _shm_dir

    prefixes = tuple(f"asynctp-{p}-" for p in pids)
    return sorted(f for f in os.listdir(_shm_dir()) if f.startswith(prefixes))


def _rank_main(rank: int, world: int, init: str, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    import asynctp

    asynctp.configure(timeout=args.timeout)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    store = dist.distributed_c10d._get_default_store()
    keys_before = store.num_keys()
    rng = random.Random(args.seed)
    last = rank == world - 1
    stats = dict(calls=0, returned=0, exact=0, silent_wrong=0, faults={f: 0 for f in FAULTS}, errors={},
                 unclear_errors=0, faulted_call_returned=0, slowest_error_s=0.0, examples={})
    for i in range(args.calls):
        spec = _draw(rng, world)
        fault = rng.choice(FAULTS) if rng.random() < args.fault_rate else None
        mine = spec
        if fault == "mismatch" and last:
            mine = _faulty(spec, fault, rng)
        elif fault == "mismatch":
            _faulty(spec, fault, rng)  # same draws on every rank
        if fault == "interrupt":
            mine = dict(mine, op="all_gather_matmul", strategy="pipeline")
        stats["calls"] += 1
        if fault:
            stats["faults"][fault] += 1
            if args.progress:
                print(f"soak: rank {rank} call {i}: {fault} {spec['op']} {spec['strategy']}", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            if fault == "skip" and last:
                raise StopIteration
            if fault == "straggler" and last:
                time.sleep(args.timeout + 0.3)
            if fault == "interrupt" and last:
                _interrupt_once(asynctp.get_workspace(dist.group.WORLD, "cpu"))
            got, want = _call(mine, rank, world)
            stats["returned"] += 1
            if got.shape == want.shape and torch.equal(got, want.to(got.dtype)):
                stats["exact"] += 1
            else:
                stats["silent_wrong"] += 1
            if fault:
                stats["faulted_call_returned"] += 1
        except StopIteration:
            pass
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - every error is classified
            name = type(exc).__name__
            stats["errors"][name] = stats["errors"].get(name, 0) + 1
            stats["examples"].setdefault(name, str(exc)[:300])
            stats["slowest_error_s"] = max(stats["slowest_error_s"], time.monotonic() - start)
            if name != "KeyboardInterrupt" and "rank" not in str(exc):
                stats["unclear_errors"] += 1
            if not fault:
                stats["errors_unfaulted"] = stats.get("errors_unfaulted", 0) + 1
        if fault:  # (reset also drops a workspace whose patched barrier never fired)
            dist.barrier()
            asynctp.reset(dist.group.WORLD)
        if args.progress and rank == 0 and (i + 1) % args.progress == 0:
            print(f"soak: {i + 1} calls", file=sys.stderr, flush=True)
    asynctp.reset(dist.group.WORLD)  # releases the workspace
    dist.barrier()
    stats["leaked_segments"] = len(_shm_files(pids))
    stats["leaked_store_keys"] = store.num_keys() - keys_before if rank == 0 else 0
    out.put((rank, stats))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    fd, path = tempfile.mkstemp(prefix="asynctp-soak-store-")
    os.close(fd)
    os.unlink(path)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, f"file://{path}", args, out), daemon=True)
             for r in range(args.world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    per_rank, hangs = {}, 0
    deadline = start + args.deadline
    while len(per_rank) < args.world and time.monotonic() < deadline:
        try:
            rank, stats = out.get(timeout=1)
            per_rank[rank] = stats
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting, a dead rank shows below
            if any(not p.is_alive() for p in procs) and out.empty():
                break
    if len(per_rank) < args.world:
        hangs = 1
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if os.path.exists(path):
        os.unlink(path)
    ranks = [per_rank[r] for r in sorted(per_rank)]
    errors: dict[str, int] = {}
    for s in ranks:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return dict(
        calls=args.calls, world_size=args.world, fault_rate=args.fault_rate, timeout_s=args.timeout, seed=args.seed,
        faults_injected=ranks[0]["faults"] if ranks else {}, errors_raised=errors,
        silent_wrong_results=sum(s["silent_wrong"] for s in ranks),
        errors_on_unfaulted_calls=sum(s.get("errors_unfaulted", 0) for s in ranks),
        faulted_calls_that_returned=sum(s["faulted_call_returned"] for s in ranks),
        unclear_errors=sum(s["unclear_errors"] for s in ranks), hangs=hangs,
        leaked_segments=sum(s["leaked_segments"] for s in ranks),
        leaked_store_keys=sum(s["leaked_store_keys"] for s in ranks),
        slowest_error_s=round(max((s["slowest_error_s"] for s in ranks), default=0.0), 2),
        exact_results=sum(s["exact"] for s in ranks), wall_s=round(time.monotonic() - start, 1),
        error_examples=ranks[0]["examples"] if ranks else {},
        torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
        command="python benchmarks/soak.py " + " ".join(sys.argv[1:]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--fault-rate", type=float, default=0.01)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1.0, help="asynctp's timeout in the ranks (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=3600, help="seconds before the run counts as hung")
    parser.add_argument("--progress", type=int, default=0, help="print every N calls (rank 0)")
    parser.add_argument("--out", default="", help="JSON result file ('' : print only)")
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    bad = result["silent_wrong_results"] + result["hangs"] + result["leaked_segments"] + max(0, result["leaked_store_keys"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
