"""GPU kernels of torch.profiler Chrome traces (the demo's `--profile --trace` files), per step,
side by side, and for kernels matching --who the host ops that launched them.

    python benchmarks/trace_kernels.py TRACE.json.gz [TRACE2.json.gz ...] --steps 5 \
        [--top 40] [--who copy elementwise]

The first table: each kernel name's GPU time (ms a step) in each trace, sorted by the largest
difference between the first trace and the others. The second: for kernels whose name holds
a --who word, the chain of host ops (innermost last, with the innermost op's input shapes) that
launched them, ms a step, per trace.

    python benchmarks/trace_kernels.py --skew RANK0.json.gz RANK1.json.gz --steps 5 \
        [--match _rs_mm_kernel _ag_mm_kernel nccl]

--skew: two ranks' traces of one run. Kernels of one name run in the same order on both ranks,
so the n-th call on one is paired with the n-th on the other; both traces' times are on the
host's clock (each trace's baseTimeNanoseconds). A call that starts d before its peer's spends
up to d (at most its duration) waiting for the peer, which the profile counts as kernel time:
"skew" below, per rank, and the rest ("own"). Waits on data in flight with both ranks on time
stay in "own".

    python benchmarks/trace_kernels.py --gaps TRACE.json.gz [...] --steps 10

--gaps: where the GPU had nothing running (no kernel, copy or memset on any stream: idle, or a
stream waiting on a peer's signal), per step, and which activity each gap ended with; best on
`demo --profile-gpu --trace` traces, whose steps stay GPU-bound.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import re


def load_trace(path: str) -> tuple[list[dict], float]:
    """(the trace's events, where its "ts" count from on the host's clock, us: its
    baseTimeNanoseconds, 0 where the times are absolute)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, 0.0
    return data["traceEvents"], data.get("baseTimeNanoseconds", 0) / 1000.0


def skew(path0: str, path1: str, match: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per kernel name holding a `match` word: {"calls": [n0, n1], "us": [each rank's summed
    duration], "skew": [each rank's summed wait for the other's later start]} (us)."""
    def calls(path: str) -> dict[str, list[tuple[float, float]]]:
        """(start on the host's clock, duration) of each matching call, by name, in time order."""
        events, base = load_trace(path)
        by_name: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for e in events:
            if e.get("cat") == "kernel" and e.get("ph") == "X" and any(w in e["name"] for w in match):
                by_name[e["name"]].append((e["ts"] + base, e.get("dur", 0.0)))
        for ks in by_name.values():
            ks.sort()
        return by_name

    c0, c1 = calls(path0), calls(path1)
    out = {}
    for name in sorted(set(c0) | set(c1)):
        a, b = c0.get(name, []), c1.get(name, [])
        waits = [0.0, 0.0]
        for (t0, d0), (t1, d1) in zip(a, b):  # the same program on both ranks: the n-th call with the n-th
            waits[0] += min(max(t1 - t0, 0.0), d0)
            waits[1] += min(max(t0 - t1, 0.0), d1)
        out[name] = {"calls": [len(a), len(b)], "us": [sum(d for _, d in ks) for ks in (a, b)], "skew": waits}
    return out


GAP_US = 5.0  # --gaps: shorter idle stretches are launch jitter between back-to-back activities


def gaps(path: str, min_us: float = GAP_US) -> dict:
    """The GPU's idle gaps (at least min_us) in one trace, on its busiest device: {"span": first
    start to last end, "busy": union of its activities, "gaps": [(us, name of the activity that
    ended the gap, its stream)]} (us)."""
    events, _ = load_trace(path)
    acts = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    if not acts:
        return {"span": 0.0, "busy": 0.0, "gaps": []}
    device = collections.Counter(e.get("pid") for e in acts).most_common(1)[0][0]
    acts = sorted((e for e in acts if e.get("pid") == device), key=lambda e: e["ts"])
    start = end = acts[0]["ts"]
    busy, out = 0.0, []
    for e in acts:  # in start order: a gap is where the next start lies past every end so far
        lo, hi = e["ts"], e["ts"] + e.get("dur", 0.0)
        if lo - end >= min_us:
            out.append((lo - end, e["name"], e.get("tid")))
        busy += max(hi, end) - max(lo, end)
        end = max(end, hi)
    return {"span": end - start, "busy": busy, "gaps": out}


def _short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def summarize(path: str, who: list[str]) -> tuple[dict[str, float], dict[tuple, float]]:
    """(GPU us by kernel name, GPU us by (kernel, launching op chain)) of one trace."""
    events, _ = load_trace(path)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and e.get("ph") == "X"]
    by_name: dict[str, float] = collections.Counter()
    for k in kernels:
        by_name[k["name"]] += k.get("dur", 0.0)
    wanted = [k for k in kernels if any(w in k["name"] for w in who)]
    if not wanted:
        return by_name, {}
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and e.get("ph") == "X" and "args" in e}
    ops_by_tid: dict = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X":
            ops_by_tid[(e.get("pid"), e.get("tid"))].append(e)
    for ops in ops_by_tid.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_tid.items()}
    by_chain: dict[tuple, float] = collections.Counter()
    for k in wanted:
        launch = launches.get(k.get("args", {}).get("correlation"))
        chain: tuple = ("?",)
        if launch is not None:
            tid = (launch.get("pid"), launch.get("tid"))
            ops, st = ops_by_tid.get(tid, []), starts.get(tid, [])
            t = launch["ts"]
            i = bisect.bisect_right(st, t)
            enclosing = [e for e in ops[max(0, i - 400) : i] if e["ts"] + e.get("dur", 0) >= t]
            names = [e["name"] for e in enclosing if not e["name"].startswith("ProfilerStep")]
            inner = enclosing[-1] if enclosing else None
            shapes = inner.get("args", {}).get("Input Dims") if inner else None
            chain = (*[_short(n, 50) for n in names[-4:]], str(shapes)[:80])
        by_chain[(_short(k["name"], 60), chain)] += k.get("dur", 0.0)
    return by_name, by_chain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, default=5, help="profiled steps in each trace")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--who", nargs="*", default=["copy", "elementwise", "Memcpy", "cat"])
    p.add_argument("--skew", action="store_true", help="two ranks' traces of one run: waits for the later rank")
    p.add_argument("--match", nargs="*", default=["_rs_mm_kernel", "_ag_mm_kernel", "nccl"])
    p.add_argument("--gaps", action="store_true", help="the GPU's idle gaps a step, by the activity that ended them")
    args = p.parse_args()
    ms = lambda us: us / args.steps / 1000.0  # noqa: E731
    if args.gaps:
        for t in args.traces:
            g = gaps(t)
            idle = sum(us for us, _, _ in g["gaps"])
            print(f"== {os.path.basename(t)}: ms a step: span {ms(g['span']):.2f}, busy {ms(g['busy']):.2f}, "
                  f"idle {ms(idle):.2f} in {len(g['gaps']) / args.steps:.0f} gaps (>= {GAP_US:.0f} us), "
                  f"{sum(us >= 1000 for us, _, _ in g['gaps']) / args.steps:.1f} of them >= 1 ms")
            by_next: dict = collections.defaultdict(lambda: [0.0, 0, 0.0])
            for us, name, stream in g["gaps"]:
                row = by_next[(_short(name, 80), stream)]
                row[0], row[1], row[2] = row[0] + us, row[1] + 1, max(row[2], us)
            print("   idle ms a step, gaps a step, largest gap us: the activity that ended them (its stream)")
            for (name, stream), (us, n, big) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"   {ms(us):7.2f} {n / args.steps:6.1f} {big:9.0f}  {name} (stream {stream})")
        return
    if args.skew:
        if len(args.traces) != 2:
            p.error(f"--skew requires two traces (rank 0's and rank 1's), got {len(args.traces)}")
        print("ms a step, rank 0 | rank 1: kernel time, of it skew (waiting for the later rank), own")
        for name, r in skew(*args.traces, args.match).items():
            us, wait, (n0, n1) = r["us"], r["skew"], r["calls"]
            cells = [f"{ms(us[i]):7.2f} {ms(wait[i]):6.2f} {ms(us[i] - wait[i]):7.2f}" for i in (0, 1)]
            unpaired = "" if n0 == n1 else f"  (calls {n0} vs {n1}: paired in order)"
            print(f"{cells[0]} | {cells[1]}  {_short(name, 80)}{unpaired}")
        return
    names = [re.sub(r"_rank\d+\.json(\.gz)?$", "", os.path.basename(t).removeprefix("trace_")) for t in args.traces]
    sums = [summarize(t, args.who) for t in args.traces]
    all_names = set().union(*(s[0] for s in sums))
    rows = sorted(all_names, key=lambda n: -max(abs(ms(s[0].get(n, 0)) - ms(sums[0][0].get(n, 0))) for s in sums)
                  - 1e-6 * ms(sums[0][0].get(n, 0)))
    print("ms a step: " + " | ".join(names))
    print("total: " + " | ".join(f"{ms(sum(s[0].values())):.2f}" for s in sums))
    for n in rows[: args.top]:
        print(" | ".join(f"{ms(s[0].get(n, 0)):8.3f}" for s in sums), " ", _short(n, 110))
    for name, (_, chains) in zip(names, sums):
        print(f"\n== launchers in {name} (ms a step, kernel, host op chain innermost last, its input dims)")
        for (kern, chain), us in sorted(chains.items(), key=lambda kv: -kv[1])[:25]:
            print(f"{ms(us):7.3f}  {kern}  <-  {' > '.join(chain)}")


if __name__ == "__main__":
    main()
