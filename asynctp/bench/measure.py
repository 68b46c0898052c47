"""One benchmark run on every rank: per op and shape, check results, then time every variant.

Per row, in this order (every rank runs every step; failures are agreed over the group first,
so no rank ever waits in a collective that another rank skipped):

    1. serial's result is the reference; every asynctp strategy must match it (a_gathered
       exactly, outputs within the dtype's tolerance), else the row is reported failed
    2. compute bound, comm bound, serial, each pipelined strategy (eager)
    3. torch.ops.symm_mem's fused op, eager and CUDA-graphed, where this torch can run it
    4. --tune: the fastest eager strategy goes into asynctp's tuning cache (rank 0 decides)
    5. asynctp "auto", eager and CUDA-graphed (after asynctp.reserve)

Times are the slowest rank's median, in microseconds (timing.py).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import asynctp
from asynctp.bench import report
from asynctp.bench.cases import CASES, OpCase, Problem
from asynctp.bench.report import (
    AUTO, AUTO_GRAPH, AUTO_PAIRED, COMM, COMPUTE, MM_PAIRED, SERIAL, SERIAL_PAIRED, TORCH, TORCH_GRAPH,
)
from asynctp.bench.shapes import Shape, shapes_for
from asynctp.symm.rendezvous import exchange
from asynctp.bench.timing import capture_graph, isolated_us, rounds_us, synchronize, time_us
from asynctp.runtime import graphs

__all__ = ["BenchConfig", "DTYPES", "pipelined_strategies", "variant", "environment", "measure_shape", "run_benchmark"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}



@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one `asynctp bench` run measures; identical on every rank."""

    ops: tuple[str, ...]  # registry names (cases.CASES)
    shape_sets: tuple[str, ...]  # shapes.SHAPE_SETS names
    dtype: str = "bfloat16"  # a DTYPES key: the matmul inputs (fp8 ops: the output dtype)
    iters: int = 50  # timed calls per variant (the median is reported)
    warmup: int = 10  # untimed calls before them
    graph: bool = True  # also time CUDA-graphed variants (CUDA only)
    tune: bool = False  # record the fastest eager strategy per shape in the tuning cache
    hardware: str | None = None  # results file tag; None: "<world size>x<GPU name>"
    command: str = ""  # the command line, stored in every row
    seed: int = 0  # input values (every rank draws its own from seed and rank)
    verbose: bool = False  # rank 0 names every step on stderr before it runs
    # instead of the op table: (matmul size, all-gather MB per rank) for asynctp.bench.contention
    contention: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in CASES]
        if not self.ops or unknown:
            raise ValueError(f"ops requires names from {sorted(CASES)}, got {list(self.ops)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype requires one of {list(DTYPES)}, got {self.dtype!r}")
        if self.iters < 1:
            raise ValueError(f"iters requires at least 1, got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"warmup requires a non-negative count, got {self.warmup}")


def pipelined_strategies(case: OpCase) -> list[str]:
    """Every strategy of the op other than "auto" and "serial" (new ones appear by themselves)."""
    return [s for s in case.strategies() if s not in ("auto", "serial")]


def variant(strategy: str) -> str:
    """The times_us key of an eager asynctp strategy."""
    return SERIAL if strategy == "serial" else f"asynctp_{strategy}"


def environment(group: dist.ProcessGroup, device: torch.device, hardware: str | None) -> dict[str, Any]:
    """What every row records about where it ran."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "world_size": group.size(),
        "device": name,
        "hardware": hardware or report.default_hardware(name, group.size()),
        "torch": torch.__version__,
        "triton": triton_version,
        "date": report.today(),
    }


def _describe(exc: BaseException, limit: int = 240) -> str:
    """"Type: first sentence of the message", short enough for a table note."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(text) > limit and ". " in text:
        text = text[: text.index(". ") + 1]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def _agree(group: dist.ProcessGroup, problem: str | None) -> str | None:
    """Every rank learns whether any rank failed (the first failing rank's message)."""
    everyone = exchange(group, "asynctp bench", problem)  # the store: no numpy needed
    for rank, p in enumerate(everyone):
        if p is not None:
            return f"rank {rank}: {p}"
    return None


def _attempt(fn: Callable[[], Any], want: Any, check: Callable[[Any, Any], None]) -> str | None:
    """None if fn runs and its result passes check against want, else why not."""
    try:
        check(fn(), want)
    except Exception as exc:  # noqa: BLE001 - any failure is reported in the row
        return _describe(exc)
    return None


def _check_strategies(problem: Problem, want: Any, strategies: list[str]) -> str | None:
    """The first strategy whose result differs from want. Every strategy runs even after a
    failure: the other ranks are running them too, and their collectives need this rank."""
    failure = None
    for strategy in strategies:
        problem_here = _attempt(lambda: problem.asynctp(strategy), want, problem.check)
        if failure is None and problem_here is not None:
            failure = f"strategy {strategy!r}: {problem_here}"
    return failure


class _Row:
    """The measurements of one row as they are taken (collective methods)."""

    def __init__(self, problem: Problem, cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device):
        self.problem, self.cfg, self.group, self.device = problem, cfg, group, device
        self.times: dict[str, float] = {}
        self.isolated: dict[str, float] = {}  # isolated calls (GPU idle at each call's start)
        self.host: dict[str, float] = {}  # host time per isolated call
        self.skipped: dict[str, str] = {}

    def say(self, what: str) -> None:
        """--verbose: rank 0 names each step before it runs (a hang shows where it is)."""
        if self.cfg.verbose and self.group.rank() == 0:
            print(f"  {what}", file=sys.stderr, flush=True)

    def time(self, key: str, fn: Callable[[], Any]) -> None:
        """times[key] = the slowest rank's median of fn back to back, in microseconds; isolated[key]
        and host[key]: the same for calls that each start on an idle GPU (timing.isolated_us)."""
        self.say(f"timing {key}")
        self.times[key] = round(time_us(fn, self.cfg.iters, self.cfg.warmup, self.group, self.device), 2)
        iso, host = isolated_us(fn, max(5, self.cfg.iters // 4), self.group, self.device)
        self.isolated[key], self.host[key] = round(iso, 2), round(host, 2)

    def time_rounds(self, timed: dict[str, Callable[[], Any]]) -> None:
        """times[key] of each of `timed` from one set of rounds (see timing.rounds_us)."""
        self.say(f"timing {', '.join(timed)} in rounds")
        got = rounds_us(list(timed.values()), self.cfg.iters, self.cfg.warmup, self.group, self.device)
        self.times.update({key: round(t, 2) for key, t in zip(timed, got)})

    def graphed(self, key: str, fn: Callable[[], Any], want: Any) -> None:
        """Time fn captured in a CUDA graph, after checking what a replay computes."""
        if self.device.type != "cuda":
            self.skipped[key] = "CUDA graphs need a CUDA device"
            return
        if not self.cfg.graph:
            self.skipped[key] = "--no-graph"
            return
        replay, outputs, problem = None, None, None
        self.say(f"capturing {key}")
        try:
            replay, outputs = capture_graph(fn, self.device)
            replay()
            synchronize(self.device)
            self.problem.check(outputs, want)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            problem = f"graph: {_describe(exc)}"
        problem = _agree(self.group, problem)
        if problem is not None:
            self.skipped[key] = problem
            return
        self.time(key, replay)


# a strategy replaces serial only if it is at least this much faster. With 3%, at llama70b w13
# (fp8 all-gather, 3 ms a call) the pipeline beat serial by 1.5-3% in
# each of five runs on 2xH200 and was never picked, while auto (serial's code) then timed 0.95-0.99
# of serial in paired rounds: the run-to-run spread of the pair itself. A pick within 1% of
# serial costs at most that much where it is noise
TUNE_MARGIN = 0.01
# two strategies whose blocks lie this close are timed head to head (_tune): a kernel that did not
# change moved 349 / 368 us between two bench runs on one 2xH100 machine (the fused bf16
# all-gather at M 4096), and fp8 rowwise M 4096 read pipelined 193 / fused 197 there
TUNE_CLOSE = 0.05


def _tune(row: _Row, strategies: list[str], world_size: int) -> tuple[str, dict[str, float]]:
    """Record the fastest measured eager strategy for this shape; rank 0 decides for all. The two
    fastest, where their blocks lie within TUNE_CLOSE, are decided head to head in rounds (their
    times returned, else {}): separate blocks of one op spread by about that much."""
    from asynctp.ops import tuning

    times = lambda s: row.times.get(variant(s), float("inf"))  # noqa: E731
    ranked = sorted(strategies, key=times)
    head: dict[str, float] = {}
    if len(ranked) > 1 and times(ranked[1]) <= times(ranked[0]) * (1 + TUNE_CLOSE):
        row.say(f"timing {ranked[0]} and {ranked[1]} head to head")
        got = rounds_us([lambda s=s: row.problem.asynctp(s) for s in ranked[:2]], row.cfg.iters, row.cfg.warmup,
                        row.group, row.device)
        head = {variant(s): round(t, 2) for s, t in zip(ranked, got)}
        if got[1] < got[0]:
            ranked[:2] = ranked[1::-1]
    # a pipelined strategy must beat serial by a margin: run-to-run spread on one machine is a
    # few percent, and a choice that flips on noise could make auto slower than serial
    fastest = ranked[0] if ranked else None
    wins = fastest is not None and times(fastest) < row.times.get(variant("serial"), float("inf")) * (1 - TUNE_MARGIN)
    best = exchange(row.group, "asynctp bench --tune", fastest if wins else "serial")[0]  # rank 0 decides
    tuning.record(row.problem.op, world_size, row.device, row.problem.shape_key, best)
    return best, head


def _auto_choice(problem: Problem, group: dist.ProcessGroup, device: torch.device) -> str:
    """What strategy="auto" runs for this problem: the op's own choice (tuning cache or rule)."""
    from asynctp.ops.strategy import choose

    return choose(problem.op, "auto", group, device, problem.shape_key)[0]


def _header(case: OpCase, shape: Shape, cfg: BenchConfig, env: dict[str, Any]) -> dict[str, Any]:
    return {
        "op": case.name, "shape_set": shape.shape_set, "layer": shape.layer, "shape": shape.dims,
        "m": shape.m, "n": shape.n, "k": shape.k, "num_bs": shape.num_bs, "dtype": cfg.dtype,
        **env, "command": cfg.command, "iters": cfg.iters, "warmup": cfg.warmup, "tuned": cfg.tune,
        "times_us": {}, "skipped": {}, "bound_us": None, "efficiency": {},
        "auto_strategy": None, "tuned_strategy": None, "tune_rounds_us": {}, "auto_vs_serial": None, "error": None,
        "graph_calls": {},
    }


def measure_shape(
    case: OpCase, shape: Shape, cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device,
    env: dict[str, Any],
) -> dict[str, Any]:
    """One result row (collective: every rank calls it with the same arguments)."""
    out = _header(case, shape, cfg, env)
    if cfg.verbose and group.rank() == 0:
        print(f"{case.name} {shape.shape_set} {shape.label}: checking results", file=sys.stderr, flush=True)
    failure = None
    try:
        problem = case.build(shape, DTYPES[cfg.dtype], group, device, cfg.seed)
        want = problem.asynctp("serial")
    except Exception as exc:  # noqa: BLE001 - e.g. a dtype the op does not take: the row says so
        failure = f"building the inputs or the serial reference: {_describe(exc)}"
    failure = _agree(group, failure)
    if failure is not None:
        out["error"] = f"row not timed: {failure}"
        return out
    strategies = pipelined_strategies(case)
    failure = _agree(group, _check_strategies(problem, want, [*strategies, "auto"]))
    if failure is not None:
        out["error"] = f"results differ from serial, row not timed: {failure}"
        return out

    row = _Row(problem, cfg, group, device)
    row.time(COMPUTE, problem.compute_bound)
    row.time(COMM, problem.comm_bound)
    # What "auto" can pick on a group with a workspace is timed first, then auto itself; the
    # send/recv ring and torch's fused ops come last: on 2xH200 host-bound calls timed after
    # them ran up to 2x slower (NCCL P2P connections, torch's own workspace and graph pools),
    # which would make the comparison of auto with serial depend on the order of the row.
    workspace_strategies = [s for s in strategies if s != "ring"]
    # how each asynctp variant's calls went through the graph cache (eager / captured / replayed,
    # and why eager): whether a timing measured replays or eager launches
    calls = out["graph_calls"]
    for strategy in ["serial", *workspace_strategies]:
        _counting(calls, variant(strategy), lambda: row.time(variant(strategy), lambda: problem.asynctp(strategy)))
    if cfg.tune:
        out["tuned_strategy"], out["tune_rounds_us"] = _tune(row, workspace_strategies, group.size())
    auto_failure = _agree(group, _attempt(lambda: problem.asynctp("auto"), want, problem.check))
    if auto_failure is not None:  # only after tuning switched auto to another strategy
        out["error"] = f"auto differs from serial after tuning: {auto_failure}"
    else:
        # auto alone, back to back, as every other column (and torch's) is timed
        _counting(calls, AUTO, lambda: row.time(AUTO, lambda: problem.asynctp("auto")))
        # and against serial and the local matmul in rounds: on host-bound rows the difference of
        # auto and serial is smaller than the machine's drift between two separate timings, and a
        # GPU's clock under sustained load (a power cap: 1545-1980 MHz on 2xH200 during the seed rows)
        # drifts the op's time against its bound (2xH100, fused AG M 8192: 677 us timed alone, 746
        # in the row, with mm only 646 / 610) (the rounds' serial calls counted too: no graphs)
        _counting(calls, AUTO_PAIRED, lambda: row.time_rounds({
            SERIAL_PAIRED: lambda: problem.asynctp("serial"), AUTO_PAIRED: lambda: problem.asynctp("auto"),
            MM_PAIRED: problem.compute_bound}))
        asynctp.reserve(group, problem.workspace_bytes, device)
        row.graphed(AUTO_GRAPH, lambda: problem.asynctp("auto"), want)
    for strategy in [s for s in strategies if s not in workspace_strategies]:
        _counting(calls, variant(strategy), lambda: row.time(variant(strategy), lambda: problem.asynctp(strategy)))

    torch_failure = _agree(group, _attempt(problem.torch_fused, want, problem.check))
    if torch_failure is None:
        row.time(TORCH, problem.torch_fused)
        row.graphed(TORCH_GRAPH, problem.torch_fused, want)
    else:
        row.skipped[TORCH] = row.skipped[TORCH_GRAPH] = torch_failure
    out["auto_strategy"] = _auto_choice(problem, group, device)
    # a variant that could not run is there too, as None (its reason under "skipped")
    out["times_us"] = {**row.times, **{k: None for k in row.skipped if k not in row.times}}
    out["skipped"] = row.skipped
    out["isolated_us"], out["host_us"] = row.isolated, row.host
    report.derive(out)
    return out


def _counting(calls: dict[str, dict[str, int]], key: str, timing: Callable[[], None]) -> None:
    """Run timing(); calls[key]: the graph cache's counts it added (graphs.stats()), non-zero ones."""
    before = graphs.stats()
    timing()
    after = graphs.stats()
    calls[key] = {k: after[k] - before.get(k, 0) for k in after if k != "graphs" and after[k] != before.get(k, 0)}


def run_benchmark(
    cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every row of the run (collective); rank 0 prints each as it completes and passes it to
    on_row (e.g. to save it at once: a run cut short by a hang keeps what it measured)."""
    env = environment(group, device, cfg.hardware)
    chatty = group.rank() == 0
    rows = []
    for name in cfg.ops:
        case = CASES[name]
        reason = case.requires()
        if reason is not None:
            if chatty:
                print(f"asynctp bench: skipping {name}: {reason}", file=sys.stderr, flush=True)
            continue
        for set_name in cfg.shape_sets:
            for shape in shapes_for(set_name, case.kind, group.size()):
                row = measure_shape(case, shape, cfg, group, device, env)
                rows.append(row)
                if chatty:
                    stream = sys.stderr if row["error"] else sys.stdout
                    print(report.progress_line(row), file=stream, flush=True)
                    if on_row is not None:
                        on_row(row)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows
